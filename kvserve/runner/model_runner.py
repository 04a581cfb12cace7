"""The model runner: owns the weights, the KV tensors and per-request sampling state.

It turns a `SchedulerOutput` into input tensors once per step, runs the forward pass, computes logits only for
the rows that sample, and samples. It never imports the scheduler: block ids arrive in the output it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.config import EngineConfig
from kvserve.core.outputs import (
    NewRequestData,
    RunnerOutput,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
)
from kvserve.core.sampling_params import SamplingParams
from kvserve.model.attention import build_attention_metadata, get_attention_backend
from kvserve.model.loader import TORCH_DTYPES, load_model
from kvserve.runner.sampler import Sampler, SamplingBatch


@dataclass
class RequestState:
    """What the runner remembers of a request between steps (until it finishes; preemption keeps it)."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, num_blocks: int, attention_backend: str = "torch"
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.model = load_model(
            config.model_dir,
            config.model,
            max_positions=config.scheduler.max_model_len,
            dtype=config.dtype,
            device=config.device,
        )
        self.attention = get_attention_backend(attention_backend)
        self.vocab_size = config.model.vocab_size
        model = config.model
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            model.num_layers,
            2,
            num_blocks,
            self.block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype=TORCH_DTYPES[config.dtype],
            device=self.device,
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler(config.seed, self.device)
        self.states: dict[str, RequestState] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """Measured from the allocated tensors, not from the formula."""
        return self.kv_cache_bytes // (self.num_blocks * self.block_size)

    def add_request(self, new: NewRequestData) -> None:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.sampling_params.seed)
        self.states[new.request_id] = RequestState(
            new.sampling_params, new.prompt_token_ids, new.eos_token_ids, generator
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.add_request(new)
        chunks = scheduler_output.chunks
        if not chunks:
            return RunnerOutput(sampled=())
        logits, sampling_chunks = self.forward_logits(chunks)
        if not sampling_chunks:
            return RunnerOutput(sampled=())
        token_ids, logprobs = self.sampler(logits, self.sampling_batch(sampling_chunks))
        sampled = []
        for chunk, token_id, logprob in zip(sampling_chunks, token_ids, logprobs, strict=True):
            self.states[chunk.request_id].output_token_ids.append(token_id)
            sampled.append(
                SampledTokens(
                    chunk.request_id, (token_id,), None if logprob is None else (logprob,)
                )
            )
        return RunnerOutput(sampled=tuple(sampled))

    @torch.inference_mode()
    def score(self, chunks: tuple[ScheduledChunk, ...]) -> torch.Tensor:
        """Logits [T, V] for every position of the chunks (evaluation and cache-equivalence checks)."""
        return self.forward_logits(chunks, every_position=True)[0]

    def forward_logits(
        self, chunks: tuple[ScheduledChunk, ...], every_position: bool = False
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run the model over every chunk; logits [S, V] for the last position of each sampling chunk."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        for chunk in chunks:
            input_ids.extend(chunk.token_ids)
            positions.append(torch.arange(chunk.start_position, chunk.context_len))
            if chunk.sample:
                logit_rows.append(len(input_ids) - 1)
                sampling_chunks.append(chunk)
        meta = build_attention_metadata(
            [(c.start_position, c.num_tokens, list(c.block_ids)) for c in chunks],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.cat(positions).to(self.device),
            self.kv_caches,
            meta,
            self.attention,
        )
        if every_position:
            return self.model.compute_logits(hidden), sampling_chunks
        rows = torch.tensor(logit_rows, device=self.device, dtype=torch.long)
        return self.model.compute_logits(hidden[rows]), sampling_chunks

    def sampling_batch(self, chunks: list[ScheduledChunk]) -> SamplingBatch:
        states = [self.states[c.request_id] for c in chunks]
        params = [s.params for s in states]
        device = self.device

        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        batch = SamplingBatch(
            temperature=column([0.0 if p.greedy else p.temperature for p in params]),
            top_k=column([p.top_k for p in params], torch.long),
            top_p=column([p.top_p for p in params]),
            min_p=column([p.min_p for p in params]),
            generators=[s.generator for s in states],
            num_logprobs=[p.logprobs for p in params],
        )
        bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            rows, ids, values = zip(*bias, strict=True)
            batch.bias = (column(rows, torch.long), column(ids, torch.long), column(values))
        banned = [
            (row, t)
            for row, (chunk, state) in enumerate(zip(chunks, states, strict=True))
            if chunk.num_output_tokens < state.params.min_tokens
            for t in self._stop_ids(state)
        ]
        if banned:
            rows, ids = zip(*banned, strict=True)
            batch.banned = (column(rows, torch.long), column(ids, torch.long))
        if any(_has_penalty(p) for p in params):
            self._add_penalties(batch, states)
        return batch

    def _stop_ids(self, state: RequestState) -> list[int]:
        ids = set(state.params.stop_token_ids)
        if not state.params.ignore_eos:
            ids |= state.eos_token_ids
        return [t for t in ids if t < self.vocab_size]

    def _add_penalties(self, batch: SamplingBatch, states: list[RequestState]) -> None:
        num_rows, vocab, device = len(states), self.vocab_size, self.device
        counts = torch.zeros(num_rows, vocab, device=device)
        prompt_mask = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        for row, state in enumerate(states):
            if state.output_token_ids:
                out = torch.tensor(state.output_token_ids, device=device)
                counts[row].index_add_(0, out, torch.ones(len(out), device=device))
            if state.params.repetition_penalty != 1.0:
                prompt_mask[row, torch.tensor(state.prompt_token_ids, device=device)] = True
        params = [s.params for s in states]
        batch.output_counts = counts
        batch.prompt_mask = prompt_mask
        batch.repetition_penalty = torch.tensor(
            [p.repetition_penalty for p in params], device=device
        )
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
