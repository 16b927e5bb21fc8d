"""A TCP fault proxy for chaos tests: sits between a client and a server on loopback.

Modes, switchable while connections are open:
  pass       forward bytes as they come
  latency    forward each chunk after `delay_s`
  slice      forward in 1-byte writes (HTTP/2 frames arrive cut anywhere)
  blackhole  forward nothing, keep every socket open (a host that vanished without FIN or RST)
  reset      close every connection with RST, and each new one at once
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, upstream: str, mode: str = "pass", delay_s: float = 0.05):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.mode = mode
        self.delay_s = delay_s
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "reset":
            with self._lock:
                conns, self._conns = self._conns, []
            for c in conns:
                _reset(c)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.set_mode("reset")

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "reset":
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.mode == "blackhole" and not self._closed:
                    time.sleep(0.01)  # hold it: nothing gets through, nothing is closed
                if self.mode == "latency":
                    time.sleep(self.delay_s)
                if self.mode == "slice":
                    for i in range(len(data)):
                        dst.sendall(data[i:i + 1])
                else:
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _reset(s: socket.socket) -> None:
    try:  # linger 0: close sends RST, not FIN
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    except OSError:
        pass
