"""Context parallel (MindIE's ``cp``, only on top of ``sp``): a step's tokens split over cp ranks.

Why: a long prompt's attention is quadratic in its length; with cp the query tokens of
every step are cut over the cp ranks, so each rank projects and attends for its share.

Layout (tp = sp = S, cp = C, worldSize = S x C; tp/sp groups contiguous, cp strided, as
MindIE places them): rank r has head slice / stripe ``r % S`` and cp rank ``r // S``; cp
group j holds ranks j, j + S, ...  With tp 2 sp 2 cp 2: sp groups {0, 1} and {2, 3},
cp groups {0, 2} and {1, 3}.

**KV cache**: each cp rank holds a full copy of the pool striped over its sp group
(sequence_parallel.py: global block b on stripe b % S), so ranks r and r + S hold the same
stripe.  The copy costs memory (the pool per rank is that of sp alone) but keeps decode,
prefix hits and MTP windows simple: any cp rank can attend for any query, with the
existing exact merge over its sp group, and no cache row ever has to move later.

**Split: zigzag.**  Each sequence's new tokens are cut into 2C near-equal chunks; cp rank
c takes chunk c and chunk 2C - 1 - c (rotated by the sequence's index, so the lone token
of a decode goes to rank ``index % C`` and decodes spread over the ranks).  Causal work
grows with a chunk's position, so a rank holding an early and the mirrored late chunk does
about the same attention as every other rank; a contiguous split would give the last rank
~(2C - 1)x the first's.  Each of a rank's chunks is one pseudo-sequence of its own
BatchMetadata (same block table, query_len = chunk length, seq_len = the position after
the chunk), so the ordinary attention plan's causal mask is exact for it.

**Exchange: all-gather over the cp group.**  Per layer a rank projects its tokens only
(queries and latent KV rows), all-gathers the latent rows over its cp group (padded to the
longest share), and writes every row of the step into its stripe (other stripes' rows go
to the sink block).  Every query then sees its whole prefix in the cache: earlier steps'
rows and this step's from every cp rank.  Attention over the cache is sequence parallel
(all heads' latent queries gathered over the sp group, partial attention over the owned
blocks, all-to-all, log-sum-exp merge), so a prefill takes the same exact merge as a
decode.

**After attention**: as under attention data parallel (data_parallel.py), a rank writes
its tokens' o_proj partials (its heads) into a zero buffer of every token's rows, and one
all-reduce over the world sums the heads and fills in the other cp ranks' rows (adding
exact zeros).  Everything else (vocabulary-parallel embedding and head, dense MLPs split
over the world, the MoE over moe_ep x moe_tp, norms, sampling) runs on every token on
every rank with the collectives as without cp: those layers are already split worldSize
ways, so their per-rank work is 1/worldSize either way.  Every rank calls the same
collectives in the same order (a cp rank with no token this step sends padding and adds
zeros; its sp group skips attention together, as both of its ranks have the same share).
The MTP layer attends through the same module; its write-only pass projects every token.
The eager, varlen path serves every step (the static step reads whole caches).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from server.distributed import collectives
from server.model.batch import BatchMetadata
from server.model.layers.attention import AttentionPlan, build_plan
from server.model.layers.latent_cache import as_cache
from server.model.parallel.sequence import SequenceParallelMLA


def zigzag_chunks(num_tokens: int, size: int, index: int = 0) -> list[list[tuple[int, int]]]:
    """Per cp rank, its [start, stop) runs of a sequence's ``num_tokens`` new tokens.

    Example, size 2: 10 tokens -> chunks [0, 2) [2, 5) [5, 7) [7, 10); sequence index 0:
    rank 0 [(0, 2), (7, 10)], rank 1 [(2, 5), (5, 7)]; index 1 swaps them.  One token
    (decode): rank ``index % size`` takes it.  Empty runs are left out."""
    n = 2 * size
    bounds = [i * num_tokens // n for i in range(n + 1)]
    out: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for j in range(n):
        if bounds[j] < bounds[j + 1]:
            mirror = j if j < size else n - 1 - j
            out[(mirror + index) % size].append((bounds[j], bounds[j + 1]))
    return out


@dataclass(slots=True)
class ContextParallelPlan:
    """One step's attention for this rank's cp share."""
    num_tokens: int                        # every token of the step
    local: AttentionPlan | None            # this rank's chunks as pseudo-sequences; None: none
    token_index: torch.Tensor | None       # [T_local] int64: its tokens among the step's
    width: int                             # the longest share: rows each rank sends
    order: torch.Tensor                    # [C * width] step row of each gathered row (T: padding)


def chunk_batch(meta: BatchMetadata, runs: list[tuple[int, int, int]]
                ) -> tuple[BatchMetadata, list[int]]:
    """Runs (sequence, start, stop) of new tokens as pseudo-sequences, and their tokens'
    rows in the step.  A run ending ``k`` tokens before its sequence's last new token has
    seq_len ``seq_len - k``: its queries are the last of that shorter context."""
    qlens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0, *accumulate(qlens)]
    rows = [r for i, a, b in runs for r in range(starts[i] + a, starts[i] + b)]
    lens = [seq_lens[i] - (qlens[i] - b) for i, _, b in runs]
    q = [b - a for _, a, b in runs]
    dev = meta.positions.device
    index = torch.tensor(rows, dtype=torch.int64).to(dev)
    pick = torch.tensor([i for i, _, _ in runs], dtype=torch.int64).to(dev)
    return BatchMetadata(
        positions=meta.positions[index],
        query_start_loc=torch.tensor([0, *accumulate(q)], dtype=torch.int32).to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(dev),
        block_tables=meta.block_tables[pick],
        slot_mapping=meta.slot_mapping[index],
        block_size=meta.block_size,
        query_lens_cpu=q,
        seq_lens_cpu=lens,
    ), rows


class ContextParallelPlanner:
    """Builds a step's ``ContextParallelPlan`` (replaces build_plan on a cp model)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __call__(self, meta: BatchMetadata, rope, num_heads: int,
                 absorb_max_query_len: int) -> ContextParallelPlan:
        num_tokens = meta.positions.shape[0]
        shares: list[list[tuple[int, int, int]]] = [[] for _ in range(self.size)]
        for i, n in enumerate(meta.query_lens_cpu):
            for c, runs in enumerate(zigzag_chunks(n, self.size, i)):
                shares[c].extend((i, a, b) for a, b in runs)
        starts = [0, *accumulate(meta.query_lens_cpu)]
        rows = [[r for i, a, b in share for r in range(starts[i] + a, starts[i] + b)]
                for share in shares]
        width = max(1, max(len(r) for r in rows))
        order = torch.tensor([x for r in rows for x in r + [num_tokens] * (width - len(r))],
                             dtype=torch.int64).to(meta.positions.device)
        mine = shares[self.rank]
        if not mine:
            return ContextParallelPlan(num_tokens, None, None, width, order)
        sub, index = chunk_batch(meta, mine)
        local = build_plan(sub, rope, num_heads, absorb_max_query_len)
        return ContextParallelPlan(num_tokens, local, torch.tensor(index, dtype=torch.int64)
                                   .to(meta.positions.device), width, order)


