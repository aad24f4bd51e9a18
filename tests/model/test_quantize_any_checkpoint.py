"""training/quantize.py on a checkpoint it was not built around: a random tiny DeepSeek-V3
(server.testing), quantized to msModelSlim W8A8 mixed and compressed-tensors int8, loads
and agrees with its float source (top-1 on random token sequences)."""
from __future__ import annotations

import pytest
import torch

from server.model.loading import load_checkpoint
from server.model.quant.linear import QuantLinear
from server.testing.tiny_checkpoint import make_tiny_checkpoint


@pytest.mark.parametrize("fmt", ["msmodelslim", "compressed-tensors"])
def test_random_checkpoint_quantizes_and_agrees(tmp_path, fmt):
    from training import quantize
    src = make_tiny_checkpoint(tmp_path / "float", seed=3)
    dst = tmp_path / "q"
    assert quantize.main([str(src), str(dst), "--format", fmt, "--calib-samples", "16"]) == 0
    ref, _ = load_checkpoint(src)
    q, info = load_checkpoint(dst)
    assert info.quantization.startswith(fmt)
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) >= 60
    ids = torch.randint(2, 500, (8, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = ref.compute_logits(ref.forward_full(ids)).argmax(-1)
        b = q.compute_logits(q.forward_full(ids)).argmax(-1)
    agreement = float((a == b).float().mean())
    print(f"{fmt}: top-1 agreement with the float source {agreement:.3f}")
    assert agreement >= 0.85
