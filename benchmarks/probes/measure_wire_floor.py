"""The floor of one draft round's wire on this machine: a round trip after an idle gap, by transport.

Between two draft rounds the threads on the wire sleep for a whole verification (tens of ms), so what a
round pays is a round trip from cold threads. This times it for a bare UNIX-socket ping-pong between two
processes (the machine's own floor), and for a gRPC bidirectional echo with every combination of a grpc.aio
or a sync server and client (the sync client blocks in its response iterator; the aio one runs on a loop
thread of its own, as the remote proposer does). Each figure is the p50 of 60 round trips of an 18-byte
message (a typical round's size), each after `--gap-ms` of sleep. Prints a table and writes a JSON with the
machine beside it. `starjar bench tax` measures the same for starjar's own rounds (wire_overhead_ms_p50).

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_wire_floor.py [--gap-ms 18] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

ROUNDS, SIZE = 60, 18
SERVICE = "starjar.floor.Echo"
METHOD = f"/{SERVICE}/Chat"


def _handler(chat):
    return grpc.method_handlers_generic_handler(SERVICE, {"Chat": grpc.stream_stream_rpc_method_handler(chat)})


def _serve_sync() -> None:
    def chat(messages, context):
        yield from messages

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_handler(chat),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    server.wait_for_termination()


async def _serve_aio() -> None:
    async def chat(messages, context):
        async for m in messages:
            yield m

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(chat),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


def _timed(one_round, gap_s: float) -> float:
    """p50 in ms of ROUNDS round trips, each after gap_s of idle time (5 more first, as warm-up)."""
    times = []
    for _ in range(ROUNDS + 5):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) * 1000


def socket_floor(gap_s: float) -> float:
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echoing process: one thread blocked in recv
        parent.close()
        while (m := child.recv(64)) and m != b"x":
            child.send(m)
        os._exit(0)
    child.close()
    msg = b"p" * SIZE
    try:
        return _timed(lambda: (parent.send(msg), parent.recv(64)), gap_s)
    finally:
        parent.send(b"x")
        os.waitpid(pid, 0)


def _same(b: bytes) -> bytes:
    return b


def sync_client(port: int, gap_s: float) -> float:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        outbox: queue.Queue = queue.Queue()
        replies = channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)(
            iter(outbox.get, None))
        try:
            return _timed(lambda: (outbox.put(b"x" * SIZE), next(replies)), gap_s)
        finally:
            outbox.put(None)


def aio_client(port: int, gap_s: float) -> float:
    from target_worker.remote.loop import WireLoop  # the remote proposer's loop thread (uvloop where installed)

    wire = WireLoop("floor")

    async def open_call():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return channel, channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)()

    channel, call = wire.call(open_call(), 10)

    async def one_round():
        await call.write(b"x" * SIZE)
        return await call.read()

    try:
        return _timed(lambda: wire.call(one_round(), 10), gap_s)
    finally:
        wire.call(channel.close(), 10)
        wire.close()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        _serve_sync() if sys.argv[2] == "sync" else asyncio.run(_serve_aio())
        return
    from starjar.cpu.kernels import machine_label
    from starjar.cpu.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-ms", type=float, default=18.0, help="idle time before each round trip")
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args()
    gap_s = args.gap_ms / 1000
    rows = {"unix socket, two processes": socket_floor(gap_s)}
    for server_kind in ("aio", "sync"):
        proc = subprocess.Popen([sys.executable, __file__, "--serve", server_kind], stdout=subprocess.PIPE, text=True)
        try:
            port = json.loads(proc.stdout.readline())["port"]
            for client_kind, client in (("aio", aio_client), ("sync", sync_client)):
                rows[f"gRPC, {server_kind} server, {client_kind} client"] = client(port, gap_s)
        finally:
            proc.kill()
            proc.wait()
    print(f"machine: {machine_label()}; round trip p50 after {args.gap_ms:g} ms idle, {SIZE}-byte message")
    for name, ms in rows.items():
        print(f"  {name:34s} {ms:7.3f} ms")
    if args.out:
        result = {"gap_ms": args.gap_ms, "message_bytes": SIZE, "rounds": ROUNDS,
                  "round_trip_ms_p50": {k: round(v, 4) for k, v in rows.items()}, "meta": machine_info()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
