"""One streamed OpenAI-compatible request -> RequestRecord, and probes of the server's identity.

Every SSE `data:` event is timestamped with `time.perf_counter()` as soon as its line arrives,
before it is parsed. Tokens per event come from the server when it says so: a running
`usage.completion_tokens` (vLLM's `continuous_usage_stats`) or per-token logprob entries. Queue time
is read only when the server reports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from dataclasses import dataclass, field

import httpx

from kvserve.lab.bench.records import BenchError, RequestRecord, RequestSpec, StreamEvent

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MODES = ("natural", "forced")
REJECT_STATUSES = (429, 503)
PROBE_PATHS = ("/v1/models", "/ready", "/manifest", "/version", "/props", "/health")


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the target. `extra_body` (JSON text) is merged into every request body."""

    base_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    mode: str = "natural"
    temperature: float = 0.0
    timeout_s: float = 600.0
    per_chunk_usage: bool = True
    extra_body: str = "{}"

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint must be one of {tuple(ENDPOINTS)}, got {self.endpoint!r}")
        if self.mode not in MODES:
            raise BenchError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if not 0 < self.timeout_s < math.inf:  # NaN fails it too
            raise BenchError(f"--timeout must be > 0, got {self.timeout_s}")
        try:
            if not isinstance(json.loads(self.extra_body), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise BenchError(f"--extra-body must be a JSON object: {exc}") from exc

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]


