"""Pieces of the demo model's training (training/train.py) that decide what it learns.

Why: the shipped model's MTP acceptance comes from these losses and masks; a shifted index
or a wrong mask trains the MTP layer on the wrong token and nothing downstream would say so
except a lower figure on the card.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from server.model.config import DeepseekConfig
from training import spec, train

ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(seed: int = 0):
    hf = spec.hf_config(vocab_size=64, bos_id=0, eos_id=1, max_len=64)
    hf.update(num_hidden_layers=2, hidden_size=32, intermediate_size=48, moe_intermediate_size=16)
    return train.init_model(DeepseekConfig.from_hf(hf), seed)


def test_losses_match_hand_computed_main_mtp_and_distillation():
    torch.manual_seed(0)
    model = _tiny_model()
    rows = torch.randint(2, 64, (2, 13))
    keep = torch.rand(rows.shape) > 0.3
    with torch.no_grad():
        main, mtp, kl, _ = train.losses(model, rows, keep, distill=True)
        hidden = model.forward_full(rows[:, :-1])
        logits = model.compute_logits(hidden)                      # position i predicts token i+1
        mlog = model.mtp_compute_logits(model.mtp_forward_full(rows[:, 1:], hidden))
    exp_main, exp_mtp, exp_kl, n1, n2 = 0.0, 0.0, 0.0, 0, 0
    for b in range(rows.shape[0]):
        for i in range(rows.shape[1] - 1):
            if keep[b, i + 1]:
                exp_main += -F.log_softmax(logits[b, i], -1)[rows[b, i + 1]].item()
                n1 += 1
            if i + 2 < rows.shape[1] and keep[b, i + 2]:
                # MTP at i sees (h_i, token i+1) and predicts token i+2; its teacher is the
                # main model at i+1, which predicts the same token.
                exp_mtp += -F.log_softmax(mlog[b, i], -1)[rows[b, i + 2]].item()
                t = F.log_softmax(logits[b, i + 1], -1)
                s = F.log_softmax(mlog[b, i], -1)
                exp_kl += (t.exp() * (t - s)).sum().item()
                n2 += 1
    assert abs(main.item() - exp_main / n1) < 1e-5
    assert abs(mtp.item() - exp_mtp / n2) < 1e-5
    assert abs(kl.item() - exp_kl / n2) < 1e-5
    assert kl.item() > 0
    _, _, off, _ = train.losses(model, rows, keep, distill=False)
    assert off.item() == 0.0


def test_distillation_moves_the_mtp_layer_towards_the_main_model():
    """The teacher side is detached (the main model is not pulled towards its drafter: its
    gradient equals that of a hand-built KL against detached teacher logits), and a few steps
    on the KL alone, MTP layer only, must lower it."""
    torch.manual_seed(1)
    model = _tiny_model(1)
    rows = torch.randint(2, 64, (4, 17))
    keep = torch.ones_like(rows, dtype=torch.bool)
    _, _, kl0, _ = train.losses(model, rows, keep, distill=True)
    kl0.backward()
    got = model.model.norm.weight.grad.clone()
    model.zero_grad()
    hidden = model.forward_full(rows[:, :-1])
    teacher = F.log_softmax(model.compute_logits(hidden)[:, 1:].detach(), -1)
    student = F.log_softmax(model.mtp_compute_logits(model.mtp_forward_full(rows[:, 1:], hidden)[:, :-1]), -1)
    ref = (teacher.exp() * (teacher - student)).sum(-1).mean()
    ref.backward()
    assert torch.allclose(got, model.model.norm.weight.grad, atol=1e-6)
    model.zero_grad()
    mtp_params = [p for n, p in model.named_parameters() if n.startswith(f"model.layers.{model.config.num_hidden_layers}.")
                  and "shared_head.head" not in n]
    opt = torch.optim.Adam(mtp_params, lr=3e-3)
    for _ in range(20):
        _, _, kl, _ = train.losses(model, rows, keep, distill=True)
        opt.zero_grad()
        kl.backward()
        opt.step()
    _, _, kl1, _ = train.losses(model, rows, keep, distill=True)
    assert kl1.item() < 0.5 * kl0.item(), (kl0.item(), kl1.item())


def test_weighted_losses_count_each_target_by_its_weight():
    """Stage 3 weights tool-argument tokens up: a weight w must count a target's CE w times
    (main and MTP), and all-ones weights must give the unweighted losses."""
    torch.manual_seed(2)
    model = _tiny_model(2)
    rows = torch.randint(2, 64, (2, 11))
    keep = torch.rand(rows.shape) > 0.2
    weights = 1.0 + 3.0 * (torch.rand(rows.shape) > 0.7).float()
    with torch.no_grad():
        main, mtp, _, _ = train.losses(model, rows, keep, weights=weights)
        m1, t1, _, _ = train.losses(model, rows, keep)
        m2, t2, _, _ = train.losses(model, rows, keep, weights=torch.ones(rows.shape))
        hidden = model.forward_full(rows[:, :-1])
        logits = model.compute_logits(hidden)
        mlog = model.mtp_compute_logits(model.mtp_forward_full(rows[:, 1:], hidden))
    num1 = den1 = num2 = den2 = 0.0
    for b in range(rows.shape[0]):
        for i in range(rows.shape[1] - 1):
            if keep[b, i + 1]:
                w = weights[b, i + 1].item()
                num1 += w * -F.log_softmax(logits[b, i], -1)[rows[b, i + 1]].item()
                den1 += w
            if i + 2 < rows.shape[1] and keep[b, i + 2]:
                w = weights[b, i + 2].item()
                num2 += w * -F.log_softmax(mlog[b, i], -1)[rows[b, i + 2]].item()
                den2 += w
    assert abs(main.item() - num1 / den1) < 1e-5
    assert abs(mtp.item() - num2 / den2) < 1e-5
    assert abs(m1.item() - m2.item()) < 1e-5 and abs(t1.item() - t2.item()) < 1e-5


@pytest.mark.demo                       # the bundled model's tokenizer
def test_copy_weights_mark_the_argument_values_and_names_tokenize_alike():
    """The copy stage's tokenizer makes a city the same tokens in the prompt and the call, and
    the weights cover exactly the call's argument value plus its closing quote."""
    import random

    from tokenizers import Tokenizer as HFTokenizer

    from training import corpus, render

    base = HFTokenizer.from_file(str(ROOT / "models" / "deepseek-v3-tiny-mtp" / "tokenizer.json"))
    tok = render.with_name_split(base)
    assert render.has_name_split(tok)
    for city in ("Florence", "Kuala Lumpur", "Paris"):
        in_prompt = tok.encode(f"What is the weather in {city}?").tokens
        in_json = tok.encode(f'{{"city": "{city}"}}').tokens
        pieces = tok.encode(city).tokens
        assert in_prompt[in_prompt.index("Ġin") + 2:][:len(pieces)] == pieces
        assert in_json[in_json.index('Ġ"') + 1:][:len(pieces)] == pieces
        for text in (f"In {city} it is 20°C.\n\nA  B", f'{{"city": "{city}"}}'):
            assert tok.decode(tok.encode(text).ids) == text
    chat = corpus.make_tool_chat(random.Random(3), "copy", corpus.CITY_KINDS)
    text = render.render_chat(chat)
    enc = tok.encode(text)
    w = train.copy_value_weights(text, enc.offsets, 4.0)
    marked = "".join(t for t, x in zip(enc.tokens, w) if x == 4.0)
    city = chat.expect_args["city"]
    assert marked.replace("Ġ", " ").startswith(city) and marked.endswith('"}')
    assert sum(x == 4.0 for x in w) == len(tok.encode(city).ids) + 1


