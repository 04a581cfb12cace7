"""Against the default server (`kvserve serve --model kvserve-demo`, what `make serve` starts): the
startup summary, `bench serve` with its default flags completing every request, a refusal before
the run when no prompt can fit, sanitized grammar errors over HTTP, and the Grafana dashboard's
series all present on /metrics."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve.config import ModelConfig
from kvserve.models import ASSETS_DIR
from tests import REPO_ROOT
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

GRAFANA = REPO_ROOT / "grafana" / "kvserve.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # `--model=NAME` stands where the helper puts a model directory: vLLM's spelling, a built-in name
    with running_server("--model=kvserve-demo", log_path=log) as (url, _):
        yield url, log


def _bench(url: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvserve", "bench", "serve", "--base-url", url, "--out", str(out)]
    return subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=900)


def test_startup_summary_names_model_cache_capacity_and_url(server):
    url, log = server
    text = log.read_text()
    model = ModelConfig.from_dir(ASSETS_DIR / "target")
    match = re.search(r"KV cache +([\d,]+) blocks x 16 tokens = ([\d,]+) tokens", text)
    assert match, text
    num_blocks, num_tokens = (int(g.replace(",", "")) for g in match.groups())
    assert num_tokens == num_blocks * 16
    # sized from this machine's memory (the default): at most 64 full-length sequences' worth
    # (--max-num-seqs 64 x 512 tokens), at least one, and the banner says how it was chosen
    blocks_per_seq = math.ceil(model.max_position_embeddings / 16)
    assert blocks_per_seq <= num_blocks <= 64 * blocks_per_seq
    assert re.search(r"KV sizing  auto: 50% of [\d.]+ GiB \((MemAvailable|cgroup)", text), text
    full = num_blocks // blocks_per_seq
    assert f"capacity   {full:,d} sequences at the full 512-token length" in text
    assert "serving 'kvserve-demo'" in text and "compute    float32 on cpu" in text
    assert "  weights    fp32, activations fp32" in text
    assert f"URL        {url}" in text


def test_bench_serve_with_default_flags_completes_every_request(server, tmp_path):
    url, _ = server
    # The defaults ask for 512-token prompts + 128 output tokens: more than the demo's 512-token
    # context once the chat template is added. They are clipped to fit, and every request completes.
    result = _bench(url, tmp_path / "run", "--num-requests", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["counts"]["measured"] == summary["counts"]["ok"] == 4
    assert summary["failures_by_reason"] == []
    workload = summary["metadata"]["workload"]
    assert workload["num_clipped_to_context"] == 4 and workload["server_max_model_len"] == 512
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").open()]
    for r in records:  # the clipped prompt + template + max_tokens fills the context exactly
        assert r["num_prompt_tokens_server"] + r["max_tokens"] == 512
    assert "prompts clipped to fit the server's context of 512 tokens" in result.stdout


def test_bench_serve_refuses_before_sending_when_no_prompt_can_fit(server, tmp_path):
    url, _ = server
    before = httpx.get(f"{url}/metrics").text.count("kvserve_prompt_tokens_total")
    result = _bench(url, tmp_path / "run", "--num-requests", "2", "--output-len", "600")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no room for a prompt in the server's context of 512 tokens" in result.stderr
    assert "lower --output-len" in result.stderr
    assert not (tmp_path / "run" / "requests.jsonl").exists()
    assert httpx.get(f"{url}/metrics").text.count("kvserve_prompt_tokens_total") == before


def test_bad_regex_is_a_400_without_compiler_internals(server):
    url, _ = server
    body = {"model": "kvserve-demo", "prompt": "x", "max_tokens": 4,
            "structured_outputs": {"regex": "[0-9"}}  # fmt: skip
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message.startswith("invalid regex constraint: Regex parsing error at position")
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+|/project/", message), message


def _exposed_series(metrics_text: str) -> set[str]:
    """Every series name /metrics declares, with a histogram's _bucket, _sum and _count."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_grafana_dashboard_queries_only_series_that_exist(server):
    url, _ = server
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    queried = {name for e in exprs for name in re.findall(r"\bkvserve_[a-z_]+\b", e)}
    exposed = _exposed_series(httpx.get(f"{url}/metrics").text)
    assert len(queried) >= 15
    assert queried <= exposed, f"not on /metrics: {sorted(queried - exposed)}"
    # the panels cover what an operator needs
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "first token",
        "inter-token",
        "waiting",
        "kv-cache",
        "prefix-cache",
        "speculative",
    ):
        assert topic in titles
