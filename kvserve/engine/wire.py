"""The typed messages between the front end (EngineClient) and an engine core (docs/engine_core.md).

Every message is a frozen msgspec Struct, tagged so one decoder reads the union; over ZMQ they travel as
MessagePack. The same objects are used in-process (the in-process client hands them over directly).

Front end -> core: `AddCmd`, `AbortCmd`, `UtilityCmd`, `ShutdownCmd`. A request is checked once, when
the core adds it: `CoreOutputs.accepted` names it, or `CoreOutputs.failures` says why not.
Core -> front end: `Ready` (once, with the static `EngineInfo`), `CoreOutputs` (after every step or batch
of commands: per-step deltas, failures, stats, utility results), `Heartbeat` (every `HEARTBEAT_S`).

A core emits per-step deltas (`RequestDelta`), never cumulative copies: the front end accumulates them
(kvserve.engine.output_processor).
"""

from __future__ import annotations

import msgspec

from kvserve.core.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    KVServeError,
)
from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import GRAMMAR_COMPILE_TIMEOUT_S, SamplingParams

HEARTBEAT_S = 0.5


class EngineDeadError(KVServeError):
    """The engine loop (or its process) stopped; the server reports 503 from then on."""


class RequestFailedError(KVServeError):
    """An internal error while preparing or running this request only; the engine goes on (HTTP 500)."""


class EngineInfo(msgspec.Struct, frozen=True):
    """The static facts the front end needs about an engine core (sent once, at start-up)."""

    model_dir: str
    model_type: str
    dtype: str
    device: str
    quantization: str | None
    vocab_size: int
    num_layers: int
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    admission: str
    speculative: str  # "off" or a one-line summary
    tokenizer: str | None  # the tokenizer's identity (name_or_path), None: the model has none
    eos_token_ids: tuple[int, ...] = ()
    threads: str = ""  # the core's OpenMP threads and variables (kvserve.threads.describe_threads)
    # the core abandons a compile past this
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    weights: str = ""  # the weights' format (kvserve.quant.describe.describe_weights)
    kv_cache_sizing: str = ""  # how the KV cache's size was chosen (kvserve.kv_sizing)
    kv_cache_bytes: int = 0  # the runner's KV tensors
    kv_groups: str = ""  # a hybrid model's KV groups (kv/groups.py); "" for one table
    blocks_per_full_seq: int = 0  # the most blocks a full-length request holds at once
    # the native kernels quantised linears and bf16 products run on here (model/kernel_choice.py):
    # "" where the served weights have none; /manifest shows them
    kernel_isa: str = ""
    bf16_products: str = ""
    # the CPU's matrix engine ("amx-bf16", "none: cpu flag absent") and the GEMM each linear shape
    # runs per row bucket, {"576x1536/f32": {"1": "panel-f32", ...}} (model/kernel_table.py)
    matrix_engine: str = ""
    kernel_table: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot a core publishes after every step (read by /ready and /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    spec_num_verify_steps: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_num_emitted: int = 0
    spec_draft_time_s: float = 0.0
    spec_target_time_s: float = 0.0
    num_threads: int = 0  # the next step's threads (kvserve/threads.py ThreadPoolSizer)
    num_thread_changes: int = 0
    cpu_lost: float = 0.0  # run delay per thread-second, last window (ThreadPoolSizer.last_lost)
    # per KV group (kv/groups.py; one for most models): its kind ("full", "window512") and the
    # blocks its tables hold now
    kv_group_kinds: tuple[str, ...] = ()
    kv_group_blocks: tuple[int, ...] = ()


class FrozenMetrics(msgspec.Struct, frozen=True):
    """A sample's timestamps as of this step (engine monotonic clock, seconds) and the times of the
    tokens this step added."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    new_token_times: tuple[float, ...]


class SampleDelta(msgspec.Struct, frozen=True):
    """What one step added to one sample of a request."""

    index: int
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None
    new_text: str
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int
    num_spec_proposed: int
    num_spec_accepted: int
    structured_complete: bool | None
    metrics: FrozenMetrics


class RequestDelta(msgspec.Struct, frozen=True):
    request_id: str
    samples: tuple[SampleDelta, ...]
    finished: bool


class Failure(msgspec.Struct, frozen=True):
    """A request that failed in the core: `kind` names the error class (see `error_from_wire`)."""

    request_id: str
    kind: str
    message: str
    param: str | None = None


class AddCmd(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None
    arrival_time: float
    group: str | None = None  # the client request it belongs to (fair admission)


class AbortCmd(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class UtilityCmd(msgspec.Struct, frozen=True, tag=True):
    """A named maintenance call, answered in `CoreOutputs.results` with the same `call_id`."""

    call_id: int
    method: str  # reset_prefix_cache | debug_engine | warm_up
    args: list = []


class ShutdownCmd(msgspec.Struct, frozen=True, tag=True):
    pass


class UtilityResult(msgspec.Struct, frozen=True):
    call_id: int
    value: object = None
    error: Failure | None = None


class StepRow(msgspec.Struct, frozen=True):
    t_start_s: float
    waited_s: float
    commands_s: float
    step_s: float
    deliver_s: float
    # per chunk: (new tokens, start position, what it samples: 0 nothing, 1 the first output token,
    # 2 a later one; proposals verified) (kvserve/engine/step_log.py)
    chunks: tuple[tuple[int, int, int, int], ...]
    threads: int = 0  # the threads the step ran on


class CoreOutputs(msgspec.Struct, frozen=True, tag=True):
    accepted: list[str] = []  # requests added (checked: context, capacity, grammar), in order
    deltas: list[RequestDelta] = []
    failures: list[Failure] = []
    results: list[UtilityResult] = []
    stats: EngineStats | None = None
    num_admitted_samples: int = 0  # cumulative: samples the core took from its command queue
    num_waiting_samples: int = 0  # samples waiting inside the engine now
    step: StepRow | None = None
    grammar_compile_s: list[float] = []
    grammar_mask_s: list[float] = []
    dead_reason: str | None = None  # the core's loop stopped for good


class Ready(msgspec.Struct, frozen=True, tag=True):
    info: EngineInfo
    pid: int


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    pid: int


ToCore = AddCmd | AbortCmd | UtilityCmd | ShutdownCmd
FromCore = CoreOutputs | Ready | Heartbeat


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


_ERRORS: dict[str, type[KVServeError]] = {
    "invalid": InvalidRequestError,
    "context_length": ContextLengthError,
    "capacity": CapacityError,
}


def failure_of(request_id: str, exc: BaseException) -> Failure:
    """An exception raised in the core, as a wire Failure."""
    for kind, cls in (
        ("context_length", ContextLengthError),
        ("capacity", CapacityError),
        ("invalid", InvalidRequestError),
        ("dead", EngineDeadError),
        ("request_failed", RequestFailedError),
    ):
        if isinstance(exc, cls):
            return Failure(request_id, kind, str(exc), getattr(exc, "param", None))
    if isinstance(exc, KVServeError):
        return Failure(request_id, "kvserve", str(exc))
    return Failure(request_id, "request_failed", f"internal error: {exc!r}")


def error_from_wire(failure: Failure) -> KVServeError:
    if failure.kind in _ERRORS:
        return _ERRORS[failure.kind](failure.message, failure.param)
    if failure.kind == "dead":
        return EngineDeadError(failure.message)
    if failure.kind == "request_failed":
        return RequestFailedError(failure.message)
    return KVServeError(failure.message)
