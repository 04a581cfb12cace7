"""A grammar that compiles slowly holds up its own request only (fuzzing: a schema of 700
properties compiled for over 60 s, and every request arriving meanwhile, validated on the engine
core's command loop, waited and then failed with a 500). The compile is slowed by the test-only
fault `grammar:SECONDS`; the plain request must be answered while it runs."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server_utils import running_server, wait_until

pytestmark = pytest.mark.slow

GRAMMAR_DELAY_S = 30


def test_a_slow_grammar_does_not_hold_up_plain_requests(gpt2_model_dir, tmp_path):
    log = tmp_path / "server.log"
    args = ("--engine-core", "process", "--log-level", "info", "--max-model-len", "256",
            "--inject-fault", f"grammar:{GRAMMAR_DELAY_S}")  # fmt: skip
    with running_server(gpt2_model_dir, *args, log_path=log) as (url, _):
        structured: dict = {}

        def send_structured() -> None:
            body = {"prompt": "a", "max_tokens": 5, "guided_json": {"type": "integer"}}
            structured["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=send_structured)
        thread.start()
        assert wait_until(lambda: "compiling a structured-output grammar" in log.read_text())
        # the grammar's check sleeps 30 s in the core: a plain request is served meanwhile
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                           timeout=GRAMMAR_DELAY_S / 2)  # fmt: skip
        assert plain.status_code == 200, plain.text
        assert thread.is_alive()  # the structured request is still compiling
        thread.join()
        assert structured["response"].status_code == 200, structured["response"].text


def test_a_grammar_check_past_the_timeout_is_the_requests_400_not_a_500():
    from kvserve.core.errors import InvalidRequestError
    from kvserve.core.sampling_params import SamplingParams, StructuredOutput
    from kvserve.engine.client import VALIDATE_TIMEOUT_S, EngineClient

    client = object.__new__(EngineClient)  # only validate(), over a core that never answers
    timeouts: list[float] = []

    def never_answers(core, command, timeout_s):
        timeouts.append(timeout_s)
        raise TimeoutError("the engine core did not answer in time")

    client._call = never_answers
    grammar = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))
    with pytest.raises(InvalidRequestError, match="did not compile within 60 s"):
        client.validate([1, 2], grammar)
    with pytest.raises(TimeoutError):  # without a grammar the core itself is late: not a 400
        client.validate([1, 2], SamplingParams())
    assert timeouts == [VALIDATE_TIMEOUT_S] * 2
