"""Command-line options of train.py and the --mix parser (train.py's docstring explains them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools.demo_models.common import KINDS, PRESETS, SEED
from tools.demo_models.tokenizer import TOKENIZER_DIR, TOKENS_DIR

DESCRIPTION = "Step 3: train Llama models on the token arrays with a plain PyTorch loop."


def parse_mix(text: str | None, batch_size: int) -> dict[str, int]:
    """'code:3,prose:5' -> {'code': 3, 'prose': 5} (rows per batch, summing to batch_size). None is
    the default: half code, half prose."""
    if text is None:
        if batch_size % len(KINDS):
            raise ValueError("batch_size must be even: half code, half prose")
        return {k: batch_size // len(KINDS) for k in KINDS}
    mix = {}
    for part in text.split(","):
        name, _, rows = part.partition(":")
        if not name or not rows.isdigit():
            raise ValueError(f"--mix: expected name:rows, got {part!r}")
        if int(rows):
            mix[name.strip()] = int(rows)
    if sum(mix.values()) != batch_size:
        raise ValueError(f"--mix rows sum to {sum(mix.values())}, not --batch-size {batch_size}")
    return mix


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(PRESETS), required=True, help="model preset")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of the schedule")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (matrices)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--seed", type=int, default=SEED, help="data and init seed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda only)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    parser.add_argument(
        "--eval-every", type=int, default=100, help="steps between 8-window held-out losses"
    )
    parser.add_argument(
        "--checkpoint-every-s", type=float, default=600.0, help="seconds between checkpoints"
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="default work/runs/<model>")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR, help="tokenizer dir")
    parser.add_argument("--tokens", type=Path, default=TOKENS_DIR, help="token array dir")
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this exported model's weights (fp32), fresh optimizer",
    )
    parser.add_argument(
        "--mix",
        default=None,
        help="rows per batch from each stream, e.g. code:3,prose:5,sft:0 "
        "(default: half code, half prose)",
    )
    parser.add_argument(
        "--ppl-every", type=int, default=0, help="steps between full held-out perplexities (0: off)"
    )
    parser.add_argument(
        "--goal-vs",
        type=Path,
        default=None,
        help="stop once held-out ppl beats this model's by --goal-margin on every kind",
    )
    parser.add_argument(
        "--goal-margin", type=float, default=0.15, help="relative perplexity margin of the goal"
    )
    parser.add_argument(
        "--max-train-s",
        type=float,
        default=0.0,
        help="end the run after this much step time (0: off)",
    )
    parser.add_argument(
        "--cpu-lock",
        action="store_true",
        help="take the shared CPU locks around each step (pauses while kv-bench runs)",
    )
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=0,
        help="checkpoint and exit after this many steps of this invocation (tests resume)",
    )
    parser.add_argument(
        "--measure",
        type=int,
        default=0,
        help="time this many steps after one warm-up step, print tokens/s, exit",
    )
    return parser.parse_args(argv)
