"""Incremental detokenisation with stop strings.

Text is decoded over a sliding window of token ids (`prefix_offset` .. end) and a delta is released only when
it does not end in U+FFFD, so a multi-byte character split across tokens is never emitted half-way. The window
starts with the last few prompt tokens so that tokenizers which drop a leading space on the first token of a
decode (SentencePiece) still produce the right spacing. Stop strings are never emitted: text that could be the
start of a stop string is held back until it is resolved.

Stop strings are matched by one compiled alternation over a window of the last `max stop length` characters
(`regex`'s partial matching finds the longest suffix that could still become a stop string), so a token
costs O(max stop length) character steps however long the text is; the server bounds the number and length
of stop strings (docs/server.md, "Limits").

Only a bounded tail is kept: token ids before the decode window and text already released (beyond what a
stop string's match or hold-back can still reach) are dropped once they exceed `_TRIM_AT`, so a request's
n tokens cost O(n) here in total, not a copy of its whole text per token.
"""

from __future__ import annotations

import regex

from kvserve.core.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6
_TRIM_AT = 4096  # ids / characters that may pile up before the dropped ones are cut off (amortised)
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: tuple[int, ...], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = _rust_decoder(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self._max_stop_len = params.max_stop_len
        # Leftmost match first; at one position the earlier-listed stop string wins.
        self._stops = (
            regex.compile("|".join(regex.escape(s) for s in self.stop)) if self.stop else None
        )
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # decoded output text, truncated at a stop string: its tail once longer than _TRIM_AT
        self.text = ""
        self._num_emitted = 0  # characters of `text` released to the caller
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None  # which one
        self.num_used = 0  # tokens of the last `update` up to the one that completed a stop string

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def update(self, new_token_ids: tuple[int, ...] | list[int], finished: bool) -> str:
        """Feed newly generated tokens; returns the text that may be released now.

        After a stop string is found, `stopped` is set and no more text is released; `num_used` says
        how many of `new_token_ids` it took to complete it (a speculative step commits several
        tokens at once: those after it are not part of the output).
        """
        self.num_used = 0
        if self.stopped:
            return ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.num_used += 1
            old_len = len(self.text)
            self._advance(final=False)
            if self.stop and self._truncate_at_stop(old_len):
                break
        if finished and not self.stopped:
            self._advance(final=True)
            if self.stop:
                self._truncate_at_stop(0)
        end = len(self.text) if (finished or self.stopped) else len(self.text) - self._holdback()
        delta = self.text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        self._trim()
        return delta

    def _trim(self) -> None:
        """Drop what can no longer matter: ids before the decode window, and released text further back
        than a stop string can reach (the next search starts max stop length - 1 before the end)."""
        if self._prefix_offset > _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        drop = min(self._num_emitted, len(self.text) - self._max_stop_len)
        if drop > _TRIM_AT:
            self.text = self.text[drop:]
            self._num_emitted -= drop

    def _truncate_at_stop(self, old_len: int) -> bool:
        # A stop string may straddle the old text and the new: search from max stop length - 1 before
        # (an occurrence wholly inside the old text would have been found already).
        match = self._stops.search(self.text, max(0, old_len - self._max_stop_len + 1))
        if match is None:
            return False
        self.text = self.text[: match.start()]
        self.stopped = True
        self.stop_string = match.group()
        return True

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        if self._stops is None or not self.text:
            return 0
        start = max(0, len(self.text) - self._max_stop_len + 1)
        match = self._stops.search(self.text, start, partial=True)
        return len(self.text) - match.start() if match is not None and match.partial else 0


def _rust_decoder(tokenizer):
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer whose `decode` is exactly its
    `decode` (no clean-up of spaces, no subclass override), else None. Calling it directly skips
    transformers' per-call argument handling (~20 us of a ~35 us decode here)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return None
    return getattr(tokenizer, "_tokenizer", None)
