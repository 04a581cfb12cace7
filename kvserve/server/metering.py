"""API keys and per-key metering.

`--api-key ID:SECRET` (repeatable) names each key; a bare `--api-key SECRET` gets the id `key<N>` (its
position). Only ids ever reach metrics, logs and /v1/usage, never a secret. Every request that passed the
key check is metered under its key id, whatever its outcome: prompt tokens as submitted, cached and generated
tokens as far as the request got (so failed, aborted and timed-out attempts are counted too). Without keys,
everything is metered under `anonymous`. Outcomes: docs/server.md, "Metering".
"""

from __future__ import annotations

import hmac
import re
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

ANONYMOUS = "anonymous"
OUTCOMES = ("ok", "rejected", "rate_limited", "aborted", "timeout", "failed", "shutdown")
_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    secret: str = ""

    def __repr__(self) -> str:  # never print the secret
        return f"ApiKey({self.key_id!r})"


def parse_api_keys(values: list[str] | tuple[str, ...]) -> tuple[ApiKey, ...]:
    keys = []
    for position, value in enumerate(values, start=1):
        key_id, sep, secret = value.partition(":")
        if not sep:
            key_id, secret = f"key{position}", value
        if not _KEY_ID.match(key_id):
            raise ValueError(f"API key id {key_id!r} must match [A-Za-z0-9_.-]{{1,64}}")
        if not secret:
            raise ValueError(f"API key {key_id!r} has an empty secret")
        keys.append(ApiKey(key_id, secret))
    ids = [k.key_id for k in keys]
    if len(set(ids)) != len(ids):
        raise ValueError(f"API key ids must be unique, got {ids}")
    return tuple(keys)


class KeyRing:
    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self.keys = keys

    def authenticate(self, authorization: str) -> str | None:
        """The key id for an `Authorization` header, `anonymous` when no keys are set, else None."""
        if not self.keys:
            return ANONYMOUS
        token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
        found = None
        for key in self.keys:  # compare with every key: the time does not depend on which matched
            if hmac.compare_digest(token.encode(), key.secret.encode()):
                found = key.key_id
        return found


def outcome_of(status_code: int, code: str | None = None) -> str:
    if status_code < 400:
        return "ok"
    if status_code == 429:
        return "rate_limited"
    if status_code == 499:
        return "aborted"
    if status_code == 504:
        return "timeout"
    if code == "server_shutdown":
        return "shutdown"
    return "failed" if status_code >= 500 else "rejected"


class Metering:
    """Prometheus counters by key id (and outcome), plus running totals for GET /v1/usage."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "kvserve_key_requests",
            "Requests per API key id, by outcome",
            ["key_id", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvserve_key_prompt_tokens",
            "Prompt tokens submitted, per API key id",
            ["key_id"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvserve_key_cached_tokens",
            "Prompt tokens served from the prefix cache, per key id",
            ["key_id"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvserve_key_generation_tokens",
            "Tokens generated, per API key id",
            ["key_id"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._totals: dict[str, dict] = {}

    def record(
        self,
        key_id: str | None,
        outcome: str,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        generated_tokens: int = 0,
    ) -> None:
        key_id = key_id or ANONYMOUS
        self.requests.labels(key_id, outcome).inc()
        self.prompt_tokens.labels(key_id).inc(prompt_tokens)
        self.cached_tokens.labels(key_id).inc(cached_tokens)
        self.generation_tokens.labels(key_id).inc(generated_tokens)
        with self._lock:
            totals = self._totals.setdefault(key_id, _empty_totals())
            totals["requests"][outcome] = totals["requests"].get(outcome, 0) + 1
            totals["prompt_tokens"] += prompt_tokens
            totals["cached_tokens"] += cached_tokens
            totals["completion_tokens"] += generated_tokens

    def usage(self, key_id: str | None) -> dict:
        key_id = key_id or ANONYMOUS
        with self._lock:
            totals = self._totals.get(key_id, _empty_totals())
            return {
                "object": "usage",
                "key_id": key_id,
                "requests": dict(totals["requests"]),
                "prompt_tokens": totals["prompt_tokens"],
                "cached_tokens": totals["cached_tokens"],
                "completion_tokens": totals["completion_tokens"],
                "total_tokens": totals["prompt_tokens"] + totals["completion_tokens"],
            }


def _empty_totals() -> dict:
    return {"requests": {}, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
