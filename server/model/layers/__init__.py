"""The model's layers: RMSNorm (norm.py), rotary embedding (rotary.py), linear layers and
their layout (linear.py), the dense MLP (mlp.py), the routed MoE (moe.py), MLA attention
(attention.py) and its paged latent cache (latent_cache.py)."""
from server.model.layers.linear import Linear, column_major
from server.model.layers.mlp import MLP
from server.model.layers.moe import DENSE_MOE_MAX_MACS, MoE, MoEGate
from server.model.layers.norm import RMSNorm
from server.model.layers.rotary import RotaryEmbedding

__all__ = ["DENSE_MOE_MAX_MACS", "Linear", "MLP", "MoE", "MoEGate", "RMSNorm", "RotaryEmbedding",
           "column_major"]
