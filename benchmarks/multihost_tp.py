"""Tensor parallelism across two hosts: collective and decode-step times per link setting, measured
against the planner's all-reduce formula (kvserve.lab.plan.parallel; docs/parallel.md "Across hosts").

The two hosts are network namespaces joined by a veth pair (tests/netns.py; needs root). For each
setting, netem shapes both ends of the veth (so each direction has the delay and the rate):

  none           the bare veth
  0.2ms-10gbit   tc qdisc add dev VETH root netem delay 0.2ms rate 10gbit
  1ms-1gbit      tc qdisc add dev VETH root netem delay 1ms rate 1gbit

each host pinned to one core of the machine (taskset), and the script measures (1) a bare gloo all-reduce between one rank in each namespace (median of
50 after 5 warm-up) at three message sizes, and (2) decode steps of the engine at TP = 2, node 0
(`LLM(..., nnodes=2)`) in one namespace and `kvserve tp-node` in the other, at batch 1 and 8
(median of 12 steps after 3 warm-up; "collectives" is the time rank 0 spends inside them). The
model is a random SmolLM2-135M-shaped Llama (d 576, 30 layers, 6 heads of 96, 2 KV heads, FFN 1536,
vocab 50257; fp32), so a step runs 61 all-reduces and one logits gather.

Planned: `allreduce_s` / `TensorParallelComm.step_s` with the netem setting as the link (latency per
ring step = the one-way delay, bandwidth = the rate), plus, in the "+ base" column, what the same
collective measured on the bare veth (the software's own cost, which the formula does not model).

  sudo python benchmarks/multihost_tp.py --out benchmarks/results/zen3_avx2/multihost_tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {"none": None, "0.2ms-10gbit": (0.2, 10.0), "1ms-1gbit": (1.0, 1.0)}
MODEL_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=6, num_key_value_heads=2,
    head_dim=96, intermediate_size=1536, max_position_embeddings=2048,
)  # fmt: skip
VOCAB = 50257
MESSAGE_ROWS = (1, 8, 64)  # all-reduce messages of [rows, 576] fp32: 2.3 kB, 18 kB, 147 kB
ENGINE = dict(num_blocks=256, block_size=16, max_model_len=512)
SECRET = "multihost-benchmark-secret-0123456789"
TIMEOUT_S = 300


# --- inside a namespace -----------------------------------------------------------------------


def collective_rank(rank: int, address: str, store: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.links import gloo_environment, listen

    os.environ.update(gloo_environment(address))
    torch.set_num_threads(1)
    host, port = store.rsplit(":", 1)
    if rank == 0:
        sock = listen(host, int(port))
        tcp = dist.TCPStore(host, int(port), 2, True, timedelta(seconds=60),
                            wait_for_workers=False, master_listen_fd=sock.detach())  # fmt: skip
    else:
        tcp = dist.TCPStore(host, int(port), 2, False, timedelta(seconds=60))
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=2)
    results = []
    for rows in MESSAGE_ROWS:
        tensor = torch.ones(rows, MODEL_SHAPE["hidden_size"])
        times = []
        for i in range(55):
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        results.append(
            {"rows": rows, "bytes": tensor.numel() * 4, "ms_median": statistics.median(times) * 1e3}
        )
    # the engine's logits gather onto rank 0 at B = 8: each rank's [8, ceil(V / 2)] fp32 shard
    shard = torch.ones(8, -(-VOCAB // 2))
    shards = [torch.empty_like(shard) for _ in range(2)] if rank == 0 else None
    times = []
    for i in range(23):
        t0 = time.perf_counter()
        dist.gather(shard, shards, dst=0)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    results.append({"op": "gather", "rows": 8, "bytes": shard.numel() * 4 * 2,
                    "ms_median": statistics.median(times) * 1e3})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(results))


def engine_node0(model: str, addr: str | None, out: Path) -> None:
    from benchmarks.tensor_parallel_engine import decode_run, timed_collectives
    from kvserve import LLM

    totals = {"comm_s": 0.0, "num_collectives": 0}
    timed_collectives(totals)
    layout = {}
    if addr is not None:
        layout = dict(tensor_parallel_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
    llm = LLM(model, **ENGINE, **layout)
    runs = [decode_run(llm, batch, 64, 12, 3, totals) for batch in (1, 8)]
    llm.engine.shutdown()
    out.write_text(json.dumps(runs))


# --- the orchestration (root, outside the namespaces) -------------------------------------------


def _python(*argv: str, cpu: int = 0) -> list[str]:
    """Python pinned to one CPU: each emulated host gets one core of the machine."""
    return ["taskset", "-c", str(cpu), sys.executable, *argv]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "KVSERVE_DIST_SECRET": SECRET}  # fmt: skip


def _run_pair(first: list[str], second: list[str]) -> None:
    """Run two commands at once; both must succeed within TIMEOUT_S."""
    procs = [subprocess.Popen(cmd, env=_env(), stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in (first, second)]  # fmt: skip
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{proc.args[:8]} failed:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)


def _rate_only(setting):
    """What the link is when only the rate could be shaped (tbf): no added delay."""
    return None if setting is None else (0.0, setting[1])


def planned(setting, model_dir: Path) -> dict:
    from kvserve.lab.plan.model import from_hf_config
    from kvserve.lab.plan.parallel import Interconnect, TensorParallelComm, allreduce_s

    if setting is None:
        return {}
    delay_ms, rate_gbit = setting
    link = Interconnect("netem", rate_gbit * 1e9 / 8, delay_ms * 1e-3)
    spec = from_hf_config(json.loads((model_dir / "config.json").read_text()), "smol-shaped")
    comm = TensorParallelComm(spec, 2, link, activation_bytes=4.0)
    result = {"allreduce_ms": {}, "step_comm_ms": {}}
    for rows in MESSAGE_ROWS:
        result["allreduce_ms"][rows] = allreduce_s(2, rows * spec.hidden_size * 4, link) * 1e3
    for batch in (1, 8):
        result["step_comm_ms"][batch] = comm.step_s(batch, batch) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--role", choices=("collective", "engine"), default=None)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--address", default="")
    parser.add_argument("--store", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--addr", default=None)
    args = parser.parse_args()
    if args.table:
        return print(render_table(json.loads(args.out.read_text())))
    if args.role == "collective":
        return collective_rank(args.rank, args.address, args.store, args.out)
    if args.role == "engine":
        return engine_node0(args.model, args.addr, args.out)

    from tests.checkpoints import build_checkpoint
    from tests.netns import two_hosts

    work = Path(tempfile.mkdtemp(prefix="kvserve-multihost-"))
    model_dir = work / "smol-shaped"
    build_checkpoint(model_dir, "llama_tied", vocab_size=50257, **MODEL_SHAPE)
    script = str(Path(__file__).resolve())
    engine_flags = ["--num-blocks", "256", "--block-size", "16", "--max-model-len", "512"]
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "model": MODEL_SHAPE | {"vocab_size": 50257, "dtype": "float32"},
              "settings": {}}  # fmt: skip
    with two_hosts() as (a, b):
        tp1 = work / "tp1.json"
        subprocess.run(a.command(*_python(script, "--out", str(tp1), "--role", "engine",
                                          "--model", str(model_dir))),
                       env=_env(), check=True, timeout=TIMEOUT_S)  # fmt: skip
        report["tp1"] = json.loads(tp1.read_text())
        for port, (name, setting) in enumerate(SETTINGS.items(), start=29600):
            shaping = "none"
            for host in (a, b):
                if setting is None:
                    host.clear_netem()
                else:
                    shaping = host.netem(*setting)
            coll = work / f"coll-{name}.json"
            store = f"{a.address}:{port}"
            _run_pair(
                a.command(*_python(script, "--out", str(coll), "--role", "collective", "--rank",
                                   "0", "--address", a.address, "--store", store)),
                b.command(*_python(script, "--out", str(coll), "--role", "collective", "--rank",
                                   "1", "--address", b.address, "--store", store, cpu=1)),
            )  # fmt: skip
            eng = work / f"engine-{name}.json"
            addr = f"{a.address}:{port + 50}"
            _run_pair(
                a.command(*_python(script, "--out", str(eng), "--role", "engine", "--model",
                                   str(model_dir), "--addr", addr)),
                b.command(*_python("-m", "kvserve", "tp-node", str(model_dir), *engine_flags,
                                   "--tensor-parallel-size", "2", "--nnodes", "2",
                                   "--node-rank", "1", "--dist-init-addr", addr, cpu=1)),
            )  # fmt: skip
            entry = {
                "netem": None
                if setting is None
                else {"delay_ms": setting[0], "rate_gbit": setting[1]},
                "allreduce": json.loads(coll.read_text()),
                "engine": json.loads(eng.read_text()),
                "shaping": shaping,
                "load_average": os.getloadavg(),
                "planned": planned(
                    setting if shaping.startswith("netem") else _rate_only(setting), model_dir
                ),
            }
            report["settings"][name] = entry
            print(json.dumps({name: {k: entry[k] for k in ("allreduce", "planned")}}), flush=True)
        a.clear_netem()
        b.clear_netem()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(render_table(report))


def render_table(report: dict) -> str:
    """The markdown table of docs/parallel.md from the report."""
    bare = report["settings"]["none"]
    lines = [
        "| link (each direction) | all-reduce 2.3 / 18 / 147 kB: measured | planned | planned + bare "
        "| decode step B=1 / B=8 | collectives per step: measured | planned | planned + bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tp1 = report["tp1"]
    for name, entry in report["settings"].items():
        ar = [r["ms_median"] for r in entry["allreduce"] if "op" not in r]
        steps = [r["step_ms_median"] for r in entry["engine"]]
        comm = [r["comm_ms_per_step"] for r in entry["engine"]]
        plan = entry["planned"]
        if plan:
            p_ar = [plan["allreduce_ms"][str(r)] if str(r) in plan["allreduce_ms"]
                    else plan["allreduce_ms"][r] for r in MESSAGE_ROWS]  # fmt: skip
            p_st = [plan["step_comm_ms"].get(str(b), plan["step_comm_ms"].get(b)) for b in (1, 8)]
            base_ar = [r["ms_median"] for r in bare["allreduce"] if "op" not in r]
            base_st = [r["comm_ms_per_step"] for r in bare["engine"]]
            plus_ar = [p + q for p, q in zip(p_ar, base_ar, strict=True)]
            plus_st = [p + q for p, q in zip(p_st, base_st, strict=True)]
        else:
            p_ar = p_st = plus_ar = plus_st = None

        def fmt(values):
            return " / ".join(f"{v:.2f}" for v in values) + " ms" if values else "-"

        lines.append(
            f"| {name} | {fmt(ar)} | {fmt(p_ar)} | {fmt(plus_ar)} | {fmt(steps)} | {fmt(comm)} "
            f"| {fmt(p_st)} | {fmt(plus_st)} |"
        )
    lines.append(
        f"| TP=1, one namespace | - | - | - | {fmt([r['step_ms_median'] for r in tp1])} | - | - | - |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
