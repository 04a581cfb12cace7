"""kvserve and llama.cpp on the same GGUF file, alternated: batch-1 and batch-16 decode, prefill.

    python benchmarks/gguf_vs_llamacpp.py [LLAMA_CPP_BIN_DIR] [--model FILE.gguf] [--rounds 2]

llama.cpp: `llama-bench -p 512 -n 64 -t 2` (prefill pp512, batch-1 decode tg64) and
`llama-batched-bench -npp 64 -ntg 64 -npl 16` (16 sequences decoding at once). kvserve: the offline
engine on the same file, once per --gguf-activations (fp32: the reference products; int8: the
panel kernel with activations rounded to int8 as llama.cpp rounds them; int8x2: the same kernel with
the rounding's remainder rounded again, the default): decode tok/s is batch x 64 new tokens after
64-token prompts (prefill excluded, as llama-batched-bench's S_TG excludes it), prefill a 512-token
prompt's tokens / time to its first token, both from the engine's own request timestamps (decode: from the last request's first token to
the last request's last token, 64 tokens per row). Up to session 1211 decode was batch x 64 /
(time of a 65-token run - time of a 1-token run): with prefix caching on, the 65-token run found the
1-token run's prompts in the cache and skipped the prefill that the subtraction takes away (batch 16
read 2-3.5x too fast), and without it the two runs' prefill noise (seconds at batch 16) landed
whole in a difference of about 3 s (session 1212: +-30% between rounds). The engine runs without prefix
caching. Rounds alternate A B A B; the JSON keeps every round. Without LLAMA_CPP_BIN_DIR only kvserve's
three modes run. The llama.cpp build is
benchmarks/peers/build_llamacpp.sh's (GGML_NATIVE off, its AMX kernels compiled out, CPU repack on);
the JSON's "llama_cpp_build" is the line that script wrote beside the binaries.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path


def kvserve_round(model: str, gguf_activations: str) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM

    llm = LLM(
        model,
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory_bytes=512 << 20,
        gguf_activations=gguf_activations,
        enable_prefix_caching=False,  # every prompt computed (module docstring)
    )
    prompt = list(range(1000, 1064))
    llm.generate([prompt], SamplingParams(max_tokens=4))  # warm-up

    def run(prompts: list[list[int]], max_tokens: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].metrics for o in llm.generate(prompts, params)]

    result = {}
    for batch in (1, 16):
        # decode: from the last request's first token to the last request's last (the engine's
        # own timestamps; every row decodes through that span, as llama-batched-bench's S_TG)
        metrics = run([[t + i for t in prompt] for i in range(batch)], 65)
        span = max(m.finished_time for m in metrics) - max(m.first_token_time for m in metrics)
        result[f"decode_b{batch}_tok_s"] = batch * 64 / span
    long_prompt = [1000 + (i % 5000) for i in range(512)]
    (m,) = run([long_prompt], 1)
    result["prefill_512_tok_s"] = 512 / (m.first_token_time - m.first_scheduled_time)
    return result


def llamacpp_round(bin_dir: Path, model: str) -> dict:
    bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", model, "-p", "512", "-n", "64",
                            "-t", "2", "-r", "1", "-o", "json"], capture_output=True, text=True,
                           check=True)  # fmt: skip
    rows = json.loads(bench.stdout)
    result = {}
    for row in rows:
        key = "prefill_512_tok_s" if row["n_prompt"] else "decode_b1_tok_s"
        result[key] = row["avg_ts"]
    batched = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", model, "-npp", "64",
                              "-ntg", "64", "-npl", "16", "-t", "2", "-c", "4096"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    # the table's row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in batched.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == "16" and re.match(r"^[\d.]+$", cells[7]):
            result["decode_b16_tok_s"] = float(cells[7])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bin_dir", type=Path, nargs="?", help="llama.cpp's binaries (optional)")
    parser.add_argument("--model", default=None, help="GGUF file (default: the built-in SmolLM2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--modes",
        default="fp32,int8x2,int8",
        help="kvserve's --gguf-activations to run, in this order each round (default: all three)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/gguf_vs_llamacpp.json")
    )
    args = parser.parse_args()
    if args.model is None:
        from kvserve.models import SMOLLM2, packaged_gguf

        args.model = str(packaged_gguf(SMOLLM2))
    rounds = []
    for i in range(args.rounds):
        modes = args.modes.split(",")
        row = {"round": i}
        for k, mode in enumerate(modes):
            row[f"kvserve {mode} activations"] = kvserve_round(args.model, mode)
            if k == 0 and args.bin_dir is not None:  # llama.cpp between kvserve's modes
                row["llama.cpp"] = llamacpp_round(args.bin_dir, args.model)
        rounds.append(row)
        print(json.dumps(rounds[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build = None if args.bin_dir is None else args.bin_dir / "kvserve-build.txt"
    build_line = (
        "not run"
        if build is None
        else build.read_text().strip()
        if build.is_file()
        else "unknown (not built by benchmarks/peers)"
    )
    args.out.write_text(
        json.dumps({"model": args.model, "llama_cpp_build": build_line, "rounds": rounds}, indent=1)
    )


if __name__ == "__main__":
    main()
