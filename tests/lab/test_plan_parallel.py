"""Planning over more than one device (docs/parallel.md) against hand-computed bytes and times."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.cli import plan as plan_cli
from kvserve.lab.plan import get_profile, load_model, make_plan, parse_weight_format
from kvserve.lab.plan.model import ModelSpec, PlanError
from kvserve.lab.plan.parallel import (
    INTERCONNECTS,
    Interconnect,
    Parallelism,
    TensorParallelComm,
    allreduce_bytes_per_rank,
    get_interconnect,
    kv_heads_per_rank,
    shard_model,
)
from kvserve.lab.plan.planner import Workload

# d=64, L=2, n_q=4, n_kv=2, d_h=16, f=128, V=100 (tests/lab/test_plan.py's TINY): 80,448 parameters
# tied, of which norms 2 L d + d = 320.
TINY = ModelSpec("tiny", 64, 2, 4, 2, 16, 128, 100, True, 512)
LINK = Interconnect("test link", 1e9, 1e-6)


def test_shard_of_two_ranks_by_hand():
    rank = shard_model(TINY, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.vocab_size) == (
        2,
        1,
        64,
        50,
    )
    # per block: q,o 2*64*32 = 4096; k,v 2*64*16 = 2048; MLP 3*64*64 = 12288; norms 128 -> 18,560
    # 2 blocks 37,120 + final norm 64 + embedding 50*64 = 3,200 -> 40,384
    assert rank.num_params == 40_384 == (80_448 - 320) // 2 + 320  # norms replicated
    assert shard_model(TINY, 1) is TINY


def test_kv_heads_split_or_replicated():
    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(8, 8) == 1
    assert kv_heads_per_rank(2, 4) == 1  # replicated twice
    with pytest.raises(PlanError, match="KV heads"):
        kv_heads_per_rank(4, 3)
    with pytest.raises(PlanError, match="attention heads"):
        shard_model(TINY, 3)
    # 4 ranks over 2 KV heads: each rank holds one KV head, so KV bytes per device are k / 2
    p = make_plan(TINY, get_profile("h100-sxm"), "bf16", parallel=Parallelism(4, 1, LINK))
    assert p.parallel.kv_heads_replicated and p.parallel.num_kv_heads_per_rank == 1
    assert p.parallel.kv_bytes_per_token_total == 2 * 2 * 2 * 16 * 2 == 256
    assert p.kv_bytes_per_token == p.parallel.kv_bytes_per_token_per_device == 128


def test_allreduce_bytes_by_hand():
    # ring: 2 (N-1)/N x M per rank
    assert allreduce_bytes_per_rank(2, 1000) == 1000
    assert allreduce_bytes_per_rank(8, 1000) == 1750
    # per token and layer: 2 x 2 (N-1)/N x d x b
    assert TensorParallelComm(TINY, 2, LINK).layer_bytes_per_token() == 2 * 2 * 0.5 * 64 * 2 == 256
    assert TensorParallelComm(TINY, 4, LINK).layer_bytes_per_token() == 2 * 2 * 0.75 * 128 == 384
    # one decode token, TP 2: layers 2 x 256 = 512, embedding all-reduce 2 x 1/2 x 128 = 128,
    # logits gather 1/2 x 100 x 2 = 100
    assert TensorParallelComm(TINY, 2, LINK).step_bytes(1, 1) == 740
    assert TensorParallelComm(TINY, 1, LINK).step_bytes(1, 1) == 0


def test_step_time_by_hand():
    comm = TensorParallelComm(TINY, 2, LINK)
    assert comm.num_allreduces_per_step == 2 * 2 + 1
    # 10 tokens, all sampled: message 10 x 64 x 2 = 1,280 B
    # each all-reduce 2 x 1/2 x 1280 / 1e9 + 2 x 1 x 1 us = 3.28 us; five of them 16.4 us
    # gather of 10 x 100 x 2 = 2,000 B logits: 1/2 x 2000 / 1e9 + 1 x 1 us = 2 us
    assert comm.step_s(10, 10) == pytest.approx(18.4e-6, rel=1e-12)
    assert TensorParallelComm(TINY, 1, LINK).step_s(10, 10) == 0


LLAMA_70B = load_model("Llama-3.1-70B")
H100 = get_profile("h100-sxm")
NVLINK = INTERCONNECTS["nvlink4"]


def test_llama_70b_on_8_h100_by_hand():
    p = make_plan(LLAMA_70B, H100, "bf16", parallel=Parallelism(8, 1, NVLINK))
    par = p.parallel
    assert par.allreduce_bytes_per_layer_per_token == 2 * 2 * 7 / 8 * 8192 * 2 == 57_344
    # one rank: q 1024 x 8192, k and v 128 x 8192 each, o 8192 x 1024, gate/up 3584 x 8192,
    # down 8192 x 3584, 2 norms -> 106,971,136 per layer; x 80; final norm 8192;
    # embedding and head 2 x 16,032 x 8192
    rank_params = 80 * 106_971_136 + 8192 + 2 * 16_032 * 8192
    assert par.weight_bytes_per_device == 2 * rank_params == 17_640_734_720
    assert par.weight_bytes_total == 2 * 70_553_706_496
    assert par.kv_bytes_per_token_per_device == 2 * 80 * 1 * 128 * 2 == 40_960
    # TPOT solo = (W + k t) / BW + 161 all-reduces of 16 kB + the gather of 128,256 bf16 logits
    t = 2000 + 500 / 2
    memory_s = (17_640_734_720 + 40_960 * t) / (3350e9 * 0.8)
    allreduce_s = 2 * 7 / 8 * 16_384 / 450e9 + 2 * 7 * 1e-6
    gather_s = 7 / 8 * 128_256 * 2 / 450e9 + 7 * 1e-6
    assert par.decode_comm_s_solo == pytest.approx(161 * allreduce_s + gather_s, rel=1e-12)
    assert p.latency.tpot_solo_s == pytest.approx(memory_s + 161 * allreduce_s + gather_s)
    assert p.latency.solo_bound == "memory"
    # capacity: (80 GB - W - 2 GB) / (k x 2500 tokens), per device = per replica
    assert p.max_concurrent == int((80e9 - 17_640_734_720 - 2e9) // (40_960 * 2500)) == 589
    # one H100 cannot hold it at all
    single = make_plan(LLAMA_70B, H100, "bf16")
    assert single.max_concurrent == 0 and single.load is None


def test_quantised_linears_shard_exactly():
    """int4-g128 linears: column-parallel rows and row-parallel input columns (1024, 3584 are
    multiples of 128) split their groups exactly, so 8 ranks hold the whole model's linear bytes."""
    fmt = parse_weight_format("int4-g128")
    rank = shard_model(LLAMA_70B, 8)
    whole = fmt.bytes_by_category(LLAMA_70B)["linear"]
    assert 8 * fmt.bytes_by_category(rank)["linear"] == pytest.approx(whole, rel=1e-12)


