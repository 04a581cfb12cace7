"""`kvserve bench latency`: offline phase-split timing of the in-process engine (docs/load-tests.md).

Over a grid of batch sizes x prompt lengths x output lengths, each point generates a batch of
token-id prompts (no tokenisation on the clock; `detokenize=False`, so no detokenisation either)
in forced-length greedy mode, times every engine step (`LLM.generate_steps`) between device
synchronisations, and splits the steps into the prefill phase (TTFT proxy) and the decode steps (a
distribution). The prefix cache is reset before every iteration, so repeats recompute their prompts.
Warm-up iterations are discarded. Outputs of the same prompt alone and in a batch must be identical; the
first differing position is reported otherwise. Each regime gets a roofline bottleneck from
kvserve.lab.plan's arithmetic and a hardware profile (the measured `this-machine` one by default).

The only module of kvserve.lab.bench that uses the engine (design.md): through the public `LLM` API
and `EngineArgs` only, and imported inside functions (the CLI imports this module to build its
parser).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvserve._version import __version__
from kvserve.engine.args import MODEL_HELP, EngineArgs
from kvserve.lab.bench import phases
from kvserve.lab.bench.records import BenchError
from kvserve.options import HelpFormatter

SCHEMA = "kvserve.lab.bench.latency/1"


@dataclass(frozen=True)
class LatencyConfig:
    """One `bench latency` invocation; `engine_args` holds the engine's options (its model resolved)."""

    model_dir: str
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_lens: tuple[int, ...] = (128,)
    output_lens: tuple[int, ...] = (32,)
    num_iters: int = 3
    num_warmup_iters: int = 1
    num_check_prompts: int = 4  # prompts of each batch compared with themselves alone
    hardware: str = "auto"  # auto (this-machine if measured) | none | a profile name or JSON path
    out_dir: str = "runs/latency"
    plot: bool = True
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    command: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "prompt_lens", "output_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise BenchError(f"--{name.replace('_', '-')} needs integers >= 1, got {values}")
        if self.num_iters < 1 or self.num_warmup_iters < 0 or self.num_check_prompts < 0:
            raise BenchError("need --iters >= 1, --warmup-iters >= 0, --check-prompts >= 0")
        if max(self.batch_sizes) > self.engine_args.max_num_seqs:
            raise BenchError(
                f"batch size {max(self.batch_sizes)} exceeds --max-num-seqs "
                f"{self.engine_args.max_num_seqs}: raise it, or a batch would not run as one batch"
            )

    @property
    def grid(self) -> list[tuple[int, int, int]]:
        return list(itertools.product(self.batch_sizes, self.prompt_lens, self.output_lens))


def make_prompt(seed: int, prompt_len: int, index: int, vocab_size: int, avoid: frozenset[int]):
    """Prompt `index` of length `prompt_len`: the same ids in every batch that holds it."""
    rng = np.random.default_rng([seed, prompt_len, index])
    ids = rng.integers(0, vocab_size, size=prompt_len)
    return [int(t) if int(t) not in avoid else (int(t) + 1) % vocab_size for t in ids]


def _synchronizer(device: str):
    import torch

    if device.startswith("cuda"):
        return torch.cuda.synchronize
    if device.startswith("mps"):
        return torch.mps.synchronize
    return lambda: None


def run_iteration(llm, prompts: list[list[int]], params, sync) -> phases.Iteration:
    """Queue the batch, then time each engine step between synchronisations until all finish."""
    if not llm.reset_prefix_cache():  # repeats must recompute their prompts
        raise BenchError("the prefix cache could not be reset: requests are still running")
    steps = llm.generate_steps(prompts, params)
    started, final, samples = set(), {}, []
    sync()
    t_start = t_end = time.perf_counter()
    while True:
        sync()
        t0 = time.perf_counter()
        changed = next(steps, None)
        sync()
        t_end = time.perf_counter()
        if changed is None:
            break
        num_first = num_decode = num_rows = 0
        for index, out in changed.items():
            n = len(out.outputs[0].delta_token_ids)
            if n and index not in started:
                started.add(index)
                num_first, n = num_first + 1, n - 1
            elif n:
                num_rows += 1  # a request past its first token decoded this step
            num_decode += n
            if out.finished:
                final[index] = out
        samples.append(phases.StepSample(t_end - t0, num_first, num_decode, num_rows))
    if len(final) < len(prompts):
        raise BenchError("the engine stopped with requests unfinished")
    done = [final[i] for i in range(len(prompts))]
    ttft = [
        o.metrics.first_token_time - o.metrics.first_scheduled_time
        for o in done
        if o.metrics.first_token_time is not None and o.metrics.first_scheduled_time is not None
    ]
    gaps = [float(g) for o in done for g in np.diff(o.outputs[0].metrics.token_times)]
    return phases.Iteration(
        split=phases.split_phases(samples, len(prompts)),
        wall_s=t_end - t_start,
        ttft_proxy_s=tuple(ttft),
        itl_engine_s=tuple(gaps),
        output_token_ids=tuple(tuple(o.outputs[0].token_ids) for o in done),
        num_preemptions=sum(o.metrics.num_preemptions for o in done),
    )


