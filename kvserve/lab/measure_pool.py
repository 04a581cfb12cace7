"""The pooled step's host cost on a model's own layer shapes (docs/planning.md, "The pooled step's
host cost on the model's shapes"), for `kvserve plan --measure --measure-model M`.

The tiny decoder's `fused-dispatch` slope (kvserve/lab/measure_engine.py) times layers whose work is
a few microseconds: between them the pool's threads give up spinning at the step's barriers and
sleep on a futex, so the slope swings between ~15-50 us and 570-900 us a layer from run to run.
A model's layers take hundreds of microseconds of GEMV each, and the barriers wait as the real
step's do. So, at each row count, three calls in interleaved rounds (`interleaved_medians_s`):

- the fused step of a random decoder with the model's layer shapes (at most `max_layers` layers,
  a tiny vocabulary, `context` cached tokens),
- the same layers' projections one by one through the fused step's own GEMV
  (`fused_decode.small_linear` on their fp32 panels),
- as many calls on 64 x 64 matrices (the per-call cost of the second, out of its time),

and the host cost of one layer is what the step takes beyond its GEMVs' streaming time and the
tiny decoder's `fused-fixed` (the step outside its layers), over the layers: the planner's
weights term (the same GEMV over the same matrices, `linear:fp32` / `linear-fused:fp32`) plus
these points then add up to the step measured on the model's shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvserve.lab.measure import MeasureConfig, stream_copies
from kvserve.lab.measure_engine import (
    fused_rows,
    interleaved_medians_s,
    linear_shapes,
    measure_engine,
    step_weight_bytes,
    tiny_decoder,
)
from kvserve.lab.plan.engine_points import _interp_log2
from kvserve.lab.plan.hardware import MeasuredPoint

POOL_HOST_ROWS = (1, 4, 16)
# the pooled layers and the head up to the fused step's rows (fused_rows(): 64), so that steps of
# 17-64 rows are priced from their own rows, not held at 16 and bounded by the FLOPs floor
POOL_LAYER_ROWS = (1, 4, 16, 32, 64)


def _gemv_calls(modules: list, rows: int) -> Callable[[], None]:
    """One call of every fp32 projection in `modules` through the fused step's panel GEMV."""
    from kvserve.model import fused_decode

    keep: list = []
    calls = []
    for m in modules:
        desc = fused_decode.linear_descriptor(m, keep)
        if desc is None:
            raise ValueError(f"{type(m).__name__} has no fp32 panels")
        calls.append((desc, torch.randn(rows, m.in_features)))  # [rows, in]

    def call() -> None:
        for desc, x in calls:
            fused_decode.small_linear(desc, x)

    call.keep = keep  # the panels the descriptors point to
    return call


