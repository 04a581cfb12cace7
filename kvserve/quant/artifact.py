"""Quantised checkpoints in the compressed-tensors layout (what vLLM loads), written and read.

A quantised linear `<prefix>.weight` becomes (compressed-tensors' names and encodings):
- int8 ("int-quantized"): `<prefix>.weight` int8 [out, in], `<prefix>.weight_scale` fp16 [out, groups];
- int4 ("pack-quantized"): `<prefix>.weight_packed` int32 [out, ceil(in / 8)] (code + 8 at bits 4i),
  `<prefix>.weight_scale`, `<prefix>.weight_shape` int64 [2], and with a zero-point
  `<prefix>.weight_zero_point` int32 (zero - 8, packed along the output dimension).
compressed-tensors keeps int4 codes signed in [-8, 7]; kvserve's zero-point codes are 0..15, so both
codes and zero-points shift by 8 on the way out and back. config.json gains `quantization_config`
(`quant_method: compressed-tensors`); docs/quantization.md lists what kvserve can run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvserve.core.errors import ModelLoadError
from kvserve.quant.rtn import QuantizedTensor
from kvserve.quant.scheme import ACT_NONE, TensorScheme

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def pack_int4(codes: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Signed int4 codes [-8, 7] (int8 tensor) -> int32 words, element i at bits 4i (dim 1) or
    packed along dim 0."""
    if dim == 0:
        return pack_int4(codes.t().contiguous()).t().contiguous()
    rows, cols = codes.shape
    padded = math.ceil(cols / 8) * 8
    unsigned = torch.nn.functional.pad(codes.to(torch.int32) + 8, (0, padded - cols))
    unsigned = unsigned.reshape(rows, padded // 8, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (unsigned << shifts).sum(dim=2, dtype=torch.int64).to(torch.int32).contiguous()


def unpack_int4(packed: torch.Tensor, cols: int, dim: int = 1) -> torch.Tensor:
    """The inverse of pack_int4: int32 words -> signed int8 codes with `cols` entries along `dim`."""
    if dim == 0:
        return unpack_int4(packed.t().contiguous(), cols).t().contiguous()
    shifts = torch.arange(8, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def _strategy(scheme: TensorScheme) -> str:
    return {"channel": "channel", "group": "group", "tensor": "tensor"}[scheme.granularity]


def quantization_args(scheme: TensorScheme) -> dict:
    """The compressed-tensors config group for `scheme`."""
    weights = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": not scheme.zero_point,
        "strategy": _strategy(scheme),
        "group_size": scheme.group_size,
        "dynamic": False,
    }
    acts = None
    if scheme.act != ACT_NONE:
        acts = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": scheme.act,  # "token" or "tensor"
            "dynamic": True,
        }
    return {"weights": weights, "input_activations": acts, "output_activations": None}


def artifact_format(scheme: TensorScheme) -> str:
    return "int-quantized" if scheme.bits == 8 else "pack-quantized"


