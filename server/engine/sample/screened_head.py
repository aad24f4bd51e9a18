"""Greedy tokens without streaming the whole 16-bit vocabulary head: an int8 copy screens
the vocabulary, and only the rows that could hold a row's argmax are multiplied exactly.

Why: at batch 1 the bf16 head of the 0.5b benchmark model is 98 MB of a 483 MB step (a
fifth of the bytes a decode step reads), and a greedy step only needs its argmax.  The
int8 copy (per output row, the draft head's: engine/spec/draft_head.py) reads half of it;
a bound on how far each screened logit can be from the served one keeps every token that
could be the argmax, and those few rows (16 of 32000 typical on the benchmark model) go
through the same product as the whole head would.  The result is the served head's argmax
bit for bit, ties included (the first largest), not an approximation:

- the served logit of token j is L_j = bf16(f_j), f_j the kernel's float32 dot of the bf16
  row x with the bf16 weight row w_j.  The backends screened (``Products.columns_exact``)
  compute every output by one chain over K that does not depend on which other rows share
  the call, so f_j of a candidate multiplied alone is f_j of the whole head;
- with x = x^ + r (x^ = s q, the int8 row the screen multiplies, r what it rounded off) and
  w_j = w^_j + d_j likewise, the screened logit l^_j = x^ . w^_j (exact integer sums) is off
  the real dot t_j by x^ . d_j + r . w_j, at most |x^| |d_j| + |r| |w_j| (Cauchy-Schwarz,
  the norms of each weight row's rounding and of the row itself kept from the load);
- f_j is off t_j by at most (K/8 + 64) 2^-24 |x| |w_j| (the float32 chain of at most K/16
  + 16 additions a lane, bounded twice over), and rounding f_j to bf16 by 2^-8 |f_j|.

Every j whose upper bound reaches the largest lower bound is a candidate; a token that
ties the served maximum is one, so the first index among the candidates' exact logits is
the served one.  A step whose rows have too many candidates (a flat distribution, a
model the bound fits badly), a non-finite hidden row, or a backend not screened reads the
whole head.  Greedy requests only (the runner's host-verified windows: raw argmax, no
logprobs, no grammar): sampling needs every logit.

``MTP_SERVE_GREEDY_HEAD`` (server/config/kernel_env.py): "auto" screens where the head is a
plain bf16 layer, its products are ``columns_exact`` and the int8 kernel is ours ("vnni",
"avx2"); "model" always reads the whole head.
"""
from __future__ import annotations

import logging
import math

import torch

from server.model.kernels import settings as kernel_env
from server.model.kernels.native import ops_ready
from server.model.layers.linear import Linear
from server.model.quant.int8 import int8_matmul, quantize_rows, row_scales
from server.model.quant.int8_copy import fast_int8, int8_backend, int8_copy
from server.model.quant.linear import QuantLinear

log = logging.getLogger("server.model")

HALF_ULP = 2.0 ** -8          # bf16 rounding to nearest: at most this much of |f|
FLOAT_EPS = 2.0 ** -24
SLACK = 1.0 + 1e-3            # the float32 arithmetic of the bound itself
MAX_CANDIDATE_SHARE = 1 / 16  # more than this of the vocabulary: read the whole head
# Rows a call screens at most: the screen's own work grows with rows x vocabulary while
# what it saves does not (the 0.5b model, alternating in one process on the 2-core Zen 4:
# batch 1 MTP off 1.11x, k=1 1.09x, batch 8 off 1.03x, batch 8 k=1 (16 rows) 0.98x).
MAX_ROWS = 8
NORM_ROWS = 4096              # weight rows a slice when the norms are taken at load
TINY = 1e-30                  # an absolute floor under every bound (flushed denormals)


