"""A grammar that compiles slowly holds up its own request only (a schema of hundreds of
properties can compile for a minute; requests arriving meanwhile must neither wait for it nor fail
with it). The test holds the compiles with the test-only grammar gate (`grammar-gate:WHERE`,
tests/faults.py); the plain request must be answered while a compile is held."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from tests.faults import FaultGate
from tests.server_utils import running_server, wait_until

pytestmark = pytest.mark.slow

COMPILING = "compiling a structured-output grammar"  # the core's log line as a compile starts


def test_a_slow_grammar_does_not_hold_up_plain_requests(gpt2_model_dir, tmp_path):
    log = tmp_path / "server.log"
    compiles = FaultGate()
    args = ("--engine-core", "process", "--log-level", "info", "--max-model-len", "256",
            "--inject-fault", compiles.spec("grammar-gate"))  # fmt: skip
    with compiles, running_server(gpt2_model_dir, *args, log_path=log) as (url, _):
        compiles.hold()
        structured: dict = {}

        def send_structured() -> None:
            body = {"prompt": "a", "max_tokens": 5, "guided_json": {"type": "integer"}}
            structured["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=send_structured)
        thread.start()
        assert wait_until(lambda: COMPILING in log.read_text())
        # the grammar's compile is held in the core: a plain request is served meanwhile
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                           timeout=60)  # fmt: skip
        assert plain.status_code == 200, plain.text
        assert thread.is_alive()  # the structured request is still compiling
        compiles.open()
        thread.join()
        assert structured["response"].status_code == 200, structured["response"].text


def test_a_grammar_the_core_does_not_accept_in_time_is_the_requests_400_not_a_500():
    """The one check of a request is the core's, at add; the server waits for the core to accept it.
    A new grammar's wait is bounded (the core's compile limit twice, plus a margin) and past it the
    request gets a 400 naming its grammar; a plain request waits on the core's liveness alone; a dead
    core's error passes through."""
    import asyncio

    from kvserve.core.errors import InvalidRequestError
    from kvserve.core.sampling_params import SamplingParams, StructuredOutput
    from kvserve.engine.client import VALIDATE_MARGIN_S
    from kvserve.engine.wire import EngineDeadError
    from kvserve.server.responses import Job
    from kvserve.server.serving import OpenAIServing

    waits: list[float | None] = []
    closed: list[str] = []

    class Stream:  # a core that never accepts, or is dead
        def __init__(self, request_id, error):
            self.request_id, self.error = request_id, error

        async def accepted(self, timeout_s=None):
            waits.append(timeout_s)
            raise self.error

        def close(self):
            closed.append(self.request_id)

    def serving_over(error) -> OpenAIServing:
        serving = object.__new__(OpenAIServing)
        serving.options = SimpleNamespace(max_waiting=None, log_content=False)
        serving.engine = SimpleNamespace(
            info=SimpleNamespace(grammar_compile_timeout_s=2.0),
            reserve=lambda n, limit: True,
            release=lambda n: None,
            add=lambda request_id, *a, **k: Stream(request_id, error),
        )
        return serving

    def started(params, known) -> Job:
        fields = ("r", "completion", False, params, [[1, 2]], [None], False, False)
        return Job(*fields, grammar_known=known)

    grammar = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))
    serving = serving_over(TimeoutError())
    late = started(grammar, known=False)
    with pytest.raises(InvalidRequestError, match="did not compile within 34 s") as info:
        asyncio.run(serving._start(late))
    assert info.value.param == grammar.structured.param
    assert waits == [2 * 2.0 + VALIDATE_MARGIN_S]  # the core's limit, twice, + margin
    serving.release(late)
    assert closed == ["r"]  # the engine request it started is ended
    waits.clear()
    serving = serving_over(EngineDeadError("every core exited"))
    with pytest.raises(EngineDeadError, match="every core exited"):
        asyncio.run(serving._start(started(SamplingParams(), known=True)))
    assert waits == [None]  # a plain request: no timeout of its own


def _waiting_grammars(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve_grammar_requests_waiting "):
            return float(line.split()[1])
    return -1.0


def test_slow_grammars_hold_no_worker_and_the_smallest_goes_next(gpt2_model_dir, tmp_path):
    """fuzzing: five 50,000-way choices each held one of the four workers while the core compiled them
    one by one; a plain completion waited 57 s and a tiny regex behind them failed after 60 s. Now they
    wait for their turn on the event loop, and the smallest grammar waiting is next. The test holds the
    compiles in the core (a grammar gate) and lets them through one at a time."""
    log = tmp_path / "server.log"
    compiles = FaultGate()
    args = ("--engine-core", "process", "--log-level", "info", "--max-model-len", "256",
            "--inject-fault", compiles.spec("grammar-gate"), "--grace-period", "0")  # fmt: skip
    with compiles, running_server(gpt2_model_dir, *args, log_path=log) as (url, _):
        compiles.hold()
        finished: list[str] = []

        def send(name: str, extra: dict) -> threading.Thread:
            def post() -> None:
                body = {"prompt": "a", "max_tokens": 2} | extra
                with contextlib.suppress(httpx.HTTPError):  # the server stops before the last ones
                    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                    finished.append(
                        name if response.status_code == 200 else f"{name}: {response.text}"
                    )

            thread = threading.Thread(target=post, daemon=True)
            thread.start()
            return thread

        def big(
            i: int,
        ) -> dict:  # 100 KB constraints (cheap to compile), each distinct: ageing gives
            # each 10 s of arrival time over a 5-byte one, more than the tiny one arrives after them
            return {"guided_json": {"type": "integer", "description": f"{i}" + "x" * 100_000}}

        send("big0", big(0))
        assert wait_until(lambda: COMPILING in log.read_text())
        for i in range(1, 6):  # more than the four workers
            send(f"big{i}", big(i))
        assert wait_until(lambda: _waiting_grammars(url) == 5), _waiting_grammars(url)
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                           timeout=60)  # fmt: skip
        assert plain.status_code == 200, plain.text
        assert finished == []  # served while the first grammar still compiled
        tiny = send("tiny", {"guided_regex": "[0-9]"})
        assert wait_until(lambda: _waiting_grammars(url) == 6), _waiting_grammars(url)
        compiles.step(1)  # big0's compile
        assert wait_until(lambda: finished == ["big0"], timeout_s=60), finished
        compiles.step(1)  # the next one's: the smallest waiting
        tiny.join(timeout=60)
        assert finished == ["big0", "tiny"]


