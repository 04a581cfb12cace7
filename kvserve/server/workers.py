"""The worker pool: CPU-heavy request preparation (tokenisation, chat templates, grammar compilation, large
detokenisation, body checks) runs here, never on the asyncio loop, so one large request cannot freeze every
open stream. Hugging Face's tokenizers and xgrammar release the GIL while they work; Python-level work
(Jinja) shares it in 5 ms slices with the loop instead of holding it for the whole job.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

_NUM_WORKERS = 4
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_NUM_WORKERS, thread_name_prefix="kvserve-worker")
    return _pool


async def offload(fn, *args, **kwargs):
    """Run `fn(*args, **kwargs)` in the worker pool and return (or raise) its result."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await loop.run_in_executor(_executor(), call)
