"""The tensor-parallel executor (docs/parallel.md): the engine's model runner as rank 0 of N.

`make_runner` gives the engine a plain `ModelRunner` for one rank, else a `TensorParallelRunner`:
a ModelRunner whose target model is rank 0's shard, which starts ranks 1..N-1 as worker processes
(`kvserve.runner.worker`, torch.multiprocessing spawn; gloo on CPU, NCCL on CUDA) and, before each
target forward, sends the forward's input to them: each chunk's request, positions and tokens, and
the block-table changes since the last forward (each rank keeps every request's tables, as rank 0
does). The scheduler, the KV manager, sampling (rank 0 gathers the logits), speculative proposers
(the draft model runs whole on rank 0) and structured-output masks stay in the engine process,
unchanged.

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
from kvserve.core.block_tables import CHANGE, DROP
from kvserve.core.errors import InvalidRequestError
from kvserve.links import gloo_environment, listen, load_secret
from kvserve.model.parallel import TensorParallelLayout, check_tensor_parallel_arch
from kvserve.mp_children import children_allowed
from kvserve.quant.scheme import QuantizationError
from kvserve.runner.model_runner import ModelRunner
from kvserve.runner.nodes import NodeGroup, NodeJoinError, RemoteNode
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
NODE_REPORT_WAIT_S = 2.0  # after a failed step: how long rank 0 waits for a node's own report


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot go on."""


