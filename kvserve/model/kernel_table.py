"""Which GEMM runs each linear at each row count: a table measured on this machine, not a guess.

For every distinct (format, out x in) of the served model and every row bucket (1, 2, 4, ... 512;
a call of M rows takes bucket 2^ceil(log2 M), capped at 512), the candidates valid for the weight's
format are timed side by side and the fastest kept, kvserve's own kernel unless another is at least
`SWITCH_MARGIN` faster, from one crossover row count up (`table_choices`):

    format        own kernel                     torch's candidates
    fp32          panel GEMM (fused_decode)      oneDNN packed fp32 ("onednn-f32"), F.linear ("torch-f32")
    bf16 products bf16dot panels                 torch's bf16 GEMM ("onednn-bf16": oneDNN, AMX where the
                                                 probe finds it), only where bf16 runs in hardware
    GGUF blocks   csrc/blocks.c block_linear     dequantise 4 MiB of rows at a time + torch.matmul
                                                 ("dequant-matmul": no resident fp32 copy)

Every candidate keeps its format's numerics class: the fp32 ones multiply and sum in fp32; the bf16
one only serves a scheme that asked for bf16 products (its output is rounded to bf16 by torch, the
one difference from bf16dot's fp32 output). Quantised panels (QuantLinear) keep their own kernel:
a dequantised fp32 copy would cost 4-8x their bytes.

Rows a fused decode step takes (model/fused_decode.py, up to 64) keep the panels of fp32 and bf16
linears: a decode step runs the fused step's GEMVs whatever the table says, and a mixed step of as
many rows must give its decode rows the same bits (docs/determinism.md).

A torch candidate that needs its own copy of the weight (oneDNN's packed layout, a plain fp32 or bf16
matrix) keeps it only when the table chose it for some bucket; the load log says how many bytes.

Timings are cached under the user cache dir (kvserve/paths.py, kind "kernel-table"), keyed by CPU
model and flags, torch version and thread count, then by shape and format: a load measures only what
the cache lacks, for at most `MEASURE_BUDGET_S`; what is left unmeasured keeps the previous fixed rule.
`--kernel-choice` (engine/args.py): measured (the default), remeasure (ignore the cache), own (the
fixed rules, as before the table), torch (torch's candidate wherever one is valid).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.core.runs import compact_runs
from kvserve.model import block_linear, fused_decode
from kvserve.model.block_linear import BlockLinear, dequant_matmul_into
from kvserve.model.kernel_choice import (
    ROW_BUCKETS,
    bucket_index,
    cpu_flags,
    probe_matrix_engine,
    torch_bf16_gemm,
)
from kvserve.model.linear import PackedLinear
from kvserve.paths import cache_dir

logger = logging.getLogger(__name__)

SWITCH_MARGIN = 1.10  # another kernel must be this much faster than kvserve's own to be chosen
MEASURE_BUDGET_S = 2.0  # per load; what is left keeps the fixed rule until a later load measures it
MAX_CALL_S = 0.05  # buckets above one whose call took longer are not timed (table_choices)
ROUNDS = 3  # alternated rounds per bucket; the minimum of each candidate's calls is kept


def choose(timings_s: dict[str, float], own: str, margin: float = SWITCH_MARGIN) -> str:
    """The kernel for one bucket: the fastest, unless kvserve's own `own` is within `margin` of it."""
    best = min(timings_s, key=timings_s.__getitem__)
    if own in timings_s and timings_s[best] * margin > timings_s[own]:
        return own
    return best


@dataclass
class Candidates:
    """One linear's kernels: `own` (the name of kvserve's kernel), and per name a builder returning
    (run: x [M, in] -> [M, out], the bytes of weight it keeps beside the module's own)."""

    key: str  # "576x1536/f32": out x in and the format
    own: str
    builders: dict[str, Callable[[], tuple[Callable[[torch.Tensor], torch.Tensor], int]]]
    floor: int = 0  # buckets below this index keep `own` whatever the timings
    rule_min_rows: int = (
        1 << 30
    )  # the fixed rule: `own` below this many rows, else the first builder

    def rule(self, rows: int) -> str:
        """The kernel the fixed rule runs for `rows` (shown as "<kernel> (rule)" where untimed)."""
        return self.own if rows < self.rule_min_rows else next(iter(self.builders))


def _panel_weight(module: PackedLinear) -> torch.Tensor:
    """[out, in] fp32 from the module's panels (exact: bf16 panels hold bf16 values)."""
    panels = module.panels  # fp32 layout [P, in, 16], bf16 products [P, in_p / 2, 16, 2]
    if module.bf16_products:
        num_panels, half, width, _ = panels.shape
        full = panels.transpose(1, 2).reshape(num_panels * width, half * 2)
        return full[: module.out_features, : module.in_features].float()
    full = panels.transpose(1, 2).reshape(-1, module.in_features)
    return full[: module.out_features].float()


