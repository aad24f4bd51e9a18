"""DeepSeek-V3 (and V2) causal LM with its Multi-Token Prediction layer(s).

Module tree mirrors the Hugging Face names (``model.embed_tokens``, ``model.layers.{i}``,
``model.norm``, ``lm_head``); MTP layer j lives at ``model.layers.{num_hidden_layers + j}``
with ``enorm``, ``hnorm``, ``eh_proj``, the usual block names and ``shared_head``.

One paged interface serves prefill, decode and k+1-token verification (see BatchMetadata);
``forward_full`` / ``mtp_forward_full`` are the cache-free, autograd-friendly paths.
"""
from __future__ import annotations

import torch
from torch import nn

from server.model.batch import BatchMetadata, DecodeMetadata
from server.model.config import DeepseekConfig
from server.model.kernels.products import UsesProducts
from server.model.layers.attention import (
    DEFAULT_ABSORB_MAX_QUERY_LEN,
    MLA,
    AttentionPlan,
    build_plan,
)
from server.model.layers.linear import Embedding, Linear
from server.model.layers.mlp import MLP
from server.model.layers.moe import MoE
from server.model.layers.norm import RMSNorm
from server.model.layers.rotary import RotaryEmbedding
from server.model.static_decode import StaticDecoder


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = MLA(cfg, rope)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, plan: AttentionPlan, slot_mapping: torch.Tensor,
                cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), plan, slot_mapping, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_full(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) -> one decoder block (pre-norm output)."""

    def __init__(self, cfg: DeepseekConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer_idx, rope)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def combine(self, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        # Embedding first, then hidden: the order every engine feeds the released eh_proj.
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekConfig, num_mtp_layers: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, rope) for i in range(n)]
            + [MTPLayer(cfg, n + j, rope) for j in range(num_mtp_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module, UsesProducts):
    """Paged-cache DeepSeek-V3; see docs/interfaces.md (server.model) for the contract."""

    parallel_plan = None      # this rank's ParallelPlan when the model is a shard (loader.py)

    def __init__(self, config: DeepseekConfig, num_mtp_layers: int | None = None) -> None:
        super().__init__()
        if num_mtp_layers is None:
            num_mtp_layers = config.num_nextn_predict_layers
        self.config = config
        self.num_mtp_layers = num_mtp_layers
        self.rope = RotaryEmbedding(config)
        self.model = DeepseekV3Model(config, num_mtp_layers, self.rope)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Longest query (tokens per sequence in a step) that still uses the absorbed MLA form.
        self.absorb_max_query_len = DEFAULT_ABSORB_MAX_QUERY_LEN
        # Attention heads this rank computes (fewer under tensor parallel: parallel.py).
        self.num_local_heads = config.num_attention_heads
        # Cache layers whose latent the checkpoint quantizes (FA3 / FAKQuant scales present);
        # the engine gives them an int8 latent cache.  Set by the loader.
        self.kv_cache_int8_layers: frozenset[int] = frozenset()
        # Steps given a DecodeMetadata (uniform windows) run here; the engine may compile it.
        self.static_decoder = StaticDecoder(self)
        # Builds a step's attention plan from its BatchMetadata: one plan for every token,
        # or with attention data parallel one for this rank's group (data_parallel.py).
        self.plan_attention = build_plan

    def stack_projections(self) -> None:
        """Products that read one input through several weights read them as one (q_a and
        kv_a; a dense MLP's or a shared expert's gate and up): layers/linear.stacked.  The
        worker does it when it starts serving; after it, forward hooks on those layers see
        no calls."""
        for m in self.modules():
            if m is not self and hasattr(m, "stack_projections"):
                m.stack_projections()

    # -- contract properties ---------------------------------------------------------------
    @property
    def kv_cache_dim(self) -> int:
        return self.config.kv_cache_dim

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers + self.num_mtp_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    def _mtp(self, layer: int) -> MTPLayer:
        if not 0 <= layer < self.num_mtp_layers:
            raise ValueError(f"MTP layer {layer} does not exist (model has {self.num_mtp_layers})")
        return self.model.layers[self.config.num_hidden_layers + layer]  # type: ignore[return-value]

    def _plan(self, meta: BatchMetadata) -> AttentionPlan:
        """The plan every layer's attention reads (a DataParallelPlan on a dp model)."""
        return self.plan_attention(meta, self.rope, self.num_local_heads, self.absorb_max_query_len)

    # -- paged path ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata | DecodeMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [T] -> final-norm hidden [T, H]; writes main-layer KV at meta.slot_mapping."""
        if isinstance(meta, DecodeMetadata):
            return self.static_decoder.forward(input_ids, meta, kv_caches)
        plan = self._plan(meta)
        x = self.model.embed_tokens(input_ids)
        for i in range(self.config.num_hidden_layers):
            x = self.model.layers[i](x, plan, meta.slot_mapping, kv_caches[i])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32."""
        return self.lm_head(hidden).float()

    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: BatchMetadata,
                    kv_caches: list[torch.Tensor], layer: int = 0) -> torch.Tensor:
        """input_ids[i] is the token at positions[i] + 1, prev_hidden[i] the main hidden at positions[i].

        Writes MTP KV at positions[i]; returns the block output before shared_head.norm [T, H].
        """
        mtp = self._mtp(layer)
        x = mtp.combine(self.model.embed_tokens(input_ids), prev_hidden)
        if isinstance(meta, DecodeMetadata):
            return self.static_decoder.mtp_forward(x, meta, kv_caches, layer)
        plan = self._plan(meta)
        return mtp(x, plan, meta.slot_mapping, kv_caches[self.config.num_hidden_layers + layer])

    def mtp_write_kv(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_caches: list[torch.Tensor], layer: int = 0) -> None:
        """The MTP KV that ``mtp_forward`` would write at positions[i] (cache slot
        slot_mapping[i]), without running the block: keeps the MTP layer's cache current
        on steps that draft nothing, and for a prompt's positions whose outputs nothing reads."""
        mtp = self._mtp(layer)
        x = mtp.combine(self.model.embed_tokens(input_ids), prev_hidden)
        cos, sin = self.rope.cos_sin(positions)
        mtp.self_attn.write_cache(mtp.input_layernorm(x), cos[:, None, :], sin[:, None, :],
                                  slot_mapping, kv_caches[self.config.num_hidden_layers + layer])

    def mtp_compute_logits(self, h_mtp: torch.Tensor, layer: int = 0,
                           head: nn.Module | None = None) -> torch.Tensor:
        """``head``: what the drafts multiply by instead of the layer's own head (an int8
        copy of it: engine/spec/draft_head.py)."""
        mtp = self._mtp(layer)
        return (head or mtp.shared_head.head)(mtp.shared_head.norm(h_mtp)).float()

    # -- full-sequence path (no cache) -----------------------------------------------------
    def _cos_sin_full(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope.cos_sin(torch.arange(length, device=device))
        return cos[:, None, :], sin[:, None, :]

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] -> final-norm hidden [B, L, H], causal, positions 0..L-1."""
        cos, sin = self._cos_sin_full(input_ids.shape[1], input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for i in range(self.config.num_hidden_layers):
            x = self.model.layers[i].forward_full(x, cos, sin)
        return self.model.norm(x)

    def mtp_forward_full(self, next_ids: torch.Tensor, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """next_ids[b, i] = token i + 1, hidden = forward_full output -> pre-norm MTP hidden [B, L, H]."""
        mtp = self._mtp(layer)
        cos, sin = self._cos_sin_full(next_ids.shape[1], next_ids.device)
        x = mtp.combine(self.model.embed_tokens(next_ids), hidden)
        return mtp.forward_full(x, cos, sin)
