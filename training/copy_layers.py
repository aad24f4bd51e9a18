"""Stage 3 of the demo model (issue 18 item 8): copy layers appended to the frozen stage-2 model.

A tool call should copy the city its request names. Earlier attempts taught that inside the
stage-2 model (copy_heads.py, spec.py has the runs): trained whole, the model learns to copy
but its other skills drift (thinking fell to 0.33-0.73); frozen but for one head per layer,
no circuit forms, because MLA shares the rotary key and the kv latent across a layer's heads.
So this stage leaves the stage-2 layers as they are and appends decoder layers of the same
kind after them; the checkpoint stays a plain DeepSeek-V3, with more layers, that the daemon
and transformers run unchanged:

* one *previous-token* layer: heads 0-1 supervised to attend one token back, so each
  position carries its predecessor's identity (the stage-2 output holds a token's own
  identity well, a linear probe reads 96% of name pieces, but its predecessor's poorly, 72%);
* ``copy`` layers: heads 0-1 supervised to attend to an earlier occurrence of the
  argument-value piece to be written next (copy_heads.copy_targets), and to rest on the
  document's BOS everywhere else;
* the main head (``lm_head``) trains as well: read through the frozen head, what a copy head
  writes tells a piece from the others poorly (0.82 of name pieces at best through one
  layer's 64-wide latent, from a probe), and a head that trains gives the pieces directions of
  their own. The MTP layer keeps its stage-2 head, weights and all (untied).

Everything else is frozen. The loss is the cross-entropy of the tool-argument values, a
retention KL of the main logits (and of the MTP layer's, fed the new hidden states) to the
stage-2 model at every other position, the attention terms, and a readout term (what heads
0-1 of the copy layers would write at a name piece, read through the final norm and the head,
names that piece). The stage-2 output is computed once per row, so a step runs only the new
layers and the MTP layer.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from server.model.config import DeepseekConfig
from server.model.deepseek_v3 import DeepseekV3ForCausalLM

from . import copy_heads, train
from .spec import TrainSettings

COPY_HEADS = (0, 1)       # the heads of each new layer that are supervised


def extend(model: DeepseekV3ForCausalLM, hf_cfg: dict, n_new: int, seed: int) -> tuple[DeepseekV3ForCausalLM, dict]:
    """``model`` with ``n_new`` decoder layers appended after its own (the MTP layer moves up
    behind them): the new layers start nearly silent (output projection at 0.1 x its initial
    scale, MLP outputs zero and frozen), and the MTP head is a copy of ``lm_head`` of its own."""
    n = hf_cfg["num_hidden_layers"]
    hf2 = dict(hf_cfg, num_hidden_layers=n + n_new)
    new = train.init_model(DeepseekConfig.from_hf(hf2), seed)
    fresh = new.state_dict()
    state = {}
    for k, v in model.state_dict().items():
        mtp = k.startswith(f"model.layers.{n}.")
        state[k.replace(f"model.layers.{n}.", f"model.layers.{n + n_new}.", 1) if mtp else k] = v
    for k, v in fresh.items():
        if any(k.startswith(f"model.layers.{n + j}.") for j in range(n_new)):
            state[k] = v
    new.load_state_dict(state, strict=True)
    for j in range(new.num_mtp_layers):
        head = new.model.layers[n + n_new + j].shared_head
        head.head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        for layer in appended(new, n_new):
            layer.self_attn.o_proj.weight.mul_(0.1)
            for name, p in layer.mlp.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.zero_()
    return new, hf2


def appended(model: DeepseekV3ForCausalLM, n_new: int) -> list[torch.nn.Module]:
    n = model.config.num_hidden_layers
    return [model.model.layers[i] for i in range(n - n_new, n)]


def trainable(model: DeepseekV3ForCausalLM, n_new: int, mtp: bool = False,
              mlp: bool = False) -> list[torch.nn.Parameter]:
    """Freeze all but the new layers' attention and norms (with ``mlp``, their MLPs too), and
    ``lm_head`` (with ``mtp``, the MTP layer as well); return those."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in appended(model, n_new):
        for name, p in layer.named_parameters():
            mlp_weight = mlp and name.startswith("mlp") and not name.endswith("e_score_correction_bias")
            if name.startswith("self_attn") or "layernorm" in name or mlp_weight:
                p.requires_grad_(True)
    model.lm_head.weight.requires_grad_(True)
    if mtp:
        mtp_layers(model).requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def mtp_layers(model: DeepseekV3ForCausalLM) -> torch.nn.ModuleList:
    n = model.config.num_hidden_layers
    return torch.nn.ModuleList(model.model.layers[n:n + model.num_mtp_layers])


