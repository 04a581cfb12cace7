"""A model directory's tokenizer and stop tokens, read once by whoever needs them: the engine core
(detokenisation, EOS), the API process (chat templates, token counts), the quantiser (calibration
text). Torch-free; `transformers` is imported only when a tokenizer is loaded with it.

Two loaders: `load_tokenizer` is transformers' AutoTokenizer (the engine core, which has torch
anyway, and the offline tools); `load_api_tokenizer` is the API process's, the light tokenizer
(`tokenizer/light.py`: the `tokenizers` library and Jinja, no transformers, hence no torch) wherever
it reproduces AutoTokenizer, and AutoTokenizer elsewhere, said in the log (docs/design.md,
"Processes")."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.core.errors import ModelLoadError
from kvserve.tokenizer.files import light_path_refusal, read_tokenizer_files
from kvserve.tokenizer.light import LightTokenizer

if TYPE_CHECKING:  # a type only: the API process imports this module, and no engine internals
    from kvserve.config import ModelConfig

logger = logging.getLogger(__name__)


def has_tokenizer(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file()


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, or None when the directory has none."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 (tokenizers raises plain Exception for a bad file)
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {exc}") from None


def load_api_tokenizer(model_dir: str | Path):
    """The API process's tokenizer: a `LightTokenizer` where it gives what AutoTokenizer gives
    (kvserve/tokenizer/files.py says where), else AutoTokenizer's, which imports torch; None when
    the directory has none. Unreadable files raise `ModelLoadError` either way."""
    if not has_tokenizer(model_dir):
        return None
    files = read_tokenizer_files(model_dir)
    refusal = light_path_refusal(files)
    if refusal is None:
        return LightTokenizer.from_files(files)
    logger.warning(
        "%s: the API process loads this tokenizer with transformers (which imports torch): %s",
        model_dir,
        refusal,
    )
    return load_tokenizer(model_dir)


def stop_token_ids(model_dir: str | Path, model: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (Llama 3 lists several)."""
    ids = set(model.eos_token_ids)
    gen_path = Path(model_dir) / "generation_config.json"
    try:  # a malformed generation_config.json is a load error
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text(encoding="utf-8"))
            eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(int(i) for i in ids)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{gen_path}: not a usable generation config: {exc}") from None
