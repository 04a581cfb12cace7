"""Reference outputs of transformers on a GGUF file, for the tests that compare kvserve with it.

transformers loads the same GGUF file (`from_pretrained(dir, gguf_file=...)`, dequantised to fp32)
and decodes greedily, with a KV cache, for `--new-tokens` tokens after each prompt (EOS does not
stop it: kvserve's `ignore_eos` does the same). The fixture holds, per prompt, the prompt's ids, the
greedy ids, and at a few positions the top logits, so a test can compare logits without loading the
model through transformers (which takes a minute or more on a 2-core machine).

    python tools/gguf_fixtures/reference_outputs.py MODEL.gguf OUT.json [--new-tokens 64]
        [--long-prompts 600,900,1300,2000]

A model without a chat template takes the ten plain prompts, then long prompts cut from the held-out
eval texts (kvserve/assets/eval) at the token counts of `--long-prompts` (one prose, one code per
length, alternating), so a sliding-window model's window is exercised (Gemma 3: 512).

tests/test_gguf_fixtures.py runs it on a tiny file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Ten chat turns and ten plain prompts: questions, instructions, code, lists, numbers.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "List the planets of the solar system in order.",
    "How do I make a cup of tea?",
    "Write a haiku about the sea.",
]
TEXT_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the river,",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The three primary colours are",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
    "<html>\n<body>\n",
    "The history of the Roman Empire",
    "Dear Sir or Madam,\n\nI am writing to",
]
EVAL_DIR = Path(__file__).resolve().parents[2] / "kvserve" / "assets" / "eval"
LOGIT_POSITIONS = (0, 1, 16, 63)  # generated positions whose top logits are kept
TOP_LOGITS = 32


def prompt_ids(tokenizer, chat: bool) -> list[list[int]]:
    if not chat or tokenizer.chat_template is None:
        return [tokenizer(p).input_ids for p in TEXT_PROMPTS]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for p in CHAT_PROMPTS
    ]  # fmt: skip


def long_prompt_ids(tokenizer, lengths: list[int], count: int) -> list[list[int]]:
    """`count` prompts of the token counts `lengths` (cycled), alternately prose and code."""
    texts = {
        kind: "\n\n".join(json.loads(line)["text"] for line in (EVAL_DIR / f"{kind}.jsonl").open())
        for kind in ("prose", "code")
    }
    ids = {kind: tokenizer(text).input_ids for kind, text in texts.items()}
    out = []
    for i in range(count):
        kind, length = ("prose", "code")[i % 2], lengths[i % len(lengths)]
        start = (i // 2) * 97  # different windows of the text for repeated lengths
        out.append(ids[kind][start : start + length])
    return out


def greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[list[float]]]:
    import torch

    out, kept = [], []
    with torch.inference_mode():
        result = model(torch.tensor([ids]), use_cache=True)
        for step in range(new_tokens):
            logits = result.logits[0, -1].float()
            if step in LOGIT_POSITIONS:
                top = torch.topk(logits, TOP_LOGITS)
                kept.append(
                    [[int(i), float(v)] for i, v in zip(top.indices, top.values, strict=True)]
                )
            token = int(torch.argmax(logits))
            out.append(token)
            result = model(
                torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True
            )
    return out, kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=20, help="at most 20")
    parser.add_argument("--long-prompts", default="600,900,1300,2000",
                        help="token counts of the long prompts a model without a chat template takes")  # fmt: skip
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    start = time.perf_counter()
    where = dict(gguf_file=args.gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), **where)
    model = AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), dtype=torch.float32, **where
    ).eval()
    load_s = time.perf_counter() - start
    if tokenizer.chat_template is not None:
        prompts = prompt_ids(tokenizer, chat=True) + prompt_ids(tokenizer, chat=False)
    else:
        lengths = [int(n) for n in args.long_prompts.split(",")]
        plain = prompt_ids(tokenizer, chat=False)
        prompts = plain + long_prompt_ids(tokenizer, lengths, 20 - len(plain))
    prompts = prompts[: args.prompts]
    cases = []
    for ids in prompts:
        generated, logits = greedy(model, ids, args.new_tokens)
        cases.append({"prompt_ids": ids, "greedy_ids": generated, "top_logits": logits})
    fixture = {
        "file": args.gguf.name,
        "file_bytes": args.gguf.stat().st_size,
        "reference": "transformers (gguf_file=, fp32), greedy with a KV cache, EOS not stopping",
        "logit_positions": list(LOGIT_POSITIONS),
        "new_tokens": args.new_tokens,
        "load_s": round(load_s, 1),
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")))
    print(f"{args.out}: {len(cases)} prompts x {args.new_tokens} tokens (load {load_s:.0f} s)")


if __name__ == "__main__":
    main()
