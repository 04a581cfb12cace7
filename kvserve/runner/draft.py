"""The draft-model proposer: a second, smaller checkpoint with the same tokenizer.

It shares the target's block ids (the KV manager allocates lookahead slots for it) and keeps KV tensors of its
own. Before proposing for a request it catches up on the committed tokens it has not seen, then proposes
autoregressively. Its cache entries past the committed tokens are speculative and are simply recomputed next
time: the draft counts as computed only the positions the target has committed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.config import EngineConfig
from kvserve.model.attention import AttentionBackend
from kvserve.model.loader import TORCH_DTYPES, load_model
from kvserve.runner.forward import allocate_kv_cache, forward_chunks
from kvserve.runner.spec_decode import DraftJob

# (logits [R, V], one key per row) -> (tokens [R], probabilities [R, V] or None for greedy rows)
SampleRows = Callable[[torch.Tensor, list], tuple[torch.Tensor, torch.Tensor | None]]


class DraftModel:
    def __init__(
        self, config: EngineConfig, num_blocks: int, attention: AttentionBackend, vocab_size: int
    ) -> None:
        spec = config.speculative
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = (
            vocab_size  # the target's: proposals and q live in the target's vocabulary
        )
        self.model = load_model(
            spec.draft_model_dir,
            spec.draft_model,
            max_positions=config.scheduler.max_model_len,
            dtype=config.dtype,
            device=config.device,
        )
        self.attention = attention
        if config.attention_backend == "torch":
            self.model.use_cpu_kernels(False)
        self.kv_tensors, self.kv_caches = allocate_kv_cache(
            self.model,
            num_blocks,
            self.block_size,
            TORCH_DTYPES[config.dtype],
            self.device,
            config.cache.kv_cache_dtype,
        )

    def _forward(
        self, chunks: list[tuple[int, list[int], list[int]]], rows: list[int]
    ) -> torch.Tensor:
        logits = forward_chunks(
            self.model, self.kv_caches, self.attention, chunks, self.block_size, self.device, rows
        )
        vocab = logits.shape[-1]
        if vocab < self.vocab_size:  # padded embedding tables may differ in size; ids mean the same
            pad = logits.new_full((logits.shape[0], self.vocab_size - vocab), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        return logits[:, : self.vocab_size]

    def propose(
        self, jobs: list[DraftJob], keys: list, sample_rows: SampleRows
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each job: (proposed tokens, their q rows [n, V] or None when greedy). `keys[i]` identifies
        job i for `sample_rows`, which applies that request's sampling processing to a row of logits."""
        results: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in jobs]
        chunks, rows, row = [], [], -1
        for (
            job
        ) in jobs:  # catch up on committed tokens; the last position predicts the first proposal
            chunks.append((job.num_computed, job.token_ids[job.num_computed :], job.block_ids))
            row += len(job.token_ids) - job.num_computed
            rows.append(row)
        active = list(range(len(jobs)))
        logits = self._forward(chunks, rows)
        for step in range(max(job.num_tokens for job in jobs)):
            tokens, probs = sample_rows(logits, [(keys[i], step) for i in active])
            for position, i in enumerate(active):
                results[i][0].append(int(tokens[position]))
                if probs is not None:
                    results[i][1].append(probs[position])
            active = [i for i in active if jobs[i].num_tokens > step + 1]
            if not active:
                break
            # Feed the proposal just made at its position: committed tokens occupy [0, L).
            chunks = [
                (len(jobs[i].token_ids) + step, [results[i][0][-1]], jobs[i].block_ids)
                for i in active
            ]
            logits = self._forward(chunks, list(range(len(active))))
        return [(toks, torch.stack(qs) if qs else None) for toks, qs in results]
