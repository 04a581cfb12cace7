"""Step 4: export trained runs as Hugging Face directories, verify, evaluate, write model cards.

For each model: config.json (model_type llama), model.safetensors in bf16 (the engine upcasts on
load), generation_config.json (eos <|end|>), tokenizer.json + tokenizer_config.json (chat template),
README.md.

Verification (always): transformers' AutoModelForCausalLM loads the exported directory, and its fp32
logits on a prompt equal the training model's (checkpoint.pt, weights rounded to bf16 and upcast, same
fp32 maths); the tokenizer round-trips held-out code and prose. Then eval.py's held-out perplexity
(code, prose, unigram baseline) goes into each model card and into eval_results.json.

    python -m tools.demo_models.export [--models draft target] [--out kvserve/assets/demo] [--no-eval]
    python -m tools.demo_models.export --models target --run target=work/runs/target_sft \
        --also-eval draft       # round 2: re-export the target only, evaluate beside the shipped draft

A model listed in --also-eval is evaluated where it lies (not re-exported); its card keeps everything
but the held-out table, which is rewritten with the new numbers. A run that started from an exported
model (--init-from) keeps the training lines of that model's previous card as its first round.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from tools.demo_models.common import ASSETS_DIR, KINDS, MANIFEST_PATH, read_json, write_json
from tools.demo_models.corpus import CORPUS_DIR
from tools.demo_models.tokenizer import TOKENIZER_DIR, TOKENS_DIR, read_documents
from tools.demo_models.train import RUNS_DIR, build_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VERIFY_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "In the beginning God created the heaven and the earth.",
)


def export_model(run_dir: Path, tokenizer_dir: Path, out_dir: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    cfg = model.config
    # No max_length: it would clash with callers' max_new_tokens; the context is in config.json.
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    # transformers >= 5 writes rope_parameters and dtype; older readers look for these two keys.
    config_path = out_dir / "config.json"
    raw = json.loads(config_path.read_text())
    raw.setdefault("rope_theta", raw.get("rope_parameters", {}).get("rope_theta", 10000.0))
    raw.setdefault("torch_dtype", "bfloat16")
    config_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def verify_export(run_dir: Path, tokenizer_dir: Path, out_dir: Path, preset_name: str) -> dict:
    """Logits of the exported directory vs the training model; tokenizer round trip. Raises on mismatch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = build_model(preset_name, tokenizer_dir)
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    trained.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    exported = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out_dir)
    max_abs_diff = 0.0
    for prompt in VERIFY_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids  # [1, T]
        with torch.no_grad():
            a = trained.eval()(input_ids=ids).logits
            b = exported.eval()(input_ids=ids).logits
        max_abs_diff = max(max_abs_diff, (a - b).abs().max().item())
    if max_abs_diff > 1e-5:
        raise AssertionError(
            f"{out_dir}: exported logits differ from the training model by {max_abs_diff}"
        )
    samples = [next(read_documents(CORPUS_DIR, "heldout", kind))["text"][:4000] for kind in KINDS]
    for text in samples:
        if tok.decode(tok(text).input_ids, skip_special_tokens=True) != text:
            raise AssertionError(f"{out_dir}: tokenizer does not round-trip held-out text")
    messages = [{"role": "user", "content": "Hello"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if chat != "<|bos|><|user|>\nHello<|end|>\n<|assistant|>\n":
        raise AssertionError(f"{out_dir}: unexpected chat template rendering {chat!r}")
    return {"max_abs_logit_diff": max_abs_diff, "tokenizer_round_trip": True, "chat_template": True}


def training_summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "train.log").read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "start")
    done = [r for r in records if r.get("event") == "done"]
    steps = [r for r in records if "heldout_code" in r]
    return {
        "start": start,
        "resumes": [r for r in records if r.get("event") == "resume"],
        "done": done[-1] if done else None,
        "last_eval": steps[-1] if steps else None,
    }


def resume_lines(summary: dict) -> list[str]:
    """One line per resumed segment. A resume may extend the run: the cosine schedule is then recomputed
    for the new step count, so the learning rate steps up where the longer schedule says it should be."""
    lines, steps, last_step = [], summary["start"]["args"]["steps"], None
    for r in summary["resumes"]:
        if r["step"] == last_step:
            lines.append(
                f"- restarted again from the step-{r['step']:,d} checkpoint (the previous run was killed)"
            )
            continue
        last_step = r["step"]
        where = r.get("hardware", "the same machine (this trainer version did not record threads)")
        lines.append(f"- resumed at step {r['step']:,d} on {where}")
        if r.get("steps", steps) != steps:
            lines.append(f"  with the schedule extended from {steps:,d} to {r['steps']:,d} steps")
            steps = r["steps"]
    final = (summary["done"] or {}).get("step", steps)
    if final > steps:
        lines.append(
            f"- the run was extended from {steps:,d} to {final:,d} steps on resume; the cosine schedule is "
            "recomputed for the longer run, so the learning rate steps up at the resume point"
        )
    return lines


