"""An instance that never finishes a POST on its own, for the tests of clients that leave
(test_abandoned.py, test_abandoned_accounting.py): what a generating llama-server looks like
to the front door while the client waits."""

from __future__ import annotations

import socket
import threading
import time


class SilentInstance:
    """Answers GET (HAProxy's health check). Takes a POST and never answers it, noting when
    the connection to it is closed (what a generating llama-server sees when the front door
    gives up on a request); a POST that asked for a stream gets one event every 0.2 s until
    then. Once `answer` is set, a POST is answered when it is."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.posts = 0
        self.answer: threading.Event | None = None
        self.closed_at: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = conn.recv(65536)
            if head.startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                return
            self.posts += 1
            if self.answer is not None:
                self.answer.wait(30)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")
                return
            if b'"stream": true' in head:
                self._stream(conn)
            else:
                while conn.recv(65536):  # the rest of the body; then EOF when the front door closes
                    pass
            self.closed_at.append(time.monotonic())

    @staticmethod
    def _stream(conn: socket.socket) -> None:
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                event = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                time.sleep(0.2)
        except OSError:
            return  # the front door closed it

    def close(self) -> None:
        self.sock.close()
