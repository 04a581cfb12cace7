"""Step 3: train Llama models on the token arrays with a plain PyTorch loop.

AdamW, linear warm-up then cosine decay to a tenth of the peak learning rate, gradient clipping at
1.0. Every batch is half code and half prose (random windows of the train streams). Each run
directory holds train.log (JSON lines: loss, held-out loss on code and prose, tokens/s),
checkpoint.pt (model, optimizer, step, data RNG, torch RNG, elapsed training seconds; written every
--checkpoint-every-s and at the end) and, when finished, final/ (a transformers save in fp32, the
input of export.py). Re-running the same command resumes from checkpoint.pt; a finished run is
skipped.

    python -m tools.demo_models.train --model draft --steps 3000 [--device cpu|cuda] [--threads 1]
    python -m tools.demo_models.train --model target --measure 5   # tokens/s only, no files
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from tools.demo_models.common import (
    KINDS,
    PRESETS,
    SEED,
    WORK_DIR,
    hardware_description,
    llama_config,
    preset_dict,
)
from tools.demo_models.eval import fixed_windows
from tools.demo_models.tokenizer import TOKENIZER_DIR, TOKENS_DIR

RUNS_DIR = WORK_DIR / "runs"
NUM_EVAL_WINDOWS = 8  # per kind, for the periodic held-out loss (the full evaluation is eval.py)


class BatchSampler:
    """Random windows of seq_len + 1 tokens: the first half of the rows code, the rest prose."""

    def __init__(self, streams: dict[str, np.ndarray], batch_size: int, seq_len: int, seed: int):
        if batch_size % len(KINDS):
            raise ValueError("batch_size must be even: half code, half prose")
        self.streams, self.batch_size, self.seq_len = streams, batch_size, seq_len
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> np.ndarray:
        rows = []
        per_kind = self.batch_size // len(KINDS)
        for kind in KINDS:
            stream = self.streams[kind]
            starts = self.rng.integers(0, len(stream) - self.seq_len - 1, size=per_kind)
            rows += [stream[s : s + self.seq_len + 1] for s in starts]
        return np.stack(rows).astype(np.int64)  # [batch_size, seq_len + 1]


def finished_step(run_dir: Path) -> int:
    """The step of the run's last export to final/, or -1. A larger --steps extends a finished run: it
    resumes from checkpoint.pt (written at the end of every run) and overwrites final/."""
    log = run_dir / "train.log"
    if not (run_dir / "final" / "config.json").exists() or not log.exists():
        return -1
    done = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "done"]
    return done[-1]["step"] if done else -1


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_model(preset_name: str, tokenizer_dir: Path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = llama_config(
        PRESETS[preset_name], len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def make_optimizer(model, lr: float, weight_decay: float):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and the (tied) embedding
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lm_loss(model, batch, autocast_ctx):
    import torch.nn.functional as F

    with autocast_ctx():
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def heldout_losses(model, eval_batches: dict, autocast_ctx) -> dict[str, float]:
    import torch

    model.eval()
    with torch.no_grad():
        out = {
            f"heldout_{k}": lm_loss(model, b, autocast_ctx).item() for k, b in eval_batches.items()
        }
    model.train()
    return out


def save_checkpoint(
    path: Path,
    model,
    optimizer,
    step: int,
    sampler: BatchSampler,
    train_s: float,
    args: argparse.Namespace,
) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "data_rng": sampler.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "train_s": train_s,
            "args": vars(args),
        },
        tmp,
    )
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda only)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--checkpoint-every-s", type=float, default=600.0)
    parser.add_argument("--run-dir", type=Path, default=None, help="default work/runs/<model>")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--tokens", type=Path, default=TOKENS_DIR)
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


def main(argv: list[str] | None = None) -> None:
    import contextlib

    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    autocast_ctx = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else contextlib.nullcontext
    )
    run_dir = args.run_dir or RUNS_DIR / args.model
    if not args.measure and finished_step(run_dir) >= args.steps:
        print(f"{run_dir}: already finished, nothing to do")
        return

    model = build_model(args.model, args.tokenizer).to(device)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    streams = {k: np.fromfile(args.tokens / f"train_{k}.bin", dtype=np.uint16) for k in KINDS}
    sampler = BatchSampler(streams, args.batch_size, args.seq_len, args.seed)
    eval_batches = {
        k: torch.as_tensor(
            np.asarray(
                fixed_windows(
                    np.fromfile(args.tokens / f"heldout_{k}.bin", dtype=np.uint16).astype(np.int64),
                    args.seq_len + 1,
                )[:NUM_EVAL_WINDOWS]
            ),
            device=device,
        )
        for k in KINDS
    }
    num_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len

    if args.measure:
        for i in range(args.measure + 1):
            if i == 1:
                start = time.perf_counter()
            loss = lm_loss(model, torch.as_tensor(sampler.next(), device=device), autocast_ctx)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "model": args.model,
                    "num_params": num_params,
                    "seq_len": args.seq_len,
                    "batch_size": args.batch_size,
                    "threads": args.threads,
                    "s_per_step": round(seconds / args.measure, 3),
                    "tokens_per_s": round(tokens_per_step * args.measure / seconds, 1),
                }
            )
        )
        return

    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = run_dir / "checkpoint.pt"
    step, train_s = 0, 0.0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.rng.bit_generator.state = ckpt["data_rng"]
        torch.set_rng_state(ckpt["torch_rng"])
        step, train_s = ckpt["step"], ckpt["train_s"]
        print(f"resumed {run_dir} at step {step} ({train_s:.0f} s trained)")
    log = open(run_dir / "train.log", "a", buffering=1)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        log.write(line + "\n")
        print(line, flush=True)

    if step == 0:
        emit(
            {
                "event": "start",
                "model": args.model,
                "preset": preset_dict(PRESETS[args.model]),
                "num_params": num_params,
                "tokens_per_step": tokens_per_step,
                "args": vars(args)
                | {
                    "run_dir": str(run_dir),
                    "tokenizer": str(args.tokenizer),
                    "tokens": str(args.tokens),
                },
                "device": args.device,
                "hardware": hardware_description(args.device, args.threads),
                "torch": torch.__version__,
            }
        )
    else:
        emit(
            {
                "event": "resume",
                "step": step,
                "train_s": round(train_s, 1),
                "steps": args.steps,
                "lr": args.lr,
                "hardware": hardware_description(args.device, args.threads),
            }
        )
    model.train()
    last_ckpt = time.perf_counter()
    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    stop_at = min(args.steps, step + args.stop_after_steps) if args.stop_after_steps else args.steps
    while step < stop_at:
        lr = lr_at(step, args.lr, args.warmup_steps, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss = lm_loss(model, torch.as_tensor(sampler.next(), device=device), autocast_ctx)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_s += time.perf_counter() - t0
        window_loss += loss.item()
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            record = {
                "step": step,
                "loss": round(window_loss / window_steps, 4),
                "lr": round(lr, 6),
                "grad_norm": round(grad_norm.item(), 3),
                "tokens_per_s": round(window_steps * tokens_per_step / elapsed, 1),
                "tokens_seen": step * tokens_per_step,
                "train_s": round(train_s, 1),
            }
            if step % args.eval_every == 0 or step == args.steps:
                record |= {
                    k: round(v, 4)
                    for k, v in heldout_losses(model, eval_batches, autocast_ctx).items()
                }
            emit(record)
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        if time.perf_counter() - last_ckpt >= args.checkpoint_every_s or step == stop_at:
            save_checkpoint(ckpt_path, model, optimizer, step, sampler, train_s, args)
            last_ckpt = time.perf_counter()
    if step < args.steps:
        emit({"event": "stopped", "step": step, "train_s": round(train_s, 1)})
        return
    model.save_pretrained(run_dir / "final", safe_serialization=True)
    emit(
        {
            "event": "done",
            "step": step,
            "train_s": round(train_s, 1),
            "tokens_seen": step * tokens_per_step,
        }
    )
    log.close()


if __name__ == "__main__":
    main()
