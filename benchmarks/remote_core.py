"""The per-message cost of an engine core on another host against a local one (docs/parallel.md,
"Engine cores on other hosts").

Three ways for one API-side client (kvserve.engine.mp_client.MPClient) to reach one engine core:

  local           the core is the client's child, over ZMQ ipc sockets (`kvserve serve`'s default)
  remote-lo       `kvserve engine-core` on 127.0.0.1 of the client's host: TCP over loopback, the
                  HMAC-tagged frames and the core host's relay (its ipc hop) included
  remote-veth     `kvserve engine-core` in another network namespace, over a veth pair (tests/netns.py)

Measured for each: (1) the round trip of a utility call (`reset_prefix_cache`: one message each way
and a wake-up of the core's loop), median and p90 of 300 after 20 warm-up; (2) the gaps between the
deltas of one greedy request of 64 tokens (one CoreOutputs message per step), median of the gaps of
5 requests; (3) TTFT (add to first delta) and E2E of 40 greedy requests of 16 tokens, one at a
time, median. The model is tests/checkpoints.py's tiny Llama (hidden 64), so a step costs little and
the link's share shows. remote-veth needs root (network namespaces); without it that row is skipped.

`--link` instead measures the remote core across the namespaces at the link settings of
benchmarks/multihost_link.py (the bare veth, 0.2 ms round trip + 10 Gbit/s, 1 ms + 1 Gbit/s: the
delay by benchmarks/link_delay.py in both namespaces, the rate by tbf), beside a local core, rounds
alternating local, veth, 0.2ms-10gbit, 1ms-1gbit. Planned: the planner's `--remote-core-latency-us
US` adds 2 x US to TTFT and E2E (kvserve.lab.plan.planner._remote_core); US = the per-message cost
calibrated on the bare veth ((TTFT remote - TTFT local) / 2) + the setting's measured one-way delay
(the round trip of small TCP messages minus the bare veth's, halved), and, as docs/parallel.md
advises, 150 us + the one-way delay.

  sudo python benchmarks/remote_core.py --out benchmarks/results/zen3_avx2/remote_core.json
  sudo python benchmarks/remote_core.py --link --rounds 2 \
      --out benchmarks/results/zen3_avx2/session_1208/remote_core_link.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = "remote-core-benchmark-secret-0123456789"
ENGINE = ("--max-model-len", "256", "--num-blocks", "256", "--block-size", "16")
PORT = 29650
NUM_CALLS, NUM_WARMUP = 300, 20
NUM_TOKENS, NUM_REQUESTS = 64, 5
NUM_TTFT, TTFT_TOKENS = 40, 16
DOC_MESSAGE_US = 150.0  # docs/parallel.md: the link, its tags and the relay, per message on a veth


def _start_core(command_prefix: list[str], model_dir: Path, host: str, log: Path):
    argv = [*command_prefix, sys.executable, "-m", "kvserve", "engine-core", str(model_dir),
            "--host", host, "--port", str(PORT), *ENGINE]  # fmt: skip
    env = {**os.environ, "KVSERVE_DIST_SECRET": SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(config, remote: list[str]) -> dict:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.mp_client import MPClient

    client = MPClient(config, num_cores=0 if remote else 1, remote_cores=remote)
    try:
        rtts = []
        for i in range(NUM_WARMUP + NUM_CALLS):
            t0 = time.perf_counter()
            client.call("reset_prefix_cache")
            if i >= NUM_WARMUP:
                rtts.append(time.perf_counter() - t0)
        params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)

        async def one(request_id: str) -> list[float]:
            times = []
            stream = client.add(request_id, list(range(1, 33)), params)
            async for _ in stream:
                times.append(time.perf_counter())
            return [b - a for a, b in zip(times, times[1:], strict=False)]

        gaps = []
        for r in range(NUM_REQUESTS):
            gaps += asyncio.run(one(f"r{r}"))
        short = SamplingParams(max_tokens=TTFT_TOKENS, temperature=0, ignore_eos=True)

        async def timed(request_id: str) -> tuple[float, float]:
            t0 = time.perf_counter()
            first = None
            async for _ in client.add(request_id, list(range(1, 33)), short):
                first = first or time.perf_counter()
            return first - t0, time.perf_counter() - t0

        ttfts, e2es = zip(*(asyncio.run(timed(f"t{r}")) for r in range(NUM_TTFT)), strict=True)
        return {
            "ttft_ms_median": statistics.median(ttfts) * 1e3,
            "e2e_ms_median": statistics.median(e2es) * 1e3,
            "rtt_us_median": statistics.median(rtts) * 1e6,
            "rtt_us_p90": _percentile(rtts, 0.9) * 1e6,
            "delta_gap_ms_median": statistics.median(gaps) * 1e3,
            "delta_gap_ms_p90": _percentile(gaps, 0.9) * 1e3,
            "num_calls": NUM_CALLS,
            "num_gaps": len(gaps),
        }
    finally:
        client.shutdown()


def _bench_model() -> tuple[Path, Path, object]:
    """The shared secret and one thread per process set, a work directory, the small GPT-2-tokenized
    model in it and its engine config: (work, model_dir, config)."""
    from kvserve.engine.args import build_engine_config
    from tests.checkpoints import build_gpt2_tokenized_checkpoint

    os.environ["KVSERVE_DIST_SECRET"] = SECRET
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="kvserve-remote-bench-"))
    model_dir = work / "model"
    build_gpt2_tokenized_checkpoint(model_dir)
    config = build_engine_config(model_dir, max_model_len=256, num_blocks=256, block_size=16)
    return work, model_dir, config


def run(out: Path | None) -> dict:
    from tests.netns import NetnsUnavailable, two_hosts

    work, model_dir, config = _bench_model()
    rows: dict[str, dict] = {"local": measure(config, [])}
    core = _start_core([], model_dir, "127.0.0.1", work / "lo.log")
    try:
        rows["remote-lo"] = measure(config, [f"127.0.0.1:{PORT}"])
    finally:
        core.kill()
        core.wait()
    note = ""
    try:
        with two_hosts() as (a, b):
            core = _start_core(b.command(), model_dir, b.address, work / "veth.log")
            try:  # this client in A: its sockets are opened by a thread inside A's namespace
                with a.executor(1) as pool:
                    rows["remote-veth"] = pool.submit(
                        measure, config, [f"{b.address}:{PORT}"]
                    ).result()
            finally:
                core.kill()
                core.wait()
    except NetnsUnavailable as exc:
        note = f"remote-veth skipped: {exc}"
    result = {
        "benchmark": "remote_core",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "model": "tests/checkpoints.py tiny Llama (hidden 64, GPT-2 tokenizer), fp32",
        "rows": rows,
        "note": note,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_link(rounds: int, out: Path) -> dict:
    """Long: rounds of a local core and a remote core across two namespaces at each link setting
    (benchmarks/multihost_link.py's), with the round trip of the link measured per setting."""
    from benchmarks.link_delay import check_available
    from benchmarks.multihost_link import SETTINGS, _delayed, _rtt_us, calibrated_link, shape
    from tests.netns import two_hosts

    check_available()
    work, model_dir, config = _bench_model()
    report: dict = {"benchmark": "remote_core --link", "cpus": os.cpu_count(), "runs": [],
                    "early_us": {}}  # fmt: skip
    with two_hosts() as (a, b), calibrated_link(a, b) as (pool, early_us):
        report["early_us"] = early_us
        for round_index in range(rounds):
            row = measure(config, []) | {"setting": "local", "round": round_index}
            row["load_average"] = os.getloadavg()
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
            for name, setting in SETTINGS.items():
                delay_us, rate = setting if setting is not None else (None, None)
                for host in (a, b):
                    shape(host, rate)
                early = report["early_us"].get(delay_us, 0.0)
                with _delayed(a, b, delay_us, early):
                    rtt = _rtt_us(pool, b)
                    log = work / f"core-{round_index}-{name}.log"
                    core = _start_core(b.command(), model_dir, b.address, log)
                    try:
                        row = pool.submit(measure, config, [f"{b.address}:{PORT}"]).result()
                    finally:
                        core.kill()
                        core.wait()
                row |= {"setting": name, "round": round_index, "rtt_us": rtt,
                        "delay_us": delay_us, "rate_bit_s": rate, "early_us": early,
                        "load_average": os.getloadavg()}  # fmt: skip
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
    report["planned"] = plan_link(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def plan_link(report: dict) -> dict:
    """Measured overheads of the remote core over the local one per setting against 2 x US, US the
    per-message cost (calibrated on the bare veth, or the docs' 150 us) + the measured one-way
    delay. Each overhead is paired within its round (remote minus that round's local core), then
    the median over the rounds: the machine's load drifts between rounds more than the link adds."""
    runs = report["runs"]
    local = {r["round"]: r for r in runs if r["setting"] == "local"}

    def overhead(name: str, key: str) -> float:
        return statistics.median(
            r[key] - local[r["round"]][key] for r in runs if r["setting"] == name
        )

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["setting"] == name)

    bare_rtt = med("veth", "rtt_us")
    message_us = max(0.0, overhead("veth", "ttft_ms_median") * 1e3 / 2)
    result = {"local_ttft_ms": med("local", "ttft_ms_median"),
              "local_e2e_ms": med("local", "e2e_ms_median"),
              "local_utility_rtt_us": med("local", "rtt_us_median"),
              "message_us_calibrated": message_us, "settings": {}}  # fmt: skip
    for name in dict.fromkeys(r["setting"] for r in runs if r["setting"] != "local"):
        one_way = max(0.0, (med(name, "rtt_us") - bare_rtt) / 2)
        result["settings"][name] = {
            "rtt_us": med(name, "rtt_us"),
            "one_way_delay_us": one_way,
            "remote_core_latency_us": message_us + one_way,
            "ttft_overhead_ms": overhead(name, "ttft_ms_median"),
            "e2e_overhead_ms": overhead(name, "e2e_ms_median"),
            "utility_rtt_overhead_ms": overhead(name, "rtt_us_median") / 1e3,
            "overhead_ms_planned": 2 * (message_us + one_way) / 1e3,
            "overhead_ms_planned_doc": 2 * (DOC_MESSAGE_US + one_way) / 1e3,
            "delta_gap_ms": med(name, "delta_gap_ms_median"),
            "load_average": [r["load_average"][0] for r in runs if r["setting"] == name],
        }
    return result


def table_link(report: dict) -> str:
    planned = report["planned"]

    def cell(measured: float, expected: float) -> str:
        if expected <= 0:
            return f"{measured:.2f} / {expected:.2f}"
        return f"{measured:.2f} / {expected:.2f} ({(measured - expected) / expected * 100:+.0f}%)"

    lines = [
        f"Local core: TTFT {planned['local_ttft_ms']:.2f} ms, E2E ({TTFT_TOKENS} tokens) "
        f"{planned['local_e2e_ms']:.2f} ms, utility round trip {planned['local_utility_rtt_us']:.0f} us (medians over the rounds); per-message cost calibrated on the bare veth "
        f"{planned['message_us_calibrated']:.0f} us.\n",
        "| link (each direction) | one-way delay measured | --remote-core-latency-us | TTFT "
        "overhead, ms: measured / planned | E2E overhead | utility round trip overhead | planned "
        "with 150 us + delay: TTFT | gap between deltas | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in planned["settings"].items():
        lines.append(
            f"| {name} | {s['one_way_delay_us']:.0f} us | {s['remote_core_latency_us']:.0f} | "
            f"{cell(s['ttft_overhead_ms'], s['overhead_ms_planned'])} | "
            f"{cell(s['e2e_overhead_ms'], s['overhead_ms_planned'])} | "
            f"{cell(s['utility_rtt_overhead_ms'], s['overhead_ms_planned'])} | "
            f"{cell(s['ttft_overhead_ms'], s['overhead_ms_planned_doc'])} | "
            f"{s['delta_gap_ms']:.2f} ms | "
            + ", ".join(f"{v:.1f}" for v in s["load_average"])
            + " |"
        )
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = ["| path | utility round trip: median / p90 | gap between deltas: median / p90 |",
             "|---|---|---|"]  # fmt: skip
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['rtt_us_median']:.0f} / {row['rtt_us_p90']:.0f} us | "
            f"{row['delta_gap_ms_median']:.2f} / {row['delta_gap_ms_p90']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="reprint a result file's table")
    parser.add_argument("--link", action="store_true", help="the remote core at the link settings")
    parser.add_argument("--rounds", type=int, default=2, help="--link: visits of every setting (2)")
    args = parser.parse_args()
    if args.table is not None:
        report = json.loads(args.table.read_text())
        print(table_link(report) if "planned" in report else table(report))
        return
    if args.link:
        from benchmarks.link_delay import DelayUnavailable

        if args.out is None:
            parser.error("--link needs --out")
        try:
            print(table_link(run_link(args.rounds, args.out)))
        except DelayUnavailable as exc:
            sys.exit(f"remote_core: cannot delay the link: {exc}")
        return
    result = run(args.out)
    print(table(result))
    if result["note"]:
        print(result["note"])


if __name__ == "__main__":
    main()
