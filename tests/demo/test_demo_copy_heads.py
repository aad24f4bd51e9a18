"""The copy-head supervision of the demo model's stage 3 (training/copy_heads.py).

Why: the shipped model copies a city from the prompt because these targets tell two heads
where to look; a target shifted by one position teaches a head to look at the wrong token,
and the model would write made-up names with nothing but a lower card figure to say so.
"""

from __future__ import annotations

import math

import torch

from server.model.config import DeepseekConfig
from training import copy_heads, corpus, spec, train


class _Vocab:
    """A tokenizer stand-in: the pieces are the list's entries."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def get_vocab_size(self) -> int:
        return len(self.pieces)

    def id_to_token(self, i: int) -> str:
        return self.pieces[i]


PIECES = ["<bos>", "Ġ", "in", "Ġthe", "Ber", "gen", "Par", "is", "?", '"', ":", "city", "The", "x"]
ID = {p: i for i, p in enumerate(PIECES)}


def _ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def test_name_classes_and_positions():
    starts, cont = copy_heads.name_token_classes(_Vocab(PIECES))
    assert [PIECES[i] for i in range(len(PIECES)) if starts[i]] == ["Ber", "Par", "The"]
    assert "gen" in [PIECES[i] for i in range(len(PIECES)) if cont[i]]
    assert not cont[ID["Ġthe"]] and not cont[ID["Ġ"]]
    x = torch.tensor([_ids("in", "Ġ", "Ber", "gen", "?", "gen")])
    inside = copy_heads.name_positions(x, (starts, cont))
    # "gen" is inside a name only right after a name piece
    assert inside[0].tolist() == [False, False, True, True, False, False]


def test_copy_targets_point_at_the_earlier_occurrence_of_the_next_piece():
    classes = copy_heads.name_token_classes(_Vocab(PIECES))
    # "<bos> in Ġ Ber gen ? " city : " Ber gen "  -> at the quote (pos 8) the next piece is
    # "Ber", held at 3; at "Ber" (9) the next is "gen", held at 4.
    seq = _ids("<bos>", "in", "Ġ", "Ber", "gen", "?", '"', "city", '"', "Ber", "gen", '"')
    rows = torch.tensor([seq])
    tg = copy_heads.copy_targets(rows, classes, bos_id=ID["<bos>"])
    assert tg.shape == (1, len(seq) - 1, len(seq) - 1)
    hits = {int(i): tg[0, i].nonzero().flatten().tolist() for i in tg[0].any(-1).nonzero().flatten()}
    assert hits == {8: [3], 9: [4]}


def test_copy_targets_stay_inside_a_document():
    classes = copy_heads.name_token_classes(_Vocab(PIECES))
    seq = _ids("<bos>", "Ġ", "Ber", "gen", "<bos>", '"', "Ber", "gen")
    tg = copy_heads.copy_targets(torch.tensor([seq]), classes, bos_id=ID["<bos>"])
    assert not tg.any()           # the only earlier "Ber" is in the previous document


LETTERS = ["<bos>", "Ġ", "Ġin", "?", '"', "B", "e", "r", "g", "n", "T", "h", "x", "O", "K"]
LID = {p: i for i, p in enumerate(LETTERS)}


def _letters(text: str) -> list[int]:
    """Ids of a spelt-out sequence: space-separated entries of LETTERS, a word spelt letter by letter."""
    out: list[int] = []
    for w in text.split(" "):
        out += [LID[w]] if w in LID else [LID[c] for c in w]
    return out


def test_aligned_targets_point_at_the_same_letter_of_the_earlier_mention():
    """Spelt one letter a piece, "Bergen" holds two "e"s: the source of each letter written is
    the letter in the same place of the earlier "Bergen", never just any "e"."""
    classes = copy_heads.name_token_classes(_Vocab(LETTERS))
    seq = _letters('<bos> Ġin Ġ Bergen ? " Bergen "')
    #               0     1   2 3....8 9 10 11..16 17
    tg = copy_heads.aligned_copy_targets(torch.tensor([seq]), classes, bos_id=LID["<bos>"])
    hits = {int(i): tg[0, i].nonzero().flatten().tolist() for i in tg[0].any(-1).nonzero().flatten()}
    # at the quote (10) the next letter is "B", held at 3; at "B" (11) the next is "e" at 4; ...
    assert hits == {10: [3], 11: [4], 12: [5], 13: [6], 14: [7], 15: [8]}
    anywhere = copy_heads.copy_targets(torch.tensor([seq]), classes, bos_id=LID["<bos>"])
    assert anywhere[0, 14].nonzero().flatten().tolist() == [4, 7, 12]   # what the piece-level targets allow


def test_aligned_targets_need_the_same_name_in_the_same_document_and_two_letters():
    classes = copy_heads.name_token_classes(_Vocab(LETTERS))
    bos = LID["<bos>"]
    other_doc = _letters('<bos> Ġ Bergen <bos> " Bergen "')
    assert not copy_heads.aligned_copy_targets(torch.tensor([other_doc]), classes, bos).any()
    other_name = _letters('<bos> Ġ Berg " Bergen "')          # a prefix is not the same name
    assert not copy_heads.aligned_copy_targets(torch.tensor([other_name]), classes, bos).any()
    acronym = _letters('<bos> Ġ OK Ġ OK Ġ B Ġ B')              # capitals are names of one letter each
    assert not copy_heads.aligned_copy_targets(torch.tensor([acronym]), classes, bos).any()
    twice = _letters('<bos> Ġ The Ġ The Ġ The')
    tg = copy_heads.aligned_copy_targets(torch.tensor([twice]), classes, bos)
    assert tg[0, 9].nonzero().flatten().tolist() == [2, 6]     # "T" of the third: both earlier ones
    only = torch.zeros(1, len(twice), dtype=torch.bool)
    only[0, 12] = True                                           # just the third mention's last letter
    tg = copy_heads.aligned_copy_targets(torch.tensor([twice]), classes, bos, only=only)
    assert tg.any(-1).nonzero().tolist() == [[0, 11]]


def _tiny_model(seed: int = 0):
    hf = spec.hf_config(vocab_size=len(PIECES) + 50, bos_id=0, eos_id=1, max_len=64)
    hf.update(num_hidden_layers=3, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    return train.init_model(DeepseekConfig.from_hf(hf), seed)


def test_supervision_records_only_inside_its_context_and_trains_a_previous_token_head():
    torch.manual_seed(0)
    model = _tiny_model()
    classes = copy_heads.name_token_classes(_Vocab(PIECES + ["x"] * 50))
    sup = copy_heads.CopySupervision(model, classes, ID["<bos>"], prev_layer=0, copy_layers=(1, 2),
                                     mtp=True, value_weight=1.0)
    cls = type(model.model.layers[0].self_attn)
    plain = cls._attend_decompressed
    name = _ids("Ġ", "Ber", "gen", "?", '"', "Ber", "gen", '"')
    rows = torch.tensor([_ids("<bos>", "x") + name * 3 + _ids("x")] * 4)
    keep = torch.ones_like(rows, dtype=torch.bool)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        with sup.recording():
            assert cls._attend_decompressed is not plain
            main, mtp, _, _ = train.losses(model, rows, keep)
        assert cls._attend_decompressed is plain
        aux, parts = sup.loss(rows)
        assert set(parts) >= {"prev", "copy1", "copy2", "value", "mtp", "targets"} and parts["targets"] > 0
        first = first or dict(parts)
        opt.zero_grad()
        (main + aux).backward()
        opt.step()
    assert math.isfinite(aux.item())
    assert parts["prev"] < 0.5 * first["prev"], (first, parts)
    assert parts["copy1"] < first["copy1"] and parts["copy2"] < first["copy2"], (first, parts)


def test_value_fit_reads_the_name_piece_back():
    torch.manual_seed(0)
    model = _tiny_model()
    letters = "abcdefghijklmnopqrstuvwxy"
    vocab = PIECES + [f"Q{c}" for c in letters] + [f"q{c}" for c in letters]
    classes = copy_heads.name_token_classes(_Vocab(vocab))
    rows = torch.randint(len(PIECES), len(vocab), (24, 33))
    with torch.no_grad():           # a trained lm_head's scale (at init it cannot be confident)
        model.lm_head.weight.mul_(50)
    before = [model.model.layers[li].self_attn.o_proj.weight.clone() for li in (1, 2)]
    ce, _ = copy_heads.fit_copy_values(model, rows, classes, layers=(1, 2), scale=1.0, steps=300)
    vocab_ce = math.log(len(vocab))
    assert ce < 0.5 * vocab_ce, ce
    for li, old in zip((1, 2), before):
        w = model.model.layers[li].self_attn.o_proj.weight
        dv = model.model.layers[li].self_attn.v_dim
        assert not torch.equal(w[:, :dv], old[:, :dv]) and torch.equal(w[:, dv:], old[:, dv:])


def _head_writes(model, layers, latents):
    """{layer: what head HEAD writes [B, L, H] for each position's own latent}."""
    out = {}
    for li in layers:
        attn = model.model.layers[li].self_attn
        dn, dv = attn.nope_dim, attn.v_dim
        b = attn.kv_b_proj.weight.view(attn.num_heads, dn + dv, -1)[copy_heads.HEAD, dn:]
        o = attn.o_proj.weight[:, copy_heads.HEAD * dv:(copy_heads.HEAD + 1) * dv]
        out[li] = latents[li] @ b.T @ o.T
    return out


def test_value_fit_with_a_bos_writes_nothing_at_the_sink():
    """Resting copy heads sit on BOS; if their value there is not ~0 they add a residual-sized
    vector to every position of the model (that is what broke thinking in the first stage-3 runs)."""
    torch.manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxy"
    vocab = PIECES + [f"Q{c}" for c in letters] + [f"q{c}" for c in letters]
    classes = copy_heads.name_token_classes(_Vocab(vocab))
    rows = torch.randint(len(PIECES), len(vocab), (24, 33))
    rows[:, 0] = rows[:, 16] = ID["<bos>"]
    sizes = {}
    for bos_id in (None, ID["<bos>"]):
        model = _tiny_model()
        with torch.no_grad():
            model.lm_head.weight.mul_(50)
        with torch.no_grad():
            latents, _ = copy_heads._latents(model, rows[:, :-1], (1, 2))    # what the fit sees
        ce, at_rest = copy_heads.fit_copy_values(model, rows, classes, layers=(1, 2), scale=1.0, steps=300,
                                                 bos_id=bos_id)
        assert ce < 0.5 * math.log(len(vocab)), ce
        with torch.no_grad():
            w = sum(_head_writes(model, (1, 2), latents).values())
        at_bos = w[rows[:, :-1] == ID["<bos>"]].norm(dim=-1).median()
        at_name = w[copy_heads.name_positions(rows[:, :-1], classes)].norm(dim=-1).median()
        sizes[bos_id] = (at_bos / at_name).item()
        if bos_id is not None:
            assert abs(at_rest - sizes[bos_id]) < 0.02
    assert sizes[ID["<bos>"]] < 0.05 < 0.3 < sizes[None], sizes


def test_piece_names_cover_the_lowercase_pieces_and_avoid_evaluation_values():
    vocab = ["Ber", "Sal", "Tor", "Mon", "gen", "burg", "ago", "enc", "ia", "Florence", "x1", "Ġthe"]
    names = corpus.piece_names(_Vocab(vocab), n=200)
    assert len(set(names)) == len(names) >= 150 and names == corpus.piece_names(_Vocab(vocab), n=200)
    assert not any(v in n.lower() for n in names for v in corpus._EVAL_VALUES)   # no Bergen..., no Florence
    assert all(n[:3] in ("Ber", "Sal", "Tor", "Mon") for n in names)
    for piece in ("gen", "burg", "ago", "enc", "ia"):
        assert sum(piece in n[3:] for n in names) >= 30, piece
    assert len(corpus.piece_names(_Vocab(["Ab", "cd"]), n=50)) < 50     # ends when names run out


def test_extra_phrasings_never_train_a_held_out_phrasing():
    """The copy evaluation's phrasings must stay unseen: the widened training phrasings hold none
    of them, even with case, punctuation and filler words ("please", "now") set aside. (The
    original list's "What time is it in {c}?" is that close to the held-out "What time is it now
    in {c}?"; it predates these and stays.)"""
    held_out = corpus.HELDOUT_WEATHER_PHRASINGS + corpus.HELDOUT_TIME_PHRASINGS
    banned = {corpus._normal(h) for h in held_out}
    assert corpus._normal("What time is it now in {c}?") == corpus._normal("what time is it in {c}")
    try:
        corpus.use_extra_phrasings(composed=True, terse=True)
        trained = corpus.weather_phrasings("copy") + corpus.time_phrasings("copy")
        assert len(trained) > 2000 and set(corpus.TERSE_TIME_PHRASINGS) <= set(trained)
        extra = [p for p in trained if p not in corpus.COPY_WEATHER_PHRASINGS + corpus.COPY_TIME_PHRASINGS]
        assert len(extra) > 2000 and not [p for p in extra if corpus._normal(p) in banned]
        assert not set(held_out) & set(trained)
    finally:
        corpus.use_extra_phrasings()
    assert corpus.time_phrasings("copy") == corpus.COPY_TIME_PHRASINGS
    assert corpus.time_phrasings("train") == corpus.TIME_PHRASINGS


def test_wide_topics_widen_training_searches_and_never_touch_the_held_out_ones():
    """Stage 2b's search topics (corpus.wide_topics) must hold no evaluation value, reach the
    training searches only while switched on, and leave the evaluation prompts as they were."""
    import random
    wide = corpus.wide_topics()
    assert len(set(wide)) == corpus.WIDE_TOPIC_COUNT == len(wide)
    assert not [t for t in wide if any(v in t for v in corpus._EVAL_VALUES)]
    assert not set(wide) & {t.lower() for t in corpus.F.EVAL_TOPICS}

    def queries(split: str) -> set[str]:
        rng = random.Random(5)
        return {corpus.t_search(rng, split)[1][0][1]["query"] for _ in range(300)}

    before_eval = corpus.eval_prompts(7, n_chat=3, n_tool=20, n_think=3)
    assert queries("train") <= set(corpus.F.TRAIN_TOPICS)
    try:
        corpus.use_wide_topics(True)
        widened = queries("train")
        assert len(widened - set(corpus.F.TRAIN_TOPICS)) > 200 and widened <= set(corpus.F.TRAIN_TOPICS + wide)
        assert queries("eval") <= set(corpus.F.EVAL_TOPICS)
        assert corpus.eval_prompts(7, n_chat=3, n_tool=20, n_think=3) == before_eval
    finally:
        corpus.use_wide_topics(False)
    assert queries("train") <= set(corpus.F.TRAIN_TOPICS)


def test_sink_is_the_bos_that_opens_each_document():
    x = torch.tensor([_ids("x", "x", "<bos>", "x", "x", "<bos>", "x")])
    assert copy_heads.sink_positions(x, ID["<bos>"])[0].tolist() == [0, 0, 2, 2, 2, 5, 5]


def test_sink_term_trains_the_copy_heads_to_rest_where_nothing_is_copied():
    torch.manual_seed(0)
    model = _tiny_model()
    classes = copy_heads.name_token_classes(_Vocab(PIECES + ["x"] * 50))
    sup = copy_heads.CopySupervision(model, classes, ID["<bos>"], prev_layer=-1, copy_layers=(1,),
                                     mtp=True, value_weight=0.0, sink_weight=1.0)
    rows = torch.tensor([_ids("<bos>") + _ids("x", "in", "Ġthe", "?") * 4 + _ids("Ġ", "Ber", "gen", '"', "Ber", "gen")] * 2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        with sup.recording():
            train.losses(model, rows, torch.ones_like(rows, dtype=torch.bool))
        aux, parts = sup.loss(rows)
        first = first or dict(parts)
        opt.zero_grad()
        aux.backward()
        opt.step()
    assert {"sink1", "mtp_sink"} <= set(parts)
    assert parts["sink1"] < 0.3 * first["sink1"] and parts["mtp_sink"] < 0.3 * first["mtp_sink"], (first, parts)


def test_args_only_keeps_just_the_argument_value_targets():
    classes = copy_heads.name_token_classes(_Vocab(PIECES))
    # "The" repeats in the prose; "Ber gen" repeats in the argument value (weights above 1).
    seq = _ids("<bos>", "The", "in", "Ġ", "Ber", "gen", "?", "The", '"', "Ber", "gen", '"')
    rows = torch.tensor([seq])
    weights = torch.ones(rows.shape)
    weights[0, 9:11] = 6.0
    every = copy_heads.copy_targets(rows, classes, 0)
    only = copy_heads.copy_targets(rows, classes, 0, weights > 1.0)
    # query 6 ("?") -> next "The", an earlier "The" at 1: a target only without the restriction
    assert every[0, 6, 1] and not only[0, 6].any()
    assert only[0, 8, 4] and only[0, 9, 5]
    assert only.sum() == 2

