"""Command-line plumbing shared by every command: byte sizes and the help formatter. A leaf module
(argparse only), so the benchmarks, the CLI and the engine's options import it without importing each
other."""

from __future__ import annotations

import argparse

_BYTE_UNITS = {
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB' or a plain number of bytes -> bytes."""
    lowered = text.strip().lower()
    try:
        for suffix, factor in _BYTE_UNITS.items():
            if lowered.endswith(suffix):
                return int(float(lowered[: -len(suffix)]) * factor)
        return int(lowered)
    except (ValueError, OverflowError):  # "infGiB" overflows
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512MiB, 2GiB or a number of bytes, got {text!r}"
        ) from None


def format_bytes(num_bytes: int) -> str:
    """The inverse of `parse_bytes` for whole binary units: 536870912 -> '512MiB'."""
    for suffix, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{suffix}"
    return str(num_bytes)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` shows every flag's default (unless it is None, a switch's False, or the help already
    says it) and keeps the epilogs' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


# Other servers' flags that users type first. `ALIASES`: the same meaning, so the same option;
# `FOREIGN`: a different meaning, refused with kvserve's option named (docs/server.md "Flags from
# vLLM and llama.cpp").
ALIASES = {
    "--enable-prefix-caching": "--prefix-caching",  # vLLM
    "--no-enable-prefix-caching": "--no-prefix-caching",
    "-m": "--model",  # llama.cpp
}
FOREIGN = {
    "--gpu-memory-utilization": (
        "vLLM's fraction of the whole GPU for weights, activations and cache",
        "--kv-cache-memory SIZE (the KV cache's own memory, e.g. 4GiB; by default sized from "
        "the free memory)",
    ),
    "--ctx-size": (
        "llama.cpp's context, shared by its --parallel slots",
        "--max-model-len N (each sequence's context) and --max-num-seqs N (sequences at once)",
    ),
    "-c": ("llama.cpp's --ctx-size", "--max-model-len N and --max-num-seqs N"),
    "--n-gpu-layers": (
        "llama.cpp's layers offloaded to the GPU",
        "--device cuda (the whole model on one GPU) or --device cpu",
    ),
    "-ngl": ("llama.cpp's --n-gpu-layers", "--device cuda or --device cpu"),
    "--parallel": ("llama.cpp's slots, each with ctx-size/N tokens", "--max-num-seqs N"),
    "-np": ("llama.cpp's --parallel", "--max-num-seqs N"),
    "--threads": ("llama.cpp's thread count", "the environment variable OMP_NUM_THREADS=N"),
    "--trust-remote-code": (
        "vLLM's switch to run a checkpoint's own code (kvserve runs its own model code only: drop it)",
        None,
    ),
}


class _Foreign(argparse.Action):
    """A flag from another server whose meaning differs: an error that names kvserve's option."""

    def __init__(self, option_strings, dest, what: str, instead: str | None, **kwargs) -> None:
        self.what, self.instead = what, instead
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            nargs="?",
            help=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        hint = f" Did you mean {self.instead}?" if self.instead else ""
        parser.error(f"{option_string} is {self.what}; kvserve does not take it.{hint}")


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    """Accept `ALIASES` as their kvserve options and refuse `FOREIGN` with a hint, on a parser that
    has the engine's flags (serve, generate, bench latency); a spelling the parser already uses for
    something else is left alone."""
    taken = parser._option_string_actions
    for alias, target in ALIASES.items():
        action = taken.get(target)
        if action is None or alias in taken:
            continue
        action.option_strings.append(alias)
        taken[alias] = action
    for flag, (what, instead) in FOREIGN.items():
        if flag not in taken:
            parser.add_argument(flag, action=_Foreign, what=what, instead=instead)
