"""The routed mixture of experts: the router (MoEGate) and the experts it picks (MoE).

Parameter names mirror the Hugging Face checkpoint (``experts.N.up_proj``,
``gate.e_score_correction_bias``...) so loading is a name-for-name copy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.model import quant
from server.model.config import DeepseekConfig
from server.model.kernels.products import UsesProducts
from server.model.layers.experts import FloatExperts, Int8Experts
from server.model.layers.linear import Linear, column_major, weight_key
from server.model.layers.mlp import MLP

# Run every expert densely when the step's dense work (tokens x all experts' MACs) is at
# most this: below it per-op dispatch, not arithmetic, dominates on CPU (demo model: up to
# ~85 tokens; DeepSeek-V3's 256 large experts: never).
DENSE_MOE_MAX_MACS = 1 << 24

# Expert stacks built so far, by every MoE (MoE.stack_builds).
_STACK_BUILDS = 0


class MoEGate(nn.Module, UsesProducts):
    """Router: scores every routed expert, keeps ``num_experts_per_tok`` per token.

    Variants (``topk_method``): ``greedy`` plain top-k; ``group_limited_greedy`` keeps the
    ``topk_group`` groups with the best single expert (V2); ``noaux_tc`` adds
    ``e_score_correction_bias`` for the choice only and ranks groups by the sum of their
    best two (V3). Weights always come from the unbiased scores. Routing runs in float32.
    """

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        n = cfg.n_routed_experts
        assert n is not None
        self.num_experts = n
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.topk_method = cfg.topk_method
        self.scoring_func = cfg.scoring_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.scale_after_norm = cfg.scale_after_norm
        self.weight = nn.Parameter(torch.empty(n, cfg.hidden_size, dtype=torch.float32))
        if not self.weight.is_meta:                # usable when built without a checkpoint
            nn.init.normal_(self.weight, std=cfg.hidden_size ** -0.5)
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = self.products.router_logits(x, self.weight)
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.topk_method != "greedy" and self.topk_group < self.n_group:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        normalised = self.norm_topk_prob and self.top_k > 1
        if normalised:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale_after_norm or not normalised:
            weights = weights * self.routed_scaling_factor
        return weights, idx


class MoE(nn.Module, UsesProducts):
    """Routed experts plus shared experts; only the chosen experts run.

    Assignments (token, slot) are sorted by expert so each active expert runs once on a
    contiguous slice of its tokens. The per-expert counts come to the host once per layer
    (``tolist``): that is the only way to size the slices in plain PyTorch, and on CPU it is
    not a device sync.
    """

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.num_experts = cfg.n_routed_experts
        self.gate = MoEGate(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        for expert in self.experts:
            expert.routed_expert = True
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # Expert parallel (parallel.py): this rank holds experts [expert_offset,
        # expert_offset + len(experts)); ``combine`` sums the ranks' partial outputs.
        self.expert_offset = 0
        self.combine: nn.Module = nn.Identity()
        # True when the shared experts' output is already whole on every rank (an int8
        # down projection that sums its integer products over the group): added after
        # ``combine``, or it would be counted once per rank.
        self.shared_after_combine = False
        self._stack_key: tuple | None = None
        self._stack_params: list[nn.Parameter] | None = None
        self._stack: tuple | None = None
        self._gather: tuple[torch.Tensor, ...] | None = None    # expert_stacks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                       # [T, H]
        weights, idx = self.gate(x)                         # [T, k]
        # Serving only (inference mode): the stacked weights are a detached copy, so
        # training and autograd paths keep the per-expert dispatch below.
        # Int8 experts (QuantLinear) keep the per-expert dispatch: their scales are per
        # expert and output channel, which one stacked down-projection cannot carry.
        if torch.is_inference_mode_enabled() and isinstance(self.experts[0].gate_proj, Linear) \
                and x.shape[0] * self._macs_per_token_dense <= DENSE_MOE_MAX_MACS:
            return self._dense(x, weights, idx).reshape(shape)
        k = idx.shape[1]
        flat = idx.reshape(-1)                              # [T * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # Sorted by expert, this rank's experts' assignments are one contiguous run.
        first, num_local = self.expert_offset, len(self.experts)
        lo = sum(counts[:first])
        mine = order[lo:lo + sum(counts[first:first + num_local])]
        token_of = mine // k                                # token of each sorted assignment
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if mine.numel():
            xs = x.index_select(0, token_of)
            local = counts[first:first + num_local]
            form, stacks = self.expert_form, self._current_stacks() or ()
            ys = form.routed(self, xs, local, stacks)
            if ys is None:
                outs = []
                start = 0
                run = form.runner(self, stacks)
                for j, n in enumerate(local):
                    if n:
                        outs.append(run(j, xs[start:start + n]))
                        start += n
                ys = torch.cat(outs)
            w = weights.reshape(-1)[mine, None]                  # float32 weighting
            # Widened, then weighted in place where no gradient is wanted: the same numbers
            # (bf16 -> float32 is exact), where a bf16 x float32 product broadcast by row ran
            # a slow mixed-type loop: a 256-token prompt's [1024, 1536] took 0.8-2.8 ms a
            # layer, widened and weighted in place 0.2.
            ys = ys.float().mul_(w) if not torch.is_grad_enabled() else ys * w
            out.index_add_(0, token_of, ys)
        out = out.to(x.dtype)
        if self.shared_experts is not None and self.shared_after_combine:
            return (self.combine(out) + self.shared_experts(x)).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.combine(out).reshape(shape)

    @property
    def expert_form(self) -> type[FloatExperts] | type[Int8Experts]:
        """How these experts compute (layers/experts.py): float, or int8 of the dynamic scheme."""
        return FloatExperts if isinstance(self.experts[0].gate_proj, Linear) else Int8Experts

    @property
    def _macs_per_token_dense(self) -> int:
        e = self.experts[0]
        return 3 * e.gate_proj.in_features * e.gate_proj.out_features * (len(self.experts) + 1)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert (shared ones included) on every token in two matmuls; unchosen
        experts get weight 0.  For a handful of tokens on small experts this replaces
        ~6 ops per active expert (argsort, bincount + host read, gathers, per-expert MLPs,
        index_add) by ~6 ops in all: per-op overhead, not flops, is the cost there.

        x [T, H]; weights/idx [T, k] -> [T, H].
        """
        w_gate_up, w_down, sizes = self._stacked()
        T = x.shape[0]
        scale = self.local_scale(weights, idx)               # [T, local experts]
        gu = self.products.linear(x, w_gate_up)                          # [T, 2 * (E*I + Is)]
        g, u = gu.chunk(2, dim=-1)
        act = F.silu(g) * u                                  # [T, E*I + Is]
        routed = act[:, :sizes[0]].view(T, len(self.experts), -1)
        routed.mul_(scale[:, :, None].to(act.dtype))         # weight before the (linear) down proj
        return self.combine(self.products.linear(act, w_down))           # [T, H]

    @property
    def can_gather(self) -> bool:
        """Experts on one device, all plain float or all int8 of the dynamic scheme: what
        the gathered form of the static step (static_decode.gathered_moe) reads by index."""
        if self.expert_offset != 0 or not isinstance(self.combine, nn.Identity):
            return False
        parts = [p for m in self.experts for p in (m.gate_proj, m.up_proj, m.down_proj)]
        return all(type(p) is Linear for p in parts) or all(quant.gatherable(p) for p in parts)

    def expert_stacks(self) -> tuple[torch.Tensor, ...]:
        """The routed experts' weights stacked for the gathered MoE: float experts
        (gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]); int8 experts
        (gate_up, its weight_scale [E, 2I], down, its weight_scale [E, H]).  Built once,
        and each expert's own tensors become views into them, so nothing is held twice;
        built again if an expert's weight was replaced since."""
        if (current := self._current_stacks()) is not None:
            return current
        names = self.expert_form.names
        # Plain tensors even when first asked inside inference mode: the dense stack keys
        # its cache on the weights' version counters, which inference tensors lack.
        with torch.inference_mode(False), torch.no_grad():
            gate_up = {n: torch.stack([torch.cat([getattr(m.gate_proj, n), getattr(m.up_proj, n)])
                                       for m in self.experts]) for n in names}
            down = {n: torch.stack([getattr(m.down_proj, n) for m in self.experts]) for n in names}
        for e, m in enumerate(self.experts):
            i = m.gate_proj.out_features
            for n in names:
                for lin, view in ((m.gate_proj, gate_up[n][e, :i]), (m.up_proj, gate_up[n][e, i:]),
                                  (m.down_proj, down[n][e])):
                    setattr(lin, n, nn.Parameter(view, requires_grad=getattr(lin, n).requires_grad))
            # An expert's own gate-and-up stack (MLP.stack_projections) is the same rows:
            # a view too, or every expert's gate and up would be held twice (the 0.5b
            # model's routed experts: 528 MiB of 1.6 GiB).
            if getattr(m, "gate_up", None) is not None and names == ("weight",):
                m.gate_up = gate_up["weight"][e]
        self._stack_params = self._stack_key = self._stack = None   # the dense stack re-reads
        self._gather = tuple(gate_up[n] for n in names) + tuple(down[n] for n in names)
        global _STACK_BUILDS
        _STACK_BUILDS += 1
        return self._gather

    @staticmethod
    def stack_builds() -> int:
        """How many times any MoE built its expert stacks: what holds on to stacks across
        steps without asking ``expert_stacks`` (model/layer_chain.py) drops them when it
        moves."""
        return _STACK_BUILDS

    def _current_stacks(self) -> tuple[torch.Tensor, ...] | None:
        """The stacks ``expert_stacks`` built, while the experts' weights are still views
        of them (None before, or once an expert's weight was replaced)."""
        g = self._gather
        return g if g is not None and self.experts[0].gate_proj.weight.data_ptr() == g[0].data_ptr() else None

    def local_scale(self, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Routing weights [T, k] at expert ids [T, k] -> dense [T, local experts] float32
        (0 where a token did not choose the expert)."""
        full = weights.new_zeros(weights.shape[0], self.num_experts).scatter_(1, idx, weights)
        return full[:, self.expert_offset:self.expert_offset + len(self.experts)]

    def weights_moved(self) -> None:
        """The weights' bytes moved (loading/arena.py), their values as they were: the dense
        stack, moved with them, stays current."""
        if self._stack is not None and self._stack_params is not None:
            self._stack_key = self._params_key()

    def _params_key(self) -> tuple:
        return tuple(weight_key(p) for p in self._stack_params)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Expert weights concatenated for ``_dense``; rebuilt if any parameter changed
        (tests edit weights in place after loading)."""
        if self._stack_params is None:
            mlps = list(self.experts) + ([self.shared_experts] if self.shared_experts is not None else [])
            self._stack_params = [p for m in mlps for p in (m.gate_proj.weight, m.up_proj.weight,
                                                            m.down_proj.weight)]
        key = self._params_key()
        if self._stack_key != key:
            mlps = list(self.experts) + ([self.shared_experts] if self.shared_experts is not None else [])
            # Plain tensors even when first asked inside inference mode (an eager forward):
            # what holds the weights stays one kind of tensor (loading/arena.py moves them).
            with torch.inference_mode(False), torch.no_grad():
                gate = torch.cat([m.gate_proj.weight for m in mlps])
                up = torch.cat([m.up_proj.weight for m in mlps])
                down = torch.cat([m.down_proj.weight for m in mlps], dim=1)
                routed = sum(m.gate_proj.out_features for m in self.experts)
                self._stack = (column_major(torch.cat([gate, up]), self.products), down,
                               (routed, gate.shape[0] - routed))
            self._stack_key = key
        return self._stack
