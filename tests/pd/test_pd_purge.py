"""A role change purges what a decode instance loaded from a peer: the block manager's side
(kv/peer_blocks.py), no engine, no daemon.

Rows pulled from P are prefix blocks of D's cache, and every block a request computes on
top of them attends to them.  After a role change (new peers, a new key) none of them may
be hit again, on the device or in the host tier, and rows checked under the old role are
not loaded; D's own blocks stay.
"""
from __future__ import annotations

from server.engine.kv.block_manager import BlockManager, RemoteRow
from server.engine.kv.disk_tier import DiskTier
from server.engine.kv.host_tier import HostTier
from server.engine.protocol import SamplingParams
from server.engine.sequence import Sequence

BS = 4


def _seq(tokens: list[int], rid: str, remote: int = 0, epoch: int | None = None) -> Sequence:
    s = Sequence(rid, list(tokens), len(tokens), SamplingParams(), max_output_tokens=16, seed=0)
    s.remote_kv = tuple(RemoteRow(bytes([i]) * 8) for i in range(remote))
    s.peer_epoch = epoch if remote else None
    return s


def _run(bm: BlockManager, s: Sequence) -> int:
    """Allocate ``s`` (its prefix matched), compute it all but its last token, register;
    the number of blocks it got without computing them."""
    m = bm.match_prefix(s)
    bm.allocate(s, m, s.num_tokens)
    s.num_computed_tokens = s.num_tokens - 1
    bm.register_computed(s)
    return m.num_blocks


PEER = list(range(100, 117))          # 4 full blocks and the token after them
OWN = list(range(200, 217))


def test_role_change_purges_peer_blocks_and_what_was_computed_on_them():
    bm = BlockManager(32, BS, enable_prefix_cache=True, host=HostTier(8), host_prefix=True)
    a = _seq(PEER, "a", remote=2, epoch=1)            # rows for blocks 0-1, computes 2-3
    assert _run(bm, a) == 2 and bm.num_remote_hits == 2 * BS
    own = _seq(OWN, "own")
    _run(bm, own)
    bm.free(a)
    bm.free(own)
    assert _run(bm, _seq(PEER + [1], "b")) == 4       # all four hit, the derived ones too
    bm.purge_peer_blocks(2)
    c = _seq(PEER + [2], "c")
    assert bm.match_prefix(c).num_blocks == 0         # none of the four any more
    assert _run(bm, _seq(OWN + [3], "own2")) == 4     # D's own blocks stay
    # Rows checked under the old role are not loaded after the change; new ones are.
    assert bm.match_prefix(_seq(PEER + [4], "old", remote=4, epoch=1)).num_blocks == 0
    assert bm.match_prefix(_seq(PEER + [5], "new", remote=4, epoch=2)).num_blocks == 4


def test_a_running_request_on_peer_rows_registers_nothing_after_the_change():
    bm = BlockManager(32, BS, enable_prefix_cache=True)
    a = _seq(PEER, "a", remote=2, epoch=1)
    m = bm.match_prefix(a)
    bm.allocate(a, m, a.num_tokens)
    a.num_computed_tokens = 2 * BS                    # its own blocks not computed yet
    bm.purge_peer_blocks(2)
    a.num_computed_tokens = a.num_tokens - 1
    bm.register_computed(a)
    bm.free(a)
    assert bm.match_prefix(_seq(PEER + [1], "b")).num_blocks == 0
    assert bm.num_free_blocks == 32


def test_peer_blocks_leave_the_device_for_the_host_tier_never_for_disk(tmp_path):
    host = HostTier(8)
    bm = BlockManager(5, BS, enable_prefix_cache=True, host=host, host_prefix=True,
                      disk=DiskTier(tmp_path, 16, 8, BS))
    a = _seq(PEER, "a", remote=4, epoch=1)
    _run(bm, a)
    bm.free(a)
    x = _seq(OWN, "x")                                # takes the pool: a's blocks go to
    _run(bm, x)                                       # the host tier
    bm.free(x)
    moves = bm.take_transfers()
    assert host.num_cached_blocks == 4 and len(moves.saves) == 4
    assert moves.disk_writes == []                    # a restart could not tell them apart
    y = _seq(OWN[:1] + PEER, "y")                     # x's own blocks do reach the disk
    _run(bm, y)
    assert len(bm.take_transfers().disk_writes) == 4
    bm.free(y)
    assert _run(bm, _seq(PEER + [1], "b")) == 4       # found again in the host tier
    bm.take_transfers()
    bm.purge_peer_blocks(2)
    assert bm.match_prefix(_seq(PEER + [2], "c")).num_blocks == 0
