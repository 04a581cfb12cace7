"""`EngineClient`: the one narrow interface between the front end (server, benches) and engine cores.

Typed commands (kvserve.engine.wire) go to one or more engine cores; their per-step deltas come back and
are accumulated here (kvserve.engine.output_processor) into `RequestOutput` snapshots, handed to each
request's asyncio queue. Two implementations share this class:

- in-process (kvserve.engine.async_engine.AsyncEngine): one core whose loop is a thread of this process;
- multi-process (kvserve.engine.mp_client.MPClient): N engine-core processes over ZMQ (data parallel when
  N > 1), with health checks across the boundary (process exit, missed heartbeat).

What a caller may use: `info` (static facts), `tokenizer`, `stats` / `core_stats`, `num_waiting`,
`num_unfinished`, `dead` / `dead_reason`, `reserve` / `release`, `validate`, `add` / `generate` / `abort`,
`reset_prefix_cache`, `debug_engine`, `debug_steps`, `warm_up`, `set_observers`, `shutdown`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvserve.core.errors import KVServeError
from kvserve.core.sampling_params import GRAMMAR_COMPILE_TIMEOUT_S, SamplingParams
from kvserve.engine.output_processor import OutputKind, OutputProcessor, Tracked, so_far
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.step_log import StepLog
from kvserve.engine.wire import (
    AbortCmd,
    AddCmd,
    CoreOutputs,
    EngineDeadError,
    EngineInfo,
    EngineStats,
    Failure,
    UtilityCmd,
    UtilityResult,
    error_from_wire,
)

# How long a request with a new grammar may wait for the core to accept it: the core abandons a compile
# past `info.grammar_compile_timeout_s`; one more may run ahead of it in the core's grammar thread (a
# request that left while its grammar compiled), and a replacement worker may be starting.
VALIDATE_MARGIN_S = 30.0


def validate_timeout_s(info: EngineInfo | None) -> float:
    if info is None:  # the configuration's default
        return 2 * GRAMMAR_COMPILE_TIMEOUT_S + VALIDATE_MARGIN_S
    compile_s = info.grammar_compile_timeout_s
    return 2 * compile_s + VALIDATE_MARGIN_S


@dataclass
class PendingCall:
    """A utility call sent to core `core_index`, whose caller waits (`answered`) for its `result`."""

    core_index: int
    answered: threading.Event = field(default_factory=threading.Event)
    result: UtilityResult | None = None

    def answer(self, result: UtilityResult) -> None:
        self.result = result
        self.answered.set()


class CoreHandle:
    """The client's view of one engine core: how to send it commands, and what it last reported."""

    def __init__(self, index: int, send: Callable[[object], None]) -> None:
        self.index = index
        self.send = send
        self.alive = True
        self.dead_reason: str | None = None
        self.stats = EngineStats()
        self.step_log = StepLog()
        self.num_sent = 0  # samples sent in add commands (cumulative)
        self.num_admitted = 0  # ... of which the core has taken from its queue
        self.num_engine_waiting = 0
        self.requests: set[str] = set()
        self.num_routed = 0  # requests sent to this core (cumulative)
        self.pid: int | None = None  # its process, once known
        self.address: str | None = None  # HOST:PORT of a core on another host (engine/remote.py)


