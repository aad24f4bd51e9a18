"""One rank's shard of the model: tensor and expert parallel (plan.py), attention data
parallel (data.py), the latent cache striped over ranks (sequence.py), a step's tokens
split over ranks (context.py), and int8 checkpoints sliced with their scales
(quant_shard.py)."""
from server.model.parallel.plan import (
    ParallelPlan,
    ShardError,
    TensorSlice,
    shard_model,
)

__all__ = ["ParallelPlan", "ShardError", "TensorSlice", "shard_model"]