def card_section(card: str, heading: str) -> str:
    """The body of `## heading` in a model card (up to the next `## `), or ''."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", card, re.S | re.M)
    return match.group(1).strip() if match else ""


def replace_section(card: str, heading: str, body: str) -> str:
    pattern = rf"(^## {re.escape(heading)}\n)(.*?)(?=^## |\Z)"
    return re.sub(pattern, lambda m: f"{m.group(1)}\n{body}\n\n", card, count=1, flags=re.S | re.M)


def mix_text(start: dict) -> str:
    mix = start.get("mix") or {"code": 1, "prose": 1}
    rows = sum(mix.values())
    return ", ".join(f"{n}/{rows} {k}" for k, n in mix.items())


INSTRUCTED = (
    "After pre-training, a short instruction-tuning stage on pairs made from its training corpus "
    "(docstring -> function, question -> language-reference topic or docstring) taught it the chat "
    "template: asked for a small Python function it writes Python (rarely the right function) and "
    "ends its turn with `<|end|>`; asked a question it answers in prose in the style of its corpus, "
    "often until `max_tokens`. It knows little, is often wrong and must not be used for anything "
    "that matters."
)
PLAIN = (
    "It continues Python code and English prose in the style of its corpus, but it knows little, "
    "follows no instructions and must not be used for anything that matters."
)


def perplexity_lines(results: dict, name: str) -> list[str]:
    lines = [
        f"exp(total NLL / scored tokens) over non-overlapping {results['window_len']}-token "
        "windows of the held-out split (bf16 weights upcast to fp32), per token of the shared "
        f"tokenizer; this model is **{name}**. Lower is better.",
        "",
        "| kind | scored tokens | " + " | ".join(results["models"]) + " | unigram baseline |",
        "|---|---:|" + "---:|" * len(results["models"]) + "---:|",
    ]
    for kind, entry in results["kinds"].items():
        ppls = " | ".join(f"{entry[m]['ppl']:.2f}" for m in results["models"])
        lines.append(
            f"| {kind} | {entry['num_scored_tokens']:,d} | {ppls} | {entry['unigram']['ppl']:.2f} |"
        )
    return lines


def stage_text(start: dict) -> str:
    """What a training round did, from its row mix: pre-training, instruction tuning, or both."""
    mix = start.get("mix") or {}
    if not mix.get("sft"):
        return "continued pre-training"
    if len(mix) == 1:
        return "instruction tuning"
    if mix["sft"] * 2 >= sum(mix.values()):
        return "instruction tuning with pre-training rows"
    return "continued pre-training mixed with instruction pairs"


def earlier_rounds(previous_training: str, start: dict) -> list[str]:
    """The card lines before this run's own training lines: a card exported from an --init-from run
    keeps every earlier round of the model it started from and numbers this one on."""
    if not previous_training:
        return []
    numbers = [int(n) for n in re.findall(r"^Round (\d+) ", previous_training, re.M)]
    if not numbers:
        previous_training = (
            f"Round 1 (pre-training; from the previous card):\n\n{previous_training}"
        )
    return [
        previous_training,
        "",
        f"Round {max(numbers, default=1) + 1} (started from those weights, fp32, fresh optimizer; "
        f"{stage_text(start)}):",
        "",
    ]


def model_card(
    name: str,
    out_dir: Path,
    summary: dict,
    manifest: dict,
    results: dict | None,
    verify: dict,
    previous_training: str = "",
) -> str:
    start, done = summary["start"], summary["done"] or {}
    preset = start["preset"]
    size_mb = (out_dir / "model.safetensors").stat().st_size / 1e6
    instructed = "sft" in (start.get("mix") or {})
    rounds = earlier_rounds(previous_training, start)
    lines = [
        f"# kvserve demo {name} model",
        "",
        f"A small demonstration model ({start['num_params'] / 1e6:.1f}M parameters) trained by kvserve's own "
        "reproducible pipeline (`tools/demo_models/`), so that kvserve has a real model to serve, "
        "speculate with and quantise on a machine with no model hub. **It is a small demonstration model.** "
        + (INSTRUCTED if instructed else PLAIN),
        "",
        "## Architecture",
        "",
        f"Llama (`LlamaForCausalLM`): hidden {preset['hidden_size']}, {preset['num_hidden_layers']} layers, "
        f"{preset['num_attention_heads']} attention heads ({preset['num_key_value_heads']} KV heads), "
        f"MLP {preset['intermediate_size']}, context {preset['max_position_embeddings']}, tied embeddings, "
        f"vocabulary {manifest['tokenizer']['vocab_size']} (byte-level BPE, shared by the demo target and "
        f"draft). Weights stored in bf16 ({size_mb:.1f} MB); upcast on load.",
        "",
        "## Training",
        "",
        *rounds,
        f"- tokens seen: {done.get('tokens_seen', 0):,d} ({done.get('step', 0):,d} steps of "
        f"{start['tokens_per_step']:,d} tokens; rows per batch: {mix_text(start)})",
        f"- training time: {done.get('train_s', 0) / 3600:.2f} h of step time, started on "
        f"{start.get('hardware', start['device'])}",
        *resume_lines(summary),
        f"- optimiser: AdamW (0.9, 0.95), peak lr {start['args']['lr']}, {start['args']['warmup_steps']} "
        f"warm-up steps, cosine to 10%, weight decay {start['args']['weight_decay']}, "
        f"gradient clip {start['args']['grad_clip']}, seed {start['args']['seed']}",
        f"- software: PyTorch {start['torch']}, plain training loop (no Trainer)",
        "",
        "## Corpus",
        "",
        "| source | kind | origin | version | licence | train bytes | train tokens | held-out tokens |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    for s in manifest["sources"]:
        lines.append(
            f"| {s['name']} | {s['kind']} | {s['origin']} | {s['version']} | {s['licence']} | "
            f"{s['train_bytes']:,d} | {s.get('train_tokens', 0):,d} | {s.get('heldout_tokens', 0):,d} |"
        )
    lines += [
        "",
        f"Held-out split: {manifest['split']} (fraction {manifest['heldout_fraction']}, "
        f"seed {manifest['seed']}).",
        "",
    ]
    if results:
        lines += ["## Held-out perplexity", "", *perplexity_lines(results, name), ""]
    lines += [
        "## Use",
        "",
        "`kvserve serve` and `kvserve generate` use the demo target when given no model; the draft "
        "pairs with it for speculative decoding (same tokenizer). Any Hugging Face Llama loader reads "
        "this directory. Chat template: `<|bos|><|user|>\\n...<|end|>\\n<|assistant|>\\n`; "
        "generation stops at `<|end|>`.",
        "",
        "## Verification",
        "",
        f"transformers loads this directory; its logits equal the training model's "
        f"(max abs difference {verify['max_abs_logit_diff']:.1e}); the tokenizer round-trips "
        "held-out code and prose.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["target", "draft"])
    parser.add_argument("--runs", type=Path, default=RUNS_DIR)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--tokens", type=Path, default=TOKENS_DIR)
    parser.add_argument("--out", type=Path, default=ASSETS_DIR)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-eval", action="store_true", help="skip held-out perplexity")
    parser.add_argument(
        "--run", action="append", default=[], help="NAME=RUN_DIR: export NAME from this run"
    )
    parser.add_argument(
        "--also-eval", nargs="*", default=[], help="exported models to evaluate in place"
    )
    args = parser.parse_args(argv)
    run_dirs = {n: args.runs / n for n in args.models} | dict(r.split("=", 1) for r in args.run)
    run_dirs = {n: Path(d) for n, d in run_dirs.items()}

    import torch

    torch.set_num_threads(args.threads)
    manifest = read_json(MANIFEST_PATH)
    verified, previous = {}, {}
    for name in args.models:
        run_dir = run_dirs[name]
        init_from = training_summary(run_dir)["start"]["args"].get("init_from")
        old_card = args.out / name / "README.md"
        if init_from and old_card.is_file():
            previous[name] = card_section(old_card.read_text(), "Training")
        export_model(run_dir, args.tokenizer, args.out / name)
        preset = training_summary(run_dir)["start"]["model"]
        verified[name] = verify_export(run_dir, args.tokenizer, args.out / name, preset)
        print(f"{name}: exported to {args.out / name}; {verified[name]}")
    results = None
    if not args.no_eval:
        from tools.demo_models.eval import evaluate

        evaluated = [*args.models, *args.also_eval]
        results = evaluate({n: args.out / n for n in evaluated}, args.tokens, args.window, None)
        write_json(args.out / "eval_results.json", results)
        print(json.dumps(results, indent=2))
    for name in args.models:
        card = model_card(
            name,
            args.out / name,
            training_summary(run_dirs[name]),
            manifest,
            results,
            verified[name],
            previous.get(name, ""),
        )
        (args.out / name / "README.md").write_text(card)
    for name in args.also_eval if results else ():
        card_path = args.out / name / "README.md"
        body = "\n".join(perplexity_lines(results, name))
        card_path.write_text(replace_section(card_path.read_text(), "Held-out perplexity", body))
    total_mb = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 1e6
    print(f"total size of {args.out}: {total_mb:.1f} MB")


if __name__ == "__main__":
    main()
