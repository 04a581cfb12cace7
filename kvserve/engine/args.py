"""Engine options -> `EngineConfig`, and the checkpoint's tokenizer and stop tokens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.core.errors import InvalidRequestError, ModelLoadError
from kvserve.models import resolve_model

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024**2


def resolve_dtype(dtype: str, device: str, model: ModelConfig) -> str:
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return model.torch_dtype if model.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    return "float32"  # bf16/fp16 matmuls are far slower than fp32 on CPUs without native support


def build_engine_config(
    model_dir: str | Path | None,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES,
    enable_prefix_caching: bool = True,
    admission: str = "on_demand",
    seed: int = 0,
    speculative_model: str | Path | None = None,
    speculative_method: str | None = None,
    num_speculative_tokens: int = 4,
    ngram_min: int = 1,
    ngram_max: int = 4,
    kv_cache_dtype: str = "auto",
    attention_backend: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
) -> EngineConfig:
    model_dir = resolve_model(model_dir)
    model = ModelConfig.from_dir(model_dir)
    limit = model.max_position_embeddings
    if model.sliding_window is not None and model.sliding_window < limit:
        # Within the window, sliding-window attention is full attention: cap the context to stay exact.
        limit = model.sliding_window
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens",
            "max_model_len",
        )
    speculative = None
    if speculative_model is not None or speculative_method is not None:
        method = speculative_method or "draft"
        draft = None
        if method == "draft":
            if speculative_model is None:
                raise InvalidRequestError(
                    "speculative method 'draft' needs --speculative-model DIR", "speculative_model"
                )
            draft_dir = resolve_model(speculative_model, role="draft model")
            draft = ModelConfig.from_dir(draft_dir)
            check_same_vocabulary(model_dir, draft_dir)
        speculative = SpeculativeConfig(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            draft_model_dir=str(draft_dir) if draft else None,
            draft_model=draft,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
        )
    return EngineConfig(
        model_dir=str(model_dir),
        model=model,
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            admission=admission,
            num_lookahead_tokens=speculative.num_speculative_tokens if speculative else 0,
        ),
        dtype=resolve_dtype(dtype, device, model),
        device=device,
        seed=seed,
        speculative=speculative,
        attention_backend=attention_backend,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
    )


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """A draft must map every token id to the same token as the target: compare whole vocabularies
    (token -> id, special tokens included), not their sizes."""
    target, draft = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if target is None or draft is None:
        missing = target_dir if target is None else draft_dir
        raise ModelLoadError(
            f"{missing} has no tokenizer, so the draft's vocabulary cannot be checked against the target's"
        )
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t
            for t in set(target_vocab) | set(draft_vocab)
            if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise ModelLoadError(
            f"the draft model's tokenizer ({draft_dir}) maps ids to tokens differently from the target's "
            f"({len(differing)} tokens differ, e.g. {differing[:3]}); a draft must share the tokenizer"
        )


def has_tokenizer(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file()


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, or None when the directory has none."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def stop_token_ids(model_dir: str | Path, model: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (Llama 3 lists several)."""
    ids = set(model.eos_token_ids)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
