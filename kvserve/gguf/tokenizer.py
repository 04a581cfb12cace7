"""A `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (llama.cpp's key names).

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges or scores, token types and
special ids as metadata. `build_tokenizer` rebuilds the tokenizer they describe and
`tokenizer_config` the matching Hugging Face `tokenizer_config.json`; saved side by side they load
with `transformers.AutoTokenizer` and encode and decode as transformers' own GGUF conversion does.

Two vocabulary models, picked by `tokenizer.ggml.model` from `_MODEL_BUILDERS`:

- "gpt2": byte-level BPE from tokens + merges; text is split by the regexes llama.cpp picks for
  `tokenizer.ggml.pre` (`PRE_TOKENIZER_SPLITS`).
- "llama": SentencePiece-style BPE with `<0xNN>` byte fallback. The file has no merges, so they are
  recovered from the vocabulary: every split of a token into two tokens is a merge, ranked by the
  token's score (or, for Gemma, its position in the file, as transformers does; `_SPM_VARIANTS`).

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added
tokens, so `<|im_start|>` stays one id. Malformed metadata raises `ModelLoadError` naming the key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvserve.core.errors import ModelLoadError

# llama.cpp's `llama_token_type`.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_SPM_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space

# The GPT-2 split as llama.cpp writes it; text it leaves unmatched becomes a piece of its own
# (`behavior="isolated"`), which is what GPT-2's trailing `|\s+` alternative gives.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes llama.cpp (llama-vocab.cpp, `llm_tokenizer_bpe`) splits with,
# applied one after another, each to the pieces of the one before.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "gpt2": (_GPT2,),  # not a llama.cpp name, but what some converters write
    "phi-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "stablelm2": (_QWEN2,),
}


@dataclass(frozen=True)
class SpmVariant:
    """How an architecture's SentencePiece vocabulary is read.

    `respell_space_runs`: tokens made only of whitespace, with a space in them, are stored with real
    spaces ("  ") while the text they must match has "▁▁"; they are renamed to "▁" * len.
    `rank_by_position`: merges rank by the merged token's position in the file rather than by score.
    """

    respell_space_runs: bool = False
    rank_by_position: bool = False


# `general.architecture` -> variant; the transformers GGUF conversion treats Gemma this way.
_SPM_VARIANTS: dict[str, SpmVariant] = {
    arch: SpmVariant(respell_space_runs=True, rank_by_position=True)
    for arch in ("gemma", "gemma2", "gemma3")
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of GGUF metadata, checked: list lengths agree and ids are in range."""

    model: str
    architecture: str | None
    tokens: Sequence[str]
    token_types: Sequence[int] | None
    scores: Sequence[float] | None
    merges: Sequence[str] | None
    pre: str
    special_ids: Mapping[str, int]  # "bos_token" -> id, for those the file names
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ModelLoadError(
                "GGUF metadata has no tokenizer.ggml.tokens: cannot build a tokenizer"
            )
        for key, values in (("token_type", self.token_types), ("scores", self.scores)):
            if values is not None and len(values) != len(self.tokens):
                raise ModelLoadError(
                    f"GGUF tokenizer.ggml.{key} has {len(values)} entries but "
                    f"tokenizer.ggml.tokens has {len(self.tokens)}"
                )
        for name, token_id in self.special_ids.items():
            if not 0 <= token_id < len(self.tokens):
                raise ModelLoadError(
                    f"GGUF tokenizer.ggml.{_SPECIAL_ID_KEYS[name]} = {token_id} is outside the "
                    f"vocabulary of {len(self.tokens)} tokens"
                )

    def special_token(self, name: str) -> str | None:
        token_id = self.special_ids.get(name)
        return None if token_id is None else self.tokens[token_id]

    def ids_of_type(self, token_type: int) -> list[int]:
        if self.token_types is None:
            return []
        return [i for i, kind in enumerate(self.token_types) if kind == token_type]


