"""The static decode/verify step: every sequence feeds the same number of tokens.

Under load most steps have no prefill: each sequence feeds its last token plus the K
drafts it holds (K the same for all), or one token through the MTP layer's chained draft
passes.  Such a step needs none of the varlen machinery (``AttentionPlan``'s host lists,
padding indices, per-sequence loops): its shapes are ``[num_seqs * Q]`` tokens against
``[num_seqs, num_blocks * block_size]`` cache rows, and every mask is a comparison of
positions made inside the step.  The forward reads no tensor value on the host, so it can
be compiled (Inductor on CPU, see ``compiled.py``) or, on a GPU, captured as a graph.

Maths: the absorbed MLA form of attention.py (queries folded into latent space, all
heads reading one shared cache row per key), and one of three MoE forms:
  * gathered (``gathered_moe``): each token reads only its top-k experts' weights, by
    index, inside the compiled graph (a GEMV per chosen expert, as gpt-fast runs Mixtral):
    for few tokens the step reads the active weights once and syncs nothing.  Taken when
    tokens x top-k <= the experts (``GATHER_MAX_PER_EXPERT``), or up to
    ``GROUPED_GATHER_MAX_TOKENS`` tokens where the kernels read each chosen expert once
    for all its tokens (AVX-512 BF16's bf16_moe, VNNI's i8_rows), and a graph exists for it (uncompiled,
    indexing would copy the weights).  Int8 experts of the dynamic scheme
    too (quant.gathered_int8_experts: each chosen expert's int8 rows
    read once: 0.32 ms for 4 experts of [1536 x 512], 2 threads);
  * dense (``dense_moe``: every expert on every token, unchosen experts weighted 0) when
    ``dense_moe`` is set (few experts);
  * otherwise the routed MoE runs as usual between the compiled attention halves.
Measured (2-core Xeon, bf16, 16 experts of [768 x 1536], top-4, compiled): 1 token 0.67 ms
gathered against 5.2 ms dense; 2 tokens 1.5 against 5.5; 4 tokens 3.5 against 5.4;
8 tokens 12.4 against 5.8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.model.batch import DecodeMetadata
from server.model.flat_calls import FlatCalls
from server.model.layer_chain import LayerChains, cache_tensors
from server.model.layers.latent_cache import (
    Int8LatentCache,
    LatentCache,
    int8_gather,
    int8_write,
)
from server.model.layers.linear import Linear
from server.model.layers.moe import MoE
from server.model.quant.experts import GROUPED_ROWS


def attend(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           slots: torch.Tensor, block_tables: torch.Tensor, cache) -> torch.Tensor:
    """x [T, H] (T = B * Q, sequence-major) -> attention output [T, H]; writes the step's
    cache rows at ``slots`` first.  ``cache``: a float [num_blocks, block_size, D] tensor, or
    an int8 cache's (latent, scale, rope) tensors (Int8LatentCache.block_tensors), written and
    read as that cache writes and reads them."""
    q_nope, q_pe, latent, k_pe = attn._project(x, cos, sin)
    rows = torch.cat([latent, k_pe], dim=-1)
    dim = rows.shape[-1]
    b = block_tables.shape[0]
    pos = positions.view(b, -1)                                     # [B, Q]
    q_len = pos.shape[1]
    nh, kvr = attn.num_heads, attn.kv_lora_rank
    if isinstance(cache, tuple):
        int8_write(cache, slots, rows)
    else:
        cache.view(-1, dim).index_copy_(0, slots, rows.to(cache.dtype))
    q = attn._latent_query(q_nope, q_pe).reshape(b, q_len * nh, dim)  # row q * nH + h
    # Where the products read the cache in place (AVX-512 BF16), no gathered context.
    o = attn.products.paged_latent_attention(q, cache, block_tables, pos, attn.scale, kvr)
    if o is None:
        o = attn.products.latent_attention(q, *_gathered_context(cache, block_tables, pos, nh, x.dtype),
                                           attn.scale, kvr)
    o = o.reshape(b * q_len, nh, kvr)
    return attn.o_proj(attn._value_out(o))


def _gathered_context(cache, block_tables: torch.Tensor, pos: torch.Tensor, heads: int,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend``'s context where the products cannot read the cache in place: (every
    sequence's cache rows gathered through its block table [B, S, D], each query row's
    causal mask as an additive bias [B, Q * heads, S])."""
    if isinstance(cache, tuple):
        ctx = int8_gather(cache, block_tables).to(dtype)               # [B, S, D]
    else:
        ctx = cache[block_tables].flatten(1, 2).to(dtype)              # [B, S, D]
    keys = torch.arange(ctx.shape[1], device=ctx.device)
    # Rows past a sequence's last position may hold anything (even NaN): zero them so the
    # masked scores stay finite.  The last query row of a sequence has its largest position.
    ctx = torch.where((keys[None, :] <= pos[:, -1:])[..., None], ctx, 0.0)
    visible = keys[None, None, :] <= pos[:, :, None]                # [B, Q, S]
    bias = torch.zeros(visible.shape, dtype=dtype, device=ctx.device).masked_fill(~visible, float("-inf"))
    return ctx, bias.repeat_interleave(heads, dim=1)                # [B, Q * heads, S]


