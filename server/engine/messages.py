"""Step messages between the scheduler (engine side) and the worker (device side).  No torch.

Everything here is a plain, picklable value: no live ``Sequence`` crosses to the worker
and no tensor comes back.  A worker process, a prefill/decode peer or a recorded trace can
carry these unchanged.

Per step the scheduler sends one ``SchedulerOutput``:
  * ``new_requests``: requests the worker sees for the first time, or again after a
    preemption (their whole token list, the blocks they hold, and how to sample them);
  * ``cached_requests``: requests the worker already holds; it knows their tokens, so only
    the blocks appended this step travel;
  * ``finished_request_ids``: requests whose per-request state the worker drops first;
  * ``preempted_request_ids``: requests that lost their KV blocks this step (they come
    back later as new requests, recomputed from their tokens, or with their blocks loaded
    back from the host tier when they were swapped out);
  * ``kv_saves`` / ``kv_loads``: block copies between the device pool and the host tier
    (kv/host_tier.py) that the worker's KV transfer (kv/transfer/kv_transfer.py) runs before the
    step's forward, in step order; ``kv_disk_writes``: saved blocks also written to the
    disk tier (kv/disk_tier.py); ``kv_row_loads``: whole block rows loaded into the pool,
    read from the disk tier or pulled from a PD prefill instance (server/pd), verified
    by the engine before they were matched.

Placeholders (asynchronous scheduling).  When step n+1 is scheduled before step n's tokens
reached the host, a cached request carries ``num_output_placeholders = 1 + d``: the most
tokens step n can still add (d drafts it verifies, plus the recovered or bonus token).
The scheduler reserved KV slots for that worst case; the worker feeds what step n really
produced, from its own state, without a host round trip through the engine.
With synchronous scheduling the placeholder count is always 0 and the scheduler's
``num_computed_tokens`` is exact.

A request that a token-level stop (stop_rules.py) ended in step n is not computed again
if step n+1 was already scheduled for it: the worker applies the same rule and reports it
as ``skipped``; only a stop string, found by the engine's detokenizer, can cost one
discarded step.

The worker answers with one ``ModelRunnerOutput`` (per request: emitted tokens, drafts
now held, logprobs), read by ``Scheduler.update`` once it reaches the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.kvblock.key import BlockKey
from server.engine.protocol import SamplingParams, TokenLogprob


@dataclass(frozen=True, slots=True)
class NewRequestData:
    request_id: str
    token_ids: tuple[int, ...]        # prompt + output emitted so far (a resumed request)
    num_prompt_tokens: int
    num_computed_tokens: int          # positions already in the KV pool (prefix-cache hit)
    block_ids: tuple[int, ...]        # the whole block table
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    max_output_tokens: int
    export_kv: bool = False           # PD prefill: send back the full prompt blocks' rows


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: tuple[int, ...]    # appended to the worker's block table this step
    num_computed_tokens: int          # as the scheduler knows it (exact iff no placeholders)
    num_output_placeholders: int      # tokens an in-flight step may still add (module doc)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    cached_requests: tuple[CachedRequestData, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()   # lost their blocks (they keep their drafts)
    kv_saves: tuple[tuple[int, int], ...] = ()    # (device block, host slot): copied out first
    kv_loads: tuple[tuple[int, int], ...] = ()    # (host slot, device block): then copied in
    kv_disk_writes: tuple[tuple[int, BlockKey, str], ...] = ()  # (host slot, key, path): saved block to disk
    kv_row_loads: tuple[tuple[bytes, int], ...] = ()       # (verified row, device block): disk or PD

    @property
    def has_kv_transfers(self) -> bool:
        return bool(self.kv_saves or self.kv_loads or self.kv_disk_writes or self.kv_row_loads)

    @property
    def num_scheduled(self) -> int:
        return len(self.new_requests) + len(self.cached_requests)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(r.token_ids) - r.num_computed_tokens for r in self.new_requests)

    @property
    def request_ids(self) -> list[str]:
        """Scheduled requests in batch order: new requests after cached ones."""
        return [r.request_id for r in self.cached_requests] + \
               [r.request_id for r in self.new_requests]


@dataclass(frozen=True, slots=True)
class CompileState:
    """How the worker's uniform decode/verify steps run: ``decode_path`` compiled, static
    (plain PyTorch) or eager (the varlen path); ``state`` off, compiling, compiled or
    failed; ``seconds`` the compile took, once done."""
    decode_path: str
    seconds: float | None
    state: str


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the engine's RuntimeInfo needs from a worker, once it is built (sent across
    processes)."""
    num_kv_blocks: int
    num_int8_kv_layers: int
    host_kv_blocks: int               # the host tier's slots (0: no tier)
    kv_block_bytes: int               # bytes one block moves (every cache layer)
    compile: CompileState
    sp: int = 1                       # ranks the pool is striped over (sequence parallel)
    dp: int = 1                       # dp groups the pool is split over (attention data parallel)
    kv_blocks_per_rank: int = 0       # blocks one rank holds: num_kv_blocks / (sp x dp)
    prediction_draft_tokens: int = 0  # predicted drafts a step may verify (measured; 0: none)
    kernels: tuple[tuple[str, str], ...] = ()   # model/kernels/report.py: what the model multiplies with


@dataclass(slots=True)
class ModelRunnerOutput:
    """One executed step, on the host.  Lists are parallel to ``request_ids``."""
    step_id: int
    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)   # accepted drafts + final token
    num_drafts: list[int] = field(default_factory=list)                # drafts verified this step
    num_drafts_next: list[int] = field(default_factory=list)           # drafts held for the next step
    num_predicted: list[int] = field(default_factory=list)             # of num_drafts: from the prediction
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)               # request id -> error
    skipped: list[str] = field(default_factory=list)                   # ended by an earlier step
    num_tokens: int = 0                                                # tokens fed to the main model
    spec_k: int = 0                                                    # drafts per sequence chosen
    execute_time_s: float = 0.0
    num_held_requests: int = 0                                         # worker state size after it
    # request id -> logprobs of its prompt tokens (first entry None), from its first prefill
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # PD prefill: request id -> (full prompt blocks, their rows end to end), in the step
    # that computed the last prompt position
    kv_exports: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    # the worker's step path when it changed (graphs compiled in the background were
    # adopted, or compiling them failed)
    compile_update: CompileState | None = None
