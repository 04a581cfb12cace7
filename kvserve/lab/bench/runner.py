"""One `kvserve bench serve` run: connect, prepare the workload, drive the load, write the run dir.

A run directory holds `requests.jsonl` (raw records), `summary.json` (metrics + metadata),
`report.html`, and optionally `outputs.jsonl` and the server's `/metrics` before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve._version import __version__
from kvserve.lab.bench import report
from kvserve.lab.bench.arrivals import ArrivalSpec, load_trace, schedule
from kvserve.lab.bench.client import (
    ClientConfig,
    first_model_id,
    probe_server,
    reset_prefix_cache,
    scrape_metrics,
    send_request,
    warm_up,
)
from kvserve.lab.bench.identity import client_host, identity_fields
from kvserve.lab.bench.loadgen import LoadPlan, LoadResult, run_load
from kvserve.lab.bench.prometheus import server_counters
from kvserve.lab.bench.records import BenchError, RequestRecord, RequestSpec, write_jsonl
from kvserve.lab.bench.slo import ObjectiveSet
from kvserve.lab.bench.summary import json_safe, summarize
from kvserve.lab.bench.tokenization import PromptFitter, TokenCounter, make_counter
from kvserve.lab.bench.workloads import WorkloadSpec, build_workload

SCHEMA = "kvserve.lab.bench.serve/1"
WARM_CONNECTIONS = 8  # keep-alive connections opened before the run clock starts


@dataclass(frozen=True)
class ServeConfig:
    """Everything one `bench serve` invocation needs; validated here, not in the CLI."""

    client: ClientConfig
    workload: WorkloadSpec
    arrivals: ArrivalSpec
    out_dir: str
    num_requests: int | None = None
    duration_s: float | None = None
    num_warmup: int = 4
    seed: int = 0
    tokenizer: str = "auto"
    objective_sets: tuple[ObjectiveSet, ...] = ()
    min_attainment: float = 0.9
    prefill_tok_s: float | None = None
    labels: tuple[tuple[str, str], ...] = ()
    progress: bool = False
    plots: bool = True
    save_outputs: bool = False
    retokenize: bool = True
    sweep_rates: tuple[float, ...] = ()
    find_capacity: bool = False
    capacity_start_rps: float = 1.0
    capacity_max_rps: float = 256.0
    capacity_rel_tol: float = 0.1
    capacity_max_trials: int = 12
    reset_prefix_cache: bool = False  # POST /reset_prefix_cache before every run (each rate)
    command: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise BenchError("give --num-requests N or --duration SECONDS")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchError("--num-requests must be >= 1")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:  # NaN fails it too
            raise BenchError(f"--duration must be a finite number > 0, got {self.duration_s}")
        if self.num_warmup < 0:
            raise BenchError("--warmup must be >= 0")
        if self.prefill_tok_s is not None and not 0 < self.prefill_tok_s < math.inf:
            # 0 and negatives refused (0 is not "not given")
            raise BenchError(f"--prefill-speed must be > 0 tokens/s, got {self.prefill_tok_s:g}")
        if not self.arrivals.is_open_loop and self.num_requests is None:
            raise BenchError("a closed loop with --duration needs --num-requests as an upper bound")
        if (self.sweep_rates or self.find_capacity) and self.arrivals.kind not in ("gamma", "inf"):
            raise BenchError(
                "--sweep and --find-capacity vary --request-rate: not with a trace or a closed loop"
            )
        if self.sweep_rates and self.find_capacity:
            raise BenchError("choose one of --sweep and --find-capacity")
        if self.find_capacity and not self.objective_sets:
            raise BenchError("--find-capacity needs an objective: --slo ttft=3s,worst_gap=100ms")
        if not 0 < self.min_attainment <= 1:
            raise BenchError("--min-attainment must be in (0, 1]")


@dataclass(frozen=True)
class Target:
    client: ClientConfig
    probes: dict
    counter: TokenCounter
    max_model_len: int | None = None  # the server's context, from /v1/models (None: not reported)
    prompt_overhead_tokens: int = 0  # tokens the chat template (or BOS) adds to a prompt


class Workload:
    """Requests 0..n-1 built on demand; request i depends only on (seed, i). With the server's
    context known, prompt lengths are clipped to fit it (see WorkloadSpec.fit_to_context)."""

    def __init__(
        self, cfg: ServeConfig, counter: TokenCounter, target: Target | None = None
    ) -> None:
        if target is not None and target.max_model_len is not None:
            workload = dataclasses.replace(
                cfg.workload,
                max_model_len=target.max_model_len,
                prompt_overhead_tokens=target.prompt_overhead_tokens,
            )
            cfg = dataclasses.replace(cfg, workload=workload)
        self._cfg, self._fitter = cfg, PromptFitter(counter)
        trace = load_trace(cfg.arrivals.trace_path) if cfg.arrivals.kind == "trace" else None
        self._lengths = trace.lengths if trace else None
        self._requests: list[RequestSpec] = []

    def get(self, num: int) -> tuple[RequestSpec, ...]:
        if num > len(self._requests):
            t0 = time.perf_counter()
            spec = self._cfg.workload
            if spec.kind == "sharegpt":
                self._requests = build_workload(spec, num, self._fitter)
            else:
                start = len(self._requests)
                self._requests += build_workload(spec, num, self._fitter, self._lengths, start)
            log(
                f"prepared {num} prompts with {self._fitter.counter.name} in "
                f"{time.perf_counter() - t0:.1f} s"
            )
            num_clipped = sum(r.clipped for r in self._requests[:num])
            if num_clipped:
                spec = self._cfg.workload
                log(
                    f"WARNING: {num_clipped} of {num} prompts clipped to fit the server's context "
                    f"of {spec.max_model_len} tokens (max_tokens + {spec.prompt_overhead_tokens} "
                    "template tokens + prompt); lower --input-len to measure what you asked for"
                )
        return tuple(self._requests[:num])

    @property
    def spec(self) -> WorkloadSpec:
        """The workload as sent (with the server's context when it is known)."""
        return self._cfg.workload


def log(msg: str) -> None:
    sys.stderr.write(f"[bench] {msg}\n")


def wait_while_loading(base_url: str, headers: dict[str, str], limit_s: float = 300.0) -> None:
    """A server that answers /ready with 503 is still loading its model: wait for it (a run that
    started then would count every request as rejected)."""
    deadline = time.monotonic() + limit_s
    announced = False
    with httpx.Client(base_url=base_url, headers=headers, timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            try:
                if http.get("/ready").status_code != 503:
                    return
            except httpx.HTTPError:
                return  # no /ready, or nothing listening: probe_server reports it
            if not announced:
                log(f"{base_url}/ready says the model is still loading: waiting")
                announced = True
            time.sleep(0.5)
    raise BenchError(f"{base_url} still not ready after {limit_s:g} s (GET /ready answers 503)")


def connect(cfg: ServeConfig) -> Target:
    base = cfg.client.base_url
    wait_while_loading(base, cfg.client.headers)
    probes = probe_server(base, cfg.client.headers)
    if not probes:
        raise BenchError(f"no answer from {base} (tried /v1/models, /ready, /version, /health)")
    client = cfg.client
    if not client.model:
        model = first_model_id(probes)
        if not model:
            raise BenchError(f"{base}/v1/models lists no model; pass --model")
        client = dataclasses.replace(client, model=model)
    counter = make_counter(cfg.tokenizer, base, client.model, client.headers)
    if not counter.exact:
        log("WARNING: no /tokenize endpoint and no --tokenizer DIR: prompt lengths are approximate")
    max_model_len = server_max_model_len(probes, client.model)
    overhead = 0
    if max_model_len is not None:
        overhead = prompt_overhead_tokens(client, counter)
        log(
            f"server context: {max_model_len} tokens (/v1/models); the prompt wrapping adds "
            f"{overhead} tokens"
        )
    return Target(client, probes, counter, max_model_len, overhead)


def server_max_model_len(probes: dict, model: str) -> int | None:
    """`max_model_len` of `model` in /v1/models (vLLM and kvserve report it), else None."""
    models = probes.get("/v1/models")
    entries = models.get("data") if isinstance(models, dict) else None
    for entry in entries or ():
        if isinstance(entry, dict) and entry.get("id") == model:
            value = entry.get("max_model_len")
            return int(value) if isinstance(value, int | float) and value > 0 else None
    return None


def prompt_overhead_tokens(client: ClientConfig, counter: TokenCounter) -> int:
    """Tokens the server adds around a prompt's content: the chat template (asked of /tokenize with
    messages, as kvserve and vLLM take it) or special tokens on completions. When the server cannot
    say, a margin: 32 tokens for chat, 1 (a BOS) for completions."""
    probe = "hello world"
    if client.endpoint == "chat":
        body = {
            "model": client.model,
            "messages": [{"role": "user", "content": probe}],
            "add_generation_prompt": True,
        }
        fallback = 32
    else:
        body = {"model": client.model, "prompt": probe, "add_special_tokens": True}
        fallback = 1
    try:
        with httpx.Client(
            base_url=client.base_url, headers=client.headers, timeout=30.0, trust_env=False
        ) as http:
            resp = http.post("/tokenize", json=body)
        if resp.status_code == 200 and counter.exact:
            data = resp.json()
            count = data.get("count", len(data.get("tokens", ())))
            return max(0, int(count) - counter.count(probe))
    except (httpx.HTTPError, ValueError, TypeError, BenchError):
        pass
    log(f"WARNING: the server cannot tokenize a chat: assuming {fallback} wrapping tokens")
    return fallback


async def _drive(client: ClientConfig, plan: LoadPlan, progress: bool) -> LoadResult:
    # No pool limit (a pool cap would queue requests inside the client, unseen), TCP_NODELAY so that
    # small writes are never held back, and no proxies from the environment.
    transport = httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
    )
    timeout = httpx.Timeout(None, connect=30.0)  # the per-request budget: asyncio.timeout in client
    async with httpx.AsyncClient(
        base_url=client.base_url,
        headers=client.headers,
        transport=transport,
        timeout=timeout,
        trust_env=False,
    ) as http:

        async def send(spec, rid, phase, t_sched, origin, sink):
            return await send_request(http, client, spec, rid, phase, t_sched, origin, sink)

        # Before the clock starts: open the pool and pay lazy imports, then no garbage collection of
        # the set-up's objects during the run (a collection at the first sends showed as a
        # 100+ ms event-loop lag spike).
        limit = plan.max_concurrency or WARM_CONNECTIONS
        warm = await warm_up(http, max(1, min(WARM_CONNECTIONS, limit, len(plan.requests))))
        if warm["errors"]:
            log(f"WARNING: client warm-up failed: {warm['errors'][0]}")
        gc.collect()
        gc.freeze()
        try:
            return await run_load(plan, send, progress)
        finally:
            gc.unfreeze()


def _retokenize(records: tuple[RequestRecord, ...], texts: tuple[str, ...], counter: TokenCounter):
    out = []
    for rec, text in zip(records, texts, strict=True):
        if text and rec.outcome == "ok":
            rec = dataclasses.replace(rec, num_completion_tokens_retokenized=counter.count(text))
        out.append(rec)
    return tuple(out)


def _metadata(
    cfg: ServeConfig,
    target: Target,
    arrivals: ArrivalSpec,
    result: LoadResult,
    num_requests: int,
    scrapes: tuple[str | None, str | None],
    cache_reset: dict,
) -> dict:
    labels = dict(cfg.labels)
    fingerprints = sorted({r.system_fingerprint for r in result.records if r.system_fingerprint})
    mode = {
        "natural": "natural stop (the model's own EOS; max_tokens caps)",
        "forced": "forced length (ignore_eos, min_tokens = max_tokens)",
    }
    return {
        "schema": SCHEMA,
        "tool": f"kvserve {__version__} bench serve",
        "command": list(cfg.command),
        "started_at_epoch_s": result.origin_epoch_s,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(result.origin_epoch_s)),
        "interrupted": result.interrupted,
        "target": {
            "base_url": target.client.base_url,
            "endpoint": target.client.endpoint,
            "model": target.client.model,
        },
        "mode": target.client.mode,
        "mode_description": mode[target.client.mode],
        "sampling": {
            "temperature": target.client.temperature,
            "extra_body": json.loads(target.client.extra_body),
        },
        "workload": cfg.workload.describe()
        | {
            "num_prepared": num_requests - cfg.num_warmup,  # measured ones: see counts
            "tokenizer": target.counter.name,
            "token_exact": target.counter.exact,
            "tokenizer_identity": target.counter.identity(),
        },
        "arrivals": arrivals.describe() | {"seed": cfg.seed},
        "concurrency_limit": arrivals.max_concurrency,
        "measurement": {
            "num_warmup": cfg.num_warmup,
            "num_requests": cfg.num_requests,
            "duration_s": cfg.duration_s,
            "timeout_s": target.client.timeout_s,
            "window": "first measured send -> end of the last measured request; steady ends at the "
            "last measured send, drain is the rest; warm-up requests excluded",
            "clock": "time.perf_counter, seconds since the run's origin",
        },
        "identity": identity_fields(target.probes, labels, fingerprints),
        "labels": labels,
        "prefix_cache_reset": cache_reset,
        "server_counters": server_counters(*scrapes),
        "server_probes": target.probes,
        "client_host": client_host(),
    }