def make_runner(config: EngineConfig, num_blocks: int) -> ModelRunner:
    if config.dist.node_rank != 0:
        raise InvalidRequestError(
            f"--node-rank {config.dist.node_rank} runs only ranks: start it with `kvserve tp-node`; "
            "the engine (serve, generate) is node 0",
            "node_rank",
        )
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
        """Long: starting the ranks (local and on other nodes) is one transaction: every failure path
        stops what was started before it."""
        world = config.tensor_parallel_size
        layout = TensorParallelLayout(0, world, config.model)  # bad splits fail before any spawn
        if config.weight_scheme is not None:
            from kvserve.model.parallel_quant import check_tensor_parallel_scheme

            check_tensor_parallel_scheme(config.weight_scheme, layout)
        if config.gguf_activations != "fp32":
            raise QuantizationError(
                f"--gguf-activations {config.gguf_activations} runs a GGUF file's own blocks on one "
                "rank; tensor parallelism dequantises them to fp32 (drop --gguf-activations)"
            )
        if dist.is_initialized():
            raise WorkerFailedError(
                "this process already has a torch.distributed process group; the tensor-parallel "
                "engine starts its own (one tensor-parallel engine per process)"
            )
        self.world_size = world
        multi = config.dist.multi_node
        secret = load_secret(config.dist.secret_file) if multi else b""  # before anything starts
        cuda = torch.device(config.device).type == "cuda"
        local_ranks = config.dist.node_ranks(world) if multi else range(world)
        threads = 1 if cuda else threads_per_rank(len(local_ranks))
        timeout_s = config.dist.timeout_s if multi else COLLECTIVE_TIMEOUT_S
        self._error: WorkerFailedError | None = None
        self._rank_table_ops: list[tuple] = []  # block-table operations the other ranks still need
        self._workers, self._conns, self._nodes = [], [], []
        self._store = self._node_group = None
        rendezvous_dir = None
        if multi:
            self._node_group = NodeGroup(config, secret)  # binds --dist-init-addr, or raises
            self._store, init_method = _tcp_store(self._node_group.host, world, timeout_s)
            os.environ.update(gloo_environment(self._node_group.host))  # rank 0 and local ranks
        else:
            init_method, rendezvous_dir = _rendezvous()
        specs = [
            RankSpec(
                rank,
                world,
                init_method,
                "nccl" if cuda else "gloo",
                _rank_device(config.device, rank),
                threads,
                timeout_s,
            )
            for rank in local_ranks
        ]
        context = mp.get_context("spawn")
        self._finalizer = weakref.finalize(
            self,
            _stop_workers,
            self._workers,
            self._conns,
            torch.get_num_threads(),
            rendezvous_dir,
            self._node_group,
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
            if multi:
                deadline = time.monotonic() + config.dist.timeout_s
                try:
                    self._nodes = self._node_group.admit(self._store.port, num_blocks, deadline)
                except NodeJoinError as exc:
                    raise WorkerFailedError(str(exc)) from None
            self._rank0 = specs[0]
            init_rank(specs[0], self._store)
            super().__init__(config, num_blocks)  # loads rank 0's shard through _load_model
            ready = {0: (self._weight_bytes, self.kv_cache_bytes)}
            for rank, conn in enumerate(self._conns, start=1):
                _, weight_bytes, kv_bytes = self._await_ready(rank, conn)
                ready[rank] = (weight_bytes, kv_bytes)
            for node in self._nodes:
                ready.update(self._await_node_ready(node))
            self.rank_weight_bytes = [ready[rank][0] for rank in range(world)]
            self.rank_kv_cache_bytes = [ready[rank][1] for rank in range(world)]
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

    def _await_node_ready(self, node: RemoteNode) -> dict[int, tuple[int, int]]:
        """{rank: (weight bytes, KV bytes)} once every rank of `node` has loaded."""
        ready = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < len(node.ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailedError(
                    f"{node.name()} did not load within {READY_TIMEOUT_S:.0f} s"
                )
            try:
                message = node.channel.recv(timeout_s=left)
            except (ConnectionError, TimeoutError, ValueError) as exc:
                raise WorkerFailedError(
                    f"tensor-parallel {node.name()} lost while loading: {exc}"
                ) from None
            if message[0] == ERROR:
                raise WorkerFailedError(f"tensor-parallel {message[1]}")
            _, rank, weight_bytes, kv_bytes = message
            ready[rank] = (weight_bytes, kv_bytes)
        return ready

    # --- each step ------------------------------------------------------------------------------

    def _apply_tables(self, scheduler_output):
        """Rank 0's tables, and the same operations queued for the other ranks, which receive them
        with the next forward (in order, so a step that fails before its forward loses none)."""
        super()._apply_tables(scheduler_output)
        ops = self._rank_table_ops
        for request_id in scheduler_output.finished_request_ids:
            ops.append((DROP, request_id))
        for request_id in scheduler_output.preempted_request_ids:
            ops.append((DROP, request_id))
        ops.extend(_change_op(chunk) for chunk in scheduler_output.chunks)

    def score(self, chunks):
        self._rank_table_ops.extend(_change_op(chunk) for chunk in chunks)
        try:
            return super().score(chunks)
        finally:
            self._rank_table_ops.extend((DROP, c.request_id) for c in chunks)

    def _forward(self, chunks, tables, rows):
        if self._error is not None:
            raise self._error
        ops, self._rank_table_ops = self._rank_table_ops, []
        spans = [(c.request_id, c.start_position, c.token_ids) for c in chunks]
        rows = None if rows is None else list(rows)
        message = (FORWARD, ops, spans, rows)
        try:
            for rank, (process, conn) in enumerate(
                zip(self._workers, self._conns, strict=True), start=1
            ):
                if process.exitcode is not None:
                    raise WorkerFailedError(
                        f"tensor-parallel rank {rank} exited with code {process.exitcode}"
                    )
                conn.send(message)
            for node in self._nodes:
                reason = node.failure()
                if reason is not None:
                    raise WorkerFailedError(f"tensor-parallel {reason}")
                node.send(message)
            return super()._forward(chunks, tables, rows)
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
        for node in self._nodes:  # a node reports its rank's end a moment after gloo notices
            node.drain(NODE_REPORT_WAIT_S)
            if node.reports or node.closed:
                reports.append(node.failure() or "")
        if self._nodes and reports:  # one line: which host failed, first
            return WorkerFailedError(
                f"tensor-parallel {reports[0]} (rank 0 saw: {_first_line(exc)})"
            )
        codes = [p.exitcode for p in self._workers]
        detail = "; ".join(reports) or f"worker exit codes {codes}"
        return WorkerFailedError(f"tensor-parallel step failed ({exc}): {detail}")

    def shutdown(self) -> None:
        self._finalizer()  # idempotent


def _change_op(chunk) -> tuple:
    """A chunk's block-table change as a `BlockTables.apply_ops` operation (plain data)."""
    return (
        CHANGE,
        chunk.request_id,
        chunk.block_offset,
        chunk.new_tables,
        chunk.num_released_blocks,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _tcp_store(host: str, world_size: int, timeout_s: float):
    """torch.distributed's store on an ephemeral port of `host` only (TCPStore alone would listen
    on every interface), and the init method for the other ranks. Its port is told to a node only
    after the node proved the secret; the store itself has no authentication."""
    from datetime import timedelta

    sock = listen(host, 0)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, f"tcp://{host}:{port}"


def stop_ranks(workers: list, conns: list) -> None:
    """Stop local rank processes: ask each live one, then terminate, then kill; close their pipes
    (rank 0's executor and a `kvserve tp-node` agent alike)."""
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


def _stop_workers(
    workers: list, conns: list, num_threads: int, rendezvous_dir: str | None, node_group=None
) -> None:
    """Stop the workers (ask, then terminate, then kill) and the other nodes (asked: each stops its
    own ranks), destroy rank 0's process group, remove the rendezvous directory, restore the engine
    process's thread count."""
    if node_group is not None:
        node_group.close()
    stop_ranks(workers, conns)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rendezvous_dir is not None:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    torch.set_num_threads(num_threads)
