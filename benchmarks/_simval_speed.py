"""Helpers of benchmarks/sim_validation.py: the machine's speed during a measured run, and the
simulator's own spread of a percentile over noise seeds.

On the shared 2-core machine the step cost moved by +25% between the calibration runs and the
measured runs minutes later (the server's own step log shows it: the same kinds of steps, slower),
which no cost model can predict. So each rate reports, beside the a priori and replay predictions:

- `speed`: the mean measured / predicted cost of the steps the server ran during that run
  (kvserve.sim.server_steps.machine_speed), per step class too;
- `replay_at_run_speed`: the replay with the profile scaled by that one number, each metric the
  mean over the noise seeds: the simulator's error once the machine's speed at the time is known (every latency still comes out of the
  simulated scheduler, queueing and step noise; nothing else is taken from the run);
- `seed_band`: min and max of each metric over `--noise-seeds` replays at run speed that differ
  only in the noise seed: how much one run of this many requests moves a p99 by chance.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.sim.cost import StepProfile
from kvserve.sim.server_steps import machine_speed


def speed_corrected(profile: Path, steps: Path, out: Path) -> tuple[dict, Path]:
    base = StepProfile.load(profile)
    speed = machine_speed(base, json.loads(steps.read_text()))
    factor = speed["mean_measured_over_predicted"]
    base.scaled(factor, f"the server's steps during {steps.name}").save(out)
    return speed, out


def seed_mean(summaries: list[dict], metrics, dig) -> dict:
    """A summary-shaped dict holding each metric's mean over the seeds (the prediction)."""
    out: dict = {}
    for _, path in metrics:
        vals = [v for v in (dig(s, path) for s in summaries) if isinstance(v, int | float)]
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = sum(vals) / len(vals) if vals else None
    return out


def seed_band(summaries: list[dict], metrics, dig) -> dict:
    """{metric: {"min": .., "max": ..}} over simulated summaries."""
    out = {}
    for name, path in metrics:
        vals = [v for v in (dig(s, path) for s in summaries) if isinstance(v, int | float)]
        out[name] = {"min": min(vals), "max": max(vals)} if vals else None
    return out


def print_table(results: list[dict], metrics) -> None:
    print(f"{'rate':>5} {'metric':>20} {'measured':>10} {'a priori':>8} {'replay':>8} "
          f"{'@speed':>8} {'seed band @speed':>18}")  # fmt: skip

    def pct(x):
        return "-" if x is None else f"{x:+.0%}"

    for r in results:
        print(f"{r['rate']:>5g} {'machine speed':>20} {r['speed']['mean_measured_over_predicted']:>10.3f}"
              "  (mean measured / predicted step cost during the run)")  # fmt: skip
        for name, _ in metrics:
            a, b, c = r["a_priori"][name], r["replay"][name], r["replay_at_run_speed"][name]
            band, m = r["seed_band"][name], a["measured"]
            rel = (
                "-"
                if not band or not m
                else f"{band['min'] / m - 1:+.0%}..{band['max'] / m - 1:+.0%}"
            )
            print(
                f"{r['rate']:>5g} {name:>20} {m:>10.4g} {pct(a['relative_error']):>8} "
                f"{pct(b['relative_error']):>8} {pct(c['relative_error']):>8} {rel:>18}"
            )
