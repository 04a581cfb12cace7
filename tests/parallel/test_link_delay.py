"""benchmarks/link_delay.py, the one-way delay that stands in for netem on this kernel
(docs/parallel.md "Across hosts: the link, planned vs measured").

Two network namespaces (tests/netns.py); host A's outgoing packets are delayed by D; small TCP
messages ping-pong between A and an echo server in B. Each packet is accepted no sooner than D after
the delayer read it, so every round trip is at least D longer than nothing (no upper bound: this
machine's load decides how late). Skips with the reason where namespaces, iptables-legacy or NFQUEUE
are not available.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import link_calibrate
from benchmarks.link_delay import Delayer, DelayUnavailable, check_available
from tests import REPO_ROOT
from tests.netns import NetnsUnavailable, two_hosts

DELAY_US = 500.0


@pytest.fixture
def hosts():
    try:
        check_available()
    except DelayUnavailable as exc:
        pytest.skip(f"cannot delay a link here: {exc}")
    try:
        pair = two_hosts()
        a, b = pair.__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces: {exc}")
    try:
        yield a, b
    finally:
        pair.__exit__(None, None, None)


def test_delay_adds_at_least_d_and_the_rule_goes_with_it(hosts, monkeypatch):
    a, b = hosts
    monkeypatch.setattr(link_calibrate, "NUM_PINGS", 60)
    monkeypatch.setattr(link_calibrate, "NUM_WARMUP", 10)
    script = str(REPO_ROOT / "benchmarks" / "link_calibrate.py")
    echo = subprocess.Popen(b.command(sys.executable, script, "--serve"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert echo.stdout.readline().strip() == "ready"
        with a.executor(1) as pool:
            bare = pool.submit(link_calibrate.ping_pong, b.address).result(timeout=60)
            with Delayer(a, DELAY_US, 31) as delayer:
                delayed = pool.submit(link_calibrate.ping_pong, b.address).result(timeout=60)
            after = pool.submit(link_calibrate.ping_pong, b.address).result(timeout=60)
    finally:
        echo.stdin.close()
        echo.wait(timeout=20)
    # every round trip carries one of A's packets, each accepted no sooner than D after it was read
    assert delayed["rtt_us_p10"] >= DELAY_US
    assert delayed["rtt_us_median"] >= bare["rtt_us_median"] + DELAY_US * 0.9
    assert delayer.counts["packets"] >= 60  # the pings' packets from A, at least
    rules = subprocess.run(a.command("iptables-legacy", "-S", "OUTPUT"), capture_output=True,
                           text=True, timeout=20).stdout  # fmt: skip
    assert "NFQUEUE" not in rules  # the rule left with the delayer: the link is bare again
    assert after["rtt_us_median"] < delayed["rtt_us_median"]


def test_a_second_delayer_on_a_taken_queue_says_why(hosts):
    a, _ = hosts
    with Delayer(a, DELAY_US, 33):
        with pytest.raises(DelayUnavailable, match="refused to bind the queue"):
            with Delayer(a, DELAY_US, 33):
                pass