def measure_pool_host(
    cfg: MeasureConfig,
    model,
    fused_fixed: list[tuple[int, float]],
    rows: tuple[int, ...] = POOL_HOST_ROWS,
    max_layers: int = 12,
    context: int = 16,
) -> list[MeasuredPoint]:
    """`fused-dispatch` points (seconds per layer) at `rows` up to the fused step's rows, on the
    layer shapes of `model` (a kvserve.lab.plan.ModelSpec); `fused_fixed`: the tiny decoder's
    (rows, seconds per step outside the layers). [] when the fused step does not run here."""
    from kvserve.model.linear import make_linear

    if not fused_rows() or not fused_fixed:
        return []
    layers = min(model.num_layers, max_layers)
    rows = tuple(n for n in rows if n <= fused_rows())
    make_step, decoder = tiny_decoder(layers, True, context, max(rows), shape=model)
    projections = [
        m
        for layer in decoder.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    tiny = [make_linear(torch.randn(64, 64) / 8, None, None, cfg.device) for _ in projections]
    points = []
    with torch.inference_mode():
        for n in rows:
            steps_before = decoder.fused.num_steps if decoder.fused else 0
            calls = {0: make_step(n), 1: _gemv_calls(projections, n), 2: _gemv_calls(tiny, n)}
            med = interleaved_medians_s(calls, cfg, cfg.dispatch_rounds)
            if not (decoder.fused and decoder.fused.num_steps > steps_before):
                break  # the fused step did not run at n rows
            streaming_s = max(med[1] - med[2], 0.0)
            host_s = med[0] - streaming_s - _interp_log2(tuple(fused_fixed), n)
            points.append(
                MeasuredPoint("fused-dispatch", n, 0.0, 0.0, 0.0, max(0.0, host_s) / layers)
            )
    return points


POOL_LAYER_KIND = "pool-layer:"  # + the block linears' format
HEAD_KIND = "head:"  # + the head's format
SHORT_CONTEXT = 16
# the pooled layers' cache holds this many rows at the longest context; more rows are timed at the
# longest context that many rows' cache holds (64 rows x 2,048 tokens of a 3B model's layers
# would not fit 24 GB)
LONG_CONTEXT_ROWS = 16


def row_contexts(contexts: tuple[int, ...], rows: int, cache_blocks: int) -> tuple[int, ...]:
    """The contexts a step of `rows` rows is timed at when the cache holds `cache_blocks` blocks
    of 16 tokens: each of `contexts`, capped at the most tokens `rows` sequences fit."""
    fits = (cache_blocks // rows - 1) * 16  # each sequence takes context // 16 + 1 blocks
    return tuple(sorted({min(c, max(fits, SHORT_CONTEXT)) for c in contexts}))


def _layer_bytes(model, fmt: str) -> tuple[float, int]:
    """(the planner's bytes of one block's linears in `fmt`, K and V bytes of one cached token of
    one layer, fp32) for a kvserve.lab.plan.ModelSpec."""
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape

    tensor_format = parse_tensor_format(fmt)
    shapes = linear_shapes(MeasureConfig(), model)[:4]  # one layer's q/k/v, o, gate/up, down
    num_bytes = sum(tensor_format.num_bytes(TensorShape("w", "linear", o, i)) for o, i in shapes)
    return num_bytes, 2 * model.num_kv_heads * model.head_dim * 4


def measure_pool_layers(
    cfg: MeasureConfig,
    model,
    fmt: str,
    fused_fixed: list[tuple[int, float]],
    rows: tuple[int, ...] = POOL_LAYER_ROWS,
    max_layers: int = 12,
    contexts: tuple[int, ...] | None = None,
) -> list[MeasuredPoint]:
    """`pool-layer:FMT` points: the pooled step's own time per layer on `model`'s layer shapes with
    block linears in `fmt` (fp32, or quantised by RTN: a quantised decoder of the same shapes), at
    each row count it takes and at `SHORT_CONTEXT` and the longest of `cfg.attention_contexts`
    cached tokens (interleaved rounds; past `LONG_CONTEXT_ROWS` rows the longest context that
    many rows' cache holds: `row_contexts`): (step - `fused-fixed`) / layers. Everything the step
    does in a layer (its GEMVs inside the one OpenMP region, the attention split across the pool's threads,
    the barriers, the host work) is in it, so the planner prices the pooled path's linears and cache
    read from these, not from kernels called alone (docs/planning.md). `bytes_per_s`: the layer's
    weight bytes in `fmt` over the time; `kv_token_bytes`: the K and V bytes of a token of a layer
    (for a plan of another model's shapes). [] when the fused step does not run here."""
    if not fused_rows() or not fused_fixed:
        return []
    scheme = None
    if fmt != "fp32":
        from kvserve.quant.scheme import parse_tensor_scheme

        scheme = parse_tensor_scheme(fmt)

    layer_bytes, kv_token_bytes = _layer_bytes(model, fmt)
    # enough of the model's layers that their weights stream from memory as in its step (12
    # layers of int4 fit in a 32 MiB last-level cache)
    span_layers = stream_copies(layer_bytes, step_weight_bytes(model, fmt), cfg.device)
    layers = min(model.num_layers, max(max_layers, span_layers))
    limit = fused_rows()  # quantised steps take as many rows as fp32 ones
    contexts = tuple(sorted({SHORT_CONTEXT, *(contexts or (max(cfg.attention_contexts),))}))
    rows = tuple(n for n in rows if n <= limit)
    longest = max(contexts)
    per_seq = longest // 16 + 1  # blocks of one sequence at the longest context
    # LONG_CONTEXT_ROWS rows at the longest context, and every row count at SHORT_CONTEXT
    cache_rows = max(
        min(max(rows), LONG_CONTEXT_ROWS), -(-max(rows) * (SHORT_CONTEXT // 16 + 1) // per_seq)
    )
    make_step, decoder = tiny_decoder(layers, True, longest, max(rows), model, scheme, cache_rows)
    cache_blocks = cache_rows * per_seq
    points = []
    with torch.inference_mode():
        for n in rows:
            steps_before = decoder.fused.num_steps if decoder.fused else 0
            at = row_contexts(contexts, n, cache_blocks)
            calls = {c: make_step(n, c) for c in at}
            med = interleaved_medians_s(calls, cfg, cfg.dispatch_rounds)
            if not (decoder.fused and decoder.fused.num_steps > steps_before):
                break  # the fused step did not run at n rows (quantised: more than it takes)
            fixed_s = _interp_log2(tuple(fused_fixed), n)
            for c in at:
                per_layer = max(med[c] - fixed_s, 1e-9) / layers
                points.append(
                    MeasuredPoint(
                        POOL_LAYER_KIND + fmt,
                        n,
                        0.0,
                        layer_bytes / per_layer,
                        0.0,
                        per_layer,
                        c,
                        kv_token_bytes,
                    )
                )
    return points


def measure_head(
    cfg: MeasureConfig, model, fmt: str, rows: tuple[int, ...] = POOL_LAYER_ROWS
) -> list[MeasuredPoint]:
    """`head:FMT` points: the engine's head module (`make_linear`, as the loader builds
    `cpu_head`) over `model`'s vocabulary x hidden matrix in `fmt`, at each row count: its
    planner bytes over the streaming time (the calls' time less a 64 x 64 call's, the per-call
    cost the host points count). One matrix of tens of MB streams at its own rate, not the block
    matrices' (`linear:FMT`)."""
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape
    from kvserve.model.linear import make_linear

    scheme = None
    if fmt != "fp32":
        from kvserve.quant.scheme import parse_tensor_scheme

        scheme = parse_tensor_scheme(fmt)
    v, d = model.vocab_size, model.hidden_size
    num_bytes = parse_tensor_format(fmt).num_bytes(TensorShape("head", "head", v, d))
    # copies called in turn, so that a quantised head (tens of MB) streams from memory as in
    # the model's step, not from the last-level cache
    copies = stream_copies(num_bytes, step_weight_bytes(model, fmt), cfg.device)
    heads = [
        make_linear(torch.randn(v, d) * d**-0.5, None, scheme, cfg.device) for _ in range(copies)
    ]  # [vocab, hidden] each
    tiny = make_linear(torch.randn(64, 64) / 8, None, scheme, cfg.device)
    points = []
    with torch.inference_mode():
        for n in rows:
            x, x_tiny = torch.randn(n, d), torch.randn(n, 64)  # [rows, hidden], [rows, 64]
            turn = itertools.cycle(heads)
            calls = {0: lambda x=x, t=turn: next(t)(x), 1: lambda x=x_tiny: tiny(x)}
            med = interleaved_medians_s(calls, cfg, cfg.dispatch_rounds)
            stream_s = max(med[0] - med[1], 0.05 * med[0])
            points.append(
                MeasuredPoint(
                    HEAD_KIND + fmt,
                    n,
                    2 * v * d * n / stream_s,
                    num_bytes / stream_s,
                    0.0,
                    stream_s,
                )
            )
    return points


def measure_engine_on_model(
    cfg: MeasureConfig,
    formats: tuple[str, ...],
    model,
    budget_s: float = 60.0,
    progress: Callable[[MeasuredPoint], None] | None = None,
) -> list[MeasuredPoint]:
    """`measure_engine` over `model`'s own attention shape and matrices (a kvserve.lab.plan.ModelSpec),
    then the pooled step's host cost per layer on its layer shapes, which replaces the tiny
    decoder's `fused-dispatch` slope (docs/planning.md), and the pooled step's own layers and head
    per format."""
    points = measure_engine(cfg, formats, budget_s, progress, model=model)
    with torch.inference_mode():
        fixed = [(p.num_columns, p.median_s) for p in points if p.kind == "fused-fixed"]
        pooled = measure_pool_host(cfg, model, fixed)
        if pooled:  # replaces the tiny decoder's slope (docs/planning.md)
            points = [p for p in points if p.kind != "fused-dispatch"] + pooled
        for fmt in formats:  # the pooled step's own layers and the head, per format
            pooled += measure_pool_layers(cfg, model, fmt, fixed) + measure_head(cfg, model, fmt)
        points += [p for p in pooled if p.kind != "fused-dispatch"]
        for p in pooled:
            if progress:
                progress(p)
    return points