def _check_grid(cfg: LatencyConfig, llm) -> None:
    limit, block = llm.max_model_len, llm.config.cache.block_size
    for b, p, o in cfg.grid:
        if p + o > limit:
            raise BenchError(f"prompt {p} + output {o} exceeds the context of {limit} tokens")
        need = b * -(-(p + o) // block)
        if need > llm.num_kv_blocks:
            raise BenchError(
                f"batch {b} x ({p} + {o}) tokens needs {need} KV blocks; the cache has "
                f"{llm.num_kv_blocks}: raise --kv-cache-memory (a batch that does not fit would be "
                "preempted and timed with its recomputation)"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _metadata(cfg: LatencyConfig, llm, hw, hw_reason: str) -> dict:
    import torch

    from kvserve.lab.bench.identity import client_host

    config, model_dir = llm.config, Path(cfg.model_dir)
    device = config.device
    return {
        "schema": SCHEMA,
        "tool": f"kvserve {__version__} bench latency",
        "command": list(cfg.command),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {
            "dir": str(model_dir),
            "config_sha256": _sha256(model_dir / "config.json"),
            "weights_sha256": {p.name: _sha256(p) for p in sorted(model_dir.glob("*.safetensors"))},
        },
        "engine": {
            "dtype": config.dtype,
            "kv_cache_dtype": config.cache.kv_cache_dtype,
            "quantization": config.quantization,
            "device": device,
            "device_name": torch.cuda.get_device_name(device)
            if device.startswith("cuda")
            else None,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "num_kv_blocks": llm.num_kv_blocks,
            "options": cfg.engine_args.options(),
        },
        "hardware_profile": None
        if hw is None
        else {k: v for k, v in hw.to_dict().items() if k != "points"},
        "hardware_profile_source": hw_reason,
        "host": client_host(),
        "method": {
            "mode": "forced length (ignore_eos, min_tokens = max_tokens), greedy, token-id "
            "prompts, detokenize=False: no tokenisation or detokenisation on the clock",
            "timing": "time.perf_counter around each engine step (next(LLM.generate_steps)), with "
            "a device synchronise "
            "before and after on an accelerator",
            "prefill": "steps from the batch's first until every request has its first token: "
            "the prefill forward(s) plus the first sample (TTFT proxy); ttft_proxy_s is the "
            "engine's per-request first_token - first_scheduled",
            "decode": "every later step (one token per running sequence); a distribution, never "
            "averaged with the prefill into one tokens/s",
            "warmup": f"{cfg.num_warmup_iters} iteration(s) per grid point discarded",
            "identical_outputs": f"prompts 0..{cfg.num_check_prompts - 1} of every batch against "
            "the same prompt alone (batch of 1, untimed)",
        },
    }


def run_latency(cfg: LatencyConfig) -> dict:
    """Run the grid; write latency.json (and latency.png); returns the document.

    Long: the grid's loops, with the warm-up and the record of each cell beside the cell."""
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm import LLM
    from kvserve.lab.bench import latency_report
    from kvserve.lab.plan.model import PlanError, load_model

    t0 = time.perf_counter()
    llm = LLM.from_engine_args(replace(cfg.engine_args, model=cfg.model_dir))
    config = llm.config
    _log(f"loaded {cfg.model_dir} on {config.device} in {time.perf_counter() - t0:.1f} s")
    _check_grid(cfg, llm)
    sync = _synchronizer(config.device)
    hw, hw_reason = phases.resolve_hardware(cfg.hardware, config.device)
    try:
        spec = load_model(cfg.model_dir)
    except PlanError as exc:
        spec, hw_reason = None, f"model shape unknown to kvserve.lab.plan: {exc}"
    vocab, avoid = config.model.vocab_size, llm.eos_token_ids
    prompt = lambda p, i: make_prompt(config.seed, p, i, vocab, avoid)
    # token ids in and out: no detokenisation inside the timed steps
    forced = lambda o, **kw: SamplingParams(
        max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0, detokenize=False, **kw
    )
    num_check = min(cfg.num_check_prompts, max(cfg.batch_sizes))
    references = {}  # (P, O) -> [(tokens, top-two per position)] of prompts alone
    for p, o in itertools.product(cfg.prompt_lens, cfg.output_lens):
        refs = []
        for i in range(num_check):
            llm.reset_prefix_cache()  # each reference computes its prompt in full
            c = llm.generate([prompt(p, i)], forced(o, logprobs=2))[0].outputs[0]
            refs.append((tuple(c.token_ids), [lp.top for lp in c.logprobs or ()]))
        references[(p, o)] = refs
    points, mismatches, repeat_mismatches = [], [], []
    for b, p, o in cfg.grid:
        prompts, params = [prompt(p, i) for i in range(b)], forced(o)
        for _ in range(cfg.num_warmup_iters):
            run_iteration(llm, prompts, params, sync)
        iters = [run_iteration(llm, prompts, params, sync) for _ in range(cfg.num_iters)]
        summary = phases.point_summary(b, p, o, iters)
        where = {"batch_size": b, "prompt_len": p, "output_len": o}
        found = []
        for i, (ref, tops) in enumerate(references[(p, o)][:b]):
            if (m := phases.mismatch(ref, iters[0].output_token_ids[i], tops)) is not None:
                found.append(where | {"prompt_index": i} | m)
        mismatches += found
        for k, it in enumerate(iters[1:], start=1):
            for i, (first, again) in enumerate(
                zip(iters[0].output_token_ids, it.output_token_ids, strict=True)
            ):
                if (m := phases.mismatch(first, again)) is not None:
                    repeat_mismatches.append(where | {"prompt_index": i, "iteration": k} | m)
        summary["identical"] = {
            "num_compared_alone": len(references[(p, o)][:b]),
            "num_mismatches": len(found),
        }
        if spec is not None and hw is not None:
            summary["roofline"] = phases.point_roofline(spec, hw, config.dtype, summary)
            summary["bottleneck"] = phases.bottleneck(summary["roofline"])
        else:
            summary["roofline"] = None
            summary["bottleneck"] = {"prefill": "unknown", "decode": "unknown", "why": hw_reason}
        points.append(summary)
        _log(latency_report.point_line(summary))
    doc = {
        **_metadata(cfg, llm, hw, hw_reason),
        "grid": {
            "batch_sizes": list(cfg.batch_sizes),
            "prompt_lens": list(cfg.prompt_lens),
            "output_lens": list(cfg.output_lens),
            "num_iters": cfg.num_iters,
            "num_warmup_iters": cfg.num_warmup_iters,
        },
        "points": points,
        "identical_outputs": {
            "num_compared": sum(pt["identical"]["num_compared_alone"] for pt in points),
            "num_mismatches": len(mismatches),
            "all_identical": not mismatches,
            "mismatches": mismatches,
            "num_repeat_mismatches": len(repeat_mismatches),
            "repeat_mismatches": repeat_mismatches,
        },
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from kvserve.lab.bench.summary import json_safe

    (out / "latency.json").write_text(json.dumps(json_safe(doc), indent=1), encoding="utf-8")
    if cfg.plot:
        (out / "latency.png").write_bytes(latency_report.plot(doc))
    print(latency_report.table(doc), flush=True)
    _log(f"wrote {out}/latency.json" + (", latency.png" if cfg.plot else ""))
    return doc


def _log(msg: str) -> None:
    sys.stderr.write(f"[bench latency] {msg}\n")


# --- command line -------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "latency",
        help="offline phase-split timing of the in-process engine over a batch x length grid",
        description=__doc__.split("\n\n")[1],
        epilog="example:\n  kvserve bench latency --model DIR --batch-sizes 1,4,16 --prompt-lens 32,256 "
        "--output-lens 32\n  (writes latency.json and latency.png to --out)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=None, help=MODEL_HELP + " (default: smollm2-135m-instruct)")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 8), help="e.g. 1,4,16")
    p.add_argument("--prompt-lens", type=_ints, default=(128,), help="prompt tokens, e.g. 32,256")
    p.add_argument("--output-lens", type=_ints, default=(32,), help="generated tokens, e.g. 32")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per grid point")
    p.add_argument("--warmup-iters", type=int, default=1, help="discarded iterations per point")
    p.add_argument(
        "--check-prompts",
        type=int,
        default=4,
        help="prompts of each batch checked against themselves alone (greedy)",
    )
    p.add_argument(
        "--require-identical",
        action="store_true",
        help="exit 1 when a batched output differs from the same prompt alone",
    )
    p.add_argument(
        "--hardware",
        default="auto",
        help="roofline profile: auto (the measured this-machine one, if it exists and "
        "matches --device), none, a built-in name (h100-sxm, ...) or a profile JSON",
    )
    p.add_argument("--out", default=None, help="output directory (default runs/latency-<time>)")
    p.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write latency plots next to the results",
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvserve.core.errors import KVServeError

    try:
        from kvserve.models import resolve_model

        model = str(resolve_model(args.model))
        cfg = LatencyConfig(
            model_dir=model,
            batch_sizes=args.batch_sizes,
            prompt_lens=args.prompt_lens,
            output_lens=args.output_lens,
            num_iters=args.iters,
            num_warmup_iters=args.warmup_iters,
            num_check_prompts=args.check_prompts,
            hardware=args.hardware,
            out_dir=args.out or os.path.join("runs", time.strftime("latency-%Y%m%d-%H%M%S")),
            plot=args.plot,
            engine_args=EngineArgs.from_cli_args(args, model=model),
            command=tuple(sys.argv),
        )
        doc = run_latency(cfg)
    except (BenchError, KVServeError) as exc:
        print(f"kvserve bench latency: error: {exc}", file=sys.stderr)
        return 2
    if args.require_identical and not doc["identical_outputs"]["all_identical"]:
        return 1
    return 0
