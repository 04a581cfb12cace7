"""Arrival processes: seeded schedules reproduce; rate and gap CV match the requested process.

Tolerances come from sampling noise. For n gamma(k) gaps, the relative standard error of the
realised rate is 1/sqrt(k n), and by the delta method the standard error of the sample CV is
sqrt((k + 1) / (2 k^2 n)) (1/sqrt(n) for Poisson). The checks allow 5 standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.lab.bench.arrivals import (
    ArrivalSpec,
    gamma_offsets,
    gap_stats,
    load_trace,
    schedule,
    unit_gaps,
)
from kvserve.lab.bench.records import BenchError

N = 20_000


def test_seeded_schedules_reproduce_and_extend():
    a = gamma_offsets(500, 4.0, 1.0, seed=7)
    assert np.array_equal(a, gamma_offsets(500, 4.0, 1.0, seed=7))
    assert not np.array_equal(a, gamma_offsets(500, 4.0, 1.0, seed=8))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    # a longer schedule starts with the shorter one (blocks of one stream), across block boundaries
    longer = gamma_offsets(9000, 4.0, 1.0, seed=7)
    assert np.array_equal(longer[:500], a)
    assert np.array_equal(unit_gaps(5000, 1.0, 3), unit_gaps(9000, 1.0, 3)[:5000])
    # a sweep's rates share one pattern, scaled
    assert np.allclose(gamma_offsets(500, 8.0, 1.0, seed=7), a / 2)


@pytest.mark.parametrize("k", [1.0, 0.25, 4.0])
def test_gamma_rate_and_gap_cv_match(k):
    rate = 5.0
    stats = gap_stats(gamma_offsets(N + 1, rate, k, seed=11))
    rate_se = rate / math.sqrt(k * N)
    assert abs(stats["rate"] - rate) < 5 * rate_se
    cv_se = math.sqrt((k + 1) / (2 * k * k * N))
    assert abs(stats["gap_cv"] - 1 / math.sqrt(k)) < 5 * cv_se


def test_poisson_counts_in_windows_are_poisson():
    # counts per 1 s window at rate 5: mean 5 and variance 5 (index of dispersion 1)
    t = gamma_offsets(N, 5.0, 1.0, seed=2)
    counts = np.bincount(t.astype(int))[:-1]
    n = len(counts)
    assert abs(counts.mean() - 5.0) < 5 * math.sqrt(5.0 / n)
    # var of the sample variance of Poisson(5) counts ~ (mu + 2 mu^2) / n
    assert abs(counts.var(ddof=1) - 5.0) < 5 * math.sqrt((5.0 + 2 * 25.0) / n)


def test_schedule_warmup_duration_and_count():
    spec = ArrivalSpec("gamma", rate=10.0)
    full = schedule(spec, seed=1, num_warmup=3, num_requests=50, duration_s=None)
    assert len(full) == 53
    assert full == schedule(spec, seed=1, num_warmup=3, num_requests=50, duration_s=None)
    timed = schedule(spec, seed=1, num_warmup=3, num_requests=None, duration_s=2.0)
    measured = np.asarray(timed[3:])
    assert measured[-1] - measured[0] < 2.0
    m = min(len(timed), len(full))
    assert timed[:m] == full[:m]  # same seed, same arrivals, whatever decides where the run stops
    both = schedule(spec, seed=1, num_warmup=3, num_requests=5, duration_s=100.0)
    assert len(both) == 8
    assert schedule(ArrivalSpec("inf"), 0, 2, 4, None) == (0.0,) * 6
    assert schedule(ArrivalSpec("closed", max_concurrency=2), 0, 0, 4, None) is None
    with pytest.raises(BenchError):
        schedule(ArrivalSpec("inf"), 0, 0, None, 5.0)


def test_trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '# comment\n10.0\n{"timestamp": 10.5, "input_len": 7}\n{"t": 12, "output_len": 3}\n'
    )
    trace = load_trace(path)
    assert trace.offsets_s == (0.0, 0.5, 2.0)
    assert trace.lengths == ((None, None), (7, None), (None, 3))
    spec = ArrivalSpec("trace", trace_path=str(path))
    assert schedule(spec, 0, 1, None, 1.0) == (0.0, 0.5)
    path.write_text("3\n2\n")
    with pytest.raises(BenchError, match="must not decrease"):
        load_trace(path)


def test_arrival_spec_validation():
    with pytest.raises(BenchError):
        ArrivalSpec("gamma", rate=0.0)
    with pytest.raises(BenchError):
        ArrivalSpec("closed")
    assert ArrivalSpec("gamma", rate=2.0).with_rate(math.inf).kind == "inf"
    assert (
        ArrivalSpec("gamma", rate=2.0, burstiness=0.5).describe()["process"] == "gamma(shape=0.5)"
    )
    assert ArrivalSpec("gamma", rate=2.0).describe()["process"] == "poisson"