def compressed_tensors(prefix: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    """The checkpoint entries of one quantised linear `<prefix>.weight`."""
    scales = qt.scales if qt.scheme.granularity != "tensor" else qt.scales.reshape(1)
    out = {f"{prefix}.weight_scale": scales.contiguous()}
    if qt.scheme.bits == 8:
        out[f"{prefix}.weight"] = qt.codes.contiguous()
        return out
    signed = qt.codes if qt.zeros is None else (qt.codes.to(torch.int16) - 8).to(torch.int8)
    out[f"{prefix}.weight_packed"] = pack_int4(signed)
    out[f"{prefix}.weight_shape"] = torch.tensor(qt.codes.shape, dtype=torch.int64)
    if qt.zeros is not None:
        zeros = (qt.zeros.float() - 8).to(torch.int8)
        out[f"{prefix}.weight_zero_point"] = pack_int4(zeros, dim=0)
    return out


def scheme_from_config(qconfig: dict, where: str) -> dict[str, TensorScheme]:
    """compressed-tensors `quantization_config` -> {target: TensorScheme}; a clear error for what
    kvserve cannot run."""

    def unsupported(why: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: unsupported quantization_config ({why}); {_RUNS}")

    method = qconfig.get("quant_method")
    if method != "compressed-tensors":
        raise unsupported(f"quant_method {method!r}")
    if qconfig.get("format") not in ("int-quantized", "pack-quantized"):
        raise unsupported(f"format {qconfig.get('format')!r}")
    out: dict[str, TensorScheme] = {}
    for name, group in (qconfig.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        bits, strategy, size = w.get("num_bits"), w.get("strategy"), w.get("group_size")
        if w.get("type") != "int" or bits not in (4, 8):
            raise unsupported(f"{name}: {w.get('type')} {bits}-bit weights")
        if strategy not in ("channel", "group", "tensor"):
            raise unsupported(f"{name}: weight strategy {strategy!r}")
        if strategy == "group" and (not size or size % 32):
            raise unsupported(f"{name}: group_size {size} (kvserve needs a multiple of 32)")
        zero_point = not w.get("symmetric", True)
        if zero_point and bits == 8:
            raise unsupported(f"{name}: asymmetric int8")
        acts = group.get("input_activations")
        act = ACT_NONE
        if acts is not None:
            if not (
                acts.get("dynamic") and acts.get("num_bits") == 8 and acts.get("type") == "int"
            ):
                raise unsupported(f"{name}: static or non-int8 activations")
            if acts.get("strategy") not in ("token", "tensor"):
                raise unsupported(f"{name}: activation strategy {acts.get('strategy')!r}")
            act = acts["strategy"]
        label = f"int{bits}" + (f"-g{size}" if strategy == "group" else "")
        label = "int4-pt" if strategy == "tensor" and bits == 4 else label
        label += "-zp" if zero_point else ""
        if act != ACT_NONE:
            label = "w8a8" if act == "token" else "w8a8-pt"
        scheme = TensorScheme(
            label,
            bits,
            strategy,
            group_size=size if strategy == "group" else None,
            zero_point=zero_point,
            act=act,
        )
        for target in group.get("targets") or []:
            out[target] = scheme
    return out


_RUNS = (
    "kvserve runs compressed-tensors int-quantized / pack-quantized checkpoints: int8 symmetric or "
    "int4 (symmetric or with zero-points), per channel, per tensor or per group of a multiple of "
    "32, with no or dynamic int8 activations, and GPTQ / AWQ int4 checkpoints"
)


def read_quantization_config(model_dir: Path) -> dict | None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("quantization_config")


def decompress_entries(
    checkpoint: dict[str, torch.Tensor], scheme: TensorScheme, prefix: str
) -> QuantizedTensor:
    """The QuantizedTensor stored under `prefix` (inverse of `compressed_tensors`)."""
    scales = checkpoint[f"{prefix}.weight_scale"].half()
    if scheme.bits == 8:
        codes = checkpoint[f"{prefix}.weight"]
        zeros = None
    else:
        num_rows, num_cols = (int(v) for v in checkpoint[f"{prefix}.weight_shape"].tolist())
        codes = unpack_int4(checkpoint[f"{prefix}.weight_packed"], num_cols)
        zeros = None
        if scheme.zero_point:
            packed_zeros = checkpoint[f"{prefix}.weight_zero_point"]
            zeros = (unpack_int4(packed_zeros, num_rows, dim=0).float() + 8).half()
            codes = (codes.to(torch.int16) + 8).to(torch.int8)
    if scheme.granularity == "tensor":
        scales = scales.reshape(1, 1)
    elif scales.dim() == 1:
        scales = scales.unsqueeze(1)
    return QuantizedTensor(scheme, codes.contiguous(), scales.contiguous(), zeros)


def quantized_prefixes(checkpoint: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.rsplit(".", 1)[0] for k in checkpoint if k.endswith(".weight_scale"))


def target_scheme(prefix: str, targets: dict[str, TensorScheme]) -> TensorScheme:
    """Which config group covers `prefix`: "Linear" covers every linear, "re:<regex>" by name."""
    import re

    for target, scheme in targets.items():
        if target.startswith("re:") and re.match(target[3:], prefix):
            return scheme
    for target, scheme in targets.items():
        if target == "Linear" or target == prefix:
            return scheme
    raise ModelLoadError(f"quantised tensor {prefix} is not covered by any config group")
