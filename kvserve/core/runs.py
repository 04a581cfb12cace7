"""Runs of equal values in an ordered mapping, as one line: how the per-shape kernel table
(kvserve/model/kernel_table.py) is logged at load and shown in the server's banner."""

from __future__ import annotations


def compact_runs(per_key: dict[str, str]) -> str:
    """{"1": "panel", "2": "panel", "128": "onednn"} -> "1-2 panel, 128 onednn"."""
    runs: list[list[str]] = []
    for key, value in per_key.items():
        if runs and runs[-1][2] == value:
            runs[-1][1] = key
        else:
            runs.append([key, key, value])
    return ", ".join(f"{a}-{b} {v}" if a != b else f"{a} {v}" for a, b, v in runs)
