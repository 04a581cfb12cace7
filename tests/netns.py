"""Two hosts on one machine: Linux network namespaces joined by a veth pair (tests, benchmarks).

`two_hosts()` creates namespaces A (10.77.0.1/24) and B (10.77.0.2/24) with unique names, yields
them, and always deletes them (which deletes the veth pair too). It raises `NetnsUnavailable` with
the reason where `ip netns` is not allowed (not root, no CAP_NET_ADMIN, no iproute2).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24


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


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, argv, result.stdout, result.stderr)
    return result


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces needs root (CAP_NET_ADMIN)")
    tag = f"{os.getpid() % 10000:04d}{secrets.token_hex(2)}"
    names = (f"kvs-a-{tag}", f"kvs-b-{tag}")
    veths = (f"kva{tag}", f"kvb{tag}")  # interface names: at most 15 characters
    created: list[str] = []
    try:
        for name in names:
            result = _ip("ip", "netns", "add", name, check=False)
            if result.returncode != 0:
                raise NetnsUnavailable(f"`ip netns add` failed: {result.stderr.strip()}")
            created.append(name)
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