def dense_moe(moe, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              num_routed: int) -> torch.Tensor:
    """Every expert (shared ones included) on every token: layers.MoE._dense without the
    host-side weight stacking (the caller passes the stacked weights)."""
    weights, idx = moe.gate(x)
    t = x.shape[0]
    scale = moe.local_scale(weights, idx)                           # [T, local experts]
    g, u = moe.products.linear(x, w_gate_up).chunk(2, dim=-1)
    act = F.silu(g) * u
    routed = act[:, :num_routed].reshape(t, scale.shape[1], -1) * scale[:, :, None].to(act.dtype)
    return moe.combine(moe.products.linear(torch.cat([routed.flatten(1), act[:, num_routed:]], dim=1), w_down))


# Most multiply-adds a token may spend on unchosen experts, over all layers, for the
# static step to compute a model's MoE densely (the demo model: 0.8 M).
DENSE_MOE_WASTE = 50e6

# Gathered while tokens x top-k <= this many per expert (the measured crossover is ~1.5).
GATHER_MAX_PER_EXPERT = 1
# Gathered up to this many tokens where the products group a window's experts (one read of
# each chosen expert for all its tokens: Products.groups_experts): then the gathered form
# costs the routed one's bytes without its host sync and small ops (the 0.5b model's
# batch-8 step spent 15-20% of its time in them).
GROUPED_GATHER_MAX_TOKENS = 64


def _groups_experts(moe) -> bool:
    """Whether the MoE's gathered experts run grouped by expert (each chosen expert read
    once for all its tokens): float ones where the products say so, int8 ones on a
    backend whose rows kernel groups them."""
    gate = moe.experts[0].gate_proj
    if isinstance(gate, Linear):
        return moe.products.groups_experts(gate.weight.dtype)
    return getattr(gate, "backend", None) in GROUPED_ROWS


def gathered_moe(moe, x: torch.Tensor, *stacks: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts only, their weights read by index.

    x [T, H]; ``stacks``: layers.MoE.expert_stacks(), as the MoE's expert form lays them
    out and computes them (layers/experts.py: float or int8), accumulated in float32."""
    weights, idx = moe.gate(x)                                      # [T, k]
    out = moe.expert_form.gathered(moe, x, weights, idx, *stacks)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def gathered_moe_layer(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots, block_tables,
                       cache, *stacks):
    """A decoder layer whose routed MoE reads only the chosen experts (module docstring)."""
    x, h = attention_half(attn, norm_in, norm_post, x, cos, sin, positions, slots, block_tables, cache)
    return x + gathered_moe(mlp, h, *stacks)


def attention_half(attn, norm_in, norm_post, x, cos, sin, positions, slots, block_tables, cache):
    """Residual + attention, then the MLP's input norm: (new residual, normed).  Takes the
    layer's parts, not the layer, so main and MTP layers share one compiled graph."""
    x = x + attend(attn, norm_in(x), cos, sin, positions, slots, block_tables, cache)
    return x, norm_post(x)


def dense_layer(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots, block_tables, cache):
    """A decoder layer whose MLP is a plain (dense) SwiGLU."""
    x, h = attention_half(attn, norm_in, norm_post, x, cos, sin, positions, slots, block_tables, cache)
    return x + mlp(h)


def moe_layer(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots, block_tables, cache,
              w_gate_up, w_down, num_routed: int):
    """A decoder layer whose routed MoE runs densely (see module docstring)."""
    x, h = attention_half(attn, norm_in, norm_post, x, cos, sin, positions, slots, block_tables, cache)
    return x + dense_moe(mlp, h, w_gate_up, w_down, num_routed)


def _flat(x, cos, sin, positions, slots) -> tuple:
    return x.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1), positions.flatten(), slots.flatten()


