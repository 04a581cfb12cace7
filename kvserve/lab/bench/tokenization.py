"""Token counting for exact prompt lengths, and fitting synthetic text to an exact token count.

Three counters, best first: the target server's own `/tokenize` (vLLM shape `{"model", "prompt"} ->
{"tokens", "count"}`, or llama.cpp's `{"content"} -> {"tokens"}`), a local Hugging Face tokenizer
directory (transformers, imported lazily), or an approximate word/punctuation count that is flagged
as inexact. All count content tokens only (no BOS, no chat template): the server's
`usage.prompt_tokens` adds those.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import httpx

from kvserve.lab.bench.records import BenchError


class TokenCounter(Protocol):
    name: str
    exact: bool

    def count(self, text: str) -> int: ...

    def identity(self) -> dict: ...

    def close(self) -> None: ...


class ServerTokenizer:
    """Counts with the target server's `/tokenize` endpoint."""

    exact = True

    def __init__(self, base_url: str, model: str, headers: dict[str, str], shape: str) -> None:
        self._client = httpx.Client(
            base_url=base_url, headers=headers, timeout=60.0, trust_env=False
        )
        self._model = model
        self._shape = shape  # "vllm" or "llamacpp"
        self.name = f"server:/tokenize ({shape})"

    @classmethod
    def probe(cls, base_url: str, model: str, headers: dict[str, str]) -> ServerTokenizer | None:
        """The server's tokenizer if it has a working `/tokenize`, else None."""
        for shape in ("vllm", "llamacpp"):
            tok = cls(base_url, model, headers, shape)
            try:
                if tok.count("hello world") > 0:
                    return tok
            except (httpx.HTTPError, BenchError, ValueError, KeyError, TypeError):
                pass
            tok.close()
        return None

    def count(self, text: str) -> int:
        if self._shape == "vllm":
            body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        else:
            body = {"content": text, "add_special": False}
        resp = self._client.post("/tokenize", json=body)
        if resp.status_code != 200:
            raise BenchError(f"/tokenize answered {resp.status_code}: {resp.text[:200]}")
        data = resp.json()
        count = data.get("count")
        return int(count) if count is not None else len(data["tokens"])

    def identity(self) -> dict:
        return {"kind": "server", "endpoint": "/tokenize", "shape": self._shape}

    def close(self) -> None:
        self._client.close()


class LocalTokenizer:
    """Counts with a local Hugging Face tokenizer directory (tokenizer.json,
    tokenizer_config.json)."""

    exact = True

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        if not self._path.is_dir():
            raise BenchError(f"tokenizer directory {self._path} does not exist")
        from transformers import AutoTokenizer  # lazy: heavy, and only needed for this counter

        self._tok = AutoTokenizer.from_pretrained(str(self._path))
        self.name = f"local:{self._path}"

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def identity(self) -> dict:
        files = {}
        for p in sorted(self._path.iterdir()):
            if p.is_file() and ("token" in p.name or p.name.endswith((".jinja", ".model"))):
                files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
        return {"kind": "local", "path": str(self._path), "sha256": files}

    def close(self) -> None:
        pass


class ApproxTokenizer:
    """Words and punctuation marks: a stand-in when no real tokenizer is reachable. Lengths are NOT
    exact."""

    exact = False
    name = "approx"
    _RE = re.compile(r"\w+|[^\w\s]")

    def count(self, text: str) -> int:
        return len(self._RE.findall(text))

    def identity(self) -> dict:
        return {
            "kind": "approx",
            "note": "word/punctuation count; prompt lengths are not token-exact",
        }

    def close(self) -> None:
        pass


def make_counter(spec: str, base_url: str, model: str, headers: dict[str, str]) -> TokenCounter:
    """`auto` (server, else approx), `server`, `approx`, or a local tokenizer directory."""
    if spec in ("auto", "server"):
        tok = ServerTokenizer.probe(base_url, model, headers)
        if tok is not None:
            return tok
        if spec == "server":
            raise BenchError(f"{base_url} has no working /tokenize endpoint; pass --tokenizer DIR")
        return ApproxTokenizer()
    if spec == "approx":
        return ApproxTokenizer()
    return LocalTokenizer(spec)


_FILLERS = (" a", " the", " x", " 1", ".")


class PromptFitter:
    """Cuts a stream of text pieces so that `count(prefix + text)` equals a target exactly.

    A search over the number of pieces (interpolation, falling back to bisection) finds the longest
    cut that does not exceed the target; single-token fillers make up a remaining shortfall. It
    learns the pieces-per-token ratio as it goes, so later prompts need ~2-4 counts each.
    """

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self._pieces_per_token = 1.0
        self.num_count_calls = 0

    def _count(self, text: str) -> int:
        self.num_count_calls += 1
        return self.counter.count(text)

    def fit(self, stream: Iterator[str], num_tokens: int, prefix: str = "") -> tuple[str, int]:
        """(text, its token count) with text = prefix + pieces; the count equals num_tokens when
        reachable."""
        base = self._count(prefix) if prefix else 0
        if base > num_tokens:
            raise BenchError(f"prefix has {base} tokens, more than the target {num_tokens}")
        if base == num_tokens:
            return prefix, base
        want = num_tokens - base
        pieces = [next(stream) for _ in range(math.ceil(want * self._pieces_per_token * 1.25) + 4)]
        text = prefix + "".join(pieces)
        c_hi = self._count(text)
        while c_hi < num_tokens:  # too short: extend
            pieces.extend(next(stream) for _ in range(len(pieces) + 4))
            text = prefix + "".join(pieces)
            c_hi = self._count(text)
        if c_hi == num_tokens:
            return self._learned(text, c_hi, len(pieces), want)
        lo, c_lo, hi = 0, base, len(pieces)
        while hi - lo > 1:
            mid = lo + round((num_tokens - c_lo) * self._pieces_per_token)
            if not lo < mid < hi:
                mid = (lo + hi) // 2
            c_mid = self._count(prefix + "".join(pieces[:mid]))
            if c_mid == num_tokens:
                return self._learned(prefix + "".join(pieces[:mid]), c_mid, mid, want)
            if c_mid < num_tokens:
                lo, c_lo = mid, c_mid
            else:
                hi = mid
        text = prefix + "".join(pieces[:lo])
        self._learn(lo, c_lo - base)
        for filler in _FILLERS:
            padded = text + filler * (num_tokens - c_lo)
            c_pad = self._count(padded)
            if c_pad == num_tokens:
                return padded, c_pad
        return text, c_lo

    def _learned(self, text: str, count: int, num_pieces: int, want: int) -> tuple[str, int]:
        self._learn(num_pieces, want)
        return text, count

    def _learn(self, num_pieces: int, num_tokens: int) -> None:
        if num_tokens >= 8:  # short cuts say little about the ratio
            self._pieces_per_token = 0.5 * self._pieces_per_token + 0.5 * num_pieces / num_tokens
