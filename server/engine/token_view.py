"""Token-list views shared by the scheduler's Sequence and the worker's RequestState.  No torch.

Both hold ``token_ids`` (prompt then output) and ``num_prompt_tokens``; the derived
counts and slices are written once here.
"""
from __future__ import annotations


class TokenView:
    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