# The same layers on a [sequences, window, ...] layout of the window's tensors: in a graph
# whose number of sequences is symbolic, the window length stays a static size (with flat
# [sequences * window] tensors it would be a second symbol).
def attention_half_windowed(attn, norm_in, norm_post, x, cos, sin, positions, slots, block_tables, cache):
    return attention_half(attn, norm_in, norm_post, *_flat(x, cos, sin, positions, slots),
                          block_tables, cache)


def dense_layer_windowed(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots, block_tables, cache):
    return dense_layer(attn, norm_in, norm_post, mlp, *_flat(x, cos, sin, positions, slots),
                       block_tables, cache)


def gathered_moe_layer_windowed(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots,
                                block_tables, cache, *stacks):
    return gathered_moe_layer(attn, norm_in, norm_post, mlp, *_flat(x, cos, sin, positions, slots),
                              block_tables, cache, *stacks)


def moe_layer_windowed(attn, norm_in, norm_post, mlp, x, cos, sin, positions, slots, block_tables, cache,
                       w_gate_up, w_down, num_routed: int):
    return moe_layer(attn, norm_in, norm_post, mlp, *_flat(x, cos, sin, positions, slots),
                     block_tables, cache, w_gate_up, w_down, num_routed)


class StaticDecoder:
    """Runs a model's decode/verify windows and draft passes through the functions above,
    plain or through compiled graphs (``use_graphs``; worker/compile_step.py makes them), one
    graph per layer kind and window kind, shared by every layer of that kind (the layer's
    weights are graph inputs, not constants)."""

    def __init__(self, model) -> None:
        self.model = model
        cfg = model.config
        self._layers = list(model.model.layers)
        # Dense MoE costs (E + 1) / (top_k + 1) times the routed FLOPs: worth it when the
        # experts are few (the demo model: 5/3), never for DeepSeek-V3's 256; and only
        # while what it wastes is small beside the per-op costs it saves (the 0.5b model's
        # 16 experts, top-4: 0.28 G multiply-adds a token; its batch-16 step took 475 ms
        # dense, 287 routed).
        self.dense_moe = bool(cfg.n_routed_experts) and \
            cfg.n_routed_experts + 1 <= 4 * (cfg.num_experts_per_tok + 1) and \
            sum(_unchosen_macs(layer, cfg) for layer in self._layers) <= DENSE_MOE_WASTE
        # Decided once: run_layer asks for every layer of every step.
        self._classify()
        # (kind, window, lone sequence) -> compiled graph; windows "q<N>" (N tokens per
        # sequence, static sizes) and a lone sequence's "many" (any length; compile_step.graph_plan)
        self._graphs: dict[tuple[str, str, bool], object] = {}
        # The KV cache the engine gives the step ("float" or "int8", ``kv_form``), set by
        # the worker before it asks for graphs: the graphs are made for it, and a call on
        # the other form (another engine on this model) takes the plain functions.
        self.kv_form = "float"
        self._graphs_form = "float"
        # The last window and its per-token tensors (rotary tables, positions, slots), flat
        # and, once asked for, in the windowed layout: made once per window, not per layer;
        # the MTP pass of a static step reuses the main forward's window.
        self._last: tuple[DecodeMetadata, dict[bool, tuple]] | None = None
        # Each graph's calls, per layer, below Dynamo's bytecode once learned (flat_calls.py).
        self.flat_calls = FlatCalls()
        # The main forward's layer graphs called back to back from C++, per kind of window,
        # once every layer's call is learned (layer_chain.py).
        self.chains = LayerChains()

    @property
    def compiled(self) -> bool:
        """Graphs in use for the cache form the engine gives (``kv_form``)."""
        return bool(self._graphs) and self._graphs_form == self.kv_form

    @property
    def static_query_len(self) -> int:
        """The longest window with static graphs for a lone sequence and a batch (0: none)."""
        def longest(lone: bool) -> int:
            return max((int(w[1:]) for _k, w, one in self._graphs if one == lone and w.startswith("q")),
                       default=0) if self.compiled else 0
        return min(longest(True), longest(False))

    def use_graphs(self, graphs: dict[tuple[str, str, bool], object]) -> None:
        """Switch to compiled graphs (between steps), made for the cache form ``kv_form``."""
        self._graphs = dict(graphs)
        self._graphs_form = self.kv_form
        self.flat_calls.clear()
        self.chains.clear()

    def kind(self, index: int) -> str:
        """"dense" (plain MLP), "moe" (dense-computed MoE) or "half" (attention compiled,
        routed MoE eager); a window of few tokens may take "gmoe" instead (``_kind_for``)."""
        return self._kinds[index]

    def layer_kinds(self) -> dict[str, int]:
        """One layer index per kind this model has (the gathered MoE included)."""
        kinds: dict[str, int] = {}
        for i in range(len(self._layers)):
            kinds.setdefault(self.kind(i), i)
        for i in sorted(self._gather):
            kinds.setdefault("gmoe" + self._gsuffix[i], i)
        return kinds

    @property
    def takes_prompts(self) -> bool:
        """Whether a lone prompt may run through this decoder's prompt window ("many"):
        never for a 16-bit model on a CPU without 16-bit instructions, whose prompt graph
        would convert every weight it reads to float32 on every call (the 0.5b model's
        4 / 64 / 203-token prompts, its experts then dense: 736 / 1025 / 1839 ms, on the
        varlen path 127 / 731 / 754)."""
        return self.model.products.takes_prompts

    @property
    def dense_moe_waste(self) -> float:
        """Multiply-adds a window spends per token on unchosen experts in its
        dense-computed MoE layers (0 when it has none)."""
        return self._dense_waste

    @property
    def gather_max_tokens(self) -> int:
        """The most tokens a window may have for the gathered MoE."""
        return self._gather_max_tokens

    def _classify(self) -> None:
        """Each layer's kind and the MoE layers that can take the gathered form: from the
        layers as they are (the loader swaps in int8 layers after the model is built, so
        ``prepare`` asks again)."""
        # Int8 experts (QuantLinear) are never computed densely: their scales are per
        # expert and output channel, which one stacked down-projection cannot carry.
        base = ["dense" if not hasattr(layer.mlp, "gate")
                else "moe" if self.dense_moe and _float_experts(layer.mlp) else "half"
                for layer in self._layers]
        # Layers of one kind share a graph only when their modules are alike: a quantized
        # checkpoint may quantize the MTP layer's attention differently (other parameters),
        # so each other make of layer gets a kind of its own ("half.1", ...).
        makes: dict[tuple, str] = {}
        self._suffix, self._gsuffix = [], {}
        for kind, layer in zip(base, self._layers):
            key = (kind, _make(layer))
            if key not in makes:
                n = sum(1 for k, _ in makes if k == kind)
                makes[key] = f".{n}" if n else ""
            self._suffix.append(makes[key])
        self._kinds = [k + sfx for k, sfx in zip(base, self._suffix)]
        # MoE layers whose experts can be read by index (layers.MoE.can_gather), and the
        # most tokens a window may have for the gathered form.
        self._gather = {i for i, layer in enumerate(self._layers)
                        if hasattr(layer.mlp, "gate") and layer.mlp.can_gather}
        # Gathered layers share a graph when alike (float and int8 experts never do).
        gmakes: dict[tuple, str] = {}
        for i in sorted(self._gather):
            self._gsuffix[i] = gmakes.setdefault(_make(self._layers[i]), f".{len(gmakes)}" if gmakes else "")
        cfg = self.model.config
        # Per token of a window, the multiply-adds the dense-computed MoE layers spend on
        # experts the token did not choose (all their experts run on every token).
        self._dense_waste = sum(_unchosen_macs(layer, cfg)
                                for kind, layer in zip(self._kinds, self._layers) if kind.startswith("moe"))
        self._gather_max_tokens = 0
        if cfg.n_routed_experts:
            self._gather_max_tokens = GATHER_MAX_PER_EXPERT * cfg.n_routed_experts \
                // cfg.num_experts_per_tok
            if self._gather and all(_groups_experts(self._layers[i].mlp) for i in self._gather):
                self._gather_max_tokens = max(self._gather_max_tokens, GROUPED_GATHER_MAX_TOKENS)

    def prepare(self) -> None:
        """Build what the step reads besides the weights (the experts' stacks), at start:
        not on a request's path."""
        self._classify()
        for i in self._gather:
            self._layers[i].mlp.expert_stacks()
        for i, kind in enumerate(self._kinds):
            if kind.startswith("moe"):
                self._layers[i].mlp._stacked()

    def _kind_for(self, index: int, meta: DecodeMetadata, graphs: bool = True) -> str:
        kind = self._kinds[index]
        if graphs and index in self._gather and meta.num_seqs * meta.query_len <= self._gather_max_tokens:
            gathered = "gmoe" + self._gsuffix[index]
            if (gathered, f"q{meta.query_len}", meta.num_seqs == 1) in self._graphs:
                return gathered
        return kind

    @staticmethod
    def function(kind: str, windowed: bool = False):
        kind = kind.partition(".")[0]
        if windowed:
            return {"dense": dense_layer_windowed, "moe": moe_layer_windowed,
                    "half": attention_half_windowed, "gmoe": gathered_moe_layer_windowed}[kind]
        return {"dense": dense_layer, "moe": moe_layer, "half": attention_half,
                "gmoe": gathered_moe_layer}[kind]

    def layer_args(self, index: int, x: torch.Tensor, cos, sin, meta: DecodeMetadata,
                   cache: torch.Tensor, windowed: bool = False, kind: str | None = None) -> tuple:
        """Arguments of ``function(kind or kind(index), windowed)``."""
        window = (cos, sin, meta.positions, meta.slot_mapping)
        if windowed:
            window = _windowed(window, meta.num_seqs)
        return self._args(index, kind or self._kinds[index], x, window, meta, cache, windowed)

    def _args(self, index: int, kind: str, x: torch.Tensor, window: tuple, meta: DecodeMetadata,
              cache: torch.Tensor, windowed: bool) -> tuple:
        """``layer_args`` given the window's (cos, sin, positions, slots), already in the
        layout the function takes."""
        layer = self._layers[index]
        args = (layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm)
        kind = kind.partition(".")[0]
        if kind != "half":
            args += (layer.mlp,)
        if windowed:
            x = x.view(meta.num_seqs, -1, x.shape[-1])
        args += (x,) + window + (meta.block_tables, cache)
        if kind == "moe":
            w_gate_up, w_down, sizes = layer.mlp._stacked()
            args += (w_gate_up, w_down, sizes[0])
        elif kind == "gmoe":
            args += layer.mlp.expert_stacks()
        return args

    def run_layer(self, index: int, x: torch.Tensor, meta: DecodeMetadata,
                  cache: torch.Tensor, record: list | None = None) -> torch.Tensor:
        """One layer; ``record``: where the forward collects its layers' calls to make a
        layer chain of them (``LayerChains.make``)."""
        graphs = ("int8" if isinstance(cache, tuple) else "float") == self._graphs_form
        kind = self._kind_for(index, meta, graphs)
        fn, windowed, graph = self._graph(kind, meta) if graphs else (self.function(kind), False, False)
        args = self._args(index, kind, x, self._window(meta, windowed), meta, cache, windowed)
        out = self.flat_calls.call(fn, index, args) if graph else fn(*args)
        if record is not None:
            record.append((self.flat_calls.learned_call(fn, index) if graph else None, args,
                           _hidden_at(kind), windowed))
        if kind.startswith("half"):            # routed dispatch, eager (reads counts on the host)
            x, h = out
            return x + self._layers[index].mlp(h)
        return out

    def _graph(self, kind: str, meta: DecodeMetadata):
        """(function, takes the windowed layout?, a compiled graph?) for this window: the
        graph with static sizes made for its exact length where compiled (a 2-token window
        of a lone sequence ran in 0.8x the time of the symbolic-length graph, 0.9x for 16
        sequences), else a lone sequence's symbolic one for two tokens or more, else the
        plain function."""
        g, q, lone = self._graphs, meta.query_len, meta.num_seqs == 1
        fn = g.get((kind, f"q{q}", lone))
        if fn is not None:
            return fn, not lone, True
        fn = lone and q > 1 and g.get((kind, "many", True))
        return (fn, False, True) if fn else (self.function(kind), False, False)

    def forward(self, input_ids: torch.Tensor, meta: DecodeMetadata, caches: list) -> torch.Tensor:
        m = self.model
        x = m.model.embed_tokens(input_ids)
        n = m.config.num_hidden_layers
        key = self._chain_key(meta, caches)
        found = self.chains.find(key, MoE.stack_builds()) if key is not None else None
        if found is not None:
            return m.model.norm(self.run_chain(found, x, meta, caches))
        record = [] if key is not None and self.chains.wanted(key) else None
        for i in range(n):
            x = self.run_layer(i, x, meta, _data(caches[i]), record)
        if record is not None:
            self.chains.make(key, record, MoE.stack_builds())
        return m.model.norm(x)

    def run_chain(self, found: tuple[int, bool], x: torch.Tensor, meta: DecodeMetadata,
                  caches: list) -> torch.Tensor:
        """Every layer of the main forward through the chain ``found`` (``LayerChains.find``)."""
        chain, windowed = found
        window = (*self._window(meta, windowed), meta.block_tables)
        flat = [t for i in range(self.model.config.num_hidden_layers) for t in cache_tensors(_data(caches[i]))]
        return torch.ops.mtp_native.chain_run(chain, x, window, flat)

    def _chain_key(self, meta: DecodeMetadata, caches: list) -> tuple | None:
        """What decides each layer's graph in a main forward over this window (``_kind_for``,
        ``_graph``): the kind of layer chain it takes.  None where it runs no graphs."""
        if not self._graphs or not caches or kv_form(caches) != self._graphs_form:
            return None
        return meta.query_len, meta.num_seqs == 1, meta.num_seqs * meta.query_len <= self._gather_max_tokens

    def mtp_forward(self, x: torch.Tensor, meta: DecodeMetadata, caches: list, layer: int) -> torch.Tensor:
        """x: the MTP layer's combined input [T, H] -> its block output [T, H]."""
        i = self.model.config.num_hidden_layers + layer
        return self.run_layer(i, x, meta, _data(caches[i]))

    def _window(self, meta: DecodeMetadata, windowed: bool) -> tuple:
        """(cos, sin, positions, slots) of the window in the asked layout, kept for the
        next calls on the same window."""
        if self._last is None or self._last[0] is not meta:
            flat = (*_rope(self.model.rope, meta.positions), meta.positions, meta.slot_mapping)
            self._last = (meta, {False: flat})
        layouts = self._last[1]
        if windowed not in layouts:
            layouts[windowed] = _windowed(layouts[False], meta.num_seqs)
        return layouts[windowed]


