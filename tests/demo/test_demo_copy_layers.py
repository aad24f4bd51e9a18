"""The appended copy layers of the demo model's stage 3 (training/copy_layers.py).

Why: stage 3 must leave the stage-2 model's behaviour where it was except where the new
layers speak. A weight mapped to the wrong layer (the MTP layer moves up behind the new ones),
an MTP head still tied to the trained ``lm_head``, or a "frozen" weight that moves, would
silently change what every other prompt gets; these tests pin each.
"""

from __future__ import annotations

import torch

from server.model.config import DeepseekConfig
from tests.demo.test_demo_copy_heads import ID, PIECES, _ids, _Vocab
from training import copy_heads, copy_layers, export, spec, train


def _stage2(seed: int = 0):
    hf = spec.hf_config(vocab_size=len(PIECES) + 50, bos_id=0, eos_id=1, max_len=64)
    hf = dict(hf, num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
    return train.init_model(DeepseekConfig.from_hf(hf), seed), hf


def _logits(model, x):
    hidden = model.forward_full(x)
    nxt = torch.cat([x[:, 1:], x[:, -1:]], 1)
    return model.compute_logits(hidden), model.mtp_compute_logits(model.mtp_forward_full(nxt, hidden))


def _city_rows():
    """Four rows of a request naming Bergen and a call copying it: (rows, keep, weights), the
    argument value and its closing quote weighted 6."""
    seq = _ids("<bos>", "in", "Ġ", "Ber", "gen", "?", '"', "city", '"', "Ber", "gen", '"')
    rows = torch.tensor([seq + [ID["x"]] * (17 - len(seq))] * 4)
    weights = torch.ones(rows.shape)
    weights[:, 9:12] = 6.0
    return rows, torch.ones_like(rows, dtype=torch.bool), weights


@torch.no_grad()
def test_extended_model_with_silent_layers_is_the_stage2_model():
    model, hf = _stage2()
    new, hf2 = copy_layers.extend(model, hf, 3, seed=5)
    assert hf2["num_hidden_layers"] == 5 and hf["num_hidden_layers"] == 2
    for layer in copy_layers.appended(new, 3):          # silence them: the rest must be as before
        layer.self_attn.o_proj.weight.zero_()
    x = torch.randint(2, len(PIECES) + 50, (2, 12))
    main0, mtp0 = _logits(model, x)
    main1, mtp1 = _logits(new, x)
    assert torch.equal(main0, main1) and torch.equal(mtp0, mtp1)
    # the MTP head is a tensor of its own: training lm_head must not move the drafts
    assert new.lm_head.weight is not new.model.layers[5].shared_head.head.weight
    new.lm_head.weight.add_(1.0)
    assert torch.equal(_logits(new, x)[1], mtp0)


@torch.no_grad()
def test_layer_with_attention_is_the_decoder_layer():
    model, hf = _stage2()
    new, _ = copy_layers.extend(model, hf, 2, seed=5)
    x = torch.randn(2, 10, hf["hidden_size"])
    cos, sin = new._cos_sin_full(10, x.device)
    layer = copy_layers.appended(new, 2)[0]
    out, logp, _writes = copy_layers._layer(layer, x, cos, sin)
    assert torch.allclose(out, layer.forward_full(x, cos, sin), atol=1e-5)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(2, 4, 10))
    assert bool((logp.exp().triu(1) == 0).all())         # causal


def test_training_moves_only_the_new_attention_and_the_head_and_the_export_keeps_the_mtp_head(tmp_path):
    from server.model.loading import load_checkpoint

    model, hf = _stage2()
    new, hf2 = copy_layers.extend(model, hf, 2, seed=5)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    rows, keep, weights = _city_rows()
    s = spec.TrainSettings(copy_steps=3, copy_append_layers=1, copy_lr=1e-2, copy_warmup_steps=1,
                           batch_size=2, copy_retain=1.0, copy_sink_weight=1.0)
    trunk = copy_layers.trunk_outputs(new, rows, 2)
    hist = copy_layers.train_copy_layers(new, rows, keep, weights, trunk,
                                         copy_heads.name_token_classes(_Vocab(PIECES + ["x"] * 50)), 0, ID["?"], s,
                                         log=lambda _m: None)
    assert hist and {"args", "chat", "retain", "mtp_retain", "prev", "copy", "sink", "readout"} <= set(hist[-1])
    after = new.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert "lm_head.weight" in moved
    assert any(k.startswith("model.layers.2.self_attn") for k in moved)
    assert any(k.startswith("model.layers.3.self_attn") for k in moved)
    allowed = ("lm_head.weight", "model.layers.2.", "model.layers.3.")
    assert all(k.startswith(allowed) for k in moved), sorted(moved)
    assert not any(".mlp." in k for k in moved)
    export.write_model(new, tmp_path, hf2, spec.generation_config(0, 1))
    loaded, _ = load_checkpoint(tmp_path, dtype=torch.float32)
    assert torch.equal(loaded.model.layers[4].shared_head.head.weight, before["model.layers.4.shared_head.head.weight"])
    assert not torch.equal(loaded.lm_head.weight, loaded.model.layers[4].shared_head.head.weight)
    x = rows[:, :-1]
    for a, b in zip(_logits(new, x), _logits(loaded, x)):
        assert torch.allclose(a, b, atol=1e-5)


