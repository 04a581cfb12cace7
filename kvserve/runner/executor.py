"""The tensor-parallel executor (docs/parallel.md): the engine's model runner as rank 0 of N.

`make_runner` gives the engine a plain `ModelRunner` for one rank, else a `TensorParallelRunner`:
a ModelRunner whose target model is rank 0's shard, which starts ranks 1..N-1 as worker processes
(`kvserve.runner.worker`, torch.multiprocessing spawn; gloo on CPU, NCCL on CUDA) and, before each
target forward, sends the forward's input to them. The scheduler, the KV manager, sampling
(rank 0 gathers the logits), speculative proposers (the draft model runs whole on rank 0) and
structured-output masks stay in the engine process, unchanged.

Failure: a worker that exits, or a collective that fails or times out, raises `WorkerFailedError`
from the step (the engine dies loudly, never hangs), and every later step raises it again. Workers
exit with the engine: on `shutdown`, when the runner is collected, at interpreter exit, and on
their own when the engine process is gone (their pipe closes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.config import EngineConfig
from kvserve.model.parallel import TensorParallelLayout, check_tensor_parallel_arch
from kvserve.mp_children import children_allowed
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.worker import (
    ERROR,
    FORWARD,
    READY,
    STOP,
    RankSpec,
    init_rank,
    load_rank_model,
    worker_main,
)
from kvserve.threads import spawn_environment

COLLECTIVE_TIMEOUT_S = 120.0  # a collective waits this long for a slow rank before failing
READY_TIMEOUT_S = 600.0  # workers load their shards within this
JOIN_TIMEOUT_S = 5.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


def make_runner(config: EngineConfig, num_blocks: int) -> ModelRunner:
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, num_blocks)
    check_tensor_parallel_arch(config.model)  # before any rank starts
    return TensorParallelRunner(config, num_blocks)


def threads_per_rank(world_size: int) -> int:
    """The CPUs this process may use, shared equally by the ranks (one each on a 2-core machine
    at N = 2)."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _rendezvous() -> tuple[str, str]:
    """A file store in a new private directory, and that directory. The ranks meet through the file,
    so no port is picked: a port found free and released could be taken by another process before
    rank 0 binds it (seen in CI beside other servers: rank 0 aborted at set-up)."""
    directory = tempfile.mkdtemp(prefix="kvserve-tp-")
    return f"file://{os.path.join(directory, 'rendezvous')}", directory


