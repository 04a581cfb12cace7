"""Tokenizer directories for the light tokenizer's oracle tests (tests/tokenizer): the project's own
(the demo model, GPT-2's fixture, the GGUF models' converted tokenizers) and small ones in the styles
of the model families kvserve serves, each written as their checkpoints ship them (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, added_tokens.json, chat_template.jinja, config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

import kvserve
from tests.checkpoints import GPT2_TOKENIZER

DEMO = Path(kvserve.__file__).parent / "assets" / "demo" / "target"
FIXTURES = Path(__file__).parent / "fixtures"
HERMES_TEMPLATE = (FIXTURES / "hermes_tools_template.jinja").read_text()

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- elif message['role'] == 'system' %}
        {{- '[SYS]' + message['content'] + '[/SYS]' }}
    {%- endif %}
{%- endfor %}
"""


def _write(path: Path, files: dict[str, object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else json.dumps(content, indent=1)
        (path / name).write_text(text, encoding="utf-8")
    return path


def _metaspace_bpe(byte_fallback: bool = True) -> Tokenizer:
    """A SentencePiece-style BPE (Llama 2, Mistral): "▁" word starts, byte fallback."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, said the café owner"]
    corpus += ["don't stop: it's 2024 and we're at 99.5%!", "numbers 12345 and ünïcödé"]
    tok.train_from_iterator(corpus * 40, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(256):  # byte pieces join the model's vocabulary, as in Llama 2
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def llama2_style(path: Path) -> Path:
    """Llama 2 / TinyLlama: byte-fallback BPE, BOS from the post-processor, `clean_up` on (a
    no-op for BPE in transformers 5), a template that raises on roles out of order."""
    _write(
        path,
        {
            "tokenizer.json": _metaspace_bpe().to_str(),
            "tokenizer_config.json": {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": None,
                "clean_up_tokenization_spaces": True,
                "chat_template": LLAMA2_TEMPLATE,
                "model_max_length": 2048,
            },
            "config.json": {"model_type": "llama"},
        },
    )
    return path


def mistral_legacy_style(path: Path) -> Path:
    """Mistral v0.1 style, saved by an old transformers: no added_tokens_decoder in
    tokenizer_config.json, so special_tokens_map.json and added_tokens.json are read; no
    post-processor; [INST] markers added as tokens."""
    tok = _metaspace_bpe()
    tok.post_processor = None
    _write(
        path,
        {
            "tokenizer.json": tok.to_str(),
            "tokenizer_config.json": {
                "tokenizer_class": "TokenizersBackend",
                "clean_up_tokenization_spaces": False,
                "additional_special_tokens": ["[INST]", "[/INST]"],
                "chat_template": MISTRAL_TEMPLATE,
            },
            "special_tokens_map.json": {
                "bos_token": {
                    "content": "<s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "extra_special_tokens": ["[SYS]"],
            },  # fmt: skip
            "added_tokens.json": {"[INST]": 1000, "[/INST]": 1001, "[SYS]": 1002},
            "config.json": {"model_type": "mistral"},
        },
    )
    return path


def _gpt2_json() -> dict:
    return json.loads((GPT2_TOKENIZER / "tokenizer.json").read_text())


def _digits_then_bytes(trim_offsets: bool) -> dict:
    """A pre-tokenizer that splits digits one by one, then byte-level (Qwen's and SmolLM2's)."""
    digits = {"type": "Digits", "individual_digits": True}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    byte_level["trim_offsets"] = trim_offsets
    return {"type": "Sequence", "pretokenizers": [digits, byte_level]}


def qwen3_style(path: Path) -> Path:
    """Qwen 3: byte-level BPE with digits split, ChatML markers and <think> as added tokens (the
    think markers not special), added_tokens_decoder in tokenizer_config.json, the template in
    chat_template.jinja."""
    spec = _gpt2_json()
    spec["pre_tokenizer"] = _digits_then_bytes(trim_offsets=False)
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": True}  # fmt: skip
    added = {"<|im_start|>": True, "<|im_end|>": True, "<think>": False, "</think>": False}
    decoder = {}
    for offset, (content, special) in enumerate(added.items()):
        entry = {"id": 50257 + offset, "content": content, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": special}  # fmt: skip
        spec["added_tokens"].append(entry)
        decoder[str(entry["id"])] = {k: v for k, v in entry.items() if k != "id"}
    _write(
        path,
        {
            "tokenizer.json": json.dumps(spec),
            "tokenizer_config.json": {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": decoder,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "errors": "replace",
                "split_special_tokens": False,
            },
            "chat_template.jinja": HERMES_TEMPLATE,
            "config.json": {"model_type": "qwen3"},
        },
    )
    return path


def gpt2_class_with_digits(path: Path) -> Path:
    """tokenizer_class GPT2Tokenizer over a tokenizer.json whose pre-tokenizer also splits digits
    (SmolLM2's Hub files): transformers 5 rebuilds the backend from the class's own code, which
    drops the digit split, and takes the special tokens' defaults from the class."""
    spec = _gpt2_json()
    spec["pre_tokenizer"] = _digits_then_bytes(trim_offsets=True)
    spec["normalizer"] = {"type": "Lowercase"}
    _write(
        path,
        {
            "tokenizer.json": json.dumps(spec),
            "tokenizer_config.json": {
                "tokenizer_class": "GPT2TokenizerFast",
                "add_prefix_space": True,
            },
            "config.json": {"model_type": "gpt2"},
        },
    )
    return path


def gemma_style(path: Path) -> Path:
    """Gemma 3 style: model-specific special tokens (`image_token`, an `extra_special_tokens`
    dict), no post-processor in tokenizer.json, two templates (chat_template.jinja and
    additional_chat_templates/tool_use.jinja)."""
    tok = _metaspace_bpe()
    spec = json.loads(tok.to_str())
    spec["post_processor"] = None
    _write(
        path,
        {
            "tokenizer.json": json.dumps(spec),
            "tokenizer_config.json": {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "image_token": "<image_soft_token>",
                "extra_special_tokens": {"boi_token": "<start_of_image>"},
                "spaces_between_special_tokens": False,
            },
            "chat_template.jinja": MISTRAL_TEMPLATE,
            "additional_chat_templates/tool_use.jinja": HERMES_TEMPLATE,
            "config.json": {"model_type": "gemma3_text"},
        },
    )
    return path


def copy_of(source: Path, path: Path, **replace: object) -> Path:
    """`source`'s files in `path`, with some replaced (name -> content; None deletes)."""
    shutil.copytree(source, path)
    for name, content in replace.items():
        name = name.replace("__", ".")
        if content is None:
            (path / name).unlink(missing_ok=True)
        elif isinstance(content, bytes):
            (path / name).write_bytes(content)
        else:
            _write(path, {name: content})
    return path
