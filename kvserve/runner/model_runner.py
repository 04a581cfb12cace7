"""The model runner: owns the weights, the KV tensors and per-request sampling state.

It turns a `SchedulerOutput` into input tensors once per step, runs the forward pass, computes logits only for
the rows that sample, and samples (or verifies proposals, then proposes again). It never imports the
scheduler: each request's block tables are rebuilt here from the changes that arrive in the output it is
given (core/block_tables.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.core.block_tables import BlockTables
from kvserve.core.outputs import (
    NewRequestData,
    RunnerOutput,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
)
from kvserve.model.attention import get_attention_backend
from kvserve.model.loader import TORCH_DTYPES, load_model
from kvserve.runner.batch import RequestState, build_sampling_batch
from kvserve.runner.constraints import MaskRow, apply_grammar_masks, commit_tokens
from kvserve.runner.draft import DraftModel
from kvserve.runner.forward import allocate_kv_cache, forward_chunks
from kvserve.runner.sampler import (
    Sampler,
    SamplingBatch,
    greedy_argmax,
    invert_cdf,
    peek_uniforms,
)
from kvserve.runner.spec_decode import DraftJob, NgramProposer, verify_greedy, verify_stochastic
from kvserve.structured.grammar import GrammarCache
from kvserve.threads import RunDelayMeter, ThreadPoolSizer

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Cumulative speculative-decoding counters (the engine reports them)."""

    num_verify_steps: int = 0  # chunks that verified at least one proposal
    num_proposed: int = 0
    num_accepted: int = 0
    num_rejections: int = 0  # verifying chunks that stopped at a rejected proposal
    num_emitted: int = 0  # tokens committed by verifying chunks
    draft_time_s: float = 0.0
    target_time_s: float = 0.0  # target forwards in steps that verified proposals


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.max_model_len = config.scheduler.max_model_len
        self.model = self._load_model()
        dtype = TORCH_DTYPES[config.dtype]
        self.attention = get_attention_backend(config.attention_backend, self.device, dtype)
        if config.attention_backend == "torch":  # the pure-torch reference path throughout
            self.model.use_cpu_kernels(False)
        self.vocab_size = config.model.vocab_size
        self.layout = config.kv_layout  # kv/groups.py: one block table, or one per group
        self.block_tables = BlockTables(len(self.layout.groups))  # per request, from the changes
        self.kv_tensors, self.kv_caches = allocate_kv_cache(
            self.model,
            num_blocks,
            self.block_size,
            dtype,
            self.device,
            config.cache.kv_cache_dtype,
            self.layout,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.states: dict[str, RequestState] = {}
        spec = config.speculative
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.ngram = (
            NgramProposer(spec.ngram_min, spec.ngram_max)
            if spec and spec.method == "ngram"
            else None
        )
        self.draft = None
        if spec is not None and spec.method == "draft":
            self.draft = DraftModel(config, num_blocks, self.attention, self.vocab_size)
        self.spec_stats = SpecStats()
        self.grammars: GrammarCache | None = None  # set by the engine when a request needs one
        self.grammar_mask_times_s: deque[float] = deque(maxlen=4096)  # per step; drained by metrics
        self.thread_pool = self._thread_pool_sizer()
        self.last_step_threads = torch.get_num_threads()

    def _thread_pool_sizer(self) -> ThreadPoolSizer | None:
        """The adaptive thread policy's sizer (kvserve/threads.py), for one CPU rank with 2+ threads
        on a kernel that reports run delay; else None (every step on torch's thread count)."""
        config = self.config
        if (
            config.thread_policy != "adaptive"
            or self.device.type != "cpu"
            or config.tensor_parallel_size != 1
            or torch.get_num_threads() < 2
        ):
            return None
        meter = RunDelayMeter()
        if not meter.available:
            logger.info("thread policy adaptive: no run delay to read here; steps use all threads")
            return None
        return ThreadPoolSizer(torch.get_num_threads(), meter)

    @property
    def num_threads(self) -> int:
        """The threads the next step uses (the sizer's count: torch's is per calling thread)."""
        return torch.get_num_threads() if self.thread_pool is None else self.thread_pool.threads

    @property
    def num_thread_changes(self) -> int:
        return 0 if self.thread_pool is None else self.thread_pool.num_changes

    @property
    def cpu_lost(self) -> float:
        """The last window's share of step thread-time lost to other processes (0 if unmeasured)."""
        return 0.0 if self.thread_pool is None else self.thread_pool.last_lost or 0.0

    def _load_model(self):
        """The target model this process runs (a tensor-parallel runner loads its rank's shard)."""
        config = self.config
        return load_model(
            config.model_dir,
            config.model,
            max_positions=config.scheduler.max_model_len,
            dtype=config.dtype,
            device=config.device,
            quantization=config.weight_scheme,
            quantization_method=config.quantization_method,
            calib=config.calib,
            gguf_activations=config.gguf_activations,
            kernel_choice=config.kernel_choice,
        )

    def _forward(
        self, chunks: Sequence[ScheduledChunk], tables: BlockTables, rows: list[int] | None
    ) -> torch.Tensor:
        """The target's forward over the chunks, through their requests' block tables in `tables` ->
        logits [len(rows), V] (rows None: every row). A tensor-parallel runner sends the same input
        to its other ranks first."""
        return forward_chunks(
            self.model,
            self.kv_caches,
            self.attention,
            [self._span(c, tables.get(c.request_id)) for c in chunks],
            self.block_size,
            self.device,
            rows,
            self.layout,
        )

    def _span(self, chunk: ScheduledChunk, tables: list[list[int]]) -> tuple:
        """What `forward_chunks` takes of a chunk: its block table, or every group's (hybrid)."""
        return (chunk.start_position, chunk.token_ids, tables if self.layout.hybrid else tables[0])

    def shutdown(self) -> None:
        """Release what outlives the runner object (worker processes, in a tensor-parallel one)."""

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_tensors)

    @property
    def kv_bytes_per_token(self) -> int:
        """Measured from the allocated target tensors, not from the formula."""
        return self.kv_cache_bytes // (self.num_blocks * self.block_size)

    def add_request(self, new: NewRequestData) -> None:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.sampling_params.seed)
        state = RequestState(
            new.sampling_params, new.prompt_token_ids, new.eos_token_ids, generator, new.max_tokens
        )
        if new.sampling_params.structured is not None:
            state.grammar = self.grammars.matcher(new.sampling_params.structured)
            state.json_grammar = self.grammars.bans_control_tokens(new.sampling_params.structured)
        self.states[new.request_id] = state

    # --- one step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        # The block tables first: the scheduler counts this step's changes as seen even if preparing
        # a request below fails the step.
        self._apply_tables(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.add_request(new)
        for request_id in scheduler_output.preempted_request_ids:
            self.states[request_id].draft_num_computed = 0  # its blocks are gone
        chunks = scheduler_output.chunks
        if not chunks:
            return RunnerOutput(sampled=())
        started = time.perf_counter()
        self.last_step_threads = torch.get_num_threads()
        try:
            return self._execute(chunks)
        finally:
            if self.thread_pool is not None:
                threads = self.thread_pool.observe(time.perf_counter() - started)
                if threads != self.last_step_threads:
                    torch.set_num_threads(threads)

    def _apply_tables(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the tables of finished and preempted requests, then apply each chunk's change."""
        tables = self.block_tables
        for request_id in scheduler_output.finished_request_ids:
            tables.drop(request_id)
        for request_id in scheduler_output.preempted_request_ids:
            tables.drop(request_id)
        for chunk in scheduler_output.chunks:
            tables.apply_chunk(chunk)

    def _execute(self, chunks: tuple[ScheduledChunk, ...]) -> RunnerOutput:
        sampling = [c for c in chunks if c.sample]
        rows, row = [], 0
        for chunk in chunks:
            row += chunk.num_tokens
            if chunk.sample:  # the last committed token and each proposal predict a token
                rows.extend(range(row - 1 - chunk.num_spec_tokens, row))
        start = time.perf_counter()
        logits = self._forward(chunks, self.block_tables, rows)
        if any(c.num_spec_tokens for c in sampling):
            self.spec_stats.target_time_s += time.perf_counter() - start
        results = self._sample(logits, sampling)
        proposals = self._propose(sampling) if self.num_speculative_tokens else {}
        return RunnerOutput(
            sampled=tuple(
                SampledTokens(
                    chunk.request_id,
                    tokens,
                    logprobs,
                    num_accepted,
                    tuple(proposals.get(chunk.request_id, ())),
                    stop,
                )
                for chunk, (tokens, logprobs, num_accepted, stop) in zip(
                    sampling, results, strict=True
                )
            )
        )

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[tuple]:
        """Per sampling chunk: (committed tokens, logprobs or None, number of accepted proposals,
        whether its grammar terminated)."""
        results: list = [None] * len(chunks)
        plain = [i for i, c in enumerate(chunks) if not c.num_spec_tokens]
        first_rows = [0]
        for chunk in chunks:
            first_rows.append(first_rows[-1] + 1 + chunk.num_spec_tokens)
        if plain:
            plain_rows = [first_rows[i] for i in plain]
            if plain_rows == list(range(logits.shape[0])):  # no proposals this step: every row
                plain_logits = logits  # [S, V] (the sampler never writes its input)
            else:  # one gather, not a Python-list index (~150 us at batch 1)
                plain_rows_t = torch.tensor(plain_rows, device=logits.device)
                plain_logits = logits.index_select(0, plain_rows_t)
            if all(
                self.states[chunks[i].request_id].plain_greedy(chunks[i].num_output_tokens)
                for i in plain
            ):
                # Every row is the argmax of its raw logits: no sampling tensors to build, and
                # the same tokens the sampler's greedy path gives (nothing would process them).
                token_ids = greedy_argmax(plain_logits).tolist()
                logprobs = [None] * len(plain)
            else:
                keys = [(chunks[i].request_id, 0, chunks[i].num_output_tokens) for i in plain]
                token_ids, logprobs = self.sampler(plain_logits, self.sampling_batch(keys))
            for i, token_id, logprob in zip(plain, token_ids, logprobs, strict=True):
                results[i] = ((token_id,), None if logprob is None else (logprob,), 0)
        for i, chunk in enumerate(chunks):
            if chunk.num_spec_tokens:
                results[i] = self._verify(chunk, logits[first_rows[i] : first_rows[i + 1]])
        for i, (chunk, (tokens, logprobs, num_accepted)) in enumerate(
            zip(chunks, results, strict=True)
        ):
            state = self.states[chunk.request_id]
            if len(state.output_token_ids) != chunk.num_output_tokens:  # the scheduler's count
                raise RuntimeError(
                    f"{chunk.request_id}: the runner holds {len(state.output_token_ids)} output "
                    f"tokens, the scheduler {chunk.num_output_tokens}"
                )
            keep = None if state.grammar is None else commit_tokens(state.grammar, tokens)
            if keep is not None:  # the grammar ended at tokens[keep - 1]: nothing after it
                tokens = tokens[:keep]
                logprobs = None if logprobs is None else logprobs[:keep]
            state.output_token_ids.extend(tokens)
            results[i] = (tokens, logprobs, num_accepted, keep is not None)
        return results

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> tuple:
        """Verify one chunk's proposals against the target logits of its last s + 1 positions."""
        state = self.states[chunk.request_id]
        num_spec = chunk.num_spec_tokens
        proposals = torch.tensor(chunk.token_ids[-num_spec:], device=self.device)
        batch = self.sampling_batch(
            [(chunk.request_id, j, chunk.num_output_tokens + j) for j in range(num_spec + 1)],
            lookahead=tuple(proposals.tolist()),
        )
        processed, probs = self.sampler.prepare(logits, batch)
        if state.params.greedy:
            num_accepted, final = verify_greedy(processed.argmax(dim=-1)[None], proposals[None])
        elif state.generator is not None:
            # A seeded request: each position's token is the target's own draw with that position's
            # uniform, the one it would take without speculation; proposals are accepted while
            # they equal it (a draft proposes with the same uniforms, so it often does). The output
            # is then the non-speculative one whatever the batch, the budget or preemption did to
            # the proposals (rejection sampling would advance the generator by a number of draws
            # that depends on them).
            drawn = invert_cdf(probs, peek_uniforms(state.generator, num_spec + 1))
            num_accepted, final = verify_greedy(drawn[None], proposals[None])
            torch.rand(  # the stream advances by the emitted tokens only, as without speculation
                int(num_accepted[0]) + 1,
                generator=state.generator,
                dtype=torch.float64,
                device=self.device,
            )
        else:
            if state.draft_probs is not None:
                q = state.draft_probs[:num_spec]
            else:  # n-gram proposals are deterministic: q is a point mass on each proposal
                q = torch.nn.functional.one_hot(proposals, probs.shape[-1]).to(probs.dtype)
            generator = state.generator or self.sampler.generator
            uniforms = torch.rand(1, num_spec, generator=generator, device=self.device)
            num_accepted, final = verify_stochastic(
                probs[None],
                q[None],
                proposals[None],
                uniforms,
                [state.generator],
                self.sampler.generator,
            )
        k = int(num_accepted[0])
        tokens = tuple(chunk.token_ids[-num_spec:][:k]) + (int(final[0]),)
        logprobs = None
        if state.params.logprobs is not None:
            emitted = torch.tensor(tokens, device=self.device)
            logprobs = tuple(
                self.sampler.logprobs(logits[: k + 1], emitted, [state.params.logprobs] * (k + 1))
            )
        stats = self.spec_stats
        stats.num_verify_steps += 1
        stats.num_proposed += num_spec
        stats.num_accepted += k
        stats.num_rejections += k < num_spec
        stats.num_emitted += k + 1
        return tokens, logprobs, k

    def _propose(self, chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        """Proposals for the next step of every speculating request that just committed tokens."""
        start = time.perf_counter()
        jobs, keys = [], []
        for chunk in chunks:
            state = self.states[chunk.request_id]
            state.draft_probs = None
            if not state.speculates:
                continue
            tokens = state.token_ids
            num = min(
                self.num_speculative_tokens,
                state.max_tokens - len(state.output_token_ids) - 1,  # the step also emits one
                self.max_model_len - len(tokens),  # the verifying chunk must fit the context
            )
            if num > 0:
                table = self.block_tables.get(chunk.request_id)[0]  # read in this step only
                jobs.append(DraftJob(tokens, state.draft_num_computed, table, num))
                keys.append(chunk.request_id)
        proposals: dict[str, list[int]] = {}
        if self.ngram is not None:
            for key, job in zip(keys, jobs, strict=True):
                proposals[key] = self.ngram.propose(job.token_ids, job.num_tokens)
                # A proposal the grammar refuses could never be accepted: cut it (and what follows).
                matcher = self.states[key].grammar
                if matcher is not None:
                    proposals[key] = _grammar_prefix(matcher, proposals[key])
        elif self.draft is not None and jobs:
            drafted = self.draft.propose(jobs, keys, self._sample_draft_rows)
            for key, job, (tokens, q) in zip(keys, jobs, drafted, strict=True):
                state = self.states[key]
                if state.grammar is not None:  # drafting advanced the matcher: back to committed
                    if state.num_draft_grammar_tokens:
                        state.grammar.rollback(state.num_draft_grammar_tokens)
                    tokens = tokens[: state.num_draft_grammar_tokens]  # none after its end
                    q = None if q is None else q[: len(tokens)]
                    state.num_draft_grammar_tokens = 0
                proposals[key] = tokens
                state.draft_probs = None if state.params.greedy else q
                # Only committed positions stay valid; the last committed token is recomputed next time.
                state.draft_num_computed = len(job.token_ids) - 1
        if jobs:  # proposing costs time with either proposer (n-gram lookup runs in Python)
            self.spec_stats.draft_time_s += time.perf_counter() - start
        return proposals

    def _sample_draft_rows(self, logits: torch.Tensor, keys: list) -> tuple:
        """Draft logits -> (tokens, q): the same processing the target's verification applies."""
        rows = []
        for request_id, step in keys:
            state = self.states[request_id]
            rows.append((request_id, step, len(state.output_token_ids) + step))
        batch = self.sampling_batch(rows)
        processed, probs = self.sampler.prepare(logits, batch)
        # A seeded request drafts with the uniform the target's verification will use at that
        # position, peeked: its generator advances by emitted tokens only (`_verify`).
        uniforms = {}
        if probs is not None:
            for i, (request_id, step) in enumerate(keys):
                state = self.states[request_id]
                if state.generator is not None and not state.params.greedy:
                    uniforms[i] = float(peek_uniforms(state.generator, step + 1)[step])
        tokens = self.sampler.sample(processed, probs, batch, uniforms)
        for (request_id, _), token in zip(keys, tokens.tolist(), strict=True):
            # Later draft steps must see the grammar state after this proposal.
            state = self.states[request_id]
            matcher = state.grammar
            if matcher is not None and not matcher.is_terminated() and matcher.accept_token(token):
                state.num_draft_grammar_tokens += 1
        return tokens, probs

    def sampling_batch(
        self, rows: list[tuple[str, int, int]], lookahead: tuple[int, ...] = ()
    ) -> SamplingBatch:
        """rows: (request id, position offset, output tokens before that row's token) per logits row.
        `lookahead`: the proposals that rows at offset j > 0 follow (their grammar state accepts them)."""
        return build_sampling_batch(
            [
                (self.states[request_id], offset, num_output)
                for request_id, offset, num_output in rows
            ],
            lookahead,
            self.vocab_size,
            self.device,
            self._apply_grammar,
        )

    def _apply_grammar(self, logits: torch.Tensor, mask_rows: list[MaskRow]) -> None:
        self.grammar_mask_times_s.append(apply_grammar_masks(self.grammars, logits, mask_rows))

    # --- scoring ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, chunks: tuple[ScheduledChunk, ...]) -> torch.Tensor:
        """Logits [T, V] for every position of the chunks (evaluation and cache-equivalence checks),
        outside any step: each chunk sends its tables whole, kept for this call only."""
        tables = BlockTables(self.block_tables.num_groups)
        for chunk in chunks:
            tables.apply_chunk(chunk)
        return self._forward(chunks, tables, None)


def _grammar_prefix(matcher, token_ids: list[int]) -> list[int]:
    """The longest prefix of `token_ids` the grammar accepts from its current state (state unchanged)."""
    accepted = 0
    for token_id in token_ids:
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return token_ids[:accepted]
