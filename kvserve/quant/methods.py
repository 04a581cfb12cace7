"""Quantisation methods and which formats each one applies to (docs/quantization.md).

- rtn: round to nearest, every format.
- gptq: error-compensating rounding with the calibration Hessian; weight-only integer formats.
- awq: activation-aware per-channel scales; weight-only integer formats.
- smoothquant: moves activation range into the weights; W8A8 only (a weight-only format has no
  activation quantisation to help).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from kvserve.core.errors import ModelLoadError
from kvserve.quant.scheme import ACT_NONE, QuantizationError, WeightScheme, parse_weight_scheme

logger = logging.getLogger(__name__)

METHODS = {
    "rtn": "every format",
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
    if method == "rtn":
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


def quantize_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    weights: str,
    method: str = "rtn",
    calib: str | None = None,
    calib_tokens: int = CALIB_TOKENS,
    alpha: float = 0.5,
) -> dict:
    """Quantise the float checkpoint in `model_dir` and write it to `out_dir`; returns the report."""
    from kvserve.engine.args import load_tokenizer
    from kvserve.model.loader import read_checkpoint
    from kvserve.quant.artifact import read_quantization_config
    from kvserve.quant.convert import check_artifact_scheme, rtn_quantize, write_artifact

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"{model_dir}: no config.json (expected a Hugging Face model directory)"
        )
    if read_quantization_config(model_dir) is not None:
        raise QuantizationError(f"{model_dir} is already quantised (quantization_config present)")
    scheme = parse_weight_scheme(weights)
    check_artifact_scheme(scheme)
    check_method(scheme, method)
    if Path(out_dir).resolve() == model_dir.resolve():
        raise QuantizationError("--out must differ from the source model directory")
    checkpoint = read_checkpoint(model_dir)
    extra: dict = {}
    if method == "rtn":
        quantized = rtn_quantize(checkpoint, scheme)
    else:
        ids = read_calibration(calib, method, load_tokenizer(model_dir), calib_tokens)
        from kvserve.quant.calibrated import calibrated_quantize

        quantized, checkpoint, extra = calibrated_quantize(
            model_dir, checkpoint, scheme, method, ids, alpha=alpha
        )
        extra["calibration"] = {"file": str(calib), "num_tokens": len(ids)}
    if not quantized:  # fuzzing: `head=int8` on a tied-embedding model wrote an artifact of nothing
        raise QuantizationError(
            f"--weights {weights} quantises no tensor of this model (a tied head is the embedding, "
            "which stays in float)"
        )
    return write_artifact(model_dir, out_dir, scheme, method, quantized, checkpoint, extra)


def calibrated_at_load(
    model_dir: Path,
    checkpoint: dict,
    scheme: WeightScheme,
    method: str,
    calib: str | None,
) -> tuple[dict, dict]:
    """For the loader (`--quantization FMT --quantization-method M --calib FILE`): the block
    linears of `scheme` quantised by `method` on the first CALIB_TOKENS tokens of `calib`, as
    `kvserve quantize` takes them, a row's last scale group short where the group does not divide
    it. Returns ({HF weight name: QuantizedTensor}, the float checkpoint, rescaled where the
    method folds scales into the preceding norm); the head and the table are left to the loader's
    round to nearest."""
    from kvserve.engine.args import load_tokenizer
    from kvserve.quant.calibrated import calibrated_quantize

    check_method(scheme, method)
    ids = read_calibration(calib, method, load_tokenizer(model_dir), CALIB_TOKENS)
    blocks = replace(scheme, embed=None, head=None)
    quantized, checkpoint, _ = calibrated_quantize(
        model_dir, checkpoint, blocks, method, ids, whole_groups=False
    )
    logger.info(
        "quantization %s: %s on %d calibration tokens at load", scheme.name, method, len(ids)
    )
    return quantized, checkpoint
