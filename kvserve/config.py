"""Frozen configuration dataclasses, validated on construction. Torch-free.

Environment variables are read in one place: `kvserve.env`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from kvserve.core.errors import InvalidRequestError, ModelLoadError
from kvserve.core.options import check_options, option
from kvserve.core.sampling_params import GRAMMAR_COMPILE_TIMEOUT_S
from kvserve.gguf.source import PANEL_FORMATS, gguf_matrix_types
from kvserve.kv.groups import KVLayout, plan_layout, single_layout
from kvserve.quant.methods import DEFAULT_METHOD, METHODS, check_method
from kvserve.quant.scheme import QuantizationError, WeightScheme, parse_weight_scheme

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# KV cache storage: "auto" = the model's dtype; 8-bit codes with one fp16 scale per (token, kv head).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_SCALE_BYTES = 2
ATTENTION_BACKENDS = ("auto", "cpu", "torch")
# config.json `layer_types` values (transformers' names): attend to the whole context, or a window
LAYER_TYPES = ("full_attention", "sliding_attention")
# adaptive: kvserve/threads.py ThreadPoolSizer; fixed: every step on all of torch's threads
THREAD_POLICIES = ("adaptive", "fixed")
GGUF_ACTIVATIONS = ("auto", "fp32", "int8", "int8x2")  # EngineConfig.gguf_activations
# which GEMM runs each linear at each row count (kvserve/model/kernel_table.py): measured on this
# machine (cached), remeasure (ignoring the cache), own (kvserve's kernels and fixed rules), torch
KERNEL_CHOICES = ("measured", "remeasure", "own", "torch")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: tuple[
        tuple[str, object], ...
    ] = ()  # sorted items of the HF rope dict, minus theta
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    hidden_activation: str = "silu"  # the gated MLP's activation (hidden_act / hidden_activation)
    # per layer, LAYER_TYPES; () when config.json gives none (every layer attends in full)
    layer_types: tuple[str, ...] = ()
    # sliding-window layers' RoPE when it differs from the global one (Gemma 3's rope_local_base_freq)
    rope_local_theta: float | None = None
    rope_local_scaling: tuple[tuple[str, object], ...] = ()
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ModelLoadError(
                    f"config.json: {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"config.json: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the number of keys a query attends to (itself and the W - 1 before it, as
        transformers' sliding-window mask), or None for full attention."""
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in (self.layer_types or ("full_attention",) * self.num_layers)
        )

    @property
    def caps_context_at_window(self) -> bool:
        """A window given for the whole model (no per-layer `layer_types`, Mistral): kvserve does not
        mask it, so the context is capped at the window, where the two agree."""
        return self.sliding_window is not None and not self.layer_types

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)

    def splits_over(self, world_size: int) -> bool:
        """Whether `world_size` tensor-parallel ranks can shard this model (docs/parallel.md):
        whole query heads and FFN columns per rank, KV heads split evenly or one replicated on
        world_size / n_kv ranks."""
        n, kv = world_size, self.num_kv_heads
        if self.num_heads % n or self.intermediate_size % n:
            return False
        return kv % n == 0 or n % kv == 0

    @property
    def tensor_parallel_sizes(self) -> tuple[int, ...]:
        """Every tensor-parallel size that shards this model (1 always does)."""
        return tuple(n for n in range(1, self.num_heads + 1) if self.splits_over(n))

    def check_tensor_parallel(self, world_size: int) -> None:
        """Raise, naming the sizes that work, unless `world_size` ranks can shard this model."""
        if not self.splits_over(world_size):
            sizes = ", ".join(str(n) for n in self.tensor_parallel_sizes)
            raise ModelLoadError(
                f"--tensor-parallel-size {world_size} does not split this model: it must divide the "
                f"{self.num_heads} attention heads and the FFN width {self.intermediate_size}, and "
                f"divide the {self.num_kv_heads} KV heads or be a multiple of them; sizes that "
                f"work: {sizes}"
            )

    def kv_bytes_per_token(
        self, dtype: str, kv_cache_dtype: str = "auto", num_layers: int | None = None
    ) -> int:
        """K and V for every layer (or `num_layers` of them: the slots of a hybrid model's block,
        kv/groups.py): 2 x layers x kv_heads x head_dim x bytes (docs/planning.md); 8-bit caches:
        1 byte per value plus a 2-byte scale per kv head."""
        layers = self.num_layers if num_layers is None else num_layers
        if kv_cache_dtype == "auto":
            return 2 * layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]
        return 2 * layers * self.num_kv_heads * (self.head_dim + KV_SCALE_BYTES)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            local_rope: dict | None = None
            if "full_attention" in rope or "sliding_attention" in rope:
                # transformers >= 5, per layer type (Gemma 3): rope_parameters[layer_type]
                local_rope = dict(rope.get("sliding_attention") or {})
                rope = dict(rope.get("full_attention") or {})
            elif raw.get("rope_local_base_freq") is not None:  # transformers < 5 (Gemma 3)
                local_rope = {"rope_theta": raw["rope_local_base_freq"]}
            # transformers < 5 keeps theta at the top level; >= 5 moves it into rope_parameters.
            theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            _normalise_rope_type(rope)
            local_theta = None
            if local_rope is not None and "rope_theta" in local_rope:
                local_theta = float(local_rope.pop("rope_theta"))
                _normalise_rope_type(local_rope)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            sliding = raw.get("sliding_window")
            if raw.get("use_sliding_window") is False:
                sliding = None  # qwen2 carries a window size it does not use
            return cls(
                model_type=str(raw["model_type"]),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                intermediate_size=int(raw["intermediate_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope_scaling=tuple(sorted(rope.items())),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                hidden_activation=str(
                    raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
                ),
                layer_types=_layer_types(raw),
                rope_local_theta=local_theta,
                rope_local_scaling=tuple(sorted((local_rope or {}).items())),
                query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json is missing the key {exc.args[0]!r}") from exc
        except (ValueError, TypeError, ZeroDivisionError) as exc:  # "abc", null, 0 heads
            raise ModelLoadError(
                f"config.json has a value of the wrong type or range: {exc}"
            ) from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} is not a JSON object")
        return cls.from_dict(raw)


def _normalise_rope_type(rope: dict) -> None:
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)


