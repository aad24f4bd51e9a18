"""One step's main-forward window: the runner builds it, the proposer drafts from it.

Why a type of its own: the proposer's first MTP pass runs over the positions the main
forward verified, in the main forward's form (a static window, a lone static prompt, or
varlen rows), so it needs the window as the runner built it.  It used to get the pieces
as a dozen arguments and mode switches (``window=``, ``static_prefill=``); now it reads
``StepWindow``, which lives here, beside the request states it was built from, so that
spec/ and worker/ both import it and neither imports the other.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from server.engine.batch.request_state import RequestState
from server.model.batch import BatchMetadata, DecodeMetadata


class WindowForm(enum.Enum):
    """How the main forward fed the step's tokens."""
    VARLEN = "varlen"                  # each request's new tokens then its drafts, side by side
    STATIC = "static"                  # every request its last token and K drafts (DecodeMetadata)
    STATIC_PREFILL = "static prefill"  # one request's prompt (chunk) on the static path


@dataclass(slots=True)
class StepWindow:
    form: WindowForm
    states: list[RequestState]        # the step's requests, in batch order
    starts: list[int]                 # each request's num_computed_tokens before the step
    num_new: list[int]                # known tokens each request feeds (its drafts come after)
    input_ids: torch.Tensor           # [T] int64
    meta: BatchMetadata | DecodeMetadata
    cu: list[int]                     # cumulative query lengths (host)
    row_seq: torch.Tensor             # [R] sequence of each logits row
    row_off: torch.Tensor             # [R] row index inside its sequence's window
    drafts: torch.Tensor              # [S, K] held drafts (0-padded)
    K: int                            # most drafts any sequence holds
    logits_indices: torch.Tensor | None   # hidden rows with logits; None = every row