def test_spelt_names_are_the_same_letters_in_the_prompt_the_call_and_the_result():
    """render.SPELL_NAMES: a capitalised word is one letter a piece wherever it stands, lowercase
    words keep their merges, and decoding gives the text back byte for byte."""
    from training import render

    texts = ["What is the weather in Bergen today? The weather in Bergen is sunny.",
             'get_weather {"city": "Bergen"} the weather in Paris', "Überlingen and ÉCOLE, 12 pm."] * 40
    tok = render.train_tokenizer(texts, 400, name_split=True, spell_names=True)
    assert render.has_spelt_names(tok) and render.has_name_split(tok)
    plain = render.train_tokenizer(texts, 400, name_split=True)
    assert not render.has_spelt_names(plain)
    assert plain.encode("Bergen").tokens == ["Bergen"]           # BPE alone learns the name whole
    for city in ("Bergen", "Valencia", "Salzburg", "Sapporo", "McKinley"):
        pieces = tok.encode(city).tokens
        assert pieces == list(city)
        in_prompt = tok.encode(f"What time is it now in {city}?").tokens
        in_json = tok.encode(f'{{"city": "{city}"}}').tokens
        in_result = tok.encode(f'{{"city": "{city}", "time": "10:00"}}').tokens
        assert in_prompt[in_prompt.index("Ġ", in_prompt.index("Ġin")) + 1:][:len(pieces)] == pieces
        assert in_json[in_json.index('Ġ"') + 1:][:len(pieces)] == pieces
        assert in_result[in_result.index('Ġ"') + 1:][:len(pieces)] == pieces
    assert "Ġweather" in tok.encode("the weather").tokens        # lowercase words are untouched
    for text in texts[:3] + ["iPhone x McDonald's  Ab\n\nZ", "The Über-Café"]:
        assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.demo                       # the bundled model's tokenizer
