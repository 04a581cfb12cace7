"""The text of each token in a logprobs answer: its decoded contribution in context (docs/tools.md).

A token's text is what appending it added to the decoded output, so the tokens of a completion concatenate
to its text and `text_offset` indexes that text. A token that ends on an incomplete UTF-8 character adds no
text yet: it is shown as its raw bytes, `bytes:\\xe2\\x80` (the convention vLLM and llama.cpp's server use for
partial characters), and the token that completes the character carries the whole character. Skipped
special tokens (EOS) add no text and are shown by their own text ("<|endoftext|>").

Decoding in context matters for SentencePiece tokenizers (Llama 2, Mistral): decoding "▁concentr" alone
gives "concentr", but after other text it adds " concentr". The context window starts with the last prompt
tokens, as the incremental detokenizer's does.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

from kvserve.core.outputs import TokenLogprob

_CONTEXT_TOKENS = 6
# Invalid UTF-8 (a lead byte never completed) would hold tokens back forever: give up after this many.
_MAX_PENDING_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
PARTIAL_PREFIX = "bytes:"


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's byte-to-unicode table: byte-level BPE pieces spell raw bytes with these characters.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenBytes:
    """Raw bytes of single tokens (byte-level BPE, SentencePiece byte fallback, or plain pieces)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self.byte_level:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("▁", " ").encode()


def partial_token(raw: bytes) -> str:
    return PARTIAL_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """Per sample: the text each generated token contributed, fed in order (streamed or not)."""

    def __init__(
        self,
        tokenizer,
        token_bytes: TokenBytes,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # decodes to whole characters
        self._pending: list[int] = []  # tokens after the window that end mid-character
        self._base = self._decode(self._window)
        self.offset = 0  # characters of output text so far (the next token's text_offset)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _contribution(self, token_id: int) -> tuple[str, bool]:
        """(text, committed): the text appending `token_id` now adds. A token whose bytes end on a
        character still missing bytes adds none yet (shown as `bytes:...`, not committed to text)."""
        raw = self.token_bytes.of(token_id)
        held = b"".join(self.token_bytes.of(t) for t in self._pending) + raw
        if _incomplete_tail(held) and len(self._pending) < _MAX_PENDING_TOKENS:
            return partial_token(raw), False
        new = self._decode(self._window + self._pending + [token_id])
        if not new.startswith(self._base):  # a tokenizer whose cleanup rewrote the context
            return new[len(os.path.commonprefix([new, self._base])) :], True
        text = new[len(self._base) :]
        if not text and token_id in self.token_bytes.special_ids:
            return self.tokenizer.convert_ids_to_tokens(token_id), False  # skipped: adds no text
        return text, True

    def text_of(self, token_id: int) -> str:
        """The text `token_id` would add now (an alternative in top_logprobs); changes nothing."""
        return self._contribution(token_id)[0]

    def advance(self, token_id: int) -> tuple[str, int]:
        """Commit the sampled token: returns (its text, its text_offset)."""
        text, committed = self._contribution(token_id)
        offset = self.offset
        if not committed:
            if text.startswith(PARTIAL_PREFIX):
                self._pending.append(token_id)
            return text, offset
        self.offset += len(text)
        self._window = (self._window + self._pending + [token_id])[-_CONTEXT_TOKENS:]
        self._pending = []
        self._base = self._decode(self._window)
        return text, offset


def _incomplete_tail(data: bytes) -> int:
    """Length of the suffix of `data` that starts a UTF-8 character and lacks its last bytes (0-3)."""
    for k in range(1, min(4, len(data)) + 1):
        byte = data[-k]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = (
            2
            if byte & 0xE0 == 0xC0
            else 3
            if byte & 0xF0 == 0xE0
            else 4
            if byte & 0xF8 == 0xF0
            else 1
        )
        return k if need > k else 0
    return 0


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        tops.append({texts.text_of(t): lp for t, lp in e.top})
        text, offset = texts.advance(e.token_id)
        tokens.append(text)
        offsets.append(offset)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    """OpenAI chat `logprobs.content`: token text, logprob, the token's own raw bytes, top_logprobs."""
    raw = texts.token_bytes.of
    content = []
    for e in entries:
        top = [{"token": texts.text_of(t), "logprob": lp, "bytes": list(raw(t))} for t, lp in e.top]
        text, _ = texts.advance(e.token_id)
        content.append(
            {
                "token": text,
                "logprob": e.logprob,
                "bytes": list(raw(e.token_id)),
                "top_logprobs": top,
            }
        )
    return {"content": content}