def chat_positions(x: torch.Tensor, bos_id: int, assistant_id: int) -> torch.Tensor:
    """[B, L] bool: positions of packed rows ``x`` inside a document that holds an assistant
    turn (a chat, not prose; documents start at BOS)."""
    doc = (x == bos_id).cumsum(1)
    n_docs = int(doc.max()) + 1
    has = torch.zeros(x.shape[0], n_docs, dtype=torch.long)
    has.scatter_reduce_(1, doc, (x == assistant_id).long(), reduce="amax")
    return has.gather(1, doc).bool()


@torch.no_grad()
def trunk_outputs(model: DeepseekV3ForCausalLM, rows: torch.Tensor, n_trunk: int) -> torch.Tensor:
    """The residual stream after the first ``n_trunk`` layers (before the final norm), [B, L, H]."""
    x_all = rows[:, :-1]
    cos, sin = model._cos_sin_full(x_all.shape[1], x_all.device)
    out = torch.empty(*x_all.shape, model.config.hidden_size)
    for b in range(0, len(x_all), 16):
        x = model.model.embed_tokens(x_all[b:b + 16])
        for i in range(n_trunk):
            x = model.model.layers[i].forward_full(x, cos, sin)
        out[b:b + 16] = x
    return out


def _layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One decoder layer as ``DecoderLayer.forward_full`` computes it, plus the attention's
    log-probabilities [B, nH, L, L] and what heads COPY_HEADS would write at each position
    if they attended to it alone [B, L, H]."""
    attn = layer.self_attn
    q_nope, q_pe, latent, k_pe = attn._project(layer.input_layernorm(x), cos, sin)
    k_nope, v = attn._expand(latent)
    length = latent.shape[1]
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, attn.num_heads, length, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) * attn.scale
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    logp = F.log_softmax(scores.masked_fill(~causal, float("-inf")), -1)
    x = x + attn.o_proj((logp.exp() @ v).transpose(1, 2).flatten(2))
    dv = v.shape[-1]
    writes = sum(v[:, h] @ attn.o_proj.weight[:, h * dv:(h + 1) * dv].T for h in COPY_HEADS)
    return x + layer.mlp(layer.post_attention_layernorm(x)), logp, writes


def _ce_on(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean CE over the ``mask`` positions; a zero that keeps the graph when there are none."""
    return F.cross_entropy(logits[mask], y[mask]) if bool(mask.any()) else logits.sum() * 0


