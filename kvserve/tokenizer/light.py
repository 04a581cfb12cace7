"""The API process's tokenizer: the `tokenizers` library (Rust) and Jinja, without `transformers` (which
imports torch whenever it is installed). It offers what the API process uses of a Hugging Face fast
tokenizer, with the same results as `AutoTokenizer` for the directories `files.light_path_refusal`
accepts (tests/tokenizer/test_tokenizer_light.py compares the two): `encode`, `decode`,
`convert_ids_to_tokens`, `convert_tokens_to_ids`, `apply_chat_template` (text), `chat_template`, the
special tokens and their ids, `get_vocab`, `backend_tokenizer`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from kvserve.core.errors import ModelLoadError
from kvserve.tokenizer.chat_template import normalize_messages, render
from kvserve.tokenizer.files import TokenizerFiles, light_path_refusal, read_tokenizer_files
from kvserve.tokenizer.special_tokens import SpecialTokens, resolve_special_tokens

# apply_chat_template's own parameters that only matter when it tokenises (transformers ignores
# them when it returns text); any other keyword is a template variable.
_TOKENIZE_ONLY = ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")
# transformers' clean_up_tokenization: the WordPiece-era space removal before punctuation.
_CLEANUPS = (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")
_CLEANUPS += (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")


def _gpt2_backend(files: TokenizerFiles) -> Tokenizer:
    """GPT2Tokenizer's backend: byte-level BPE over the file's vocabulary and merges, its own
    pre-tokenizer and decoder; only the post-processor comes from the file."""
    data = json.loads(files.tokenizer_json)
    model = data["model"]
    vocab = model["vocab"]
    if isinstance(vocab, list):
        vocab = {(t[0] if isinstance(t, list) else t): i for i, t in enumerate(vocab)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(files.config.get("add_prefix_space", False))
    )
    backend.decoder = decoders.ByteLevel()
    minimal = {**data, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}
    post_processor = Tokenizer.from_str(json.dumps(minimal)).post_processor
    if post_processor is not None:
        backend.post_processor = post_processor
    return backend


class LightTokenizer:
    """A model directory's tokenizer as `transformers.AutoTokenizer` builds it, for the directories
    `light_path_refusal` accepts (build one with `LightTokenizer.load`)."""

    def __init__(
        self,
        backend: Tokenizer,
        special: SpecialTokens,
        config: dict,
        chat_template: str | dict | None,
        name_or_path: str,
    ) -> None:
        self._tokenizer = backend
        self._special = special
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> LightTokenizer:
        return cls.from_files(read_tokenizer_files(model_dir))

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> LightTokenizer:
        """Raises `ModelLoadError` for unreadable files and `ValueError` for a directory the light
        path does not cover (`light_path_refusal`)."""
        model_dir = files.model_dir
        refusal = light_path_refusal(files)
        if refusal is not None:
            raise ValueError(f"{model_dir}: {refusal}")
        try:
            backend = (
                _gpt2_backend(files)
                if files.backend_build == "gpt2"
                else Tokenizer.from_str(files.tokenizer_json)
            )
        except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception for a bad file)
            raise ModelLoadError(
                f"{model_dir / 'tokenizer.json'}: not a tokenizer the tokenizers library "
                f"reads: {exc}"
            ) from None
        backend.no_truncation()  # transformers encodes without truncation or padding by default
        backend.no_padding()
        try:
            already = [t.content for t in backend.get_added_tokens_decoder().values()]
            special = resolve_special_tokens(files, already)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ModelLoadError(
                f"{model_dir}: the tokenizer's special tokens are malformed: {exc}"
            ) from None
        if special.tokens_to_add:
            backend.add_tokens(special.tokens_to_add)
        backend.encode_special_tokens = bool(files.config.get("split_special_tokens", False))
        if backend.post_processor is None:  # as TokenizersBackend.update_post_processor leaves it
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )
        return cls(backend, special, files.config, files.chat_template, str(model_dir))

    # --- the vocabulary -------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' `vocab_size`)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            if index is None and tokens != self._special.token("unk_token"):
                return self.unk_token_id
            return index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- special tokens -------------------------------------------------------------------------

    def __getattr__(self, name: str):
        """bos_token, eos_token, ..., and their `_id`s (model-specific `*_token`s too), as
        transformers exposes them; None when the tokenizer has no such token."""
        base = name.removesuffix("_id")
        special = self.__dict__.get("_special")
        if special is None or base not in special.named:
            raise AttributeError(name)
        token = special.token(base)
        if base == name or token is None:
            return token
        return self.convert_tokens_to_ids(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return self._special.names_map

    @property
    def all_special_tokens(self) -> list[str]:
        return self._special.all_tokens

    @property
    def all_special_ids(self) -> list[int | None]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        # transformers skips the clean-up on BPE models (it would delete real spaces)
        if clean and (type(self._tokenizer.model).__name__ != "BPE" or self._clean_up_bpe):
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    # --- chat -----------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(
                    "This model has multiple chat templates with no default specified! Available "
                    f"template names are {sorted(templates)}."
                )
            return chat_template
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError(
                    "Cannot use chat template functions because tokenizer.chat_template is not set "
                    "and no template argument was passed!"
                )
            return self.chat_template
        return chat_template

    def apply_chat_template(
        self,
        conversation: list,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        sanitize_control_tokens: bool = False,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        **kwargs: Any,
    ) -> str | list[str] | list[int] | list[list[int]]:
        """transformers' `apply_chat_template`: the text (tokenize=False), or its ids with
        return_dict=False; the other forms (a BatchEncoding, the assistant mask, control-token
        sanitising) are not offered."""
        if not tokenize:
            return_dict = False
        if return_assistant_tokens_mask:
            raise ValueError(
                "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`"
                if not (return_dict and tokenize)
                else "the light tokenizer does not build assistant token masks"
            )
        if sanitize_control_tokens:
            raise ValueError(
                "`sanitize_control_tokens=True` requires `tokenize=True` and is not compatible with "
                "`return_assistant_tokens_mask=True`."
                if not tokenize
                else "the light tokenizer does not sanitise control tokens"
            )
        if tokenize and return_dict:
            raise ValueError("the light tokenizer returns ids only (pass return_dict=False)")
        for name in _TOKENIZE_ONLY:
            kwargs.pop(name, None)
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, list | tuple) and len(conversation) == 0:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        batched = isinstance(conversation, list | tuple) and (
            isinstance(conversation[0], list | tuple) or hasattr(conversation[0], "messages")
        )
        conversations = conversation if batched else [conversation]
        conversations = [normalize_messages(c) for c in conversations]
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, and "
                "add_generation_prompt when you want to add a header that will prompt it to start "
                "a new assistant message instead."
            )
        rendered = render(
            conversations=conversations,
            tools=tools,
            documents=documents,
            chat_template=template,
            continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        if tokenize:
            rendered = [self.encode(text, add_special_tokens=False) for text in rendered]
        return rendered if batched else rendered[0]
