"""kvserve and llama.cpp on the same GGUF file: greedy agreement and the KL of next-token distributions.

    LLAMA_CPP_LIB_PATH=BIN PYTHONPATH=SDIST python benchmarks/gguf_llamacpp_agreement.py

llama.cpp is read through llama-cpp-python's ctypes bindings (the sdist's `llama_cpp` package, its
dependency `diskcache`) over the libllama.so that benchmarks/peers/build_llamacpp.sh builds. The
prompts are the 20 chat prompts of tests/fixtures/gguf/smollm2_reference.json (the transformers
reference's own), fed as token ids to both engines (no tokenizer in the comparison).

Per kvserve mode (--gguf-activations fp32, int8x2 and int8) and per prompt:
- greedy: 64 tokens from each engine; agreement = identical sequences, and the mean length of the
  common prefix;
- teacher-forced: both engines score the prompt + transformers' greedy continuation; at every position
  KL(kvserve || llama.cpp) of the next-token distributions (full vocabulary), top-1 agreement.
The same numbers for transformers' fp32 logits against kvserve come from the fixture's test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

FIXTURE = (
    Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf" / "smollm2_reference.json"
)


def llamacpp_runs(path: str, cases: list[dict], new_tokens: int, kv: str) -> list[dict]:
    import llama_cpp

    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv]
    model = llama_cpp.Llama(path, n_ctx=512, logits_all=True, n_threads=2, verbose=False,
                            type_k=kv_type, type_v=kv_type)  # fmt: skip
    runs = []
    for case in cases:
        seq = case["prompt_ids"] + case["greedy_ids"]
        model.reset()
        model.eval(seq)
        forced = np.array(model.scores[: len(seq)], dtype=np.float32)
        model.reset()
        model.eval(case["prompt_ids"])
        greedy = []
        for _ in range(new_tokens):
            token = int(np.argmax(model.scores[model.n_tokens - 1]))
            greedy.append(token)
            model.eval([token])
        runs.append({"forced": torch.from_numpy(forced), "greedy": greedy})
    return runs


def kvserve_runs(path: str, cases: list[dict], new_tokens: int, activations: str) -> list[dict]:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM

    llm = LLM(
        path, max_model_len=512, gguf_activations=activations, kv_cache_memory_bytes=256 << 20
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([c["prompt_ids"] for c in cases], params)
    return [
        {"forced": llm.engine.score(c["prompt_ids"] + c["greedy_ids"]).float(),
         "greedy": list(o.outputs[0].token_ids)}
        for c, o in zip(cases, outputs, strict=True)
    ]  # fmt: skip


def compare(ours: list[dict], theirs: list[dict], cases: list[dict]) -> dict:
    kls, top1, same, prefix = [], [], 0, []
    for a, b, case in zip(ours, theirs, cases, strict=True):
        start = len(case["prompt_ids"]) - 1  # positions that predict the continuation
        pa = torch.log_softmax(a["forced"][start:-1], -1)
        pb = torch.log_softmax(b["forced"][start:-1], -1)
        kls.append((pa.exp() * (pa - pb)).sum(-1))
        top1.append((pa.argmax(-1) == pb.argmax(-1)).float())
        same += a["greedy"] == b["greedy"]
        common = next((i for i, (x, y) in enumerate(zip(a["greedy"], b["greedy"], strict=True)) if x != y),
                      len(a["greedy"]))  # fmt: skip
        prefix.append(common)
    kl, agree = torch.cat(kls), torch.cat(top1)
    return {
        "greedy_identical": f"{same}/{len(cases)}",
        "greedy_common_prefix_mean": float(np.mean(prefix)),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(kl.quantile(0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()),
        "positions": int(kl.numel()),
    }


def _identical(runs: list[dict], cases: list[dict]) -> str:
    """How many greedy runs equal transformers' (the fixture's) ids."""
    same = sum(r["greedy"] == c["greedy_ids"] for r, c in zip(runs, cases, strict=True))
    return f"{same}/{len(cases)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the built-in SmolLM2)")
    parser.add_argument("--llamacpp-kv", choices=("f16", "f32"), default="f16",
                        help="llama.cpp's KV cache type (f16: its default)")  # fmt: skip
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/zen3_avx2/gguf_llamacpp_agreement.json"))  # fmt: skip
    args = parser.parse_args()
    if args.model is None:
        from kvserve.models import SMOLLM2, packaged_gguf

        args.model = str(packaged_gguf(SMOLLM2))
    fixture = json.loads(FIXTURE.read_text())
    cases, new_tokens = fixture["cases"], fixture["new_tokens"]
    theirs = llamacpp_runs(args.model, cases, new_tokens, args.llamacpp_kv)
    report = {"model": args.model, "prompts": len(cases), "new_tokens": new_tokens,
              "llama.cpp KV cache": args.llamacpp_kv}  # fmt: skip
    for activations in ("fp32", "int8x2", "int8"):
        ours = kvserve_runs(args.model, cases, new_tokens, activations)
        row = compare(ours, theirs, cases)
        row["greedy_identical_to_transformers"] = _identical(ours, cases)
        report[f"kvserve {activations} activations vs llama.cpp"] = row
        print(activations, json.dumps(row))
    report["llama.cpp greedy identical to transformers"] = _identical(theirs, cases)
    print(report["llama.cpp greedy identical to transformers"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
