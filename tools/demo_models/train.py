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

Continuing or tuning a trained model: `--init-from DIR` starts step 0 from an exported model's weights
(upcast to fp32) with a fresh optimizer; `--mix code:3,prose:5,sft:0` sets how many rows of each
batch come from each train stream (work/tokens/train_<name>.bin). `--ppl-every N` measures the full
held-out perplexity (eval.py's windows and formula) every N steps and, with `--goal-vs DRAFT_DIR`,
ends the run as soon as the model beats that model by `--goal-margin` on every kind;
`--max-train-s` ends it when the step time is spent. `--cpu-lock` shares the CPU politely: each step
waits while a `kv-bench` benchmark holds the machine (cpu_lock.py).
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
    WORK_DIR,
    hardware_description,
    llama_config,
    preset_dict,
)
from tools.demo_models.cpu_lock import CpuTurn
from tools.demo_models.eval import fixed_windows, model_nll
from tools.demo_models.train_args import parse_args, parse_mix

RUNS_DIR = WORK_DIR / "runs"
NUM_EVAL_WINDOWS = 8  # per kind, for the periodic held-out loss (the full evaluation is eval.py)


class BatchSampler:
    """Random windows of seq_len + 1 tokens: `mix[name]` rows from stream `name`, in mix order."""

    def __init__(
        self, streams: dict[str, np.ndarray], mix: dict[str, int], seq_len: int, seed: int
    ):
        self.streams, self.mix, self.seq_len = streams, mix, seq_len
        self.batch_size = sum(mix.values())
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> np.ndarray:
        rows = []
        for name, count in self.mix.items():
            stream = self.streams[name]
            starts = self.rng.integers(0, len(stream) - self.seq_len - 1, size=count)
            rows += [stream[s : s + self.seq_len + 1] for s in starts]
        return np.stack(rows).astype(np.int64)  # [batch_size, seq_len + 1]


def finished_step(run_dir: Path) -> float:
    """The step of the run's last export to final/, or -1; infinity when the run ended early on its
    goal or its time budget (re-running it is a no-op). A larger --steps extends a finished run: it
    resumes from checkpoint.pt (written at the end of every run) and overwrites final/."""
    log = run_dir / "train.log"
    if not (run_dir / "final" / "config.json").exists() or not log.exists():
        return -1
    done = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "done"]
    if done and done[-1].get("reason") in ("goal", "budget"):
        return math.inf
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


def load_init_weights(model, init_dir: Path) -> None:
    """Copy an exported model's weights (any dtype, e.g. the shipped bf16) into `model`, in fp32."""
    from transformers import LlamaForCausalLM

    src = LlamaForCausalLM.from_pretrained(init_dir, dtype=model.dtype)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if getattr(src.config, field) != getattr(model.config, field):
            raise ValueError(f"--init-from {init_dir}: {field} differs from the --model preset")
    model.load_state_dict(src.state_dict())


def heldout_perplexity(model, windows: dict[str, list], device: str) -> dict[str, float]:
    """Perplexity per kind over the full held-out windows (eval.py's formula), model left in train."""
    out = {}
    for kind, kind_windows in windows.items():
        nll, count = model_nll(model, kind_windows, device=device)
        out[kind] = math.exp(nll / count)
    model.train()
    return out


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


