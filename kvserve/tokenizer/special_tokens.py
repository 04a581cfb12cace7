"""A tokenizer's special tokens as transformers 5 resolves them from its files
(`PreTrainedTokenizerBase._from_pretrained` and `__init__`, `TokenizersBackend.__init__`): the named
ones (bos_token, eos_token, ..., and model-specific `*_token` entries), the extra ones, and the added
tokens it hands the backend, in the order it adds them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import AddedToken

from kvserve.tokenizer.files import TokenizerFiles

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# GPT2Tokenizer's keyword defaults, used where its tokenizer_config.json has no such key.
_GPT2_DEFAULTS = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>"} | {
    "eos_token": "<|endoftext|>"
}


@dataclass(frozen=True)
class SpecialTokens:
    named: dict[str, str | AddedToken]  # attribute -> token, in transformers' attribute order
    extra: list[str | AddedToken]
    tokens_to_add: list[AddedToken]  # what TokenizersBackend.__init__ passes to add_tokens

    def token(self, name: str) -> str | None:
        value = self.named.get(name)
        return None if value is None else str(value)

    @property
    def names_map(self) -> dict[str, str]:
        """transformers' `special_tokens_map`: the named tokens (chat template variables)."""
        return {name: str(value) for name, value in self.named.items() if value is not None}

    @property
    def all_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for value in [*self.named.values(), *self.extra]:
            if value is not None:
                seen.setdefault(str(value), None)
        return list(seen)


def _added_token(value):
    """A serialised AddedToken (`{"__type": "AddedToken", ...}`) as one; other values as they are."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    if isinstance(value, list | tuple):
        return [_added_token(v) for v in value]
    if isinstance(value, dict):
        return {k: _added_token(v) for k, v in value.items()}
    return value


def _is_token(value) -> bool:
    return isinstance(value, str | AddedToken)


def _legacy_added_tokens(files: TokenizerFiles, init: dict) -> dict[int, AddedToken]:
    """Without `added_tokens_decoder` in tokenizer_config.json: special_tokens_map.json,
    added_tokens.json and tokenizer.json's added tokens, as transformers reads them."""
    for key, value in (files.special_tokens_map or {}).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(init.get("extra_special_tokens") or [])
            for token in value:
                token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                if token not in existing:
                    existing.append(token)
            value = existing
        init[key] = value
    decoder: dict[int, AddedToken] = {}
    if files.added_tokens is not None:
        special = {str(init[k]) for k in NAMED if init.get(k)}
        special.update(str(t) for t in (init.get("extra_special_tokens") or []))
        for token, index in files.added_tokens.items():
            is_special = token in special
            decoder[index] = AddedToken(
                token, rstrip=False, lstrip=False, normalized=not is_special, special=is_special
            )
    for entry in json.loads(files.tokenizer_json).get("added_tokens") or []:
        entry = dict(entry)
        index = entry.pop("id")
        decoder[index] = AddedToken(**entry)
    return decoder


def resolve_special_tokens(files: TokenizerFiles, backend_added: list[str]) -> SpecialTokens:
    """`backend_added`: the contents of the backend's added tokens before transformers adds any.
    Long: one pass over transformers' loading steps, in their order, so each can be compared."""
    init = {k: v for k, v in files.config.items() if k not in ("add_bos_token", "add_eos_token")}
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    explicit = {
        k: init.pop(k)
        for k in list(init)
        if k not in NAMED and k.endswith("_token") and isinstance(init[k], str)
    }
    if isinstance(init.get("extra_special_tokens"), dict):
        explicit.update(init.pop("extra_special_tokens"))
    if "added_tokens_decoder" in init:
        decoder = {}
        for index, token in init["added_tokens_decoder"].items():
            if not isinstance(token, dict):
                raise TypeError(f"added_tokens_decoder[{index}] is not an object: {token!r}")
            decoder[int(index)] = AddedToken(**token)
    else:
        decoder = _legacy_added_tokens(files, init)
        if isinstance(init.get("extra_special_tokens"), dict):
            explicit.update(init.pop("extra_special_tokens"))
    by_content = {str(t): t for t in decoder.values()}
    init = _added_token(init)
    for key in NAMED:
        if key in init and by_content and init[key] is not None:
            init[key] = by_content.get(str(init[key]), init[key])

    if files.backend_build == "gpt2":  # GPT2Tokenizer.__init__'s keyword defaults
        init = _GPT2_DEFAULTS | init
    # PreTrainedTokenizerBase.__init__
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    named: dict[str, str | AddedToken | None] = dict.fromkeys(NAMED)
    extra: list = []
    auto = {}
    for key, value in init.items():
        if key in NAMED:
            if value is None:
                continue
            if not _is_token(value):
                raise TypeError(f"{key} must be a string or an AddedToken, got {value!r}")
            named[key] = value
        elif key == "extra_special_tokens" and value is not None:
            if isinstance(value, dict):
                explicit = {**value, **explicit}
            elif isinstance(value, list | tuple):
                extra = list(value)
            else:
                raise TypeError("extra_special_tokens must be a list of tokens or a dict of names")
        elif key.endswith("_token") and _is_token(value):
            auto[key] = value
    for key, value in {**auto, **explicit}.items():
        if _is_token(value):
            named[key] = value

    # TokenizersBackend.__init__: every token of added_tokens_decoder, then the special tokens the
    # backend lacks (strings become special AddedTokens)
    tokens_to_add = [token for _, token in sorted(decoder.items(), key=lambda item: item[0])]
    encoder = [*backend_added, *(str(t) for t in tokens_to_add)]  # not extended below, as there
    for value in [*named.values(), *extra]:
        if value is not None and str(value) not in encoder and value not in tokens_to_add:
            tokens_to_add.append(value)
    all_named = {str(t) for t in named.values() if t}
    final = []
    for token in tokens_to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in all_named:
            token.special = True
        final.append(token)
    return SpecialTokens(named, extra, final)
