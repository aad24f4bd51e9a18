"""One KV block as every part of the server sees it: its key, its bytes and its file.  No torch.

The engine's prefix cache, host tier and disk tier name blocks by their key; the worker's
pool, the disk tier and ``python -m server --check`` size them alike; the disk tier
writes and reads them as files.  None of it needs torch or anything else of the server,
so it sits below server/config, server/engine and server/pd, which all read it.

    key.py    BlockKey: the SHA-256 chain over a prefix block's tokens
    size.py   bytes per token and per block, blocks a disk tier of a given size holds
    file.py   one block on disk: checksummed, written atomically, read without trust
"""
