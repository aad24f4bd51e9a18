"""DeepSeek-V2/V3 architecture settings, read once from a checkpoint's ``config.json``.  No torch.

The dataclass is frozen: the model and loader take what they need from it and never
mutate it. ``from_hf`` accepts the Hugging Face dict as found on disk (legacy
``rope_scaling`` or newer ``rope_parameters``), fills the defaults the official
remote code uses, and refuses what this code cannot serve with a message that names the
field, the value and what is allowed.

Why here, below the model: ``python -m server --check`` sizes a KV block from it
(kv_block.py) without torch, and server/config sits below server/model and
server/engine.  The model reads it through server/model/config.py, which adds the torch
dtypes its dtype names stand for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
# The dtype names a config or a checkpoint uses (server/model/config.py: their torch dtypes).
DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedConfigError(ValueError):
    """config.json describes something this model code does not implement."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_scaling.type == "yarn"``), DeepSeek flavour."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class DeepseekConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: YarnScaling | None
    rope_interleave: bool          # rope dims are (x0, x1), (x2, x3) pairs (DeepSeek layout)
    max_position_embeddings: int
    rms_norm_eps: float
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int | None   # None: every layer dense
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    # MTP and head
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    torch_dtype: str
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale_after_norm(self) -> bool:
        """V3 multiplies by routed_scaling_factor always; V2's remote code only when not normalising."""
        return self.model_type != "deepseek_v2"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as the official remote code (MTP layers use their own index N + j)."""
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN (the attention-temperature correction)."""
        scale = self.qk_head_dim ** -0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim:
            m = yarn_get_mscale(y.factor, y.mscale_all_dim)
            scale = scale * m * m
        return scale

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DeepseekConfig":
        """Build from a Hugging Face config dict; raise UnsupportedConfigError on what we can't serve."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type {model_type!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        v3 = model_type == "deepseek_v3"

        def req(name: str) -> Any:
            if d.get(name) is None:
                raise UnsupportedConfigError(f"config field {name!r} is required for {model_type}")
            return d[name]

        topk_method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        scoring_func = d.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        _check_choice("topk_method", topk_method, TOPK_METHODS)
        _check_choice("scoring_func", scoring_func, SCORING_FUNCS)
        hidden_act = d.get("hidden_act", "silu")
        _check_choice("hidden_act", hidden_act, ("silu",))
        torch_dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        _check_choice("torch_dtype", torch_dtype, DTYPES)

        n_routed = d.get("n_routed_experts")
        n_group = int(d.get("n_group") or 1)
        topk_group = int(d.get("topk_group") or 1)
        if n_routed is not None:
            if n_routed % n_group:
                raise UnsupportedConfigError(
                    f"n_routed_experts {n_routed} is not divisible by n_group {n_group}"
                )
            if topk_method == "noaux_tc" and n_routed // n_group < 2:
                raise UnsupportedConfigError("noaux_tc needs at least 2 experts per group (it sums each group's top 2)")
        rope_theta, rope_scaling = _rope(d)
        q_lora_rank = d.get("q_lora_rank")
        known = {f.name for f in fields(cls)}
        return cls(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=int(req("num_attention_heads")),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            n_routed_experts=None if n_routed is None else int(n_routed),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring_func,
            norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=torch_dtype,
            hidden_act=hidden_act,
            extra={k: v for k, v in d.items() if k not in known},
        )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UnsupportedConfigError(f"config field {name!r} is {value!r}; allowed: {', '.join(allowed)}")


def _rope(d: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """Read rope_theta and YaRN settings from legacy ``rope_scaling`` or ``rope_parameters``."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    src = scaling or params
    kind = src.get("type") or src.get("rope_type") or "default"
    if kind == "default":
        return rope_theta, None
    if kind != "yarn":
        raise UnsupportedConfigError(f"rope_scaling type {kind!r} is not supported; allowed: yarn (or none)")
    if src.get("factor") is None:
        raise UnsupportedConfigError("rope_scaling.factor is required for yarn")
    return rope_theta, YarnScaling(
        factor=float(src["factor"]),
        original_max_position_embeddings=int(
            src.get("original_max_position_embeddings") or d.get("max_position_embeddings", 4096)
        ),
        beta_fast=float(src.get("beta_fast") or 32.0),
        beta_slow=float(src.get("beta_slow") or 1.0),
        mscale=float(src.get("mscale") or 1.0),
        mscale_all_dim=float(src.get("mscale_all_dim") or 0.0),
    )
