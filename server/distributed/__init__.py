"""Collectives of a rank group: torch.distributed, or shared memory between the ranks of
one node (collectives.py)."""
