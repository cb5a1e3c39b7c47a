"""The demo's gate clients: a connection closed with no answer is sent once more and counted apart; a second one
in a row is a failure (:mod:`pinsidecar.demo.clients`).

Against a raw socket server that reads each request and then either answers ``200`` or hangs up without a byte:
the one way to make ``Server disconnected without sending a response`` happen on purpose.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pinsidecar.demo.clients import GateClients
from pinsidecar.testing.wait import wait_until

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@contextmanager
def server(answer: Callable[[int], bool]) -> Iterator[str]:
    """Serve on loopback; request ``n`` (0-based, one per connection) is answered when ``answer(n)``, else the
    connection is closed unanswered."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):  # head and the (JSON) body
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if answer(n):
                    conn.sendall(OK.replace(b"Content-Length", b"Connection: close\r\nContent-Length"))
                n += 1

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        lsock.close()


def test_a_connection_closed_unanswered_is_sent_once_more_and_counted_apart() -> None:
    with server(lambda n: n != 0) as url:
        clients = GateClients(url, "m", clients=1, timeout_s=10)
        clients.switch("code", [{"prompt": "x"}])
        wait_until(lambda: clients.snapshot().completed >= 3, "three completed requests", 20)
        counts = clients.stop(10)
    assert counts.failed == 0 and counts.retried == 1, counts
    assert "without sending a response" in counts.retries[0] and " s)" in counts.retries[0]
    assert counts.as_dict()["retried"] == 1


def test_two_unanswered_in_a_row_are_a_failure_with_when_it_happened() -> None:
    with server(lambda n: n >= 2) as url:
        clients = GateClients(url, "m", clients=1, timeout_s=10)
        clients.switch("code", [{"prompt": "x"}])
        wait_until(lambda: clients.snapshot().completed >= 1, "a completed request", 20)
        counts = clients.stop(10)
    assert counts.failed == 1 and counts.retried == 1, counts
    assert counts.errors[0].startswith("RemoteProtocolError: Server disconnected without sending a response")
    assert counts.errors[0].endswith(" s)")
