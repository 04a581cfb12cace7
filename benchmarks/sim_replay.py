"""Re-calibrate and replay a finished `benchmarks/sim_validation.py` run from its saved artifacts,
without a server: the calibration runs' step log and first run (`server_steps.json`,
`calibration_rate_1/`) are fitted again with this tree's simulator (`kvserve simulate
--calibrate-server`, the delivery jitter included), and each held-out validation run is replayed
at its own machine speed per kind of step, the median over 9 noise seeds, as sim_validation.py
reports `@speed`. So a change to
the cost model is checked against the same measured runs (docs/simulator.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sim_replay.py benchmarks/results/tmp/sim_validation \\
        --json benchmarks/results/sim_replay.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._simval_speed import (  # noqa: E402
    at_speed_results,
    replays_at_speed,
    seed_band,
    speed_corrected,
)
from benchmarks.sim_validation import METRICS, compare, dig, simulate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", help="a sim_validation.py --out directory")
    p.add_argument("--rates", default="0.5,1.5,inf")
    p.add_argument("--calibration-run", default="calibration_rate_1")
    p.add_argument("--noise-seeds", type=int, default=9)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tmp" / "sim_replay"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sim_replay.json"))
    args = p.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    art, out = Path(args.artifacts), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = out / "profile.json"
    cmd = [sys.executable, "-m", "kvserve", "simulate", "--calibrate-server",
           str(art / "server_steps.json"), "--calibrate-run", str(art / args.calibration_run),
           "--save", str(profile), "--accept-poor-fit"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    results = []
    for rate in args.rates.split(","):
        run = art / f"bench_rate_{rate}"
        measured = json.loads((run / "summary.json").read_text())
        steps = art / f"server_steps_rate_{rate}.json"
        speed, at_speed, at_one = speed_corrected(profile, steps, out, rate)
        trace = run / "requests.jsonl"
        runs, one_runs = replays_at_speed(at_speed, at_one, trace, out, rate, args.noise_seeds,
                                          simulate)  # fmt: skip
        row = {"rate": float(rate), "speed": speed,
               **at_speed_results(runs, one_runs, measured, METRICS, dig, compare),
               "seed_band": seed_band(runs, METRICS, dig)}  # fmt: skip
        results.append(row)
        errors = " ".join(
            f"{k} {v['relative_error']:+.0%}" for k, v in row["replay_at_run_speed"].items()
        )
        print(f"rate {rate}: speed {speed['mean_measured_over_predicted']:.3f}; {errors}")
    fit = json.loads(profile.read_text())
    doc = {
        "what": "sim_validation.py's held-out runs replayed at run speed with a profile fitted "
        "again from the same calibration artifacts by this tree",
        "artifacts": str(art),
        "calibration_fit": {k: v for k, v in fit["fit"].items() if "quantiles" not in k},
        "delivery_jitter": {
            k: v for k, v in fit.get("delivery_jitter", {}).items() if k != "quantiles"
        },
        "results": results,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
