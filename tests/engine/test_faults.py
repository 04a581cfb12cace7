"""The test-only fault gates (kvserve/engine/faults.py) against the test's end (tests/faults.py): a held
gate lets exactly the steps it is given through, a command wakes a held step, hanging up or a silent
test opens it, and the sleeps they replaced are refused with the name of the replacement."""

from __future__ import annotations

import threading

import pytest

from kvserve.engine.faults import FaultInjection, Gate
from tests.faults import FaultGate


def test_parse_takes_seeds_and_gates_and_refuses_the_sleeps():
    faults = FaultInjection.parse("request:7,engine:8,gate:4001,grammar-gate:/tmp/g/gate.sock")
    assert faults == FaultInjection(7, 8, "4001", "/tmp/g/gate.sock")
    assert FaultInjection.parse(None) is None and FaultInjection.parse("") is None
    with pytest.raises(ValueError, match=r"delay:SECONDS \(a sleep\) is gone; use gate:WHERE"):
        FaultInjection.parse("delay:0.01")
    with pytest.raises(ValueError, match="use grammar-gate:WHERE"):
        FaultInjection.parse("request:1,grammar:5")
    with pytest.raises(ValueError, match="got 'gate:x'"):
        FaultInjection.parse("gate:x")  # neither a path nor a port
    with pytest.raises(ValueError, match="got 'slow:1'"):
        FaultInjection.parse("slow:1")


@pytest.mark.parametrize("tcp", [False, True])
def test_a_gate_without_a_test_is_a_clear_error(tcp):
    with FaultGate(tcp=tcp) as test:
        address = test.address
    with pytest.raises(ConnectionError, match=f"no test listens at {address}"):
        Gate(address, "gate")


def _passes(gate: Gate, num: int) -> list[bool]:
    """What `num` tries to pass return, each waited for at most 0.2 s in a thread (the gate's own
    bound is long)."""
    results: list[bool] = []
    for _ in range(num):
        done = threading.Event()
        stop = threading.Event()

        def attempt(done=done, stop=stop) -> None:
            if gate.wait(stop.is_set):
                gate.passed()
                done.set()

        thread = threading.Thread(target=attempt)
        thread.start()
        results.append(done.wait(0.2))
        if not results[-1]:  # held: interrupt it, as a command arriving does
            with gate._condition:
                stop.set()
                gate._condition.notify_all()
        thread.join(5)
        assert not thread.is_alive()
    return results


@pytest.mark.parametrize("tcp", [False, True])
def test_held_gate_lets_exactly_the_given_steps_through(tcp):
    with FaultGate(tcp=tcp) as test:
        gate = Gate(test.address, "gate")
        assert test.num_cores == 1
        assert _passes(gate, 2) == [True, True]  # open from the start
        test.hold()
        assert _passes(gate, 1) == [False]  # the interrupted try returns False: not passed
        test.step(2)
        assert _passes(gate, 3) == [True, True, False]
        test.wait_passed(2)
        assert test.num_passed() == 2
        test.open()
        assert _passes(gate, 2) == [True, True]
        with test.held():
            assert _passes(gate, 1) == [False]
        assert _passes(gate, 1) == [True]


def test_hanging_up_opens_the_gate_and_a_silent_test_does_not_hold_it_forever():
    test = FaultGate()
    gate = Gate(test.address, "gate")
    test.hold()
    assert _passes(gate, 1) == [False]
    test.close()
    assert gate.wait() is True  # returns once the connection's end is read
    with FaultGate() as silent:
        gate = Gate(silent.address, "gate", timeout_s=0.1)
        silent.hold()
        assert gate.wait() is True  # after 0.1 s it opens itself (and logs it)
        assert _passes(gate, 1) == [True]


def test_stopping_opens_a_held_gate():
    stopping = threading.Event()
    condition = threading.Condition()
    with FaultGate() as test:
        gate = Gate(test.address, "gate", condition, stopping.is_set)
        test.hold()
        assert _passes(gate, 1) == [False]
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(gate.wait()))
        thread.start()
        with condition:
            stopping.set()
            condition.notify_all()  # as ServingLoop.shutdown does
        thread.join(5)
        assert result == [True]


def test_a_held_step_gate_says_how_many_requests_it_holds():
    with FaultGate() as test:
        gate = Gate(test.address, "gate")
        test.hold()
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(gate.wait(num_requests=lambda: 3)))
        thread.start()
        test.wait_held(3)
        with pytest.raises(TimeoutError, match="were not held with 4 requests"):
            test.wait_held(4, timeout_s=0.1)
        test.step(1)
        thread.join(5)
        assert result == [True]


def test_a_held_engine_core_steps_only_when_told_and_still_aborts_and_stops(gpt2_model_dir):
    """The engine core with `gate:WHERE` (in-process): held, it takes no step; `step(3)` gives exactly
    three tokens; an abort reaches a held core; shutting down a held core with a running request ends
    its thread (the gate opens for a stopping core)."""
    import asyncio

    from kvserve import SamplingParams
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.core import EngineCore

    config = build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=128)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    with FaultGate() as steps:
        engine = AsyncEngine(EngineCore(config), faults=FaultInjection(step_gate=steps.address))

        def generated() -> int:
            return engine.call_in_engine_thread(
                lambda e: sum(len(r.output_token_ids) for r in e.scheduler.requests.values())
            )

        def unfinished() -> bool:
            return engine.call_in_engine_thread(lambda e: e.has_unfinished_requests())

        async def main() -> None:
            stream = engine.add("r", [5, 6, 7], params)
            await asyncio.to_thread(steps.wait_held, 1)
            assert await asyncio.to_thread(generated) == 0  # held before its first step
            await asyncio.to_thread(steps.step, 3)
            await asyncio.to_thread(steps.wait_passed, 3)
            await asyncio.to_thread(steps.wait_held, 1)  # and held again after them
            assert await asyncio.to_thread(generated) == 3
            await stream.aclose()  # an abort while held
            assert not await asyncio.to_thread(unfinished)
            kept = engine.add("s", [5, 6, 8], params)  # running (held) when the engine shuts down
            await asyncio.to_thread(steps.wait_held, 1)
            assert kept.request_id == "s"

        steps.hold()
        asyncio.run(main())
        engine.shutdown(timeout_s=60)
        assert not engine.serving_loop._thread.is_alive()
