"""A prefill instance's finished prompts' KV rows, held until the decode instance pulls.

The worker gathers a prefill-only request's full prompt blocks (every layer, the MTP
layer's too) in the step that finishes it; the engine files them here before it emits
the request's last output, so the KV server can answer a pull as soon as the
coordinator has P's response.  A pull takes the rows (one transfer per request); rows
nobody pulled within ``ttl_s`` are dropped, so a decode instance that died costs memory
for at most that long.  Thread-safe: the engine thread puts, the event loop takes.
"""
from __future__ import annotations

import threading
import time

from server.pd.wire import KVRows


class KVExports:
    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, KVRows]] = {}
        self.num_exported = 0
        self.num_expired = 0

    def put(self, request_id: str, rows: KVRows) -> None:
        with self._lock:
            self._expire()
            self._rows[request_id] = (self.clock() + self.ttl_s, rows)
            self.num_exported += 1

    def take(self, request_id: str) -> KVRows | None:
        with self._lock:
            self._expire()
            entry = self._rows.pop(request_id, None)
        return entry[1] if entry else None

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._rows

    @property
    def num_held(self) -> int:
        with self._lock:
            self._expire()
            return len(self._rows)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(len(r.payload) for _, r in self._rows.values())

    def _expire(self) -> None:
        now = self.clock()
        for rid in [rid for rid, (t, _) in self._rows.items() if t <= now]:
            del self._rows[rid]
            self.num_expired += 1
