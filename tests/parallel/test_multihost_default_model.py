"""The real default model (SmolLM2-135M-Instruct, the Q4_1 GGUF file) tensor-parallel across three
hosts (docs/parallel.md, "Across hosts").

Its 9 query heads and 3 KV heads split 3 ways (3 heads and one KV head per rank), not 2. The hosts
are three network namespaces on one bridge (tests/netns.py `hosts(3)`, always deleted): node 0 runs
`kvserve generate` in the first, `kvserve tp-node` runs one rank in each of the others, and every
all-reduce crosses the bridge. Every rank dequantises the file's blocks to fp32 and takes its slices.
Oracles: the same file at TP = 1 in this process (its blocks times fp32 activations) and transformers
reading the file (`gguf_file=`); greedy token ids must be equal.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.core.errors import ModelLoadError
from tests.netns import NetnsUnavailable, hosts
from tests.oracle import assert_same_tokens
from tests.parallel.test_multihost_tp import ENGINE, _env, _finish, _kill, _kvserve, _start

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 12
TP = 3


@pytest.fixture(scope="module")
def gguf_file():
    from kvserve.models import SMOLLM2, packaged_gguf

    try:
        return packaged_gguf(SMOLLM2)
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def three_hosts():
    try:
        with hosts(TP) as trio:
            yield trio
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")


def _layout(addr: str, node_rank: int) -> list[str]:
    return ["--tensor-parallel-size", str(TP), "--nnodes", str(TP), "--node-rank", str(node_rank),
            "--dist-init-addr", addr, "--dist-timeout", "60"]  # fmt: skip


def _generate_argv(model: str) -> list[str]:
    argv = ["generate", "--model", model, *ENGINE, "--max-tokens", str(MAX_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    return [*argv, "--json", "--ignore-eos"]


def _transformers_greedy(ref, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = ref.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.logits)


def test_default_model_tp3_across_three_namespaces_equals_tp1_and_transformers(
    gguf_file, three_hosts
):
    from kvserve import LLM, SamplingParams

    model = str(gguf_file)
    addr = f"{three_hosts[0].address}:29521"
    env = _env()
    followers = [
        _start(host.command(*_kvserve("tp-node", model, *ENGINE, *_layout(addr, rank))), env)
        for rank, host in enumerate(three_hosts[1:], start=1)
    ]
    try:
        leader = _start(
            three_hosts[0].command(*_kvserve(*_generate_argv(model), *_layout(addr, 0))), env
        )
        out, err = _finish(leader, 240)
        assert leader.returncode == 0, err[-3000:]
        for rank, follower in enumerate(followers, start=1):
            _, follower_err = _finish(follower, 60)
            assert follower.returncode == 0, follower_err[-3000:]
            assert f"rank {rank} loaded" in follower_err
    finally:
        for follower in followers:
            _kill(follower)
    got = [json.loads(line)["token_ids"] for line in out.splitlines()]

    llm = LLM(model, num_blocks=256, block_size=16, max_model_len=1024, gguf_activations="fp32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = llm.generate(PROMPTS, params)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    for i, (tokens, w) in enumerate(zip(got, want, strict=True)):
        hf_tokens, hf_logits = _transformers_greedy(ref, list(w.prompt_token_ids))
        assert_same_tokens(list(w.outputs[0].token_ids), hf_tokens, hf_logits, f"TP=1 vs HF {i}")
        assert_same_tokens(tokens, hf_tokens, hf_logits, f"TP=3 across hosts vs HF {i}")