def test_with_the_mtp_layer_training_it_moves_and_learns_to_follow_the_main_model():
    model, hf = _stage2()
    new, _ = copy_layers.extend(model, hf, 2, seed=5)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    rows, keep, weights = _city_rows()
    s = spec.TrainSettings(copy_steps=60, copy_append_layers=1, copy_lr=1e-2, copy_mtp_lr=1e-2, copy_warmup_steps=1,
                           batch_size=4, copy_mtp_train=True, copy_chat_ce=1.0, copy_all_names=True)
    trunk = copy_layers.trunk_outputs(new, rows, 2)
    hist = copy_layers.train_copy_layers(new, rows, keep, weights, trunk,
                                         copy_heads.name_token_classes(_Vocab(PIECES + ["x"] * 50)), 0, ID["?"], s,
                                         log=lambda _m: None)
    assert {"mtp_distill", "mtp_copy", "chat"} <= set(hist[-1]) and "mtp_retain" not in hist[-1]
    moved = {k for k, v in new.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.startswith("model.layers.4.self_attn") for k in moved)
    assert any(k.startswith("model.layers.4.eh_proj") for k in moved)
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens")) for k in moved)
    assert hist[-1]["mtp_copy"] < hist[0]["mtp_copy"], hist


def test_with_copy_train_mlp_the_new_mlps_move_and_nothing_of_the_trunk_does():
    model, hf = _stage2()
    new, _ = copy_layers.extend(model, hf, 2, seed=5)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    rows, keep, weights = _city_rows()
    s = spec.TrainSettings(copy_steps=4, copy_append_layers=1, copy_lr=1e-2, copy_warmup_steps=1,
                           batch_size=2, copy_train_mlp=True)
    trunk = copy_layers.trunk_outputs(new, rows, 2)
    copy_layers.train_copy_layers(new, rows, keep, weights, trunk,
                                  copy_heads.name_token_classes(_Vocab(PIECES + ["x"] * 50)), 0, ID["?"], s,
                                  log=lambda _m: None)
    moved = {k for k, v in new.state_dict().items() if not torch.equal(v, before[k])}
    for i in (2, 3):                                     # both new layers: shared expert's output and the router
        assert f"model.layers.{i}.mlp.shared_experts.down_proj.weight" in moved, sorted(moved)
        assert f"model.layers.{i}.mlp.gate.weight" in moved, sorted(moved)
        assert f"model.layers.{i}.mlp.gate.e_score_correction_bias" not in moved
    assert all(k.startswith(("lm_head.weight", "model.layers.2.", "model.layers.3.")) for k in moved), sorted(moved)


def test_chat_positions_mark_documents_with_an_assistant_turn():
    bos, asst = 0, 9
    x = torch.tensor([[0, 5, 9, 6, 0, 7, 7, 0, 9, 3], [4, 4, 0, 9, 2, 2, 0, 5, 5, 5]])
    got = copy_layers.chat_positions(x, bos, asst)
    want = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_card_of_an_appended_layer_run_reproduces_its_settings(tmp_path):
    """The card's command must rebuild this model: every setting that differs goes on it."""
    from training.card import write_card
    from training.evaluate import EvalResult

    s = spec.with_overrides(spec.TrainSettings(), ["copy_steps=1200", "copy_append_layers=2", "copy_retain=2",
                                                   "threads=1"])
    hf = dict(spec.hf_config(2048, 0, 1), num_hidden_layers=11)
    copy_run = {"steps": 1200, "lr": 5e-3, "warmup_steps": 20, "seed": 1, "chats": 3000, "corpus_seed": 7,
                "rows": 10, "append_layers": 2, "retain": 2.0, "mtp_retain": 1.0, "supervision": 1.0,
                "sink_weight": 1.0, "value_weight": 1.0, "prose_docs": 300, "seconds": 60.0, "arg_weight": 6.0,
                "train_mlp": True, "mixed_tokens": True}
    res = EvalResult(figures={"mtp_acceptance_k1": 0.9, "tool_city_copy": 0.5},
                     counts={"n_copy": 40, "n_plain": 30, "n_think": 30, "n_tool": 30, "drafted": 100})
    write_card(tmp_path, s, hf, res, {"copy_run": copy_run, "history": [{"stage": "copy", "args": 0.5}],
                                      "stage_seconds": [1.0, 2.0, 60.0], "total_seconds": 100.0})
    card = (tmp_path / "README.md").read_text()
    assert "--copy-steps 1200 --set copy_append_layers=2 --set copy_retain=2.0" in card
    assert "3 decoder layers of the same kind are appended after its 8" in card
    # stage 3 runs at copy_threads: --threads (stages 1-2) stays at the default that built the stage-2 base
    assert "threads=1" not in card and "MLPs start silent" in card and "train.encode_mixed" in card
