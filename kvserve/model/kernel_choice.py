"""Which native kernels run here: the C library's panel GEMVs (model/csrc, model/fused_decode.py)
where it builds, else the quantised GEMM extension (quant/csrc/qgemm.cpp, quant/kernels.py).
The engine core reports the choice (`EngineInfo.kernel_isa`, `bf16_products`) and /manifest shows
it; the API process never loads either library (docs/design.md)."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.model import fused_decode
from kvserve.quant.kernels import kernel_isa, set_extension_max_isa
from kvserve.quant.scheme import WeightScheme


def served_kernel_isa() -> str:
    """The instruction set quantised linears run on: the native panel GEMV's (model/csrc/qgemv.c)
    where the C library builds, else the extension's ("unavailable": a dequantised stand-in)."""
    return fused_decode.isa() if fused_decode.max_rows() else kernel_isa()


def bf16_products_kernel() -> str:
    """What runs `bf16` linears here (csrc/bf16dot.c): "vdpbf16ps" (AVX512_BF16), "avx512-fma"
    (the same operations on fp32 FMAs), "portable" (scalar loops, slower than fp32) or "torch" (no
    C kernels)."""
    if not fused_decode.max_rows():
        return "torch"
    if fused_decode.bf16_insn():
        return "vdpbf16ps"
    return "avx512-fma" if fused_decode.isa() == "avx512" else "portable"


def set_max_isa(name: str) -> None:
    """Cap every kernel's instruction set ("avx512", "avx2" or "scalar"): tests run the fallbacks
    this way. The panel GEMVs quantised linears take (model/fused_decode.py) follow the cap."""
    set_extension_max_isa(name)
    if fused_decode.max_rows():
        fused_decode.set_max_isa(name)


def served_kernels(model_dir: str | Path, scheme: WeightScheme | None) -> dict[str, str]:
    """`EngineInfo.kernel_isa` and `bf16_products` for /manifest: the kernels the served weights
    run on, "" for what they do not use (quantised weights: at load, or a checkpoint's
    quantization_config; bf16 products: a load-time scheme with them), so that an unquantised model
    never builds the quantised GEMM extension to say so."""
    config_path = Path(model_dir) / "config.json"
    checkpoint_quantized = config_path.is_file() and (
        json.loads(config_path.read_text()).get("quantization_config") is not None
    )
    bf16 = scheme is not None and scheme.runs_bf16
    return {
        "kernel_isa": served_kernel_isa() if scheme is not None or checkpoint_quantized else "",
        "bf16_products": bf16_products_kernel() if bf16 else "",
    }
