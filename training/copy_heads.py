"""Copy heads for stage 3: attention supervision and a fitted value path (issue 18 item 8).

A model copies a name from the prompt with two circuits: a previous-token head, and copy
heads in later layers that attend to an earlier occurrence of the token to write and carry
its identity to the output. Trained on the LM loss alone the demo model grew neither in
thousands of steps (spec.py lists the runs): its attention stayed near uniform. So stage 3
tells one head per layer where to look, and starts those heads' value/output path from a
least-squares fit instead of from what they did before:

* ``copy_targets``: for each position whose next token continues a name (a capitalised piece
  and the lowercase pieces glued to it), the earlier positions of the same document that hold
  that very token. Any of them is a correct source, so the loss is -log of the attention mass
  on the set (the head learns by itself how to find one: previous-token matching).
* ``CopySupervision``: records head 0's attention in the chosen layers (and in the MTP layer,
  whose targets are shifted by one: its position i holds token i+1 and predicts i+2) during the
  training forward, and turns it into that loss, plus the cross-entropy of the copy heads'
  summed output read through the final norm and ``lm_head`` (so their value path carries
  the token's identity, not something else).
* ``fit_copy_values``: fits head 0's value and output projections in those layers jointly so
  that the kv latent at a name token, sent through them, reads back as that token; scaled to
  the residual stream's size, and blind to the BOS latent, so that heads resting on BOS write
  nothing. Without it the copy heads attend correctly within 200 steps but write made-up names
  (the identity has to be learnt through a 32-wide value path).

Stage 3 is off by default: with these heads the model copies about half of the held-out
cities, but its thinking breaks (spec.py has the runs). The model class is untouched: these
wrap ``MLA._attend_decompressed`` only while training (a context manager), so the shipped
weights run on the daemon's plain code.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from server.model.deepseek_v3 import DeepseekV3ForCausalLM

from . import train

HEAD = 0          # the head of each supervised layer that becomes the copy / previous-token head


def name_token_classes(tok) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, continuations) [V] bool: ASCII-letter pieces that begin with a capital, and
    pieces of lowercase ASCII letters that may continue a name. ASCII, because byte-level BPE
    writes a space as ``Ġ``, which Python counts as a capital letter."""
    vocab = tok.get_vocab_size()
    pieces = [tok.id_to_token(i) or "" for i in range(vocab)]
    starts = torch.tensor([bool(p) and p.isascii() and p.isalpha() and p[0].isupper() for p in pieces])
    cont = torch.tensor([bool(p) and p.isascii() and p.isalpha() and p.islower() for p in pieces])
    return starts, cont


