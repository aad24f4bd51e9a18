"""What the engine actually runs with, derived once at start-up.  No torch.

The config says what an operator asked for; this says what they got (a checkpoint without
MTP weights runs with k = 0 whatever ``num_speculative_tokens`` says).  The scheduler, the
HTTP layer (``/v1/status``, the ``n > 1`` rule, ``/v1/models``), the metrics and the
start-up log all read this one object, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass


def lookahead_slots(num_spec_tokens: int, async_scheduling: bool) -> int:
    """KV slots a sequence may need past ``prompt + max_output`` tokens: the worst case.

    With k drafts (k = ``num_spec_tokens``) a step feeds the last token plus k drafts, and
    the chained MTP passes write k - 1 positions past the verified ones, so a sequence with
    n tokens may touch positions up to n - 1 + k + (k - 1).  With asynchronous scheduling
    a step is scheduled while the previous one is in flight: it must also cover the up to
    1 + k tokens that step may still add; the scheduler never schedules a continuation for
    a sequence that the in-flight step must finish, which takes one of those back.

    A request with a prediction may verify a window of predicted tokens a step instead of
    k drafts (spec/prediction.py), but never one reaching past its ``max_tokens`` and never
    more than the blocks its step was given hold, so predictions add nothing here: the
    worst case is the same with or without one (issue 58: a prediction once made a request
    that fits the pool need more blocks than the pool has).
    """
    k = num_spec_tokens
    chained = max(0, k - 1)
    return k + chained + (k if async_scheduling else 0)


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    num_speculative_tokens: int        # effective k: the most drafts any step verifies (0: MTP off)
    configured_speculative_tokens: int  # what the config asked for
    adaptive_speculation: bool          # k chosen per step in 0..num_speculative_tokens
    async_scheduling: bool
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    max_seq_len: int
    vocab_size: int = 0                 # the model's: token ids are valid in [0, vocab_size)
    num_kv_layers: int = 0
    num_int8_kv_layers: int = 0         # cache layers with an int8 latent (kv_cache_dtype / FA3)
    decode_path: str = "eager"          # uniform decode steps: compiled | static | eager (worker/worker.py)
    compile_seconds: float | None = None  # start to compiled graphs in use (None: not compiled)
    compile_state: str = "off"          # off | compiling (serving uncompiled meanwhile) | compiled | failed
    host_kv_blocks: int = 0             # host KV tier size (0: no tier; kv/host_tier.py)
    kv_block_bytes: int = 0             # bytes one block moves between the tiers (every layer)
    host_cache_prefix: bool = False     # evicted prefix blocks go to the tier
    swap_preemption: bool = False       # preempted requests swap to it when it has room
    world_size: int = 1                 # ranks of a tensor/expert-parallel group (executor/parallel.py)
    moe_tp: int = 1
    moe_ep: int = 1
    sp: int = 1                         # ranks the KV pool is striped over (model/sequence_parallel.py)
    dp: int = 1                         # attention data parallel groups (model/data_parallel.py)
    cp: int = 1                         # context parallel ranks (model/context_parallel.py)
    kv_blocks_per_rank: int = 0         # blocks one rank holds (num_kv_blocks / (sp x dp))
    worker_pids: tuple[int, ...] = ()   # this node's rank processes (for operators' tools)
    engine_pid: int = 0                 # the process running the engine loop (front/engine_process.py)
    prediction_draft_tokens: int = 0    # predicted drafts a step may verify: the worker's measured window
    kernels: tuple[tuple[str, str], ...] = ()   # CPU class, products, int8 backend (model/kernels/report.py)

    @property
    def mtp_enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def kv_cache_dtype(self) -> str:
        """"auto" (the model dtype), "int8", or "int8 on i of n layers" (an FA3 checkpoint)."""
        if not self.num_int8_kv_layers:
            return "auto"
        if self.num_int8_kv_layers == self.num_kv_layers:
            return "int8"
        return f"int8 on {self.num_int8_kv_layers} of {self.num_kv_layers} layers"

    @property
    def chained_draft_slots(self) -> int:
        """Positions past the verified ones that the chained MTP passes write (k - 1)."""
        return max(0, self.num_speculative_tokens - 1)

    @property
    def lookahead_slots(self) -> int:
        return lookahead_slots(self.num_speculative_tokens, self.async_scheduling)

    @property
    def host_tier_text(self) -> str:
        if not self.host_kv_blocks:
            return "off"
        uses = [u for u, on in (("prefix cache", self.host_cache_prefix),
                                ("swap", self.swap_preemption)) if on]
        return f"{self.host_kv_blocks} blocks ({' + '.join(uses) or 'unused'})"

    def host_tier_dict(self) -> dict:
        return {"enabled": bool(self.host_kv_blocks), "backend": "host" if self.host_kv_blocks else "",
                "blocks": self.host_kv_blocks, "block_bytes": self.kv_block_bytes,
                "bytes": self.host_kv_blocks * self.kv_block_bytes,
                "prefix_cache": self.host_cache_prefix, "swap_preemption": self.swap_preemption}

    def describe(self) -> str:
        """One start-up log line."""
        mtp = (f"MTP on, k={self.num_speculative_tokens}"
               + (" (adaptive)" if self.adaptive_speculation else "")
               if self.mtp_enabled else "MTP off")
        if self.configured_speculative_tokens != self.num_speculative_tokens:
            mtp += f" (configured k={self.configured_speculative_tokens})"
        return (f"engine runtime: {mtp}; async scheduling {'on' if self.async_scheduling else 'off'}; "
                f"KV pool {self.num_kv_blocks} blocks x {self.block_size} tokens "
                f"(KV cache {self.kv_cache_dtype}); host KV tier {self.host_tier_text}; "
                f"decode path {self.decode_path}"
                + (f" (products {dict(self.kernels).get('products')}, int8 "
                   f"{dict(self.kernels).get('int8_backend')}, CPU {dict(self.kernels).get('cpu_class')})"
                   if self.kernels else "")
                + (f" on {self.world_size} ranks (dp {self.dp}, cp {self.cp}, tp "
                   f"{self.world_size // (self.dp * self.cp)}, moe_tp {self.moe_tp}, "
                   f"moe_ep {self.moe_ep}, sp {self.sp})"
                   if self.world_size > 1 else "")
                + (f" (compiled in {self.compile_seconds:.1f} s)" if self.compile_seconds is not None else "")
                + (" (compiling in the background)" if self.compile_state == "compiling" else "")
                + "; "
                f"EOS ids {sorted(self.eos_token_ids)}")

    def to_dict(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens,
                "configured_num_speculative_tokens": self.configured_speculative_tokens,
                "adaptive_speculation": self.adaptive_speculation,
                "async_scheduling_enabled": self.async_scheduling,
                "kv_blocks": self.num_kv_blocks, "block_size": self.block_size,
                "kv_tokens": self.num_kv_blocks * self.block_size,
                "kv_cache_dtype": self.kv_cache_dtype,
                "kernels": dict(self.kernels),
                "lookahead_slots": self.lookahead_slots,
                "prediction_draft_tokens": self.prediction_draft_tokens,
                "eos_token_ids": sorted(self.eos_token_ids), "max_seq_len": self.max_seq_len,
                "vocab_size": self.vocab_size, "decode_path": self.decode_path,
                "compile_state": self.compile_state,
                "compile_seconds": (round(self.compile_seconds, 2)
                                    if self.compile_seconds is not None else None),
                "host_kv_tier": self.host_tier_dict(), "engine_pid": self.engine_pid,
                "parallel": {"world_size": self.world_size, "tp": self.world_size // (self.dp * self.cp),
                             "dp": self.dp, "cp": self.cp, "moe_tp": self.moe_tp, "moe_ep": self.moe_ep,
                             "sp": self.sp,
                             "kv_blocks_per_rank": self.kv_blocks_per_rank,
                             "worker_pids": list(self.worker_pids)}}
