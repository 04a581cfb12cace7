"""The planner's price of a delayed, rate-shaped cross-host link against what two network-namespace
hosts measure (kvserve.lab.plan.parallel; docs/parallel.md, "Across hosts: the link, planned vs
measured").

Two hosts are network namespaces joined by a veth pair (tests/netns.py; needs root), each pinned to
one core (taskset). This kernel has no sch_netem, so the delay is benchmarks/link_delay.py (an
NFQUEUE rule on each veth's OUTPUT and a process per namespace that accepts every packet D us after
it read it) and the rate is `tbf` on both veth ends. Settings (each direction):

  veth           the bare veth (its own latency: the calibration)
  0.2ms-10gbit   D = 100 us (0.2 ms round trip) + tbf rate 10gbit
  1ms-1gbit      D = 500 us (1 ms round trip) + tbf rate 1gbit

The delayer's own latency (reading a packet after the kernel queued it, waking after a deadline) is
measured once at the start (a TCP ping-pong with the delay uncompensated) and taken off its
deadlines; each setting's real one-way delay is then measured again in every round (the median round
trip of 200 small TCP messages, minus the bare veth's, halved) and is what the plan prices.

Each round visits every setting in turn (A B C A B C ...); per setting, benchmarks/multihost_tp.py
measures (1) a bare gloo all-reduce between the hosts at [1, 8, 64] x 576 fp32 (2.3, 18, 147 kB;
median of 50 after 5 warm-up) and the logits gather, and (2) the engine's decode steps at TP = 2
across the hosts (random SmolLM2-135M-shaped fp32 Llama, 6 heads of 96 so that it splits 2 ways;
B = 1 and 8, median of 12 steps after 3; "collectives" is the time rank 0 spends inside the 61
all-reduces and the gather).

Planned: the planner's formulas, `allreduce_s` / `gather_s` / `TensorParallelComm.step_s`, i.e. what
`kvserve plan --tensor-parallel 2 --link-latency-us L --link-bandwidth BW` prices, with L = the
software's own cost per ring step (calibrated on the veth rows) + the setting's measured one-way
delay, and BW = the rate (in series with the software's per-byte cost for the bare-calibrated
columns). Two calibrations of the software's L: *bare* (a least-squares line through the three bare
all-reduce sizes on the veth) and *engine* (what makes the formula equal the engine's own collectives
per step on the veth, per batch). Planned step = the veth step + (planned - veth) collectives.

  sudo python benchmarks/multihost_link.py --rounds 2 \
      --out benchmarks/results/zen3_avx2/session_1208/multihost_link.json
  python benchmarks/multihost_link.py --out FILE --table   # reprint the table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.link_delay import DelayUnavailable  # noqa: E402
from benchmarks.multihost_tp import (  # noqa: E402
    MESSAGE_ROWS,
    MODEL_SHAPE,
    VOCAB,
    _python,
    _run_pair,
)

# name: (one-way delay in us, tbf rate in bit/s); None: the bare veth
SETTINGS: dict[str, tuple[float, float] | None] = {
    "veth": None,
    "0.2ms-10gbit": (100.0, 10e9),
    "1ms-1gbit": (500.0, 1e9),
}
NUM_PINGS = 200
GLOO_DELAYS_PER_STEP = 2  # one-way delays per ring step: the receiver's recv-ready notice, the data
BATCHES = (1, 8)
WORLD = 2
VOCAB_PADDED = -(-VOCAB // WORLD) * WORLD  # the gathered logits: ceil(V / N) per rank


def _allreduces(run: dict) -> list[dict]:
    return [x for x in run["allreduce"] if "op" not in x]


def _gather_ms(run: dict) -> list[float]:
    return [x["ms_median"] for x in run["allreduce"] if x.get("op") == "gather"]


def shape(host, rate_bit_s: float | None) -> str:
    """tbf at `rate_bit_s` on the host's veth (None: unshaped). The burst is what the rate sends in
    100 us (at least two 1500-byte frames): a small bucket, so a message is paced at the rate instead
    of passing whole in the bucket's burst, yet at 10 Gbit/s large enough (125 kB) for one 64 kB GSO
    packet, which tbf would otherwise split into frames (measured: 3.7 instead of 7 Gbit/s)."""
    tc = ("tc", "-n", host.namespace, "qdisc")
    subprocess.run([*tc, "del", "dev", host.veth, "root"], capture_output=True, timeout=20)
    if rate_bit_s is None:
        return "none"
    burst = max(3000, int(rate_bit_s / 8 * 100e-6))
    argv = [*tc, "add", "dev", host.veth, "root", "tbf", "rate", f"{rate_bit_s:.0f}bit",
            "burst", str(burst), "latency", "50ms"]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=20)
    return " ".join(argv[3:])


def netem_available(host) -> str:
    """What `tc ... netem` answers here (kept in the report: why the delay is link_delay.py)."""
    argv = ["tc", "-n", host.namespace, "qdisc", "add", "dev", host.veth, "root", "netem",
            "delay", "1ms"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    subprocess.run(["tc", "-n", host.namespace, "qdisc", "del", "dev", host.veth, "root"],
                   capture_output=True, timeout=20)  # fmt: skip
    return "available" if result.returncode == 0 else result.stderr.strip()


def _rtt_us(pool, b) -> float:
    """Median round trip of small TCP messages from this pool's host to b (link_calibrate's echo)."""
    from benchmarks import link_calibrate

    link_calibrate.NUM_PINGS = NUM_PINGS
    return pool.submit(link_calibrate.ping_pong, b.address).result()["rtt_us_median"]


def _delayed(a, b, delay_us: float | None, early_us: float):
    """link_delay.py in both hosts (each direction delayed), or nothing for delay_us None."""
    from benchmarks.link_delay import Delayer

    stack = contextlib.ExitStack()
    if delay_us:
        stack.enter_context(Delayer(a, delay_us, 21, early_us))
        stack.enter_context(Delayer(b, delay_us, 22, early_us))
    return stack


@contextlib.contextmanager
def calibrated_link(a, b):
    """link_calibrate's echo server in host b and a one-thread pool in host a to time the link's
    round trip; first the delayer's own latency per delay of SETTINGS (measured uncompensated, to be
    taken off its deadlines). Yields (pool, {delay_us: early_us}); shapes both hosts back to bare and
    stops the echo server on the way out."""
    echo = subprocess.Popen(
        b.command(sys.executable, str(ROOT / "benchmarks" / "link_calibrate.py"), "--serve"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pool = None
    try:
        if echo.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server in host B did not start")
        pool = a.executor(1)
        bare_rtt = _rtt_us(pool, b)
        early: dict = {}
        for setting in SETTINGS.values():
            if setting is not None and setting[0] not in early:
                with _delayed(a, b, setting[0], 0.0):
                    raw = _rtt_us(pool, b)
                early[setting[0]] = max(0.0, (raw - bare_rtt) / 2 - setting[0])
        print(json.dumps({"bare_rtt_us": bare_rtt, "early_us": early}), flush=True)
        yield pool, early
        for host in (a, b):
            shape(host, None)
    finally:
        echo.stdin.close()
        echo.wait(timeout=20)
        if pool is not None:
            pool.shutdown()


def measure(rounds: int, out: Path) -> dict:
    """Long: the rounds over every setting, each a pair of collective ranks and a TP = 2 engine
    run across the namespaces, with the delayers and tbf set for the setting."""
    from benchmarks.link_delay import check_available
    from tests.checkpoints import build_checkpoint
    from tests.netns import two_hosts

    check_available()
    work = Path(tempfile.mkdtemp(prefix="kvserve-link-"))
    model_dir = work / "smol-shaped"
    build_checkpoint(model_dir, "llama_tied", vocab_size=VOCAB, **MODEL_SHAPE)
    worker = str(ROOT / "benchmarks" / "multihost_tp.py")
    flags = ["--num-blocks", "256", "--block-size", "16", "--max-model-len", "512"]
    report = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "model": MODEL_SHAPE | {"vocab_size": VOCAB, "dtype": "float32"},
              "world_size": WORLD, "runs": [], "early_us": {}}  # fmt: skip
    with two_hosts() as (a, b), calibrated_link(a, b) as (pool, early_us):
        report["netem"] = netem_available(a)
        report["early_us"] = early_us
        port = 29700
        for round_index in range(rounds):
            for name, setting in SETTINGS.items():
                delay_us, rate = setting if setting is not None else (None, None)
                shaping = [shape(host, rate) for host in (a, b)][0]
                early = report["early_us"].get(delay_us, 0.0)
                with _delayed(a, b, delay_us, early):
                    rtt = _rtt_us(pool, b)
                    port += 2
                    coll, eng = work / f"coll-{port}.json", work / f"eng-{port}.json"
                    store = f"{a.address}:{port}"
                    _run_pair(
                        a.command(*_python(worker, "--out", str(coll), "--role", "collective",
                                           "--rank", "0", "--address", a.address, "--store",
                                           store)),
                        b.command(*_python(worker, "--out", str(coll), "--role", "collective",
                                           "--rank", "1", "--address", b.address, "--store",
                                           store, cpu=1)),
                    )  # fmt: skip
                    addr = f"{a.address}:{port + 1}"
                    _run_pair(
                        a.command(*_python(worker, "--out", str(eng), "--role", "engine",
                                           "--model", str(model_dir), "--addr", addr)),
                        b.command(*_python("-m", "kvserve", "tp-node", str(model_dir), *flags,
                                           "--tensor-parallel-size", "2", "--nnodes", "2",
                                           "--node-rank", "1", "--dist-init-addr", addr,
                                           cpu=1)),
                    )  # fmt: skip
                run = {"round": round_index, "setting": name, "delay_us": delay_us,
                       "early_us": early, "rate_bit_s": rate, "shaping": shaping, "rtt_us": rtt,
                       "allreduce": json.loads(coll.read_text()),
                       "engine": json.loads(eng.read_text()),
                       "load_average": os.getloadavg()}  # fmt: skip
                report["runs"].append(run)
                print(json.dumps({k: run[k] for k in ("round", "setting", "rtt_us",
                                                      "load_average")}), flush=True)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _median(runs: list[dict], name: str, pick) -> list[float]:
    """Per message size (or batch), the median over the rounds of setting `name`."""
    values = [pick(r) for r in runs if r["setting"] == name]
    return [statistics.median(column) for column in zip(*values, strict=True)]


def plan(report: dict) -> dict:
    """Long: measured (medians over rounds) and planned numbers per setting; the planned latency per
    ring step is the software's own (calibrated on the veth rows, two ways) plus the setting's
    measured one-way delay."""
    from kvserve.lab.plan.model import ModelSpec
    from kvserve.lab.plan.parallel import (
        Interconnect,
        TensorParallelComm,
        allreduce_s,
        gather_s,
    )

    runs = report["runs"]
    d = report["model"]["hidden_size"]
    sizes = [rows * d * 4 for rows in MESSAGE_ROWS]
    bare = _median(runs, "veth", lambda r: [x["ms_median"] * 1e-3 for x in _allreduces(r)])
    # least squares: t = a + c x over the three sizes; a = 2 (N-1) L, c = 2 (N-1)/N / BW_sw
    mx, my = statistics.fmean(sizes), statistics.fmean(bare)
    c = sum((x - mx) * (y - my) for x, y in zip(sizes, bare, strict=True)) / sum(
        (x - mx) ** 2 for x in sizes
    )
    c = max(c, 1e-15)  # a flat or falling line: no per-byte software cost measured
    a = max(0.0, my - c * mx)  # a line through noise may cross below zero: no negative latency
    n = report["world_size"]
    latency_s = a / (2 * (n - 1))
    software_bw = 2 * (n - 1) / n / c
    m = report["model"]
    spec = ModelSpec(
        name="smol-shaped", num_layers=m["num_hidden_layers"], hidden_size=d,
        num_heads=m["num_attention_heads"], num_kv_heads=m["num_key_value_heads"],
        head_dim=m["head_dim"], intermediate_size=m["intermediate_size"], vocab_size=m["vocab_size"],
        tie_word_embeddings=True, max_position_embeddings=m["max_position_embeddings"],
    )  # fmt: skip
    bare_steps = _median(runs, "veth", lambda r: [x["step_ms_median"] for x in r["engine"]])
    bare_comm = _median(runs, "veth", lambda r: [x["comm_ms_per_step"] for x in r["engine"]])
    bare_rtt_us = statistics.median(r["rtt_us"] for r in runs if r["setting"] == "veth")
    ring_steps = (2 * spec.num_layers + 1) * 2 * (n - 1) + (n - 1)
    engine_latency_s = [ms * 1e-3 / ring_steps for ms in bare_comm]
    result = {"latency_us": latency_s * 1e6, "software_bandwidth_gb_s": software_bw / 1e9,
              "engine_latency_us": [x * 1e6 for x in engine_latency_s],
              "bare_rtt_us": bare_rtt_us, "settings": {}}  # fmt: skip
    for name, setting in SETTINGS.items():
        if not any(r["setting"] == name for r in runs):
            continue
        rate = None if setting is None else setting[1]
        rtt_us = statistics.median(r["rtt_us"] for r in runs if r["setting"] == name)
        one_way_s = max(0.0, (rtt_us - bare_rtt_us) / 2) * 1e-6
        bw = software_bw if rate is None else 1 / (1 / software_bw + 8 / rate)

        def comm_ms(latency_s: float, bandwidth: float, name: str = name) -> list[float]:
            link = Interconnect(name, bandwidth, latency_s)
            comm = TensorParallelComm(spec, n, link, activation_bytes=4.0)
            return [comm.step_s(batch, batch) * 1e3 for batch in BATCHES]

        # gloo's TCP transport sends only once the peer has posted its receive (a NOTIFY_RECV_READY
        # message), so a ring step pays the delay twice: the notice, then the data
        link = Interconnect(name, bw, latency_s + GLOO_DELAYS_PER_STEP * one_way_s)
        wire = [comm_ms(lat + one_way_s, (rate or 1e18) / 8) for lat in engine_latency_s]
        gloo = [comm_ms(lat + GLOO_DELAYS_PER_STEP * one_way_s, (rate or 1e18) / 8)
                for lat in engine_latency_s]  # fmt: skip
        engine_wire = [wire[i][i] for i in range(len(BATCHES))]
        engine_gloo = [gloo[i][i] for i in range(len(BATCHES))]
        result["settings"][name] = {
            "delay_us_target": None if setting is None else setting[0],
            "rtt_us": rtt_us,
            "one_way_delay_us": one_way_s * 1e6,
            "link_bandwidth_gb_s": bw / 1e9,
            "link_latency_us": link.latency_s * 1e6,
            "allreduce_ms": _median(runs, name, lambda r: [x["ms_median"] for x in _allreduces(r)]),
            "allreduce_ms_planned": [allreduce_s(n, s, link) * 1e3 for s in sizes],
            "gather_ms": _median(runs, name, _gather_ms),
            "gather_ms_planned": [gather_s(n, 8 * VOCAB_PADDED * 4, link) * 1e3],
            "comm_ms": _median(runs, name, lambda r: [x["comm_ms_per_step"] for x in r["engine"]]),
            "comm_ms_planned_bare_calibrated": comm_ms(link.latency_s, bw),
            "comm_ms_planned_wire": engine_wire,
            "comm_ms_planned": engine_gloo,
            "step_ms": _median(runs, name, lambda r: [x["step_ms_median"] for x in r["engine"]]),
            "step_ms_planned": [
                s - c0 + p for s, c0, p in zip(bare_steps, bare_comm, engine_gloo, strict=True)
            ],
            "load_average": [r["load_average"][0] for r in runs if r["setting"] == name],
        }
    return result


def render_table(report: dict) -> str:
    """docs/parallel.md's table: measured / planned (error) per cell; the 18 kB all-reduce is in
    the JSON (`planned.settings.*.allreduce_ms`)."""
    planned = report["planned"]

    def cell(measured: float, expected: float) -> str:
        return f"{measured:.2f} / {expected:.2f} ({(measured - expected) / expected * 100:+.0f}%)"

    lines = [
        "| link (each direction) | one-way delay: target / measured | all-reduce 2.3 kB, ms | "
        "147 kB | logits gather 804 kB | collectives per step B=1, ms | B=8 | the same, one "
        "delay per ring step: B=1 | B=8 | decode step B=1, ms | B=8 | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in planned["settings"].items():
        target = "-" if s["delay_us_target"] is None else f"{s['delay_us_target']:.0f}"
        row = [name, f"{target} / {s['one_way_delay_us']:.0f} us"]
        row.append(cell(s["allreduce_ms"][0], s["allreduce_ms_planned"][0]))
        row.append(cell(s["allreduce_ms"][-1], s["allreduce_ms_planned"][-1]))
        row.append(cell(s["gather_ms"][0], s["gather_ms_planned"][0]))
        row += [cell(m, e) for m, e in zip(s["comm_ms"], s["comm_ms_planned"], strict=True)]
        wire = s["comm_ms_planned_wire"]
        row += [cell(m, e) for m, e in zip(s["comm_ms"], wire, strict=True)]
        row += [cell(m, e) for m, e in zip(s["step_ms"], s["step_ms_planned"], strict=True)]
        row.append(", ".join(f"{v:.1f}" for v in s["load_average"]))
        lines.append("| " + " | ".join(row) + " |")
    lines.append(
        f"\nCalibrated on the veth rows: latency per ring step {planned['latency_us']:.0f} us bare, "
        + "/".join(f"{x:.0f}" for x in planned["engine_latency_us"])
        + " us engine (B = 1 / 8); "
        + (
            "no software per-byte cost measured (a flat line)"
            if planned["software_bandwidth_gb_s"] > 1e3
            else f"software per-byte cost as {planned['software_bandwidth_gb_s'] * 8:.2f} Gbit/s "
            "in series with the rate"
        )
        + f"; bare round trip {planned['bare_rtt_us']:.0f} us; delayer compensation "
        + ", ".join(f"{k} us: -{v:.0f} us" for k, v in report.get("early_us", {}).items())
        + f"; netem: {report.get('netem')}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--rounds", type=int, default=2, help="visits of every setting (2)")
    args = parser.parse_args()
    if args.table:
        report = json.loads(args.out.read_text())
    else:
        try:
            report = measure(args.rounds, args.out)
        except DelayUnavailable as exc:
            sys.exit(f"multihost_link: cannot delay the link: {exc}")
    report["planned"] = plan(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(render_table(report))


if __name__ == "__main__":
    main()