def _rank_device(device: str, rank: int) -> str:
    """cpu for every rank; cuda:i + r for rank r when rank 0 runs on cuda:i."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    return f"cuda:{(dev.index or 0) + rank}"


class TensorParallelRunner(ModelRunner):
    """Rank 0 of `config.tensor_parallel_size`, in the engine process; see the module doc."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        world = config.tensor_parallel_size
        layout = TensorParallelLayout(0, world, config.model)  # bad splits fail before any spawn
        if config.weight_scheme is not None:
            from kvserve.model.parallel_quant import check_tensor_parallel_scheme

            check_tensor_parallel_scheme(config.weight_scheme, layout)
        if dist.is_initialized():
            raise WorkerFailedError(
                "this process already has a torch.distributed process group; the tensor-parallel "
                "engine starts its own (one tensor-parallel engine per process)"
            )
        self.world_size = world
        cuda = torch.device(config.device).type == "cuda"
        threads = 1 if cuda else threads_per_rank(world)
        init_method, rendezvous_dir = _rendezvous()
        specs = [
            RankSpec(
                rank,
                world,
                init_method,
                "nccl" if cuda else "gloo",
                _rank_device(config.device, rank),
                threads,
                COLLECTIVE_TIMEOUT_S,
            )
            for rank in range(world)
        ]
        self._error: WorkerFailedError | None = None
        context = mp.get_context("spawn")
        self._workers, self._conns = [], []
        self._finalizer = weakref.finalize(
            self,
            _stop_workers,
            self._workers,
            self._conns,
            torch.get_num_threads(),
            rendezvous_dir,
        )
        try:
            for spec in specs[1:]:
                parent, child = context.Pipe()
                process = context.Process(
                    target=worker_main,
                    args=(spec, config, num_blocks, child),
                    name=f"kvserve-tp-rank{spec.rank}",
                    daemon=True,
                )
                with children_allowed(), spawn_environment():  # the OpenMP defaults too
                    process.start()
                child.close()
                self._workers.append(process)
                self._conns.append(parent)
            self._rank0 = specs[0]
            init_rank(specs[0])
            super().__init__(config, num_blocks)  # loads rank 0's shard through _load_model
            self.rank_weight_bytes = [self._weight_bytes]
            self.rank_kv_cache_bytes = [self.kv_cache_bytes]
            for rank, conn in enumerate(self._conns, start=1):
                _, weight_bytes, kv_bytes = self._await_ready(rank, conn)
                self.rank_weight_bytes.append(weight_bytes)
                self.rank_kv_cache_bytes.append(kv_bytes)
        except BaseException:
            self.shutdown()
            raise

    def _load_model(self):
        model, self._weight_bytes = load_rank_model(
            self.config, 0, self.world_size, self._rank0.device
        )
        return model

    def _await_ready(self, rank: int, conn) -> tuple:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not conn.poll(0.2):
            process = self._workers[rank - 1]
            if process.exitcode is not None and not conn.poll(0):
                raise WorkerFailedError(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode} while loading"
                )
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"rank {rank} did not load within {READY_TIMEOUT_S:.0f} s")
        message = conn.recv()
        if message[0] == ERROR:
            raise WorkerFailedError(f"tensor-parallel {message[1]}")
        assert message[0] == READY, message
        return message

    # --- each step ------------------------------------------------------------------------------

    def _forward(self, chunks, rows):
        if self._error is not None:
            raise self._error
        chunks = [(start, tuple(tokens), tuple(blocks)) for start, tokens, blocks in chunks]
        rows = None if rows is None else list(rows)
        try:
            for rank, (process, conn) in enumerate(
                zip(self._workers, self._conns, strict=True), start=1
            ):
                if process.exitcode is not None:
                    raise WorkerFailedError(
                        f"tensor-parallel rank {rank} exited with code {process.exitcode}"
                    )
                conn.send((FORWARD, chunks, rows))
            return super()._forward(chunks, rows)
        except (OSError, RuntimeError) as exc:  # a broken pipe; gloo/NCCL errors and timeouts
            self._error = self._failure(exc)
            raise self._error from exc

    def _failure(self, exc: BaseException) -> WorkerFailedError:
        """The error to raise for a failed step, with the workers' own reports when they sent one."""
        if isinstance(exc, WorkerFailedError):
            return exc
        reports = []
        for conn in self._conns:
            try:
                if conn.poll(0):
                    message = conn.recv()
                    if message[0] == ERROR:
                        reports.append(message[1])
            except (OSError, EOFError):
                pass
        codes = [p.exitcode for p in self._workers]
        detail = "; ".join(reports) or f"worker exit codes {codes}"
        return WorkerFailedError(f"tensor-parallel step failed ({exc}): {detail}")

    def shutdown(self) -> None:
        self._finalizer()  # idempotent


def _stop_workers(workers: list, conns: list, num_threads: int, rendezvous_dir: str) -> None:
    """Stop the workers (ask, then terminate, then kill), destroy rank 0's process group, remove
    the rendezvous directory, restore the engine process's thread count."""
    for process, conn in zip(workers, conns, strict=False):
        if process.exitcode is None:
            try:
                conn.send((STOP,))
            except OSError:
                pass
    for process in workers:
        process.join(JOIN_TIMEOUT_S)
        if process.exitcode is None:
            process.terminate()
            process.join(JOIN_TIMEOUT_S)
        if process.exitcode is None:
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)
    torch.set_num_threads(num_threads)
