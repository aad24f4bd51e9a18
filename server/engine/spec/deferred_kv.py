"""The MTP layer's KV of steps that draft nothing (k = 0), written many steps at a time.

Why: a k = 0 step still owes the MTP layer's cache the KV of each verified position (later
drafts attend to it once k rises again), and writing it every step cost a separate eager
pass (the MTP layer's input projection, norm and KV projection, ~15 small ops): 1.0 ms at
batch 1 and 1.3-2.2 ms at batch 8 on the 0.5b model, 5-7% of a plain decode step.  That is
what adaptive speculation pays for choosing k = 0, so k = 0 under MTP served less than MTP
off.  Held here instead (each step's token ids, main hidden rows, positions and slots: a
few KB), the writes go in one pass of many rows, whose weights are read once.

The cache must hold them before anything reads it or hands its slots to another owner, so
they are written before any MTP pass that is not a plain k = 0 decode (drafts, a prompt,
predicted drafts: the proposer), before any step that admits, finishes, preempts or moves
KV, and before a prompt's KV is exported (a new owner's or a copy's rows must be the final
ones: the worker), and every ``max_steps`` steps.  Only the MTP layer's cache waits: the main model's KV, which every
token's output depends on, is written in the step itself, and a draft is always verified,
so a late MTP row could only ever cost acceptance, never change a token.
"""
from __future__ import annotations

import torch

# Steps held at most: the flush then writes max_steps x batch rows in one pass.
MAX_STEPS = 32


class DeferredMTPWrites:
    """Held k = 0 MTP KV writes of one worker (single rank: a rank group would have to agree
    on every flush, and its layers write through their own plans)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], max_steps: int = MAX_STEPS) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_steps = max_steps
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_flushes = 0

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor) -> None:
        """One step's rows (``mtp_write_kv``'s inputs).  The hidden rows are copied: a
        compiled step may hand the same output buffer back next step."""
        self._parts.append((input_ids, prev_hidden.clone(), positions, slot_mapping))
        if len(self._parts) >= self.max_steps:
            self.flush()

    def flush(self) -> None:
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        ids, hidden, positions, slots = (torch.cat([p[i] for p in parts]) for i in range(4))
        self.model.mtp_write_kv(ids, hidden, positions, slots, self.kv_caches, layer=0)
        self.num_flushes += 1
