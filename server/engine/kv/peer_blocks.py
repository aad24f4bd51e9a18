"""Which prefix blocks derive from KV rows a PD peer sent, so a role change can purge them.
No torch.

A decode instance (D) loads rows pulled from a prefill instance (P) as prefix blocks
(``seq.remote_kv``), and every block a request computes after them attends to them.  Those
blocks are right as long as D's role, peers and key are the ones the rows were checked
under; a role change (server/api/planes/pd_routes.py) is a change of whom D trusts.  Before, an
attacker who posted D a role naming their own KV server had their rows stay in D's
prefix cache after the coordinator posted the real role back: later clients got garbage
with HTTP 200.

The bookkeeping (the block manager calls it; kv/block_manager.py):

  * a request's rows carry the role version they were checked under
    (``EngineRequest.remote_kv_epoch`` -> ``Sequence.peer_epoch``); a request that hits a
    cached block derived from a peer inherits that block's version;
  * a block such a request registers is tagged with the version (``tag``);
  * ``purge(epoch)``: the role is now version ``epoch``; every block tagged with an older
    version is named for removal (device cache and host tier), rows of an older version
    are no longer loaded (``rows_usable``), and a running request whose KV derives from
    one registers nothing more (``may_register``).

Tagged blocks are never written to the disk tier: a restarted daemon has lost its tags and
could not tell them apart.  Tags of blocks that left every tier are pruned once there are
more than twice as many tags as the tiers hold blocks.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

from server.engine.sequence import Sequence


class PeerBlocks:
    def __init__(self, capacity: int) -> None:
        self.epoch = 0                           # the role version of the latest purge
        self._tags: dict[Hashable, int] = {}     # block key -> oldest peer version it derives from
        self._limit = 2 * capacity + 64
        self.num_purged = 0                      # blocks forgotten by purges

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tags

    def rows_usable(self, seq: Sequence) -> bool:
        """Whether ``seq``'s pulled rows may still be loaded (checked under the current
        role or a later one)."""
        return seq.peer_epoch is not None and seq.peer_epoch >= self.epoch

    def may_register(self, seq: Sequence) -> bool:
        return seq.peer_epoch is None or seq.peer_epoch >= self.epoch

    def inherit(self, seq: Sequence, keys: Iterable[Hashable]) -> None:
        """``seq`` now uses the blocks ``keys``: its KV derives from whatever they do."""
        for key in keys:
            epoch = self._tags.get(key)
            if epoch is not None:
                seq.peer_epoch = epoch if seq.peer_epoch is None else min(seq.peer_epoch, epoch)

    def tag(self, key: Hashable, seq: Sequence, held: Callable[[Hashable], bool]) -> None:
        """``seq`` registered the block ``key`` (``held``: whether a tier still holds a key,
        for pruning)."""
        if seq.peer_epoch is None:
            return
        self._tags[key] = seq.peer_epoch
        if len(self._tags) > self._limit:
            self._tags = {k: e for k, e in self._tags.items() if held(k)}

    def forget(self, key: Hashable) -> None:
        """The block ``key`` left every tier."""
        self._tags.pop(key, None)

    def purge(self, epoch: int) -> list[Hashable]:
        """The role is now version ``epoch``: the keys of every block derived from rows of
        an earlier version (the caller removes them from its tiers)."""
        self.epoch = max(self.epoch, epoch)
        stale = [k for k, e in self._tags.items() if e < self.epoch]
        for key in stale:
            del self._tags[key]
        self.num_purged += len(stale)
        return stale
