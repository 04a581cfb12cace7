"""The engine-core process: an `EngineCore` (scheduler, KV manager, runner), served by its
`ServingLoop` (kvserve.engine.serving_loop), behind two ZMQ sockets.

Started by kvserve.engine.mp_client with the `spawn` method. It connects a PULL socket (commands from the
front end) and a PUSH socket (outputs, shared by every data-parallel core: each message is framed with the
core's index). It sends `Ready` once the model is loaded, a `Heartbeat` every `HEARTBEAT_S` from its own
thread, and the core's `CoreOutputs` after every step. It exits when told (`ShutdownCmd`), when its loop
dies (after reporting why), or when its parent process is gone. Ctrl-C in the terminal reaches the
server, which drains and then shuts the core down; the core itself ignores SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from kvserve.engine.wire import (
    HEARTBEAT_S,
    CoreOutputs,
    Heartbeat,
    Ready,
    ShutdownCmd,
    ToCore,
    decoder,
    encoder,
)

logger = logging.getLogger("kvserve.engine.core")


def run_core(
    config,
    faults,
    in_address: str,
    out_address: str,
    index: int,
    parent_pid: int,
    log_level: str = "WARNING",
) -> None:
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s core{index}: %(message)s"
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_address)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_address)
    lock = threading.Lock()
    enc = encoder()
    tag = str(index).encode()
    pid = os.getpid()

    def send(message) -> None:
        data = enc.encode(message)
        with lock:
            push.send_multipart([tag, data])

    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            if os.getppid() != parent_pid:  # the API server is gone: nobody to serve
                os._exit(0)
            send(Heartbeat(pid))

    threading.Thread(target=heartbeat, name="kvserve-heartbeat", daemon=True).start()
    try:
        from kvserve.engine.core import EngineCore
        from kvserve.engine.info import engine_info
        from kvserve.engine.serving_loop import ServingLoop

        core = EngineCore(config)
    except Exception as exc:
        logger.exception("engine core %d failed to load", index)
        send(CoreOutputs(dead_reason=f"{type(exc).__name__}: {exc}"))
        time.sleep(0.5)
        os._exit(1)
    send(Ready(engine_info(core), pid))
    loop = ServingLoop(core, send, faults=faults)
    loop.start()

    dec = decoder(ToCore)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        if loop.dead_reason is not None:  # reported by the loop itself; let it reach the client
            time.sleep(0.5)
            os._exit(1)
        if not poller.poll(200):
            continue
        command = dec.decode(pull.recv())
        if isinstance(command, ShutdownCmd):
            break
        loop.submit(command)  # checked once, when the loop takes it (ServingLoop._intake)
    loop.shutdown()
    stop.set()
    push.close()
    pull.close(linger=0)
    ctx.term()
