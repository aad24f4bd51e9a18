"""Token-level stop rules, shared by the scheduler and the worker.  No torch.

Both sides apply them to the same tokens: the scheduler to end a request, the worker to
skip a request that an earlier step already ended (under asynchronous scheduling the next
step is launched before the engine has seen the stop), so one rule, written once.
"""
from __future__ import annotations

from server.engine.protocol import FinishReason, SamplingParams


def first_stop(tokens: list[int], num_output_before: int, stop_ids: frozenset[int],
               params: SamplingParams, max_output_tokens: int
               ) -> tuple[int, FinishReason, int | None] | None:
    """(index of the token that ends the request, reason, stop token id) or None.

    A stop id (EOS unless ignore_eos, or a stop_token_id) ends it once more than
    min_tokens output tokens exist; reaching max_output_tokens ends it too.
    """
    for i, tok in enumerate(tokens):
        n_out = num_output_before + i + 1
        if tok in stop_ids and n_out > params.min_tokens:
            return i, FinishReason.STOP, (tok if tok in params.stop_token_ids else None)
        if n_out >= max_output_tokens:
            return i, FinishReason.LENGTH, None
    return None
