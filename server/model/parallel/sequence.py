"""Sequence parallel (MindIE's ``sp``): the latent KV cache striped over the TP ranks.

Under tensor parallel alone every rank holds the whole latent cache (MLA's latent is
shared by all heads, so the heads' split does not split it).  With ``sp == tp == S`` the
cache is cut along the sequence instead, block by block:

    global KV block b lives on rank b % S, at local block b // S.

Worked example, S = 2, block_size 4, a sequence with block table [6, 3, 8]: positions
0-3 (block 6) and 8-11 (block 8) are on rank 0 at local blocks 3 and 4; positions 4-7
(block 3) on rank 1 at local block 1.  The engine, scheduler, prefix cache and block
tables keep global block ids; only the cache translates (``StripedLatentCache``), so
each rank allocates 1/S of the blocks and the pool the engine sees is S times a rank's.

Attention where the context comes from the cache (``SequenceParallelMLA``), per layer:
  1. the per-head latent queries (W_UK folded in: the absorbed form) [T, nH/S, D] are
     all-gathered over the group, so every rank has all heads;
  2. each rank gathers only the blocks it owns (``StripeIndex``: each sequence's owned
     blocks first, compacted) and attends, for every head, over those positions, giving
     a partial output normalised over them and its log-sum-exp (``partial_attention``;
     a row with no owned visible position has LSE -inf and output 0);
  3. (output, LSE) go to the rank that holds each head (one all-to-all: a rank receives
     only its own heads' partials, 1/S of what an all-gather would move) and are merged
     exactly (``merge_partials``, FlashAttention's rule), then W_UV and ``o_proj`` as
     under TP.
A prefill from position 0 attends to its fresh rows, which every rank computed whole
(the latent projections are replicated): no communication there.  Every rank runs the
same batch, so the collectives line up.
"""
from __future__ import annotations

from typing import Any

import torch

from server.distributed.collectives import all_gather_cat, all_to_all
from server.model.layers.attention import MLA, AttentionPlan, _pad, _unpad
from server.model.layers.latent_cache import Int8LatentCache, LatentCache


