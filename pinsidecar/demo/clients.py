"""The demo's clients: a few threads sending completions through the sidecar's gate, one traffic domain at a time.

The demo shows the loop under load, the way a service sees it: clients talk to the gate (never to the engine),
keep sending while the drift watch trips, while a second engine counts, and while the gate holds them through the
drain and the reboot. Every request is counted as sent, completed or failed, so the demo can say at the end how
many requests the remap cost (none is the point: the gate holds, it does not refuse).

:meth:`GateClients.switch` changes the traffic domain for every client at once (the demo's "shift"); requests in
flight finish as they were sent.

One thing a client does that an OpenAI client does too (openai-python retries connection errors by default): a
request whose connection was closed before any byte of an answer came back (``RemoteProtocolError: Server
disconnected without sending a response``) is sent once more on a new connection. CI saw it once in the demo and
once in the soak (2026-12-07), a local stress run of the gate never; its cause is not established (a keep-alive
close racing a reused connection is the usual one). It is counted apart (``retried``, with when it happened),
never silently: a second failure is a failure, and a ``retried`` count that shows up often is a gate problem to
look into.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__: list[str] = []  # nothing here is another package's business

# Errors kept for the summary (the first ones; the counts hold them all).
KEEP_ERRORS = 20


@dataclass
class ClientCounts:
    """What the clients did so far."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    by_domain: dict[str, int] = field(default_factory=dict)  # completed requests per domain
    retried: int = 0  # requests sent again once after a connection closed unanswered (module docstring)
    retries: list[str] = field(default_factory=list)  # the first ones: when (seconds since the start) and what

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "completed": self.completed, "failed": self.failed,
                "in_flight": self.sent - self.completed - self.failed, "errors": list(self.errors),
                "completed_by_domain": dict(self.by_domain), "retried": self.retried, "retries": list(self.retries)}


class GateClients:
    """``clients`` threads posting ``/v1/completions`` to ``gate_url`` in a loop until :meth:`stop`.

    ``timeout_s`` must be longer than the gate may hold a request (``gate.max_hold_s``): a request held through a
    reboot is slow, not failed.
    """

    def __init__(self, gate_url: str, model: str, *, clients: int, timeout_s: float) -> None:
        if clients < 1:
            raise ValueError(f"clients must be >= 1, got {clients}")
        self.url = f"{gate_url.rstrip('/')}/v1/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.counts = ClientCounts()
        self.domain = ""
        self._prompts: list[dict[str, Any]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"demo-client-{i}", daemon=True)
                         for i in range(clients)]
        self._started = False
        self._t0 = 0.0  # the clients' start (switch's first call): what errors and retries are timed from

    def switch(self, domain: str, prompts: Sequence[dict[str, Any]]) -> None:
        """Send ``prompts`` (cycled, in order) from now on; starts the clients on the first call."""
        if not prompts:
            raise ValueError(f"no prompts for domain {domain!r}")
        with self._lock:
            self.domain, self._prompts, self._next = domain, list(prompts), 0
        if not self._started:
            self._started = True
            self._t0 = time.monotonic()
            for t in self._threads:
                t.start()

    def snapshot(self) -> ClientCounts:
        with self._lock:
            c = self.counts
            return ClientCounts(c.sent, c.completed, c.failed, list(c.errors), dict(c.by_domain), c.retried,
                                list(c.retries))

    def _take(self) -> tuple[str, dict[str, Any]]:
        with self._lock:
            prompt = self._prompts[self._next % len(self._prompts)]
            self._next += 1
            self.counts.sent += 1
            return self.domain, prompt

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                domain, prompt = self._take()
                body = {**prompt, "model": self.model, "temperature": 0.0}
                error = self._post(client, body)
                with self._lock:
                    if error:
                        self.counts.failed += 1
                        if len(self.counts.errors) < KEEP_ERRORS:
                            self.counts.errors.append(f"{error} (at {self._since_start():.1f} s)")
                    else:
                        self.counts.completed += 1
                        self.counts.by_domain[domain] = self.counts.by_domain.get(domain, 0) + 1

    def _post(self, client: httpx.Client, body: dict[str, Any]) -> str:
        """Send one request; the error ("" when it completed). A connection closed unanswered is tried once more."""
        retried = False
        while True:
            try:
                r = client.post(self.url, json=body)
            except httpx.RemoteProtocolError as exc:
                if retried or "without sending a response" not in str(exc):
                    return f"{type(exc).__name__}: {exc}"
                retried = True
                with self._lock:
                    self.counts.retried += 1
                    if len(self.counts.retries) < KEEP_ERRORS:
                        self.counts.retries.append(f"{exc} (at {self._since_start():.1f} s)")
                continue
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"

    def _since_start(self) -> float:
        return time.monotonic() - self._t0

    def stop(self, timeout_s: float | None = None) -> ClientCounts:
        """Stop sending; wait (up to ``timeout_s``, default the request timeout) for requests in flight."""
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(self.timeout_s if timeout_s is None else timeout_s)
        return self.snapshot()
