"""Multi-head Latent Attention over a paged latent cache.

Per token the cache row is ``[kv_a_layernorm(latent) (kv_lora_rank) | roped k_pe (rope_dim)]``;
full keys/values are never stored. Two ways to attend, same maths:

* decompressed: expand the context's latents through ``kv_b_proj`` into per-head
  k_nope / v and run ordinary attention. Cheap when many queries share one context (prefill).
* absorbed: fold ``W_UK`` into the query (q_nope @ W_UK -> latent space) and ``W_UV`` into
  the output, so each query reads only the ``kv_cache_dim``-wide cache rows, shared by all
  heads (multi-query). Cheap when few queries read a long context (decode, verification).

Batching: every sequence's context is gathered through its block table into a padded
[num_seqs, max_seq_len, kv_cache_dim] tensor, queries are padded to [num_seqs, max_query_len]
and one masked SDPA call covers the batch. ``AttentionPlan`` holds the index tensors and
mask, built once per forward and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from server.model.batch import BatchMetadata
from server.model.config import DeepseekConfig
from server.model.kernels.products import UsesProducts
from server.model.layers.latent_cache import CacheLike, as_cache
from server.model.layers.linear import Linear, restacked, weight_key
from server.model.layers.norm import RMSNorm
from server.model.layers.rotary import RotaryEmbedding
from server.model.quant.linear import stacked_forward, stacked_int8

# Steps whose longest query is at most this many tokens use the absorbed form.
DEFAULT_ABSORB_MAX_QUERY_LEN = 16


@dataclass(slots=True)
class AttentionPlan:
    """Per-step gather/pad indices and masks (built by ``build_plan``, read by every layer)."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    pad_index: torch.Tensor       # [num_tokens] int64: flat token -> seq * max_query_len + i
    block_tables: torch.Tensor    # [num_seqs, blocks covering max_seq_len] int64
    key_valid: torch.Tensor       # [num_seqs, max_seq_len, 1] bool: key inside the sequence
    mask: torch.Tensor            # [num_seqs, 1, max_query_len, max_seq_len] bool: causal + length
    absorbed: bool
    head_bias: torch.Tensor | None  # absorbed form: additive mask (0 / -inf), heads as rows [B, Lq * nH | 1, S]
    cos: torch.Tensor             # [num_tokens, 1, rope_dim // 2]
    sin: torch.Tensor
    fresh_lens: list[int] | None = None  # every sequence a prefill from position 0: its length