class StripedLatentCache:
    """This rank's blocks of a striped cache, addressed by global slots (also the
    cache of an attention data parallel group: data_parallel.py, stripe = dp group).

    ``inner`` (a LatentCache or Int8LatentCache) holds the rank's local blocks plus one
    sink block last: rows of blocks another rank owns are written there (no host sync
    to filter them, and the write keeps its shape), and never read.  ``index`` is shared
    by every cache of the pool: the owned blocks of a step's tables, found once for all
    layers."""

    def __init__(self, inner: LatentCache | Int8LatentCache, index: "StripeIndex") -> None:
        self.inner = inner
        self.index = index
        self.rank, self.size, self.block_size = index.rank, index.size, index.block_size
        self.local_blocks = inner.num_blocks - 1          # the last one is the sink
        self.exact = inner.exact

    @property
    def data(self) -> torch.Tensor:
        """The float inner tensor (attention checks its dtype for the fresh-rows path)."""
        return self.inner.data

    @property
    def num_blocks(self) -> int:
        """Global blocks (what the engine's block manager counts)."""
        return self.local_blocks * self.size

    def local_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slots -> (local slots, owned); slots of other ranks' blocks go to the sink."""
        block, offset = slots // self.block_size, slots % self.block_size
        owned = block % self.size == self.rank
        local = torch.where(owned, block // self.size, self.local_blocks)
        return local * self.block_size + offset, owned

    def write(self, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        self.inner.write(self.local_slots(slot_mapping)[0], rows)

    def gather_owned(self, block_tables: torch.Tensor, max_len: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Only the blocks this rank owns, each sequence's first: (rows [B, K, dim],
        their positions [B, K], owned [B, K]: a position of the sequence's first
        ``max_len`` held here; rows not owned are meaningless)."""
        local, positions, owned = self.index.owned(block_tables, max_len)
        return self.inner.gather(local, positions.shape[1]), positions, owned

    def gather(self, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
        """[B, max_len, dim] as a whole cache would give it, zeros at positions not owned."""
        mine = block_tables % self.size == self.rank
        rows = self.inner.gather(block_tables // self.size, max_len)
        return rows.masked_fill(~mine.repeat_interleave(self.block_size, 1)[:, :max_len, None], 0)

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        local, owned = self.local_slots(torch.tensor(slots, dtype=torch.int64))
        if not bool(owned.all()):
            raise ValueError(f"slots {[s for s, o in zip(slots, owned.tolist()) if not o]} "
                             f"are held by another rank (this one holds stripe {self.rank} "
                             f"of the {self.size} the pool is striped into)")
        return self.inner.read_slots(local.tolist())

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """The local tensors (local block ids, sink last): PD rows move by global id
        through engine/kv/transfer/striped.py; the host/disk tiers are refused."""
        return self.inner.block_tensors()


class StripeIndex:
    """Which blocks of a step's block tables this rank owns, compacted, once per step.

    Worked example (S = 2, rank 0, block_size 4): tables [[6, 3, 8], [5, 2, 0]] -> owned
    columns [[0, 2], [1, 2]] (blocks 6, 8 and 2, 0), local blocks [[3, 4], [1, 0]],
    positions [[0..3, 8..11], [4..7, 8..11]].  Width K = the most any sequence owns
    (one host read per step); a sequence owning fewer is padded with unowned columns."""

    def __init__(self, rank: int, size: int, block_size: int) -> None:
        self.rank, self.size, self.block_size = rank, size, block_size
        self._last: tuple = (None, 0, None)     # (block tables, max_len, result): layers share it

    def owned(self, block_tables: torch.Tensor, max_len: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local block tables [B, W], positions [B, W * bs], owned [B, W * bs])."""
        tables, length, result = self._last
        if tables is block_tables and length == max_len:
            return result
        bs = self.block_size
        mine = block_tables % self.size == self.rank                        # [B, nb]
        width = max(1, int(mine.sum(dim=1).max()))
        cols = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)[:, :width]
        local = block_tables.gather(1, cols) // self.size                    # [B, W]
        positions = (cols[:, :, None] * bs + torch.arange(bs, device=cols.device)).flatten(1)
        owned = mine.gather(1, cols).repeat_interleave(bs, dim=1) & (positions < max_len)
        result = (local, positions, owned)
        self._last = (block_tables, max_len, result)
        return result


def partial_attention(q: torch.Tensor, ctx: torch.Tensor, visible: torch.Tensor, scale: float,
                      value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over a subset of the keys.

    q [B, Lq * nH, D] (row ``i * nH + h``: query i, head h), ctx [B, S, D] (values: its
    first ``value_dim`` columns), visible [B, Lq, S] bool ->
    (out [B, Lq * nH, value_dim] normalised over the visible keys, lse [B, Lq * nH]).
    A row with no visible key: lse -inf, out 0 (no NaN)."""
    nh = q.shape[1] // visible.shape[1]
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill_(~visible, float("-inf")).repeat_interleave(nh, dim=1)
    scores = torch.baddbmm(bias, q, ctx.transpose(1, 2), alpha=scale)   # [B, Lq*nH, S]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.bmm(probs, ctx[:, :, :value_dim]), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of R partial attentions: outs [R, ..., dv] (each normalised over its
    keys), lses [R, ...] -> [..., dv].  With m = max_r lse_r:
    out = sum_r exp(lse_r - m) * out_r / sum_r exp(lse_r - m).  Rows empty everywhere
    give 0."""
    m = lses.amax(dim=0)
    m = m.masked_fill(torch.isinf(m), 0.0)
    w = torch.exp(lses - m)                                             # [R, ...]; 0 where -inf
    total = w.sum(dim=0).clamp_min(torch.finfo(w.dtype).tiny)
    return (w[..., None] * outs).sum(dim=0) / total[..., None]


class SequenceParallelMLA(MLA):
    """MLA over a striped cache (module docstring).  ``sp_rank`` / ``sp_size`` are set by
    ``make_sequence_parallel``; ``num_heads`` is this rank's heads, as under TP.
    ``sp_group``: the process group of the sp ranks (None: the world; context_parallel.py
    binds one per cp rank)."""

    sp_rank: int = 0
    sp_size: int = 1
    sp_group: Any = None

    def _attend_cached(self, q_nope, q_pe, cache: StripedLatentCache, plan: AttentionPlan,
                       dtype: torch.dtype) -> torch.Tensor:
        """[T, nH/S, d] queries -> [T, nH/S * dv], context from every rank's positions."""
        own_heads, kvr, size = self.num_heads, self.kv_lora_rank, self.sp_size
        q = all_gather_cat(self._latent_query(q_nope, q_pe), size, dim=1,
                           group=self.sp_group)                              # [T, nH, D]
        nh = q.shape[1]
        b, mq = plan.num_seqs, plan.max_query_len
        q = _pad(q, plan.pad_index, b * mq).view(b, mq * nh, -1)
        ctx, pos, owned = cache.gather_owned(plan.block_tables, plan.max_seq_len)  # [B, K, D]
        pos = pos.clamp(max=plan.max_seq_len - 1)
        keep = owned & plan.key_valid[..., 0].gather(1, pos)                   # [B, K]
        # Rows not kept may hold anything (another block's rows, NaN): zero them.
        ctx = ctx.to(dtype).masked_fill(~keep[..., None], 0.0)
        visible = plan.mask[:, 0].gather(2, pos[:, None, :].expand(-1, mq, -1)) & keep[:, None, :]
        o, lse = partial_attention(q, ctx, visible, self.scale, kvr)
        o = _unpad(o.view(b * mq, nh, kvr), plan.pad_index)                 # [T, nH, kvr]
        lse = _unpad(lse.view(b * mq, nh), plan.pad_index)                  # [T, nH]
        # One all-to-all carries both, [T, nH, kvr + 1] in float32 cut by heads: rank j
        # gets every rank's partials for its own heads only.
        packed = torch.cat([o.float(), lse.float()[..., None]], dim=-1)
        send = packed.view(o.shape[0], size, own_heads, kvr + 1).transpose(0, 1).contiguous()
        recv = all_to_all(send, group=self.sp_group)                        # [S, T, nH/S, kvr+1]
        merged = merge_partials(recv[..., :kvr], recv[..., kvr])          # [T, nH/S, kvr]
        return self._value_out(merged.to(dtype))


def make_sequence_parallel(attn: MLA, rank: int, size: int) -> None:
    """Turn ``attn`` (already cut to this rank's heads) into a SequenceParallelMLA, in
    place: the model is transformed, the attention code does not branch on sp."""
    attn.__class__ = SequenceParallelMLA
    attn.sp_rank = rank
    attn.sp_size = size
