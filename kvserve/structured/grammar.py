"""Grammar-constrained decoding with xgrammar (docs/structured-output.md).

Why xgrammar: it compiles JSON schemas, regexes and EBNF against the served tokenizer into a token-level
automaton with a precomputed mask cache, so filling one request's next-token bitmask takes microseconds;
its matchers roll back, which speculative decoding needs; and vLLM and SGLang use it, so its JSON-schema
coverage is the one OpenAI-style clients are used to.

`GrammarCache` compiles each distinct constraint once. Each constrained request gets its own matcher; every
step the runner fills that request's bitmask row and applies it to that request's logits only.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import StructuredOutput
from kvserve.structured.compile_worker import (
    CompileWorkerError,
    GrammarCompileTimeoutError,
    IsolatedCompiler,
)

DEFAULT_COMPILE_TIMEOUT_S = 60.0
# Compiled grammars kept for reuse: each holds token tables of the vocabulary's size, and a server that
# sees endless distinct schemas must not keep them all (issue 46: engine RSS that did not come back).
MAX_CACHED_GRAMMARS = 128

# xgrammar's C++ errors start "[HH:MM:SS] /path/to/file.cc:LINE: " and may hold an internal check:
# neither means anything to a client, and a source path is not ours to publish.
_LOG_PREFIX = re.compile(r"^\s*(\[[0-9:.]+\]\s*)?(\S+\.(cc|cpp|h|hpp|py):\d+:\s*)?")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def sanitize_compiler_error(exc: BaseException) -> str:
    """The grammar compiler's message for a client: its last non-empty line, without the log
    timestamp, the C++ source location or an internal "Check failed" clause."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    message = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", lines[-1], count=1)).strip()
    return message or type(exc).__name__


class GrammarCache:
    """Compiled grammars keyed by the constraint; compilation errors become 400-class errors."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: frozenset[int],
        on_compile: Callable[[float], None] | None = None,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.info = info
        # Compiles run in worker processes that are killed past the limit (kvserve.structured.compile_worker).
        self.compiler = IsolatedCompiler(info.serialize_json(), compile_timeout_s)
        self.compiler.prestart()
        # xgrammar 0.2.9 lets JSON strings with minLength/maxLength take raw control characters
        # (U+0000-U+001F), which JSON forbids (RFC 8259 section 7). Our JSON grammars use fixed separators
        # (any_whitespace=False), so a valid document never needs a token containing one: ban them.
        special = set(info.special_token_ids) | set(stop_token_ids)
        self.control_token_ids = torch.tensor(
            [
                i
                for i, piece in enumerate(info.decoded_vocab)
                if i not in special and any(byte < 0x20 for byte in piece)
            ],
            dtype=torch.long,
        )
        self.vocab_size = vocab_size
        self.on_compile = on_compile
        # tests (`--inject-fault grammar-gate:WHERE`): a kvserve.engine.faults.Gate every compile passes
        # first (outside the compile limit)
        self.gate = None
        # least recently used first; a running request's matcher keeps its own grammar alive
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()  # compiled from HTTP threads and from the engine thread
        self.compile_times_s: deque[float] = deque(maxlen=4096)

    def close(self) -> None:
        """Stop the compile workers."""
        self.compiler.close()

    def is_compiled(self, structured: StructuredOutput) -> bool:
        with self._lock:
            return structured in self._compiled

    def compile(self, structured: StructuredOutput):
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
        if compiled is not None:
            return compiled
        if self.gate is not None:
            self.gate.wait_and_pass()
        start = time.perf_counter()
        try:
            serialized = self.compiler.compile(structured.kind, structured.spec)
            compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self.info)
            self._refuse_if_empty(compiled)
        except GrammarCompileTimeoutError as exc:
            exc.param = structured.param
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, CompileWorkerError):
                raise
            raise InvalidRequestError(
                f"invalid {structured.kind} constraint: {sanitize_compiler_error(exc)}",
                structured.param,
            ) from exc
        elapsed = time.perf_counter() - start
        with self._lock:
            self._compiled[structured] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:  # bounded: memory that returns
                self._compiled.popitem(last=False)
            self.compile_times_s.append(elapsed)
        if self.on_compile is not None:
            self.on_compile(elapsed)
        return compiled

    def _refuse_if_empty(self, compiled) -> None:
        """ValueError for a grammar that no output can satisfy from its first token on: no token may
        start it and the empty string does not complete it (`root ::= x` with `x ::= x "a"`, an empty
        character class). Served, it gave "" with `complete: false`. A grammar that may start but
        can never end (`root ::= "a" root`) is not found here: it runs to max_tokens."""
        matcher = self._xgr.GrammarMatcher(compiled)
        bitmask = self.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask)
        if not matcher.is_completed() and not bool((bitmask != 0).any()):
            raise ValueError("it matches no string: no token can start it and it cannot be empty")

    def matcher(self, structured: StructuredOutput):
        return self._xgr.GrammarMatcher(self.compile(structured))

    @staticmethod
    def bans_control_tokens(structured: StructuredOutput) -> bool:
        # Forced tool calls are JSON between fixed strings without control characters.
        return structured.kind in ("json_schema", "json_object", "structural_tag")

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], json_rows: list[int]
    ) -> None:
        """Mask, in place, the tokens each listed row's grammar forbids (and, on JSON rows, tokens with
        control characters); other rows are untouched."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        if json_rows and len(self.control_token_ids):
            index = torch.tensor(json_rows, device=logits.device).unsqueeze(1)
            logits[index, self.control_token_ids.to(logits.device)] = float("-inf")
