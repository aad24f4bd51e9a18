"""A step's batch as the worker side sees it: each request's state, the batch metadata
built from it, and the window the main forward ran on.  The worker's runner builds them
and the MTP proposer (spec/) reads them, so both import this package and neither the
other.

    request_state.py   RequestState: the worker's per-request state (no torch)
    metadata.py        BatchMetadata from per-sequence host lists (the eager, varlen path)
    window.py          StepWindow: one step's main-forward inputs, and their form
"""