class EngineClient:
    def __init__(self, info: EngineInfo, tokenizer, cores: list[CoreHandle], on_dead=None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.on_dead = on_dead
        self._cores = cores
        self._lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._owner: dict[str, CoreHandle] = {}
        self._affinity: dict[bytes, int] = {}  # first-block hash -> core index
        self._outputs = OutputProcessor()
        self._num_reserved = 0
        self._call_ids = itertools.count()
        self._calls: dict[int, PendingCall] = {}  # call id -> the caller waiting for its result
        self.dead_reason: str | None = None
        self._on_grammar_compile: Callable[[float], None] | None = None
        self._on_grammar_mask: Callable[[float], None] | None = None

    # --- facts and state --------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_cores(self) -> int:
        return len(self._cores)

    @property
    def core_stats(self) -> list[tuple[int, bool, EngineStats]]:
        """(core index, alive, its latest stats) for every core."""
        return [(c.index, c.alive, c.stats) for c in self._cores]

    @property
    def core_status(self) -> list[dict]:
        """Per core: index, alive, pid, address (another host's core), requests routed to it so
        far, running now, why it died."""
        return [
            {
                "index": c.index,
                "alive": c.alive,
                "pid": c.pid,
                "address": c.address,
                "num_routed": c.num_routed,
                "num_running": c.stats.num_running,
                "error": c.dead_reason,
            }
            for c in self._cores
        ]

    @property
    def stats(self) -> EngineStats:
        """The live cores' stats, summed (KV usage: of all their blocks)."""
        live = [c.stats for c in self._cores if c.alive] or [EngineStats()]
        if len(live) == 1:
            return live[0]
        total = {
            f: sum(getattr(s, f) for s in live)
            for f in EngineStats.__struct_fields__
            if not isinstance(getattr(live[0], f), tuple)
        }
        # the cores run one model: the same KV groups, their blocks summed
        total["kv_group_kinds"] = live[0].kv_group_kinds
        total["kv_group_blocks"] = tuple(
            map(sum, zip(*(s.kv_group_blocks for s in live), strict=True))
        )
        blocks = total["num_blocks"]
        total["kv_usage"] = sum(s.kv_usage * s.num_blocks for s in live) / blocks if blocks else 0.0
        return EngineStats(**total)

    @property
    def step_log(self) -> StepLog:
        return self._cores[0].step_log

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        """Samples accepted but not yet admitted: reserved, in flight to a core, or in its waiting queue."""
        with self._lock:
            return self._num_reserved + sum(
                c.num_sent - c.num_admitted + c.num_engine_waiting for c in self._cores if c.alive
            )

    def set_observers(self, grammar_compile=None, grammar_mask=None) -> None:
        """Callbacks for each grammar compile time and each per-batch mask time (seconds)."""
        self._on_grammar_compile = grammar_compile
        self._on_grammar_mask = grammar_mask

    # --- intake -----------------------------------------------------------------------------------------

    def reserve(self, num_samples: int, limit: int | None) -> bool:
        """Hold `num_samples` places in the waiting count if that keeps it <= `limit` (None: no limit).
        A reservation is used by `add(..., reserved=True)` or returned with `release`."""
        waiting = self.num_waiting
        with self._lock:
            if limit is not None and waiting + num_samples > limit:
                return False
            self._num_reserved += num_samples
            return True

    def release(self, num_samples: int) -> None:
        with self._lock:
            self._num_reserved -= num_samples

    def _live_cores(self) -> list[CoreHandle]:
        live = [c for c in self._cores if c.alive]
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core is running")
        return live

    def _route(self, prompt_token_ids: list[int], cache_salt: str | None) -> CoreHandle:
        """The core most likely to hold this prompt's prefix (its first full block), else the least
        loaded live core."""
        live = self._live_cores()
        if len(live) == 1:
            return live[0]
        key = None
        block = self.info.block_size
        if len(prompt_token_ids) >= block:
            head = ",".join(map(str, prompt_token_ids[:block])) + f"|{cache_salt or ''}"
            key = hashlib.blake2b(head.encode(), digest_size=16).digest()
            index = self._affinity.get(key)
            if index is not None and self._cores[index].alive:
                return self._cores[index]
        core = min(live, key=lambda c: (len(c.requests), c.index))
        if key is not None:
            self._affinity[key] = core.index
        return core

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        reserved: bool = False,
        group: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> RequestStream:
        """Submit one request now (on the event loop); iterate the returned stream for its snapshots
        until it finishes, and `aclose` it to abort early. An invalid request raises its error from the
        stream. `reserved`: the caller holds a `reserve` for `params.n` samples, which this uses.
        `output_kind`: what the stream yields (kvserve.engine.output_processor; DELTA for SSE)."""
        import time

        try:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if request_id in self._queues:
                raise KVServeError(f"duplicate request id {request_id!r}")
            core = self._route(prompt_token_ids, cache_salt)
        except BaseException:
            if reserved:
                self.release(params.n)
            raise
        queue: asyncio.Queue = asyncio.Queue()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._owner[request_id] = core
            core.requests.add(request_id)
            core.num_routed += 1
            tracked = self._outputs.add(
                request_id, prompt, prompt_token_ids, params, arrival_time, output_kind
            )
            core.num_sent += params.n
            if reserved:
                self._num_reserved -= params.n
        core.send(
            AddCmd(
                request_id, list(prompt_token_ids), params, prompt, cache_salt, arrival_time, group
            )
        )
        return RequestStream(self, request_id, queue, tracked)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """`add` as an async generator: leaving early (disconnect, timeout, cancellation) aborts."""
        stream = self.add(request_id, prompt_token_ids, params, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def _forget(self, request_id: str, abort: bool) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
            self._outputs.remove(request_id)
            core = self._owner.pop(request_id, None)
            if core is not None:
                core.requests.discard(request_id)
        if abort and core is not None and core.alive:
            core.send(AbortCmd([request_id]))

    def abort(self, request_id: str) -> None:
        self._forget(request_id, abort=True)

    # --- maintenance ------------------------------------------------------------------------------------

    def call(self, method: str, *args, core: int = 0, timeout_s: float = 60.0):
        """A named utility call on one core (blocking; off the event loop)."""
        return self._call(core, lambda call_id: UtilityCmd(call_id, method, list(args)), timeout_s)

    def _call(self, core: int, command, timeout_s: float = 60.0):
        handle = self._cores[core]
        if not handle.alive:
            raise EngineDeadError(
                handle.dead_reason or self.dead_reason or "the engine core stopped"
            )
        call_id = next(self._call_ids)
        pending = PendingCall(core)
        self._calls[call_id] = pending
        handle.send(command(call_id))
        if not pending.answered.wait(timeout_s):
            self._calls.pop(call_id, None)
            raise TimeoutError("the engine core did not answer in time")
        result = pending.result
        if result.error is not None:
            raise error_from_wire(result.error)
        return result.value

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes on every live core; False if any still has running requests."""
        return all([self.call("reset_prefix_cache", core=c.index) for c in self._cores if c.alive])

    def debug_engine(self) -> dict:
        """Block-pool state (invariants checked) of every live core, summed; per core under `cores`."""
        per_core = [
            self.call("debug_engine", core=c.index) | {"index": c.index}
            for c in self._cores
            if c.alive
        ]
        keys = ("num_free_blocks", "num_blocks", "num_requests")
        return {k: sum(d[k] for d in per_core) for k in keys} | {
            "invariants": "ok",
            "cores": per_core,
        }

    def warm_up(self) -> None:
        for c in self._cores:
            self.call("warm_up", core=c.index)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        raise NotImplementedError

    # --- core outputs (any thread) ----------------------------------------------------------------------

    def _on_core_outputs(self, core: CoreHandle, out: CoreOutputs) -> None:
        for result in out.results:
            pending = self._calls.pop(result.call_id, None)
            if pending is not None:
                pending.answer(result)
        items: list[tuple[str, object]] = []
        with self._lock:
            if out.stats is not None:
                core.stats = out.stats
                core.num_admitted = out.num_admitted_samples
                core.num_engine_waiting = out.num_waiting_samples
            for request_id in out.accepted:  # before its outputs: the core names it first
                items.append((request_id, ACCEPTED))
            for failure in out.failures:
                items.append((failure.request_id, error_from_wire(failure)))
            for output in self._outputs.process(out.deltas):
                items.append((output.request_id, output))
        if out.step is not None:
            s = out.step
            core.step_log.record(
                s.t_start_s, s.waited_s, s.commands_s, s.step_s, s.deliver_s, s.chunks, s.threads
            )
        if self._on_grammar_compile is not None:
            for seconds in out.grammar_compile_s:
                self._on_grammar_compile(seconds)
        if self._on_grammar_mask is not None:
            for seconds in out.grammar_mask_s:
                self._on_grammar_mask(seconds)
        self._deliver_all(items)
        if out.dead_reason is not None:
            self._core_died(core, out.dead_reason)

    def _core_died(self, core: CoreHandle, reason: str) -> None:
        """Take a core out of rotation; its requests fail with 503. The client dies with its last core."""
        with self._lock:
            if not core.alive:
                return
            core.alive = False
            core.dead_reason = reason
            orphans = list(core.requests)
            all_dead = not any(c.alive for c in self._cores)
            if all_dead:
                self.dead_reason = reason
        for call_id, pending in list(self._calls.items()):  # nobody will answer these calls
            if pending.core_index == core.index:
                self._calls.pop(call_id, None)
                pending.answer(UtilityResult(call_id, None, Failure("", "dead", reason)))
        dead = EngineDeadError(reason)
        self._deliver_all([(request_id, dead) for request_id in orphans])
        if all_dead and self.on_dead is not None:
            self.on_dead(reason)

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their requests' queues with one wake-up per event loop, not one per item
        (each `call_soon_threadsafe` writes to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            entry = self._queues.get(request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the event loop has closed (shutdown)
                pass


ACCEPTED = object()  # queued for a request when its core has accepted it (RequestStream.accepted)


class RequestStream:
    """The outputs of one submitted request, as an async iterator; `aclose` aborts it if unfinished."""

    def __init__(
        self, client: EngineClient, request_id: str, queue: asyncio.Queue, tracked: Tracked
    ) -> None:
        self.request_id = request_id
        self._client = client
        self._queue = queue
        self._tracked = tracked
        self._open = True
        self._accepted = False

    async def accepted(self, timeout_s: float | None = None) -> None:
        """Wait until the core has checked and added the request (its context, the cache's capacity,
        its grammar compiled): the one check a request gets. A refusal raises its error here, before
        any output; TimeoutError after `timeout_s` (None: the core's liveness bounds the wait)."""
        while not self._accepted:
            async with asyncio.timeout(timeout_s):
                item = await self._queue.get()
            if isinstance(item, BaseException):
                await self.aclose()
                raise item
            self._accepted = True  # the marker (outputs never come before it)
            if item is not ACCEPTED:
                raise RuntimeError(f"an output of {self.request_id} came before its acceptance")

    def so_far(self) -> RequestOutput:
        """The whole request as received until now (also after it ended or was aborted): what
        accounting reads for a request that did not finish, or for a stream's totals."""
        with self._client._lock:  # the core's thread applies deltas under this lock
            return so_far(self.request_id, self._tracked)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is ACCEPTED:  # a caller that did not wait for it
            self._accepted = True
            item = await self._queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._open = False
            self._client._forget(self.request_id, abort=False)
        return item

    def interrupt(self, error: BaseException) -> None:
        """Make the next read raise `error` (after the outputs already queued)."""
        if self._open:
            self._queue.put_nowait(error)

    def close(self) -> None:
        """End the request if it is still open (its engine request is aborted)."""
        if self._open:
            self._open = False
            self._client._forget(self.request_id, abort=True)

    async def aclose(self) -> None:
        self.close()


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