_SPECIAL_ID_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def read_vocab(metadata: Mapping[str, object]) -> GGUFVocab:
    """The tokenizer fields of `metadata`, validated (raises `ModelLoadError`)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in _MODEL_BUILDERS:
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.model = {model!r} is not supported (supported: "
            f"{', '.join(sorted(_MODEL_BUILDERS))})"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, Sequence) or isinstance(tokens, str):
        tokens = ()
    special_ids = {
        name: int(metadata[f"tokenizer.ggml.{key}"])
        for name, key in _SPECIAL_ID_KEYS.items()
        if metadata.get(f"tokenizer.ggml.{key}") is not None
    }
    return GGUFVocab(
        model=str(model),
        architecture=_opt_str(metadata.get("general.architecture")),
        tokens=tokens,
        token_types=metadata.get("tokenizer.ggml.token_type"),
        scores=metadata.get("tokenizer.ggml.scores"),
        merges=metadata.get("tokenizer.ggml.merges"),
        pre=_opt_str(metadata.get("tokenizer.ggml.pre")) or "default",
        special_ids=special_ids,
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
    )


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def build_tokenizer(metadata: Mapping[str, object]) -> Tokenizer:
    """The tokenizer the GGUF metadata describes, with BOS/EOS added as the file asks."""
    vocab = read_vocab(metadata)
    tokenizer = _MODEL_BUILDERS[vocab.model](vocab)
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def tokenizer_config(metadata: Mapping[str, object]) -> dict:
    """The `tokenizer_config.json` to save beside `build_tokenizer(metadata).save(...)`."""
    vocab = read_vocab(metadata)
    config: dict = {
        name: vocab.special_token(name) for name in _SPECIAL_ID_KEYS if name in vocab.special_ids
    }
    config["add_bos_token"] = vocab.add_bos_token
    config["add_eos_token"] = vocab.add_eos_token
    if (template := metadata.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = str(template)
    context_length = metadata.get(f"{vocab.architecture}.context_length")
    if context_length is not None:
        config["model_max_length"] = int(context_length)
    config["clean_up_tokenization_spaces"] = False
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


# --- byte-level BPE ("gpt2") -------------------------------------------------------------------


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (as `tokenizers`' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _build_byte_level(vocab: GGUFVocab) -> Tokenizer:
    if vocab.pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.pre = {vocab.pre!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))})"
        )
    if not vocab.merges:
        raise ModelLoadError(
            "GGUF tokenizer.ggml.merges is missing: a gpt2 vocabulary needs merges"
        )
    spelling = _byte_spelling()
    alphabet = frozenset(spelling.values())
    # A token outside the byte alphabet is spelled in text (llama.cpp writes some that way); respell
    # it byte by byte. Such a token marked control is not added as special: transformers skips it.
    spelled = [
        token if alphabet.issuperset(token) else "".join(spelling[b] for b in token.encode())
        for token in vocab.tokens
    ]
    token_ids = {token: i for i, token in enumerate(spelled)}
    merges = _parse_merges(vocab.merges, token_ids)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=token_ids,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in PRE_TOKENIZER_SPLITS[vocab.pre]
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, vocab, keep=lambda i: spelled[i] == vocab.tokens[i])
    return tokenizer


# --- SentencePiece-style BPE ("llama") -----------------------------------------------------------


def _build_sentencepiece(vocab: GGUFVocab) -> Tokenizer:
    variant = _SPM_VARIANTS.get(vocab.architecture or "", SpmVariant())
    tokens = list(vocab.tokens)
    if variant.respell_space_runs:
        tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    token_ids = {token: i for i, token in enumerate(tokens)}
    if vocab.merges:
        merges = _parse_merges(vocab.merges, token_ids)
    else:
        if variant.rank_by_position:
            ranks = {token: -i for i, token in enumerate(tokens)}
        elif vocab.scores is None:
            raise ModelLoadError(
                "GGUF tokenizer.ggml.scores is missing: a llama (SentencePiece) vocabulary "
                "without merges needs scores"
            )
        else:
            ranks = dict(zip(tokens, vocab.scores, strict=True))
        merges = _merges_from_vocab(token_ids, ranks)
    unk = vocab.special_token("unk_token")
    tokenizer = Tokenizer(
        models.BPE(vocab=token_ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prepend = "first" if vocab.add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme=prepend, split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_special_tokens(tokenizer, vocab, keep=lambda i: tokens[i] == vocab.tokens[i])
    return tokenizer


def _merges_from_vocab(
    token_ids: Mapping[str, int], ranks: Mapping[str, float]
) -> list[tuple[str, str]]:
    """Every way to cut a token into two vocabulary tokens, best-ranked token first.

    The order is transformers' `generate_merges`, so both rebuild the same BPE: by the merged
    token's rank, high first; then by the left piece's length, long first; then the right piece's;
    ties keep `ranks`' order. Tokens are grouped by rank so only equal ranks need a sort.
    """
    by_rank: dict[float, list[tuple[int, int, str, str]]] = {}
    for token, rank in ranks.items():
        for k in range(len(token) - 1, 0, -1):  # long left piece first
            left = token[:k]
            if left in token_ids:
                right = token[k:]
                if right in token_ids:
                    by_rank.setdefault(rank, []).append((-k, k - len(token), left, right))
    merges: list[tuple[str, str]] = []
    for rank in sorted(by_rank, reverse=True):
        cuts = by_rank[rank]
        if len(cuts) > 1:
            cuts.sort(key=lambda cut: (cut[0], cut[1]))  # stable: equal keys keep `ranks`' order
        merges.extend((left, right) for _, _, left, right in cuts)
    return merges


def _parse_merges(merges: Sequence[str], token_ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """`"left right"` lines as pairs; each side must be a vocabulary token."""
    pairs = []
    for index, merge in enumerate(merges):
        pair = merge.split(" ")
        if len(pair) != 2 or pair[0] not in token_ids or pair[1] not in token_ids:
            raise ModelLoadError(
                f"GGUF tokenizer.ggml.merges[{index}] = {merge!r} does not name two vocabulary tokens"
            )
        pairs.append((pair[0], pair[1]))
    return pairs


# --- shared pieces -------------------------------------------------------------------------------


def _add_special_tokens(
    tokenizer: Tokenizer, vocab: GGUFVocab, keep: Callable[[int], bool]
) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens, each kept
    whole in the text; `keep(id)` is False for tokens whose vocabulary spelling was changed."""
    control = [
        AddedToken(vocab.tokens[i], normalized=False, special=True)
        for i in vocab.ids_of_type(TOKEN_TYPE_CONTROL)
        if keep(i)
    ]
    tokenizer.add_special_tokens(control)
    user_defined = [
        AddedToken(vocab.tokens[i], normalized=False, special=False)
        for i in vocab.ids_of_type(TOKEN_TYPE_USER_DEFINED)
        if keep(i)
    ]
    tokenizer.add_tokens(user_defined)


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing:
    """`[BOS] $A [EOS]` (and the same around `$B`) with each marker only where the file asks for it."""
    bos, eos = vocab.special_token("bos_token"), vocab.special_token("eos_token")
    add_bos = vocab.add_bos_token and bos is not None
    add_eos = vocab.add_eos_token and eos is not None

    def around(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if add_bos else []
        parts.append(f"${seq}:{type_id}")
        if add_eos:
            parts.append(f"{eos}:{type_id}")
        return " ".join(parts)

    special = {}
    if add_bos:
        special[bos] = vocab.special_ids["bos_token"]
    if add_eos:
        special[eos] = vocab.special_ids["eos_token"]
    return processors.TemplateProcessing(
        single=around("A", 0),
        pair=f"{around('A', 0)} {around('B', 1)}",
        special_tokens=list(special.items()),
    )


_MODEL_BUILDERS: dict[str, Callable[[GGUFVocab], Tokenizer]] = {
    "gpt2": _build_byte_level,
    "llama": _build_sentencepiece,
}
