"""The scheduler: which tokens of which requests run in the next step. Torch-free.

There is no prefill phase and no decode phase: each request has `num_computed_tokens` and `num_tokens`, and a
step gives it up to the remaining token budget's worth of the difference (docs/scheduling.md). Running
requests are served first in arrival order; waiting requests are admitted FCFS while the budget,
`max_num_seqs` and the cache allow, except that samples of one client request (`Request.group`) yield to a
request with fewer running samples and never take the last free slot (docs/scheduling.md "Fairness"). With
`on_demand` admission a running request that cannot grow preempts the newest running request (recompute); with
`reserve` admission a request is admitted only when prompt + max_tokens fit, so nothing is ever preempted.

The scheduler owns each request's progress and end: it decides every stop and its reason in `update` (token
rules here; the grammar's end as the runner reports it; stop strings through the engine core's
`StopCheck`), and it fans a request with n > 1 samples out into n sequences. Samples 1..n-1 are held
back until sample 0 has sampled its first token (its prompt is computed), then queued; they share its
full prompt blocks by reference (with or without prefix caching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.config import SchedulerConfig
from kvserve.core.block_tables import TableSender
from kvserve.core.outputs import (
    NewRequestData,
    RequestUpdate,
    RunnerOutput,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
    StopCheck,
)
from kvserve.core.request import Request, RequestStatus
from kvserve.kv.manager import GroupBlocks, KVCacheManager


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # n > 1: samples 1..n-1 by sample 0's id, until sample 0 has sampled its first token
        self._held: dict[str, list[Request]] = {}
        self._finished_ids: list[str] = []  # told to the runner with the next step
        # what the runner holds of each request's block tables: a step sends only the change
        self.tables_sent = TableSender([g.window is not None for g in kv_manager.groups])
        self.stats = SchedulerStats()

    # --- queue ------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> list[str]:
        """Queue a request; one with n > 1 samples is fanned out (`Request.samples`). Returns the
        sample ids, which `RequestUpdate`s name."""
        samples = request.samples()
        if any(s.request_id in self.requests for s in samples):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        for sample in samples:
            self.requests[sample.request_id] = sample
        self.waiting.append(samples[0])
        if len(samples) > 1:
            self._held[samples[0].request_id] = samples[1:]
        return [s.request_id for s in samples]

    def _release_held(self, source_id: str) -> None:
        """Sample 0 has computed the prompt (or ended): its siblings join the queue."""
        self.waiting.extend(self._held.pop(source_id, ()))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string, timeout); frees their blocks."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.prompt_source_id in self._held and request in (
                held := self._held[request.prompt_source_id]
            ):
                held.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.tables_sent.forget(request.request_id)
        del self.requests[request.request_id]
        self._release_held(request.request_id)
        if request.first_scheduled_time is not None:
            self._finished_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        """Samples not yet admitted: the waiting queue plus n > 1 samples held back."""
        return len(self.waiting) + sum(len(h) for h in self._held.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step ---------------------------------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Long: one scheduling pass read top to bottom (running requests, preemption, admission), as
        vLLM's and nano-vllm's are."""
        budget = self.config.max_num_batched_tokens
        # Prompt work beside decoding rows is capped, so that a prompt does not stall their next token
        # for a whole prompt's time (docs/scheduling.md "Prompt tokens beside decoding rows").
        prompt_budget = budget
        if self.config.max_prompt_tokens_beside_decode and any(
            r.num_tokens - r.num_computed_tokens == 1 for r in self.running
        ):
            prompt_budget = self.config.max_prompt_tokens_beside_decode
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_left = request.num_tokens - request.num_computed_tokens
            num_new = min(num_left, budget, prompt_budget if num_left > 1 else budget)
            if num_new <= 0:
                index += 1
                continue
            num_spec = 0
            if num_new == request.num_tokens - request.num_computed_tokens == 1:
                # Caught up: verify the proposals too, as far as the budget allows.
                num_spec = min(len(request.spec_token_ids), budget - 1)
            lookahead = self._lookahead(request)
            while not self.kv.allocate_slots(request, num_new + num_spec, None, lookahead):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chunks.append(self._chunk(request, num_new, num_spec))
                budget -= num_new + num_spec
                if num_left > 1:
                    prompt_budget -= num_new
                index += 1
                continue
            break

        # Admitting while preempting would let a newcomer take the blocks just freed for a running request.
        running_by_group: dict[str, int] | None = None  # built at the first admission that needs it
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.group is not None:
                if running_by_group is None:
                    running_by_group = self._running_by_group()
                request = self._least_served(request, running_by_group)
                if running_by_group.get(request.group, 0) >= self._group_cap:
                    break  # the last slot stays free for another client's request
            computed_ids, num_cached = self._computed_prefix(request)
            num_left = request.num_tokens - num_cached
            num_new = min(num_left, budget, prompt_budget if num_left > 1 else budget)
            if num_new <= 0:
                break  # this step's prompt tokens are spent; it is admitted first next step
            lookahead = self._lookahead(request)
            if self.config.admission == "reserve":
                # Everything it may ever hold, proposer lookahead included: it will never need more.
                lookahead += request.max_num_tokens - num_cached - num_new
            if not self.kv.allocate_slots(request, num_new, computed_ids, lookahead):
                break  # nobody overtakes the one chosen: it is served as soon as the cache allows
            if request is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            if request.group is not None and running_by_group is not None:
                running_by_group[request.group] = running_by_group.get(request.group, 0) + 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_cached
                new_requests.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        request.eos_token_ids,
                        request.max_tokens,
                    )
                )
            self.running.append(request)
            chunks.append(self._chunk(request, num_new, whole=True))
            budget -= num_new
            if num_left > 1:
                prompt_budget -= num_new

        finished_ids = tuple(self._finished_ids)
        self._finished_ids.clear()
        self.stats.num_steps += 1
        return SchedulerOutput(
            new_requests=tuple(new_requests),
            chunks=tuple(chunks),
            finished_request_ids=finished_ids,
            preempted_request_ids=tuple(r.request_id for r in preempted),
        )

    def _computed_prefix(self, request: Request) -> tuple[GroupBlocks, int]:
        """Blocks a request being admitted need not compute: its prompt sibling's full prompt blocks
        (shared by reference, with or without prefix caching), else the longest prefix-cache hit."""
        hits, num_cached = self.kv.get_computed_blocks(request)
        source = self.requests.get(request.prompt_source_id or "")
        if source is not None and source.status is RequestStatus.RUNNING:
            block_size = self.kv.block_size
            # Full blocks of the shared prompt that the source has computed; the last prompt token
            # always stays to be computed (it yields the first sample).
            num_full = min(request.num_prompt_tokens - 1, source.num_computed_tokens) // block_size
            if num_full * block_size > num_cached:
                shared, num_shared = self.kv.shared_prefix(source.request_id, num_full)
                if num_shared > num_cached:
                    return shared, num_shared
        return hits, num_cached

    @property
    def _group_cap(self) -> int:
        """Running samples one client request may hold: all slots but one, which stays free for the
        next request to arrive (its first token then waits for no other request's samples)."""
        return max(1, self.config.max_num_seqs - 1)

    def _running_by_group(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for running in self.running:
            if running.group is not None:
                counts[running.group] = counts.get(running.group, 0) + 1
        return counts

    def _least_served(self, head: Request, running_by_group: dict[str, int]) -> Request:
        """Fair admission (docs/scheduling.md "Fairness"): the head of the queue, unless its client
        request already runs samples while another waits with fewer running; then the first waiting
        sample of the least-served request (ungrouped samples count as none running)."""
        best, best_count = head, running_by_group.get(head.group, 0)
        if best_count == 0:
            return head
        for request in self.waiting:
            count = 0 if request.group is None else running_by_group.get(request.group, 0)
            if count < best_count:
                best, best_count = request, count
                if count == 0:
                    break
        return best

    def _lookahead(self, request: Request) -> int:
        return self.config.num_lookahead_tokens if request.sampling_params.speculate else 0

    def _chunk(
        self, request: Request, num_new: int, num_spec: int = 0, whole: bool = False
    ) -> ScheduledChunk:
        """The chunk of `num_new` tokens (+ `num_spec` proposals); its block tables whole when the
        request was just admitted (the runner holds none for it), else what changed since the last."""
        start = request.num_computed_tokens
        token_ids = request.token_ids(start, start + num_new)
        tables = self.kv.group_block_ids(request.request_id)
        sent = self.tables_sent
        offset, new, released = (sent.whole if whole else sent.change)(request.request_id, tables)
        if num_spec:
            token_ids += tuple(request.spec_token_ids[:num_spec])
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            new_block_ids=new[0],
            sample=start + num_new == request.num_tokens,
            num_output_tokens=request.num_output_tokens,
            num_spec_tokens=num_spec,
            block_offset=offset,
            group_new_block_ids=new[1:],
            num_released_blocks=released,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self.tables_sent.forget(request.request_id)  # the runner drops its tables
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: RunnerOutput,
        stop_check: StopCheck | None = None,
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by its chunk, append sampled tokens, and decide every stop:
        EOS, stop token ids, length, the grammar's end (reported by the runner), and stop strings
        (`stop_check`, the engine core's detokenizer; None: no text, as in the simulator)."""
        sampled = {s.request_id: s for s in runner_output.sampled}
        updates: list[RequestUpdate] = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # ended between schedule and update
            request.num_computed_tokens += chunk.num_tokens
            result = sampled.get(chunk.request_id) if chunk.sample else None
            if chunk.num_spec_tokens:
                self._discard_rejected(request, chunk.num_spec_tokens - result.num_accepted)
            if not chunk.sample:
                self.kv.cache_full_blocks(request)
                continue
            new_token_ids, status, stop_reason = self._commit(request, result, stop_check)
            logprobs = result.logprobs[: len(new_token_ids)] if result.logprobs else None
            request.spec_token_ids = [] if status is not None else list(result.spec_token_ids)
            self.kv.cache_full_blocks(request)  # after the tokens of accepted proposals are known
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updates.append(
                RequestUpdate(
                    request_id=request.request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    finish_reason=status.finish_reason if status else None,
                    num_cached_tokens=request.num_cached_tokens,
                    num_spec_proposed=chunk.num_spec_tokens,
                    num_spec_accepted=result.num_accepted,
                    grammar_complete=result.grammar_ended,
                    stop_reason=stop_reason,
                )
            )
            if new_token_ids:
                self._release_held(request.request_id)
        return updates

    def _commit(
        self, request: Request, result: SampledTokens, stop_check: StopCheck | None
    ) -> tuple[tuple[int, ...], RequestStatus | None, str | int | None]:
        """Append a step's sampled tokens up to the first one that ends the request; returns them, the
        status it ends with (None: it goes on) and the stop reason. A stop string wins over a token
        rule in the same step (completed by the max_tokens-th token, the request stopped; it did not
        reach its length), as in vLLM."""
        new_token_ids: list[int] = []
        status = None
        for token_id in result.token_ids:
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                break
        if status is None and result.grammar_ended:
            status = RequestStatus.FINISHED_STOPPED
        stop_reason: str | int | None = None
        if status is RequestStatus.FINISHED_STOPPED and new_token_ids:
            last, params = new_token_ids[-1], request.sampling_params
            if last in params.stop_token_ids or last in request.eos_token_ids:
                stop_reason = last
        match = None
        if stop_check is not None:
            match = stop_check(request.request_id, tuple(new_token_ids), status is not None)
        if match is not None:
            num_dropped = len(new_token_ids) - match.num_tokens
            if num_dropped:
                del new_token_ids[match.num_tokens :]
                del request.output_token_ids[-num_dropped:]
            status, stop_reason = RequestStatus.FINISHED_STOPPED, match.stop_string
        return tuple(new_token_ids), status, stop_reason

    def _discard_rejected(self, request: Request, num_rejected: int) -> None:
        """Roll back the cache entries written for rejected proposals: they stop counting as computed
        (the slots are overwritten when those positions are computed again; blocks past the end are kept
        as lookahead and freed with the request)."""
        request.num_computed_tokens -= num_rejected

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
