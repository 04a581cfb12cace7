"""A model directory's tokenizer files as `transformers.AutoTokenizer` (transformers 5) reads them, and
whether the light tokenizer (kvserve/tokenizer/light.py) reproduces what it builds from them.

The light path covers the tokenizers that AutoTokenizer loads from `tokenizer.json` as it is
(`tokenizer_class` PreTrainedTokenizerFast or TokenizersBackend: the demo model and every GGUF
directory kvserve writes) and GPT2Tokenizer (rebuilt from the file's vocabulary and merges, as its
class does). Everything else AutoTokenizer builds from its own per-model code (LlamaTokenizer,
Qwen2Tokenizer, GemmaTokenizer ... rebuild the normaliser and pre-tokenizer; a SentencePiece
`tokenizer.model` is converted; remote code runs), so `light_path_refusal` names why, and the
caller falls back to transformers."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.core.errors import ModelLoadError

# transformers 5.24's MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: for these model types
# AutoTokenizer ignores the declared class and uses its registered one (tests/tokenizer checks that
# transformers' set is inside this one).
_CLASS_OVERRIDDEN_MODEL_TYPES = frozenset(
    "arctic chatlm ernie4_5 ernie4_5_moe fuyu h2ovl_chat hyperclovax hyperclovax_vlm "
    "hyperclovax_vision_v2 internlm2 internlm3 iquestcoder jamba llava llava_next minicpm3 minicpmv "
    "minimax_m2 modernbert modernbert-decoder molmo molmo2 nemotron nvfp4 opencua openvla "
    "paddleocr_vl phi3 phi3_v phimoe qwen2 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen4_exp step3_vl "
    "vipllava cohere_asr camembertv2-base siglip2 smolvlm".split()
)
# transformers 5.24's MODEL_IDS_TO_TOKENIZERS_BACKEND: Hub ids it loads as TokenizersBackend whatever
# their declared class (matched against config.json's _name_or_path; refused, to be safe).
_BACKEND_MODEL_IDS = (
    "deepseek-ai/deepseek-r1-distill-llama-*",
    "deepseek-ai/deepseek-coder-*",
    "allenai/dolma2-tokenizer",
    "google/umt5-small",
    "naver-clova-ix/donut-*",
    "salesforce/blip2-opt-*",
    "salesforce/blip2-flan-t5-*",
    "salesforce/instructblip-flan-t5-*",
    "stepfun-ai/step-3.7-*",
)
# tokenizer_class (without "Fast") -> how the backend is built: "file" (tokenizer.json as it is)
# or "gpt2" (GPT2Tokenizer: byte-level BPE rebuilt from the file's vocabulary and merges).
BACKEND_BUILDS = {
    "PreTrainedTokenizer": "file",
    "TokenizersBackend": "file",
    "GPT2Tokenizer": "gpt2",
}


@dataclass(frozen=True)
class TokenizerFiles:
    """What AutoTokenizer reads from a model directory, parsed (the tokenizer.json as text)."""

    model_dir: Path
    tokenizer_json: str
    config: dict  # tokenizer_config.json, {} when absent
    special_tokens_map: (
        dict | None
    )  # special_tokens_map.json (read only without added_tokens_decoder)
    added_tokens: dict | None  # added_tokens.json (likewise)
    chat_template: str | dict | None
    model_config: dict  # config.json, {} when absent or unreadable (as AutoConfig falls back)

    @property
    def tokenizer_class(self) -> str | None:
        name = self.config.get("tokenizer_class") or self.model_config.get("tokenizer_class")
        return name if isinstance(name, str) else None

    @property
    def backend_build(self) -> str | None:
        name = self.tokenizer_class
        return None if name is None else BACKEND_BUILDS.get(name.removesuffix("Fast"))


def _read_json(path: Path, required_type: type = dict) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelLoadError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(value, required_type):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable UTF-8 file: {exc}") from None


def _chat_template(model_dir: Path, config: dict) -> str | dict | None:
    """chat_template.jinja and additional_chat_templates/*.jinja win over tokenizer_config.json's
    entry; one template is a string, several a dict by name ("default" for chat_template.jinja)."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = _read_text(model_dir / "chat_template.jinja")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = _read_text(path)
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, list | tuple):
        try:
            return {item["name"]: item["template"] for item in template}
        except (TypeError, KeyError) as exc:
            raise ModelLoadError(
                f"{model_dir / 'tokenizer_config.json'}: chat_template is a list of "
                f"{{name, template}} objects: {exc!r}"
            ) from None
    return template


def read_tokenizer_files(model_dir: str | Path) -> TokenizerFiles:
    """The files, parsed; a `ModelLoadError` naming the file when one is not readable."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    config = _read_json(model_dir / "tokenizer_config.json") or {}
    try:
        model_config = _read_json(model_dir / "config.json") or {}
    except ModelLoadError:
        model_config = {}  # AutoConfig's failure is not the tokenizer's: it falls back likewise
    legacy = "added_tokens_decoder" not in config
    return TokenizerFiles(
        model_dir=model_dir,
        tokenizer_json=_read_text(path) if path.is_file() else "",
        config=config,
        special_tokens_map=_read_json(model_dir / "special_tokens_map.json") if legacy else None,
        added_tokens=_read_json(model_dir / "added_tokens.json") if legacy else None,
        chat_template=_chat_template(model_dir, config),
        model_config=model_config,
    )


def light_path_refusal(files: TokenizerFiles) -> str | None:
    """Why the light tokenizer would not reproduce AutoTokenizer for these files, or None."""
    if not files.tokenizer_json:
        return "it has no tokenizer.json (transformers converts a SentencePiece tokenizer.model)"
    if files.config.get("auto_map"):
        return "its tokenizer is remote code (auto_map)"
    if (files.model_dir / "tekken.json").is_file():
        return "it has a Mistral tekken.json"
    if files.config.get("fix_mistral_regex"):
        return "its tokenizer_config.json asks transformers to patch the pre-tokenizer"
    model_type = files.model_config.get("model_type")
    model_name = files.model_config.get("model_name")
    for value in (model_type, model_name):
        if isinstance(value, str) and value in _CLASS_OVERRIDDEN_MODEL_TYPES:
            return f"transformers replaces the tokenizer class of model type {value!r}"
    name_or_path = files.model_config.get("_name_or_path")
    if isinstance(name_or_path, str) and any(
        fnmatch.fnmatch(name_or_path.lower(), p) for p in _BACKEND_MODEL_IDS
    ):
        return f"transformers chooses the tokenizer class of {name_or_path} by its name"
    if files.backend_build is None:
        return (
            f"transformers builds tokenizer class {files.tokenizer_class!r} from its own code"
            if files.tokenizer_class
            else "its tokenizer_config.json names no tokenizer_class"
        )
    return None