def _layer_types(raw: dict) -> tuple[str, ...]:
    """config.json's `layer_types`, or the one transformers derives from `sliding_window_pattern`
    (every pattern-th layer global, the others sliding); () when it gives neither."""
    if raw.get("layer_types"):
        return tuple(str(kind) for kind in raw["layer_types"])
    pattern = raw.get("sliding_window_pattern")
    if pattern is None:
        return ()
    pattern = int(pattern)
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(int(raw["num_hidden_layers"]))
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` tokens each."""

    block_size: int = option(16, "tokens per KV-cache block", ge=1)
    num_blocks: int | None = option(
        None, "KV-cache blocks (default: as many as --kv-cache-memory holds)", ge=1
    )
    kv_cache_memory_bytes: int = option(512 * 1024**2, "memory for the KV cache", ge=1)
    enable_prefix_caching: bool = option(True, "reuse cached prompt prefixes")
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: the model's dtype, or 8-bit codes + fp16 scales per token and head",
        choices=KV_CACHE_DTYPES,
    )
    hybrid: bool = option(
        True,
        "a model with sliding-window and global layers (Gemma 3) returns the blocks its "
        "window layers no longer see (docs/scheduling.md)",
    )
    sizing: str = ""  # how the size was chosen, for the startup banner (kvserve/memory.py)

    def __post_init__(self) -> None:
        check_options(self)

    def resolve_num_blocks(self, kv_bytes_per_token: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        num_blocks = self.kv_cache_memory_bytes // (kv_bytes_per_token * self.block_size)
        if num_blocks < 1:
            raise InvalidRequestError(
                f"kv cache memory {self.kv_cache_memory_bytes} B holds no block of {self.block_size} "
                f"tokens at {kv_bytes_per_token} B/token",
                "kv_cache_memory",
            )
        return num_blocks


ADMISSION_POLICIES = ("on_demand", "reserve")


# The default cap on prompt tokens beside decoding rows where a step's time grows with its prompt
# tokens: a GGUF model on the integer panel kernel (docs/performance.md, "Prompt tokens beside
# decoding rows on the default model"). Elsewhere (no cap) the measured default.
PROMPT_CAP_ON_INTEGER_PRODUCTS = 48


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decode tokens and prompt chunks (docs/scheduling.md)."""

    max_num_seqs: int = option(64, "most sequences running at once", ge=1)
    max_num_batched_tokens: int = option(
        2048, "token budget of one step, shared by decode tokens and prompt chunks", ge=1
    )
    max_prompt_tokens_beside_decode: int | None = option(
        None,
        "prompt tokens a step may hold while it also holds decoding rows (0: the whole budget; "
        f"default: {PROMPT_CAP_ON_INTEGER_PRODUCTS} where a GGUF model's products run on the "
        "integer panel kernel, --gguf-activations int8 or int8x2, else 0): a prompt chunk delays "
        "every decoding row's next token by its cost (docs/scheduling.md)",
        ge=0,
    )
    max_model_len: int = option(2048, "context length in tokens, prompt + output", ge=2)
    admission: str = option(
        "on_demand",
        "on_demand: charge blocks as used, preempt when full; reserve: prompt + max_tokens "
        "up front (docs/scheduling.md)",
        choices=ADMISSION_POLICIES,
    )
    # Speculative decoding: slots allocated past each chunk of a speculating request, so the proposer can
    # write its draft positions (gamma when speculating, else 0).
    num_lookahead_tokens: int = option(0, ge=0)

    def __post_init__(self) -> None:
        check_options(self)


SPECULATIVE_METHODS = ("draft", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative-decoding.md): a proposer and how many tokens it proposes per step."""

    method: str = option(
        help="draft model or n-gram lookup (default: draft when --speculative-model is given)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(4, "gamma: proposals per step", ge=1, le=16)
    draft_model_dir: str | None = option(
        None, "draft model directory or built-in name (kvserve-demo-draft); same tokenizer"
    )
    draft_model: ModelConfig | None = None
    # n-gram lookup tries the longest suffix first, down to ngram_min tokens
    ngram_min: int = option(1, "shortest n-gram to match", ge=1)
    ngram_max: int = option(4, "longest n-gram to match", ge=1)

    def __post_init__(self) -> None:
        check_options(self)
        if self.method == "draft" and (self.draft_model_dir is None or self.draft_model is None):
            raise InvalidRequestError(
                "the draft method needs a draft model directory", "speculative_model"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError("need 1 <= ngram_min <= ngram_max", "ngram_min")


@dataclass(frozen=True)
class DistConfig:
    """Where this process sits in a multi-host tensor-parallel layout."""

    nnodes: int = option(
        1,
        "hosts the tensor-parallel ranks span; node 0 runs the engine, the others `kvserve tp-node` "
        "(SGLang's spelling; docs/parallel.md)",
        ge=1,
    )
    node_rank: int = option(0, "this host's index, 0 to --nnodes - 1 (0: the engine)", ge=0)
    init_addr: str | None = option(
        None,
        "node 0's HOST:PORT: node 0 listens there (on HOST only) for the other nodes, which must "
        "prove the shared secret ($KVSERVE_DIST_SECRET or --dist-secret-file)",
    )
    timeout_s: float = option(
        60.0,
        "seconds every node has to join, and that a collective across hosts waits for a rank",
        gt=0,
    )
    secret_file: str | None = option(
        None, "file holding the nodes' shared secret (default: $KVSERVE_DIST_SECRET)"
    )

    def __post_init__(self) -> None:
        check_options(self)
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(
                f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}", "node_rank"
            )
        if self.nnodes > 1:
            self.address  # noqa: B018 (validates HOST:PORT)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def address(self) -> tuple[str, int]:
        text = self.init_addr
        if not text:
            raise InvalidRequestError(
                "--nnodes > 1 needs --dist-init-addr HOST:PORT", "dist_init_addr"
            )
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequestError(
                f"--dist-init-addr must be HOST:PORT (node 0's address), got {text!r}",
                "dist_init_addr",
            )
        return host, int(port)

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise InvalidRequestError(
                f"--tensor-parallel-size {world_size} must be a multiple of --nnodes {self.nnodes} "
                "(every node runs the same number of ranks)",
                "nnodes",
            )
        return world_size // self.nnodes

    def node_ranks(self, world_size: int, node_rank: int | None = None) -> range:
        """The global ranks node `node_rank` (default: this one) runs: a contiguous slice."""
        per_node = self.ranks_per_node(world_size)
        node = self.node_rank if node_rank is None else node_rank
        return range(node * per_node, (node + 1) * per_node)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine. `model` is the checkpoint's config."""

    model_dir: str
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = option(
        "float32",
        "compute dtype",
        choices=tuple(sorted(DTYPE_BYTES)),
    )
    device: str = option("cpu", "cpu, cuda or cuda:N")
    seed: int = option(0, "engine random seed")
    speculative: SpeculativeConfig | None = None
    attention_backend: str = option(
        "auto",
        "auto: the in-place C kernels on CPU with fp32 weights; torch: torch ops only",
        choices=ATTENTION_BACKENDS,
    )
    quantization: str | None = option(
        None,
        "quantise weights at load: int8, int4-g128, w8a8, linear=bf16,head=bf16 (bf16 products, "
        "fp32 sums), linear=int4-g64,head=int8, ... (docs/quantization.md)",
    )
    # kvserve.quant.methods
    quantization_method: str = option(
        DEFAULT_METHOD,
        "how --quantization quantises the block linears: rtn (round to nearest), or gptq, awq, "
        "smoothquant on the calibration text of --calib (the head and table: rtn)",
        choices=tuple(METHODS),
    )
    calib: str | None = option(
        None,
        "calibration text for --quantization-method: .jsonl with a text field, or plain text",
    )
    # kvserve.model.loader
    gguf_activations: str = option(
        "auto",
        "a GGUF model's products: int8 (Q4_0, Q4_1, Q5_0, Q8_0 blocks on the integer panel kernel, "
        "activations rounded to int8 per 32 inputs as llama.cpp rounds them: fastest, but greedy "
        "answers drift from the exact model's), int8x2 (the same kernel, the rounding's remainder "
        "rounded again: two int8 terms per input, KL 1.5e-5 from the exact model), fp32 (the "
        "file's blocks times fp32 activations: the exact reference, slowest) or auto (int8x2 where "
        "every matrix of the file is such a block and the engine runs on one CPU rank in float32, "
        "else fp32; docs/gguf.md)",
        choices=GGUF_ACTIVATIONS,
    )
    tensor_parallel_size: int = option(
        1,
        "shard the model over N ranks (worker processes; gloo on CPU, NCCL on CUDA; "
        "docs/parallel.md)",
        ge=1,
    )
    # kvserve.threads.ThreadPoolSizer
    thread_policy: str = option(
        "adaptive",
        "adaptive: on CPU, steps use one thread fewer while a neighbour takes CPU time from "
        "the engine's threads, trying the full count again now and then; fixed: always "
        'torch\'s thread count (docs/performance.md "Threads")',
        choices=THREAD_POLICIES,
    )
    kernel_choice: str = option(
        "measured",
        "which GEMM runs each linear at each row count on CPU: measured (kvserve's kernels vs "
        "torch's, timed at load within ~2 s and cached per machine), remeasure (ignore the "
        "cache), own (kvserve's kernels and fixed rules), torch (torch's GEMM where valid); "
        'docs/performance.md "Choosing the kernel per shape"',
        choices=KERNEL_CHOICES,
    )
    # the compile's worker process is killed past it (kvserve.structured.compile_worker)
    grammar_compile_timeout_s: float = option(
        GRAMMAR_COMPILE_TIMEOUT_S,
        "seconds a structured-output grammar may compile; past it the compile is stopped and its "
        "request gets a 400 (docs/structured-output.md)",
        gt=0,
    )
    # the hosts the tensor-parallel ranks span (docs/parallel.md, "Across hosts"); one by default
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        check_options(self)
        if self.dist.multi_node:
            self.dist.ranks_per_node(self.tensor_parallel_size)  # raises unless K divides N
        if self.tensor_parallel_size > 1:
            self.model.check_tensor_parallel(self.tensor_parallel_size)  # before anything starts
        _ = self.weight_scheme  # parsed once, here: a bad string raises QuantizationError naming it
        self._check_quantization_method()
        if self.gguf_activations == "auto":  # decided once, here: every process reads the decision
            object.__setattr__(self, "gguf_activations", self._auto_gguf_activations())
        if self.scheduler.max_prompt_tokens_beside_decode is None:
            cap = self._default_prompt_cap()
            scheduler = replace(self.scheduler, max_prompt_tokens_beside_decode=cap)
            object.__setattr__(self, "scheduler", scheduler)

    def _auto_gguf_activations(self) -> str:
        """int8x2 for a GGUF model run as it is (no --quantization) on one CPU rank in float32 whose
        every matrix is a type the integer panel kernel runs (not int8: its rounding flips the
        default model's answer to the README's question); fp32 (the exact path) otherwise:
        tensor parallelism dequantises the blocks, the panel kernel is CPU code, and a file with
        other types (K-quants) would mix int8 rounding with fp32 kernels whose sums change with a
        step's row count, so its outputs would change with batching (docs/gguf.md)."""
        types = gguf_matrix_types(self.model_dir)
        runs_blocks = self.quantization is None and self.tensor_parallel_size == 1
        on_cpu_fp32 = self.device == "cpu" and self.dtype == "float32"
        if runs_blocks and on_cpu_fp32 and types and all(t in PANEL_FORMATS for t in types):
            return "int8x2"
        return "fp32"

    def _default_prompt_cap(self) -> int:
        """`PROMPT_CAP_ON_INTEGER_PRODUCTS` for a GGUF model whose products run on the integer panel
        kernel: there a step's time grows with its prompt tokens, and a whole 128-token prompt
        beside the decoding rows held their next token ~0.4 s (int8x2); capped, 0.92 of 1 request a
        second met TTFT <= 2 s and gaps <= 500 ms against 0.13-0.37 uncapped, at the same
        saturation and the same greedy texts (docs/performance.md). 0 (the whole budget)
        elsewhere."""
        on_integer_kernel = self.gguf_activations in ("int8", "int8x2")
        return (
            PROMPT_CAP_ON_INTEGER_PRODUCTS
            if on_integer_kernel and gguf_matrix_types(self.model_dir)
            else 0
        )

    @cached_property
    def weight_scheme(self) -> WeightScheme | None:
        """`quantization` parsed, once for this config (it travels with it to the core and the
        ranks); None when nothing is quantised at load."""
        return None if self.quantization is None else parse_weight_scheme(self.quantization)

    def _check_quantization_method(self) -> None:
        method = self.quantization_method
        if method == DEFAULT_METHOD:
            if self.calib is not None:
                raise QuantizationError(
                    "--calib is for a calibrated --quantization-method (gptq, awq, smoothquant); "
                    "round to nearest uses none"
                )
            return
        if self.quantization is None:
            raise QuantizationError(
                f"--quantization-method {method} needs --quantization (the format it produces)"
            )
        check_method(self.weight_scheme, method)  # unknown or mismatched
        if self.calib is None:
            raise QuantizationError(f"{method} needs calibration text: pass --calib FILE")
        if self.tensor_parallel_size > 1:
            raise QuantizationError(
                f"--quantization-method {method} runs on one rank: quantise with `kvserve "
                "quantize` and serve the written directory with --tensor-parallel-size"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes per token slot on one device: the target's (one tensor-parallel rank's KV
        heads), plus the draft model's (it shares the block ids; it runs on rank 0 only)."""
        kv_dtype = self.cache.kv_cache_dtype
        tp = self.tensor_parallel_size
        # n_kv / N heads per rank, or one replicated head when N > n_kv (docs/parallel.md)
        rank_model = replace(self.model, num_kv_heads=max(1, self.model.num_kv_heads // tp))
        # a block of a hybrid layout holds one group's layers (kv/groups.py), else every layer
        total = rank_model.kv_bytes_per_token(self.dtype, kv_dtype, self.kv_layout.group_size)
        if self.speculative is not None and self.speculative.draft_model is not None:
            total += self.speculative.draft_model.kv_bytes_per_token(self.dtype, kv_dtype)
        return total

    @property
    def kv_layout(self) -> KVLayout:
        """The KV groups (kv/groups.py): hybrid for a model with full and window layers, unless
        --no-hybrid-kv-cache or tensor parallelism (whose ranks take one block table) say otherwise."""
        if not self.cache.hybrid or self.tensor_parallel_size > 1:
            return single_layout(self.model.num_layers)
        return plan_layout(self.model.layer_windows, self.scheduler.max_model_len)

    @property
    def num_blocks(self) -> int:
        return self.cache.resolve_num_blocks(self.kv_bytes_per_token)
