"""Decode speed beside llama.cpp, the strongest CPU peer: the same fp32 weights, the same threads.

llama.cpp is not a dependency: build its `llama-bench` and `llama-batched-bench` yourself and convert the
checkpoint with its `convert_hf_to_gguf.py --outtype f32`; pass the paths. Weights are fp32 on both sides; the
KV cache is fp32 in kvserve and in llama-batched-bench, f16 in llama-bench (this build refuses `-ctk f32` there;
at these contexts the cache is a small share of the bytes a step reads).

Definitions, the same on both sides:
  prefill tok/s = prompt tokens / time to process the prompt (llama-bench `pp`; kvserve: first token - first
                  scheduled, which also holds one sampling step)
  decode tok/s  = generated tokens after the first / decode time (llama-bench `tg`, llama-batched-bench
                  `S_TG`; kvserve: per request (n - 1) / (last token - first token), summed over the batch)

    .venv/bin/python benchmarks/peer_llamacpp.py --hf-dir DIR --gguf FILE \
        --llama-bench BIN --llama-batched-bench BIN [--threads 2] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess

from _report import (  # benchmarks/ is on sys.path when a script runs
    kvserve_llm,
    threads_used,
    write_report,
)


def kvserve_point(llm, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import torch

    from kvserve import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(
        3, llm.engine.config.model.vocab_size, (batch, prompt_len), generator=gen
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1].tolist(), params.with_updates(max_tokens=4))  # warm-up
    llm.engine.kv_manager.pool.reset_prefix_cache()
    outputs = llm.generate(prompts.tolist(), params)
    metrics = [o.outputs[0].metrics for o in outputs]
    first = min(m.first_scheduled_time for m in metrics)
    prefill_s = max(m.first_token_time for m in metrics) - first
    decode_start = max(m.first_token_time for m in metrics)
    decode_end = max(m.finished_time for m in metrics)
    return {
        "batch": batch,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": batch * (new_tokens - 1) / (decode_end - decode_start),
        # the adaptive thread policy's changes of pool size so far (0: every step on all threads)
        "thread_changes": llm.engine.runner.num_thread_changes,
    }


def kvserve_long_prefill(llm, prompt_len: int) -> float:
    """Cold prefill tok/s of one `prompt_len`-token prompt (the prefix cache reset first)."""
    import torch

    from kvserve import SamplingParams

    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, llm.engine.config.model.vocab_size, (prompt_len,), generator=gen)
    llm.engine.kv_manager.pool.reset_prefix_cache()
    output = llm.generate([prompt.tolist()], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    metrics = output.outputs[0].metrics
    return prompt_len / (metrics.first_token_time - metrics.first_scheduled_time)


def llama_bench(
    binary: str, gguf: str, threads: int, prompt_len: int, new_tokens: int, repeats: int = 3
) -> dict:
    cmd = [binary, "-m", gguf, "-p", str(prompt_len), "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {"command": " ".join(cmd)}
    for row in rows:
        key = "prefill_tok_s" if row["n_prompt"] else "decode_tok_s"
        out[key] = row["avg_ts"]
        out["build"] = row.get("build_commit")
    return out


def llama_batched_bench(
    binary: str, gguf: str, threads: int, batch: int, prompt_len: int, new_tokens: int
) -> dict:
    ctx = batch * (prompt_len + new_tokens) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads),
           "-ctk", "f32", "-ctv", "f32", "-npp", str(prompt_len), "-ntg", str(new_tokens),
           "-npl", str(batch)]  # fmt: skip
    stdout = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == batch:
            return {"command": " ".join(cmd), "batch": batch, "prefill_tok_s": float(cells[5]),
                    "decode_tok_s": float(cells[7])}  # fmt: skip
    raise RuntimeError(f"could not read llama-batched-bench output:\n{stdout}")


def paired(ours, theirs, point, round_index: int) -> dict:
    """One round of one point: both engines, kvserve first in even rounds, llama.cpp first in odd
    ones (a drift of the machine's speed then favours neither side over the rounds)."""
    first, second = (("kvserve", ours), ("llama.cpp", theirs))[:: 1 if round_index % 2 == 0 else -1]
    out = {"round": round_index, "first": first[0]}
    for name, measure in (first, second):
        out[name] = measure(point)
    return out


def median_round(rounds: list[dict], key: str) -> dict:
    """The round whose `key` ratio is the median (the lower middle one for an even count)."""
    return sorted(rounds, key=lambda r: r[key])[(len(rounds) - 1) // 2]


def ratio_summary(rounds: list[dict], keys: tuple[str, ...]) -> dict:
    """Per ratio: the median round's value under `key`, and `key`_min_max over the rounds."""
    out = {}
    for key in keys:
        values = sorted(r[key] for r in rounds)
        out[key] = values[(len(values) - 1) // 2]
        out[f"{key}_min_max"] = [values[0], values[-1]]
    return out


def spread(row: dict, key: str) -> str:
    low, high = row[f"{key}_min_max"]
    return "" if low == high else f", rounds {low:.2f}-{high:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--llama-batched-bench", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument(
        "--long-prompt", type=int, default=3000, help="cold prefill point (0: skip)"
    )
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every point this many times, kvserve and llama.cpp in alternating order "
        "(kvserve first in even rounds); each round's ratio pairs the two runs of that round",
    )
    parser.add_argument("--out", default="benchmarks/results/peer_llamacpp.json")
    args = parser.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    LLM = kvserve_llm()  # before torch: kvserve's thread defaults apply as they do for users
    import torch

    torch.set_num_threads(args.threads)

    options = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
    llm = LLM(args.hf_dir, max_num_seqs=64, kv_cache_memory_bytes=512 * 1024**2, **options)

    def ours_point(batch: int) -> dict:
        return kvserve_point(llm, batch, args.prompt_len, args.new_tokens)

    def theirs_point(batch: int) -> dict:
        if batch == 1:
            return llama_bench(
                args.llama_bench, args.gguf, args.threads, args.prompt_len, args.new_tokens
            )
        return llama_batched_bench(args.llama_batched_bench, args.gguf, args.threads, batch,
                                   args.prompt_len, args.new_tokens)  # fmt: skip

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rounds = [paired(ours_point, theirs_point, batch, r) for r in range(args.rounds)]
        for r in rounds:
            r["decode_ratio"] = r["kvserve"]["decode_tok_s"] / r["llama.cpp"]["decode_tok_s"]
            r["prefill_ratio"] = r["kvserve"]["prefill_tok_s"] / r["llama.cpp"]["prefill_tok_s"]
        mid = median_round(rounds, "decode_ratio")
        row = {"batch": batch, "kvserve": mid["kvserve"], "llama.cpp": mid["llama.cpp"],
               **ratio_summary(rounds, ("decode_ratio", "prefill_ratio")),
               "rounds": rounds}  # fmt: skip
        rows.append(row)
        ours, theirs = mid["kvserve"], mid["llama.cpp"]
        print(
            f"batch {batch:2d}: decode kvserve {ours['decode_tok_s']:8.1f} tok/s, llama.cpp "
            f"{theirs['decode_tok_s']:8.1f} tok/s (x{row['decode_ratio']:.2f}"
            f"{spread(row, 'decode_ratio')}); prefill kvserve {ours['prefill_tok_s']:8.1f}, "
            f"llama.cpp {theirs['prefill_tok_s']:8.1f} tok/s (x{row['prefill_ratio']:.2f}"
            f"{spread(row, 'prefill_ratio')})"
        )
    long_prefill = None
    if args.long_prompt:
        rounds = [
            paired(
                lambda n: {"prefill_tok_s": kvserve_long_prefill(llm, n)},
                lambda n: llama_bench(args.llama_bench, args.gguf, args.threads, n, 0, 1),
                args.long_prompt,
                r,
            )
            for r in range(args.rounds)
        ]  # fmt: skip
        for r in rounds:
            r["ratio"] = r["kvserve"]["prefill_tok_s"] / r["llama.cpp"]["prefill_tok_s"]
        mid = median_round(rounds, "ratio")
        long_prefill = {"prompt_len": args.long_prompt,
                        "kvserve_tok_s": mid["kvserve"]["prefill_tok_s"],
                        "llama.cpp_tok_s": mid["llama.cpp"]["prefill_tok_s"],
                        **ratio_summary(rounds, ("ratio",)),
                        "llama.cpp_command": mid["llama.cpp"]["command"],
                        "rounds": rounds}  # fmt: skip
        print(f"pp{args.long_prompt}: kvserve {long_prefill['kvserve_tok_s']:8.1f} tok/s, llama.cpp "
              f"{long_prefill['llama.cpp_tok_s']:8.1f} tok/s (x{long_prefill['ratio']:.2f}"
              f"{spread(long_prefill, 'ratio')})")  # fmt: skip
    report = {
        "benchmark": "peer_llamacpp", "hf_dir": args.hf_dir, "gguf": args.gguf,
        "dtype": "float32 weights both sides; KV fp32 (llama-bench: f16)", "threads": args.threads,
        "kvserve_threads": threads_used(),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "kv_cache_dtype": args.kv_cache_dtype, "rounds": args.rounds, "rows": rows,
        "long_prefill": long_prefill,
    }  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