class ContextParallelMLA(SequenceParallelMLA):
    """Sequence-parallel MLA for this rank's cp share of the step (module docstring);
    ``o_proj`` holds this rank's heads' columns and does not reduce."""

    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None

    def forward(self, x: torch.Tensor, plan: ContextParallelPlan, slot_mapping: torch.Tensor,
                cache) -> torch.Tensor:
        """x [T, H] (every token) -> [T, H]; writes every token's row at ``slot_mapping``."""
        cache = as_cache(cache)
        out = torch.zeros_like(x)
        local = plan.local
        if local is not None:
            xs = x.index_select(0, plan.token_index)
            q_nope, q_pe, latent, k_pe = self._project(xs, local.cos, local.sin)
            rows = torch.cat([latent, k_pe], dim=-1)
        else:
            rows = x.new_zeros(0, self.kv_lora_rank + self.rope_dim)
        cache.write(slot_mapping, self.exchange(rows, plan))
        if local is not None:
            o = self._attend_cached(q_nope, q_pe, cache, local, x.dtype)
            out.index_copy_(0, plan.token_index, self.o_proj(o))
        return collectives.all_reduce(out)

    def exchange(self, rows: torch.Tensor, plan: ContextParallelPlan) -> torch.Tensor:
        """This rank's latent rows [T_local, D] -> every token's [T, D], in step order:
        one all-gather over the cp group, each share padded to ``plan.width`` rows."""
        send = rows.new_zeros(plan.width, rows.shape[1])
        send[: rows.shape[0]] = rows
        gathered = collectives.all_gather_cat(send, self.cp_size, dim=0, group=self.cp_group)
        full = rows.new_zeros(plan.num_tokens + 1, rows.shape[1])      # last row: padding
        full.index_copy_(0, plan.order, gathered)
        return full[: plan.num_tokens]


def make_context_parallel(model, rank: int, size: int) -> None:
    """Turn ``model``'s attention (main and MTP layers, already sequence parallel over
    their sp group) into ContextParallelMLA for cp rank ``rank`` of ``size``, in place;
    the process groups are bound by ``join_groups`` once the ranks have met."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if not isinstance(attn, SequenceParallelMLA):
            raise ValueError("context parallel runs on top of sequence parallel (sp = tp > 1)")
        attn.__class__ = ContextParallelMLA
        attn.cp_rank, attn.cp_size = rank, size
    model.plan_attention = ContextParallelPlanner(rank, size)


def join_groups(model, world_size: int, tp: int, store: Any = None, timeout_s: float = 30.0) -> None:
    """Create the sp (contiguous: tp ranks each) and cp (strided) process groups and bind
    this rank's to every attention layer.  Every rank calls this once, in the same order
    (``dist.new_group`` is collective over the world), after the default group exists.
    With the group's ``store``, and the world on shared memory, each group this rank is
    in gets a shared-memory channel too (model/collectives.py)."""
    rank = dist.get_rank()
    members = {f"sp{g}": list(range(g, g + tp)) for g in range(0, world_size, tp)}
    members.update({f"cp{j}": list(range(j, world_size, tp)) for j in range(tp)})
    groups = {name: dist.new_group(ranks) for name, ranks in members.items()}
    if store is not None and collectives.world_channel() is not None:
        for name, ranks in members.items():
            if rank in ranks:
                collectives.bind(groups[name], collectives.open_channel(
                    store, name, ranks, rank, timeout_s, timeout_s))
    sp_groups = [groups[f"sp{g}"] for g in range(0, world_size, tp)]
    cp_groups = [groups[f"cp{j}"] for j in range(tp)]
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.sp_group = sp_groups[rank // tp]
        attn.cp_group = cp_groups[rank % tp]
