"""The capacity search, against scripted pass/fail oracles (no network)."""

from __future__ import annotations

import pytest

from kvserve.lab.bench.capacity import Trial, conservative_capacity, find_capacity


def threshold(limit: float):
    calls = []

    def evaluate(rate: float) -> Trial:
        calls.append(rate)
        return Trial(rate, rate <= limit)

    return evaluate, calls


@pytest.mark.parametrize("limit", [0.3, 1.0, 7.3, 100.0])
def test_monotone_oracle_is_bracketed_within_tolerance(limit):
    evaluate, calls = threshold(limit)
    result = find_capacity(evaluate, start_rps=1.0, max_rps=1024.0, rel_tol=0.1, max_trials=20)
    assert result.capacity_rps is not None
    assert limit / 1.1 <= result.capacity_rps <= limit
    assert not result.non_monotonic and not result.lower_bound_only
    assert len(calls) <= 20
    # neighbour checks ran: the boundary was evaluated twice
    assert (
        calls.count(result.capacity_rps) >= 2
        or calls.count(max(r for r in calls if r <= limit)) >= 2
    )


def test_no_failure_up_to_the_maximum_is_only_a_lower_bound():
    evaluate, _ = threshold(1e9)
    result = find_capacity(evaluate, start_rps=1.0, max_rps=16.0)
    assert result.capacity_rps == 16.0 and result.lower_bound_only


def test_everything_failing_gives_no_capacity():
    evaluate, _ = threshold(0.0)
    result = find_capacity(evaluate, start_rps=1.0, max_rps=16.0, max_trials=10)
    assert result.capacity_rps is None


def test_a_noisy_failure_below_a_pass_is_reported_and_caps_the_answer():
    seen: dict[float, int] = {}

    def evaluate(rate: float) -> Trial:
        seen[rate] = seen.get(rate, 0) + 1
        # true limit 10, but the second trial at any rate in (6, 10] fails (noise)
        noisy = 6 < rate <= 10 and seen[rate] == 2
        return Trial(rate, rate <= 10 and not noisy)

    result = find_capacity(evaluate, start_rps=1.0, max_rps=64.0, rel_tol=0.1, max_trials=20)
    assert result.non_monotonic  # a rate passed although it or a lower one failed once
    assert result.capacity_rps is not None and result.capacity_rps <= 10 / 1.1 + 1e-9
    assert conservative_capacity(result.trials) == result.capacity_rps


def test_conservative_capacity():
    trials = (Trial(1, True), Trial(2, True), Trial(4, False), Trial(3, True), Trial(2, False))
    assert conservative_capacity(trials) == 1
    assert conservative_capacity((Trial(1, False),)) is None
