"""A prefill instance's finished prompts' KV rows, held until the decode instance pulls.

The worker gathers a prefill-only request's full prompt blocks (every layer, the MTP
layer's too) in the step that finishes it; the engine files them here before it emits
the request's last output, so the KV server can answer a pull as soon as the
coordinator has P's response.  A pull takes the rows (one transfer per request).

Bounded, because any client can ask P for an export: a request reserves its rows' bytes
before it is prefilled (``reserve``: the prompt's full blocks times the block's bytes),
and is refused when the reservation would pass ``max_count`` exports or ``max_bytes``
(the serving layer answers 503).  Rows being sent count until the send ends
(``done_sending``).  What nobody pulled goes: on ``release`` (the request failed, or the
coordinator gave up after D refused), or ``ttl_s`` after it was filed.  Rows filed for a
request whose reservation is gone are dropped at once.  Thread-safe: the engine thread
puts, the event loop reserves, takes and releases.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from server.pd.wire import KVRows


@dataclass(slots=True)
class _Entry:
    deadline: float
    num_bytes: int                   # reserved, then the rows' own size
    digests: tuple[str, ...]         # the prompt's block digests (trust.py)
    rows: KVRows | None = None


class KVExports:
    def __init__(self, ttl_s: float, *, max_count: int = 256, max_bytes: int = 2 << 30,
                 reserve_ttl_s: float = 600.0, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.reserve_ttl_s = reserve_ttl_s   # a prefill's longest life (e2eTimeout)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._sending_bytes = 0
        self.num_exported = 0
        self.num_expired = 0
        self.num_refused = 0             # reservations refused: the store was full
        self.num_released = 0            # dropped unpulled on request

    def reserve(self, request_id: str, num_bytes: int, digests: tuple[str, ...] = ()) -> bool:
        """Room for one request's rows; False when it would pass a bound."""
        with self._lock:
            self._expire()
            if len(self._entries) >= self.max_count or \
                    self._bytes() + num_bytes > self.max_bytes:
                self.num_refused += 1
                return False
            self._entries[request_id] = _Entry(self.clock() + self.reserve_ttl_s, num_bytes,
                                               digests)
            return True

    def put(self, request_id: str, rows: KVRows) -> bool:
        """File the rows of a reserved request (False, and dropped, if it has none)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.rows is not None:
                return False
            entry.rows = KVRows(rows.num_blocks, rows.bytes_per_block, rows.layout,
                                rows.payload, entry.digests[:rows.num_blocks])
            entry.num_bytes = len(rows.payload)
            entry.deadline = self.clock() + self.ttl_s
            self.num_exported += 1
            return True

    def take(self, request_id: str) -> KVRows | None:
        """The rows for a pull; their bytes count as sending until ``done_sending``."""
        with self._lock:
            self._expire()
            entry = self._entries.get(request_id)
            if entry is None or entry.rows is None:
                return None
            del self._entries[request_id]
            self._sending_bytes += entry.num_bytes
            return entry.rows

    def done_sending(self, rows: KVRows) -> None:
        with self._lock:
            self._sending_bytes -= len(rows.payload)

    def release(self, request_id: str) -> bool:
        """Drop a reservation or unpulled rows; True when there was one."""
        with self._lock:
            found = self._entries.pop(request_id, None) is not None
            self.num_released += found
            return found

    def holds_rows(self, request_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and entry.rows is not None

    def __contains__(self, request_id: str) -> bool:
        return self.holds_rows(request_id)

    @property
    def num_held(self) -> int:
        """Exports reserved or filed, not yet pulled."""
        with self._lock:
            self._expire()
            return len(self._entries)

    @property
    def bytes_held(self) -> int:
        """Bytes reserved, filed or being sent."""
        with self._lock:
            return self._bytes()

    @property
    def bytes_sending(self) -> int:
        with self._lock:
            return self._sending_bytes

    def _bytes(self) -> int:
        return self._sending_bytes + sum(e.num_bytes for e in self._entries.values())

    def _expire(self) -> None:
        now = self.clock()
        for rid in [rid for rid, e in self._entries.items() if e.deadline <= now]:
            del self._entries[rid]
            self.num_expired += 1
