"""What benchmarks/link_delay.py really adds to a link between two network-namespace hosts: the
round trip of small TCP messages and the throughput of one bulk TCP transfer, with and without the
delayer, with and without tbf (docs/parallel.md, "Across hosts: the link, planned vs measured").

Settings (each direction; the delayer runs in both namespaces):

  veth            the bare veth
  delay-D         link_delay.py at D us per direction, first uncompensated, then with its own
                  latency (the excess over D measured uncompensated, per direction) taken off
  0.2ms-10gbit    D = 100 us compensated + tbf 10gbit
  1ms-1gbit       D = 500 us compensated + tbf 1gbit
  10gbit, 1gbit   tbf alone

Round trip: 64-byte TCP_NODELAY ping-pong, median / p10 / p90 of 400 after 40 warm-up. Throughput:
one TCP stream sending 1 MiB writes for 1.5 s, bytes the receiver acknowledged / time.

  sudo python benchmarks/link_calibrate.py \
      --out benchmarks/results/zen3_avx2/session_1208/link_calibrate.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.link_delay import Delayer, DelayUnavailable, check_available  # noqa: E402

PORT = 7790
NUM_PINGS, NUM_WARMUP = 400, 40
BULK_S = 1.5
DELAYS_US = (100, 500)


def serve() -> None:
    """In the far namespace: echo on PORT, sink on PORT + 1 (answers the byte count at EOF)."""
    import threading

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(64):
            conn.sendall(data)
        conn.close()

    def sink(conn: socket.socket) -> None:
        total = 0
        while data := conn.recv(1 << 20):
            total += len(data)
        conn.sendall(str(total).encode())
        conn.close()

    for port, handler in ((PORT, echo), (PORT + 1, sink)):
        listener = socket.create_server(("0.0.0.0", port))

        def loop(listener=listener, handler=handler) -> None:
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=handler, args=(conn,), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def ping_pong(address: str) -> dict:
    with socket.create_connection((address, PORT), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for i in range(NUM_WARMUP + NUM_PINGS):
            t0 = time.perf_counter()
            conn.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(conn.recv(64 - got))
            if i >= NUM_WARMUP:
                rtts.append((time.perf_counter() - t0) * 1e6)
    rtts.sort()
    return {"rtt_us_median": statistics.median(rtts), "rtt_us_p10": rtts[len(rtts) // 10],
            "rtt_us_p90": rtts[int(0.9 * len(rtts))]}  # fmt: skip


def bulk(address: str) -> dict:
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((address, PORT + 1), timeout=30) as conn:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < BULK_S:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        received = int(conn.recv(64))
        elapsed = time.perf_counter() - t0
    return {"gbit_s": received * 8 / elapsed / 1e9, "bytes": received, "seconds": elapsed}


def measure(out: Path) -> dict:
    from benchmarks.multihost_link import shape
    from tests.netns import two_hosts

    report = {"load_average_start": os.getloadavg(), "settings": {}}
    with two_hosts() as (a, b):
        server = subprocess.Popen(b.command(sys.executable, __file__, "--serve"),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert server.stdout.readline().strip() == "ready"
        pool = a.executor(1)

        def one(name: str, delay_us: float, early_us: float, rate: float | None) -> dict:
            for host in (a, b):
                shape(host, rate)
            row: dict = {"delay_us": delay_us, "early_us": early_us, "rate_bit_s": rate}
            if delay_us:
                with (
                    Delayer(a, delay_us, 11, early_us) as da,
                    Delayer(b, delay_us, 12, early_us) as db,
                ):
                    row |= pool.submit(ping_pong, b.address).result()
                    row |= pool.submit(bulk, b.address).result()
                row["delayer"] = [da.counts, db.counts]
            else:
                row |= pool.submit(ping_pong, b.address).result()
                row |= pool.submit(bulk, b.address).result()
            row["load_average"] = os.getloadavg()
            report["settings"][name] = row
            print(name, json.dumps({k: v for k, v in row.items() if k != "delayer"}), flush=True)
            return row

        bare = one("veth", 0, 0, None)["rtt_us_median"]
        early = {}
        for delay in DELAYS_US:
            raw = one(f"delay-{delay}-raw", delay, 0, None)["rtt_us_median"]
            early[delay] = max(0.0, (raw - bare) / 2 - delay)
            one(f"delay-{delay}", delay, early[delay], None)
        one("0.2ms-10gbit", 100, early[100], 10e9)
        one("1ms-1gbit", 500, early[500], 1e9)
        one("10gbit", 0, 0, 10e9)
        one("1gbit", 0, 0, 1e9)
        for host in (a, b):
            shape(host, None)
        server.stdin.close()
        server.wait(timeout=20)
        pool.shutdown()
    report["early_us"] = early
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def table(report: dict) -> str:
    bare = report["settings"]["veth"]["rtt_us_median"]
    lines = ["| setting | target added RTT | RTT median (p10-p90) | added RTT | throughput | "
             "delayer late median / p99 | load avg |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in report["settings"].items():
        late = "-"
        if r.get("delayer"):
            c = r["delayer"][0]
            late = f"{c.get('late_us_median', 0):.0f} / {c.get('late_us_p99', 0):.0f} us"
        lines.append(
            f"| {name} | {2 * r['delay_us']:.0f} us | {r['rtt_us_median']:.0f} "
            f"({r['rtt_us_p10']:.0f}-{r['rtt_us_p90']:.0f}) us | {r['rtt_us_median'] - bare:.0f} us "
            f"| {r['gbit_s']:.2f} Gbit/s | {late} | {r['load_average'][0]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="reprint --out's table")
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.table:
        report = json.loads(args.out.read_text())
    else:
        try:
            check_available()
            report = measure(args.out)
        except DelayUnavailable as exc:
            sys.exit(f"link_calibrate: cannot delay the link: {exc}")
    print(table(report))


if __name__ == "__main__":
    main()
