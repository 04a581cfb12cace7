"""Model shapes for planning: the few numbers of a decoder's config that fix its parameters, FLOPs
and bytes.

`ModelSpec` is read from a Hugging Face `config.json` (or the directory holding one) or taken from
the built-in presets of published configurations. No weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PlanError(ValueError):
    """Bad planner input (unknown preset, malformed config, impossible option); says what to fix."""


@dataclass(frozen=True)
class TensorShape:
    """One weight tensor, repeated `count` times. 1-D tensors have `num_rows == 1`.

    `category` decides its storage format: "linear" (matmuls inside the blocks), "embed" (the input
    table; the head too when tied), "head" (an untied output projection), "norm" (1-D: norm weights
    and biases).
    """

    name: str
    category: str
    num_rows: int  # output features of a matmul; 1 for a vector
    num_cols: int  # input features (quantisation groups run along this axis)
    count: int = 1

    @property
    def num_params(self) -> int:
        return self.num_rows * self.num_cols * self.count


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer with SwiGLU MLPs and RMSNorm (Llama, Mistral, Qwen2/3, SmolLM2)."""

    name: str
    hidden_size: int  # d
    num_layers: int  # L
    num_heads: int  # n_q
    num_kv_heads: int  # n_kv
    head_dim: int  # d_h
    intermediate_size: int  # f
    vocab_size: int  # V
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Documented extras beyond docs/planning.md's formula (0 / False for Llama):
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    o_bias: bool = False  # Llama `attention_bias=True` also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (2 d_h weights per layer)
    # per layer, the keys a query sees (None: all); () when every layer attends to the whole context
    layer_windows: tuple[int | None, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for field in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, field) <= 0:
                raise PlanError(
                    f"{self.name}: {field} must be positive, got {getattr(self, field)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"{self.name}: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_dim(self) -> int:
        """n_q d_h: the attention width (docs/planning.md's d in the attention terms)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tensors(self) -> tuple[TensorShape, ...]:
        """Every weight tensor, grouped by shape. Sums to `num_params`."""
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        out = [
            TensorShape("q_proj", "linear", self.q_dim, d, L),
            TensorShape("k_proj", "linear", self.kv_dim, d, L),
            TensorShape("v_proj", "linear", self.kv_dim, d, L),
            TensorShape("o_proj", "linear", d, self.q_dim, L),
            TensorShape("gate_proj", "linear", f, d, L),
            TensorShape("up_proj", "linear", f, d, L),
            TensorShape("down_proj", "linear", d, f, L),
            TensorShape("layer_norms", "norm", 1, d, 2 * L),
            TensorShape("final_norm", "norm", 1, d, 1),
            TensorShape("embed_tokens", "embed", self.vocab_size, d, 1),
        ]
        if not self.tie_word_embeddings:
            out.append(TensorShape("lm_head", "head", self.vocab_size, d, 1))
        if self.qkv_bias:
            out.append(TensorShape("qkv_bias", "norm", 1, self.q_dim + 2 * self.kv_dim, L))
        if self.o_bias:
            out.append(TensorShape("o_bias", "norm", 1, d, L))
        if self.mlp_bias:
            out.append(TensorShape("mlp_bias", "norm", 1, 2 * f + d, L))
        if self.qk_norm:
            out.append(TensorShape("qk_norm", "norm", 1, 2 * self.head_dim, L))
        return tuple(out)

    @property
    def num_params(self) -> int:
        """N (docs/planning.md): per block 2 d n_q d_h + 2 d n_kv d_h + 3 d f + 2 d, final norm d, V d
        embedding, V d more for an untied head; plus the documented bias / qk-norm extras."""
        return sum(t.num_params for t in self.tensors())

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_matmul_params(self) -> int:
        """N_matmul: N minus the input embedding table when untied (a lookup is not a matmul)."""
        return self.num_params - (0 if self.tie_word_embeddings else self.num_embedding_params)


def from_hf_config(config: dict[str, Any], name: str = "") -> ModelSpec:
    """Build a ModelSpec from the keys of a Hugging Face config.json."""
    name = name or config.get("_name_or_path") or config.get("model_type", "model")
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        inter = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise PlanError(
            f"{name}: config.json lacks {exc.args[0]!r}; kvserve plan needs hidden_size, "
            "num_hidden_layers, num_attention_heads, intermediate_size, vocab_size"
        ) from exc
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    model_type = str(config.get("model_type", ""))
    attention_bias = bool(config.get("attention_bias", False))
    return ModelSpec(
        layer_windows=_layer_windows(config),
        name=str(name),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate_size=inter,
        vocab_size=vocab,
        # transformers' Llama/Mistral/Qwen2 configs default to untied when the key is absent.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        source=f"config.json ({model_type or 'unknown model_type'})",
    )


def _layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Per-layer sliding windows as the engine reads them (kvserve.config.ModelConfig), or () when
    every layer is global or the config does not parse there."""
    from kvserve.config import ModelConfig

    try:
        windows = ModelConfig.from_dict(config).layer_windows
    except Exception:  # noqa: BLE001 - the planner also takes configs the engine does not serve
        return ()
    return windows if any(w is not None for w in windows) else ()


def _preset(
    name: str,
    d: int,
    L: int,
    nq: int,
    nkv: int,
    f: int,
    V: int,
    tied: bool,
    ctx: int,
    source: str,
    **extra: Any,
) -> ModelSpec:
    return ModelSpec(name, d, L, nq, nkv, d // nq, f, V, tied, ctx, source=source, **extra)


# Published config.json values of each model's Hugging Face repository.
PRESETS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in (
        _preset(
            "Llama-2-7B", 4096, 32, 32, 32, 11008, 32000, False, 4096, "meta-llama/Llama-2-7b-hf"
        ),
        _preset(
            "Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, 131072, "meta-llama/Llama-3.1-8B"
        ),
        _preset(
            "Llama-3.1-70B",
            8192,
            80,
            64,
            8,
            28672,
            128256,
            False,
            131072,
            "meta-llama/Llama-3.1-70B",
        ),
        _preset(
            "Mistral-7B-v0.1",
            4096,
            32,
            32,
            8,
            14336,
            32000,
            False,
            32768,
            "mistralai/Mistral-7B-v0.1",
        ),
        _preset(
            "Qwen2.5-7B",
            3584,
            28,
            28,
            4,
            18944,
            152064,
            False,
            131072,
            "Qwen/Qwen2.5-7B",
            qkv_bias=True,
        ),
        _preset(
            "Qwen2.5-0.5B-Instruct",
            896,
            24,
            14,
            2,
            4864,
            151936,
            True,
            32768,
            "Qwen/Qwen2.5-0.5B-Instruct",
            qkv_bias=True,
        ),
        _preset(
            "SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, "HuggingFaceTB/SmolLM2-135M"
        ),
        _preset(
            "SmolLM2-360M", 960, 32, 15, 5, 2560, 49152, True, 8192, "HuggingFaceTB/SmolLM2-360M"
        ),
    )
}


def _normalise(name: str) -> str:
    name = name.strip().lower().rsplit("/", 1)[-1]
    return name.removesuffix("-hf")


_ALIASES = {
    "mistral-7b": "mistral-7b-v0.1",
    "qwen2.5-0.5b": "qwen2.5-0.5b-instruct",
    "llama-3.1-8b-instruct": "llama-3.1-8b",
    "llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "smollm2-135m-instruct": "smollm2-135m",
    "smollm2-360m-instruct": "smollm2-360m",
    "llama-2-7b-chat": "llama-2-7b",
}


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (any case, `org/` prefix allowed), a HF model directory, or a config.json."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"{name_or_path}: directory has no config.json")
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON ({exc})") from exc
        label = path.parent.name if path.name == "config.json" else path.stem
        return from_hf_config(config, name=label)
    key = _normalise(name_or_path)
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    names = ", ".join(m.name for m in PRESETS.values())
    raise PlanError(
        f"{name_or_path!r} is neither a path to a config.json / model directory nor a preset "
        f"({names})"
    )