class ScreenedHead:
    """The greedy ids of ``head`` [V, H] (a plain bf16 Linear) through ``int8`` (its
    per-row W8A8_DYNAMIC copy) and the exact rows of the candidates."""

    def __init__(self, head: Linear, int8: QuantLinear) -> None:
        self.head = head
        self.q, self.scale, self.backend = int8.weight, int8.weight_scale, int8.backend
        d_norm, w_norm = [], []
        with torch.no_grad():                  # in double, a slice at a time (a V x H copy is GBs)
            for r in range(0, head.out_features, NORM_ROWS):
                w = head.weight[r:r + NORM_ROWS].detach().double()
                d = w - self.q[r:r + NORM_ROWS].double() * self.scale[r:r + NORM_ROWS].double()[:, None]
                d_norm.append(d.norm(dim=1))
                w_norm.append(w.norm(dim=1))
        self.d_norm = torch.cat(d_norm).float() * SLACK                  # |d_j|
        self.w_norm = torch.cat(w_norm).float() * SLACK                  # |w_j|
        k = head.in_features
        self.chain = (k / 8 + 64) * FLOAT_EPS                            # f_j - t_j, per |x||w_j|
        self.max_candidates = max(1, int(head.out_features * MAX_CANDIDATE_SHARE))
        self.calls = self.fallbacks = 0

    def ids(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, H] (the head's input rows) -> int64 [M]: ``argmax(head(x).float(), -1)``,
        or None where this call must read the whole head (module docstring)."""
        if x.dim() != 2 or x.dtype != self.head.weight.dtype or x.shape[0] > MAX_ROWS \
                or not self.head.products.columns_exact(self.head.weight, x.shape[0]):
            return None
        native = ops_ready()
        x = x.contiguous()
        xq, stats = torch.ops.mtp_native.screen_rows(x) if native else screen_rows(x)
        if not math.isfinite(float(stats.sum())):
            return None
        self.calls += 1
        sums = int8_matmul(xq, self.q, self.backend)
        c_bound, c_abs = (1 + HALF_ULP) * SLACK, HALF_ULP * SLACK
        if native and sums.dtype == torch.int32 and sums.is_contiguous():
            cand = torch.ops.mtp_native.screen_candidates(sums, stats, self.scale, self.d_norm,
                                                          self.w_norm, self.chain, c_bound, c_abs)
        else:
            cand = self._candidates(sums, stats, c_bound, c_abs)
        if cand.numel() > self.max_candidates:
            self.fallbacks += 1
            return None
        rows = self.head.weight.index_select(0, cand)
        exact = self.head.products.linear(x, rows).float()               # [M, C]
        return cand[exact.argmax(dim=1)]

    def _candidates(self, sums: torch.Tensor, stats: torch.Tensor, c_bound: float,
                    c_abs: float) -> torch.Tensor:
        """ops.cpp's ``screen_candidates`` in torch operations."""
        s, hat_norm, r_norm, x_norm = stats.float().unbind(1)
        screened = sums.float().mul_(self.scale).mul_(s[:, None])        # l^ [M, V]
        # |L_j - l^_j| <= (1 + 2^-8)(E_j + g_j) + 2^-8 |l^_j|, E_j + g_j = a |d_j| + b |w_j|
        a, b = hat_norm[:, None], (r_norm + self.chain * x_norm)[:, None]
        bound = torch.addcmul(b * self.w_norm, a, self.d_norm).mul_(c_bound)
        bound.add_(screened.abs(), alpha=c_abs).add_(TINY)
        floor = (screened - bound).amax(dim=1, keepdim=True)             # [M, 1]
        return screened.add_(bound).ge_(floor).any(dim=0).nonzero().flatten()  # ascending


def screen_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.cpp's ``screen_rows`` in torch operations: (q int8 [M, K], float32 [M, 4] of s,
    |s q|, |x - s q|, |x|; NaN norms for a row that is not finite)."""
    xf = x.float()
    s = row_scales(xf)                                                   # [M, 1]
    q = quantize_rows(xf, s)
    xd, hat = xf.double(), q.double() * s.double()
    finite = torch.isfinite(xf).all(dim=1, keepdim=True)
    norms = torch.cat([hat.norm(dim=1, keepdim=True), (xd - hat).norm(dim=1, keepdim=True),
                       xd.norm(dim=1, keepdim=True)], dim=1).float()
    norms = torch.where(finite, norms, torch.full_like(norms, float("nan")))
    q = torch.where(finite, q, torch.zeros_like(q)).to(torch.int8)
    return q, torch.cat([s, norms], dim=1)


def screened_setting() -> str:
    """``MTP_SERVE_GREEDY_HEAD`` as this process reads it."""
    return kernel_env.kernel_settings().greedy_head


def screens(weight: torch.Tensor, products) -> bool:
    """Whether greedy steps screen a plain head of ``weight`` multiplied by ``products``
    under ``MTP_SERVE_GREEDY_HEAD`` on this CPU (the "auto" rule; benchmarks.harness counts
    the bytes a served step reads by it too)."""
    return (screened_setting() != "model" and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and products.columns_exact(weight, 1)
            and fast_int8(weight.dtype))


def screened_head(model, draft_int8: QuantLinear | None = None,
                  grouped: bool = False) -> ScreenedHead | None:
    """The screen of ``model.lm_head`` under ``MTP_SERVE_GREEDY_HEAD``, or None.
    ``draft_int8``: the MTP drafts' int8 head copy (engine/spec/draft_head.py), taken
    instead of a second copy where it is the same weight.  ``grouped``: one rank of a group
    (its head is a shard or is not a plain layer): None."""
    head = getattr(model, "lm_head", None)
    if (grouped or type(head) is not Linear or head.bias is not None
            or not screens(head.weight, head.products)):
        return None
    same = (draft_int8 is not None and getattr(model, "num_mtp_layers", 0)
            and model._mtp(0).shared_head.head.weight is head.weight)
    int8 = draft_int8 if same else int8_copy(head, int8_backend(head.weight.dtype))
    log.info("greedy steps screen the vocabulary head through an int8 copy (%s%s) and "
             "multiply only the candidates' rows exactly", int8.backend,
             ", the drafts' own" if same else f", {head.weight.numel() / 1e6:.0f} MB")
    return ScreenedHead(head, int8)
