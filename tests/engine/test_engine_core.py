"""kvserve/engine/core.py: one engine core owns its requests, from the one check at add to the last delta.

Driven through its serving loop (kvserve/engine/serving_loop.py) as a client drives it (commands in
with `submit`, `CoreOutputs` out through `emit`), on the small GPT-2-tokenised checkpoint; the oracle for the text is the same core driven
directly (`add_request` / `step`)."""

from __future__ import annotations

import queue

import pytest

from kvserve import SamplingParams
from kvserve.core.sampling_params import StructuredOutput
from kvserve.engine.args import build_engine_config
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import FaultInjection
from kvserve.engine.serving_loop import ServingLoop
from kvserve.engine.wire import AbortCmd, CoreOutputs
from tests.faults import FaultGate
from tests.loop_messages import add_command, messages_until
from tests.server_utils import wait_until


@pytest.fixture(scope="module")
def config(gpt2_model_dir):
    return build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=128)


def test_a_refused_request_fails_at_add_and_a_grammar_is_not_compiled_for_it(config):
    """The one check runs before anything else: a request too long for the context fails in the
    first message, before any step; one with a grammar fails the same way without waiting for (or
    starting) a compile."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(config)
    loop = ServingLoop(core, outputs.put)
    loop.start()
    try:
        digits = StructuredOutput("regex", "[0-9]+")
        loop.submit(add_command("long", list(range(5, 205)), SamplingParams(max_tokens=4)))
        loop.submit(
            add_command("grammar", [5, 6, 7], SamplingParams(max_tokens=500, structured=digits))
        )
        failures = {}

        def both_refused(message: CoreOutputs) -> bool:
            failures.update({f.request_id: f for f in message.failures})
            return len(failures) == 2

        got = messages_until(outputs, both_refused)
        assert (failures["long"].kind, failures["long"].param) == ("context_length", "prompt")
        assert (failures["grammar"].kind, failures["grammar"].param) == (
            "context_length",
            "max_tokens",
        )
        assert not any(m.deltas or m.accepted for m in got)
        assert core._grammars is None  # nothing compiled, nor the vocabulary indexed, for it
    finally:
        loop.shutdown()


def test_the_loop_streams_what_the_core_returns_when_driven_directly(config):
    """Accepted at once, then deltas whose concatenation is the direct run's output; the core holds
    no record of the request after its last delta, and every block is back in the pool."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["zz"])
    prompt = [5, 6, 7, 8]
    direct = EngineCore(config)
    direct.add_request("direct", prompt, params)
    while direct.has_unfinished_requests():
        final = direct.step()
    expected = final[0].outputs[0]

    outputs: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(config)
    loop = ServingLoop(core, outputs.put)
    loop.start()
    try:
        loop.submit(add_command("looped", prompt, params))
        got = messages_until(outputs, lambda m: any(d.finished for d in m.deltas))
        assert [r for m in got for r in m.accepted] == ["looped"]
        samples = [s for m in got for d in m.deltas for s in d.samples]
        assert "".join(s.new_text for s in samples) == expected.text
        assert tuple(t for s in samples for t in s.new_token_ids) == tuple(expected.token_ids)
        assert (samples[-1].finish_reason, samples[-1].stop_reason) == (
            expected.finish_reason,
            expected.stop_reason,
        )
        assert core.outputs is None  # the loop accumulates nothing: the client does
        assert not core.has_unfinished_requests() and core.num_free_blocks() == 64
    finally:
        loop.shutdown()


def test_an_abort_while_the_grammar_compiles_never_adds_the_request(config):
    """The compile is held by a grammar gate while the abort and a plain request go through; once
    it is let through and its result handled, the aborted request was never added."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(config)
    with FaultGate() as compiles:
        compiles.hold()
        loop = ServingLoop(core, outputs.put, faults=FaultInjection(grammar_gate=compiles.address))
        loop.start()
        try:
            params = SamplingParams(max_tokens=3, structured=StructuredOutput("regex", "[a-c]+"))
            loop.submit(add_command("waits", [5, 6, 7], params))
            loop.submit(AbortCmd(["waits"]))
            loop.submit(add_command("plain", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True)))
            got = messages_until(outputs, lambda m: any(d.finished for d in m.deltas))
            assert got[-1].num_admitted_samples == 2  # the aborted one left the queue too
            compiles.step(1)
            compiles.wait_passed(1)
            wait_until(lambda: not loop._compiling, timeout_s=30)  # its result was handled
            loop.submit(add_command("after", [5], SamplingParams(max_tokens=1, ignore_eos=True)))
            got += messages_until(outputs, lambda m: any(d.finished for d in m.deltas))
            assert [r for m in got for r in m.accepted] == ["plain", "after"]
            assert not core.has_unfinished_requests()
        finally:
            loop.shutdown()


def test_a_request_aborted_on_probation_lets_the_quarantine_go_on(config):
    """After a failing step with several newcomers, they are re-admitted one at a time (the one on
    probation first). Aborting the one on probation before it ran a step must let the next one in:
    before the fix, probation stayed on the aborted request and the rest were never re-admitted
    (and the loop, with a non-empty quarantine, never slept)."""
    core = EngineCore(config)
    loop = ServingLoop(core, lambda out: None)  # driven by hand: no thread
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        core.add_request("a", [5, 6], params)
        core.add_request("b", [7, 8], params)
        loop._isolate(["a", "b"], RuntimeError("a step failed with both new"))
        assert not core.has_unfinished_requests()  # both wait in the quarantine
        loop._apply_commands()
        assert loop._probation is not None and loop._probation.request_id == "a"
        loop.submit(AbortCmd(["a"]))
        loop._apply_commands()
        assert loop._probation is not None and loop._probation.request_id == "b"
        finished = []
        for _ in range(20):
            finished += [d.request_id for d in core.step_deltas() if d.finished]
            if not core.has_unfinished_requests():
                break
        assert finished == ["b"]
        assert core.num_free_blocks() == 64
    finally:
        loop.shutdown()
