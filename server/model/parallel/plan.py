"""Tensor and expert parallelism: one rank's shard of a DeepSeek-V3 model.

The model is built whole on the meta device, then ``shard_model`` replaces the pieces a
rank holds only part of (gpt-fast's way: transform the model, do not branch inside it):

* attention (MLA), tensor parallel over the tp ranks (all of them unless ``dp`` > 1):
  ``q_proj``/``q_b_proj`` and
  ``kv_b_proj`` keep this rank's heads (rows), ``o_proj`` keeps the matching input columns
  and all-reduces its output.  The latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``)
  and their norms are replicated, so every rank writes the same latent rows: the latent KV
  cache is replicated per rank (it is shared by all heads, the MLA design; a per-head
  split does not exist to be made).  With ``sp`` = tp the cache is striped over the
  ranks by block instead, and attention over it merges the ranks' partial results
  (sequence_parallel.py).  With ``dp`` > 1 (attention data parallel) the world is dp
  groups of tp = worldSize / dp ranks, each attending for its own requests only, and
  ``o_proj`` leaves its sum to the all-reduce that gathers the groups' rows
  (data_parallel.py); everything below still runs over all ranks on every token.
  With ``cp`` > 1 (context parallel, on top of sp) the world is cp groups of tp ranks
  that split each step's query tokens (context_parallel.py); ``o_proj`` again leaves its
  sum to the all-reduce that gathers the cp ranks' rows.
* dense MLP: ``gate_proj``/``up_proj`` keep a slice of the intermediate rows,
  ``down_proj`` the matching columns and all-reduces.
* MoE: the router is replicated (every rank routes every token the same way); routed
  experts are partitioned over ``moe_ep`` groups of ``moe_tp`` ranks, and within a group
  each expert's intermediate is split ``moe_tp`` ways; the shared experts' intermediate is
  split over all ranks.  Every rank holds every token (attention is not data parallel),
  so dispatch needs no collective: a rank runs its experts on the tokens routed to them
  and one all-reduce of the layer output combines routed and shared partial sums.
* embedding and ``lm_head`` (the MTP head too): vocabulary-parallel.  A rank looks up
  only its rows (others give zero, then all-reduce: exact), and computes its vocabulary
  slice of the logits, then all-gathers them, so every rank holds identical full logits
  and samples identically with the counter-based sampler.

Rank layout: rank r has attention rank r, expert group ``r // moe_tp`` and expert slice
``r % moe_tp``.  ``shard_model`` returns, for each sharded parameter, which checkpoint
tensor and which slice of it the rank loads (loader.py reads only that slice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from server.config.parallel_layout import LayoutError, ParallelLayout
from server.distributed import collectives
from server.model.kernels.products import UsesProducts
from server.model.layers.linear import Linear
from server.model.meta import meta_device
from server.model.parallel.context import make_context_parallel
from server.model.parallel.data import make_data_parallel
from server.model.parallel.sequence import make_sequence_parallel


class ShardError(ValueError):
    """The model's shapes do not divide over the requested parallel sizes."""


