"""Test-only fault injection for the async engine (`kvserve serve --inject-fault ...`), and the stand-in
engine that maintenance calls see once the real one is dead.

Faults keyed by a request's seed make the runner (`request:SEED`) or the loop (`engine:SEED`) fail.
Gates let a test decide when the engine moves on instead of racing it with sleeps: with
`gate:WHERE` the engine core passes a `Gate` before each step, with `grammar-gate:WHERE` the grammar
cache passes one before each compile. The test listens at WHERE (tests/faults.py): a Unix socket's
absolute path (reachable from another network namespace too) or a port on 127.0.0.1; each gate
connects to it when the engine core starts and then obeys the lines the test sends: `hold` (close),
`step N` (let N more steps or compiles through, then close again), `open`. It answers each with `ok`
once applied, so the test knows the gate's state when its call returns; `passed` after each step let
through by `step`, and the step gate `held N` when it starts to hold the engine with N requests. A
gate starts open; a gate
whose test hangs up, or that stays closed for `GATE_TIMEOUT_S`, opens for good and logs it, so
nothing waits forever."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

GATE_TIMEOUT_S = 60.0  # a closed gate opens itself after this long without a word from the test
REMOVED = {"delay": "gate:WHERE", "grammar": "grammar-gate:WHERE"}  # sleeps replaced by gates


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults. `request_seed` makes the runner fail while preparing that request (inside a
    step: attributable); `engine_seed` makes the loop itself fail after the step that follows its
    arrival (not attributable: the engine dies). `step_gate` / `grammar_gate`: where the test that
    holds the step gate / the grammar-compile gate listens (a Unix socket's path or a 127.0.0.1
    port)."""

    request_seed: int | None = None
    engine_seed: int | None = None
    step_gate: str | None = None
    grammar_gate: str | None = None

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection | None:
        """`request:SEED`, `engine:SEED`, `gate:WHERE`, `grammar-gate:WHERE`, comma-separated; WHERE
        is an absolute path (a Unix socket) or a port on 127.0.0.1."""
        if not spec:
            return None
        fields: dict[str, int | str] = {}
        for part in spec.split(","):
            kind, _, value = part.partition(":")
            if kind in REMOVED:
                raise ValueError(
                    f"fault injection {part!r}: {kind}:SECONDS (a sleep) is gone; use "
                    f"{REMOVED[kind]}, a gate the test opens (tests/faults.py)"
                )
            name = {
                "request": "request_seed",
                "engine": "engine_seed",
                "gate": "step_gate",
                "grammar-gate": "grammar_gate",
            }.get(kind)
            try:
                if name is None:
                    raise ValueError
                if kind in ("request", "engine"):
                    fields[name] = int(value)
                elif value.startswith("/") or value.isdigit():
                    fields[name] = value
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    "fault injection must be request:SEED, engine:SEED, gate:WHERE or "
                    f"grammar-gate:WHERE (a socket's absolute path or a port); got {part!r}"
                ) from None
        return cls(**fields)


