"""`kvserve train-demo`: run one step of the demo-model pipeline (tools/demo_models/) from a checkout."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

STEPS = ("corpus", "tokenizer", "instruct", "train", "export", "eval", "replies", "all")

EPILOG = """\
steps (each idempotent and seeded; arguments after the step go to it, see --help of each):
  corpus     gather code and prose from this Python installation, Debian and npm packages
  tokenizer  train the byte-level BPE tokenizer (or --reuse the shipped one), encode the corpus
  instruct   instruction pairs from the train split (docstring -> function, question -> topic)
  train      train one model: kvserve train-demo train --model draft --steps 1500
  export     write kvserve/assets/demo/{target,draft}, verify, evaluate, write model cards
  eval       held-out perplexity: kvserve train-demo eval kvserve/assets/demo/target
  replies    greedy chat replies to three fixed prompts: kvserve train-demo replies kvserve-demo
  all        corpus, tokenizer, draft and target training, then round 2 (run_training.sh)

The pipeline lives in the source tree, not in the installed package: run it from a clone.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train-demo",
        help="rebuild the embedded demo models (corpus, tokenizer, training, export)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("step", choices=STEPS, help="pipeline step (see above)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the step")
    p.set_defaults(func=run)


def _repo_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "tools" / "demo_models" / "train.py").exists():
        raise SystemExit(
            "kvserve train-demo: tools/demo_models/ not found next to the kvserve package; "
            "run it from a source checkout (git clone, then pip install -e .)"
        )
    return root


def run(args: argparse.Namespace) -> int:
    root = _repo_root()
    if args.step == "all":
        cmd = ["bash", str(root / "tools" / "demo_models" / "run_training.sh"), *args.args]
    else:
        cmd = [sys.executable, "-m", f"tools.demo_models.{args.step}", *args.args]
    # run_training.sh runs its steps with $PYTHON: the interpreter that runs kvserve.
    return subprocess.call(cmd, cwd=root, env={**os.environ, "PYTHON": sys.executable})
