"""Checkpoint loading: FP8 dequantisation, shards, missing MTP, and refusals of bad checkpoints."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from server.model.quant.fp8 import quantize_fp8
from server.model.loading import CheckpointError, load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model.forward_full(ids))


def _naive_dequant(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w8.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            out[blk] = w8[blk].float() * scale[i, j]
    return out


def test_fp8_checkpoint_matches_dequantized_float32_twin(tmp_path):
    fp8_dir = make_tiny_checkpoint(tmp_path / "fp8", seed=6, fp8=True)
    raw = load_file(str(fp8_dir / "model.safetensors"))
    w = raw["model.layers.0.mlp.down_proj.weight"]                      # [64, 160]: a partial column block
    assert w.dtype == torch.float8_e4m3fn and raw["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert raw["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)   # 160 rows: partial row block

    # Twin: every fp8 weight dequantised block by block, written as a plain float32 checkpoint.
    twin = {}
    for name, t in raw.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = raw.get(name[: -len("weight")] + "weight_scale_inv")
        twin[name] = _naive_dequant(t, scale) if scale is not None else t.float()
    twin_dir = _copy(fp8_dir, tmp_path / "twin")
    save_file(twin, str(twin_dir / "model.safetensors"))
    cfg = json.loads((twin_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    (twin_dir / "config.json").write_text(json.dumps(cfg))

    model, info = load_checkpoint(fp8_dir, dtype=torch.float32)
    ref, ref_info = load_checkpoint(twin_dir)
    assert info.quantization == "fp8" and ref_info.quantization is None and ref_info.dtype == torch.float32
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    # Weights are bit-identical; logits may differ in the last bits (SIMD reduction order
    # depends on memory alignment), so compare them with a tight tolerance.
    assert (_logits(model, ids) - _logits(ref, ids)).abs().max() < 1e-5
    # Quantisation is close to the original weights (sanity of the factory's quantiser).
    orig = torch.randn(200, 300)
    q, s = quantize_fp8(orig)
    assert (_naive_dequant(q, s) - orig).abs().max() < 0.07 * orig.abs().max()

    # Default dtype follows torch_dtype (bfloat16 for the FP8 release layout).
    bf16, bf16_info = load_checkpoint(fp8_dir)
    assert bf16_info.dtype == torch.bfloat16 and bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32       # routing stays float32
    diff = (_logits(bf16, ids) - _logits(ref, ids)).abs().max()
    assert diff < 0.5, f"bfloat16 logits drift {diff}"


def test_factory_writes_full_hf_layout(tiny):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (tiny / name).is_file(), name
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == 1


def test_vocabulary_head_is_held_column_major_on_cpu_with_its_values(tiny):
    model, _ = load_checkpoint(tiny)
    head = model.lm_head.weight
    stored = load_file(str(tiny / "model.safetensors"))["lm_head.weight"]
    assert head.shape == stored.shape and head.stride() == (1, head.shape[0])   # [hidden, vocab] in memory
    assert torch.equal(head, stored)
    mtp = model.model.layers[model.config.num_hidden_layers]
    assert mtp.shared_head.head.weight is head            # the MTP head is still the same tensor
    x = torch.randn(3, model.config.hidden_size)
    assert torch.allclose(model.compute_logits(x), x @ stored.t(), atol=1e-5)
    # the MoE's stacked gate/up for decode windows: column-major too, the same values
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    gate_up, down, _ = moe._stacked()
    assert gate_up.stride() == (1, gate_up.shape[0]) and down.is_contiguous()
    assert torch.equal(gate_up[:moe.experts[0].gate_proj.out_features], moe.experts[0].gate_proj.weight)


def test_bf16_heads_stay_row_major_without_native_bf16(tiny, monkeypatch):
    """Column-major bf16 products leave oneDNN's fast path on a CPU without AVX512_BF16 /
    AMX (30x slower, layers.column_major): there a bf16 head stays row-major; float32 and
    a native-bf16 CPU keep the column-major head."""
    from server.model.kernels.products import Products
    from server.model.loading import install
    for native in (False, True):
        monkeypatch.setattr(install, "model_products", lambda dtype, device, native=native: Products(native))
        model, _ = load_checkpoint(tiny, dtype=torch.bfloat16)
        head = model.lm_head.weight
        assert head.is_contiguous() is (not native)
        assert torch.equal(head.float(), load_file(str(tiny / "model.safetensors"))["lm_head.weight"]
                           .to(torch.bfloat16).float())
    assert Products(False).column_major(torch.float32)


def test_sharded_checkpoint_loads_like_single_file(tiny, tmp_path, caplog):
    sharded = _copy(tiny, tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(sharded / fname))
        weight_map.update({k: fname for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with caplog.at_level(logging.INFO, logger="server.model.loading"):
        model, info = load_checkpoint(sharded)
    assert "loaded shard 2/2" in caplog.text
    single, _ = load_checkpoint(tiny)
    for (name, a), (_, b) in zip(model.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(3, 512, (1, 9))
    assert (_logits(model, ids) - _logits(single, ids)).abs().max() < 1e-5
    assert info.has_mtp and info.model_type == "deepseek_v3"


def test_checkpoint_without_mtp_weights_loads_with_mtp_unavailable(tiny, tmp_path, caplog):
    no_mtp = _copy(tiny, tmp_path / "no_mtp")
    tensors = load_file(str(no_mtp / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")},
              str(no_mtp / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="server.model.loading"):
        model, info = load_checkpoint(no_mtp)
    assert not info.has_mtp and info.num_mtp_layers == 0
    assert not model.has_mtp and model.num_kv_layers == 2 and model.kv_cache_dim == 32 + 8
    assert "MTP" in caplog.text and "unavailable" in caplog.text
    with pytest.raises(ValueError, match="MTP layer 0 does not exist"):
        model.mtp_compute_logits(torch.zeros(1, 64))


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_config_json(tiny, tmp_path):
    bad = _copy(tiny, tmp_path / "bad")
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*missing config\.json"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_unknown_model_type(tiny, tmp_path):
    bad = _copy(tiny, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model_type 'llama' is not supported; allowed: deepseek_v3"):
        load_checkpoint(bad)


def test_missing_and_misshaped_tensors_are_all_named(tiny, tmp_path):
    bad = _copy(tiny, tmp_path / "bad")

    def edit(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        del t["model.layers.2.eh_proj.weight"]
        t["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(10, 32)

    _rewrite(bad, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "missing tensor model.layers.1.mlp.experts.3.up_proj.weight (not in model.safetensors)" in msg
    assert "missing tensor model.layers.2.eh_proj.weight" in msg
    assert "tensor model.layers.0.self_attn.kv_b_proj.weight in model.safetensors: shape (10, 32), " \
           "expected (128, 32)" in msg


def test_fp8_weight_without_scale_and_missing_shard(tmp_path):
    bad = make_tiny_checkpoint(tmp_path / "bad", seed=7, fp8=True)
    _rewrite(bad, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight in model\.safetensors "
                                              r"is torch\.float8_e4m3fn but .*weight_scale_inv is missing"):
        load_checkpoint(bad)
    shard = _copy(bad, tmp_path / "shard")
    with safe_open(str(shard / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (shard / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in names}}))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001\.safetensors listed in "
                                              r"model\.safetensors\.index\.json does not exist"):
        load_checkpoint(shard)
