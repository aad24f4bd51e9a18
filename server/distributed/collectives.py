"""The collectives a rank group's model and worker call, over shared memory on one node.

Why not gloo alone: on a CPU node gloo moves every collective through loopback TCP and a
thread hand-off.  Measured on the 2-core test machine: 1,054 us for one all-reduce of a
[4, 128] float32 tensor between two processes, against 26 us through shared memory; the
demo model's tp=2 step makes ~20 of them, so the rank group spent half its time waiting
and served 4-5x slower than one process.  vLLM's and SGLang's CPU backends keep a
shared-memory all-reduce for the same reason.

How (``ShmChannel``): one file in /dev/shm, mapped by every rank of the group and
unlinked once all have it (nothing is left behind, even after a kill).  The ranks meet on
the group's TCP store; the file carries a random token, so a rank on another host (or in
another container) that cannot see it says so, and the whole group keeps gloo.  It holds a
sequence counter per rank (one cache line each) and two phases of one slot per rank.
Every rank runs the same collectives in the same order (the step is the same on all), so
collective number ``seq`` uses phase ``seq % 2`` on every rank:
  * a rank writes its part into its slot, then publishes ``seq`` in its counter;
  * it waits until every counter is >= ``seq``, then reads every slot (the reduction
    runs in rank order, so every rank computes the same bits);
  * before writing into a phase, a rank waits until every counter is >= ``seq - 1``:
    a rank publishes ``seq - 1`` only after it has read collective ``seq - 2``, the
    last user of that phase.  (For the collectives that wait for all, this holds
    already; the step broadcast, where only rank 0 writes, needs it.)
Tensors larger than a slot go through in slot-sized pieces.  A step message larger than
a slot goes through ``torch.distributed`` instead (the slot header says so), so does every
collective on a group without a channel (sp/cp sub-groups, ranks on other nodes).

Waiting spins briefly, then yields, then sleeps in growing steps (an idle follower waiting
for the next step costs no core).  A wait fails with ``CollectiveFailed`` naming the rank
when that rank's process is gone (checked every few ms) or when it has not arrived within
the group's collective timeout (a hung rank), as gloo's timeout did.

Only on x86-64: the protocol relies on the CPU keeping a process's stores in order
(total store order); elsewhere, and with $MTP_SERVE_SHM_COLLECTIVES=0, the group uses
``torch.distributed`` (gloo) for everything.
"""
from __future__ import annotations

import mmap
import os
import pickle
import platform
import time
from typing import Any

import torch
import torch.distributed as dist

ENV = "MTP_SERVE_SHM_COLLECTIVES"
SLOT_BYTES = 4 << 20            # per rank and phase; bigger tensors go through in pieces
YIELD_S = 0.002                 # then sleep: an idle rank (or one of more ranks than cores) frees its core
_LINE = 8                       # int64s per counter: one 64-byte cache line each
_OPS = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}
_DIST_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class CollectiveFailed(RuntimeError):
    """A rank of the group died or did not arrive within the collective timeout."""


