"""The team step's host cost on a model's own layer shapes (docs/planning.md, "The team step's
host cost on the model's shapes"), for `kvserve plan --measure --measure-model M`.

The tiny decoder's `fused-dispatch` slope (kvserve/measure_engine.py) times layers whose work is
a few microseconds: between them the team threads give up spinning at the step's barriers and
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

from collections.abc import Callable

import torch

from kvserve.measure import MeasureConfig
from kvserve.measure_engine import _tiny_decoder, fused_rows, interleaved_medians_s
from kvserve.plan.engine_cost import _interp_log2
from kvserve.plan.hardware import MeasuredPoint

TEAM_HOST_ROWS = (1, 4, 16)


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


def measure_team_host(
    cfg: MeasureConfig,
    model,
    fused_fixed: list[tuple[int, float]],
    rows: tuple[int, ...] = TEAM_HOST_ROWS,
    max_layers: int = 12,
    context: int = 16,
) -> list[MeasuredPoint]:
    """`fused-dispatch` points (seconds per layer) at `rows` up to the fused step's rows, on the
    layer shapes of `model` (a kvserve.plan.ModelSpec); `fused_fixed`: the tiny decoder's
    (rows, seconds per step outside the layers). [] when the fused step does not run here."""
    from kvserve.model.linear import make_linear

    if not fused_rows() or not fused_fixed:
        return []
    layers = min(model.num_layers, max_layers)
    rows = tuple(n for n in rows if n <= fused_rows())
    make_step, decoder = _tiny_decoder(layers, True, context, max(rows), shape=model)
    projections = [
        m
        for layer in decoder.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj)
    ]  # fmt: skip
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