def _packed_candidates(module: PackedLinear) -> Candidates | None:
    if module.panels is None or module.small_rows != -1:
        return None  # oneDNN or torch already runs it (no C kernels, or the portable loops)
    shape = f"{module.out_features}x{module.in_features}"
    bias = module.bias

    def onednn_f32():
        # 16: oneDNN's expected row count, as model/linear.py packs it
        packed = torch.ops.mkldnn._reorder_linear_weight(_panel_weight(module), 16)

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

        return run, module.out_features * module.in_features * 4

    def torch_f32():
        weight = _panel_weight(module).contiguous()
        return (lambda x: F.linear(x, weight, bias)), weight.numel() * 4

    def onednn_bf16():
        weight = _panel_weight(module).to(torch.bfloat16).contiguous()
        bias32 = None if bias is None else bias.float()

        def run(x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x.to(torch.bfloat16), weight).to(x.dtype)
            return y if bias32 is None else y + bias32

        return run, weight.numel() * 2

    # A step of up to max_step_rows decode rows runs the fused step on these panels whatever the
    # table says; a mixed step of as many rows keeps them too, so that those rows get the same bits.
    floor = bucket_index(fused_decode.max_step_rows()) + 1
    if module.bf16_products:
        builders = {"onednn-bf16": onednn_bf16} if torch_bf16_gemm() else {}
        return Candidates(f"{shape}/bf16-products", "bf16dot", builders, floor)
    builders = {"onednn-f32": onednn_f32, "torch-f32": torch_f32}
    if not torch.backends.mkldnn.is_available():
        builders.pop("onednn-f32")
    return Candidates(f"{shape}/f32", "panel-f32", builders, floor)


def _block_candidates(module: BlockLinear) -> Candidates | None:
    if not block_linear.native_available():
        return None  # the dequantise-and-matmul path runs every row count already
    types = ",".join(p.ggml_type for p in module.parts)
    return Candidates(
        f"{module.out_features}x{module.in_features}/{types}",
        "blocks",
        {"dequant-matmul": lambda: (_dequant_runner(module), 0)},
        rule_min_rows=module.dequant_min_rows,
    )


