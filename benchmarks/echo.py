"""A bare grpc.aio bidirectional echo: the floor of Python gRPC round trips on this machine.

  python -m benchmarks.echo            serve on a free port; prints {"address": ...}
  measure_echo(address, size, n)       p50 round trip of `size`-byte messages, back to back, in ms
  measure_idle_echo(address, size, n, gap_s)
                                       the same from a loop thread, as the remote proposer sends, with
                                       gap_s of idle time before each round (a draft round's compute):
                                       the floor a round with that gap can reach
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import grpc

METHOD = "/starjar.bench.Echo/Chat"


async def _serve() -> None:
    async def chat(request_iterator, context):
        async for msg in request_iterator:
            yield msg

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "starjar.bench.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(chat)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"serving": "echo", "address": f"127.0.0.1:{port}"}), flush=True)
    await server.wait_for_termination()


async def _measure(address: str, size: int, n: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(METHOD)()
        payload = b"x" * size
        times = []
        for i in range(n + 20):
            t0 = time.perf_counter()
            await call.write(payload)
            await call.read()
            if i >= 20:  # warm-up rounds excluded
                times.append(time.perf_counter() - t0)
        await call.done_writing()
        return times


def measure_echo(address: str, size: int, n: int = 500) -> float:
    times = asyncio.run(_measure(address, size, n))
    return 1000 * statistics.median(times)


def measure_idle_echo(address: str, size: int, n: int, gap_s: float) -> float:
    """Back to back, every thread on the path is still awake; a target worker's rounds come one target step
    apart and every thread (the caller, the client's loop, gRPC's own, the server's) has gone to sleep. Sent
    through the remote proposer's own loop thread (target_worker.remote.loop.WireLoop)."""
    from target_worker.remote.loop import WireLoop

    wire = WireLoop("echo-loop")

    async def open_call():
        channel = grpc.aio.insecure_channel(address)
        return channel, channel.stream_stream(METHOD)()

    async def one(call, payload):
        await call.write(payload)
        return await call.read()

    channel, call = wire.call(open_call(), 10)
    payload, times = b"x" * size, []
    for i in range(n + 5):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        wire.call(one(call, payload), 10)
        if i >= 5:  # warm-up rounds excluded
            times.append(time.perf_counter() - t0)
    wire.call(channel.close(), 10)
    wire.close()
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(_serve())
    except ImportError:
        asyncio.run(_serve())
    sys.exit(0)
