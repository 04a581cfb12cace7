"""Calibrating from a live server's own steps (`GET /debug/steps`), not from offline `step()` calls.

The server's engine thread logs every iteration (kvserve.engine.step_log): applying queued
commands (intake), `engine.step()` (schedule, forward, sample, detokenise) and handing outputs to
the HTTP side (streaming). Their sum is the step's cost while serving: on a shared CPU it includes
the HTTP thread's share of the interpreter and the cores, which an offline calibration misses
(the simulator was 15-20% optimistic with it). The fit adds a per-new-request term (intake), keeps
its residuals as step noise, and records the per-request time outside the loop
(`request_overhead_s`: the client's TTFT less the server's, over a bench run) so that TTFT
includes it (docs/simulator.md).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvserve.lab.bench.records import RequestRecord
from kvserve.lab.sim.cost import DEFAULT_FEATURES, ChunkLoad, StepLoad, StepProfile, step_kind
from kvserve.lab.sim.delivery import ttft_gap_s
from kvserve.lab.sim.fit import fit_profile
from kvserve.lab.sim.workload import SimError

SERVER_FEATURES = DEFAULT_FEATURES + ("num_new_requests",)


def loads_and_costs(steps: Iterable[dict]) -> tuple[list[StepLoad], list[float]]:
    """(what each non-empty step computed, its cost while serving in seconds). The cost is the
    time from the iteration's start to the next one's, less the next one's idle sleep: all the
    loop spent on this step, waits for the interpreter between its timed parts included; the
    last logged step, without a successor, counts its timed parts only."""
    rows = list(steps)
    loads, costs = [], []
    for row, nxt in zip(rows, (rows[1:] + [None]) if rows else [], strict=True):
        if not row["chunks"]:
            continue
        timed = float(row["commands_s"] + row["step_s"] + row["deliver_s"])
        cost = timed
        if nxt is not None and nxt["index"] == row["index"] + 1:
            cost = max(timed, nxt["t_start_s"] - row["t_start_s"] - nxt["waited_s"])
        loads.append(StepLoad(tuple(ChunkLoad(int(c[0]), int(c[1])) for c in row["chunks"])))
        costs.append(cost)
    return loads, costs


def timed_intake_s(steps: Iterable[dict]) -> float | None:
    """The server's own intake time per new request: the time its loop spent applying queued
    commands (`commands_s`) in steps that took new requests, over those requests; None without
    any. The fitted `num_new_requests` cost is meant to be this; the fit cannot tell it from a
    fixed cost per prompt (on a calibration where most prompt steps take one new request the two
    are collinear), so the profile keeps both and the calibration prints them side by side. A
    diagnostic: a step's commands other than new requests count too, and a request counts in the
    step that first schedules it."""
    total_s, count = 0.0, 0
    for row in steps:
        new = sum(1 for c in row.get("chunks", []) if int(c[1]) == 0)
        if new:
            total_s += float(row["commands_s"])
            count += new
    return total_s / count if count else None


def request_overhead_s(records: Iterable[RequestRecord]) -> float | None:
    """Median of client TTFT - server TTFT over a bench run's completed requests: the time a
    request spends outside the engine loop (HTTP in, SSE out, the client), None if unknown."""
    gaps = [g for g in map(ttft_gap_s, records) if g is not None]
    return statistics.median(gaps) if gaps else None


PICKUP_MIN_REQUESTS = 10  # fewer requests with a server queue time: no pickup latency


def pickup_s(records: Iterable[RequestRecord]) -> float | None:
    """The idle engine's pickup latency: the 10th percentile of the server's queue time (arrival
    at the engine client to the first step that schedules it) over a bench run's completed
    requests. A request that finds the engine idle waits only for the engine thread to take it
    up (1.2 ms at 0.5 req/s on the 2-core EPYC, demo model); the lowest decile are those, in a
    run at a light rate (in a saturating one every queue time is the queue's). None with fewer
    than PICKUP_MIN_REQUESTS known."""
    queue = [
        float(q)
        for r in records
        if r.outcome == "ok"
        and (q := ((r.extra or {}).get("server_metrics") or {}).get("queue_time_s")) is not None
    ]
    if len(queue) < PICKUP_MIN_REQUESTS:
        return None
    return float(statistics.quantiles(queue, n=10, method="inclusive")[0])


def fit_server_profile(
    doc: dict[str, Any],
    overhead_s: float | None = None,
    features: tuple[str, ...] = SERVER_FEATURES,
    delivery: dict | None = None,
    pickup: float | None = None,
) -> StepProfile:
    """A step profile from a `/debug/steps` answer (and the request overhead and the delivery
    jitter, kvserve.lab.sim.delivery, when measured)."""
    loads, costs = loads_and_costs(doc.get("steps", []))
    if len(loads) < 4 * len(features):
        raise SimError(
            f"the server logged {len(loads)} non-empty steps: load it first (e.g. a short "
            "kvserve bench serve run), then calibrate"
        )
    meta = {
        "engine": doc.get("engine", {}),
        "source": "server /debug/steps (commands + step + deliver per iteration)",
        "request_overhead_s": overhead_s or 0.0,
        "pickup_s": pickup or 0.0,
        "intake_timed_s_per_request": timed_intake_s(doc.get("steps", [])),
    } | ({"delivery_jitter": delivery} if delivery else {})
    return fit_profile(loads, costs, features, meta=meta)


def machine_speed(profile: StepProfile, doc: dict[str, Any]) -> dict[str, Any]:
    """How the steps a server logged (a `/debug/steps` answer) compare with what `profile`
    predicts for the same steps: the mean and median of measured / predicted overall, the mean
    per step class (`by_class`, kvserve.lab.sim.noise.noise_class) and per kind (`by_kind`,
    kvserve.lab.sim.cost.step_kind: prefill, decode). A mean far from 1 says the machine ran at
    another speed than at calibration (other jobs on a shared CPU), whatever the workload."""
    import numpy as np

    from kvserve.lab.sim.noise import noise_class

    loads, costs = loads_and_costs(doc.get("steps", []))
    if not loads:
        raise SimError("no non-empty steps to compare")
    ratio = np.array([c / max(profile.load_s(s), 1e-9) for s, c in zip(loads, costs, strict=True)])

    def by(names: np.ndarray) -> dict[str, dict[str, Any]]:
        return {
            n: {
                "num_steps": int((names == n).sum()),
                "mean_measured_over_predicted": float(ratio[names == n].mean()),
            }
            for n in sorted(set(names))
        }

    return {
        "num_steps": len(loads),
        "mean_measured_over_predicted": float(ratio.mean()),
        "median_measured_over_predicted": float(np.median(ratio)),
        "by_class": by(np.array([noise_class(s) for s in loads])),
        "by_kind": by(np.array([step_kind(s) for s in loads])),
    }


def fetch_steps(base_url: str, since: int = 0, timeout_s: float = 60.0) -> dict[str, Any]:
    import httpx

    url = base_url.rstrip("/").removesuffix("/v1") + "/debug/steps"
    try:
        resp = httpx.get(url, params={"since": since}, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        raise SimError(f"cannot reach {url}: {exc}") from exc
    if resp.status_code != 200:
        raise SimError(f"{url}: HTTP {resp.status_code} (a kvserve server exposes /debug/steps)")
    return resp.json()


def load_steps(source: str, since: int = 0) -> dict[str, Any]:
    """A `/debug/steps` document from a server URL or a saved JSON file."""
    if source.startswith(("http://", "https://")):
        return fetch_steps(source, since)
    try:
        doc = json.loads(Path(source).read_text())
    except (OSError, ValueError) as exc:
        raise SimError(f"cannot read steps {source}: {exc}") from exc
    doc["steps"] = [s for s in doc.get("steps", []) if s.get("index", 0) >= since]
    return doc


def calibrate_server_main(args: Any) -> str:
    """`kvserve simulate --calibrate-server URL|FILE`: fit, judge against the bound, save like
    `--calibrate`; returns the profile path."""
    import sys

    from kvserve.lab.bench.records import read_jsonl
    from kvserve.lab.sim.delivery import delivery_jitter
    from kvserve.lab.sim.fit import FitBound, judge_fit

    out = sys.stderr if args.json else sys.stdout
    doc = load_steps(args.calibrate_server, args.steps_since)
    overhead, delivery, pickup = None, None, None
    if args.calibrate_run:
        records = read_jsonl(Path(args.calibrate_run) / "requests.jsonl")
        overhead = request_overhead_s(records)
        delivery = delivery_jitter(records, doc.get("steps", []))
        pickup = pickup_s(records)
    profile = fit_server_profile(doc, overhead, delivery=delivery, pickup=pickup)
    fit = profile.meta["fit"]
    bound = FitBound(args.max_fit_error, args.max_fit_p90_error)
    coef = ", ".join(f"{f}={c:.3g}" for f, c in zip(profile.features, profile.coef_s, strict=True))
    print(
        f"server fit over {fit['num_steps']} steps: median |rel err| "
        f"{fit['median_abs_rel_error']:.1%}, p90 {fit['p90_abs_rel_error']:.1%}; request "
        f"overhead {profile.request_overhead_s * 1e3:.1f} ms; idle pickup "
        f"{profile.pickup_s * 1e3:.2f} ms; seconds per unit: {coef}",
        file=out,
    )
    timed = profile.meta.get("intake_timed_s_per_request")
    if timed is not None and "num_new_requests" in profile.features:
        fitted = profile.coef_s[profile.features.index("num_new_requests")]
        print(
            f"per new request: fitted {fitted * 1e3:.2f} ms; server-timed intake "
            f"{timed * 1e3:.2f} ms"
            + (
                " (the fit could not tell prompt work from a per-request cost)"
                if fitted > 2 * timed + 1e-4
                else ""
            ),
            file=out,
        )
    if delivery:
        q = delivery["quantiles"]
        print(
            f"delivery jitter over {delivery['num_tokens']} tokens: p50 {q[50] * 1e3:.2f} ms, "
            f"p90 {q[90] * 1e3:.2f} ms, p99 {q[99] * 1e3:.2f} ms, lag-1 correlation "
            f"{delivery['lag1_correlation']:.2f}",
            file=out,
        )
    bad = judge_fit(profile, bound, args.accept_poor_fit)
    path = profile.save(args.save)
    if bad:
        print(f"WARNING: POOR FIT ({'; '.join(bad)}), saved anyway to {path}", file=sys.stderr)
    print(f"saved to {path}", file=out)
    return str(path)
