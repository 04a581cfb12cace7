"""benchmarks/peer_llamacpp.py --rounds: the two engines alternate which runs first, and each ratio
is paired within its round (the machine's drift between rounds cancels out of a ratio)."""

from __future__ import annotations

import sys

from tests import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from peer_llamacpp import median_round, paired, ratio_summary, spread  # noqa: E402


def test_rounds_alternate_which_engine_runs_first():
    calls = []

    def ours(n):
        calls.append(("kvserve", n))
        return {"decode_tok_s": 2.0 * n}

    def theirs(n):
        calls.append(("llama.cpp", n))
        return {"decode_tok_s": float(n)}

    rounds = [paired(ours, theirs, 5, r) for r in range(3)]
    assert [c[0] for c in calls] == ["kvserve", "llama.cpp", "llama.cpp", "kvserve", "kvserve",
                                     "llama.cpp"]  # fmt: skip
    assert [r["first"] for r in rounds] == ["kvserve", "llama.cpp", "kvserve"]
    assert all(r["kvserve"]["decode_tok_s"] == 10.0 for r in rounds)


def test_the_ratio_is_the_median_of_the_rounds_paired_ratios():
    # a machine twice as fast in round 1 moves both engines: the paired ratio stays 0.9
    rounds = [{"ratio": 0.9}, {"ratio": 0.9}, {"ratio": 1.5}]
    assert ratio_summary(rounds, ("ratio",)) == {"ratio": 0.9, "ratio_min_max": [0.9, 1.5]}
    assert median_round([{"r": 3}, {"r": 1}, {"r": 2}, {"r": 4}], "r") == {"r": 2}
    assert spread({"ratio_min_max": [0.9, 1.5]}, "ratio") == ", rounds 0.90-1.50"
    assert spread({"ratio_min_max": [1.1, 1.1]}, "ratio") == ""
