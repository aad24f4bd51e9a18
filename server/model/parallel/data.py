"""Attention data parallel (MindIE's ``dp``): each dp group attends for its own requests.

The world is dp groups of tp ranks (tp groups contiguous: rank r is in dp group r // tp,
attention-head slice r % tp).  Every rank receives the whole step, as under tensor
parallel, and runs the same non-attention work on every token: the vocabulary-parallel
embedding, dense MLPs, the MoE (experts over moe_ep groups, one all-reduce), norms, the
head and sampling, so rank 0's tokens are the one process's.  Attention is where the
groups differ:

* A request's KV lives in one dp group only.  The pool is striped by block as under
  sequence parallel (global block b on group b % dp, at local block b // dp: the same
  ``StripedLatentCache``), but the engine's block manager hands each request blocks of
  one stripe only (engine/kv/dp_blocks.py), so a group holds its requests' whole context
  and no attention reads another group's rows.  The same npuMemSize per rank holds dp
  times one group's tokens; nothing is duplicated across groups.
* Per layer a rank computes attention (projections, cache write, attention, o_proj over
  its heads) for its group's tokens only, into a zero buffer with a row for every token
  of the step; one all-reduce over the world fills in the other groups' rows (a row has
  one non-zero contribution per head slice, so with tp 1 the sum is exact) and, with
  tp > 1, also sums the heads' partial o_proj outputs, the all-reduce tensor parallel
  would do on its own.  A group that owns no token this step adds zeros: every rank
  calls the same collectives in the same order with the same shapes.

Which sequences a group owns is read from the host copy of each sequence's first block
(``BatchMetadata.first_blocks_cpu``: no device sync), and the plan of the group's
sub-batch is built once per forward and shared by every layer (``DataParallelPlanner``).
The MTP layer attends through the same module.  ``write_cache`` (the MTP layer's
write-only pass) projects every token and the striped cache drops the rows of other
groups' blocks into its sink block.  The static/compiled step is not used with dp: its
functions read whole caches (static_decode.supports_static_decode), so the eager, varlen
path serves every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from server.distributed import collectives
from server.model.batch import BatchMetadata
from server.model.layers.attention import MLA, AttentionPlan, build_plan


@dataclass(slots=True)
class DataParallelPlan:
    """One step's attention for this rank's dp group."""
    num_tokens: int                        # every token of the step
    local: AttentionPlan | None            # the group's sub-batch; None: it owns no sequence
    token_index: torch.Tensor | None       # [T_local] int64: its tokens among the step's
    slot_mapping: torch.Tensor | None      # [T_local] their cache slots


def sub_batch(meta: BatchMetadata, seqs: list[int]) -> tuple[BatchMetadata, torch.Tensor]:
    """The metadata of sequences ``seqs`` (indices into ``meta``, in order) alone, and
    their tokens' rows in the step: [T_local] int64.

    Example: query lens [2, 3, 1], seqs [1, 2] -> rows [2, 3, 4, 5], query_start_loc
    [0, 3, 4]; positions, slots, seq lens and block tables are those rows' and sequences'."""
    qlens = meta.query_lens_cpu
    starts = [0, *accumulate(qlens)]
    rows = [r for i in seqs for r in range(starts[i], starts[i] + qlens[i])]
    dev = meta.positions.device
    index = torch.tensor(rows, dtype=torch.int64).to(dev)
    pick = torch.tensor(seqs, dtype=torch.int64).to(dev)
    q = [qlens[i] for i in seqs]
    first = meta.first_blocks_cpu
    return BatchMetadata(
        positions=meta.positions[index],
        query_start_loc=torch.tensor([0, *accumulate(q)], dtype=torch.int32).to(dev),
        seq_lens=meta.seq_lens[pick],
        block_tables=meta.block_tables[pick],
        slot_mapping=meta.slot_mapping[index],
        block_size=meta.block_size,
        query_lens_cpu=q,
        seq_lens_cpu=[meta.seq_lens_cpu[i] for i in seqs],
        first_blocks_cpu=[first[i] for i in seqs] if first is not None else None,
    ), index


class DataParallelPlanner:
    """Builds a step's ``DataParallelPlan`` (replaces build_plan on a dp model)."""

    def __init__(self, group: int, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, meta: BatchMetadata, rope, num_heads: int,
                 absorb_max_query_len: int) -> DataParallelPlan:
        if meta.first_blocks_cpu is None:
            raise ValueError("attention data parallel needs each sequence's first block on "
                             "the host (BatchMetadata.first_blocks_cpu)")
        num_tokens = meta.positions.shape[0]
        own = [i for i, b in enumerate(meta.first_blocks_cpu) if b % self.size == self.group]
        if not own:
            return DataParallelPlan(num_tokens, None, None, None)
        sub, index = sub_batch(meta, own)
        return DataParallelPlan(num_tokens, build_plan(sub, rope, num_heads, absorb_max_query_len),
                                index, sub.slot_mapping)


class DataParallelMLA(MLA):
    """MLA for this rank's dp group's tokens, every token's output after one all-reduce
    (module docstring).  ``o_proj`` holds this rank's heads' columns and does not reduce."""

    def forward(self, x: torch.Tensor, plan: DataParallelPlan, slot_mapping: torch.Tensor,
                cache) -> torch.Tensor:
        """x [T, H] (every token) -> [T, H]; ``slot_mapping`` (every token's) is unused:
        the group's slots are in the plan."""
        out = torch.zeros_like(x)
        if plan.local is not None:
            mine = super().forward(x.index_select(0, plan.token_index), plan.local,
                                   plan.slot_mapping, cache)
            out.index_copy_(0, plan.token_index, mine)
        return collectives.all_reduce(out)


def make_data_parallel(model, group: int, size: int) -> None:
    """Turn ``model``'s attention (main and MTP layers, already cut to this rank's heads)
    into DataParallelMLA for dp group ``group`` of ``size``, in place."""
    for layer in model.model.layers:
        layer.self_attn.__class__ = DataParallelMLA
    model.plan_attention = DataParallelPlanner(group, size)
