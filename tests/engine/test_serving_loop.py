"""kvserve/engine/serving_loop.py: the loop that serves one engine core, as its clients drive it.

Commands in with `submit`, `CoreOutputs` out through `emit`, on the small GPT-2-tokenised checkpoint:
refusals, utility calls, maintenance calls, the quarantine after a failing step, the loop's death and
its shutdown. tests/engine/test_engine_core.py drives the core through it end to end (streams,
grammars)."""

from __future__ import annotations

import queue
import threading

import pytest

from kvserve import SamplingParams
from kvserve.core.sampling_params import StructuredOutput
from kvserve.engine.args import build_engine_config
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import FaultInjection
from kvserve.engine.serving_loop import ServingLoop
from kvserve.engine.wire import AbortCmd, Failure, UtilityCmd
from tests.loop_messages import TIMEOUT_S, add_command, messages_until
from tests.server_utils import wait_until

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def config(gpt2_model_dir):
    return build_engine_config(gpt2_model_dir, num_blocks=NUM_BLOCKS, max_model_len=128)


@pytest.fixture
def started(config):
    """A started loop over a fresh core, and the queue its messages arrive on; shut down after."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(config)
    loop = ServingLoop(core, outputs.put)
    loop.start()
    yield loop, outputs
    loop.shutdown()


def test_a_refused_add_comes_back_as_a_failure_and_counts_as_taken_from_the_queue(started):
    """A prompt with a token outside the vocabulary fails in the first message, before any step,
    with the core's own error; its sample counts as admitted (it left the queue) and no request is
    held for it."""
    loop, outputs = started
    vocab = loop.core.config.model.vocab_size
    loop.submit(add_command("bad", [5, vocab], SamplingParams(max_tokens=2, n=2)))
    got = messages_until(outputs, lambda m: m.step is not None)
    assert got[0].step is None and not got[0].accepted  # the admissions, before the step
    [failure] = got[0].failures
    assert (failure.request_id, failure.kind, failure.param) == ("bad", "invalid", "prompt")
    assert str(vocab) in failure.message
    assert got[-1].num_admitted_samples == 2
    assert not loop.core.has_unfinished_requests()


def test_utility_calls_are_answered_with_their_value_or_their_failure(started):
    loop, outputs = started
    loop.submit(UtilityCmd(1, "debug_engine"))
    loop.submit(UtilityCmd(2, "no_such_method"))
    got = messages_until(outputs, lambda m: len(m.results) == 2)
    [debug, unknown] = got[-1].results
    assert (debug.call_id, debug.error) == (1, None)
    assert debug.value == {
        "num_free_blocks": NUM_BLOCKS,
        "num_blocks": NUM_BLOCKS,
        "num_requests": 0,
        "invariants": "ok",
    }
    assert unknown.call_id == 2 and unknown.value is None
    assert unknown.error == Failure(
        "", "request_failed", "internal error: KeyError('no_such_method')"
    )


def test_a_maintenance_call_runs_in_the_loop_thread_with_the_core(started):
    loop, outputs = started
    seen: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit(lambda core: seen.put((core, threading.current_thread().name)))
    assert seen.get(timeout=TIMEOUT_S) == (loop.core, "kvserve-engine")


def test_an_abort_takes_a_request_out_of_the_quarantine(config):
    """Three newcomers of a failed step wait in the quarantine; the one on probation comes back
    first. Aborting one still in the quarantine means it never comes back: only the other two
    finish, and every block returns to the pool."""
    core = EngineCore(config)
    loop = ServingLoop(core, lambda out: None)  # driven by hand: no thread
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for request_id, prompt in (("a", [5, 6]), ("b", [7, 8]), ("c", [9, 10])):
            core.add_request(request_id, prompt, params)
        loop._isolate(["a", "b", "c"], RuntimeError("a step failed with three new"))
        assert not core.has_unfinished_requests()
        loop.submit(AbortCmd(["c"]))
        loop._apply_commands()
        assert loop._probation.request_id == "a"
        assert [r.request_id for r in loop._quarantine] == ["b"]
        finished = []
        for _ in range(40):
            loop._apply_commands()
            finished += [d.request_id for d in loop._step() if d.finished]
            if not core.has_unfinished_requests() and not loop._quarantine:
                break
        assert finished == ["a", "b"]
        assert core.num_free_blocks() == NUM_BLOCKS
    finally:
        loop.shutdown()


def test_a_failure_no_request_explains_kills_the_loop_and_says_why(config):
    """`engine_seed` makes the loop itself fail after the step that follows that request's add: the
    last message carries the reason, the loop's `dead_reason` says the same, and the thread ends."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    loop = ServingLoop(EngineCore(config), outputs.put, faults=FaultInjection(engine_seed=7))
    loop.start()
    try:
        loop.submit(add_command("fatal", [5, 6], SamplingParams(max_tokens=4, seed=7)))
        got = messages_until(outputs, lambda m: m.dead_reason is not None)
        reason = "the engine loop stopped: RuntimeError('injected engine fault')"
        assert got[-1].dead_reason == reason == loop.dead_reason
        assert [r for m in got for r in m.accepted] == ["fatal"]
        loop._thread.join(TIMEOUT_S)
        assert not loop._thread.is_alive()
    finally:
        loop.shutdown()


def test_shutdown_joins_the_loop_and_ends_the_grammar_thread(started):
    """After a grammar compiled on the grammar thread, `shutdown` returns with the loop's thread
    ended; the grammar thread takes its stop and ends too."""
    loop, outputs = started
    params = SamplingParams(
        max_tokens=2, ignore_eos=True, structured=StructuredOutput("regex", "[a-c]+")
    )
    loop.submit(add_command("grammar", [5, 6, 7], params))
    got = messages_until(outputs, lambda m: any(d.finished for d in m.deltas))
    assert [r for m in got for r in m.accepted] == ["grammar"]
    assert sum(len(m.grammar_compile_s) for m in got) == 1
    loop.shutdown()
    assert not loop._thread.is_alive()
    wait_until(lambda: not loop._grammar_thread.is_alive(), timeout_s=TIMEOUT_S)
    assert loop.dead_reason is None
