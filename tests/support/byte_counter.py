"""A TCP proxy on loopback that counts the bytes clients send through it to a server (the request lines,
headers and bodies, as they cross the wire): put its URL where a store's client would put the server's.
Used by tests/unit/test_appends_match_a_local_file.py and benchmarks/appends.py."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit


class CountingProxy:
    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sent = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="counting-proxy").start()

    @property
    def sent(self) -> int:
        """Bytes clients have sent through the proxy so far."""
        with self._lock:
            return self._sent

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if counted:
                    with self._lock:
                        self._sent += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._open:
                sock.close()
