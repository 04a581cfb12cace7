"""`kvserve quantize`: a float checkpoint -> a compressed-tensors checkpoint, its report and its hash.

Also the loader's half: the QuantizedTensors of a written (or compressed-tensors) checkpoint, keyed by
kvserve's fused module names.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.core.errors import ModelLoadError
from kvserve.quant.artifact import (
    artifact_format,
    compressed_tensors,
    decompress_entries,
    quantization_args,
    quantized_prefixes,
    read_quantization_config,
    scheme_from_config,
    target_scheme,
)
from kvserve.quant.hf_checkpoints import hf_quantized_tensors
from kvserve.quant.provenance import HF_METHODS, artifact_sha256
from kvserve.quant.rtn import QuantizedTensor, quantize
from kvserve.quant.scheme import QuantizationError, TensorScheme, WeightScheme

REPORT_NAME = "quantization_report.json"
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)
_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_class(name: str) -> str | None:
    """ "linear" for a block projection's weight, "head" for an untied LM head, else None."""
    if name == "lm_head.weight":
        return "head"
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in _LINEAR_NAMES:
        return "linear"
    return None


def write_artifact(
    model_dir: str | Path,
    out_dir: str | Path,
    scheme: WeightScheme,
    method: str,
    quantized: dict[str, QuantizedTensor],
    checkpoint: dict[str, torch.Tensor],
    extra_report: dict | None = None,
) -> dict:
    """Write `out_dir`: float tensors as they were, `quantized` (HF weight name -> codes) in the
    compressed-tensors layout, config.json with quantization_config, tokenizer files, the report."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    report_tensors = {}
    for name, tensor in checkpoint.items():
        if name not in quantized:
            tensors[name] = tensor.contiguous()
            continue
        qt = quantized[name]
        tensors.update(compressed_tensors(name[: -len(".weight")], qt))
        err = ((qt.dequantize() - tensor.float()).norm() / tensor.float().norm()).item()
        report_tensors[name] = {"scheme": qt.scheme.name, "relative_error": err}
    config = json.loads((model_dir / "config.json").read_text())
    # before anything is written (a refused scheme leaves --out untouched)
    config["quantization_config"] = build_quantization_config(scheme, method)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
    bits = sum(qt.num_bits for qt in quantized.values())
    count = sum(qt.codes.numel() for qt in quantized.values())
    report = {
        "source": str(model_dir),
        "scheme": scheme.name,
        "method": method,
        "num_quantized_tensors": len(quantized),
        "quantized_bits_per_weight": bits / count if count else None,
        "tensors": report_tensors,
        "artifact_sha256": artifact_sha256(out_dir),
        "created_unix_s": int(time.time()),
        **(extra_report or {}),
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_quantization_config(scheme: WeightScheme, method: str) -> dict:
    groups, formats = {}, set()
    linear, head = scheme.for_class("linear"), scheme.for_class("head")
    ignore = [] if head is not None else ["lm_head"]
    if linear is not None:
        groups["group_0"] = {"targets": ["Linear"], **quantization_args(linear)}
        formats.add(artifact_format(linear))
    if head is not None:
        groups["group_1"] = {"targets": ["re:lm_head$"], **quantization_args(head)}
        formats.add(artifact_format(head))
    if len(formats) > 1:
        raise QuantizationError(
            f"{scheme.name}: one artifact holds one compressed-tensors format; mixing int8 and "
            "int4 classes is a load-time option (--quantization) only"
        )
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop(),
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "kvserve": {"scheme": scheme.name, "method": method},
    }


def check_artifact_scheme(scheme: WeightScheme) -> None:
    if scheme.for_class("embed") is not None:
        raise QuantizationError(
            f"{scheme.name}: compressed-tensors checkpoints keep the embedding table in float; "
            "quantise embed at load time (--quantization) instead"
        )
    if scheme.runs_bf16:
        raise QuantizationError(
            f"{scheme.name}: bf16 products are a load-time format (--quantization); an artifact "
            "stores integer codes"
        )
    if not scheme.is_quantized:
        raise QuantizationError(f"{scheme.name}: nothing to quantise")


def quantized_formats(
    checkpoint: dict[str, torch.Tensor], scheme: WeightScheme, whole_groups: bool = True
) -> dict[str, TensorScheme]:
    """HF weight name -> its format, for the tensors `scheme` quantises. compressed-tensors (and
    vLLM) need whole groups: for an artifact (`whole_groups`) a row length that is not a multiple
    of the group size is an error; quantised at load, its row ends with a short group."""
    out = {}
    for name, tensor in checkpoint.items():
        cls = tensor_class(name)
        fmt = scheme.for_class(cls) if cls else None
        if fmt is None:
            continue
        if whole_groups and fmt.granularity == "group" and tensor.shape[1] % fmt.group_size:
            raise QuantizationError(
                f"{name} has {tensor.shape[1]} inputs, not a multiple of {fmt.name}'s group of "
                f"{fmt.group_size}: compressed-tensors cannot store a short group. Use a group "
                "that divides it (e.g. int4-g32) or --quantization at load, which can"
            )
        out[name] = fmt
    return out


def rtn_quantize(
    checkpoint: dict[str, torch.Tensor], scheme: WeightScheme
) -> dict[str, QuantizedTensor]:
    from kvserve.progress import progress

    formats = quantized_formats(checkpoint, scheme)
    items = progress(formats.items(), len(formats), "quantising")
    return {name: quantize(checkpoint[name], fmt) for name, fmt in items}


# ---- loading ------------------------------------------------------------------------------------------


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack quantised matrices along the output dimension (q, k, v -> qkv): rows quantise alone."""
    first = parts[0]
    if any(p.scheme != first.scheme for p in parts):
        raise ModelLoadError("fused projections must share one quantisation scheme")
    if first.scheme.granularity == "tensor" and len(parts) > 1:
        # one scale per tensor cannot be shared after fusing: give every row its tensor's scale
        scheme = TensorScheme(
            first.scheme.name,
            first.scheme.bits,
            "channel",
            zero_point=first.scheme.zero_point,
            act=first.scheme.act,
        )
        parts = [
            QuantizedTensor(
                scheme,
                p.codes,
                p.scales.expand(p.codes.shape[0], 1),
                None if p.zeros is None else p.zeros.expand(p.codes.shape[0], 1),
            )
            for p in parts
        ]
        first = parts[0]
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedTensor(
        first.scheme,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
    )


def artifact_tensors(
    model_dir: Path, checkpoint: dict[str, torch.Tensor]
) -> dict[str, QuantizedTensor] | None:
    """For a compressed-tensors, GPTQ or AWQ checkpoint: {HF weight name: QuantizedTensor}, with the
    compressed entries removed from `checkpoint` (nothing is dequantised here: the loader builds
    the integer linears from the codes). None for a float checkpoint."""
    qconfig = read_quantization_config(model_dir)
    if qconfig is None:
        return None
    if qconfig.get("quant_method") in HF_METHODS:
        return hf_quantized_tensors(qconfig, checkpoint, str(model_dir))
    targets = scheme_from_config(qconfig, str(model_dir))
    out = {}
    for prefix in quantized_prefixes(checkpoint):
        scheme = target_scheme(prefix, targets)
        qt = decompress_entries(checkpoint, scheme, prefix)
        for suffix in (
            "weight",
            "weight_packed",
            "weight_scale",
            "weight_zero_point",
            "weight_shape",
        ):
            checkpoint.pop(f"{prefix}.{suffix}", None)
        out[f"{prefix}.weight"] = qt
    return out
