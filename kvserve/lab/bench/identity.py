"""What was measured: the identity fields docs/load-tests.md asks for with every result.

A black-box HTTP client knows only what the server exposes (`/v1/models`, `/ready`, `/manifest`,
`/version`, `/props`, each response's `system_fingerprint`) and what the user states (`--label
key=value`). Each field says where it came from, and a field nobody reported says so instead of
being left out.
"""

from __future__ import annotations

import os
import platform
import socket

# field -> keys that servers use for it, searched in the probes in _PROBE_ORDER
FIELD_KEYS: dict[str, tuple[str, ...]] = {
    "hardware": ("hardware", "device_name", "gpu", "device", "accelerator"),
    "engine": ("engine", "owned_by", "server"),
    "engine_version": ("engine_version", "version", "build_info"),
    "model": ("served_model_name", "model", "model_path", "root", "id"),
    "model_sha256": ("model_sha256", "weights_sha256", "model_hash", "weights_hash"),
    "tokenizer_sha256": ("tokenizer_sha256", "tokenizer_hash"),
    "chat_template_sha256": ("chat_template_sha256", "chat_template_hash"),
    "manifest_sha256": ("manifest_sha256", "manifest_hash", "system_fingerprint"),
    "dtype": ("dtype", "torch_dtype"),
    "quantization": ("quantization", "quant_method", "quantisation"),
    "cache_dtype": ("kv_cache_dtype", "cache_dtype"),
    "max_model_len": ("max_model_len", "n_ctx", "context_length"),
}
_PROBE_ORDER = ("/ready", "/manifest", "/version", "/props", "/v1/models")
_MISSING = object()


def _find(obj: object, keys: tuple[str, ...], allow_null: bool) -> tuple[str, object]:
    """(key, value) of the first key in `keys` found depth first; a value may be a dict.
    Lists: their first element only."""
    if isinstance(obj, dict):
        for key in keys:
            if key in obj and obj[key] != "" and (allow_null or obj[key] is not None):
                return key, obj[key]
        for value in obj.values():
            if isinstance(value, dict | list):
                hit = _find(value, keys, allow_null)
                if hit[1] is not _MISSING:
                    return hit
    elif isinstance(obj, list) and obj:
        return _find(obj[0], keys, allow_null)
    return "", _MISSING


def identity_fields(probes: dict, labels: dict[str, str], fingerprints: list[str]) -> dict:
    """{field: {"value", "source"}} for every field in FIELD_KEYS; labels win over the server."""
    found: dict[str, dict] = {}
    for name, keys in FIELD_KEYS.items():
        if name in labels:
            found[name] = {"value": labels[name], "source": "--label"}
            continue
        # a value anywhere wins over a null; a null (`"quantization": null`) is still an answer
        hits = (
            (path, *_find(probes.get(path), keys, allow_null))
            for allow_null in (False, True)
            for path in _PROBE_ORDER
        )
        path, key, value = next((h for h in hits if h[2] is not _MISSING), ("", "", _MISSING))
        if value is _MISSING:
            found[name] = {"value": None, "source": "unreported"}
        else:
            found[name] = {"value": value, "source": f"{path}:{key}"}
    if fingerprints and found["manifest_sha256"]["source"] == "unreported":
        found["manifest_sha256"] = {
            "value": fingerprints[0],
            "source": "response system_fingerprint",
        }
    found["system_fingerprints_seen"] = {"value": fingerprints, "source": "responses"}
    return found


def client_host() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "num_cpus": os.cpu_count(),
    }