def name_positions(x: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[B, L] bool: tokens inside a name (a start piece, then continuation pieces)."""
    starts, cont = classes[0][x], classes[1][x]
    inside = torch.zeros_like(starts)
    inside[:, 0] = starts[:, 0]
    for i in range(1, x.shape[1]):
        inside[:, i] = starts[:, i] | (cont[:, i] & inside[:, i - 1])
    return inside


def copy_targets(rows: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], bos_id: int,
                 only: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L, L] bool for packed rows [B, L+1]: at query i, the positions j < i of the same
    document (documents start at BOS) with x[j] == x[i+1], where x[i+1] is inside a name and
    so is x[j]. With ``only`` [B, L+1] bool, just the queries whose x[i+1] is marked there."""
    x, y = rows[:, :-1], rows[:, 1:]
    length = x.shape[1]
    inside = name_positions(rows, classes)
    next_inside = inside[:, 1:] if only is None else inside[:, 1:] & only[:, 1:]
    doc = (x == bos_id).cumsum(1)
    earlier = torch.ones(length, length, dtype=torch.bool).tril(-1)
    return ((x[:, None, :] == y[:, :, None]) & (doc[:, :, None] == doc[:, None, :]) & earlier
            & next_inside[:, :, None] & inside[:, None, :-1])


def aligned_copy_targets(rows: torch.Tensor, classes: tuple[torch.Tensor, torch.Tensor], bos_id: int,
                         only: torch.Tensor | None = None, min_len: int = 2) -> torch.Tensor:
    """[B, L, L] bool for packed rows [B, L+1]: at query i, where x[i+1] is letter k of a name
    (a start piece and the continuation pieces glued to it, at least ``min_len`` pieces) that
    the same document named before, the positions of letter k in each of those earlier mentions.

    copy_targets accepts any earlier position holding the token to write, which pins the
    source down when names are a few rare pieces; spelt one letter a piece (render.SPELL_NAMES)
    every "e" of the prompt would do, so the target is the letter in the same place of the same
    name. With ``only`` [B, L+1] bool, just the queries whose x[i+1] is marked there."""
    length = rows.shape[1] - 1
    inside = name_positions(rows, classes).tolist()
    starts = classes[0][rows].tolist()
    out = torch.zeros(rows.shape[0], length, length, dtype=torch.bool)
    marked = None if only is None else only.tolist()
    for b, ids in enumerate(rows.tolist()):
        seen: dict[tuple[int, ...], list[int]] = {}
        p = 0
        while p < len(ids):
            if ids[p] == bos_id:
                seen = {}
            if not (starts[b][p] and inside[b][p]):
                p += 1
                continue
            e = p + 1
            while e < len(ids) and inside[b][e] and not starts[b][e]:
                e += 1
            name = tuple(ids[p:e])
            if len(name) >= min_len:
                for s0 in seen.get(name, ()):
                    for k in range(e - p):
                        q = p + k - 1
                        if 0 <= q < length and s0 + k < q and (marked is None or marked[b][p + k]):
                            out[b, q, s0 + k] = True
                seen.setdefault(name, []).append(p)
            p = e
    return out


def sink_positions(x: torch.Tensor, bos_id: int) -> torch.Tensor:
    """[B, L] the position of the BOS that opens each position's document (0 if the row starts
    inside one): where a copy head rests when there is nothing to copy."""
    pos = torch.arange(x.shape[1]).expand_as(x)
    return torch.where(x == bos_id, pos, torch.zeros_like(pos)).cummax(1).values


def _sink_term(logp: torch.Tensor, x: torch.Tensor, copying: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Mean NLL of attending to the document's BOS at the positions that copy nothing."""
    sink = sink_positions(x, bos_id)[..., None]
    rest = ~copying
    return -logp.gather(2, sink)[..., 0][rest].mean() if bool(rest.any()) else logp.new_zeros(())


@contextlib.contextmanager
def attention_inputs(model: DeepseekV3ForCausalLM, on_call) -> Iterator[None]:
    """Calls ``on_call(layer_index, attn, q_nope, q_pe, latent, k_pe)`` on every attention of
    ``model.forward_full`` / ``mtp_forward_full`` inside the block; the plain method after."""
    cls = type(model.model.layers[0].self_attn)
    plain = cls._attend_decompressed
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(model.model.layers)}

    def attend(attn, q_nope, q_pe, latent, k_pe, mask=None, is_causal=False):
        on_call(layer_of.get(id(attn), -1), attn, q_nope, q_pe, latent, k_pe)
        return plain(attn, q_nope, q_pe, latent, k_pe, mask, is_causal)

    cls._attend_decompressed = attend
    try:
        yield
    finally:
        cls._attend_decompressed = plain


def _head_scores(attn, q_nope, q_pe, latent, k_pe) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal log-attention [B, L, S], value rows [B, S, dv]) of head ``HEAD``."""
    k_nope, v = attn._expand(latent)
    q = torch.cat([q_nope[:, :, HEAD], q_pe[:, :, HEAD]], -1)
    k = torch.cat([k_nope[:, HEAD], k_pe], -1)
    scores = (q @ k.transpose(1, 2)) * attn.scale
    n = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.log_softmax(-1), v[:, HEAD]


class CopySupervision:
    """The stage-3 auxiliary loss; use as ``with sup.recording(): forward ...; sup.loss(rows)``."""

    def __init__(self, model: DeepseekV3ForCausalLM, classes, bos_id: int, prev_layer: int,
                 copy_layers: tuple[int, ...], mtp: bool, value_weight: float, sink_weight: float = 0.0,
                 args_only: bool = False, aligned: bool = False) -> None:
        self.model, self.classes, self.bos_id = model, classes, bos_id
        self.targets = aligned_copy_targets if aligned else copy_targets
        self.prev_layer, self.copy_layers = prev_layer, tuple(copy_layers)
        self.mtp_layer = model.config.num_hidden_layers if mtp else None
        self.value_weight = value_weight
        self.sink_weight = sink_weight
        self.args_only = args_only
        self._logp: dict[int, torch.Tensor] = {}
        self._share: dict[int, torch.Tensor] = {}

    def _watched(self, li: int) -> bool:
        return li >= 0 and (li == self.prev_layer or li in self.copy_layers or li == self.mtp_layer)

    def _record(self, li: int, attn, q_nope, q_pe, latent, k_pe) -> None:
        if not self._watched(li):
            return
        logp, v = _head_scores(attn, q_nope, q_pe, latent, k_pe)
        self._logp[li] = logp
        if li in self.copy_layers and self.value_weight:
            dv = v.shape[-1]
            self._share[li] = (logp.exp() @ v) @ attn.o_proj.weight[:, HEAD * dv:(HEAD + 1) * dv].T

    def recording(self):
        """Context manager: the forward passes inside it record what ``loss`` needs."""
        self._logp.clear()
        self._share.clear()
        return attention_inputs(self.model, self._record)

    def loss(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum of: previous-token NLL, copy-target NLL per copy layer (and the MTP layer),
        ``value_weight`` x the copy heads' readout CE, and ``sink_weight`` x the NLL of resting on
        the document's BOS wherever there is nothing to copy (without it the copy heads fire
        everywhere and the model loops: "w-n-n-n-n", "Brazil Brazil Brazil"). Parts are logged
        per term. With ``args_only`` only the tool-argument values (``weights`` above 1, see
        train.copy_value_weights) are copy targets, and the heads rest everywhere else: copying
        every repeated capitalised word ("The", "So") makes a generic induction circuit that
        loops in prose."""
        only = None
        if self.args_only:
            if weights is None:
                raise ValueError("args_only copy supervision needs the rows' argument weights")
            only = train.argument_values(weights)
        total = rows.new_zeros((), dtype=torch.float32)
        parts: dict[str, float] = {}
        if self.prev_layer >= 0:
            lp = self._logp[self.prev_layer][:, 1:]
            idx = torch.arange(lp.shape[1]).view(1, -1, 1).expand(lp.shape[0], -1, 1)
            term = -lp.gather(2, idx).mean()
            parts["prev"] = term.item()
            total = total + term
        targets = self.targets(rows, self.classes, self.bos_id, only)
        sel = targets.any(-1)
        parts["targets"] = float(sel.sum())
        if not bool(sel.any()):
            return total, parts
        for li in self.copy_layers:
            term = -torch.logsumexp(self._logp[li].masked_fill(~targets, float("-inf")), -1)[sel].mean()
            parts[f"copy{li}"] = term.item()
            total = total + term
            if self.sink_weight:
                rest = _sink_term(self._logp[li], rows[:, :-1], sel, self.bos_id)
                parts[f"sink{li}"] = rest.item()
                total = total + self.sink_weight * rest
        if self.value_weight and self._share:
            share = sum(self._share[li] for li in self.copy_layers)[sel]
            logits = self.model.lm_head(self.model.model.norm(share))
            term = F.cross_entropy(logits, rows[:, 1:][sel])
            parts["value"] = term.item()
            total = total + self.value_weight * term
        if self.mtp_layer is not None:
            lp = self._logp[self.mtp_layer]                 # position i holds token i+1, predicts token i+2
            shifted = self.targets(rows[:, 1:], self.classes, self.bos_id, None if only is None else only[:, 1:])
            pad = lp.shape[1] - shifted.shape[1]
            shifted = F.pad(shifted, (0, pad, 0, pad))
            msel = shifted.any(-1)
            if bool(msel.any()):
                term = -torch.logsumexp(lp.masked_fill(~shifted, float("-inf")), -1)[msel].mean()
                parts["mtp"] = term.item()
                total = total + term
            if self.sink_weight:
                rest = _sink_term(lp, rows[:, 1:], msel, self.bos_id)
                parts["mtp_sink"] = rest.item()
                total = total + self.sink_weight * rest
        return total, parts


