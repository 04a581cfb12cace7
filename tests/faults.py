"""The test's end of the engine's fault gates (kvserve/engine/faults.py): instead of slowing the engine
with sleeps and hoping to win a race, a test holds the engine core before its next step (or the grammar
cache before its next compile) while it does what it needs to, then lets steps through.

    with FaultGate() as steps:
        with running_server(model, "--inject-fault", steps.spec()) as (url, _):
            steps.hold()        # no step from now on (returns once every core has it)
            ...                 # start a stream, disconnect, add a request...
            steps.step(3)       # three more steps (that produce tokens), then held again
            steps.wait_passed(3)
            steps.open()        # run freely

One `FaultGate` serves every engine core that connects (data parallelism: each core gets each order;
a core that connects later starts in the gate's current state). Leaving the `with` hangs up, which
opens every gate for good. Every wait here is bounded."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time

GATE_REPLY_TIMEOUT_S = 30.0  # a core that does not answer an order within this is an error


class _Core:
    """One engine core's connection: its answers are read by a thread of their own, so that the core
    never blocks on a full socket."""

    def __init__(self, sock: socket.socket, changed: threading.Condition) -> None:
        self.sock = sock
        self.num_sent = 0  # orders sent to it
        self.num_ok = 0  # orders it applied
        self.num_passed = 0
        self.held_with: int | None = None  # the requests it held at its latest `held N`
        self.alive = True
        self._changed = changed
        threading.Thread(target=self._read, name="fault-gate-reader", daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            for line in self.sock.makefile("r", encoding="ascii"):
                words = line.split()
                with self._changed:
                    if words == ["ok"]:
                        self.num_ok += 1
                    elif words == ["passed"]:
                        self.num_passed += 1
                        self.held_with = None
                    elif words[:1] == ["held"] and self.num_ok == self.num_sent:
                        self.held_with = int(words[1])  # (not one sent before the latest order)
                    self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()


class FaultGate:
    """Listens for the gates of `--inject-fault gate:WHERE` (`spec()`) or `grammar-gate:WHERE`
    (`spec("grammar-gate")`): on a Unix socket in a directory of its own (`address`; a core in another
    network namespace reaches it too), or with `tcp=True` on a port of 127.0.0.1."""

    def __init__(self, tcp: bool = False) -> None:
        self._dir = None
        if tcp:
            self._listener = socket.create_server(("127.0.0.1", 0))
            self.address = str(self._listener.getsockname()[1])
        else:
            self._dir = tempfile.mkdtemp(prefix="kvserve-gate-", dir="/tmp")  # short: sun_path
            os.chmod(self._dir, 0o755)  # a core started as another user may connect
            self.address = os.path.join(self._dir, "gate.sock")
            self._listener = socket.socket(socket.AF_UNIX)
            self._listener.bind(self.address)
            os.chmod(self.address, 0o777)
            self._listener.listen(16)
        self._cores: list[_Core] = []
        self._changed = threading.Condition()
        self._state = "open"  # what a core that connects now is told first
        self._passed_before_hold = 0  # steps passed (all cores) before the latest `hold`

    def spec(self, kind: str = "gate") -> str:
        """The `--inject-fault` value: `gate:WHERE` (steps) or `grammar-gate:WHERE` (compiles)."""
        return f"{kind}:{self.address}"

    def __enter__(self) -> FaultGate:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Hang up: every gate opens for good."""
        for core in self._cores:
            with contextlib.suppress(OSError):
                core.sock.shutdown(socket.SHUT_RDWR)
            core.sock.close()
        self._listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _accept_new(self) -> None:
        """Take the cores that connected since the last order (they did so before their server said
        it was ready) and tell them the current state."""
        self._listener.setblocking(False)
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                break
            sock.setblocking(True)
            core = _Core(sock, self._changed)
            self._cores.append(core)
            self._send(core, self._state)

    def _send(self, core: _Core, line: str) -> None:
        if not core.alive:
            return
        with self._changed:
            core.num_sent += 1
            core.held_with = None
        try:
            core.sock.sendall(f"{line}\n".encode())
        except OSError:
            with self._changed:
                core.num_sent -= 1  # that core is gone (killed by the test, or exited)

    def _order(self, line: str) -> None:
        """Send `line` to every core and wait until each living one has applied it."""
        self._accept_new()
        for core in self._cores:
            self._send(core, line)
        self._wait(
            lambda: all(not c.alive or c.num_ok >= c.num_sent for c in self._cores),
            f"the engine cores did not apply {line!r}",
        )

    def _wait(self, predicate, what: str, timeout_s: float = GATE_REPLY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate():
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"{what} within {timeout_s} s")
                self._changed.wait(left_s)

    @property
    def num_cores(self) -> int:
        """Engine cores connected now (and still connected)."""
        self._accept_new()
        with self._changed:
            return sum(c.alive for c in self._cores)

    def wait_for_cores(self, num: int, timeout_s: float = GATE_REPLY_TIMEOUT_S) -> None:
        """Wait until `num` engine cores have connected (a core connects once its model is loaded:
        `kvserve generate` has no readiness line to wait for)."""
        deadline = time.monotonic() + timeout_s
        while self.num_cores < num:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"{num} engine core(s) did not connect within {timeout_s} s")
            select.select([self._listener], [], [], left_s)  # wakes when one connects

    def hold(self) -> None:
        """Close the gate: no step (or compile) starts until `step` or `open`."""
        self._state = "hold"
        self._order("hold")
        with self._changed:
            self._passed_before_hold = sum(c.num_passed for c in self._cores)

    def open(self) -> None:
        """Let everything through from now on."""
        self._state = "open"
        self._order("open")

    def step(self, num: int = 1) -> None:
        """Let `num` more steps that produce output (or compiles) through each core; then it is held
        again. Returns once the cores have the order, not once the steps ran (`wait_passed`)."""
        self._order(f"step {num}")

    def num_passed(self) -> int:
        """Steps (or compiles) let through by `step` since the latest `hold`, over every core."""
        with self._changed:
            return sum(c.num_passed for c in self._cores) - self._passed_before_hold

    def wait_passed(self, num: int, timeout_s: float = GATE_REPLY_TIMEOUT_S) -> None:
        """Wait until `num` steps (or compiles) let through by `step` since the latest `hold` went
        through (over every core)."""
        self._wait(
            lambda: sum(c.num_passed for c in self._cores) - self._passed_before_hold >= num,
            f"{num} steps did not pass the gate",
            timeout_s,
        )

    def wait_held(self, num_requests: int, timeout_s: float = GATE_REPLY_TIMEOUT_S) -> None:
        """Wait until the engine cores are held with at least `num_requests` requests in them (over
        every core; n > 1 counts one): the requests the test sent have reached them. Only while the
        gate is held (after `hold` or a `step` that was used up)."""
        self._wait(
            lambda: sum(c.held_with or 0 for c in self._cores if c.alive) >= num_requests,
            f"the engine cores were not held with {num_requests} requests",
            timeout_s,
        )

    @contextlib.contextmanager
    def held(self):
        """Closed inside the block, open after it (also when the block fails)."""
        self.hold()
        try:
            yield self
        finally:
            self.open()