def execute_run(
    cfg: ServeConfig, target: Target, workload: Workload, arrivals: ArrivalSpec, run_dir: Path
) -> dict:
    """One run at one arrival process; writes run_dir and returns its summary."""
    offsets = schedule(arrivals, cfg.seed, cfg.num_warmup, cfg.num_requests, cfg.duration_s)
    num = len(offsets) if offsets is not None else cfg.num_warmup + cfg.num_requests
    requests = workload.get(num)
    plan = LoadPlan(
        requests,
        cfg.num_warmup,
        offsets,
        arrivals.max_concurrency,
        cfg.duration_s if offsets is None else None,
    )
    cache_reset = {"requested": cfg.reset_prefix_cache, "status": "not requested"}
    if cfg.reset_prefix_cache:
        cache_reset |= reset_prefix_cache(target.client.base_url, target.client.headers)
        if cache_reset["status"] != "ok":
            log(
                f"WARNING: prefix cache not reset ({cache_reset['status']}): {cache_reset['detail']}"
            )
    before = scrape_metrics(target.client.base_url, target.client.headers)
    log(f"{arrivals.describe()['process']}: {num} requests ({cfg.num_warmup} warm-up) -> {run_dir}")
    result = asyncio.run(_drive(target.client, plan, cfg.progress))
    after = scrape_metrics(target.client.base_url, target.client.headers)
    records = result.records
    if cfg.retokenize and target.counter.exact:
        records = _retokenize(records, result.texts, target.counter)
    summary = summarize(
        records,
        objective_sets=cfg.objective_sets,
        nominal_rate=arrivals.nominal_rate,
        loop_lag_s=result.loop_lag_s,
        cpu_s=result.cpu_s,
        wall_s=result.wall_s,
        prefill_tok_s=cfg.prefill_tok_s,
    )
    sent_cfg = dataclasses.replace(cfg, workload=workload.spec)
    metadata = _metadata(sent_cfg, target, arrivals, result, num, (before, after), cache_reset)
    metadata["workload"]["num_clipped_to_context"] = sum(
        r.clipped for r in requests[cfg.num_warmup :]
    )
    summary = {"metadata": metadata} | summary
    summary = json_safe(summary)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(run_dir / "requests.jsonl", records)
    # atomically: a summary.json is never cut short (bench compare reads it)
    partial = run_dir / "summary.json.partial"
    partial.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    partial.replace(run_dir / "summary.json")
    if cfg.save_outputs:
        with open(run_dir / "outputs.jsonl", "w", encoding="utf-8") as f:
            for rec, text in zip(records, result.texts, strict=True):
                f.write(
                    json.dumps({"request_id": rec.request_id, "index": rec.index, "text": text})
                    + "\n"
                )
    for name, text in (
        ("server_metrics_before.prom", before),
        ("server_metrics_after.prom", after),
    ):
        if text is not None:
            (run_dir / name).write_text(text, encoding="utf-8")
    report.write_run_html(run_dir / "report.html", summary, records, plots=cfg.plots)
    print(report.console_table(summary), flush=True)
    return summary
