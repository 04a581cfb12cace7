"""Server configuration: a model without a chat template, --chat-template, and what request logs carry."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.server_utils import running_server

pytestmark = pytest.mark.slow

SECRET_PROMPT = "my password is hunter2"
MESSAGES = [{"role": "user", "content": SECRET_PROMPT}]


@pytest.fixture(scope="module")
def no_template_dir(gpt2_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template")
    for item in gpt2_model_dir.iterdir():
        if item.name != "chat_template.jinja":
            shutil.copy(item, path / item.name)
    return path


def test_missing_chat_template_and_private_logs(no_template_dir, tmp_path):
    log = tmp_path / "server.log"
    args = ("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--log-level", "info")
    with running_server(no_template_dir, *args, log_path=log) as (url, _):
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES})
        assert chat.status_code == 400
        assert "--chat-template" in chat.json()["error"]["message"]
        done = httpx.post(f"{url}/v1/completions", json={"prompt": SECRET_PROMPT, "max_tokens": 3})
        assert done.status_code == 200
        request_id = done.json()["id"]
    text = log.read_text()
    assert request_id in text and '"prompt_tokens"' in text and '"finish_reasons"' in text
    assert SECRET_PROMPT not in text and "hunter2" not in text


def test_chat_template_flag_and_log_content(no_template_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}A:"
    )
    log = tmp_path / "server.log"
    args = ("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--log-level", "info",
            "--chat-template", str(template), "--log-content")  # fmt: skip
    with running_server(no_template_dir, *args, log_path=log) as (url, _):
        chat = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}
        )
        assert chat.status_code == 200
        tokens = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
        rendered = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert rendered["prompt"] == f"user: {SECRET_PROMPT}\nA:"
    assert SECRET_PROMPT in log.read_text()  # content logging was asked for explicitly


def test_manifest_reports_the_kv_cache_dtype_not_the_model_dtype(tmp_path):
    from kvserve.server.manifest import build_manifest, manifest_hash
    from tests.checkpoints import build_checkpoint

    build_checkpoint(tmp_path / "m")
    common = dict(served_model_name="m", dtype="float32", chat_template=None)
    auto = build_manifest(tmp_path / "m", engine_options={}, **common)
    int8 = build_manifest(tmp_path / "m", engine_options={"kv_cache_dtype": "int8"}, **common)
    assert auto["kv_cache_dtype"] == "float32"
    assert int8["kv_cache_dtype"] == "int8"
    assert manifest_hash(auto) != manifest_hash(int8)


@pytest.fixture(scope="module")
def named_templates_dir(gpt2_model_dir, tmp_path_factory):
    """The GPT-2 fixture with a second, named template beside chat_template.jinja."""
    path = tmp_path_factory.mktemp("named-templates")
    for item in gpt2_model_dir.iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(
        "tools: {{ tools | length }}.{% for m in messages %} {{ m['content'] }}{% endfor %}"
    )
    return path


def test_a_model_with_named_chat_templates_serves_each(named_templates_dir):
    """A model with named templates (chat_template.jinja and additional_chat_templates/
    tool_use.jinja) starts (its manifest hashes both) and renders as transformers picks: the
    default without tools, `tool_use` with them. It used to fail the start (the manifest hashed a
    dict) and every chat (the dict went to the template call)."""
    args = ("--max-model-len", "256", "--kv-cache-memory", "16MiB")
    with running_server(named_templates_dir, *args) as (url, _):
        manifest = httpx.get(f"{url}/manifest")
        assert manifest.status_code == 200 and manifest.json()["manifest"]["chat_template_sha256"]
        plain = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
        text = httpx.post(f"{url}/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"]
        assert text == f"<|user|>\n{SECRET_PROMPT}\n<|assistant|>\n"
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        body = {"messages": MESSAGES, "max_tokens": 1, "tools": [tool], "tool_choice": "none"}
        chat = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        expected = httpx.post(
            f"{url}/tokenize",
            json={"prompt": f"tools: 1. {SECRET_PROMPT}", "add_special_tokens": False},
        ).json()
        assert chat.json()["usage"]["prompt_tokens"] == expected["count"]
