"""kvserve: an LLM inference and serving engine, and the tools to measure it honestly."""

from __future__ import annotations

from kvserve._version import __version__

__all__ = ["__version__", "LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import kvserve` must not import torch (plan/ and bench/ users do not need it).
    if name == "LLM":
        from kvserve.threads import defaults_while_torch_loads

        with defaults_while_torch_loads():  # OpenMP reads them once, when torch loads
            from kvserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
