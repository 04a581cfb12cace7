"""Speculative decoding on this machine: measured acceptance, tokens per step, costs and speedup vs the
independent-acceptance prediction (docs/speculative-decoding.md), for code-like and prose-like prompts.

For each content type and proposer (draft model, n-gram lookup) and gamma, greedy decoding of the same prompts
with and without speculation (batch 1, one request at a time: the bandwidth-bound regime speculation is for):
  acceptance = accepted / proposed (what servers report)
  alpha      = accepted / (accepted + rejections): the chance that a tested proposal is accepted (the
               formula's alpha; proposals after the first rejection in a step are never tested)
  E measured = committed tokens / verification steps; E predicted = (1 - alpha^(g+1)) / (1 - alpha)
  c          = draft time per proposed token / plain decode step time
  v          = verification step time / plain decode step time
  speedup    = predicted E / (g c + v); measured = plain wall / speculative wall (same tokens required)

    .venv/bin/python benchmarks/spec_decode.py [--target DIR --draft DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _report import write_report  # benchmarks/ is on sys.path when a script runs

HELDOUT = Path(__file__).resolve().parents[1] / "tools" / "demo_models" / "work" / "corpus"
COPY_TASK = (
    "Repeat this code with one change: rename `total` to `acc`.\n\n"
    "def total_price(items):\n    total = 0\n    for item in items:\n"
    "        total += item.price * item.quantity\n    return total\n\n"
    "def total_price(items):\n    acc = 0\n"
)


def prompts_for(kind: str, count: int, prompt_chars: int) -> tuple[list[str], str]:
    """Held-out documents cut to a prompt (the demo pipeline's split), else a labelled fallback."""
    path = HELDOUT / f"heldout_{kind}.jsonl"
    if path.is_file():
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        docs = [d for d in docs if len(d) > prompt_chars]
        step = max(1, len(docs) // count)
        return [d[:prompt_chars] for d in docs[::step][:count]], str(path)
    import inspect
    import json as json_module

    if kind == "code":
        source = inspect.getsource(json_module.decoder)
        return [
            source[i : i + prompt_chars] for i in range(0, count * 997, 997)
        ], "stdlib json.decoder"
    prose = (
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
        "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
        "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
        "of despair."
    )
    return [prose[: prompt_chars - i] for i in range(count)], "fallback prose"


def run(llm, prompts, max_tokens):
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.engine.kv_manager.pool.reset_prefix_cache()
    tokens, gaps, start = [], [], time.perf_counter()
    for prompt in prompts:  # one at a time: batch 1
        completion = llm.generate([prompt], params)[0].outputs[0]
        tokens.append(completion.token_ids)
        times = completion.metrics.token_times
        gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
    return tokens, time.perf_counter() - start, sum(gaps) / max(len(gaps), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", default=None, help="target model (default: embedded demo target)"
    )
    parser.add_argument("--draft", default=None, help="draft model (default: embedded demo draft)")
    parser.add_argument("--gammas", default="2,4,6")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()

    import torch

    from kvserve import LLM
    from kvserve.models import default_draft_dir, default_model_dir

    target = args.target or str(default_model_dir())
    draft = args.draft or str(default_draft_dir())
    base = LLM(target)
    contents = {
        kind: prompts_for(kind, args.num_prompts, args.prompt_chars) for kind in ("code", "prose")
    }
    contents["copy"] = ([COPY_TASK] * 2, "copy-heavy task (repeat code with one change)")
    rows = []
    for kind, (prompts, source) in contents.items():
        run(base, prompts[:1], 8)  # warm-up
        reference, plain_wall, plain_step_s = run(
            base, prompts, args.max_tokens
        )  # mean decode step
        num_tokens = sum(len(t) for t in reference)
        for proposer in ("draft", "ngram"):
            for gamma in [int(g) for g in args.gammas.split(",")]:
                spec = (
                    dict(speculative_model=draft)
                    if proposer == "draft"
                    else dict(speculative_method="ngram")
                )
                llm = LLM(target, num_speculative_tokens=gamma, **spec)
                run(llm, prompts[:1], 8)
                stats_before = dict(vars(llm.engine.runner.spec_stats))
                tokens, wall, _ = run(llm, prompts, args.max_tokens)
                after = vars(llm.engine.runner.spec_stats)
                d = {k: after[k] - stats_before[k] for k in after}
                # Two acceptance numbers. `acceptance` = accepted / proposed (what servers report).
                # The formula's alpha is the chance that one *tested* proposal is accepted; proposals
                # after the first rejection are never tested, so alpha = accepted / (accepted +
                # rejections). Using accepted / proposed in the formula understates E.
                tested = d["num_accepted"] + d["num_rejections"]
                rate = d["num_accepted"] / d["num_proposed"] if d["num_proposed"] else 0.0
                alpha = d["num_accepted"] / tested if tested else 0.0
                steps = d["num_verify_steps"]
                e_measured = d["num_emitted"] / steps if steps else 1.0
                e_predicted = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
                c = (
                    (d["draft_time_s"] / d["num_proposed"]) / plain_step_s
                    if d["num_proposed"]
                    else 0.0
                )
                v = (d["target_time_s"] / steps) / plain_step_s if steps else 0.0
                row = {
                    "content": kind, "prompt_source": source, "proposer": proposer, "gamma": gamma,
                    "acceptance": rate, "alpha_per_position": alpha, "tokens_per_step_measured": e_measured,
                    "tokens_per_step_predicted": e_predicted, "draft_cost_c": c, "verify_cost_v": v,
                    "speedup_predicted": e_predicted / (gamma * c + v) if (gamma * c + v) else None,
                    "speedup_measured": plain_wall / wall, "identical_outputs": tokens == reference,
                    "num_tokens": num_tokens, "plain_wall_s": plain_wall, "spec_wall_s": wall,
                    "plain_decode_step_s": plain_step_s,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{kind:5s} {proposer:5s} g={gamma}: acceptance {rate:.3f}  alpha {alpha:.3f}  E {e_measured:.2f} "
                    f"(pred {e_predicted:.2f})  c {c:.3f}  v {v:.2f}  speedup {row['speedup_measured']:.2f}x "
                    f"(pred {row['speedup_predicted'] or 0:.2f}x)  identical {row['identical_outputs']}"
                )
    report = {
        "benchmark": "spec_decode", "target": target, "draft": draft, "max_tokens": args.max_tokens,
        "mode": "greedy, batch 1, forced length (ignore_eos)", "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }  # fmt: skip
    write_report(args.out, report)


if __name__ == "__main__":
    main()
