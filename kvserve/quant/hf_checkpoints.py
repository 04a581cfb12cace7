"""Pre-quantised GPTQ and AWQ Hugging Face checkpoints (what vLLM users bring), read into kvserve's
int4 codes (docs/quantization.md, "GPTQ and AWQ checkpoints").

GPTQ (AutoGPTQ / GPTQModel; config `quant_method: gptq`), per linear `<prefix>`:
- `qweight` int32 [in / 8, out]: input row 8w + j at bits 4j of word w (packed along the input);
- `qzeros` int32 [groups, out / 8]: output column 8w + j at bits 4j; the `gptq` (v1) checkpoint
  format stores zero - 1, `gptq_v2` the zero itself;
- `scales` fp16 [groups, out]; `g_idx` int32 [in], the group of each input row.
W[o, i] = scales[g, o] * (q[i, o] - z[g, o]) with g = g_idx[i].

AWQ (AutoAWQ GEMM; `quant_method: awq`, `version: gemm`):
- `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8]: packed along the output, the
  value at bits 4j of word w is column 8w + AWQ_ORDER[j]; `scales` fp16 [groups, out].
W[o, i] = scales[g, o] * (q[i, o] - z[g, o]) with g = i // group_size.

Both become a zero-point `QuantizedTensor` (codes 0..15, fp16 scales and zero-points per group),
or a symmetric one when every zero-point is 8 (GPTQ's `sym: true`), so the integer kernels run them
exactly as they run kvserve's own int4-gN(-zp) formats.
"""

from __future__ import annotations

import torch

from kvserve.core.errors import ModelLoadError
from kvserve.quant.rtn import QuantizedTensor
from kvserve.quant.scheme import KERNEL_BLOCK, TensorScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's column order within a packed word
QUANT_ENTRIES = ("qweight", "qzeros", "scales", "g_idx")
RUNS = (
    "kvserve runs GPTQ (checkpoint_format gptq or gptq_v2, 4-bit, no act-order permutation) and "
    "AWQ (version gemm, 4-bit, zero-point) checkpoints with groups of a multiple of 32 or per channel"
)
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, words] -> int8 [rows, words * 8]: the nibble at bits 4j of word w at 8w + j."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).reshape(packed.shape[0], -1).to(torch.int8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's packed [rows, out / 8] -> codes [rows, out] in column order."""
    raw = _nibbles(packed).reshape(packed.shape[0], -1, 8)  # [rows, words, slot]
    out = torch.empty_like(raw)
    out[:, :, list(AWQ_ORDER)] = raw  # slot j holds column AWQ_ORDER[j]
    return out.reshape(packed.shape[0], -1)


class _Config:
    """The quantization_config fields that decide the layout, checked once."""

    def __init__(self, qconfig: dict, where: str) -> None:
        self.where = where
        self.method = qconfig.get("quant_method")
        self.bits = qconfig.get("bits", qconfig.get("w_bit"))
        self.group_size = qconfig.get("group_size", qconfig.get("q_group_size"))
        if self.bits != 4:
            raise self.unsupported(f"{self.bits}-bit weights")
        if not isinstance(self.group_size, int) or not (
            self.group_size == -1 or (self.group_size > 0 and self.group_size % KERNEL_BLOCK == 0)
        ):
            raise self.unsupported(f"group_size {self.group_size} (a multiple of 32, or -1)")
        if self.method == "gptq":
            self.v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
            self.desc_act = bool(qconfig.get("desc_act", False))
            if qconfig.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
                raise self.unsupported(f"checkpoint_format {qconfig.get('checkpoint_format')!r}")
        else:
            version = str(qconfig.get("version", "gemm")).lower()
            if version != "gemm":
                raise self.unsupported(f"AWQ version {version!r} (only gemm's layout)")
            if not qconfig.get("zero_point", True):
                raise self.unsupported("AWQ without zero-points")

    def unsupported(self, why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self.where}: unsupported {self.method} quantization_config ({why}); {RUNS}"
        )


