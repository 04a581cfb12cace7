"""A representative subset of the server tests again, with the engine core as a thread of the server's
process (`--engine-core in-process`): issue 12's hardening and fault tests
(tests/server/test_server_hardening.py). The other server modules run with the default (an engine-core
process); docs/engine_core.md."""

from __future__ import annotations

from tests.server.test_server_hardening import *  # noqa: F403 - the same tests, collected again here
from tests.server_utils import engine_core_in_process  # noqa: F401 - autouse


def test_the_engine_core_is_a_thread_of_the_server_process(server):
    import httpx
    import psutil

    pid = httpx.get(f"{server[0]}/ready").json()["engines"][0]["pid"]
    assert "kvserve.cli" in " ".join(psutil.Process(pid).cmdline())  # the API server itself