@dataclass(frozen=True, slots=True)
class ParallelPlan(ParallelLayout):
    """One rank's place in the group: a layout (its sizes and rules are
    server/config/parallel_layout.py's: dp attention data parallel groups or cp context
    parallel ranks of tp contiguous ranks, which split the attention heads; dense layers,
    the vocabulary and ``moe_tp * moe_ep`` cover the world; ``sp`` 1 or tp, the latent
    cache striped: sequence.py) and the rank this shard is cut for.  A layout that breaks
    a rule, or that this build does not serve, raises LayoutError here."""

    rank: int = 0

    def __post_init__(self) -> None:
        self.check()
        if not 0 <= self.rank < self.world_size:
            raise LayoutError(f"rank {self.rank} outside [0, {self.world_size})")

    @property
    def dp_rank(self) -> int:
        """This rank's dp group (tp groups are contiguous ranks)."""
        return self.rank // self.tp

    @property
    def cp_rank(self) -> int:
        """This rank's place in its cp group (cp groups are strided: j, j + tp, ...)."""
        return self.rank // self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Parameter <- ``source[start:stop]`` along ``dim`` of checkpoint tensor ``source``
    (dim None: the whole tensor, under another name)."""

    source: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    def index(self, ndim: int) -> tuple[slice, ...]:
        idx = [slice(None)] * ndim
        if self.dim is not None:
            idx[self.dim] = slice(self.start, self.stop)
        return tuple(idx)


# -- layers ----------------------------------------------------------------------------
class AllReduce(nn.Module):
    """Sum partial results over the group, in place (the MoE's combine step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(x)


class RowParallelLinear(Linear):
    """A linear layer holding a slice of the input features; output summed over ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(self.products.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding; the others look up zero."""

    def __init__(self, rows: int, dim: int, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return collectives.all_reduce(out * mine[..., None].to(out.dtype))


class VocabParallelHead(nn.Module, UsesProducts):
    """This rank's vocabulary slice of the logits, all-gathered into the full row."""

    def __init__(self, rows: int, dim: int, world_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_gather_cat(self.products.linear(x, self.weight), self.world_size, dim=-1)


# -- sharding --------------------------------------------------------------------------
def _split(total: int, ways: int, index: int, what: str) -> tuple[int, int]:
    if total % ways:
        raise ShardError(f"{what} ({total}) does not divide by {ways}")
    size = total // ways
    return index * size, (index + 1) * size


def _meta_linear(cls: type[Linear], in_f: int, out_f: int) -> Linear:
    with meta_device():
        return cls(in_f, out_f, bias=False)


def shard_model(model: nn.Module, plan: ParallelPlan) -> dict[str, TensorSlice]:
    """Cut the meta-device ``model`` down to rank ``plan.rank``'s shard, in place; return
    the checkpoint slice each sharded parameter loads (parameters not named load whole)."""
    if plan.world_size == 1:
        return {}
    cfg = model.config
    world, r = plan.world_size, plan.rank
    slices: dict[str, TensorSlice] = {}

    def rows(name: str, a: int, b: int, source: str | None = None) -> None:
        slices[name] = TensorSlice(source or name, 0, a, b)

    def cols(name: str, a: int, b: int, source: str | None = None) -> None:
        slices[name] = TensorSlice(source or name, 1, a, b)

    v0, v1 = _split(cfg.vocab_size, world, r, "vocab_size")
    emb = model.model.embed_tokens
    with meta_device():
        model.model.embed_tokens = VocabParallelEmbedding(v1 - v0, emb.embedding_dim, v0)
        model.lm_head = VocabParallelHead(v1 - v0, cfg.hidden_size, world)
    rows("model.embed_tokens.weight", v0, v1)
    rows("lm_head.weight", v0, v1)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

    h0, h1 = _split(cfg.num_attention_heads, plan.tp, r % plan.tp, "num_attention_heads")
    local_heads = h1 - h0
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        if plan.tp > 1:
            _shard_attention(layer.self_attn, f"{p}.self_attn", h0, h1, plan, rows, cols)
        if plan.sp > 1:
            make_sequence_parallel(layer.self_attn, r % plan.tp, plan.sp)
        if hasattr(layer.mlp, "gate"):
            _shard_moe(layer.mlp, f"{p}.mlp", plan, rows, cols)
        else:
            a, b = _split(layer.mlp.gate_proj.out_features, world, r, f"{p} intermediate_size")
            _shard_mlp(layer.mlp, f"{p}.mlp", a, b, rows, cols, RowParallelLinear)
        head = getattr(layer, "shared_head", None)
        if head is not None:
            with meta_device():
                head.head = VocabParallelHead(v1 - v0, cfg.hidden_size, world)
            rows(f"{p}.shared_head.head.weight", v0, v1)
    model.num_local_heads = local_heads
    if plan.dp > 1:
        make_data_parallel(model, plan.dp_rank, plan.dp)
    if plan.cp > 1:
        make_context_parallel(model, plan.cp_rank, plan.cp)
    return slices


def _shard_attention(attn: nn.Module, prefix: str, h0: int, h1: int, plan: ParallelPlan,
                     rows, cols) -> None:
    """Keep heads [h0, h1) of an MLA; ``o_proj`` all-reduces its output unless dp or
    cp > 1, where the all-reduce that gathers the groups' rows sums the heads too."""
    hidden = attn.o_proj.out_features
    qk, dv, heads = attn.nope_dim + attn.rope_dim, attn.v_dim, h1 - h0
    q_name = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    q = getattr(attn, q_name)
    setattr(attn, q_name, _meta_linear(Linear, q.in_features, heads * qk))
    rows(f"{prefix}.{q_name}.weight", h0 * qk, h1 * qk)
    kvb = attn.kv_b_proj
    attn.kv_b_proj = _meta_linear(Linear, kvb.in_features, heads * (attn.nope_dim + dv))
    rows(f"{prefix}.kv_b_proj.weight", h0 * (attn.nope_dim + dv), h1 * (attn.nope_dim + dv))
    o_cls = RowParallelLinear if plan.dp == 1 and plan.cp == 1 else Linear
    attn.o_proj = _meta_linear(o_cls, heads * dv, hidden)
    cols(f"{prefix}.o_proj.weight", h0 * dv, h1 * dv)
    attn.num_heads = heads


def _shard_mlp(mlp: nn.Module, prefix: str, a: int, b: int, rows, cols,
               down_cls: type[Linear] = Linear, source: str | None = None) -> None:
    """Keep intermediate slice [a, b) of a SwiGLU MLP (``source``: its checkpoint prefix)."""
    src = source or prefix
    h = mlp.gate_proj.in_features
    mlp.gate_proj = _meta_linear(Linear, h, b - a)
    mlp.up_proj = _meta_linear(Linear, h, b - a)
    mlp.down_proj = _meta_linear(down_cls, b - a, h)
    rows(f"{prefix}.gate_proj.weight", a, b, f"{src}.gate_proj.weight")
    rows(f"{prefix}.up_proj.weight", a, b, f"{src}.up_proj.weight")
    cols(f"{prefix}.down_proj.weight", a, b, f"{src}.down_proj.weight")


def _shard_moe(moe: nn.Module, prefix: str, plan: ParallelPlan, rows, cols) -> None:
    e0, e1 = _split(moe.num_experts, plan.moe_ep, plan.ep_rank, f"{prefix} n_routed_experts")
    inter = moe.experts[0].gate_proj.out_features
    a, b = _split(inter, plan.moe_tp, plan.moe_tp_rank, f"{prefix} moe_intermediate_size")
    kept = nn.ModuleList(moe.experts[e] for e in range(e0, e1))
    for j, e in enumerate(range(e0, e1)):
        _shard_mlp(kept[j], f"{prefix}.experts.{j}", a, b, rows, cols,
                   source=f"{prefix}.experts.{e}")
    moe.experts = kept
    moe.expert_offset = e0
    if moe.shared_experts is not None:
        sa, sb = _split(moe.shared_experts.gate_proj.out_features, plan.world_size, plan.rank,
                        f"{prefix} shared experts' intermediate size")
        _shard_mlp(moe.shared_experts, f"{prefix}.shared_experts", sa, sb, rows, cols)
    moe.combine = AllReduce()
    moe._stack_params = None
