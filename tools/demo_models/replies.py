"""The demo model's chat replies to fixed prompts (greedy), for before/after notes and model cards.

Each prompt goes through the checkpoint's chat template and the kvserve engine (the offline `LLM`
API), greedy, at most --max-tokens tokens; a reply that stopped on `<|end|>` has finish_reason "stop".

    python -m tools.demo_models.replies [MODEL] [--max-tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = (
    "Write a Python function that adds two numbers.",
    "What is a Python list?",
    "Tell me about the history of the United States.",
)


def chat_replies(model: str, prompts: tuple[str, ...], max_tokens: int) -> list[dict]:
    """[{prompt, reply, finish_reason, num_tokens}] for each prompt, in order."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model)
    encoded = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(
        [llm.tokenizer.encode(t, add_special_tokens=False) for t in encoded], params
    )
    replies = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        replies.append(
            {
                "prompt": prompt,
                "reply": completion.text,
                "finish_reason": completion.finish_reason,
                "num_tokens": len(completion.token_ids),
            }
        )
    return replies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model", nargs="?", default="kvserve-demo", help="model dir or built-in name"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="reply length limit (tokens)")
    parser.add_argument("--json", type=Path, default=None, help="also write the replies here")
    args = parser.parse_args(argv)
    replies = chat_replies(args.model, PROMPTS, args.max_tokens)
    for r in replies:
        print(
            f"### {r['prompt']}\n{r['reply']}\n[{r['finish_reason']}, {r['num_tokens']} tokens]\n"
        )
    if args.json:
        args.json.write_text(json.dumps(replies, indent=2) + "\n")


if __name__ == "__main__":
    main()