@torch.no_grad()
def _latents(model: DeepseekV3ForCausalLM, x: torch.Tensor, layers: tuple[int, ...]):
    """({layer: kv latent [B, L, kvr]}, final hidden [B, L, H]) of ``model`` on rows ``x``."""
    out: dict[int, list[torch.Tensor]] = {li: [] for li in layers}

    def keep(li, _attn, _q_nope, _q_pe, latent, _k_pe):
        if li in out:
            out[li].append(latent)

    with attention_inputs(model, keep):
        hidden = [model.forward_full(x[b:b + 16]) for b in range(0, len(x), 16)]
    return {li: torch.cat(v) for li, v in out.items()}, torch.cat(hidden)


BOS_RANK = 3      # directions of the BOS latent the copy heads' value map ignores


def _without_directions(samples: torch.Tensor, rank: int) -> torch.Tensor:
    """[d, d] projection that removes the top ``rank`` directions of ``samples`` [n, d]
    (uncentred, so the mean direction goes first); the identity without samples."""
    d = samples.shape[-1]
    if len(samples) == 0:
        return torch.eye(d)
    top = torch.linalg.svd(samples, full_matrices=False).Vh[:rank]
    return torch.eye(d) - top.T @ top


def fit_copy_values(model: DeepseekV3ForCausalLM, rows: torch.Tensor, classes, layers: tuple[int, ...],
                    scale: float, steps: int = 800, seed: int = 0, bos_id: int | None = None,
                    silence: float = 0.0) -> tuple[float, float]:
    """Overwrite head ``HEAD``'s value rows (kv_b_proj) and output columns (o_proj) in ``layers``
    with a joint fit: sum over layers of o_l(v_l(latent_l at a name token)), read through the
    final norm and lm_head, predicts that token. The product is scaled to ``scale`` x the
    median norm of the final hidden state.

    With ``bos_id`` the heads write nothing where they rest, on the document's BOS: the value
    map is fitted on the latent with BOS's top ``BOS_RANK`` directions projected out (the BOS
    latent is nearly the same vector everywhere, cosine 0.98 to its mean in the demo model).
    Without it the resting heads add a residual-sized vector to every position, four layers
    over, and the model's other skills break. ``silence`` adds a soft term that makes them quiet
    at the other tokens that are not names too. Returns (the fit's last cross-entropy, the size
    of what they write at BOS relative to at a name)."""
    x = rows[:, :-1]
    latents, hidden = _latents(model, x, layers)
    inside = name_positions(x, classes)
    ys = x[inside]
    feats = {li: latents[li][inside] for li in layers}
    at_bos = (x == bos_id) if bos_id is not None else torch.zeros_like(inside)
    rest = {li: latents[li][~inside & ~at_bos] for li in layers}
    bos = {li: latents[li][at_bos] for li in layers}
    keep_dirs = {li: _without_directions(bos[li], BOS_RANK) for li in layers}
    g = torch.Generator().manual_seed(seed)
    attn0 = model.model.layers[layers[0]].self_attn
    dv, kvr, hid = attn0.v_dim, attn0.kv_lora_rank, model.config.hidden_size
    params = {li: (torch.nn.Parameter(torch.randn(hid, dv, generator=g) * 0.05),
                   torch.nn.Parameter(torch.randn(dv, kvr, generator=g) * 0.05)) for li in layers}
    opt = torch.optim.Adam([p for pair in params.values() for p in pair], lr=3e-3)
    w_u, g_norm = model.lm_head.weight.detach(), model.model.norm.weight.detach()

    def write(idx: torch.Tensor, src: dict[int, torch.Tensor] = feats) -> torch.Tensor:
        return sum(src[li][idx] @ keep_dirs[li] @ b.T @ o.T for li, (o, b) in params.items())

    def quiet(src: dict[int, torch.Tensor], size: torch.Tensor) -> torch.Tensor:
        n = len(next(iter(src.values())))
        if n == 0:
            return size.new_zeros(())
        return write(torch.randint(0, n, (512,), generator=g), src).pow(2).sum(-1).mean() / size

    ce = float("nan")
    for _ in range(steps):
        idx = torch.randint(0, len(ys), (1024,), generator=g)
        out = write(idx)
        logits = F.rms_norm(out, (hid,)) * g_norm @ w_u.T
        loss = F.cross_entropy(logits, ys[idx])
        if silence:
            size = out.pow(2).sum(-1).mean()
            loss = loss + silence * quiet(rest, size)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ce = loss.item()
    with torch.no_grad():
        size = write(torch.arange(min(20000, len(ys)))).norm(dim=-1).median().item()
        n_bos = len(bos[layers[0]])
        at_rest = write(torch.arange(n_bos), bos).norm(dim=-1).median().item() / size if n_bos else float("nan")
        factor = math.sqrt(scale * hidden.norm(dim=-1).median().item() / size)
        for li, (o, b) in params.items():
            attn = model.model.layers[li].self_attn
            dn = attn.nope_dim
            attn.kv_b_proj.weight.view(attn.num_heads, dn + dv, kvr)[HEAD, dn:] = (b @ keep_dirs[li].T) * factor
            attn.o_proj.weight[:, HEAD * dv:(HEAD + 1) * dv] = o * factor
    return ce, at_rest
