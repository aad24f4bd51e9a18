"""What a load will read: the model built on the meta device (a rank's shard under a
parallel plan, int8 layers swapped in), the checkpoint tensor and file behind each
parameter, and what is missing, before any weight is read."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from server.model import kernels
from server.model.config import DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.kernels.choice import KERNEL_OF
from server.model.kernels.select import built_kernels
from server.model.loading.files import (
    INDEX_FILE,
    CheckpointError,
    fp8_block,
    listing,
    num_mtp_layers,
    tensor_index,
)
from server.model.meta import meta_device
from server.model.parallel.plan import (
    ParallelPlan,
    ShardError,
    TensorSlice,
    shard_model,
)
from server.model.parallel.quant_shard import QuantShard, QuantShardError, shard_spec
from server.model.quant.formats import QuantConfigError, QuantSpec, detect, install
from server.model.quant.int8 import fastest_int8_backend


@dataclass
class LoadPlan:
    path: Path
    config: DeepseekConfig
    dtype: torch.dtype
    device: torch.device
    model: DeepseekV3ForCausalLM                  # on the meta device until installed
    where: dict[str, str]                         # checkpoint tensor -> file
    fp8_block: int
    spec: QuantSpec | None = None                 # int8 layers (quant/formats.py)
    shard: QuantShard | None = None               # their slices under a parallel plan
    int8_backend: str = "auto"
    slices: dict[str, TensorSlice] = field(default_factory=dict)   # parameter -> checkpoint slice
    expected: dict[str, nn.Parameter] = field(default_factory=dict)  # float parameters to read
    optional: set[str] = field(default_factory=set)                # MTP heads that may be absent
    by_file: dict[str, list[str]] = field(default_factory=dict)     # file -> parameters it holds
    errors: list[str] = field(default_factory=list)

    @property
    def num_mtp_layers(self) -> int:
        return self.model.num_mtp_layers


def plan_load(path: Path, config: DeepseekConfig, dtype: torch.dtype, device: torch.device,
              int8_backend: str, plan: ParallelPlan | None) -> LoadPlan:
    where = tensor_index(path)
    with meta_device():
        model = DeepseekV3ForCausalLM(config, num_mtp_layers=num_mtp_layers(config, where))
    lp = LoadPlan(path, config, dtype, device, model, where, fp8_block(config, path),
                  int8_backend=_int8_backend(int8_backend, dtype))
    _quantize_and_shard(lp, plan)
    _expected_tensors(lp)
    return lp


def _quantize_and_shard(lp: LoadPlan, plan: ParallelPlan | None) -> None:
    """The int8 layers the checkpoint describes and, under ``plan``, the rank's shard."""
    model = lp.model
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        lp.spec = detect(lp.path, lp.config.extra, linears)
    except QuantConfigError as e:
        raise CheckpointError(str(e)) from e
    if plan is not None and plan.world_size > 1:
        try:
            lp.slices = shard_model(model, plan)
            if lp.spec is not None:
                local = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
                lp.shard = shard_spec(lp.spec, lp.slices, local, plan)
                lp.spec = lp.shard.spec
        except (ShardError, QuantShardError) as e:
            raise CheckpointError(f"{lp.path}: cannot be split over {plan.world_size} ranks "
                                  f"(moe_tp {plan.moe_tp}, moe_ep {plan.moe_ep}): {e}") from e
    model.parallel_plan = plan if plan is not None and plan.world_size > 1 else None
    if lp.spec is not None:
        if lp.int8_backend == "auto":
            lp.int8_backend = fastest_int8_backend(lp.device, lp.dtype)
        install(model, lp.spec, lp.int8_backend, lp.shard.row_parallel if lp.shard else frozenset())


def _expected_tensors(lp: LoadPlan) -> None:
    """The float parameters to read, grouped by the file holding each (int8 layers are
    read by quant/formats.py), and every one that no file holds."""
    expected = dict(lp.model.named_parameters())                # tied duplicates appear once
    if lp.spec is not None:
        for name in [n for n in expected if n.rpartition(".")[0] in lp.spec.layer_types]:
            del expected[name]
    n = lp.config.num_hidden_layers
    lp.optional = {f"model.layers.{n + j}.shared_head.head.weight" for j in range(lp.num_mtp_layers)}
    if lp.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name in expected:
        src = lp.slices[name].source if name in lp.slices else name
        if src in lp.where:
            lp.by_file.setdefault(lp.where[src], []).append(name)
        elif name not in lp.optional:
            lp.errors.append(f"missing tensor {name} (not in {listing(lp.path)})")
    for f in sorted(f for f in lp.by_file if not (lp.path / f).is_file()):
        lp.errors.append(f"file {lp.path / f} listed in {INDEX_FILE} does not exist "
                         f"(holds e.g. {lp.by_file.pop(f)[0]})")
    lp.expected = expected


def _int8_backend(asked: str, dtype: torch.dtype) -> str:
    """The int8 backend to load with: ``asked``, or for "auto" $MTP_SERVE_INT8_BACKEND where
    set (still "auto" otherwise: measured once the device is known), checked against what
    this CPU and a model of ``dtype`` can run (kernels/choice.py)."""
    try:
        if asked == "auto":
            asked = kernels.kernel_settings().int8_backend
        if asked == "auto":
            return asked
        half = dtype in (torch.bfloat16, torch.float16)
        wanted = [KERNEL_OF[asked]] if asked in KERNEL_OF else []
        return kernels.forced_int8_backend(asked, kernels.cpu_caps(), half, built_kernels(wanted))
    except (kernels.BackendUnavailable, kernels.KernelSettingError) as e:
        raise CheckpointError(str(e)) from e
