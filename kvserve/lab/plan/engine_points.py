"""Interpolation over measured engine points (kvserve/lab/plan/engine_cost.py, docs/planning.md "A
measured engine profile"): in log2 of the rows, linear in context, and the pooled step's layer line."""

from __future__ import annotations

import math

Points = tuple[tuple[int, float], ...]


def _interp_log2(points: Points, x: float) -> float:
    """Linear in log2(x) between measured (x, y) points, constant beyond the ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            f = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + f * (y1 - y0)
    return pts[-1][1]


def _merged(points: Points) -> Points:
    """Sorted by x, points measured at the same x averaged into one."""
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    return tuple(sorted((px, sum(ys) / len(ys)) for px, ys in by_x.items()))


def _interp_linear(points: Points, x: float) -> float:
    """Linear between measured (x, y) points and beyond the ends (the nearest two's slope); points
    at the same x are averaged."""
    pts = _merged(points)
    if len(pts) == 1:
        return pts[0][1] * x / pts[0][0] if pts[0][0] else pts[0][1]
    i = 0
    while i < len(pts) - 2 and x > pts[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


def attention_excess_s(points: Points, context: float) -> float:
    """Seconds per layer the cache read adds at `context` over a zero-length context, from
    (context, seconds per layer) points of one row count: the linear interpolation less its
    intercept at context 0 (clamped to [0, the first point's time])."""
    pts = _merged(points)
    if len(pts) == 1:
        return max(0.0, _interp_linear(pts, context))
    intercept = min(max(0.0, _interp_linear(pts[:2], 0.0)), pts[0][1])
    return max(0.0, _interp_linear(pts, context) - intercept)


def _pool_scales(point, layer_bytes: float, kv_token_bytes: float) -> tuple[float | None, ...]:
    """(a layer of `layer_bytes` weight bytes over the timed layer's, `kv_token_bytes` K and V bytes
    a token over the timed cache's) for a `pool-layer:FMT` point; None where the point does not
    say (an older profile)."""
    measured_bytes = point.bytes_per_s * point.median_s  # the timed layer's weight bytes
    return (
        layer_bytes / measured_bytes if measured_bytes else None,
        kv_token_bytes / point.kv_token_bytes if point.kv_token_bytes else None,
    )


def _timed_as_planned(points: list, layer_bytes: float, kv_token_bytes: float) -> bool:
    """Whether `pool-layer` points were timed on a layer of `layer_bytes` weight bytes and
    `kv_token_bytes` K and V bytes a token (within 1%: the planner's own arithmetic)."""
    scales = _pool_scales(points[0], layer_bytes, kv_token_bytes)
    return all(s is not None and abs(s - 1) < 0.01 for s in scales)


def _pool_layer_fit(
    points: list, layer_bytes: float, kv_token_bytes: float
) -> tuple[tuple[int, float, float], ...]:
    """(rows, seconds per layer at no context, seconds per layer per cached token) from
    `pool-layer:FMT` points (the pooled step's time per layer at two or more contexts), the line
    through the shortest and the longest context, scaled to a layer of `layer_bytes` weight bytes
    and `kv_token_bytes` K and V bytes a token (the measured shapes' are in each point)."""
    by_rows: dict[int, list] = {}
    for p in points:
        by_rows.setdefault(p.num_columns, []).append(p)
    out = []
    for rows, pts in sorted(by_rows.items()):
        pts.sort(key=lambda p: p.context_tokens)
        first, last = pts[0], pts[-1]
        span = last.context_tokens - first.context_tokens
        slope = max(0.0, (last.median_s - first.median_s) / span) if span else 0.0
        intercept = max(0.0, first.median_s - slope * first.context_tokens)
        w_scale, kv_scale = (
            1.0 if s is None else s for s in _pool_scales(first, layer_bytes, kv_token_bytes)
        )
        out.append((rows, intercept * w_scale, slope * kv_scale))
    return tuple(out)


def _side(points: Points, batch: float, boundary: int) -> Points:
    """The points measured on the same side of `boundary` rows as `batch` (another kernel runs
    on the other side); all of them when that side has none or there is no boundary."""
    if not boundary:
        return points
    same = tuple(p for p in points if (p[0] <= boundary) == (batch <= boundary))
    return same or points
