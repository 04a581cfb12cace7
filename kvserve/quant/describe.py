"""One line for the startup banner: the weights' storage format and what the products run in."""

from __future__ import annotations

from pathlib import Path

from kvserve.gguf.source import gguf_matrix_types
from kvserve.quant.methods import DEFAULT_METHOD
from kvserve.quant.scheme import (
    ACT_BLOCK2,
    ACT_NONE,
    ACT_TENSOR,
    ACT_TOKEN,
    GGUF_ACTIVATION_ACTS,
    TensorScheme,
    WeightScheme,
    parse_weight_scheme,
)

_DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_ACTS = {
    ACT_NONE: "int8 per 32-input block (Q8_0)",
    ACT_TOKEN: "int8 per token (W8A8)",
    ACT_TENSOR: "int8 per tensor (W8A8)",
    ACT_BLOCK2: "int8 x 2 per 32-input block (the rounding and its remainder)",
}


def describe_weights(
    dtype: str,
    quantization: WeightScheme | str | None,
    method: str = DEFAULT_METHOD,
    model_dir: str | Path | None = None,
    gguf_activations: str = "fp32",
) -> str:
    """`fp32, activations fp32`, `int8 (rtn), activations int8 per 32-input block (Q8_0), sums
    fp32`, or a quantised checkpoint's format (`int4-g128 (compressed-tensors checkpoint), ...`).
    `dtype` is the compute dtype (what float weights and activations are in); `quantization` the
    scheme the engine parsed once (`EngineConfig.weight_scheme`), or for a direct caller its
    string."""
    compute = _DTYPE_SHORT.get(dtype, dtype)
    linear, origin = None, None
    if quantization is not None:
        scheme = (
            parse_weight_scheme(quantization) if isinstance(quantization, str) else quantization
        )
        linear, origin = scheme.for_class("linear") or scheme.for_class("head"), method
        name = scheme.name
        if linear is None and scheme.bf16_products("linear"):
            return f"{name}, bf16 products, activations and sums {compute}"
    elif model_dir is not None and (types := gguf_matrix_types(model_dir)):
        blocks = ", ".join(f"{n} x {t}" for t, n in sorted(types.items(), key=lambda i: -i[1]))
        act = GGUF_ACTIVATION_ACTS.get(gguf_activations)
        acts = compute if act is None else _ACTS[act] + " where the type allows"
        return f"GGUF blocks as in the file ({blocks}), activations {acts}, sums {compute}"
    elif model_dir is not None:
        found = _checkpoint_scheme(Path(model_dir))
        if found is not None:
            name, linear, origin = found
    if linear is None:
        return f"{compute}, activations {compute}"
    return f"{name} ({origin}), activations {_ACTS.get(linear.act, linear.act)}, sums {compute}"


def _checkpoint_scheme(model_dir: Path) -> tuple[str, TensorScheme | None, str] | None:
    """(format, the linears' scheme if known, origin) of a quantised checkpoint, else None."""
    from kvserve.quant.artifact import read_quantization_config, scheme_from_config

    try:
        qconfig = read_quantization_config(model_dir)
    except (OSError, ValueError):
        return None
    if not isinstance(qconfig, dict):
        return None
    method = str(qconfig.get("quant_method", "quantised"))
    if method != "compressed-tensors":  # GPTQ / AWQ: int4 groups, weight-only
        bits, group = qconfig.get("bits", 4), qconfig.get("group_size")
        name = f"int{bits}" + (f"-g{group}" if group else "")
        return name, TensorScheme(name, int(bits)), f"{method} checkpoint"
    try:
        schemes = scheme_from_config(qconfig, str(model_dir))
    except Exception:  # noqa: BLE001 - the loader reports it; the banner only describes
        return None
    first = next(iter(schemes.values()), None)
    return (first.name if first else "quantised"), first, "compressed-tensors checkpoint"
