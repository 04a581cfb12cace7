"""The async engine charges a failure to the request that caused it: several newcomers admitted in the
failing step are re-admitted one at a time until the culprit is found; the others complete unchanged and
the cache is whole afterwards (compared with the same requests run alone)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve import SamplingParams
from kvserve.engine.args import build_engine_config
from kvserve.engine.async_engine import AsyncEngine, RequestFailedError
from kvserve.engine.core import EngineCore
from kvserve.engine.faults import FaultInjection
from tests.faults import FaultGate

FAULT_SEED = 99


@pytest.fixture(scope="module")
def config(gpt2_model_dir):
    return build_engine_config(gpt2_model_dir, num_blocks=64, max_model_len=128)


async def _collect(stream):
    outputs = [o async for o in stream]
    return outputs[-1]


def test_culprit_among_newcomers_of_one_step_fails_alone(config, caplog):
    engine = AsyncEngine(EngineCore(config), faults=FaultInjection(request_seed=FAULT_SEED))
    reference = EngineCore(config)
    params = [SamplingParams(max_tokens=6, seed=s, temperature=1.0) for s in (1, 2, FAULT_SEED, 3)]
    prompts = [[5, 6, 7 + i] for i in range(4)]
    inside, gate = threading.Event(), threading.Event()

    def hold(_engine) -> None:  # keeps the engine thread between steps while the adds queue up
        inside.set()
        gate.wait(30)

    holder = threading.Thread(target=engine.call_in_engine_thread, args=(hold,))
    holder.start()
    assert inside.wait(30)

    async def main():
        streams = [
            engine.add(f"r{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        gate.set()  # all four are applied in one go and admitted in the same step
        return await asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True)

    results = asyncio.run(main())
    holder.join(30)
    assert isinstance(results[2], RequestFailedError)
    assert "retrying them one by one" in caplog.text  # they did share the failing step
    for i in (0, 1, 3):
        reference.add_request(f"ref{i}", prompts[i], params[i])
        while reference.has_unfinished_requests():
            done = reference.step()
        expected = [o for o in done if o.request_id == f"ref{i}"][0]
        assert results[i].outputs[0].token_ids == expected.outputs[0].token_ids
    engine.call_in_engine_thread(lambda e: e.check_invariants())
    assert engine.call_in_engine_thread(lambda e: e.num_free_blocks()) == 64
    assert not engine.dead and engine.num_waiting == 0
    engine.shutdown()


def test_reservations_make_the_waiting_count_exact(config):
    engine = AsyncEngine(EngineCore(config))
    assert engine.reserve(3, limit=4) and engine.num_waiting == 3
    assert not engine.reserve(2, limit=4)  # 3 + 2 > 4
    engine.release(3)
    assert engine.num_waiting == 0
    engine.shutdown()


def test_a_grammar_the_core_has_not_compiled_waits_off_the_step_loop(config):
    """A request reaching the core with a grammar it has not compiled (data parallelism routes a request
    away from the core that checked it) waits while a thread compiles it: the step loop goes on (a plain
    request finishes meanwhile), an abort during the compile takes it out of the queue (the waiting
    count returns to 0) and a grammar that fails to compile fails its request alone. The test holds
    the compiles (a grammar gate) until the plain request has finished."""
    from kvserve.core.errors import InvalidRequestError
    from kvserve.core.sampling_params import StructuredOutput
    from tests.server_utils import wait_until

    compiles = FaultGate()
    engine = AsyncEngine(EngineCore(config), faults=FaultInjection(grammar_gate=compiles.address))
    compiles.hold()
    digits = StructuredOutput("regex", "[0-9]+")
    constrained = SamplingParams(max_tokens=3, temperature=0, structured=digits)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    finished: list[str] = []

    async def run(request_id: str, params: SamplingParams):
        try:
            out = await _collect(engine.add(request_id, [5, 6, 7], params))
        except InvalidRequestError as exc:
            out = exc
        finished.append(request_id)
        return out

    async def main():
        aborted = engine.add("aborted", [5, 6, 7], constrained)
        await asyncio.sleep(0)
        await aborted.aclose()  # while its grammar compiles
        waiting = asyncio.create_task(run("grammar", constrained))
        plain_out = await run("plain", plain)
        assert not waiting.done()  # the compiles are held: it waits, the step loop does not
        await asyncio.to_thread(compiles.open)
        return await waiting, plain_out

    grammar, plain_out = asyncio.run(main())
    assert finished == ["plain", "grammar"]  # the plain request did not wait for the compile
    assert grammar.outputs[0].text.isdigit() and len(plain_out.outputs[0].token_ids) == 4
    assert wait_until(lambda: engine.num_waiting == 0)  # the aborted one left the queue

    async def broken():
        bad = SamplingParams(max_tokens=3, structured=StructuredOutput("regex", "a(b"))
        return await run("broken", bad)

    error = asyncio.run(broken())
    assert isinstance(error, InvalidRequestError) and "parenthesis" in str(error)
    assert wait_until(lambda: engine.num_waiting == 0)
    assert not engine.call_in_engine_thread(lambda e: e.has_unfinished_requests())
    assert engine.call_in_engine_thread(lambda e: e.num_free_blocks()) == 64
    assert not engine.dead
    engine.shutdown()
    compiles.close()
