"""`kvserve quantize`: a float checkpoint in, a quantised artifact out (docs/quantization.md).

Above the model layer: it reads the float checkpoint through kvserve.model.loader. The quantisers it
runs (quant/rtn.py, quant/calibrated.py) and the artifact format (quant/artifact.py, quant/convert.py)
sit below the model, which reads artifacts and calls the calibrated methods at load.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.core.errors import ModelLoadError
from kvserve.model.loader import read_checkpoint
from kvserve.quant.artifact import read_quantization_config
from kvserve.quant.calibrated import calibrated_quantize
from kvserve.quant.convert import check_artifact_scheme, rtn_quantize, write_artifact
from kvserve.quant.methods import CALIB_TOKENS, DEFAULT_METHOD, check_method, read_calibration
from kvserve.quant.scheme import QuantizationError, parse_weight_scheme
from kvserve.tokenizer import load_tokenizer


def quantize_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    weights: str,
    method: str = DEFAULT_METHOD,
    calib: str | None = None,
    calib_tokens: int = CALIB_TOKENS,
    alpha: float = 0.5,
) -> dict:
    """Quantise the float checkpoint in `model_dir` and write it to `out_dir`; returns the report."""
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
    if method == DEFAULT_METHOD:
        quantized = rtn_quantize(checkpoint, scheme)
    else:
        ids = read_calibration(calib, method, load_tokenizer(model_dir), calib_tokens)
        quantized, checkpoint, extra = calibrated_quantize(
            model_dir, checkpoint, scheme, method, ids, alpha=alpha
        )
        extra["calibration"] = {"file": str(calib), "num_tokens": len(ids)}
    if not quantized:  # e.g. `head=int8` on a tied-embedding model
        raise QuantizationError(
            f"--weights {weights} quantises no tensor of this model (a tied head is the embedding, "
            "which stays in float)"
        )
    return write_artifact(model_dir, out_dir, scheme, method, quantized, checkpoint, extra)
