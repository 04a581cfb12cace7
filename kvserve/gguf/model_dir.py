"""A GGUF file as a model directory: the Hugging Face files kvserve reads, derived once and cached.

Everything in kvserve that reads a model (the engine's config, the tokenizer and its chat template, the
stop ids, the manifest) reads a Hugging Face directory. For a GGUF file, `gguf_model_dir` writes those
files from its metadata into a cache directory keyed by the header's hash:

    config.json              hf_config: the architecture, from `<arch>.*` metadata
    generation_config.json   BOS / EOS ids
    tokenizer.json           the vocabulary as a `tokenizers` tokenizer (gguf/tokenizer.py)
    tokenizer_config.json    special tokens and `tokenizer.chat_template`
    gguf.json                where the weights are: {"file": "/abs/path/model.gguf", ...}

The weights are never copied: the loader maps them from the GGUF file itself (`gguf_source`). A cached
directory is reused while the file's header (metadata and tensor descriptions) and size are the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from kvserve.core.errors import ModelLoadError
from kvserve.gguf.config import generation_config, hf_config
from kvserve.gguf.reader import GGUFFile, open_gguf
from kvserve.gguf.source import POINTER
from kvserve.paths import cache_dir

FORMAT_VERSION = 2  # bump when the derived files change, so old caches are rebuilt


def is_gguf_path(text: str | Path) -> bool:
    return str(text).lower().endswith(".gguf")


def header_digest(path: Path, gguf: GGUFFile) -> str:
    digest = hashlib.sha256(f"{FORMAT_VERSION}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(gguf.data_start))
    return digest.hexdigest()[:16]


def gguf_model_dir(path: str | Path) -> Path:
    """The cached model directory of the GGUF file at `path`, written on first use (a bad file
    raises `ModelLoadError` or `UnsupportedModelError` with one line that says why)."""
    from kvserve.gguf.tokenizer import build_tokenizer, tokenizer_config

    path = Path(path).expanduser().resolve()
    gguf = open_gguf(path)
    target = cache_dir("gguf") / f"{path.stem}-{header_digest(path, gguf)}"
    pointer = target / POINTER
    if pointer.is_file() and json.loads(pointer.read_text()).get("file") == str(path):
        return target
    config = hf_config(gguf)
    tokenizer = build_tokenizer(gguf.metadata)
    tok_config = tokenizer_config(gguf.metadata)
    if tok_config.get("chat_template"):
        check_chat_template(tok_config["chat_template"], path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(config, indent=1))
        (work / "generation_config.json").write_text(json.dumps(generation_config(config)))
        tokenizer.save(str(work / "tokenizer.json"))
        (work / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
        types: dict[str, int] = {}
        for info in gguf.tensors.values():
            if len(info.dims) > 1:
                types[info.ggml_type.name] = types.get(info.ggml_type.name, 0) + 1
        source = {
            "file": str(path),
            "architecture": gguf.architecture,
            "version": gguf.version,
            "matrix_types": types,
        }
        (work / POINTER).write_text(
            json.dumps(source)
        )  # last: its presence marks a whole directory
        if target.exists():  # a directory for the same header, written for a file now elsewhere
            for old in target.iterdir():
                old.unlink()
            target.rmdir()
        try:
            os.replace(work, target)
        except OSError:  # another process wrote it first: theirs is the same
            if not (target / POINTER).is_file():
                raise
        work.mkdir()  # for TemporaryDirectory's cleanup
    return target


def check_chat_template(template: str, path: Path) -> None:
    """Compile the file's chat template as the server will (transformers' sandboxed compiler) and
    render one conversation: a syntax error, or a template that reaches outside the sandbox (e.g.
    `''.__class__.__mro__`), is a load error naming the file, not a failure on the first chat. Other
    runtime errors are left to the request that triggers them (a template may refuse, say, a system
    message by design)."""
    import jinja2
    from jinja2.sandbox import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    conversation = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"},
    ]
    try:
        compiled = _compile_jinja_template(template)
        compiled.render(
            messages=conversation, add_generation_prompt=True, bos_token="", eos_token=""
        )
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(
            f"{path}: tokenizer.chat_template line {exc.lineno}: {exc.message}"
        ) from None
    except SecurityError as exc:
        raise ModelLoadError(
            f"{path}: tokenizer.chat_template tries to leave its sandbox: {exc}"
        ) from None
    except jinja2.TemplateError:
        pass