def supported() -> bool:
    """Shared-memory collectives are possible here (x86-64 Linux, not switched off)."""
    return (os.environ.get(ENV, "1").strip() != "0" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm"))


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead rank its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class ShmChannel:
    """Collectives among this node's ranks ``ranks`` (global rank numbers, this process
    at index ``me``) over the mapped file ``path`` (module docstring)."""

    def __init__(self, path: str, ranks: list[int], me: int, pids: list[int], timeout_s: float,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.ranks, self.me, self.pids, self.timeout_s = ranks, me, pids, timeout_s
        self.visible = [True] * len(ranks)
        self.size = len(ranks)
        self.slot_bytes = slot_bytes
        head = _head_bytes(self.size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, head + 2 * self.size * slot_bytes)
        finally:
            os.close(fd)
        self._counters = memoryview(self._mm)[:head].cast("q")
        self._head = head
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=head).view(2, self.size, slot_bytes)
        self._seq = 0

    @staticmethod
    def create(path: str, size: int, token: bytes, slot_bytes: int = SLOT_BYTES) -> None:
        """The file, zeroed (every counter 0) but for ``token``, before any rank maps it.
        Its pages are reserved now: a /dev/shm too small (Docker's default is 64 MB) fails
        here, and the group keeps gloo, instead of a rank dying of SIGBUS mid-step."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _head_bytes(size) + 2 * size * slot_bytes)
            os.pwrite(fd, token, size * _LINE * 8)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        else:
            os.close(fd)

    def token(self) -> bytes:
        off = self.size * _LINE * 8
        return bytes(self._mm[off:off + 16])

    # -- the protocol ---------------------------------------------------------------------
    def _publish(self, seq: int) -> None:
        self._counters[self.me * _LINE] = seq

    def _wait(self, seq: int, who: range | tuple[int, ...] | None = None) -> None:
        """Until every counter in ``who`` (default: all) is >= ``seq``."""
        counters, who = self._counters, who if who is not None else range(self.size)
        for _ in range(64):                         # spin
            if all(counters[i * _LINE] >= seq for i in who):
                return
        start = time.monotonic()
        checked, pause = start, 0.0
        while True:
            late = [i for i in who if counters[i * _LINE] < seq]
            if not late:
                return
            now = time.monotonic()
            if now - checked > 0.005:
                checked = now
                self._check(late, now - start)
            # Yield first (ranks may outnumber cores: let the late one run), sleep once
            # the wait is long (an idle follower waiting for the next step).
            if now - start < YIELD_S:
                os.sched_yield()
            else:
                pause = min(0.001, max(pause * 2, 0.00005))
                time.sleep(pause)

    def _check(self, late: list[int], waited: float) -> None:
        for i in late:
            if self.visible[i] and not _alive(self.pids[i]):
                raise CollectiveFailed(f"rank {self.ranks[i]} (pid {self.pids[i]}) exited "
                                       f"during a collective")
        if waited > self.timeout_s:
            names = ", ".join(str(self.ranks[i]) for i in late)
            raise CollectiveFailed(f"rank(s) {names} did not reach the collective within "
                                   f"{self.timeout_s:g} s (hung?)")

    def _next(self) -> tuple[int, torch.Tensor]:
        """The next collective's number and its phase's slots; waits until the phase is free."""
        self._seq += 1
        seq = self._seq
        self._wait(seq - 1)
        return seq, self._data[seq & 1]

    # -- collectives ----------------------------------------------------------------------
    def _exchange(self, flat: torch.Tensor):
        """Each slot-sized piece of ``flat`` written, published and waited for: yields
        (its offset, the piece, every rank's copy of it [size, n]), read before the next."""
        per = self.slot_bytes // flat.element_size()
        for lo in range(0, flat.numel(), per):
            part = flat[lo:lo + per]
            seq, slots = self._next()
            n = part.numel() * part.element_size()
            slots[self.me, :n].view(part.dtype).copy_(part)
            self._publish(seq)
            self._wait(seq)
            yield lo, part, slots[:, :n].view(part.dtype)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> None:
        """``x`` <- the reduction of every rank's ``x`` (in place; same shape on all)."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        for _lo, part, rows in self._exchange(flat):
            if op == "sum" and self.size == 2:
                torch.add(rows[0], rows[1], out=part)
            else:
                part.copy_(_OPS[op](rows))
        if not x.is_contiguous():
            x.copy_(flat.view_as(x))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) stacked in rank order: [size, *x.shape]."""
        flat = x.contiguous().view(-1)
        out = torch.empty((self.size, flat.numel()), dtype=x.dtype, device=x.device)
        for lo, part, rows in self._exchange(flat):
            out[:, lo:lo + part.numel()].copy_(rows)
        return out.view(self.size, *x.shape)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` [size, ...]: row j goes to rank j; returns [size, ...] whose row i came
        from rank i (``torch.distributed.all_to_all_single`` with equal splits)."""
        gathered = self.all_gather(send)                 # [size (from), size (to), ...]
        return gathered[:, self.me].clone()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank index ``src``'s ``obj`` on every rank (pickled; a message larger than a slot
        goes through ``torch.distributed``, the slot header says so)."""
        seq, slots = self._next()
        base = self._head + (seq & 1) * self.size * self.slot_bytes + src * self.slot_bytes
        if self.me == src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(data) <= self.slot_bytes - 8
            self._mm[base:base + 8] = (len(data) if fits else -1).to_bytes(8, "little", signed=True)
            if fits:
                self._mm[base + 8:base + 8 + len(data)] = data
            self._publish(seq)
            if not fits:
                dist.broadcast_object_list([obj], src=self.ranks[src])
            return obj
        self._wait(seq, (src,))
        n = int.from_bytes(self._mm[base:base + 8], "little", signed=True)
        obj = pickle.loads(self._mm[base + 8:base + 8 + n]) if n >= 0 else None
        self._publish(seq)
        if n < 0:
            box = [None]
            dist.broadcast_object_list(box, src=self.ranks[src])
            obj = box[0]
        return obj

    def close(self) -> None:
        self._data = None
        self._counters.release()
        try:
            self._mm.close()
        except BufferError:          # a tensor still views the mapping: the OS unmaps at exit
            pass


def _head_bytes(size: int) -> int:
    return (size + 1) * _LINE * 8          # the counters, then the file's token


def open_channel(store: Any, name: str, ranks: list[int], rank: int, timeout_s: float,
                 wait_s: float, want: bool = True, slot_bytes: int = SLOT_BYTES) -> ShmChannel | None:
    """Rendezvous on the group's TCP store: the first rank creates the file, every rank
    maps it and reports (its pid, or that it cannot see the file), the first rank
    unlinks it.  None, on every rank, unless all of them mapped it (and want it: a rank
    whose ``want`` is false, e.g. switched off by its node's environment, keeps the group
    on gloo).  Every rank of ``ranks`` calls this, in the same order for the same ``name``."""
    import datetime as dt
    wait = dt.timedelta(seconds=wait_s)
    me = ranks.index(rank)
    key = f"shm/{name}"
    if me == 0 and not want:
        store.set(key, f"|{bytes(16).hex()}")
    elif me == 0:
        token = os.urandom(16)
        path = f"/dev/shm/mtp-serve-{os.getpid()}-{token.hex()[:8]}-{name.replace('/', '-')}"
        try:
            ShmChannel.create(path, len(ranks), token, slot_bytes)
        except OSError:
            path = ""
        store.set(key, f"{path}|{token.hex()}")
    store.wait([key], wait)
    path, token_hex = store.get(key).decode().split("|")
    channel = None
    try:
        if path and want:
            channel = ShmChannel(path, ranks, me, [0] * len(ranks), timeout_s, slot_bytes)
            if channel.token() != bytes.fromhex(token_hex):      # another host's file
                channel.close()
                channel = None
    except (OSError, ValueError):
        channel = None
    store.set(f"{key}/pid/{rank}", str(os.getpid() if channel is not None else 0))
    pid_keys = [f"{key}/pid/{r}" for r in ranks]
    store.wait(pid_keys, wait)
    pids = [int(store.get(k)) for k in pid_keys]
    if me == 0 and path:                  # every rank has mapped it or given up
        os.unlink(path)
    if channel is not None and all(pids):
        channel.pids = pids
        # Liveness is read from /proc only for the ranks this process can see (a rank in
        # another pid namespace is watched by the timeout alone).
        channel.visible = [_alive(p) for p in pids]
        return channel
    if channel is not None:
        channel.close()
    return None


# -- what the model and the worker call ----------------------------------------------------
_WORLD: ShmChannel | None = None
_GROUPS: dict[int, ShmChannel] = {}      # id(a torch.distributed sub-group) -> its channel


def install(channel: ShmChannel | None) -> None:
    """The world group's channel (None: ``torch.distributed`` for everything; also drops
    the sub-groups' channels)."""
    global _WORLD
    _WORLD = channel
    if channel is None:
        for ch in _GROUPS.values():
            ch.close()
        _GROUPS.clear()


def bind(group: Any, channel: ShmChannel | None) -> None:
    """A sub-group's channel (None: that group stays on ``torch.distributed``)."""
    if channel is not None:
        _GROUPS[id(group)] = channel


def world_channel() -> ShmChannel | None:
    return _WORLD


def _channel(group: Any) -> ShmChannel | None:
    return _WORLD if group is None else _GROUPS.get(id(group))


@torch.library.custom_op("mtp_serve::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, op: str) -> torch.Tensor:
    """The world all-reduce as an operator a compiled graph calls (rank groups on the
    compiled step): opaque to the compiler, run as Python at each call.  Functional (a new
    tensor), as graphs want; the collectives of a layer depend on each other, so a graph
    cannot reorder them against the uncompiled step of another rank."""
    y = x.clone(memory_format=torch.contiguous_format)
    all_reduce(y, op)
    return y


@_all_reduce_op.register_fake
def _(x: torch.Tensor, op: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def all_reduce(x: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Over the group (None: the world): in place, returning ``x``; inside a graph being
    compiled, the operator above (callers use the returned tensor)."""
    if group is None and torch.compiler.is_compiling():
        return _all_reduce_op(x, op)
    channel = _channel(group)
    if channel is not None:
        channel.all_reduce(x, op)
    else:
        dist.all_reduce(x, op=getattr(dist.ReduceOp, _DIST_OPS[op]), group=group)
    return x


def all_gather_cat(x: torch.Tensor, size: int, dim: int, group: Any = None) -> torch.Tensor:
    """Every rank's ``x`` (same shape on all), concatenated along ``dim`` in rank order
    (``group``: the ``size`` ranks to gather over; None: the world)."""
    channel = _channel(group)
    if channel is not None:
        return torch.cat(list(channel.all_gather(x).unbind(0)), dim=dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def all_to_all(send: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``send`` [size, ...] (row j for rank j) -> [size, ...] (row i from rank i)."""
    channel = _channel(group)
    if channel is not None:
        return channel.all_to_all(send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank of the world."""
    if _WORLD is not None:
        return _WORLD.broadcast_object(obj, _WORLD.ranks.index(src))
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