def test_a_client_that_leaves_takes_its_grammar_out_of_the_queue(gpt2_model_dir, tmp_path):
    """review: a queued grammar whose client had left was still compiled in its turn. The fault holds the
    first grammar's compile in the core (a grammar gate, never opened); the second client leaves while
    queued behind it, and its place must go at once (the queue polls the connection), not once the
    first compile ends."""
    log = tmp_path / "server.log"
    compiles = FaultGate()
    args = ("--engine-core", "process", "--log-level", "info", "--max-model-len", "256",
            "--inject-fault", compiles.spec("grammar-gate"), "--grace-period", "0")  # fmt: skip
    with compiles, running_server(gpt2_model_dir, *args, log_path=log) as (url, _):
        compiles.hold()
        first = {"prompt": "a", "max_tokens": 2, "guided_regex": "[0-9]+"}

        def post_first() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server stops before it is answered
                httpx.post(f"{url}/v1/completions", json=first, timeout=120)

        threading.Thread(target=post_first, daemon=True).start()
        assert wait_until(lambda: COMPILING in log.read_text())
        body = json.dumps({"prompt": "a", "max_tokens": 2, "guided_regex": "[a-z]+"}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as leaving:
            leaving.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )  # fmt: skip
            assert wait_until(lambda: _waiting_grammars(url) == 1)
        assert wait_until(lambda: _waiting_grammars(url) == 0), "the left request kept its place"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvserve_request_errors_total{error_type="client_closed_request"} 1.0' in metrics


def test_a_core_compiling_a_routed_grammar_keeps_stepping(gpt2_model_dir, tmp_path):
    """fuzzing/review: with data parallelism the front checks a request (compiling its grammar) on
    core 0 and may route it to core 1, which compiled the grammar again inside its step loop: every
    stream on core 1 stalled for the whole compile. Now the core compiles it on a thread of its own and
    adds the request after. The test holds the steps (a gate) until the requests are where they
    should be, and C's compile on core 1 (a grammar gate) until B has finished."""
    log = tmp_path / "server.log"
    steps, compiles = FaultGate(), FaultGate()
    args = ("--engine-core", "process", "--data-parallel-size", "2", "--max-model-len", "256",
            "--kv-cache-memory", "16MiB", "--log-level", "info",
            "--inject-fault", f"{steps.spec()},{compiles.spec('grammar-gate')}",
            "--grace-period", "0")  # fmt: skip
    regex = {"guided_regex": "[0-9]+", "max_tokens": 1}
    prompt_b = list(range(300, 348))  # three blocks of 16: C below shares B's first block
    with (
        steps,
        compiles,
        running_server(gpt2_model_dir, *args, log_path=log) as (url, _),
        httpx.Client(timeout=120) as http,
        ThreadPoolExecutor(1) as pool,
    ):
        # W: both cores idle, so core 0 runs it, and its check compiles the grammar on core 0
        assert http.post(f"{url}/v1/completions", json={"prompt": [5] * 20, **regex}).is_success
        assert log.read_text().count(COMPILING) == 1
        long = {"max_tokens": 200, "ignore_eos": True, "stream": True}
        steps.hold()
        steps.step(1)  # one step on each core: A's first token, B's first token
        with http.stream("POST", f"{url}/v1/completions", json={"prompt": [9] * 20, **long}) as a:
            a_lines = a.iter_lines()  # keep it: dropping it would close the stream
            next(a_lines)  # A runs on core 0 (held there), so B goes to core 1
            finished: list[str] = []
            body_b = {"prompt": prompt_b, "max_tokens": 60, "ignore_eos": True, "stream": True}

            def stream_b() -> None:
                with http.stream("POST", f"{url}/v1/completions", json=body_b) as b:
                    lines = b.iter_lines()
                    next(lines)
                    started.set()
                    for _ in lines:
                        pass
                finished.append("B")

            started = threading.Event()
            thread = threading.Thread(target=stream_b)
            thread.start()
            assert started.wait(60)
            # C: B's first block, so core 1; its check on core 0 is a lookup, then core 1 compiles
            compiles.hold()
            body_c = {"prompt": prompt_b[:32] + [7], **regex}
            c = pool.submit(http.post, f"{url}/v1/completions", json=body_c)
            assert wait_until(lambda: log.read_text().count(COMPILING) == 2)
            steps.open()  # B's other 59 steps run while core 1's compile of C is held
            thread.join(60)
            assert finished == ["B"], finished
            compiles.open()
            c = c.result(timeout=60)
            finished.append("C")
        assert c.status_code == 200, c.text
        assert c.json()["choices"][0]["text"].isdigit()
        assert finished == ["B", "C"], finished
        engines = http.get(f"{url}/ready").json()["engines"]
        assert [e["num_routed"] for e in engines] == [2, 2], engines
        debug = wait_until(lambda: (d := http.get(f"{url}/ready").json())["num_waiting"] == 0 and d)
        assert debug
