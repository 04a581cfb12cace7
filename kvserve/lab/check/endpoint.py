"""The batch-invariance check against a running OpenAI-compatible server (`--endpoint URL`).

Prompts go to `/v1/completions` as token ids (or text), greedy, `ignore_eos`, with `logprobs`;
tokens are keyed by their text (what the API returns). Shapes the client controls: run-to-run
repeat, concurrent batches of several sizes (the server batches requests that arrive together),
long neighbours sent alongside, and a prefix-cache hit (the same prompt again; the server reports
`prompt_tokens_details.cached_tokens`). Chunked prefill and speculative decoding are the server's
configuration: they are exercised when it was started with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import httpx

from kvserve.lab.check.invariance import Position, ShapeResult, Trace, compare_shape
from kvserve.lab.check.shapes import CheckConfig, Prompt, groups


class EndpointError(RuntimeError):
    """The server refused or failed a check request."""


class EndpointCheck:
    def __init__(
        self,
        base_url: str,
        model: str | None,
        prompts: Sequence[Prompt],
        cfg: CheckConfig,
        timeout_s: float = 300.0,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False)
        self.model = model or self._first_model()
        self.prompts, self.cfg = list(prompts), cfg
        self.progress: Callable[[str], None] = lambda msg: None

    def _first_model(self) -> str:
        try:
            data = self.http.get("/v1/models").json()["data"]
            return data[0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as exc:
            raise EndpointError(f"{self.base_url}/v1/models lists no model: {exc}") from exc

    def _one(self, prompt: Prompt) -> Trace:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.cfg.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": self.cfg.num_logprobs,
        }
        try:
            resp = self.http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EndpointError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        try:  # an answer of the wrong shape is a reported failure
            doc = resp.json()
            lp = doc["choices"][0]["logprobs"]
            positions = tuple(
                Position(tok, float(chosen), {k: float(v) for k, v in top.items()})
                for tok, chosen, top in zip(
                    lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
                )
            )
            usage = doc.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            return Trace(positions, int(cached))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EndpointError(
                f"the completion is not an OpenAI completion with logprobs "
                f"({type(exc).__name__}: {exc}): {resp.text[:200]}"
            ) from None

    def _together(self, prompts: list[Prompt]) -> list[Trace]:
        """Send all at once (one thread each) so that the server batches them."""
        out: list[Trace | BaseException | None] = [None] * len(prompts)
        start = threading.Barrier(len(prompts))

        def work(i: int) -> None:
            try:
                start.wait()
                out[i] = self._one(prompts[i])
            except BaseException as exc:  # handed back below
                out[i] = exc

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for item in out:
            if isinstance(item, BaseException):
                raise item
        return out  # type: ignore[return-value]

    def _reset_cache(self) -> None:
        try:
            self.http.post("/reset_prefix_cache")
        except httpx.HTTPError:
            pass

    def run(self) -> tuple[list[Trace], list[ShapeResult]]:
        cfg, prompts = self.cfg, self.prompts
        n = len(prompts)
        results = []

        def add(name, description, variants, facts=None):
            self.progress(name)
            results.append(compare_shape(name, description, refs, variants, facts))

        self._reset_cache()
        self.progress("alone")
        refs = []
        for p in prompts:
            refs.append(self._one(p))
            self._reset_cache()  # the reference never hits the cache
        variants = {}
        for i, p in enumerate(prompts):
            self._reset_cache()
            variants[i] = self._one(p)
        add("repeat", "each prompt alone, again", variants)
        for size in cfg.batch_sizes:
            variants = {}
            for members in groups(n, size):
                self._reset_cache()
                for i, trace in zip(
                    members, self._together([prompts[i] for i in members]), strict=True
                ):
                    variants.setdefault(i, trace)
            add(f"batch-{size}", f"{size} concurrent requests", variants, {"batch_size": size})
        longs = [[int(t) for t in row] for row in _long_token_prompts(cfg)]
        self._reset_cache()
        traces = self._together(prompts + longs)
        add(
            "long-neighbours",
            f"all prompts concurrently beside {len(longs)} prompts of {len(longs[0])} tokens",
            dict(enumerate(traces[:n])),
        )
        variants = {}
        for i, p in enumerate(prompts):
            self._reset_cache()
            self._one(p)
            variants[i] = self._one(p)
        add(
            "prefix-cache-hit",
            "each prompt sent twice; the second is compared",
            variants,
            {"num_prompts_hit": sum(t.num_cached_tokens > 0 for t in variants.values())},
        )
        return refs, results


def _long_token_prompts(cfg: CheckConfig) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(cfg.seed + 1)
    # ids below 256 exist in every vocabulary the project ships (byte-level BPE, the tiny tests')
    return [
        list(rng.integers(3, 256, size=cfg.long_neighbour_tokens))
        for _ in range(cfg.num_long_neighbours)
    ]
