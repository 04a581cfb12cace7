"""Hosts on one machine: Linux network namespaces joined by veth pairs (tests, benchmarks).

`two_hosts()` creates namespaces A (10.77.0.1/24) and B (10.77.0.2/24) with unique names, joined by
one veth pair, yields them, and always deletes them (which deletes the veth pair too).
`hosts(n)` creates n namespaces (10.77.0.1, .2, ...) on one switch: a bridge in a namespace of its
own, one veth pair per host. Both raise `NetnsUnavailable` with the reason where `ip netns` is not
allowed (not root, no CAP_NET_ADMIN, no iproute2). `Host.executor()` runs the test's own code (an
HTTP client) inside a host: a network namespace is a per-thread attribute, so its threads enter it
with setns(2) and the rest of the process stays where it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24
CLONE_NEWNET = 0x40000000


class NetnsUnavailable(RuntimeError):
    """This process may not create network namespaces."""


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    veth: str  # this host's end of the link

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def netem(self, delay_ms: float, rate_gbit: float) -> str:
        """Shape this host's outgoing traffic (delay and rate), replacing any earlier setting, and
        say how: netem, or, on a kernel without sch_netem, tbf (the rate only, no added delay)."""
        self.clear_netem()
        tc = ("tc", "-n", self.namespace, "qdisc", "add", "dev", self.veth, "root")
        result = _ip(*tc, "netem", "delay", f"{delay_ms:g}ms", "rate", f"{rate_gbit:g}gbit",
                     check=False)  # fmt: skip
        if result.returncode == 0:
            return f"netem delay {delay_ms:g}ms rate {rate_gbit:g}gbit"
        if "unknown" not in result.stderr:
            raise subprocess.CalledProcessError(result.returncode, tc, "", result.stderr)
        burst_kb = max(64, int(rate_gbit * 1e9 / 8 / 1000 / 1024) * 2)  # two timer ticks' bytes
        _ip(*tc, "tbf", "rate", f"{rate_gbit:g}gbit", "burst", f"{burst_kb}kb", "latency", "50ms")
        return f"tbf rate {rate_gbit:g}gbit (this kernel has no netem: no delay added)"

    def clear_netem(self) -> None:
        _ip("tc", "-n", self.namespace, "qdisc", "del", "dev", self.veth, "root", check=False)

    def set_link(self, up: bool) -> None:
        """Take this host's link down (a cut cable: nothing is closed, packets stop) or up."""
        _ip("ip", "-n", self.namespace, "link", "set", self.veth, "up" if up else "down")

    def executor(self, max_workers: int = 8) -> ThreadPoolExecutor:
        """Threads that run inside this host's network namespace (sockets they open live there)."""
        return ThreadPoolExecutor(max_workers, initializer=enter, initargs=(self.namespace,))


def enter(namespace: str) -> None:
    """Move the calling thread, only it, into `namespace`'s network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {namespace}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, argv, result.stdout, result.stderr)
    return result


def _check_allowed() -> str:
    """A tag for unique names; raises NetnsUnavailable where namespaces cannot be made."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces needs root (CAP_NET_ADMIN)")
    return f"{os.getpid() % 10000:04d}{secrets.token_hex(2)}"


def _add_namespace(name: str, created: list[str]) -> None:
    result = _ip("ip", "netns", "add", name, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {result.stderr.strip()}")
    created.append(name)


@contextlib.contextmanager
def hosts(count: int) -> Iterator[tuple[Host, ...]]:
    """`count` hosts, 10.77.0.1 .. 10.77.0.count, on one bridge (a switch in its own namespace)."""
    tag = _check_allowed()
    switch = f"kvs-s-{tag}"
    names = [f"kvs-{i}-{tag}" for i in range(count)]
    created: list[str] = []
    try:
        _add_namespace(switch, created)
        _ip("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", switch, "link", "set", "br0", "up")
        result = []
        for i, name in enumerate(names):
            _add_namespace(name, created)
            veth, port = f"kvh{i}{tag}", f"kvp{i}{tag}"  # at most 15 characters
            _ip("ip", "link", "add", veth, "netns", name, "type", "veth", "peer", "name", port,
                "netns", switch)  # fmt: skip
            _ip("ip", "-n", switch, "link", "set", port, "master", "br0")
            _ip("ip", "-n", switch, "link", "set", port, "up")
            address = f"10.77.0.{i + 1}"
            _ip("ip", "-n", name, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", veth)
            _ip("ip", "-n", name, "link", "set", veth, "up")
            _ip("ip", "-n", name, "link", "set", "lo", "up")
            result.append(Host(name, address, veth))
        yield tuple(result)
    finally:
        for name in created:  # deleting a namespace deletes its veth ends, and so their peers
            _ip("ip", "netns", "del", name, check=False)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    tag = _check_allowed()
    names = (f"kvs-a-{tag}", f"kvs-b-{tag}")
    veths = (f"kva{tag}", f"kvb{tag}")  # interface names: at most 15 characters
    created: list[str] = []
    try:
        for name in names:
            _add_namespace(name, created)
        _ip("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, address in zip(names, veths, ADDRESSES, strict=True):
            _ip("ip", "link", "set", veth, "netns", name)
            _ip("ip", "-n", name, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", veth)
            _ip("ip", "-n", name, "link", "set", veth, "up")
            _ip("ip", "-n", name, "link", "set", "lo", "up")
        yield tuple(Host(*args) for args in zip(names, ADDRESSES, veths, strict=True))
    finally:
        for name in created:
            _ip("ip", "netns", "del", name, check=False)
        _ip("ip", "link", "del", veths[0], check=False)  # if it never moved into a namespace