def _to_quantized(
    codes_in_out: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> QuantizedTensor:
    """codes [in, out] 0..15, zeros and scales [groups, out] -> a QuantizedTensor [out, in]."""
    num_cols = codes_in_out.shape[0]
    per_channel = group_size == -1 or group_size >= num_cols
    codes = codes_in_out.t().contiguous()
    zeros_t = zeros.t().to(torch.float16).contiguous()
    scales_t = scales.t().to(torch.float16).contiguous()
    symmetric = bool((zeros == 8).all())
    if per_channel:
        scheme = TensorScheme("int4" if symmetric else "int4-zp", 4, zero_point=not symmetric)
    else:
        name = f"int4-g{group_size}" + ("" if symmetric else "-zp")
        scheme = TensorScheme(name, 4, "group", group_size=group_size, zero_point=not symmetric)
    if symmetric:
        return QuantizedTensor(scheme, (codes.to(torch.int16) - 8).to(torch.int8), scales_t, None)
    return QuantizedTensor(scheme, codes, scales_t, zeros_t)


def _read_gptq(cfg: _Config, entries: dict[str, torch.Tensor], prefix: str) -> QuantizedTensor:
    qweight, qzeros, scales = entries["qweight"], entries["qzeros"], entries["scales"]
    num_cols, num_rows = qweight.shape[0] * 8, qweight.shape[1]
    codes = _nibbles(qweight.t().contiguous()).t()  # [in, out]
    zeros = _nibbles(qzeros)[:, :num_rows].to(torch.int16)  # [groups, out] (a padded last word)
    if cfg.v1:
        # v1 stores zero - 1 (AutoGPTQ's convention); a stored 15 is a zero of 16, as AutoGPTQ,
        # exllama and vLLM compute it (zeros are fp16 here, so 16 is exact)
        zeros = zeros + 1
    group_size = cfg.group_size if cfg.group_size != -1 else num_cols
    g_idx = entries.get("g_idx")
    if g_idx is None and cfg.desc_act:
        raise cfg.unsupported(f"{prefix}: desc_act without a g_idx to say each input's group")
    if g_idx is not None:
        if tuple(g_idx.shape) != (num_cols,):
            raise ModelLoadError(
                f"{cfg.where}: {prefix}.g_idx has shape {tuple(g_idx.shape)}, expected ({num_cols},)"
            )
        contiguous = torch.arange(num_cols, dtype=torch.int64) // group_size
        if not torch.equal(g_idx.to(torch.int64), contiguous):
            raise cfg.unsupported(
                f"{prefix}: act-order (desc_act) g_idx permutes the input channels; kvserve's "
                "kernels need contiguous groups"
            )
    return _to_quantized(codes, zeros, scales, cfg.group_size)


def _read_awq(cfg: _Config, entries: dict[str, torch.Tensor], prefix: str) -> QuantizedTensor:
    codes = _awq_columns(entries["qweight"])  # [in, out]
    zeros = _awq_columns(entries["qzeros"])[:, : codes.shape[1]].to(torch.int16)
    return _to_quantized(codes, zeros, entries["scales"], cfg.group_size)


def _check_shapes(cfg: _Config, entries: dict[str, torch.Tensor], prefix: str) -> None:
    """qweight, qzeros and scales must describe one [in, out] weight in groups of group_size."""
    missing = [n for n in ("qzeros", "scales") if n not in entries]
    if missing:
        raise ModelLoadError(f"{cfg.where}: {prefix} has a qweight but no {', '.join(missing)}")
    qweight = entries["qweight"]
    if cfg.method == "gptq":
        num_cols, num_rows = qweight.shape[0] * 8, qweight.shape[1]
    else:
        num_cols, num_rows = qweight.shape[0], qweight.shape[1] * 8
    group_len = num_cols if cfg.group_size == -1 else cfg.group_size
    num_groups = -(-num_cols // group_len)
    expected = {"scales": (num_groups, num_rows), "qzeros": (num_groups, -(-num_rows // 8))}
    for name, shape in expected.items():
        if tuple(entries[name].shape) != shape:
            raise ModelLoadError(
                f"{cfg.where}: {prefix}.{name} has shape {tuple(entries[name].shape)}, expected "
                f"{shape} for a [{num_cols} in, {num_rows} out] weight in groups of {group_len}"
            )


def hf_quantized_tensors(
    qconfig: dict, checkpoint: dict[str, torch.Tensor], where: str
) -> dict[str, QuantizedTensor]:
    """{`<prefix>.weight`: QuantizedTensor} of a GPTQ or AWQ checkpoint; each linear's packed entries
    are removed from `checkpoint` (nothing is dequantised: the loader builds the integer linears)."""
    cfg = _Config(qconfig, where)
    read = _read_gptq if cfg.method == "gptq" else _read_awq
    out: dict[str, QuantizedTensor] = {}
    prefixes = sorted(k[: -len(".qweight")] for k in checkpoint if k.endswith(".qweight"))
    for prefix in prefixes:
        entries = {
            n: checkpoint.pop(f"{prefix}.{n}")
            for n in QUANT_ENTRIES
            if f"{prefix}.{n}" in checkpoint
        }
        _check_shapes(cfg, entries, prefix)
        qt = read(cfg, entries, prefix)
        out[f"{prefix}.weight"] = qt
    if not out:
        raise ModelLoadError(
            f"{where}: quantization_config says {cfg.method}, but no tensor is packed"
        )
    return out
