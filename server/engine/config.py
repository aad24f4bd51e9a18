"""The engine's slice of the application config, plus the one function that builds it.

The engine never reads AppConfig directly: ``engine_config_from_app`` copies the fields it
needs once at start-up, so tests can build an ``EngineConfig`` by hand and the rest of the
engine does not depend on how config.json is spelled.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from server.config.parallel_layout import ParallelLayout

# How long a child process (engine process, worker, rank) may take to load and report ready.
START_TIMEOUT_S = 300.0



class EngineError(ValueError):
    """The engine cannot be built from this configuration (message says what and why)."""


@dataclass(frozen=True, slots=True)
class ParallelConfig(ParallelLayout):
    """The engine's parallel layout (EngineConfig.parallel); world_size 1 = one device.
    The sizes and their rules are the layout's (server/config/parallel_layout.py); the
    engine adds where the ranks meet and how long it waits for them."""

    master_addr: str = "127.0.0.1"
    master_port: int = 1120         # 0: the executor hosts the store on a port it is given
    store_hosted: bool = False      # the store runs in the engine's process: ranks are clients
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = 30.0         # collectives and heartbeats
    start_timeout_s: float = 300.0  # joining and loading
    device_ids: tuple[int, ...] = ()  # CUDA devices of this node's ranks (npuDeviceIds)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # ScheduleConfig (MindIE names in comments)
    block_size: int = 16                    # cacheBlockSize
    max_batch_size: int = 200               # maxBatchSize: running sequences per step
    max_prefill_tokens: int = 8192          # maxPrefillTokens: prompt tokens per step
    max_prefill_batch_size: int = 50        # maxPrefillBatchSize: prefills per step
    max_queue_delay_us: int = 5000          # maxQueueDelayMicroseconds
    support_select_batch: bool = False      # supportSelectBatch
    prefill_time_ms_per_req: int = 150      # prefillTimeMsPerReq
    decode_time_ms_per_req: int = 50        # decodeTimeMsPerReq
    max_preempt_count: int = 0              # maxPreemptCount: preemptions per request; 0 = reserve instead
    max_iter_times: int = 512               # maxIterTimes: global output-length cap
    # ModelDeployConfig / ModelConfig
    max_seq_len: int = 2560                 # maxSeqLen: prompt + output
    mem_size_gb: float = -1                 # npuMemSize: KV pool size in GiB; -1 = auto
    num_blocks: int | None = None           # explicit pool size (tests); overrides mem_size_gb
    # plugins
    num_speculative_tokens: int = 0         # k; 0 = MTP off
    adaptive_speculation: bool = True       # pick k in 0..num_speculative_tokens per step (mtp.AdaptiveK)
    enable_prefix_cache: bool = False
    prediction_draft_tokens: int = 64       # $MTP_SERVE_PREDICTION_TOKENS: most tokens of a request's
                                            # prediction verified per step (spec/prediction.py); 0 = unused
    kv_cache_dtype: str = "auto"            # "auto" (model dtype) | "int8" (int8 latent + scale)
    # host KV tier (kv/host_tier.py): cpuMemSize / kvPoolConfig
    host_cache_gb: float = 0.0              # its size in GiB; 0 = no tier
    host_cache_blocks: int | None = None    # explicit size in blocks (tests); overrides host_cache_gb
    host_cache_prefix: bool = False         # evicted prefix-cache blocks go there (kvPoolConfig "host")
    swap_preemption: bool = False           # preempted requests swap there when it has room
    kv_pool_async_write: bool = False       # kvPoolConfig.asyncWrite: saves finish after the step (CUDA)
    disk_cache_dir: str | None = None       # disk tier behind the host tier (kv/disk_tier.py); None = none
    disk_cache_gb: float = 0.0              # its size bound in GiB
    # execution
    async_scheduling: bool = False          # $MINDIE_ASYNC_SCHEDULING_ENABLE: overlap scheduling with execution
    async_executor: str = "auto"            # where the worker runs then: process | thread | auto
                                            # (auto: a process on CPU, a thread on CUDA)
    static_decode: bool = True              # uniform decode/verify steps on the static path (static_decode.py)
    draft_after_emit: bool = False          # $MTP_SERVE_DRAFT_AFTER_EMIT for the daemon: a step's MTP
                                            # passes run after its tokens went out (worker/worker.py)
    compile: str = "off"                    # $MTP_SERVE_COMPILE for the daemon: auto | on | off (worker/compile_step.py)
    compile_wait: bool = True               # False: compile in the background ($MTP_SERVE_COMPILE_WAIT=0)
    tokenizer_dir: str | None = None        # tokenizer.json for grammar masks (sample/grammar.py)
    device: str = "cpu"
    dtype: str | None = None                # None = checkpoint dtype
    parallel: ParallelConfig = ParallelConfig()  # worldSize > 1: tensor/expert parallel ranks


def engine_config_from_app(app: Any, **overrides: Any) -> EngineConfig:
    """Copy the engine's slice out of an ``AppConfig`` (server.config) once, at start-up."""
    sched = app.schedule
    cfg = EngineConfig(
        block_size=sched.cache_block_size,
        max_batch_size=sched.max_batch_size,
        max_prefill_tokens=sched.max_prefill_tokens,
        max_prefill_batch_size=app.max_prefill_batch_size,
        max_queue_delay_us=sched.max_queue_delay_microseconds,
        support_select_batch=sched.support_select_batch,
        prefill_time_ms_per_req=sched.prefill_time_ms_per_req,
        decode_time_ms_per_req=sched.decode_time_ms_per_req,
        max_preempt_count=sched.max_preempt_count,
        max_iter_times=sched.max_iter_times,
        max_seq_len=app.max_seq_len,
        mem_size_gb=float(app.model_config.npu_mem_size),
        num_speculative_tokens=app.num_speculative_tokens,
        enable_prefix_cache=app.prefix_cache_enabled,
        adaptive_speculation=app.mtp.adaptive_speculation if app.mtp else True,
        async_scheduling=app.async_scheduling,
        kv_cache_dtype=app.kv_cache_dtype,
        host_cache_gb=app.host_kv_tier_gb,
        host_cache_prefix=bool(app.kv_pool.backend),
        swap_preemption=sched.max_preempt_count > 0,
        kv_pool_async_write=app.kv_pool.async_write,
        disk_cache_dir=str(app.kv_pool.disk_dir) if app.kv_pool.disk_dir else None,
        disk_cache_gb=app.kv_pool.disk_size_gb,
        compile=app.compile_mode, compile_wait=app.compile_wait,
        draft_after_emit=app.draft_after_emit,
        prediction_draft_tokens=app.prediction_draft_tokens,
        parallel=_parallel_config(app),
        tokenizer_dir=str(app.model_weight_path),
    )
    return replace(cfg, **overrides) if overrides else cfg


def _parallel_config(app: Any) -> ParallelConfig:
    lay = getattr(app, "parallel", None)
    if lay is None or lay.world_size == 1:
        return ParallelConfig()
    # No port in the config: the executor opens the store on a port the kernel picks as it
    # binds (a port probed free and bound later by rank 0 could be taken in between).
    port = lay.master_port if lay.master_port is not None else 0
    return ParallelConfig(world_size=lay.world_size, moe_tp=lay.moe_tp, moe_ep=lay.moe_ep,
                          sp=lay.sp, dp=lay.dp, cp=lay.cp, master_addr=lay.master_addr or "127.0.0.1",
                          master_port=port, nnodes=lay.nnodes, node_rank=lay.node_rank,
                          device_ids=lay.device_ids)


