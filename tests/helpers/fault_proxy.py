"""A TCP proxy on 127.0.0.1 in front of a server, with the faults a test switches on while a job
talks through it:

    pass     every byte forwarded both ways (the server as it is)
    refuse   the listening socket closed and every open connection reset: a server that went away
             (a new connection is refused, one in flight is cut)
    stall    connections accepted and held, no byte forwarded either way: a server that accepts
             and never answers

The tests' own, so that the faults are the network's and the template's code is not touched."""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.port = 0
        self.listener = None
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str) -> None:
        assert mode in ("pass", "refuse", "stall"), mode
        with self.lock:
            self.mode = mode
            if mode == "refuse":
                # shutdown first: a close alone leaves the accept() in flight listening (Linux)
                try:
                    self.listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.listener.close()
                for connection in self.connections:
                    reset(connection)
                self.connections.clear()
        if mode != "refuse" and self.listener.fileno() == -1:
            self._listen()

    def close(self) -> None:
        self.set("refuse")

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: refuse
                return
            with self.lock:
                if self.mode == "refuse":
                    reset(client)
                    return
                self.connections.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        while self.mode == "stall":  # accepted, held: never read, never answered (until "pass")
            time.sleep(0.05)
        if self.mode == "refuse":
            reset(client)
            return
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            reset(client)
            return
        with self.lock:
            self.connections.append(upstream)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            while self.mode == "stall":  # held mid-request or mid-answer
                time.sleep(0.05)
            if self.mode == "refuse":
                for end in (source, sink):
                    reset(end)
                return
            if not data:  # one side closed: pass the close on
                try:
                    sink.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                sink.sendall(data)
            except OSError:
                reset(source)
                return


def reset(connection: socket.socket) -> None:
    """Close with a reset (RST), as a host that went away does, not a polite FIN."""
    try:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # wakes a recv() in flight in another thread: a close alone waits for it to return
        connection.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    connection.close()
