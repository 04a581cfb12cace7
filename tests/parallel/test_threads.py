"""The OpenMP defaults of the `kvserve` command line (kvserve/threads.py, docs/performance.md "Threads"):
applied when the user set none of a group's variables, never over the user's, and inherited by the
engine-core process. The oracle is libgomp's own account of the values it read (`OMP_DISPLAY_ENV`,
printed to stderr when torch loads it), in fresh processes; no timing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from kvserve.threads import APPLIED_MARKER, THREAD_DEFAULTS, THREAD_VARIABLES, thread_defaults_for
from tests import REPO_ROOT
from tests.server_utils import running_server

ROOT = str(REPO_ROOT)


def _clean_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARIABLES, APPLIED_MARKER)}
    return env | {"OMP_DISPLAY_ENV": "VERBOSE", "TOKENIZERS_PARALLELISM": "false"} | overrides


def _libgomp_settings(text: str) -> list[dict[str, str]]:
    """One dict per OpenMP runtime that started: each process prints one block per libgomp it loads
    (torch's, which the C kernels share, and sentencepiece's own copy)."""
    blocks = re.findall(
        r"OPENMP DISPLAY ENVIRONMENT BEGIN(.*?)OPENMP DISPLAY ENVIRONMENT END", text, re.S
    )
    return [dict(re.findall(r"^\s*(\w+) = '([^']*)'", block, re.M)) for block in blocks]


# libgomp's spin count (what decides how an idle thread waits) when nothing is set, and with ours
LIBGOMP_SPIN_UNSET = "300000"  # <= 1 thread per CPU, as here
SPIN_OF_POLICY = {"PASSIVE": "0", "ACTIVE": "30000000000"}
OUR_SPIN = (
    THREAD_DEFAULTS.get("GOMP_SPINCOUNT") or SPIN_OF_POLICY[THREAD_DEFAULTS["OMP_WAIT_POLICY"]]
)


def _one_value(settings: list[dict[str, str]], name: str) -> str:
    (value,) = {seen[name] for seen in settings}  # every runtime of the process read the same
    return value


def _generate(model_dir, **env: str) -> list[dict[str, str]]:
    cmd = [sys.executable, "-m", "kvserve", "generate", "--model", str(model_dir),
           "--prompt", "hi", "--max-tokens", "1"]  # fmt: skip
    result = subprocess.run(cmd, env=_clean_env(**env), cwd=ROOT, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    settings = _libgomp_settings(result.stderr)
    assert settings, result.stderr[-3000:]
    return settings


def test_a_default_stays_out_when_any_variable_of_its_group_is_set():
    assert thread_defaults_for({}) == dict(THREAD_DEFAULTS)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        left = thread_defaults_for({name: "anything"})
        assert not set(left) & {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}
    assert "OMP_NUM_THREADS" not in thread_defaults_for({"OMP_NUM_THREADS": "3"})


CLI_THEN_ENV = """import json, os
from kvserve.cli import main
from kvserve.threads import THREAD_VARIABLES
try:
    main(["--version"])
except SystemExit:
    pass
