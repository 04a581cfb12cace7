"""Every engine option, once (`EngineArgs`), -> `EngineConfig`; and the checkpoint's tokenizer and stop
tokens.

`EngineArgs` names each option and the config field it sets, whose declaration (type, default, help,
bound or choices: kvserve/config.py) it takes over (kvserve/core/options.py). `kvserve serve`,
`kvserve generate` and `kvserve bench latency` generate their engine flags from it (`add_cli_args`,
`from_cli_args`); `LLM(model, **options)` and `build_engine_config(model, **options)` validate their
keyword arguments with it. A new option is a config field declared with `option()` and one field
here that names it.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from kvserve.config import (
    DTYPE_BYTES,
    CacheConfig,
    DistConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.core.errors import InvalidRequestError, ModelLoadError
from kvserve.core.options import (
    Option,
    add_flags,
    check_options,
    check_types,
    declared,
    option,
    value_type,
    values_from_cli,
)
from kvserve.memory import (
    KV_CACHE_MEMORY_FRACTION,
    auto_kv_cache_bytes,
    checkpoint_bytes,
    device_memory_reading,
)
from kvserve.models import resolve_model
from kvserve.options import format_bytes, parse_bytes
from kvserve.tokenizer import load_api_tokenizer

logger = logging.getLogger(__name__)

MODEL_HELP = (
    "model directory, GGUF file, or a built-in name: smollm2-135m-instruct, kvserve-demo, "
    "kvserve-demo-draft"
)
DTYPES = ("auto", *sorted(DTYPE_BYTES))


_MULTI_HOST = "multi-host tensor parallelism"
_SPECULATIVE = "speculative decoding"


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options, validated on construction (types here; bounds and choices from the
    config field each option sets, declared there once: kvserve/config.py). Each field is
    `Option.of(ConfigClass, "field", ...)`: the config field's default, help, bound and choices,
    with what the flag adds (its spelling, group, parser) and, where the option means something
    else before it is resolved (None: auto), its own default and help."""

    model: str | None = option(
        None,
        MODEL_HELP + " (default: smollm2-135m-instruct)",
        metavar="MODEL",
        cli=False,
        config=(EngineConfig, "model_dir"),
        resolved=True,
    )
    dtype: str = Option.of(
        EngineConfig,
        "dtype",
        default="auto",
        help="compute dtype; auto: fp32 on CPU, the checkpoint's bf16/fp16 on CUDA",
        choices=DTYPES,
    )
    device: str = Option.of(EngineConfig, "device")
    max_model_len: int | None = Option.of(
        SchedulerConfig,
        "max_model_len",
        default=None,
        help="context length in tokens, prompt + output (default: the model's limit)",
    )
    max_num_seqs: int = Option.of(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = Option.of(SchedulerConfig, "max_num_batched_tokens")
    max_prompt_tokens_beside_decode: int | None = Option.of(
        SchedulerConfig, "max_prompt_tokens_beside_decode"
    )
    block_size: int = Option.of(CacheConfig, "block_size")
    num_blocks: int | None = Option.of(CacheConfig, "num_blocks")
    kv_cache_memory_bytes: int | None = Option.of(
        CacheConfig,
        "kv_cache_memory_bytes",
        default=None,
        help="memory for the KV cache, e.g. 512MiB, 2GiB, or bytes (default: auto, "
        f"{KV_CACHE_MEMORY_FRACTION * 100:.0f}%% of the memory available after the weights, at most "
        "what --max-num-seqs full-length sequences use; docs/operations.md)",
        flag="--kv-cache-memory",
        parse=parse_bytes,
        metavar="SIZE",
    )
    enable_prefix_caching: bool = Option.of(
        CacheConfig, "enable_prefix_caching", flag="--prefix-caching"
    )
    hybrid_kv_cache: bool = Option.of(CacheConfig, "hybrid")
    admission: str = Option.of(SchedulerConfig, "admission")
    seed: int = Option.of(EngineConfig, "seed")
    quantization: str | None = Option.of(EngineConfig, "quantization")
    quantization_method: str = Option.of(EngineConfig, "quantization_method")
    calib: str | None = Option.of(EngineConfig, "calib", metavar="FILE")
    gguf_activations: str = Option.of(EngineConfig, "gguf_activations")
    kv_cache_dtype: str = Option.of(CacheConfig, "kv_cache_dtype")
    attention_backend: str = Option.of(EngineConfig, "attention_backend")
    thread_policy: str = Option.of(EngineConfig, "thread_policy")
    kernel_choice: str = Option.of(EngineConfig, "kernel_choice")
    grammar_compile_timeout: float = Option.of(EngineConfig, "grammar_compile_timeout_s")
    tensor_parallel_size: int = Option.of(EngineConfig, "tensor_parallel_size")
    nnodes: int = Option.of(DistConfig, "nnodes", group=_MULTI_HOST)
    node_rank: int = Option.of(DistConfig, "node_rank", group=_MULTI_HOST)
    dist_init_addr: str | None = Option.of(
        DistConfig, "init_addr", metavar="HOST:PORT", group=_MULTI_HOST
    )
    dist_timeout: float = Option.of(DistConfig, "timeout_s", group=_MULTI_HOST)
    dist_secret_file: str | None = Option.of(
        DistConfig, "secret_file", metavar="FILE", group=_MULTI_HOST
    )
    # a name or directory, resolved into the draft's directory
    speculative_model: str | None = Option.of(
        SpeculativeConfig, "draft_model_dir", group=_SPECULATIVE, resolved=True
    )
    speculative_method: str | None = Option.of(
        SpeculativeConfig, "method", default=None, group=_SPECULATIVE
    )
    num_speculative_tokens: int = Option.of(
        SpeculativeConfig, "num_speculative_tokens", group=_SPECULATIVE
    )
    ngram_min: int = Option.of(SpeculativeConfig, "ngram_min", group=_SPECULATIVE)
    ngram_max: int = Option.of(SpeculativeConfig, "ngram_max", group=_SPECULATIVE)

    def __post_init__(self) -> None:
        for f, _ in declared(EngineArgs):
            if isinstance(getattr(self, f.name), Path) and value_type(f)[0] is str:
                object.__setattr__(self, f.name, str(getattr(self, f.name)))
        check_types(self, "engine option")
        check_options(self, lambda f: f"engine option {f.name}")

    @classmethod
    def from_options(cls, model=None, **options) -> EngineArgs:
        """`EngineArgs(model=model, **options)`, with an unknown name a clear error, not a TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; the options are {sorted(known - {'model'})}",
                unknown[0],
            )
        return cls(model=model, **options)

    # --- the command line -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add every engine flag (all but the model, which each command spells its own way) to
        `parser`, in argument groups, with the defaults and help declared once."""
        add_flags(parser, cls, {None: parser.add_argument_group("engine")})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model=None) -> EngineArgs:
        """The options `add_cli_args` parsed into `args`, with the command's model; a value out of
        its bound is an `InvalidRequestError` naming the flag."""
        return cls(model=model, **values_from_cli(cls, args))

    def config_values(self, config_class: type) -> dict:
        """The options that set a field of `config_class` as they are (the others are resolved by
        `create_engine_config`), by the config field's name."""
        return {
            spec.config[1]: getattr(self, f.name)
            for f, spec in declared(EngineArgs)
            if spec.config[0] is config_class and not spec.resolved
        }

    def options(self) -> dict:
        """Every option but the model, by name (manifests, reports)."""
        values = asdict(self)
        values.pop("model")
        return values

    # --- the engine's configuration ---------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (a built-in name or a directory), read its config, build `EngineConfig`."""
        _check_device(self.device)
        model_dir = resolve_model(self.model)
        model = ModelConfig.from_dir(model_dir)
        limit = model.max_position_embeddings
        if model.caps_context_at_window and model.sliding_window < limit:
            # Within the window, sliding-window attention is full attention: cap the context to stay exact.
            limit = model.sliding_window
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens",
                "max_model_len",
            )
        speculative = self._speculative_config(model_dir)
        config = EngineConfig(
            model_dir=str(model_dir),
            model=model,
            cache=CacheConfig(**self.config_values(CacheConfig)),
            scheduler=SchedulerConfig(
                **self.config_values(SchedulerConfig),
                max_model_len=max_model_len,
                num_lookahead_tokens=speculative.num_speculative_tokens if speculative else 0,
            ),
            dtype=resolve_dtype(self.dtype, self.device, model),
            speculative=speculative,
            dist=DistConfig(**self.config_values(DistConfig)),
            **self.config_values(EngineConfig),
        )
        return replace(config, cache=self._sized_cache(config))

    def _sized_cache(self, config: EngineConfig) -> CacheConfig:
        """The cache config with its byte budget and how it was chosen: --num-blocks, else
        --kv-cache-memory, else from this machine's memory (kvserve/memory.py)."""
        cache = config.cache
        if self.num_blocks is not None:
            return replace(cache, sizing=f"--num-blocks {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None:
            return replace(
                cache,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                sizing=f"--kv-cache-memory {format_bytes(self.kv_cache_memory_bytes)}",
            )
        size = auto_kv_cache_bytes(
            device_memory_reading(self.device),
            weights_bytes=_weights_bytes(config),
            kv_bytes_per_token=config.kv_bytes_per_token,
            block_size=cache.block_size,
            max_model_len=config.scheduler.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        return replace(cache, kv_cache_memory_bytes=size.num_bytes, sizing="auto: " + size.reason)

    def _speculative_config(self, model_dir: Path) -> SpeculativeConfig | None:
        if self.speculative_model is None and self.speculative_method is None:
            return None
        method = self.speculative_method or "draft"
        draft = draft_dir = None
        if method == "draft":
            if self.speculative_model is None:
                raise InvalidRequestError(
                    "speculative method 'draft' needs --speculative-model DIR", "speculative_model"
                )
            draft_dir = resolve_model(self.speculative_model, role="draft model")
            draft = ModelConfig.from_dir(draft_dir)
            check_same_vocabulary(model_dir, draft_dir)
        elif self.speculative_model is not None:  # never silently ignored
            raise InvalidRequestError(
                f"--speculative-model is for --speculative-method draft, not {method}",
                "speculative_model",
            )
        return SpeculativeConfig(
            method=method,
            draft_model_dir=str(draft_dir) if draft else None,
            draft_model=draft,
            **self.config_values(SpeculativeConfig),
        )


def _weights_bytes(config: EngineConfig) -> int:
    """About what the weights will take once loaded: the files' bytes, widened when a 16-bit float
    checkpoint runs in fp32 (quantised checkpoints and formats: their file size)."""
    total = 0
    for model_dir, model in ((config.model_dir, config.model), _draft(config)):
        if model_dir is None:
            continue
        num_bytes = checkpoint_bytes(model_dir)
        stored = DTYPE_BYTES.get(model.torch_dtype, DTYPE_BYTES[config.dtype])
        if config.quantization is None and DTYPE_BYTES[config.dtype] > stored:
            num_bytes = num_bytes * DTYPE_BYTES[config.dtype] // stored
        total += num_bytes
    return total


def _draft(config: EngineConfig) -> tuple[str | None, ModelConfig | None]:
    spec = config.speculative
    if spec is None or spec.draft_model is None:
        return None, None
    return spec.draft_model_dir, spec.draft_model


# device types torch knows that kvserve does not run on (the rest are not devices at all)
_OTHER_DEVICE_TYPES = ("mps", "xpu", "xla", "meta", "hip", "hpu", "ipu", "mtia", "lazy", "vulkan")
_DEVICE = re.compile(r"([a-z]+)(?::(\d+))?")


def _check_device(device: str) -> None:
    """cpu, cuda or cuda:N that this torch can use, checked before the model loads. Torch is imported only for a CUDA device: the
    API process builds this configuration, and on CPU it never loads torch (docs/design.md)."""
    match = _DEVICE.fullmatch(device)
    kind = match.group(1) if match else None
    if kind not in ("cpu", "cuda", *_OTHER_DEVICE_TYPES):
        raise InvalidRequestError(
            f"--device {device!r} is not a device: use cpu, cuda or cuda:N", "device"
        )
    if kind not in ("cpu", "cuda"):
        raise InvalidRequestError(f"--device {device!r}: kvserve runs on cpu or cuda", "device")
    if kind == "cuda":
        import torch

        index = None if match.group(2) is None else int(match.group(2))
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (index is not None and index >= count):
            raise InvalidRequestError(
                f"--device {device!r}: this machine's torch sees {count} CUDA device(s)", "device"
            )


def resolve_dtype(dtype: str, device: str, model: ModelConfig) -> str:
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return model.torch_dtype if model.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    return "float32"  # bf16/fp16 matmuls are far slower than fp32 on CPUs without native support


def build_engine_config(model_dir: str | Path | None = None, **options) -> EngineConfig:
    """`EngineArgs.from_options(model_dir, **options).create_engine_config()`."""
    return EngineArgs.from_options(model_dir, **options).create_engine_config()


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """A draft must map every token id to the same token as the target: compare whole vocabularies
    (token -> id, special tokens included), not their sizes."""
    target, draft = load_api_tokenizer(target_dir), load_api_tokenizer(draft_dir)
    if target is None or draft is None:
        missing = target_dir if target is None else draft_dir
        raise ModelLoadError(
            f"{missing} has no tokenizer, so the draft's vocabulary cannot be checked against the target's"
        )
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t
            for t in set(target_vocab) | set(draft_vocab)
            if target_vocab.get(t) != draft_vocab.get(t)
        )
        raise ModelLoadError(
            f"the draft model's tokenizer ({draft_dir}) maps ids to tokens differently from the target's "
            f"({len(differing)} tokens differ, e.g. {differing[:3]}); a draft must share the tokenizer"
        )
