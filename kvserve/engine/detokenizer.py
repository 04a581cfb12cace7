"""Incremental detokenisation with stop strings.

Text is decoded over a sliding window of token ids (`prefix_offset` .. end) and a delta is released only when
it does not end in U+FFFD, so a multi-byte character split across tokens is never emitted half-way. The window
starts with the last few prompt tokens so that tokenizers which drop a leading space on the first token of a
decode (SentencePiece) still produce the right spacing. Stop strings are never emitted: text that could be the
start of a stop string is held back until it is resolved.
"""

from __future__ import annotations

from kvserve.core.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: tuple[int, ...], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded output text, truncated at a stop string
        self._num_emitted = 0  # characters of `text` released to the caller
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None  # which one

    def _decode(self, ids: list[int]) -> str:
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

        After a stop string is found, `stopped` is set and no more text is released.
        """
        if self.stopped:
            return ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
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
        return delta

    def _truncate_at_stop(self, old_len: int) -> bool:
        # A stop string may straddle the old text and the new: search from len(stop) - 1 before.
        best, found = -1, None
        for stop in self.stop:
            index = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best == -1 or index < best):
                best, found = index, stop
        if found is None:
            return False
        self.text = self.text[:best]
        self.stopped = True
        self.stop_string = found
        return True

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
