"""Loading a Hugging Face DeepSeek checkpoint into the model: checkpoint.py runs plan.py
(what to read), read.py (the safetensors reads) and install.py (into the model);
files.py knows the folder's files."""
from server.model.loading.checkpoint import ModelInfo, load_checkpoint
from server.model.loading.files import (
                                        CheckpointError,
                                        CheckpointSummary,
                                        inspect_checkpoint,
                                        read_config,
                                        tensor_index,
)
from server.model.loading.install import heads_by_columns

__all__ = ["CheckpointError", "CheckpointSummary", "ModelInfo", "heads_by_columns",
           "inspect_checkpoint", "load_checkpoint", "read_config", "tensor_index"]
