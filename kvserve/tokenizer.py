"""A model directory's tokenizer and stop tokens, read once by whoever needs them: the engine core
(detokenisation, EOS), the API process (chat templates, token counts), the quantiser (calibration
text). Torch-free; `transformers` is imported only when a tokenizer is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.core.errors import ModelLoadError

if TYPE_CHECKING:  # a type only: the API process imports this module, and no engine internals
    from kvserve.config import ModelConfig


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
    except (
        OSError,
        ValueError,
        TypeError,
    ) as exc:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {exc}") from None


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
