"""Blocks leaving and entering a worker's device pool (worker side; torch).

    kv_transfer.py   KVTransfer: the worker's one door for tier copies and PD rows
    host_pool.py     the host tier's memory and its copies to and from the device pool
    block_rows.py    whole blocks as byte rows (the device side of every copy)
    striped.py       rows by global block id over a pool striped over ranks (sp, cp, dp)
"""
from server.engine.kv.transfer.kv_transfer import KVTransfer
from server.engine.kv.transfer.striped import StripePlace

__all__ = ["KVTransfer", "StripePlace"]
