"""The KV pool and where its blocks go besides it.

Engine side (bookkeeping, no torch) and the pool's tensors here; the worker side's block
copies in transfer/.  A block's key, size and file format are server/kvblock's.

    block_manager.py   block allocation, ref counts, MTP-aware prefix cache (no torch)
    dp_blocks.py       one block pool per attention data parallel group (no torch)
    peer_blocks.py     blocks derived from a PD peer's rows, purged on a role change (no torch)
    host_tier.py       host tier bookkeeping: block key -> slot, swap slots (no torch)
    disk_tier.py       disk tier: verified reads, write plans (no torch)
    tiers.py           the block manager and its tiers built for one engine; their figures
    cache.py           the pool's tensors and their sizing
    transfer/          the worker's block copies: KVTransfer (its one door), the host pool,
                       whole blocks as rows, rows over a striped pool
"""