def _attention_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean NLL of attending to any of ``targets`` [B, L, L], over the queries that have one."""
    sel = targets.any(-1)
    if not bool(sel.any()):
        return logp.sum() * 0
    return -torch.logsumexp(logp.masked_fill(~targets, float("-inf")), -1)[sel].mean()


def train_copy_layers(model: DeepseekV3ForCausalLM, rows: torch.Tensor, keep: torch.Tensor,
                      weights: torch.Tensor, trunk: torch.Tensor, classes, bos_id: int, assistant_id: int,
                      s: TrainSettings, log: Callable[[str], None] = print) -> list[dict]:
    """Stage 3's loop over packed rows (argument values are ``weights`` above 1) with the
    frozen stage-2 output ``trunk``; returns the loss history (every 20 steps)."""
    n_new = 1 + s.copy_append_layers
    params = trainable(model, n_new, mtp=s.copy_mtp_train, mlp=s.copy_train_mlp)
    layers = appended(model, n_new)
    mtp = mtp_layers(model)[0]
    mtp_params = {id(p) for p in mtp.parameters()} if s.copy_mtp_train else set()
    stage2_head = model.lm_head.weight.detach().clone()
    groups = [{"params": [p for p in params if id(p) not in mtp_params], "scale": 1.0}]
    if mtp_params:                     # the MTP layer is trained already: a gentler rate
        groups.append({"params": [p for p in params if id(p) in mtp_params], "scale": s.copy_mtp_lr / s.copy_lr})
    opt = torch.optim.AdamW(groups, lr=s.copy_lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(s.seed + 3)
    order, cursor = torch.randperm(len(rows), generator=g), 0
    cos, sin = model._cos_sin_full(rows.shape[1] - 1, rows.device)
    history: list[dict] = []
    sums: dict[str, float] = {}
    t0 = time.time()
    model.train()
    for step in range(s.copy_steps):
        if cursor + s.batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=g), 0
        idx = order[cursor:cursor + s.batch_size]
        cursor += s.batch_size
        lr = s.copy_lr * min(1.0, (step + 1) / s.copy_warmup_steps) * (
            s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * step / s.copy_steps)))
        for group in opt.param_groups:
            group["lr"] = lr * group["scale"]
        h, r, w, k = trunk[idx], rows[idx], weights[idx], keep[idx]
        y, args = r[:, 1:], train.argument_values(w[:, 1:]) & k[:, 1:]
        x, prev_logp, _ = _layer(layers[0], h, cos, sin)
        copy_logp, reads = [], 0
        for layer in layers[1:]:
            x, logp, writes = _layer(layer, x, cos, sin)
            copy_logp.append(logp)
            reads = reads + writes
        logits = model.compute_logits(model.model.norm(x))
        with torch.no_grad():
            ref = F.log_softmax((model.model.norm(h) @ stage2_head.T).float(), -1)
        x_mtp, mtp_logp, _ = _layer(mtp, mtp.combine(model.model.embed_tokens(r[:, 1:]), model.model.norm(x)), cos, sin)
        mtp_lp = F.log_softmax(model.mtp_compute_logits(x_mtp), -1)
        chat = chat_positions(r[:, :-1], bos_id, assistant_id) & k[:, 1:] & ~args
        parts = {
            "args": _ce_on(logits, y, args),
            "chat": _ce_on(logits, y, chat),
            "retain": F.kl_div(F.log_softmax(logits[~args], -1), ref[~args], log_target=True, reduction="batchmean"),
            "prev": -torch.diagonal(prev_logp[:, list(COPY_HEADS)], offset=-1, dim1=-2, dim2=-1).mean(),
        }
        if s.copy_mtp_train:
            # Self-distillation (train.losses): the MTP logits at i against the new main model's
            # at i+1, which predict the same token; so the drafts follow the copying main model.
            sel = k[:, 2:]
            teacher = F.log_softmax(logits[:, 1:][sel].detach(), -1)
            parts["mtp_distill"] = F.kl_div(mtp_lp[:, :-1][sel], teacher, log_target=True, reduction="batchmean")
            # Head 0 of the MTP layer attends where the main copy heads do (an earlier x[j] equal
            # to its input token x[i+1]); the MTP stream there holds x[j+1], the piece after next.
            shifted = F.pad(copy_heads.copy_targets(r[:, 1:], classes, bos_id, train.argument_values(w[:, 1:])),
                            (0, 1, 0, 1))
            parts["mtp_copy"] = _attention_nll(mtp_logp[:, 0], shifted)
        else:
            with torch.no_grad():
                mtp_ref = F.log_softmax(model.mtp_compute_logits(model.mtp_forward_full(r[:, 1:], model.model.norm(h))), -1)
            parts["mtp_retain"] = F.kl_div(mtp_lp.flatten(0, 1), mtp_ref.flatten(0, 1), log_target=True,
                                           reduction="batchmean")
        targets = copy_heads.copy_targets(r, classes, bos_id, None if s.copy_all_names else train.argument_values(w))
        sel = targets.any(-1)
        copy_term = sink = h.new_zeros(())
        if bool(sel.any()):
            for logp in copy_logp:
                for head in COPY_HEADS:
                    lp = logp[:, head]
                    copy_term = copy_term + _attention_nll(lp, targets)
                    sink = sink + copy_heads._sink_term(lp, r[:, :-1], sel, bos_id)
        n_heads = len(copy_logp) * len(COPY_HEADS)
        parts["copy"], parts["sink"] = copy_term / n_heads, sink / n_heads
        names = copy_heads.name_positions(r[:, :-1], classes)
        parts["readout"] = F.cross_entropy(model.compute_logits(model.model.norm(reads[names])), r[:, :-1][names])
        loss = (parts["args"] + s.copy_chat_ce * parts["chat"] + s.copy_retain * parts["retain"]
                + s.copy_supervision * (parts["prev"] + parts["copy"] + s.copy_sink_weight * parts["sink"])
                + s.copy_value_weight * parts["readout"])
        if s.copy_mtp_train:
            loss = loss + s.copy_mtp_distill * parts["mtp_distill"] + s.copy_supervision * parts["mtp_copy"]
        else:
            loss = loss + s.copy_mtp_retain * parts["mtp_retain"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        for name, v in parts.items():
            sums[name] = sums.get(name, 0.0) + v.item()
        if (step + 1) % 20 == 0 or step == s.copy_steps - 1:
            n = 20 if (step + 1) % 20 == 0 else (step + 1) % 20
            rec = {"step": step + 1, "lr": lr, "elapsed_s": time.time() - t0, **{k: v / n for k, v in sums.items()}}
            history.append(rec)
            log(f"[copy] step {step + 1}/{s.copy_steps} " + " ".join(f"{k} {v / n:.3f}" for k, v in sums.items())
                + f" lr {lr:.2e} {rec['elapsed_s']:.0f}s")
            sums = {}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return history