print(json.dumps({name: os.environ.get(name) for name in THREAD_VARIABLES}))"""


def test_the_cli_entry_sets_the_defaults_only_where_unset():
    _, out = _python(CLI_THEN_ENV)
    assert json.loads(out.splitlines()[-1]) == {k: THREAD_DEFAULTS.get(k) for k in THREAD_VARIABLES}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        _, out = _python(CLI_THEN_ENV, **{name: "7"})
        assert json.loads(out.splitlines()[-1]) == {
            k: "7" if k == name else None for k in THREAD_VARIABLES
        }


def test_the_cli_applies_the_default_when_unset(gpt2_model_dir):
    assert OUR_SPIN != LIBGOMP_SPIN_UNSET
    seen = _generate(gpt2_model_dir)
    assert _one_value(seen, "GOMP_SPINCOUNT") == OUR_SPIN, seen


def test_the_users_setting_wins(gpt2_model_dir):
    assert _one_value(_generate(gpt2_model_dir, GOMP_SPINCOUNT="777"), "GOMP_SPINCOUNT") == "777"
    seen = _generate(gpt2_model_dir, OMP_WAIT_POLICY="ACTIVE")
    assert _one_value(seen, "OMP_WAIT_POLICY") == "ACTIVE"
    assert _one_value(seen, "GOMP_SPINCOUNT") == SPIN_OF_POLICY["ACTIVE"]


@pytest.fixture(scope="module")
def server(gpt2_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("threads") / "server.log"
    with pytest.MonkeyPatch.context() as patch:  # the server inherits this process's environment
        for name in (*THREAD_VARIABLES, APPLIED_MARKER):
            patch.delenv(name, raising=False)
        patch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
        with running_server(gpt2_model_dir, "--engine-core", "process", log_path=log) as (url, _):
            yield url, log


def test_the_engine_core_process_inherits_the_default_and_reports_it(server):
    url, log = server
    engine = httpx.get(f"{url}/debug/steps").json()["engine"]
    expected = [f"{name}={value} (kvserve default)" for name, value in THREAD_DEFAULTS.items()]
    assert all(part in engine["threads"] for part in expected), engine["threads"]
    text = log.read_text()
    assert f"threads    {engine['threads']}" in text  # the startup summary
    started = _libgomp_settings(text)
    assert started  # at least the engine core's runtime; the API server's too if it loads torch
    assert _one_value(started, "GOMP_SPINCOUNT") == OUR_SPIN, started


def _python(code: str, **env: str) -> tuple[list[dict[str, str]], str]:
    result = subprocess.run([sys.executable, "-c", code], env=_clean_env(**env), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return _libgomp_settings(result.stderr), result.stdout.strip()


def test_the_offline_api_loads_torch_with_the_default_and_gives_the_environment_back():
    code = "import os\nfrom kvserve import LLM\nprint(sorted(k for k in os.environ if 'OMP' in k))"
    seen, left = _python(code)
    assert _one_value(seen, "GOMP_SPINCOUNT") == OUR_SPIN, seen
    assert left == "['OMP_DISPLAY_ENV']"  # a program the user starts next sees what it saw before
    assert _one_value(_python(code, GOMP_SPINCOUNT="777")[0], "GOMP_SPINCOUNT") == "777"
    # torch imported first: too late for this process, and nothing is set for its children either
    seen, left = _python("import torch\n" + code)
    assert _one_value(seen, "GOMP_SPINCOUNT") == LIBGOMP_SPIN_UNSET
    assert left == "['OMP_DISPLAY_ENV']"


def test_spawned_ranks_get_the_defaults_the_offline_api_loaded_torch_with(monkeypatch):
    from kvserve import threads

    for name in (*THREAD_VARIABLES, APPLIED_MARKER):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_LOADED_WITH", dict(THREAD_DEFAULTS))
    expected = "; ".join(
        ["2 OpenMP threads"] + [f"{k}={v} (kvserve default)" for k, v in THREAD_DEFAULTS.items()]
    )
    assert threads.describe_threads(2) == expected
    with threads.spawn_environment():
        assert {k: os.environ.get(k) for k in THREAD_DEFAULTS} == dict(THREAD_DEFAULTS)
        assert threads.describe_threads(2) == expected
    assert not any(k in os.environ for k in (*THREAD_DEFAULTS, APPLIED_MARKER))
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")  # the user's, now in the environment: kept, marked
    with threads.spawn_environment():
        assert os.environ["GOMP_SPINCOUNT"] == "5"
        assert "GOMP_SPINCOUNT=5 (set by user)" in threads.describe_threads(2)
    assert os.environ["GOMP_SPINCOUNT"] == "5"


def test_the_thread_pool_size_is_on_metrics_and_in_the_step_log(server):
    """The adaptive thread policy's state (kvserve/threads.py ThreadPoolSizer) reaches /metrics and
    /debug/steps: the engine core runs 2 threads here (this server has no OMP_NUM_THREADS), and a
    neighbour (other tests) may have taken one, so any count from 1 to 2 is right."""
    url, _ = server
    start = httpx.get(f"{url}/debug/steps", params={"since": 10**9}).json()["num_recorded"]
    body = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    steps = httpx.get(f"{url}/debug/steps", params={"since": start}).json()["steps"]
    assert steps and all(1 <= row["threads"] <= 2 for row in steps), steps
    metrics = httpx.get(f"{url}/metrics").text.splitlines()
    threads = [float(x.split()[-1]) for x in metrics if x.startswith("kvserve_engine_threads{")]
    changes = [x for x in metrics if x.startswith("kvserve_engine_thread_changes_total{")]
    lost = [float(x.split()[-1]) for x in metrics if x.startswith("kvserve_engine_cpu_lost_ratio{")]
    assert len(threads) == 1 and 1 <= threads[0] <= 2 and len(changes) == 1, metrics
    assert len(lost) == 1 and lost[0] >= 0.0
