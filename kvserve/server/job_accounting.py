"""Counting, metering and logging a job's outcome once (a mixin of OpenAIServing), and merging the
output streams of a job's prompts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import APIError
from kvserve.server.responses import Job

logger = logging.getLogger("kvserve.requests")


class JobAccounting:
    """Needs `metrics`, `metering`, `responses` and `options` on the instance."""

    def _finish(
        self,
        job: Job,
        outcome: str,
        error: APIError | None = None,
    ) -> None:
        """Count, meter and log a request that did not complete (once per job), with what its
        streams received until now."""
        if job.accounted:
            return
        job.accounted = True
        outputs = job.so_far()
        if error is not None:
            error.accounted = True  # the error handler must not count it again
            self.metrics.observe_error(error.error_type)
        completions = [c for o in outputs.values() for c in o.outputs]
        self._meter(job, outcome, outputs)
        self._log(job, error.error_type if error is not None else outcome, completions)

    def _meter(self, job: Job, outcome: str, outputs: dict[int, RequestOutput]) -> None:
        if self.metering is None:
            return
        usage = self.responses.usage(job, outputs)
        self.metering.record(
            job.key_id,
            outcome,
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
        )

    def _record(self, job: Job, finals: dict[int, RequestOutput]) -> None:
        if job.accounted:
            return
        job.accounted = True
        completions = [c for o in finals.values() for c in o.outputs]
        self.metrics.observe_completion(sum(len(i) for i in job.prompt_token_ids), completions)
        self._meter(job, "ok", finals)
        self._log(job, "ok", completions)

    def _log(self, job: Job, outcome: str, completions: list[CompletionOutput]) -> None:
        record = {
            "request_id": job.request_id,
            "key_id": job.key_id,
            "kind": job.kind,
            "stream": job.stream,
            "outcome": outcome,
            "prompt_tokens": [len(i) for i in job.prompt_token_ids],
            "output_tokens": [c.num_tokens for c in completions],
            "finish_reasons": [c.finish_reason for c in completions],
            "e2e_s": round(time.monotonic() - job.arrival_time, 4),
        }
        ttfts = [
            c.metrics.ttft_s for c in completions if c.metrics and c.metrics.ttft_s is not None
        ]
        if job.user is not None:
            record["user"] = job.user
        if ttfts:
            record["ttft_s"] = round(min(ttfts), 4)
        if self.options.log_content:
            record["prompts"] = job.prompt_texts
            record["outputs"] = [c.text for c in completions]
        logger.info("request %s", json.dumps(record))


async def merge_streams(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:
            await queue.put((index, exc))
            raise
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
