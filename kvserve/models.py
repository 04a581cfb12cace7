"""Where models live: the built-in names and the one resolver every command goes through.

`kvserve-demo` is the project's embedded demonstration target and `kvserve-demo-draft` its draft
(see tools/demo_models). Anything else must be a local Hugging Face directory: kvserve never
downloads. `resolve_model` turns a name or a path into a directory, or raises `ModelLoadError` with
a message that says what to do (never a traceback from deep inside the loader).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.core.errors import ModelLoadError

ASSETS_DIR = Path(__file__).parent / "assets" / "demo"

DEMO_MODEL = "kvserve-demo"
DEMO_DRAFT = "kvserve-demo-draft"
BUILTIN_MODELS = {DEMO_MODEL: "target", DEMO_DRAFT: "draft"}


def _builtin_dir(name: str) -> Path:
    path = ASSETS_DIR / BUILTIN_MODELS[name]
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the embedded model {name!r} is missing ({path}): reinstall kvserve, or pass a model "
            "directory instead"
        )
    return path


def default_model_dir() -> Path:
    return _builtin_dir(DEMO_MODEL)


def default_draft_dir() -> Path:
    return _builtin_dir(DEMO_DRAFT)


def builtin_name(model_dir: str | Path) -> str | None:
    """The built-in name of a directory (`kvserve-demo` for the embedded target), else None."""
    resolved = Path(model_dir).resolve()
    for name, sub in BUILTIN_MODELS.items():
        if resolved == (ASSETS_DIR / sub).resolve():
            return name
    return None


def resolve_model(model: str | Path | None, *, role: str = "model") -> Path:
    """A built-in name, a local directory, or None (the default model) -> a model directory.

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
    if path.exists():
        raise ModelLoadError(
            f"{role} {text!r} is a file; give its directory (the one with config.json)"
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
