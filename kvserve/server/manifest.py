"""Provenance: one manifest of what is served, whose hash is every response's `system_fingerprint`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvserve import __version__
from kvserve.paths import sha256_file
from kvserve.quant.methods import DEFAULT_METHOD
from kvserve.quant.provenance import HF_METHODS, describe_hf_checkpoint, recorded_evaluation

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)


def _template_sha256(chat_template: str | dict | None) -> str | None:
    """The served template's sha256; a model's named templates (name -> text) as one JSON text."""
    if not chat_template:
        return None
    if isinstance(chat_template, dict):
        chat_template = json.dumps(chat_template, sort_keys=True)
    return hashlib.sha256(chat_template.encode()).hexdigest()


def build_manifest(
    model_dir: str | Path,
    *,
    served_model_name: str,
    dtype: str,
    chat_template: str | dict | None,
    engine_options: dict,
    kernel_isa: str = "",
    bf16_products: str = "",
    matrix_engine: str = "",
    kernel_table: dict | None = None,
) -> dict:
    """SHA-256 of weights, tokenizer files and chat template; engine version; dtype and cache
    options. `kernel_isa` and `bf16_products`: what the engine core reports it runs
    (`EngineInfo`, kvserve/model/kernel_choice.py); the API process loads no kernel to find out.
    `matrix_engine` and `kernel_table` (the GEMM per linear shape and row bucket) likewise go
    under "kernels"."""
    model_dir = Path(model_dir)
    weights = {p.name: sha256_file(p) for p in sorted(model_dir.glob("*.safetensors"))}
    tokenizer = {
        name: sha256_file(model_dir / name)
        for name in _TOKENIZER_FILES
        if (model_dir / name).is_file()
    }
    return {
        "engine": "kvserve",
        "engine_version": __version__,
        "served_model_name": served_model_name,
        "weights_sha256": weights,
        "tokenizer_sha256": tokenizer,
        "chat_template_sha256": _template_sha256(chat_template),
        "dtype": dtype,
        "quantization": quantization_manifest(
            model_dir,
            engine_options.get("quantization"),
            engine_options.get("quantization_method") or DEFAULT_METHOD,
            engine_options.get("calib"),
            kernel_isa,
            bf16_products,
        ),
        "kv_cache_dtype": (
            dtype
            if engine_options.get("kv_cache_dtype", "auto") == "auto"
            else engine_options["kv_cache_dtype"]
        ),
        "engine_options": engine_options,
        "kernels": {"matrix_engine": matrix_engine, "table": dict(kernel_table or {})},
    }


def manifest_hash(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def fingerprint(manifest_sha256: str) -> str:
    return "fp_" + manifest_sha256[:16]


def quantization_manifest(
    model_dir: Path,
    at_load: str | None,
    at_load_method: str = DEFAULT_METHOD,
    calib: str | None = None,
    kernel_isa: str = "",
    bf16_products: str = "",
) -> dict | None:
    """The served quantisation scheme: the artifact's (config.json quantization_config) or the one
    applied at load (with its method, and the calibration file's hash for a calibrated one), the
    kernels' instruction set (as the engine core reports it), and the recorded evaluation of these
    files."""
    config_path = model_dir / "config.json"
    qconfig = (
        json.loads(config_path.read_text()).get("quantization_config")
        if config_path.is_file()
        else None
    )
    if qconfig is None and at_load is None:
        return None
    ours = (qconfig or {}).get("kvserve", {})
    if at_load:
        scheme, method = at_load, at_load_method
    elif qconfig.get("quant_method") in HF_METHODS:  # a GPTQ or AWQ checkpoint
        scheme, method = describe_hf_checkpoint(qconfig), qconfig["quant_method"]
    else:
        scheme, method = ours.get("scheme") or qconfig.get("format"), ours.get("method")
    out = {
        "scheme": scheme,
        "source": f"{method} at load" if at_load else "checkpoint",
        "method": method,
        "kernel_isa": kernel_isa,  # "scalar" or "unavailable": a slower stand-in runs
        "evaluation": recorded_evaluation(model_dir),
    }
    if bf16_products:  # a load-time scheme with bf16 products
        out["bf16_products"] = bf16_products
    if at_load and calib is not None:  # the codes depend on this text: it is part of the model
        out["calibration_sha256"] = sha256_file(Path(calib)) if Path(calib).is_file() else None
    return out
