"""Quantisation methods and which formats each one applies to (docs/quantization.md).

- rtn: round to nearest, every format.
- gptq: error-compensating rounding with the calibration Hessian; weight-only integer formats.
- awq: activation-aware per-channel scales; weight-only integer formats.
- smoothquant: moves activation range into the weights; W8A8 only (a weight-only format has no
  activation quantisation to help).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.quant.scheme import ACT_NONE, QuantizationError, WeightScheme

DEFAULT_METHOD = "rtn"  # the default of every option and parameter that names a method
METHODS = {
    DEFAULT_METHOD: "every format",
    "gptq": "weight-only integer formats",
    "awq": "weight-only integer formats",
    "smoothquant": "w8a8 formats",
}
MIN_CALIB_TOKENS = 64
CALIB_TOKENS = 4096  # calibration tokens taken by default (kvserve quantize --calib-tokens)


def check_method(scheme: WeightScheme, method: str) -> None:
    if method not in METHODS:
        raise QuantizationError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    linear = scheme.for_class("linear")
    if method == DEFAULT_METHOD:
        return
    if linear is None:
        raise QuantizationError(
            f"{method} quantises block linears; {scheme.name} leaves them float"
        )
    w8a8 = linear.act != ACT_NONE
    if method == "smoothquant" and not w8a8:
        raise QuantizationError(
            f"smoothquant needs quantised activations (w8a8 or w8a8-pt), not the weight-only "
            f"{linear.name}: with float activations there is nothing to smooth"
        )
    if method in ("gptq", "awq") and w8a8:
        raise QuantizationError(f"{method} is for weight-only formats, not {linear.name}")


def read_calibration(path: str | None, method: str, tokenizer, max_tokens: int) -> list[int]:
    """Calibration token ids from a .jsonl ("text" per line) or text file, with clear errors."""
    from kvserve.evaluation import read_documents, token_stream

    if path is None:
        raise QuantizationError(f"{method} needs calibration text: pass --calib FILE")
    file = Path(path)
    if not file.is_file():
        raise QuantizationError(f"calibration file {path!r} does not exist")
    try:
        documents = [d for d in read_documents(file) if d.strip()]
    except (ValueError, KeyError) as exc:
        raise QuantizationError(f"calibration file {path}: cannot read it ({exc})") from exc
    if not documents:
        raise QuantizationError(f"calibration file {path} is empty")
    if tokenizer is None:
        raise QuantizationError("the model directory has no tokenizer to read calibration text")
    ids = token_stream(tokenizer, documents)[:max_tokens]
    if len(ids) < MIN_CALIB_TOKENS:
        raise QuantizationError(
            f"calibration file {path} gives {len(ids)} tokens; {method} needs at least "
            f"{MIN_CALIB_TOKENS}"
        )
    return ids