def test_data_parallel_adds_capacity_not_latency():
    model = load_model("Llama-3.1-8B")
    one = make_plan(model, H100, "bf16", parallel=Parallelism(1, 1, NVLINK))
    four = make_plan(model, H100, "bf16", parallel=Parallelism(1, 4, NVLINK))
    plain = make_plan(model, H100, "bf16")
    assert one.latency == plain.latency == four.latency  # TP 1 has no communication
    assert four.parallel.max_concurrent_total == 4 * plain.max_concurrent
    assert four.parallel.full_load_output_tokens_per_s_total == pytest.approx(
        4 * plain.load.output_tokens_per_s
    )
    assert four.cost.num_devices == 4  # replicas fixed by --data-parallel
    assert four.cost.utilisation == pytest.approx(plain.cost.busy_hours_per_day / (24 * 4))


def test_tensor_parallel_price_and_latency_tradeoff():
    model = load_model("Llama-3.1-8B")
    w = Workload(prompt_tokens=2000, output_tokens=500)
    tp1 = make_plan(model, H100, "bf16", workload=w)
    tp8 = make_plan(model, H100, "bf16", workload=w, parallel=Parallelism(8, 1, NVLINK))
    assert tp8.cost.usd_per_hour == 8 * tp1.cost.usd_per_hour
    assert tp8.cost.devices_per_replica == 8
    assert tp8.latency.tpot_solo_s < tp1.latency.tpot_solo_s  # 1/8 of the weights per step ...
    assert tp8.latency.tpot_solo_s > tp1.latency.tpot_solo_s / 8  # ... plus the all-reduces
    # over 10 GbE the same split is slower than one device
    slow = make_plan(
        model, H100, "bf16", parallel=Parallelism(8, 1, get_interconnect("ethernet-10g"))
    )
    assert slow.latency.tpot_solo_s > tp1.latency.tpot_solo_s


