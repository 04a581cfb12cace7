"""`kvserve bench serve` warms its client before the clock starts: the first measured request
finds an open keep-alive connection (no TCP connect, no lazy imports on its path). A minimal
HTTP/1.1 server on 127.0.0.1 counts connections and logs requests in arrival order."""

from __future__ import annotations

import asyncio
import json

from kvserve.lab.bench.client import ClientConfig
from kvserve.lab.bench.loadgen import LoadPlan
from kvserve.lab.bench.records import RequestSpec
from kvserve.lab.bench.runner import _drive


class CountingServer:
    """GET -> a JSON model list; POST -> a two-token SSE stream. Keep-alive, HTTP/1.1."""

    def __init__(self) -> None:
        self.num_connections = 0
        self.log: list[tuple[int, str]] = []  # (connection number, "METHOD path")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        conn = self.num_connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = dict(h.split(": ", 1) for h in lines[1:] if ": " in h)
                length = int(headers.get("content-length", headers.get("Content-Length", 0)))
                if length:
                    await reader.readexactly(length)
                self.log.append((conn, f"{method} {path}"))
                if method == "GET":
                    body = json.dumps({"data": [{"id": "m"}]}).encode()
                else:
                    chunks = [
                        {"choices": [{"text": "a", "finish_reason": None}]},
                        {"choices": [{"text": "b", "finish_reason": "length"}]},
                    ]
                    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
                    body = (body + "data: [DONE]\n\n").encode()
                kind = "application/json" if method == "GET" else "text/event-stream"
                writer.write(
                    f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_the_first_measured_request_reuses_a_connection_opened_before_the_clock():
    server = CountingServer()

    async def main():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        cfg = ClientConfig(f"http://127.0.0.1:{port}", "m", endpoint="completions")
        specs = tuple(RequestSpec(i, f"prompt {i}", 2, 2) for i in range(3))
        plan = LoadPlan(specs, num_warmup=0, offsets_s=(0.0, 0.0, 0.0))
        async with srv:
            return await _drive(cfg, plan, progress=False)

    result = asyncio.run(main())
    assert [r.outcome for r in result.records] == ["ok"] * 3
    # three requests at once: three connections opened by the warm-up (GETs), none by the run
    assert server.num_connections == 3
    assert [entry for _, entry in server.log[:3]] == ["GET /v1/models"] * 3
    assert [entry for _, entry in server.log[3:]] == ["POST /v1/completions"] * 3
    assert {conn for conn, _ in server.log[3:]} <= {1, 2, 3}