def build_plan(
    meta: BatchMetadata, rope: RotaryEmbedding, num_heads: int, absorb_max_query_len: int
) -> AttentionPlan:
    """Worked example (block_size 4): seq A query_len 2, seq_len 7; seq B query_len 3, seq_len 3.

    max_query_len 3, max_seq_len 7. Token 0,1 (A) -> padded rows 0,1; tokens 2..4 (B) -> rows 3..5.
    A's query row i sits at position 5 + i and sees keys 0..5+i; B's row i sees keys 0..i.
    """
    device = meta.positions.device
    num_seqs = meta.num_seqs
    max_q = max(meta.query_lens_cpu)
    max_s = max(meta.seq_lens_cpu)
    num_tokens = meta.positions.shape[0]
    qsl = meta.query_start_loc.to(torch.int64)
    query_lens = qsl[1:] - qsl[:-1]
    seq_ids = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
    )
    within = torch.arange(num_tokens, device=device) - qsl[seq_ids]
    pad_index = seq_ids * max_q + within
    seq_lens = meta.seq_lens.to(torch.int64)
    # Absolute position of padded query row i of each sequence (rows past query_len are
    # discarded later; they still see key 0, so no row is fully masked).
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    keys = torch.arange(max_s, device=device)
    mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]
    key_valid = (keys[None, :] < seq_lens[:, None])[..., None]
    num_blocks = -(-max_s // meta.block_size)
    cos, sin = rope.cos_sin(meta.positions)
    absorbed = max_q <= absorb_max_query_len
    head_bias = None
    if absorbed:
        # Row q * nH + h of the absorbed query is query q, head h: repeat each mask row nH
        # times (one row broadcasts over the heads when max_q == 1).  Additive, built once
        # per step instead of SDPA converting a bool mask in every layer.
        rows = mask[:, 0] if max_q == 1 else mask[:, 0].repeat_interleave(num_heads, dim=1)
        head_bias = torch.zeros(rows.shape, device=device).masked_fill_(~rows, float("-inf"))
    return AttentionPlan(
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_seq_len=max_s,
        pad_index=pad_index,
        block_tables=meta.block_tables[:, :num_blocks].to(torch.int64),
        key_valid=key_valid,
        mask=mask,
        absorbed=absorbed,
        head_bias=head_bias,
        cos=cos[:, None, :],
        sin=sin[:, None, :],
        fresh_lens=(list(meta.query_lens_cpu)
                    if not absorbed and meta.query_lens_cpu == meta.seq_lens_cpu else None),
    )


class MLA(nn.Module, UsesProducts):
    def __init__(self, cfg: DeepseekConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.scale = cfg.softmax_scale
        self.rope = rope
        h, qk = cfg.hidden_size, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=False)
        self.register_buffer("q_kv_a", None, persistent=False)     # stack_projections()
        # int8 q_a and kv_a as one (quant/linear.stacked_int8): weights and their scales
        self.register_buffer("q_kv_a_int8", None, persistent=False)
        self.register_buffer("q_kv_a_scale", None, persistent=False)
        # W_UK^T [nH, kvr, dn] and W_UV [nH, dv, kvr], each head's rows contiguous, where the
        # products multiply heads as rows (stack_projections): copies of kv_b_proj's rows.
        self.register_buffer("w_uk_rows", None, persistent=False)
        self.register_buffer("w_uv_rows", None, persistent=False)
        self._head_rows_of: tuple[int, int] | None = None       # the kv_b weight they copy

    def stack_projections(self) -> None:
        """q_a and kv_a (both read the layer's input) as one weight, read by one product
        (linear.stacked says why)."""
        if self.q_lora_rank is not None:
            pair = [self.q_a_proj, self.kv_a_proj_with_mqa]
            self.q_kv_a = restacked(pair, self.q_kv_a)
            if self.q_kv_a is None:
                self.q_kv_a_int8, self.q_kv_a_scale = stacked_int8(pair, self.q_kv_a_int8, self.q_kv_a_scale)
        w = self.kv_b_proj.weight
        # Made again only where kv_b changed since (replaced, or edited in place).
        if self.products.takes_head_rows(w) and type(self.kv_b_proj) is Linear \
                and self._head_rows_of != weight_key(w):
            self._head_rows_of = weight_key(w)
            nh, dn, kvr = self.num_heads, self.nope_dim, self.kv_lora_rank
            heads = w.detach().view(nh, dn + self.v_dim, kvr)
            self.w_uk_rows = heads[:, :dn].transpose(1, 2).contiguous()     # [nH, kvr, dn]
            self.w_uv_rows = heads[:, dn:].contiguous()                     # [nH, dv, kvr]

    def weights_moved(self) -> None:
        """The weights' bytes moved (loading/arena.py), their values as they were: W_UK / W_UV
        still copy kv_b."""
        if self._head_rows_of is not None:
            self._head_rows_of = weight_key(self.kv_b_proj.weight)

    # -- shared pieces -------------------------------------------------------------------
    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., H] -> q_nope [..., nH, dn], q_pe [..., nH, dr], latent [..., kvr], k_pe [..., dr]."""
        if self.q_kv_a is not None or self.q_kv_a_scale is not None:   # q_a and kv_a as one
            both = self.products.linear(x, self.q_kv_a) if self.q_kv_a is not None else \
                stacked_forward(x, self.q_kv_a_int8, self.q_kv_a_scale, self.q_a_proj.backend)
            q_a, kv = both.split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        elif self.q_lora_rank is None:
            q = self.q_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            kv = self.kv_a_proj_with_mqa(x)
        q = q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self.rope.apply(q_pe, cos, sin)
        k_pe = self.rope.apply(k_pe[..., None, :], cos, sin)[..., 0, :]
        return q_nope, q_pe, latent, k_pe

    def write_cache(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slot_mapping: torch.Tensor, cache: CacheLike) -> None:
        """Only write the cache rows of x [T, H] (what ``forward`` writes), attend nothing."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = self.rope.apply(k_pe[..., None, :], cos, sin)[..., 0, :]
        as_cache(cache).write(slot_mapping, torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1))

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, S, kvr] -> k_nope [B, nH, S, dn], v [B, nH, S, dv]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.nope_dim + self.v_dim))
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        return k_nope, v

    def _attend_decompressed(self, q_nope, q_pe, latent, k_pe, mask=None, is_causal=False):
        """q_* [B, L, nH, d]; latent [B, S, kvr]; k_pe [B, S, dr] -> [B, L, nH * dv]."""
        k_nope, v = self._expand(latent)
        s = latent.shape[1]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, s, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)
        return out.transpose(1, 2).flatten(2)

    # -- full sequence, no cache (training / references) ----------------------------------
    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, L, H], cos/sin [L, 1, dr/2] -> [B, L, H], causal over positions 0..L-1."""
        q_nope, q_pe, latent, k_pe = self._project(x, cos, sin)
        return self.o_proj(self._attend_decompressed(q_nope, q_pe, latent, k_pe, is_causal=True))

    # -- paged cache ---------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, slot_mapping: torch.Tensor, cache: CacheLike
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]. Writes this step's cache rows first, then attends."""
        q_nope, q_pe, latent, k_pe = self._project(x, plan.cos, plan.sin)
        cache = as_cache(cache)
        cache.write(slot_mapping, torch.cat([latent, k_pe], dim=-1))
        # A prefill may attend to its fresh rows only when the cache stores them exactly:
        # otherwise a later prefix-cache hit (which reads the stored rows) would differ.
        if plan.fresh_lens is not None and cache.exact and cache.data.dtype == x.dtype:
            return self.o_proj(self._attend_fresh(q_nope, q_pe, latent, k_pe, plan.fresh_lens))
        return self.o_proj(self._attend_cached(q_nope, q_pe, cache, plan, x.dtype))

    def _attend_cached(self, q_nope, q_pe, cache, plan: AttentionPlan, dtype: torch.dtype
                       ) -> torch.Tensor:
        """The step's queries [T, nH, d] against their sequences' context in ``cache``
        -> [T, nH * dv] (sequence_parallel.py replaces this for a striped cache)."""
        b, mq, ms = plan.num_seqs, plan.max_query_len, plan.max_seq_len
        ctx = cache.gather(plan.block_tables, ms)                      # [B, S, D]
        # Slots past a sequence's end may hold anything (even NaN): zero them so masked
        # scores stay finite.
        ctx = ctx.to(dtype).masked_fill(~plan.key_valid, 0.0)
        if plan.absorbed:
            return self._attend_absorbed(q_nope, q_pe, ctx, plan)
        qn = _pad(q_nope, plan.pad_index, b * mq).unflatten(0, (b, mq))
        qp = _pad(q_pe, plan.pad_index, b * mq).unflatten(0, (b, mq))
        lat, kp = ctx.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        out = self._attend_decompressed(qn, qp, lat, kp, mask=plan.mask)   # [B, Lq, nH*dv]
        return _unpad(out.flatten(0, 1), plan.pad_index)

    def _attend_fresh(self, q_nope, q_pe, latent, k_pe, lens: list[int]) -> torch.Tensor:
        """Prefills from position 0 only: each sequence's keys are exactly its own new rows,
        so attend per sequence with ``is_causal`` (SDPA's fused CPU kernel) instead of
        gathering the cache into a padded, masked batch (quadratic in the longest prompt
        times the batch, on the slow masked path).  [T, nH, d] pieces -> [T, nH * dv]."""
        outs, start = [], 0
        for n in lens:
            sl = slice(start, start + n)
            outs.append(self._attend_decompressed(q_nope[None, sl], q_pe[None, sl], latent[None, sl],
                                                  k_pe[None, sl], is_causal=True)[0])
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _latent_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Fold W_UK into the query: [T, nH, dn], [T, nH, dr] -> [T, nH, kvr + dr]."""
        if self.w_uk_rows is not None:           # each (token, head) a row through its head
            return torch.cat([self.products.head_rows(q_nope, self.w_uk_rows), q_pe], dim=-1)
        nh, dn, kvr = self.num_heads, self.nope_dim, self.kv_lora_rank
        w_uk = self.kv_b_proj.weight.view(nh, dn + self.v_dim, kvr)[:, :dn]   # [nH, dn, kvr]
        return torch.cat([self.products.latent_query(q_nope, w_uk), q_pe], dim=-1)

    def _value_out(self, o: torch.Tensor) -> torch.Tensor:
        """Unfold W_UV: latent-space outputs [T, nH, kvr] -> [T, nH * dv]."""
        if self.w_uv_rows is not None:
            return self.products.head_rows(o, self.w_uv_rows).flatten(1)
        nh, dn, kvr = self.num_heads, self.nope_dim, self.kv_lora_rank
        w_uv = self.kv_b_proj.weight.view(nh, dn + self.v_dim, kvr)[:, dn:]   # [nH, dv, kvr]
        return self.products.latent_value(o, w_uv).flatten(1)

    def _attend_absorbed(self, q_nope, q_pe, ctx, plan: AttentionPlan) -> torch.Tensor:
        """Attend in latent space; all heads share one key/value row per token (MQA)."""
        nh, kvr = self.num_heads, self.kv_lora_rank
        b, mq = plan.num_seqs, plan.max_query_len
        q = _pad(self._latent_query(q_nope, q_pe), plan.pad_index, b * mq)   # [B*Lq, nH, D]
        # Heads become extra query rows: [B, Lq * nH, D] against keys [B, S, D].  Three
        # plain kernels: on CPU this is ~2x faster than SDPA's math path at these sizes.
        q = q.view(b, mq * nh, -1)
        o = self.products.latent_attention(q, ctx, plan.head_bias, self.scale, kvr)  # [B, Lq*nH, kvr]
        return self._value_out(_unpad(o.view(b * mq, nh, kvr), plan.pad_index))


def _pad(x: torch.Tensor, pad_index: torch.Tensor, rows: int) -> torch.Tensor:
    """Scatter flat tokens [T, ...] into zero-padded rows [rows, ...]."""
    if rows == x.shape[0]:  # every query_len equals max_query_len (e.g. pure decode): no padding
        return x
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    return out.index_copy_(0, pad_index, x)


def _unpad(x: torch.Tensor, pad_index: torch.Tensor) -> torch.Tensor:
    """Padded rows [B * Lq, ...] -> flat tokens [T, ...]."""
    return x if x.shape[0] == pad_index.shape[0] else x.index_select(0, pad_index)