def test_mixed_encoding_keeps_stage2_pieces_but_for_the_copied_values():
    """copy_mixed_tokens: the assistant's own text stays in the pieces the frozen layers were
    trained on (``ĠRome``, never a bare ``Ġ`` before a name), the context and the argument values
    are in the name-split pieces (so the value is the prompt's pieces), the mask is the
    assistant's, and the weights cover the value plus the token that closes it."""
    import random

    from tokenizers import Tokenizer as HFTokenizer

    from training import corpus, render
    from server.text import special_tokens as st

    base = HFTokenizer.from_file(str(ROOT / "models" / "deepseek-v3-tiny-mtp" / "tokenizer.json"))
    tok = render.with_name_split(base)
    tid = tok.token_to_id
    mask_of = train.assistant_masker(tok)

    rng = random.Random(3)
    while True:                     # a city whose pieces differ with and without the split rule
        chat = corpus.make_tool_chat(rng, "copy", corpus.CITY_KINDS)
        text = render.render_chat(chat)
        if base.encode(" " + chat.expect_args["city"]).ids != tok.encode(" " + chat.expect_args["city"]).ids:
            break
    ids, mask, w = train.encode_mixed(text, tok, base, mask_of, 4.0)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(ids) == len(mask) == len(w)
    split_enc = tok.encode(text)
    assert sum(mask_of(split_enc.ids)) > 0 and mask[:5] == [False] * 5
    city = chat.expect_args["city"]
    pieces = tok.encode(city).ids
    marked = [i for i, x in zip(ids, w) if x == 4.0]
    assert marked == pieces + [tid('"}')]
    n_ctx = mask.index(True)                       # the context: the split tokenizer's pieces
    assert ids[:n_ctx] == split_enc.ids[:n_ctx]
    # The assistant's answer after the tool result names the city in stage 2's pieces.
    written = [i for i, m in zip(ids, mask) if m]
    answer = written[len(written) - written[::-1].index(tid(st.EOS), 1):-1]     # the last turn, EOS off
    answer_text = tok.decode(answer, skip_special_tokens=False)
    assert city in answer_text and answer == base.encode(answer_text).ids != tok.encode(answer_text).ids
    # Other chats (thinking, plain answers) decode back to their text, their mask is the assistant's.
    for seed in range(8):
        other = render.render_chat(corpus.make_chat(random.Random(seed), "copy"))
        ids2, mask2, _ = train.encode_mixed(other, tok, base, mask_of, 4.0)
        assert tok.decode(ids2, skip_special_tokens=False) == other
        assert tok.decode([i for i, m in zip(ids2, mask2) if m], skip_special_tokens=False) == tok.decode(
            [i for i, m in zip(tok.encode(other).ids, mask_of(tok.encode(other).ids)) if m], skip_special_tokens=False)


def test_retention_kl_is_zero_against_itself_and_skips_the_argument_values():
    """The copy stage keeps the model's other skills by a KL to the frozen starting model on
    every target except the argument values; were those included the KL would pull the calls
    back to the memorised city, were the others left out nothing would hold thinking in place."""
    import copy

    torch.manual_seed(0)
    model = _tiny_model()
    rows = torch.randint(2, 64, (2, 13))
    keep = torch.ones(rows.shape, dtype=torch.bool)
    weights = torch.ones(rows.shape)
    weights[:, 5:8] = 6.0
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    assert train.losses(model, rows, keep, teacher=None).retain.item() == 0.0
    assert abs(train.losses(model, rows, keep, weights=weights, teacher=teacher).retain.item()) < 1e-6
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        got = train.losses(model, rows, keep, weights=weights, teacher=teacher).retain
        x = rows[:, :-1]
        s = F.log_softmax(model.compute_logits(model.forward_full(x)), -1)
        t = F.log_softmax(teacher.compute_logits(teacher.forward_full(x)), -1)
        sel = weights[:, 1:] <= 1.0
        want = (t.exp() * (t - s)).sum(-1)[sel].sum() / sel.sum()
    assert got.item() > 1e-4
    assert abs(got.item() - want.item()) < 1e-5


def test_settings_overrides_parse_each_field_type():
    s = spec.with_overrides(spec.TrainSettings(), ["copy_retain=1.5", "copy_args_only=1", "copy_layers=3,5",
                                                   "polish_steps=0"])
    assert (s.copy_retain, s.copy_args_only, s.copy_layers, s.polish_steps) == (1.5, True, (3, 5), 0)
    for bad in ["nope=1", "copy_retain", "copy_args_only=maybe", "polish_steps=x"]:
        with pytest.raises(ValueError, match="--set"):
            spec.with_overrides(spec.TrainSettings(), [bad])


def test_training_cli_refuses_unknown_settings_and_copy_heads_without_the_name_split():
    import subprocess

    for extra, message in ((["--set", "nope=1"], "TrainSettings' fields"),
                           (["--no-copy-pretrain", "--set", "copy_heads_from_start=1"], "needs --copy-pretrain")):
        r = subprocess.run([sys.executable, "-m", "training", "--out", "/nonexistent/never-written", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr[-500:])


def test_set_args_round_trip_through_the_overrides():
    base = spec.TrainSettings()
    s = spec.with_overrides(base, ["copy_retain=1.5", "copy_args_only=1", "copy_layers=3,5", "copy_lr=0.006"])
    args = spec.set_args(s, base, skip=("copy_lr",))
    assert dict(args) == {"copy_retain": "1.5", "copy_args_only": "1", "copy_layers": "3,5"}
    again = spec.with_overrides(base, [f"{k}={v}" for k, v in args] + ["copy_lr=0.006"])
    assert again == s