def _hidden_at(kind: str) -> int:
    """Where ``StaticDecoder._args`` puts the hidden state among a layer's arguments: after
    its modules (attention, two norms, and the MLP but for "half")."""
    return 3 if kind.partition(".")[0] == "half" else 4


def _make(layer) -> tuple:
    """What a compiled graph of the layer depends on besides sizes: the classes and int8
    schemes of the linear layers of the parts it is given (attention, norms, MLP; an MTP
    layer's other parts are not in the graph), in order."""
    parts = (layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp)
    return tuple((type(m).__name__, getattr(m, "scheme", None)) for part in parts
                 for m in part.modules() if isinstance(m, torch.nn.Linear) or hasattr(m, "scheme"))


def _unchosen_macs(layer, cfg) -> float:
    """Multiply-adds a token spends on the experts it did not choose when ``layer``'s MoE
    runs every (local) expert on it; 0 for a dense layer."""
    if not hasattr(layer.mlp, "gate"):
        return 0.0
    return (3 * cfg.hidden_size * cfg.moe_intermediate_size * len(layer.mlp.experts)
            * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts))


def _float_experts(moe) -> bool:
    return all(isinstance(m.gate_proj, torch.nn.Linear) for m in moe.experts)


def _windowed(window: tuple, num_seqs: int) -> tuple:
    """Per-token tensors [sequences * window, ...] -> [sequences, window, ...] views."""
    return tuple(t.view(num_seqs, -1, *t.shape[1:]) for t in window)


def _rope(rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope.cos_sin(positions)
    return cos[:, None, :], sin[:, None, :]


def _data(cache) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """What ``attend`` takes: a float cache's tensor, an int8 cache's three."""
    if isinstance(cache, torch.Tensor):
        return cache
    return cache.block_tensors() if isinstance(cache, Int8LatentCache) else cache.data


def kv_form(caches: list) -> str:
    """"int8" where the caches are int8 ones, else "float": the cache a graph was made for
    (compile_step.cache_dir keys its folder on it)."""
    return "int8" if caches and isinstance(caches[0], Int8LatentCache) else "float"


def supports_static_decode(model, caches: list) -> bool:
    """Float and int8 caches, all of one form: what ``attend`` reads.  Striped
    (sequence-parallel) caches keep the varlen path: ``attend`` would read them as whole
    ones (StripedLatentCache is neither).  Float and int8 (QuantLinear) layers both run
    here: int8 layers as modules inside the graphs (their GEMMs are torch._int_mm or exact
    float ones), int8 experts gathered or routed."""
    return (all(isinstance(c, (torch.Tensor, LatentCache)) for c in caches)
            or all(isinstance(c, Int8LatentCache) for c in caches))