def normalise_base_url(url: str) -> str:
    """`http://host:port`, accepting a trailing `/` or `/v1` (the OpenAI client's convention)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def build_payload(cfg: ClientConfig, spec: RequestSpec) -> dict:
    stream_options: dict = {"include_usage": True}
    if cfg.per_chunk_usage:
        stream_options["continuous_usage_stats"] = True
    body: dict = {
        "model": cfg.model,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": stream_options,
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if cfg.mode == "forced":  # docs/load-tests.md: ignore_eos + min_tokens = max_tokens
        body |= {"ignore_eos": True, "min_tokens": spec.max_tokens}
    return body | json.loads(cfg.extra_body)


def _queue_time_s(obj: dict) -> float | None:
    """Server-reported queue time (admission - arrival), in seconds, from `metrics` or `usage`."""
    for holder in (obj.get("metrics"), obj.get("usage")):
        if isinstance(holder, dict):
            for key in ("queue_time_s", "time_in_queue", "queue_time"):
                if isinstance(holder.get(key), int | float):
                    return float(holder[key])
    return None


@dataclass
class _Stream:
    """Mutable accumulation for one in-flight request (private to this module)."""

    endpoint: str
    events: list[StreamEvent] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    fingerprint: str | None = None
    queue_time_s: float | None = None
    server_metrics: dict | None = None  # kvserve's per-request `metrics` (on the finish chunk)
    error: str | None = None
    done: bool = False

    def feed(self, t_s: float, payload: str) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        obj = json.loads(payload)
        # a malformed event (a JSON list, a string `delta`, a string token count) fails its own
        # request (ValueError), not the whole run
        _expect(isinstance(obj, dict), "the event is not a JSON object")
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
            return
        text, num_logprobs = "", None
        choices = obj.get("choices") or ()
        _expect(isinstance(choices, list | tuple), "`choices` is not a list")
        for choice in choices:
            _expect(isinstance(choice, dict), "a choice is not an object")
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                _expect(isinstance(delta, dict), "`delta` is not an object")
                for key in ("content", "reasoning_content", "reasoning"):
                    text += _text(delta.get(key))
                logprobs = choice.get("logprobs") or {}
                _expect(isinstance(logprobs, dict), "`logprobs` is not an object")
                logprobs = logprobs.get("content")
            else:
                text += _text(choice.get("text"))
                logprobs = choice.get("logprobs") or {}
                _expect(isinstance(logprobs, dict), "`logprobs` is not an object")
                logprobs = logprobs.get("tokens")
            if isinstance(logprobs, list):
                num_logprobs = (num_logprobs or 0) + len(logprobs)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        cum = None
        usage = obj.get("usage")
        if isinstance(usage, dict):
            cum = _count(usage.get("completion_tokens"), "completion_tokens")
            self.completion_tokens = cum if cum is not None else self.completion_tokens
            prompt = _count(usage.get("prompt_tokens"), "prompt_tokens")
            self.prompt_tokens = prompt if prompt is not None else self.prompt_tokens
        self.fingerprint = obj.get("system_fingerprint") or self.fingerprint
        queue_time_s = _queue_time_s(obj)
        self.queue_time_s = queue_time_s if queue_time_s is not None else self.queue_time_s
        if isinstance(obj.get("metrics"), dict):
            self.server_metrics = obj["metrics"]
        self.events.append(StreamEvent(t_s, len(text), cum, num_logprobs))
        if text:
            self.texts.append(text)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"malformed stream event: {what}")


def _text(value) -> str:
    _expect(value is None or isinstance(value, str), "a text field is not a string")
    return value or ""


def _count(value, name: str) -> int | None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    _expect(ok, f"usage.{name} is not a non-negative integer")
    return value


async def send_request(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    spec: RequestSpec,
    request_id: str,
    phase: str,
    t_scheduled_s: float,
    origin_s: float,
    sink: dict[str, tuple[RequestRecord, str]],
) -> tuple[RequestRecord, str]:
    """Stream one request; returns its record and the output text (kept out of the record), and also
    puts them in `sink[request_id]`, so that a request cancelled mid-stream still leaves what it
    received."""
    clock = time.perf_counter
    st = _Stream(cfg.endpoint)
    status: int | None = None
    outcome = "failed"
    extra: dict = {}
    t_send = clock() - origin_s
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with http.stream("POST", cfg.path, json=build_payload(cfg, spec)) as resp:
                status = resp.status_code
                if status != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    st.error = f"HTTP {status}: {body[:300]}"
                    if resp.headers.get("retry-after"):
                        extra["retry_after"] = resp.headers["retry-after"]
                    outcome = "rejected" if status in REJECT_STATUSES else "failed"
                else:
                    async for line in resp.aiter_lines():
                        t = clock() - origin_s
                        if line.startswith("data:"):
                            st.feed(t, line[5:].strip())
                        if st.done or st.error:
                            break
                    if st.error is None and not (st.done or st.finish_reason):
                        st.error = "stream ended without a finish_reason or [DONE]"
                    outcome = "ok" if st.error is None else "failed"
    except TimeoutError:
        outcome, st.error = "timeout", f"no complete answer within {cfg.timeout_s:g} s"
    except asyncio.CancelledError:
        outcome, st.error = "cancelled", "cancelled (interrupted)"
        raise
    except (httpx.HTTPError, OSError, ValueError) as exc:
        outcome, st.error = "failed", f"{type(exc).__name__}: {exc}"[:500]
    finally:
        text = "".join(st.texts)
        if st.server_metrics is not None:
            extra["server_metrics"] = st.server_metrics
        record = RequestRecord(
            request_id=request_id,
            index=spec.index,
            phase=phase,
            outcome=outcome,
            t_scheduled_s=t_scheduled_s,
            t_send_s=t_send,
            t_end_s=clock() - origin_s,
            max_tokens=spec.max_tokens,
            events=tuple(st.events),
            num_prompt_tokens_client=spec.num_prompt_tokens,
            num_prompt_tokens_server=st.prompt_tokens,
            num_completion_tokens_server=st.completion_tokens,
            finish_reason=st.finish_reason,
            http_status=status,
            error=st.error,
            output_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            num_output_chars=len(text),
            system_fingerprint=st.fingerprint,
            queue_time_s=st.queue_time_s,
            prompt_sha256=spec.prompt_sha256,
            extra=extra,
        )
        sink[request_id] = (record, text)
    return record, text


WARM_PATH = "/v1/models"


async def warm_up(http: httpx.AsyncClient, num_connections: int) -> dict:
    """Pay the client's first-request costs before the run clock starts: the lazy imports of the
    HTTP stack (anyio's backend, h11), the streaming read path, and `num_connections` open
    keep-alive connections in the pool (streams held open together, so each needs its own).
    Without it the first measured request pays ~100+ ms on the client side alone, which lands in
    TTFT p99 (docs/simulator.md, the load-tool cross-check). Returns what was done."""
    start = time.perf_counter()
    ready = asyncio.Event()
    opened = 0
    errors: list[str] = []

    async def hold_one() -> None:
        nonlocal opened
        try:
            async with http.stream("GET", WARM_PATH) as resp:
                opened += 1
                if opened == num_connections:
                    ready.set()
                await ready.wait()  # keep this connection busy until all are open
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            ready.set()

    async with asyncio.timeout(30.0):
        await asyncio.gather(*(hold_one() for _ in range(num_connections)))
    json.loads(json.dumps({"warm": [1.0, "x"]}))
    return {
        "num_connections": opened,
        "warm_up_s": time.perf_counter() - start,
        "errors": errors,
    }


def probe_server(base_url: str, headers: dict[str, str], timeout_s: float = 10.0) -> dict:
    """GET the identity endpoints that exist; {path: parsed JSON (or text)}. Missing ones are left
    out."""
    out: dict = {}
    with httpx.Client(
        base_url=base_url, headers=headers, timeout=timeout_s, trust_env=False
    ) as http:
        for path in PROBE_PATHS:
            try:
                resp = http.get(path)
            except httpx.HTTPError:
                continue
            if resp.status_code != 200:
                continue
            try:
                out[path] = resp.json()
            except ValueError:
                out[path] = resp.text[:2000]
    return out


def reset_prefix_cache(
    base_url: str, headers: dict[str, str], wait_s: float = 10.0, retry_s: float = 0.25
) -> dict:
    """POST /reset_prefix_cache (kvserve; vLLM in dev mode) so that a run does not start with the
    previous run's prompts cached. {"status": "ok" | "unsupported" | "busy" | "failed", "detail"}.
    A 409 (requests still running, e.g. ones the client gave up on) is retried for `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = httpx.post(
                base_url + "/reset_prefix_cache", headers=headers, timeout=30.0, trust_env=False
            )
        except httpx.HTTPError as exc:
            return {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"[:300]}
        if resp.status_code == 200:
            return {"status": "ok", "detail": None}
        if resp.status_code in (404, 405, 501):
            return {
                "status": "unsupported",
                "detail": f"HTTP {resp.status_code}: the server has no POST /reset_prefix_cache",
            }
        if resp.status_code != 409:
            return {"status": "failed", "detail": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        if time.monotonic() >= deadline:
            return {
                "status": "busy",
                "detail": f"HTTP 409 for {wait_s:g} s: requests still running",
            }
        time.sleep(retry_s)


def scrape_metrics(base_url: str, headers: dict[str, str]) -> str | None:
    """The server's Prometheus `/metrics` text, or None."""
    try:
        resp = httpx.get(base_url + "/metrics", headers=headers, timeout=10.0, trust_env=False)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def first_model_id(probes: dict) -> str | None:
    models = probes.get("/v1/models")
    if isinstance(models, dict) and models.get("data"):
        return models["data"][0].get("id")
    return None
