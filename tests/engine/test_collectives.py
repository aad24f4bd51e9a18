"""Shared-memory collectives (server/distributed/collectives.py) between real rank processes,
against what torch.distributed (gloo) computes for the same inputs: sums, max, min,
gathers, all-to-all and the step broadcast, for tensors larger than a slot too (they go
through in pieces) and messages larger than one (they go through gloo); a rank that dies
or hangs fails the others' collective naming it; a rank that cannot map the file (or does
not want to) keeps the whole group on gloo; the file is gone once the group has met."""
from __future__ import annotations

import datetime as dt
import glob
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from server.distributed import collectives
from server.testing.daemon import free_port
from tests.engine.helpers import run_rank_processes

pytestmark = pytest.mark.skipif(not collectives.supported(), reason="shared-memory collectives need x86-64 Linux")

SLOT = 4096                  # bytes: small, so the tests' tensors go through in pieces


def _join(rank: int, world: int, port: int, *, want: bool = True, slot: int = SLOT,
          timeout_s: float = 10.0):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=dt.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    channel = collectives.open_channel(store, "world", list(range(world)), rank, timeout_s, 30.0,
                                       want=want, slot_bytes=slot)
    collectives.install(channel)
    return channel


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {
        "f32": torch.randn(3, 1000, generator=g),                       # 12 kB: 3 pieces
        "bf16": torch.randn(7, 33, generator=g).to(torch.bfloat16),
        "i32": torch.randint(-1000, 1000, (2, 2000), generator=g, dtype=torch.int32),
        "strided": torch.randn(40, 30, generator=g).t(),                 # not contiguous
    }


def _compare(rank: int, world: int, port: int, out_file: str) -> None:
    channel = _join(rank, world, port)
    assert channel is not None
    got, ref = {}, {}
    for name, x in _inputs(rank).items():
        for op in ("sum", "max", "min"):
            a = x.clone()
            collectives.all_reduce(a, op)
            b = x.clone()
            dist.all_reduce(b, op=getattr(dist.ReduceOp, op.upper()))
            got[f"{name}-{op}"], ref[f"{name}-{op}"] = a, b
        got[f"{name}-gather"] = collectives.all_gather_cat(x, world, dim=0)
        parts = [torch.empty_like(x.contiguous()) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ref[f"{name}-gather"] = torch.cat(parts, dim=0)
    send = torch.arange(world * 6, dtype=torch.float32).view(world, 6) + 100 * rank
    got["a2a"] = collectives.all_to_all(send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    ref["a2a"] = recv
    small = {"step": 7, "ids": list(range(50))}
    large = {"blob": os.urandom(3 * SLOT)}                               # through gloo
    got["msgs"] = [collectives.broadcast_object(small if rank == 0 else None),
                   collectives.broadcast_object(large if rank == 0 else None),
                   collectives.broadcast_object("after" if rank == 0 else None)]
    with open(out_file, "wb") as f:
        pickle.dump((got, ref, glob.glob("/dev/shm/mtp-serve-*"), os.getpid()), f)
    dist.barrier()
    channel.close()


@pytest.mark.parametrize("world", [2, 3])
def test_results_equal_gloos_and_the_file_is_gone(world, tmp_path):
    port = free_port()
    codes = run_rank_processes(_compare, lambda r: (r, world, port, str(tmp_path / f"r{r}.pkl")), world)
    assert codes == [0] * world, codes
    outs = [pickle.loads((tmp_path / f"r{r}.pkl").read_bytes()) for r in range(world)]
    creator = outs[0][3]
    for got, ref, shm_files, _pid in outs:
        assert set(got) == set(ref) | {"msgs"}
        for key, want in ref.items():
            if key.startswith("bf16-sum"):         # same sum, rounding order may differ
                torch.testing.assert_close(got[key].float(), want.float(), rtol=1e-2, atol=1e-2)
            elif "f32-sum" in key or "strided-sum" in key:
                torch.testing.assert_close(got[key], want)
            else:
                assert torch.equal(got[key], want), key
        assert got["msgs"][0] == {"step": 7, "ids": list(range(50))} and got["msgs"][2] == "after"
        assert len(got["msgs"][1]["blob"]) == 3 * SLOT
        assert not [f for f in shm_files if f"mtp-serve-{creator}-" in f], shm_files
    # Every rank holds the same bits (the reduction runs in rank order on each).
    for key in outs[0][0]:
        if key not in ("msgs", "a2a"):
            assert all(torch.equal(o[0][key], outs[0][0][key]) for o in outs), key


def _fallback(rank: int, world: int, port: int, out_file: str) -> None:
    channel = _join(rank, world, port, want=rank != 1)
    x = torch.full((4,), float(rank + 1))
    collectives.all_reduce(x)
    msg = collectives.broadcast_object("hello" if rank == 0 else None)
    with open(out_file, "wb") as f:
        pickle.dump((channel is None, x.tolist(), msg), f)


def test_one_rank_without_shared_memory_keeps_the_group_on_gloo(tmp_path):
    port = free_port()
    codes = run_rank_processes(_fallback, lambda r: (r, 2, port, str(tmp_path / f"r{r}.pkl")), 2)
    assert codes == [0, 0], codes
    for r in range(2):
        assert pickle.loads((tmp_path / f"r{r}.pkl").read_bytes()) == (True, [3.0] * 4, "hello")


def _fault(rank: int, world: int, port: int, out_file: str, how: str) -> None:
    channel = _join(rank, world, port, timeout_s=2.0)
    x = torch.ones(8)
    collectives.all_reduce(x)                        # the group works
    if rank == 1:
        if how == "dies":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSTOP)         # hangs
    t0 = time.monotonic()
    try:
        collectives.all_reduce(x)
        result = "no error"
    except collectives.CollectiveFailed as exc:
        result = str(exc)
    with open(out_file, "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}|{result}")
    if how == "hangs":
        os.kill(channel.pids[1], signal.SIGKILL)     # the stopped one
    os._exit(0)


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_dead_or_hung_rank_fails_the_collective_naming_it(how, tmp_path):
    port = free_port()
    out = tmp_path / "r0.txt"
    codes = run_rank_processes(_fault, lambda r: (r, 2, port, str(tmp_path / f"r{r}.txt"), how), 2,
                               timeout=15)
    seconds, message = out.read_text().split("|", 1)
    assert codes[0] == 0
    assert "rank(s) 1 did not reach the collective within 2 s" in message if how == "hangs" \
        else "rank 1 (pid" in message and "exited" in message, message
    # A dead rank is seen within milliseconds; a hung one after the group's timeout.
    assert float(seconds) < (1.0 if how == "dies" else 6.0), seconds