def run_plan(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_tensor_parallel_text_and_json(capsys):
    argv = ["Llama-3.1-70B", "--hardware", "h100-sxm", "--tensor-parallel", "8"]
    rc, out, _ = run_plan(argv, capsys)
    assert rc == 0
    assert "on 8 x H100 SXM (TP 8 x DP 1)" in out
    assert "2 x 2 x 7/8 x 8192 x 2 = 57,344 B per rank" in out
    assert "1 replica(s) x 8 devices" in out
    rc, out, _ = run_plan(argv + ["--json", "--link-latency-us", "0"], capsys)
    data = json.loads(out)
    assert data["parallel"]["weight_bytes_per_device"] == 17_640_734_720
    assert data["parallel"]["interconnect"]["latency_s"] == 0
    # no latency: each all-reduce is bandwidth only
    expected = 161 * 2 * 7 / 8 * 16_384 / 450e9 + 7 / 8 * 128_256 * 2 / 450e9
    assert data["parallel"]["decode_comm_s_solo"] == pytest.approx(expected, rel=1e-12)


def test_link_delay_is_paid_twice_per_ring_step(capsys):
    """--link-delay-us D prices a ring step at the software's latency + 2 D (gloo's ready notice, then
    the data: docs/parallel.md measured it on a delayed link); a negative delay is refused."""
    argv = ["SmolLM2-135M", "--hardware", "h100-sxm", "--tensor-parallel", "3", "--json",
            "--interconnect", "ethernet-10g", "--link-latency-us", "900"]  # fmt: skip
    _, delayed, _ = run_plan(argv + ["--link-delay-us", "500"], capsys)
    _, folded, _ = run_plan(argv[:-1] + ["1900"], capsys)
    a, b = json.loads(delayed)["parallel"], json.loads(folded)["parallel"]
    assert a["interconnect"]["latency_s"] == pytest.approx(1900e-6, rel=1e-12)
    assert a["decode_comm_s_solo"] == pytest.approx(b["decode_comm_s_solo"], rel=1e-12)
    _, bare, _ = run_plan(argv, capsys)
    assert json.loads(bare)["parallel"]["decode_comm_s_solo"] < a["decode_comm_s_solo"]
    rc, _, err = run_plan(argv + ["--link-delay-us", "-1"], capsys)
    assert rc != 0 and "a delay is >= 0" in err


def test_cli_without_parallel_flags_has_no_parallel_section(capsys):
    rc, out, _ = run_plan(["SmolLM2-135M", "--json"], capsys)
    assert rc == 0 and json.loads(out)["parallel"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tensor-parallel", "3"], "must divide"),
        (["--interconnect", "carrier-pigeon"], "unknown interconnect"),
        (["--data-parallel", "0"], "must be >= 1"),
    ],
)
def test_cli_bad_parallel_input(capsys, argv, message):
    rc, _, err = run_plan(["Llama-3.1-70B", *argv], capsys)
    assert rc == 2 and message in err


def test_a_remote_core_adds_two_messages_to_ttft_and_e2e_not_to_tpot():
    model = load_model("Llama-3.1-8B")
    local = make_plan(model, H100, "bf16", parallel=Parallelism(1, 2, NVLINK))
    remote = make_plan(model, H100, "bf16", parallel=Parallelism(1, 2, NVLINK, 250e-6))
    a, b = local.latency, remote.latency
    assert b.ttft_cold_s - a.ttft_cold_s == pytest.approx(500e-6, rel=1e-9)
    assert b.ttft_cached_s - a.ttft_cached_s == pytest.approx(500e-6, rel=1e-9)
    assert b.e2e_solo_s - a.e2e_solo_s == pytest.approx(500e-6, rel=1e-9)
    assert (b.tpot_solo_s, b.tpot_max_batch_s) == (a.tpot_solo_s, a.tpot_max_batch_s)
    assert any("engine cores on other hosts" in n for n in remote.notes)


def test_cli_remote_core_latency(capsys):
    argv = ["SmolLM2-135M", "--hardware", "h100-sxm", "--json"]
    _, out, _ = run_plan(argv, capsys)
    _, remote_out, _ = run_plan([*argv, "--remote-core-latency-us", "150"], capsys)
    local, remote = json.loads(out), json.loads(remote_out)
    assert local["parallel"] is None and remote["parallel"]["data_parallel"] == 1
    gained = remote["latency"]["ttft_cold_s"] - local["latency"]["ttft_cold_s"]
    assert gained == pytest.approx(300e-6, rel=1e-9)
    rc, _, err = run_plan([*argv, "--remote-core-latency-us", "-1"], capsys)
    assert rc == 2 and "message time must be >= 0" in err