def _dequant_runner(module: BlockLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty(x.shape[0], module.out_features)
        offsets = module.part_offsets
        for part, row0, row1 in zip(module.parts, offsets, offsets[1:], strict=False):
            dequant_matmul_into(part, x, y[:, row0:row1], True)
        return y if module.bias is None else y + module.bias

    return run


def candidates_of(module: nn.Module) -> Candidates | None:
    """The kernels a module may run on, or None for a module the table does not cover."""
    if isinstance(module, PackedLinear):
        return _packed_candidates(module)
    if isinstance(module, BlockLinear):
        return _block_candidates(module)
    return None


def _own_runner(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(module, BlockLinear):
        return lambda x: module.forward_rule(x, use_kernel=True)
    return lambda x: fused_decode.small_linear(module._desc, x)


def _time_call(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    start = time.perf_counter()
    run(x)
    return time.perf_counter() - start


def measure(
    module: nn.Module, runners: dict, deadline: float
) -> dict[int, dict[str, float]] | None:
    """Seconds per call of each candidate at each row bucket (alternated, minimum of ROUNDS), up to
    the first bucket whose call takes over MAX_CALL_S; None when the `deadline` (perf_counter)
    passes first (a partial table would extrapolate from too few rows)."""
    gen = torch.Generator().manual_seed(0)
    table: dict[int, dict[str, float]] = {}
    for rows in ROW_BUCKETS:
        if time.perf_counter() > deadline:
            return None
        x = torch.randn(rows, module.in_features, generator=gen)  # [rows, in]
        best = dict.fromkeys(runners, float("inf"))
        for run in runners.values():
            run(x)  # first-call costs (oneDNN primitive creation) are not the steady state
        for _ in range(ROUNDS):
            for name, run in runners.items():
                best[name] = min(best[name], _time_call(run, x))
        table[rows] = best
        if min(best.values()) > MAX_CALL_S:
            break
    return table


@functools.cache
def _machine_key() -> str:
    """CPU model and flags, torch version: what a timing depends on besides the shape and the
    threads (the file name holds those)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    text = f"{model}|{sorted(cpu_flags())}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_path():
    return cache_dir("kernel-table") / f"{_machine_key()}-t{torch.get_num_threads()}.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(entries: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the table is measured again next time
        logger.info("kernel table: not cached (%s)", exc)


def table_choices(
    timings: dict, own: str, names: list[str], floor: int = 0
) -> tuple[str | None, ...]:
    """Per bucket the kernel from cached `timings` ({"rows": {kernel: s}}): kvserve's own below a
    crossover, from it up the bucket's fastest other kernel, the crossover being the smallest bucket
    (index >= `floor`) from which another kernel wins (`choose`) at every timed bucket. One
    crossover, not a choice per bucket: a noisy timing cannot make the kernel, and with it the
    summation order, flip back and forth between row counts. Buckets above the largest timed one
    take its choice where another kernel had already won, else the fixed rule (None), as every
    bucket does when nothing was timed."""
    timed = [
        i for i, r in enumerate(ROW_BUCKETS) if all(n in timings.get(str(r), {}) for n in names)
    ]
    if not timed:
        return (None,) * len(ROW_BUCKETS)
    picks = {i: choose({n: timings[str(ROW_BUCKETS[i])][n] for n in names}, own) for i in timed}
    crossover = len(ROW_BUCKETS)
    for i in reversed(timed):
        if i < floor or picks[i] == own:
            break
        crossover = i
    out: list[str | None] = []
    for i in range(len(ROW_BUCKETS)):
        timed_at = max((j for j in timed if j <= i), default=timed[0])
        if i > timed[-1] and crossover > timed[-1]:
            out.append(None)  # past the timings with kvserve's kernel still ahead: the fixed rule
        else:
            out.append(picks[timed_at] if i >= crossover else own)
    return tuple(out)


def apply_kernel_choice(
    model: nn.Module, mode: str, budget_s: float = MEASURE_BUDGET_S
) -> dict[str, dict[str, str]]:
    """Give each covered linear of `model` its per-bucket kernels under `mode` (KERNEL_CHOICES) and
    return the table for /manifest, {"out x in/format": {"rows bucket": kernel}}. "own" changes
    nothing (the fixed rules).

    Long: one pass groups the modules by shape and format, measures what the cache lacks within
    the budget, and installs each group's choice; splitting it would pass the same four maps
    around."""
    logger.info("matrix engine: %s", probe_matrix_engine().summary())
    if mode == "own":
        return {}
    groups: dict[str, list[tuple[nn.Module, Candidates]]] = {}
    for module in model.modules():
        cands = candidates_of(module)
        if cands is not None and cands.builders:
            groups.setdefault(cands.key, []).append((module, cands))
    cache = _read_cache()
    deadline = time.perf_counter() + budget_s
    measured = False
    table: dict[str, dict[str, str]] = {}
    extra_bytes = 0
    for key, members in groups.items():
        first, cands = members[0]
        names = [cands.own, *cands.builders]
        if mode == "torch":
            alt = next(iter(cands.builders))
            choices: tuple[str | None, ...] = tuple(
                cands.own if i < cands.floor else alt for i in range(len(ROW_BUCKETS))
            )
        else:
            timings = {} if mode == "remeasure" else cache.get(key, {})
            if not any(str(r) in timings for r in ROW_BUCKETS) and time.perf_counter() < deadline:
                runners = {cands.own: _own_runner(first)}
                runners |= {n: b()[0] for n, b in cands.builders.items()}
                got = measure(first, runners, deadline)
                if got is not None:
                    timings = {str(r): t for r, t in got.items()}
                    cache[key] = timings
                    measured = True
            choices = table_choices(timings, cands.own, names, cands.floor)
        table[key] = {
            str(r): c or f"{cands.rule(r)} (rule)"
            for r, c in zip(ROW_BUCKETS, choices, strict=True)
        }
        for module, mod_cands in members:
            extra_bytes += install(module, mod_cands, choices)
    if measured:
        _write_cache(cache)
    if table:
        logger.info(
            "kernel choice %s: %s; extra weight copies %.1f MiB",
            mode,
            json.dumps(compact_table(table)),
            extra_bytes / 2**20,
        )
    return table


def install(module: nn.Module, cands: Candidates, choices: tuple[str | None, ...]) -> int:
    """Set `module.row_kernels` from per-bucket choices; returns the bytes of copies it keeps."""
    if isinstance(module, BlockLinear):
        # True: the block kernel; None: the fixed rule (dequant_min_rows)
        module.row_kernels = tuple(None if c is None else c == cands.own for c in choices)
        return 0
    built: dict[str, tuple[Callable, int]] = {}
    for name in set(choices) - {None, cands.own}:
        built[name] = cands.builders[name]()
    module.row_kernels = tuple(built[c][0] if c in built else None for c in choices)
    return sum(size for _, size in built.values())


def compact_table(table: dict[str, dict[str, str]]) -> dict[str, str]:
    """{"576x1536/f32": "1-64 panel-f32, 128-512 onednn-f32"}: runs of equal choices."""
    return {key: compact_runs(per_bucket) for key, per_bucket in table.items()}


def matrix_engine_label() -> str:
    """/manifest's `matrix_engine`: "amx-bf16" or "none: <why>" (model/kernel_choice.py)."""
    return probe_matrix_engine().label
