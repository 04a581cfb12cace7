"""The API server process never imports torch (docs/design.md, "Processes"): with the engine core in
its own process (`kvserve serve --engine-core process`, the default), the API process parses the
options, builds the engine configuration, the app and the manifest, and talks to the core over
ZMQ; torch, the model and the C kernels live in the core."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server_utils import running_server

API_PROCESS = """
import sys
import kvserve.cli.serve, kvserve.engine.mp_client, kvserve.server.app
from kvserve.engine.args import EngineArgs
from kvserve.server.manifest import build_manifest

config = EngineArgs(model="kvserve-demo", device="cpu").create_engine_config()
for options in ({}, {"quantization": "int8"}, {"quantization": "linear=bf16,head=bf16"}):
    build_manifest(config.model_dir, served_model_name="m", dtype=config.dtype,
                   chat_template=None, engine_options=options, kernel_isa="avx2",
                   bf16_products="portable")
print(sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules))
"""


def test_the_api_process_path_imports_no_torch():
    """What `kvserve serve` runs before and around the core, in a fresh interpreter: options ->
    EngineConfig (device check and KV sizing on CPU), the app, the manifest of a float and of
    quantised weights (whose kernels the core reports in EngineInfo)."""
    result = subprocess.run(
        [sys.executable, "-c", API_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.slow
def test_a_served_chat_request_leaves_torch_out_of_the_api_process():
    """End to end: after a streamed chat request, /tokenize, /detokenize and /manifest, the API
    process (not the engine core, its child) has no torch library mapped: it tokenises with the
    light tokenizer (kvserve/tokenizer/light.py), not transformers."""
    with running_server("kvserve-demo", "--engine-core", "process") as (url, process):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200 and "data: [DONE]" in response.text
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": "hi there"}, timeout=10).json()
        text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10)
        assert text.json()["prompt"] == "<|bos|>hi there"
        assert httpx.get(f"{url}/manifest", timeout=10).status_code == 200
        with open(f"/proc/{process.pid}/maps") as maps:
            mapped = {line.split()[-1].rsplit("/", 1)[-1] for line in maps if "torch" in line}
    assert not mapped, f"the API process maps {sorted(mapped)}"