class Gate:
    """The engine's end of a test's gate at `address` (see the module docstring). `wait` blocks
    while the gate is closed; `passed` spends one of the steps the test let through.

    `condition`: the lock and condition the waiting thread sleeps on (the serving loop passes its own,
    so that a command arriving while the step is held wakes it); `stopping`: while it says True the
    gate is open (shutdown never waits for a test)."""

    def __init__(
        self,
        address: str,
        name: str,
        condition: threading.Condition | None = None,
        stopping: Callable[[], bool] = lambda: False,
        timeout_s: float = GATE_TIMEOUT_S,
    ) -> None:
        self.name = name
        self._condition = condition or threading.Condition()
        self._stopping = stopping
        self._timeout_s = timeout_s
        self._is_open = True
        self._num_allowed = 0  # steps let through while closed, not yet passed
        self._told = threading.Event()  # the test's first line (its state) arrived, or it hung up
        self._send_lock = threading.Lock()
        where = ("127.0.0.1", int(address)) if address.isdigit() else address
        self._sock = socket.socket(socket.AF_INET if address.isdigit() else socket.AF_UNIX)
        try:
            self._sock.settimeout(10)
            self._sock.connect(where)
        except OSError as exc:
            self._sock.close()
            raise ConnectionError(
                f"--inject-fault {name}: no test listens at {address} ({exc})"
            ) from None
        self._sock.settimeout(None)
        threading.Thread(target=self._follow, name=f"kvserve-{name}", daemon=True).start()

    def _follow(self) -> None:
        """Apply the test's lines until it hangs up; then the gate stays open."""
        try:
            for line in self._sock.makefile("r", encoding="ascii"):
                words = line.split()
                with self._condition:
                    if words == ["open"]:
                        self._is_open = True
                    elif words == ["hold"]:
                        self._is_open, self._num_allowed = False, 0
                    elif len(words) == 2 and words[0] == "step":
                        self._num_allowed += int(words[1])
                    else:
                        logger.error("gate %s: unknown line %r", self.name, line)
                    self._condition.notify_all()
                self._send("ok")
                self._told.set()
        except (OSError, ValueError) as exc:
            logger.warning("gate %s: the test's connection failed: %r", self.name, exc)
        with self._condition:
            self._is_open = True
            self._condition.notify_all()
        self._told.set()

    def wait_for_the_test(self) -> None:
        """Block until the test has told this gate its state (the first line it sends once it takes
        the connection), so that no step runs before a test that holds the gate could say so; at
        most the gate's timeout, then the gate stays open."""
        if not self._told.wait(self._timeout_s):
            logger.error(
                "gate %s: no word from the test in %.0f s; open", self.name, self._timeout_s
            )

    def _send(self, line: str) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(f"{line}\n".encode())
            except OSError:
                pass  # the test hung up: `_follow` opens the gate

    def wait(
        self,
        interrupted: Callable[[], bool] = lambda: False,
        num_requests: Callable[[], int] | None = None,
    ) -> bool:
        """Block while the gate is closed: True once it lets this step through; False as soon as
        `interrupted()` is true (checked under the condition's lock, after each wake-up). When it
        blocks it tells the test `held N`, N = `num_requests()` (the requests the engine holds), so a
        test can wait for the requests it sent to have arrived."""
        with self._condition:
            deadline = time.monotonic() + self._timeout_s
            if num_requests is not None and not self._lets_through():
                self._send(f"held {num_requests()}")
            while not self._lets_through():
                if interrupted():
                    return False
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    logger.error(
                        "gate %s: closed for %.0f s without a word from the test; opening it",
                        self.name,
                        self._timeout_s,
                    )
                    self._is_open = True
                    break
                self._condition.wait(left_s)
            return True

    def _lets_through(self) -> bool:
        return self._is_open or self._num_allowed > 0 or self._stopping()

    def passed(self) -> None:
        """One step (or compile) went through: spend one that the test allowed, if closed (and tell
        the test, which may wait for its steps to be taken)."""
        with self._condition:
            spent = not self._is_open and self._num_allowed > 0
            if spent:
                self._num_allowed -= 1
        if spent:
            self._send("passed")

    def wait_and_pass(self) -> None:
        self.wait()
        self.passed()

    def close(self) -> None:
        self._sock.close()


def inject_runner_fault(runner, seed: int) -> None:
    """Make `runner` fail while preparing any request with this seed (inside a step)."""
    add_request = runner.add_request

    def failing_add_request(new):
        if new.sampling_params.seed == seed:
            raise RuntimeError("injected fault while preparing a request")
        return add_request(new)

    runner.add_request = failing_add_request


class DeadEngine:
    """Stands in for the engine in maintenance calls that arrive after it died: any use raises."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def __getattr__(self, name: str):
        raise self._error


def step_gate(
    faults: FaultInjection | None, condition: threading.Condition, stopping: Callable[[], bool]
) -> Gate | None:
    """The engine core's gate before each step (`gate:WHERE`), or None."""
    if faults is None or faults.step_gate is None:
        return None
    return Gate(faults.step_gate, "gate", condition, stopping)


def grammar_gate(faults: FaultInjection | None) -> Gate | None:
    """The grammar cache's gate before each compile (`grammar-gate:WHERE`), or None."""
    if faults is None or faults.grammar_gate is None:
        return None
    return Gate(faults.grammar_gate, "grammar-gate")
