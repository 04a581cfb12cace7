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
    except (ValueError, OverflowError):  # fuzzing: "infGiB" overflowed with a traceback
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
