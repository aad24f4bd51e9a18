"""Corpus -> token rows -> joint main + MTP training of server.model's DeepseekV3ForCausalLM.

The model class is the daemon's own (server.model.deepseek_v3), trained through its
cache-free ``forward_full`` / ``mtp_forward_full`` path, so the weights we ship are exactly
what the serving code computes with.

Loss = CE(main logits at i, token i+1) + mtp_weight * CE(MTP logits at i, token i+2), where
the MTP layer sees (final-norm hidden h_i, embedding of token i+1), as in DeepSeek-V3.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from server.model.config import DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM

from server.text import special_tokens as st

from . import corpus, render
from .spec import TrainSettings

IGNORE = -100


# --------------------------------------------------------------------------------------
# Data

def drill_count(s: TrainSettings) -> int:
    """How many copying drills build_texts puts at the end of the prose (stage 1's documents)."""
    return s.pretrain_drills if s.copy_pretrain else 0


def build_texts(s: TrainSettings) -> tuple[list[str], list[str]]:
    """(chat texts, prose texts), deterministic in ``s.corpus_seed``; the prose ends with the
    drill_count(s) copying drills."""
    rng = random.Random(s.corpus_seed)
    corpus.use_extra_phrasings(composed=s.copy_pretrain and s.composed_phrasings,
                               terse=s.copy_pretrain and s.terse_phrasings)
    corpus.use_wide_topics(s.wide_topics)
    make = corpus.make_copy_chat if s.copy_pretrain else (lambda r: corpus.make_chat(r, "train"))
    chats = [render.render_chat(make(rng)) for _ in range(s.num_chats)]
    prose = [render.prose_text(d) for d in corpus.prose_documents()] * s.prose_repeats
    if drill_count(s):
        drng = random.Random(s.drill_seed)
        prose += [render.prose_text(corpus.copy_drill(drng)) for _ in range(drill_count(s))]
    return chats, prose


def assistant_mask(ids: list[int], assistant: int, outputs_end: int, think: int, newline: int,
                   eos: int) -> list[bool]:
    """True for tokens the assistant writes (trained in the SFT stage), False for the context.

    A turn starts after ``<｜Assistant｜>`` (or after ``<｜tool▁outputs▁end｜>``, where DeepSeek
    answers without a marker) and runs to its ``<｜end▁of▁sentence｜>`` inclusive. A ``<think>``
    plus newline right after the marker belongs to the prompt (the template adds it).
    """
    mask = [False] * len(ids)
    on = after_marker = after_think = False
    for i, t in enumerate(ids):
        if not on:
            if t in (assistant, outputs_end):
                on, after_marker = True, True
            continue
        if after_marker:
            after_marker = False
            if t == think:
                after_think = True
                continue
        if after_think:
            after_think = False
            if t == newline:
                continue
        mask[i] = True
        if t == eos:
            on = False
    return mask


def assistant_masker(tok) -> Callable[[list[int]], list[bool]]:
    """assistant_mask with ``tok``'s ids of the chat markers filled in."""
    ids = [tok.token_to_id(t) for t in (st.ASSISTANT, st.TOOL_OUTPUTS_END, st.THINK_START, "\u010a", st.EOS)]
    return lambda doc: assistant_mask(doc, *ids)


def argument_value_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the string argument values of the tool calls in ``text`` (quotes excluded)."""
    spans = []
    for block in re.finditer(re.escape(st.TOOL_CALL_BEGIN) + r".*?" + re.escape(st.TOOL_CALL_END), text, re.S):
        for v in re.finditer(r'": "((?:[^"\\]|\\.)*)"', block.group(0)):
            spans.append((block.start() + v.start(1), block.start() + v.end(1)))
    return spans


def encode_mixed(text: str, split_tok, base_tok, mask_of: Callable[[list[int]], list[bool]],
                 arg_weight: float) -> tuple[list[int], list[bool], list[float]]:
    """(ids, assistant mask, weights) of ``text`` with what the assistant writes encoded by
    ``base_tok`` but for its tool-argument values, and the rest (the context, the values) by
    ``split_tok`` (the name-splitting tokenizer).

    The stage-2 model was trained on ``base_tok``'s pieces (``ĠIreland``); trained on the split
    ones (``Ġ`` + ``Ireland``) in its own text, it learns to write a bare space where a name is
    due, a state its frozen layers never saw (spec.py: the thinking loops). Only what a call
    copies must be in the prompt's pieces. Values (and the token after each, which closes it)
    are weighted ``arg_weight``."""
    enc = split_tok.encode(text)
    mask = mask_of(enc.ids)
    runs: list[list[int]] = []                 # assistant-written character runs
    for k, on in enumerate(mask):
        a, b = enc.offsets[k]
        if on and runs and runs[-1][1] == a:
            runs[-1][1] = b
        elif on:
            runs.append([a, b])
    values = argument_value_spans(text)
    cuts: list[tuple[int, int, str]] = []      # (start, end, kind): context / assistant / value
    pos = 0
    for a, b in runs:
        if pos < a:
            cuts.append((pos, a, "context"))
        inner = sorted((max(a, va), min(b, vb)) for va, vb in values if va < b and vb > a)
        for va, vb in inner:
            if a < va:
                cuts.append((a, va, "assistant"))
            if va < vb:
                cuts.append((va, vb, "value"))
            a = vb
        if a < b:
            cuts.append((a, b, "assistant"))
        pos = b
    if pos < len(text):
        cuts.append((pos, len(text), "context"))
    ids: list[int] = []
    out_mask: list[bool] = []
    weights: list[float] = []
    closing = False
    for a, b, kind in cuts:
        piece = (base_tok if kind == "assistant" else split_tok).encode(text[a:b]).ids
        ids += piece
        out_mask += [kind != "context"] * len(piece)
        w = [arg_weight if kind == "value" else 1.0] * len(piece)
        if closing and piece:
            w[0] = arg_weight
        closing = kind == "value"
        weights += w
    return ids, out_mask, weights


def copy_value_weights(text: str, offsets: list[tuple[int, int]], weight: float) -> list[float]:
    """Per-token loss weights: ``weight`` on the string argument values of the tool calls in
    ``text`` (and on the token closing each value), 1 elsewhere.

    These are the tokens a call must copy from the prompt (a city, a search query); the copy
    stage weights them up so that copying, not a memorised favourite, is what lowers the loss.
    """
    spans = [(a, b + 1) for a, b in argument_value_spans(text)]     # + the closing quote
    out = [1.0] * len(offsets)
    for k, (a, b) in enumerate(offsets):
        if b > a and any(a < e and b > s for s, e in spans):
            out[k] = weight
    return out


def pack_rows(docs: list[list[int]], seq_len: int, pad_id: int, seed: int,
              masks: list[list[bool]] | None = None, weights: list[list[float]] | None = None):
    """Pack token documents into rows of ``seq_len + 1`` tokens (inputs plus one shifted target).

    Documents longer than a row are cut into row-sized pieces. Rows are filled first-fit in a
    seeded random order; the tail of a row is ``pad_id``. Returns (rows, trainable) where
    ``trainable`` marks tokens that count as targets (all real tokens when ``masks`` is None);
    with per-token ``weights`` it returns (rows, trainable, row weights) (0 on padding).
    """
    width = seq_len + 1
    pieces: list[tuple[list[int], list[bool], list[float]]] = []
    for k, d in enumerate(docs):
        m = masks[k] if masks is not None else [True] * len(d)
        w = weights[k] if weights is not None else [1.0] * len(d)
        for i in range(0, len(d), width):
            pieces.append((d[i:i + width], m[i:i + width], w[i:i + width]))
    random.Random(seed).shuffle(pieces)
    rows: list[tuple[list[int], list[bool], list[float]]] = []
    open_rows: list[tuple[list[int], list[bool], list[float]]] = []   # rows with room left (first-fit)
    for p, m, w in pieces:
        for r in open_rows:
            if len(r[0]) + len(p) <= width:
                r[0].extend(p)
                r[1].extend(m)
                r[2].extend(w)
                break
        else:
            r = (list(p), list(m), list(w))
            rows.append(r)
            open_rows.append(r)
        open_rows = [r for r in open_rows if width - len(r[0]) >= 24][-16:]
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    keep = torch.zeros((len(rows), width), dtype=torch.bool)
    wts = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m, w) in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
        keep[i, :len(m)] = torch.tensor(m)
        wts[i, :len(w)] = torch.tensor(w)
    if weights is not None:
        return out, keep, wts
    return out, keep


# --------------------------------------------------------------------------------------
# Model

def init_model(cfg: DeepseekConfig, seed: int) -> DeepseekV3ForCausalLM:
    """Fresh model: N(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers), unit norms.

    The MTP layer shares the main embedding (it has none of its own) and its shared_head.head
    is tied to lm_head during training, as DeepSeek-V3 shares them.
    """
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    depth = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("e_score_correction_bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = 0.02 / math.sqrt(2 * depth)
                p.copy_(torch.randn(p.shape, generator=g) * std)
    for j in range(cfg.num_nextn_predict_layers):
        model.model.layers[cfg.num_hidden_layers + j].shared_head.head.weight = model.lm_head.weight
    return model


def argument_values(weights: torch.Tensor) -> torch.Tensor:
    """The tokens copy_value_weights weighted up: the tool-argument values (and their closing quote)."""
    return weights > 1.0


class Losses(NamedTuple):
    main: torch.Tensor        # CE of the main head
    mtp: torch.Tensor         # CE of the MTP head
    kl: torch.Tensor          # KL(main || MTP), the MTP self-distillation term
    retain: torch.Tensor      # KL(teacher || main) on the targets that are not argument values


def losses(model: DeepseekV3ForCausalLM, rows: torch.Tensor, keep: torch.Tensor,
           distill: bool = False, weights: torch.Tensor | None = None,
           teacher: DeepseekV3ForCausalLM | None = None) -> Losses:
    """(main CE, MTP CE, MTP distillation KL, retention KL) on packed rows [B, L+1]; only ``keep``
    tokens are targets.

    The distillation term is KL(main || MTP) at each MTP position i, against the main model's
    own (detached) distribution at position i+1, which predicts the same token i+2. Acceptance
    is agreement with the main model's choice, not with the corpus, so this is the signal that
    raises it (self-distillation, as EAGLE and Medusa-2 train their drafters); it is 0 unless
    ``distill``. With ``weights`` [B, L+1] the two CEs are weighted means over the targets
    (token j's CE counts ``weights[:, j]`` times); the KL stays a plain mean.

    With a frozen ``teacher`` (the model this stage started from) the retention term is
    KL(teacher || main) on every target whose weight is not above 1, i.e. everywhere except the
    tool-argument values the stage is there to change: a stage that teaches one skill keeps the
    others where they were instead of relearning them from a narrower corpus (0 without one).
    """
    x = rows[:, :-1]
    y1 = rows[:, 1:].clone()
    y1[~keep[:, 1:]] = IGNORE
    hidden = model.forward_full(x)
    logits = model.compute_logits(hidden)
    if weights is None:
        main = F.cross_entropy(logits.flatten(0, 1), y1.flatten(), ignore_index=IGNORE)
    else:
        w1 = weights[:, 1:] * keep[:, 1:]
        ce1 = F.cross_entropy(logits.flatten(0, 1), y1.flatten(), ignore_index=IGNORE, reduction="none")
        main = (ce1 * w1.flatten()).sum() / w1.sum().clamp_min(1e-6)
    # MTP at position i: (h_i, token i+1) -> token i+2.  next_ids[:, i] = token i+1 = y1 source.
    next_ids = rows[:, 1:]
    h_mtp = model.mtp_forward_full(next_ids, hidden)
    mlogits = model.mtp_compute_logits(h_mtp[:, :-1])
    y2 = y1[:, 1:]
    if weights is None:
        mtp = F.cross_entropy(mlogits.flatten(0, 1), y2.flatten(), ignore_index=IGNORE)
    else:
        w2 = w1[:, 1:]
        ce2 = F.cross_entropy(mlogits.flatten(0, 1), y2.flatten(), ignore_index=IGNORE, reduction="none")
        mtp = (ce2 * w2.flatten()).sum() / w2.sum().clamp_min(1e-6)
    kl = mtp.new_zeros(())
    if distill:
        sel = y2 != IGNORE
        teacher_lp = F.log_softmax(logits[:, 1:][sel].detach(), dim=-1)
        student = F.log_softmax(mlogits[sel], dim=-1)
        kl = F.kl_div(student, teacher_lp, log_target=True, reduction="batchmean")
    retain = mtp.new_zeros(())
    if teacher is not None:
        sel = keep[:, 1:] if weights is None else keep[:, 1:] & ~argument_values(weights[:, 1:])
        if bool(sel.any()):
            with torch.no_grad():
                ref = F.log_softmax(teacher.compute_logits(teacher.forward_full(x))[sel], dim=-1)
            retain = F.kl_div(F.log_softmax(logits[sel], dim=-1), ref, log_target=True, reduction="batchmean")
    return Losses(main, mtp, kl, retain)


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    t = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(model: DeepseekV3ForCausalLM, rows: torch.Tensor, keep: torch.Tensor, s: TrainSettings,
          log: Callable[[str], None] = print, weights: torch.Tensor | None = None,
          supervision=None, supervision_weight: float = 0.0,
          teacher: DeepseekV3ForCausalLM | None = None, retain_weight: float = 0.0) -> list[dict]:
    """AdamW + warmup/cosine; returns the loss history (every 20 steps).

    With ``supervision`` (a copy_heads.CopySupervision) its loss on each batch is added at
    ``supervision_weight``, and its parts are logged; with a frozen ``teacher``, the retention
    KL (see losses) at ``retain_weight``.
    """
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(s.seed + 1)
    order = torch.randperm(len(rows), generator=g)
    cursor = 0
    history: list[dict] = []
    t0 = time.time()
    tag = f"[{s.stage}] " if s.stage else ""
    acc_main = acc_mtp = acc_kl = acc_retain = 0.0
    acc_aux: dict[str, float] = {}
    model.train()
    for step in range(s.steps):
        if cursor + s.batch_size > len(order):
            order = torch.randperm(len(rows), generator=g)
            cursor = 0
        idx = order[cursor:cursor + s.batch_size]
        batch, batch_keep = rows[idx], keep[idx]
        cursor += s.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        with supervision.recording() if supervision is not None else contextlib.nullcontext():
            batch_w = None if weights is None else weights[idx]
            main, mtp, kl, retain = losses(model, batch, batch_keep, distill=s.mtp_distill > 0, weights=batch_w,
                                           teacher=teacher if retain_weight else None)
        loss = main + s.mtp_weight * mtp + s.mtp_distill * kl + retain_weight * retain
        if supervision is not None:
            aux, parts = supervision.loss(batch, batch_w)
            loss = loss + supervision_weight * aux
            for k, v in parts.items():
                acc_aux[k] = acc_aux.get(k, 0.0) + v
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        acc_main += main.item()
        acc_mtp += mtp.item()
        acc_kl += kl.item()
        acc_retain += retain.item()
        if (step + 1) % 20 == 0 or step == s.steps - 1:
            n = 20 if (step + 1) % 20 == 0 else (step + 1) % 20
            rec = {"step": step + 1, "main": acc_main / n, "mtp": acc_mtp / n, "kl": acc_kl / n, "lr": lr_at(step, s),
                   "elapsed_s": time.time() - t0}
            if teacher is not None and retain_weight:
                rec["retain"] = acc_retain / n
            if acc_aux:
                rec["supervision"] = {k: round(v / n, 4) for k, v in acc_aux.items()}
            history.append(rec)
            eta = (time.time() - t0) / (step + 1) * (s.steps - step - 1)
            log(f"{tag}step {step + 1}/{s.steps} main {rec['main']:.3f} mtp {rec['mtp']:.3f} kl {rec['kl']:.3f} "
                f"lr {rec['lr']:.2e} {rec['elapsed_s']:.0f}s eta {eta:.0f}s"
                + (f" retain {rec['retain']:.3f}" if "retain" in rec else "")
                + "".join(f" {k} {v:.3f}" for k, v in rec.get("supervision", {}).items() if k != "targets"))
            acc_main = acc_mtp = acc_kl = acc_retain = 0.0
            acc_aux = {}
    model.eval()
    return history
