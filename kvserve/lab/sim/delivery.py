"""Delivery jitter: the time between the engine loop handing a token over and the client receiving
it, which moves from token to token (docs/simulator.md, "Delivery jitter").

A token leaves the engine loop at the end of the step that sampled it; the client sees it later,
after the engine-to-HTTP hand-off, the SSE write and its own event loop, all on the same cores as
the engine. The median of that delay is in the request overhead (client TTFT - server TTFT); its
spread is not, and on the 2-core server it is what makes the client's ITL tail: at light load the
client's ITL p90 was 9.1 ms where the steps' p90 was 6.3 ms.

Calibration (`delivery_jitter`) matches each token a bench run received to the step that sampled it
in the server's own step log (`/debug/steps`): a request of P prompt tokens gets its first token
from the step whose prompt chunk ends at P, and its j-th from the step holding its decode chunk at
context P + j - 2. The delay receive - step end is known up to the two clocks' offset, so the jitter
is each delay less the median delay: its quantiles, and the lag-1 correlation of consecutive
tokens' jitter within a request. The simulator (`DeliveryJitter`) adds a draw to each token's time,
correlated along a request as measured (a Gaussian AR(1) mapped through the quantiles), keeping the
tokens in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import NormalDist

import numpy as np

from kvserve.engine.step_log import SAMPLES_FIRST, SAMPLES_LATER
from kvserve.lab.bench.records import RequestRecord
from kvserve.lab.sim.workload import SimError

_NORMAL = NormalDist()
NUM_QUANTILES = 101
MIN_TOKENS = 200  # fewer matched tokens: no jitter term
MIN_REQUESTS = 20  # fewer requests with a matched first token: no intake spread


def _step_ends(steps: Iterable[dict]) -> dict[tuple[int, int], list[float]]:
    """{(position of a token a chunk sampled, 1 if a later output token else 0 for the first):
    [(server-clock end time, number of sequences) of the steps holding such a chunk]}: where each
    token could have come from. A chunk row is (new tokens n, start, what it samples, proposals k)
    (kvserve/engine/step_log.py `chunk_row`): the first token sits at start + n, later ones at
    start + n - k .. start + n. Logs from before the kinds were recorded hold (n, start) only: there
    a one-token chunk after position 0 is read as a decode step and any other as a prompt chunk."""
    ends: dict[tuple[int, int], list[float]] = {}
    for row in steps:
        if not row["chunks"]:
            continue
        end = row["t_start_s"] + row["commands_s"] + row["step_s"] + row["deliver_s"]
        for chunk in row["chunks"]:
            n, start = int(chunk[0]), int(chunk[1])
            if len(chunk) < 4:
                keys = [(n + start, int(n == 1 and start > 0))]
            elif chunk[2] == SAMPLES_FIRST:
                keys = [(n + start, 0)]
            elif chunk[2] == SAMPLES_LATER:
                keys = [(n + start - i, 1) for i in range(int(chunk[3]) + 1)]
            else:
                keys = []
            for key in keys:
                ends.setdefault(key, []).append((end, len(row["chunks"])))
    return ends


def _token_delays(
    record: RequestRecord, ends: dict, offset: float | None
) -> list[tuple[int, float]]:
    """(j, receive time - step end (client clock - server clock)) of each token j (1 = the first)
    of `record`; with `offset`, each token's step is the candidate whose end + offset is nearest
    its receive time, else every candidate's (up to 64 per token: `_clock_offset` finds the true
    one)."""
    prompt = record.num_prompt_tokens_server
    if record.outcome != "ok" or not prompt or not record.events:
        return []
    out, seen = [], 0
    for event in record.events:
        n = event.cum_completion_tokens
        count = n if n is not None else seen + (1 if event.num_chars else 0)
        for j in range(seen + 1, count + 1):
            key = (prompt, 0) if j == 1 else (prompt + j - 1, 1)
            cands = ends.get(key, [])
            if offset is None:
                out += [(j, event.t_s - e) for e, _ in cands[:64]]
            elif cands:
                end, _ = min(cands, key=lambda e: abs(event.t_s - e[0] - offset))
                out.append((j, event.t_s - end))
        seen = max(seen, count)
    return out


def _clock_offset(diffs: list[float], window_s: float = 2e-3) -> float | None:
    """The clocks' offset plus the typical delay: the median of the densest `window_s` of
    receive - step end over every candidate step of every token. The right step of most tokens
    lands in a few milliseconds; other candidates (another request of the same length, another
    run) spread over seconds."""
    if not diffs:
        return None
    d = np.sort(np.asarray(diffs))
    counts = np.searchsorted(d, d + window_s, side="right") - np.arange(len(d))
    i = int(np.argmax(counts))
    return float(np.median(d[i : i + counts[i]]))


def delivery_jitter(records: list[RequestRecord], steps: list[dict]) -> dict | None:
    """The jitter of a bench run's token deliveries against the server's step log (module
    docstring): {"quantiles": jitter in seconds at percentiles 0..100 (median 0),
    "lag1_correlation", "num_tokens", "median_delay_s"}, and with the server's TTFT in the records
    (at least MIN_REQUESTS of them) "intake_quantiles" (each request's client - server TTFT less its
    first token's delay, less their median; docs/simulator.md) and "num_requests"; None when too few
    tokens match."""
    ends = _step_ends(steps)
    offset = _clock_offset([d for r in records for _, d in _token_delays(r, ends, None)])
    if offset is None:
        return None
    pairs_per_request = [_token_delays(r, ends, offset) for r in records]
    per_request = [np.asarray([d for _, d in p]) for p in pairs_per_request]
    matched = [x for d in per_request for x in d]
    if len(matched) < MIN_TOKENS:
        return None
    offset = float(np.median(matched))  # the clocks' offset + the median delay
    # intake: client TTFT - server TTFT less the first token's delivery delay, per request
    intake = []
    for record, delays in zip(records, pairs_per_request, strict=True):
        first = next((d for j, d in delays if j == 1), None)
        gap = ttft_gap_s(record)
        if first is not None and gap is not None:
            intake.append(gap - first)
    jitter, pairs = [], []
    for d in per_request:
        d = d - offset
        jitter += list(d)
        if len(d) > 2:
            pairs += list(zip(d[:-1], d[1:], strict=True))
    j = np.asarray(jitter)
    rho = 0.0
    if len(pairs) > 2:
        a, b = np.asarray(pairs).T
        ra = np.argsort(np.argsort(a)) / len(a)
        rb = np.argsort(np.argsort(b)) / len(b)
        rho = float(np.clip(np.corrcoef(ra, rb)[0, 1], -0.95, 0.95))
    levels = np.linspace(0, 100, NUM_QUANTILES)
    out = {
        "quantiles": [float(q) for q in np.percentile(j, levels)],
        "lag1_correlation": rho,
        "num_tokens": len(j),
        "median_delay_s": offset,
    }
    if len(intake) >= MIN_REQUESTS:
        spread = np.asarray(intake) - np.median(intake)
        out |= {
            "intake_quantiles": [float(q) for q in np.percentile(spread, levels)],
            "num_requests": len(intake),
        }
    return out


def ttft_gap_s(record: RequestRecord) -> float | None:
    """Client TTFT (send to the first text) less the server's TTFT for one completed request: the
    time outside the engine loop (HTTP in, the first token's way out, the client); None if
    unknown."""
    server = (record.extra or {}).get("server_metrics") or {}
    text = [e.t_s for e in record.events if e.num_chars > 0]
    if record.outcome != "ok" or record.t_send_s is None or not text:
        return None
    if server.get("ttft_s") is None:
        return None
    return (text[0] - record.t_send_s) - float(server["ttft_s"])


class DeliveryJitter:
    """Per-token delivery jitter drawn from measured quantiles, AR(1)-correlated along a request
    (seeded per request index, so a request's draws do not depend on the others')."""

    def __init__(
        self,
        quantiles: list[float],
        lag1_correlation: float = 0.0,
        seed: int = 0,
        intake_quantiles: list[float] | None = None,
    ):
        q = np.asarray(quantiles, dtype=float)
        if len(q) < 2 or not (np.diff(q) >= 0).all():
            raise SimError("delivery jitter quantiles must be >= 2 non-decreasing values")
        self._intake = None
        if intake_quantiles is not None:
            iq = np.asarray(intake_quantiles, dtype=float)
            if len(iq) < 2 or not (np.diff(iq) >= 0).all():
                raise SimError("intake quantiles must be >= 2 non-decreasing values")
            self._intake = (iq, np.linspace(0.0, 1.0, len(iq)))
        if not -1 < lag1_correlation < 1:
            raise SimError("the delivery jitter's lag-1 correlation must be in (-1, 1)")
        self._q, self._levels = q, np.linspace(0.0, 1.0, len(q))
        self.rho, self.seed = lag1_correlation, seed
        self._state: dict[int, tuple[np.random.Generator, float]] = {}

    def reset(self) -> None:
        self._state = {}

    def delays_s(self, request_index: int, num_tokens: int) -> list[float]:
        """The jitter of the request's next `num_tokens` tokens (seconds, median 0)."""
        if request_index not in self._state:
            rng = np.random.default_rng((self.seed, request_index))
            self._state[request_index] = (rng, float(rng.standard_normal()))
        rng, z = self._state[request_index]
        out = []
        for _ in range(num_tokens):
            z = self.rho * z + float(np.sqrt(1 - self.rho**2) * rng.standard_normal())
            out.append(float(np.interp(_NORMAL.cdf(z), self._levels, self._q)))
        self._state[request_index] = (rng, z)
        return out

    def intake_s(self, request_index: int) -> float:
        """The request's intake time less the median intake (seconds; 0 without a measured
        spread): drawn once per request from its own seeded stream."""
        if self._intake is None:
            return 0.0
        u = float(np.random.default_rng((self.seed, request_index, 1)).random())
        return float(np.interp(u, self._intake[1], self._intake[0]))

    def describe(self) -> dict:
        out = {
            "kind": "per-token delivery jitter, AR(1) along a request",
            "p1_p50_p99_s": [float(np.interp(p, self._levels, self._q)) for p in (0.01, 0.5, 0.99)],
            "lag1_correlation": self.rho,
        }
        if self._intake is not None:
            iq, levels = self._intake[0], self._intake[1]
            out["intake_p1_p50_p99_s"] = [
                float(np.interp(p, levels, iq)) for p in (0.01, 0.5, 0.99)
            ]
        return out