def measure(model, optimizer, sampler, args, autocast_ctx, device) -> None:
    """Time args.measure steps after one warm-up step; print tokens/s."""
    import torch

    for i in range(args.measure + 1):
        if i == 1:
            start = time.perf_counter()
        loss = lm_loss(model, torch.as_tensor(sampler.next(), device=device), autocast_ctx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    tokens_per_step = sampler.batch_size * args.seq_len
    record = {
        "model": args.model,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "s_per_step": round(seconds / args.measure, 3),
        "tokens_per_s": round(tokens_per_step * args.measure / seconds, 1),
    }
    print(json.dumps(record))


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

    turn = CpuTurn(args.cpu_lock)
    model = build_model(args.model, args.tokenizer).to(device)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    mix = parse_mix(args.mix, args.batch_size)
    streams = {k: np.fromfile(args.tokens / f"train_{k}.bin", dtype=np.uint16) for k in mix}
    sampler = BatchSampler(streams, mix, args.seq_len, args.seed)
    heldout = {
        k: np.fromfile(args.tokens / f"heldout_{k}.bin", dtype=np.uint16).astype(np.int64)
        for k in KINDS
    }
    eval_batches = {
        k: torch.as_tensor(
            np.asarray(fixed_windows(heldout[k], args.seq_len + 1)[:NUM_EVAL_WINDOWS]),
            device=device,
        )
        for k in KINDS
    }
    ppl_windows = {k: fixed_windows(heldout[k].tolist(), args.seq_len) for k in KINDS}
    num_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = args.batch_size * args.seq_len
    if args.measure:
        measure(model, optimizer, sampler, args, autocast_ctx, device)
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
    elif args.init_from is not None:
        load_init_weights(model, args.init_from)
    log = open(run_dir / "train.log", "a", buffering=1)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        log.write(line + "\n")
        print(line, flush=True)

    goal_ppl: dict[str, float] = {}
    if args.goal_vs is not None:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(args.goal_vs, dtype=torch.float32)
        with turn:
            reference_ppl = heldout_perplexity(reference.to(device), ppl_windows, args.device)
        del reference
        goal_ppl = {k: v * (1.0 - args.goal_margin) for k, v in reference_ppl.items()}

    hardware = hardware_description(args.device, args.threads)
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
                    "init_from": str(args.init_from) if args.init_from else None,
                    "goal_vs": str(args.goal_vs) if args.goal_vs else None,
                },
                "mix": mix,
                "device": args.device,
                "hardware": hardware,
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
                "hardware": hardware,
            }
        )
    if goal_ppl:
        emit({"event": "goal", "step": step, "max_heldout_ppl": goal_ppl})
    model.train()
    last_ckpt = time.perf_counter()
    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    stop_at = min(args.steps, step + args.stop_after_steps) if args.stop_after_steps else args.steps
    reason = "steps"
    while step < stop_at:
        lr = lr_at(step, args.lr, args.warmup_steps, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with turn:
            t0 = time.perf_counter()
            loss = lm_loss(model, torch.as_tensor(sampler.next(), device=device), autocast_ctx)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train_s += time.perf_counter() - t0
        step += 1
        window_loss += loss.item()
        window_steps += 1
        record = None
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
                "waited_s": round(turn.waited_s, 1),
            }
            if step % args.eval_every == 0 or step == args.steps:
                with turn:
                    losses = heldout_losses(model, eval_batches, autocast_ctx)
                record |= {k: round(v, 4) for k, v in losses.items()}
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        if args.ppl_every and (step % args.ppl_every == 0 or step == stop_at):
            with turn:
                ppl = heldout_perplexity(model, ppl_windows, args.device)
            record = (record or {"step": step}) | {
                f"heldout_ppl_{k}": round(v, 2) for k, v in ppl.items()
            }
            if goal_ppl and all(ppl[k] <= goal_ppl[k] for k in KINDS):
                reason = "goal"
        if args.max_train_s and train_s >= args.max_train_s and reason != "goal":
            reason = "budget"
        if record is not None:
            emit(record)
        done_early = reason in ("goal", "budget")
        if (
            time.perf_counter() - last_ckpt >= args.checkpoint_every_s
            or step == stop_at
            or done_early
        ):
            save_checkpoint(ckpt_path, model, optimizer, step, sampler, train_s, args)
            last_ckpt = time.perf_counter()
        if done_early:
            break
    if step < args.steps and reason == "steps":
        emit({"event": "stopped", "step": step, "train_s": round(train_s, 1)})
        return
    model.save_pretrained(run_dir / "final", safe_serialization=True)
    emit(
        {
            "event": "done",
            "step": step,
            "reason": reason,
            "train_s": round(train_s, 1),
            "waited_s": round(turn.waited_s, 1),
            "tokens_seen": step * tokens_per_step,
        }
    )
    log.close()


if __name__ == "__main__":
    main()
