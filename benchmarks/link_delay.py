"""A fixed one-way delay on a host's outgoing link, for kernels without sch_netem (docs/parallel.md,
"Across hosts: the link, planned vs measured").

An iptables-legacy rule in the host's network namespace sends every packet leaving its veth to an
NFQUEUE; this process, run inside the same namespace, reads the queued packets over nfnetlink (the
kernel's nfnetlink_queue protocol, spoken directly: no library) and gives them their ACCEPT verdict
`delay_us` after it read them. One FIFO with one constant delay keeps every flow's order; the
verdicts of all packets due at a wake-up go out as one batch verdict (NFQNL_MSG_VERDICT_BATCH: every
packet id up to the newest due one). Only metadata is copied to user space (NFQNL_COPY_META) and GSO
packets are queued whole (NFQA_CFG_F_GSO), so a 64 kB TCP segment is one packet here. `tbf` on the
same veth still shapes the rate (the queue sits in the OUTPUT hook, before the qdisc).

No fail-open: if this process is absent or dies, the rule drops the veth's traffic (no
--queue-bypass), so a measurement never runs silently undelayed.

  # as root, in the namespace (the rule is added and removed by this process):
  ip netns exec NS python benchmarks/link_delay.py --dev VETH --queue 7 --delay-us 500

It prints `ready` on stdout once the rule is in place, and a JSON line of counters when it stops
(SIGTERM or SIGINT): packets, wake-ups, and how late the verdicts were against their deadlines.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = (NFNL_SUBSYS_QUEUE << 8) | 0
NFQNL_MSG_VERDICT = (NFNL_SUBSYS_QUEUE << 8) | 1
NFQNL_MSG_CONFIG = (NFNL_SUBSYS_QUEUE << 8) | 2
NFQNL_MSG_VERDICT_BATCH = (NFNL_SUBSYS_QUEUE << 8) | 3
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 1 << 2
NF_ACCEPT = 1
PR_SET_TIMERSLACK = 29
QUEUE_MAXLEN = 16384
RCVBUF_BYTES = 32 << 20


class DelayUnavailable(RuntimeError):
    """This host cannot delay its link this way (not root, no iptables-legacy, no NFQUEUE)."""


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    # nfgenmsg: family AF_UNSPEC, version 0, res_id = the queue number (big-endian)
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


class QueueSocket:
    """One bound nfnetlink_queue: configuration, packet ids in, batch verdicts out."""

    def __init__(self, queue: int) -> None:
        self.queue = queue
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        self.sock.bind((0, 0))
        cmd = struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)
        self._config(_attr(NFQA_CFG_CMD, cmd), "bind the queue")
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
                     "set copy mode")  # fmt: skip
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)), "set maxlen")
        self._config(
            _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))
            + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)),
            "queue GSO packets whole",
        )
        self.sock.setblocking(False)

    def _config(self, attrs: bytes, what: str) -> None:
        self.seq += 1
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, attrs, self.seq,
                                NLM_F_REQUEST | NLM_F_ACK))  # fmt: skip
        reply = self.sock.recv(65536)
        _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
        if kind == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, 16)
            if error != 0:
                raise DelayUnavailable(
                    f"nfnetlink_queue refused to {what} (queue {self.queue}): {os.strerror(-error)}"
                )

    def read_ids(self) -> list[int]:
        """The ids of every queued packet readable now (one netlink message per packet)."""
        ids = []
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return ids
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
                if kind == NFQNL_MSG_PACKET:
                    attr = offset + 20  # after nlmsghdr and nfgenmsg
                    while attr + 4 <= offset + length:
                        attr_len, attr_kind = struct.unpack_from("=HH", data, attr)
                        if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                            ids.append(struct.unpack_from("!I", data, attr + 4)[0])
                            break
                        attr += (attr_len + 3) & ~3
                elif kind == NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", data, offset + 16)
                    if error != 0:
                        raise OSError(-error, f"nfnetlink_queue: {os.strerror(-error)}")
                offset += (length + 3) & ~3

    def accept_up_to(self, packet_id: int) -> None:
        """ACCEPT every queued packet whose id is <= packet_id."""
        self.seq += 1
        verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
        self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, verdict, self.seq))


def check_available() -> None:
    """Raise DelayUnavailable with the reason where this cannot work."""
    if os.geteuid() != 0:
        raise DelayUnavailable("delaying a link needs root (iptables and nfnetlink_queue)")
    if shutil.which("iptables-legacy") is None:
        raise DelayUnavailable("iptables-legacy is not installed (apt-get install iptables)")
    probe = subprocess.run(["iptables-legacy", "-j", "NFQUEUE", "-h"], capture_output=True,
                           text=True, timeout=20)  # fmt: skip
    if "NFQUEUE" not in probe.stdout + probe.stderr:
        raise DelayUnavailable("iptables-legacy has no NFQUEUE target")


def _rule(action: str, dev: str, queue: int) -> list[str]:
    return ["iptables-legacy", "-w", action, "OUTPUT", "-o", dev, "-j", "NFQUEUE",
            "--queue-num", str(queue)]  # fmt: skip


def run(dev: str, queue: int, delay_us: float, early_us: float = 0.0) -> dict:
    """Delay `dev`'s outgoing packets by `delay_us` until SIGTERM/SIGINT; returns the counters.
    `early_us` is taken off every deadline: this process's own wake-up latency (reading a packet
    after the kernel queued it, waking after its deadline), measured by the calibration."""
    check_available()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake-ups within ~1 us, not the default 50 us
    try:
        nfq = QueueSocket(queue)
    except OSError as exc:
        raise DelayUnavailable(f"cannot open nfnetlink_queue {queue}: {exc}") from exc
    added = subprocess.run(_rule("-A", dev, queue), capture_output=True, text=True, timeout=20)
    if added.returncode != 0:
        raise DelayUnavailable(f"iptables-legacy NFQUEUE rule on {dev}: {added.stderr.strip()}")
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.append(True))
    delay_ns = int(max(0.0, delay_us - early_us) * 1000)
    pending: collections.deque[tuple[int, int]] = collections.deque()  # (deadline ns, id), FIFO
    counts = {"packets": 0, "wakeups": 0, "verdicts": 0, "late_us": []}
    print("ready", flush=True)
    try:
        while not stop:
            timeout = 0.5
            if pending:
                timeout = max(0.0, (pending[0][0] - time.monotonic_ns()) / 1e9)
            try:
                readable, _, _ = select.select([nfq.sock], [], [], timeout)
            except InterruptedError:
                continue
            now = time.monotonic_ns()
            if readable:
                for packet_id in nfq.read_ids():
                    pending.append((now + delay_ns, packet_id))
                    counts["packets"] += 1
            counts["wakeups"] += 1
            now = time.monotonic_ns()
            last = None
            while pending and pending[0][0] <= now:
                deadline, last = pending.popleft()
                if len(counts["late_us"]) < 200_000:
                    counts["late_us"].append((now - deadline) / 1e3)
            if last is not None:
                nfq.accept_up_to(last)
                counts["verdicts"] += 1
    finally:
        subprocess.run(_rule("-D", dev, queue), capture_output=True, timeout=20)
        if pending:  # nothing left stranded in the queue once the rule is gone
            nfq.accept_up_to(pending[-1][1])
    late = sorted(counts.pop("late_us"))
    if late:
        counts["late_us_median"] = late[len(late) // 2]
        counts["late_us_p90"] = late[int(0.9 * (len(late) - 1))]
        counts["late_us_p99"] = late[int(0.99 * (len(late) - 1))]
    return counts


class Delayer:
    """`link_delay.py` running inside `host`'s namespace on its veth, for a `with` block: entering
    waits for its `ready` (raising DelayUnavailable with its error if it fails), leaving stops it and
    keeps its counters in `.counts`."""

    def __init__(self, host, delay_us: float, queue: int, early_us: float = 0.0) -> None:
        self.argv = host.command(sys.executable, os.path.abspath(__file__), "--dev", host.veth,
                                 "--queue", str(queue), "--delay-us", str(delay_us),
                                 "--early-us", str(early_us))  # fmt: skip
        self.counts: dict = {}

    def __enter__(self) -> Delayer:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)  # fmt: skip
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=20)
            raise DelayUnavailable(err.strip() or f"link_delay.py did not start ({line!r})")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=20)
        lines = out.strip().splitlines()
        self.counts = json.loads(lines[-1]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dev", required=True, help="the outgoing interface (this host's veth)")
    parser.add_argument("--queue", type=int, required=True, help="NFQUEUE number (0-65535)")
    parser.add_argument("--delay-us", type=float, required=True, help="one-way delay added")
    parser.add_argument("--early-us", type=float, default=0.0,
                        help="taken off each deadline: this process's own latency (0)")  # fmt: skip
    args = parser.parse_args()
    try:
        counts = run(args.dev, args.queue, args.delay_us, args.early_us)
    except DelayUnavailable as exc:
        print(f"link_delay: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
