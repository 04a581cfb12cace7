"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3), over a flat batch of tokens and a
paged cache.

Architectures differ by a few flags (`ArchSpec`, registered in model/registry.py) and by what their
config.json says (activation, attention scale, per-layer sliding windows and RoPE, softcapping). q/k/v and gate/up are
fused into one matmul each; the loader concatenates the checkpoint's separate tensors. The residual stream
is carried beside the hidden state so the add fuses into the next norm (vLLM's layout).

On CPU with fp32 weights (`use_cpu_weights`) the small ops between the linears run as fused C kernels
(model/cpu_kernels.py): add + RMSNorm, RoPE in place on the q/k/v projection, the KV write, SiLU-and-multiply.
Elsewhere they are torch ops with the same arithmetic.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import LAYER_TYPES, ModelConfig
from kvserve.core.errors import UnsupportedModelError
from kvserve.model import cpu_kernels, fused_decode
from kvserve.model.attention import AttentionBackend, AttentionMetadata, cpu_attention
from kvserve.model.kv_cache import LayerKVCache
from kvserve.model.linear import PanelEmbedding, cpu_linear, use_cpu_linears
from kvserve.model.registry import ArchSpec
from kvserve.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_kernels = False  # set by DecoderLM.use_cpu_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as Hugging Face: normalise in fp32, cast back, then scale.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, dim] -> (norm(x + residual), x + residual); residual None: x alone."""
        if self.cpu_kernels:
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1, and normalising and scaling both run in fp32
    before the cast back (transformers' Gemma3RMSNorm, op for op). With the C kernels (fp32 on
    CPU), the C RMSNorm scaled by 1 + w (csrc/layer_ops.c add_rms_norm: the same operations, the
    sum of squares in its own order, so within an ulp or two of torch's; per row, so a row's bits do
    not depend on the step's other rows). In torch each norm is ~6 dispatched ops, ~70 us at one
    row on a Zen 3: Gemma 3 runs 6 a layer (q and k norms included), ~7 ms of a decode step."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.cpu_kernels = False  # set by DecoderLM.use_cpu_kernels
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_kernel(x):
            return self.add_norm(x, None)[0]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return self.cpu_kernels and x.dtype == torch.float32 and x.device.type == "cpu"

    def _offset_weight(self) -> torch.Tensor:
        """1 + w in fp32, as the torch path computes it; recomputed when the weight changes."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, (1.0 + self.weight.detach().float()).contiguous())
        return self._scale[1]

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `RMSNorm.add_norm`; x may have leading dimensions (the q and k norms: [T, heads, D])."""
        if self._on_kernel(x):
            shape, dim = x.shape, x.shape[-1]
            res = None if residual is None else residual.reshape(-1, dim)
            normed, summed = cpu_kernels.add_rms_norm(
                x.reshape(-1, dim), res, self._offset_weight(), self.eps
            )
            return normed.view(shape), (x if residual is None else summed.view(shape))
        if residual is not None:
            x = x + residual
        return self(x), x


def norm_class(arch: ArchSpec) -> type[nn.Module]:
    return OffsetRMSNorm if arch.offset_norms else RMSNorm


# config.json's hidden_act / hidden_activation -> the gated MLP's activation
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, arch: ArchSpec, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.window = window  # keys each query sees (itself and the window - 1 before), None: all
        qkv_bias = arch.qkv_bias or config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        norm = norm_class(arch)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.cpu_kernels = False  # set by DecoderLM.use_cpu_weights

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, head_dim / 2]
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 kv_size]
        fused = self.cpu_kernels and self.q_norm is None  # RoPE and the KV write in C, in place
        if fused:
            cpu_kernels.rotary_(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, rope)
        if fused and not kv_cache.quantised:
            cpu_kernels.write_kv(k, v, meta.slot_mapping, kv_cache.k, kv_cache.v)
        elif fused:  # 8-bit: the fused step's writer (kv_cache.quantise's bits)
            cpu_kernels.write_kv_q(k, v, meta.slot_mapping, kv_cache)
        else:
            kv_cache.write(k, v, meta.slot_mapping)
        out = backend(q, kv_cache, meta, self.scale, self.window)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        if config.hidden_activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {config.hidden_activation!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        self.act = ACTIVATIONS[config.hidden_activation]
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.cpu_kernels = False  # set by DecoderLM.use_cpu_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 intermediate_size]
        if self.cpu_kernels and self.act is F.silu:
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, arch: ArchSpec, window: int | None = None, local_rope=False
    ) -> None:
        super().__init__()
        self.local_rope = local_rope  # RoPE of the sliding-window layers (DecoderLM.rotary_local)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, arch, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, hidden, residual, rope, kv_cache, meta, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden_size] -> this layer's MLP output and the residual before it;
        the stream after the layer is their sum (added by the next norm)."""
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(hidden), residual


class SandwichDecoderLayer(nn.Module):
    """Gemma's layer: a norm before and after attention and before and after the MLP; each block's
    normed output joins the residual stream (carried as in `DecoderLayer`)."""

    def __init__(
        self, config: ModelConfig, arch: ArchSpec, window: int | None = None, local_rope=False
    ) -> None:
        super().__init__()
        norm = norm_class(arch)
        self.local_rope = local_rope
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, arch, window)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden, residual, rope, kv_cache, meta, backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.post_attention_layernorm(
            self.self_attn(hidden, rope, kv_cache, meta, backend)
        )
        hidden, residual = self.pre_feedforward_layernorm.add_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def _check_supported(config: ModelConfig, arch: ArchSpec) -> None:
    missing = [key for key in arch.required_config if getattr(config, key) in (None, ())]
    if missing:
        raise UnsupportedModelError(
            f"{config.model_type}: config.json gives no {', '.join(missing)}, which kvserve reads "
            "rather than assumes (layer_types may come as sliding_window_pattern, rope_local_theta "
            "as rope_local_base_freq or rope_parameters.sliding_attention.rope_theta)"
        )
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:  # (ModelConfig keeps them: the planner may still size such a model)
        raise UnsupportedModelError(
            f"{config.model_type}: layer_types {unknown} are not supported (kvserve runs "
            f"{', '.join(LAYER_TYPES)})"
        )
    if config.attn_logit_softcapping is not None:
        raise UnsupportedModelError(
            f"{config.model_type}: attn_logit_softcapping={config.attn_logit_softcapping} is not "
            "supported by kvserve's attention kernels"
        )


class DecoderLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` applies the head to chosen rows only."""

    def __init__(self, config: ModelConfig, arch: ArchSpec, max_positions: int) -> None:
        super().__init__()
        _check_supported(config, arch)
        self.config = config
        self.arch = arch
        self.rotary = RotaryEmbedding(config, max_positions)
        self.rotary_local: RotaryEmbedding | None = None  # sliding layers' own RoPE, if any
        if config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(config, max_positions, local=True)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_cls = SandwichDecoderLayer if arch.sandwich_norms else DecoderLayer
        layer_types = config.layer_types or ("full_attention",) * config.num_layers
        self.layers = nn.ModuleList(
            layer_cls(config, arch, window, kind == "sliding_attention")
            for window, kind in zip(config.layer_windows, layer_types, strict=True)
        )
        self.norm = norm_class(arch)(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cpu_head: nn.Module | None = None  # set by use_cpu_weights
        # model/fused_decode.py: built at the first decode step it can run (None: not built yet)
        self.fused_decode = False  # set by use_cpu_kernels
        self.fused: fused_decode.FusedDecoder | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata | list[AttentionMetadata],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """`meta`: the step's attention metadata, or one per layer (a hybrid KV layout's layers read
        their own group's block tables, kv/groups.py)."""
        if isinstance(meta, list):
            metas, fused = meta, None
        else:
            metas = [meta] * len(self.layers)
            fused = self._fused_for(input_ids.shape[0], kv_caches, meta, backend)
        if fused is not None:
            # the whole step in one native call (decode rows only), the lookups included
            single = meta.single
            return fused(
                input_ids,
                positions,
                self.embed_tokens,
                meta.slot_mapping,
                single.block_table,
                single.context_lens,
            )
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        if self.arch.embed_scale:
            # as transformers: sqrt(hidden) rounded to fp32, then to the model's dtype
            scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32)
            hidden = hidden * scale.to(hidden.dtype)
        residual = None
        rope = self.rotary(positions)
        local_rope = rope if self.rotary_local is None else self.rotary_local(positions)
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
            layer_rope = local_rope if layer.local_rope else rope
            hidden, residual = layer(hidden, residual, layer_rope, kv_cache, layer_meta, backend)
        return self.norm.add_norm(hidden, residual)[0]

    def use_cpu_kernels(self, enabled: bool) -> None:
        """Run the small ops between the linears as fused C kernels (fp32 on CPU, when they build),
        and decode steps of a few rows as one native call (model/fused_decode.py)."""
        enabled = enabled and cpu_kernels.kernel_available()
        for module in self.modules():
            if isinstance(module, (RMSNorm, OffsetRMSNorm, Attention, MLP)):
                module.cpu_kernels = enabled
        self.fused_decode, self.fused = enabled, None

    def _fused_for(self, num_tokens, kv_caches, meta, backend) -> fused_decode.FusedDecoder | None:
        """The fused decoder when this step can run on it: decode rows only, few enough, with the
        in-place CPU attention, and a model whose every part has a native path."""
        if not (self.fused_decode and backend is cpu_attention and meta.single is not None):
            return None
        if meta.multi or num_tokens > fused_decode.max_step_rows():
            return None
        if self.fused is None or not self.fused.matches(kv_caches):
            self.fused = fused_decode.FusedDecoder.build(self, kv_caches)
            if self.fused is None:  # some part has no native path: never try again
                self.fused_decode = False
        if self.fused is not None and num_tokens > self.fused.max_rows():
            return None  # more rows than the step was capped at (set_f32_max_rows)
        return self.fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden_size] -> [S, vocab_size], fp32 for the sampler
        if self.cpu_head is not None:
            logits = self.cpu_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def build_rotary(self, device: torch.device | str) -> None:
        """(Re)compute the RoPE tables on `device` (after loading a model built on the meta device)."""
        self.rotary.build(device)
        if self.rotary_local is not None:
            self.rotary_local.build(device)

    def use_cpu_weights(self) -> None:
        """CPU layout (model/linear.py): every projection, and the head, run from a weight laid out for
        the CPU kernel. A tied fp32 head's panels also serve the embedding lookup (`PanelEmbedding`), so
        the table is freed; otherwise a tied head keeps its own copy beside the table it shares."""
        use_cpu_linears(self.layers)
        # the norms are never quantised: their dtype is the model's activation dtype
        self.use_cpu_kernels(self.norm.weight.dtype == torch.float32)
        if self.cpu_head is None:  # a quantised head (model/linear.py) is already there
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.cpu_head = cpu_linear(weight)
            panels = getattr(self.cpu_head, "panels", None)
            if (
                self.lm_head is None
                and panels is not None
                and type(self.embed_tokens) is nn.Embedding
            ):
                # tied: look rows up in the head's panels and free the table (one copy fewer)
                self.embed_tokens = PanelEmbedding(panels, self.config.vocab_size)
        self.lm_head = None  # an untied head lives on only as cpu_head
