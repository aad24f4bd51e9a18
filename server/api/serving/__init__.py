"""The business plane's handlers: a request planned, run on the engine, answered.

    chat.py         POST /v1/chat/completions: messages -> template -> prompt ids -> answer
    completions.py  POST /v1/completions: prompts (text or ids) x n choices -> answer
    common.py       request rules shared by both (model, MTP rules, lengths, sampling)
                    and the planning step (on or off the event loop)
    run.py          a planned request's run: grammar, PD, one engine call per choice, and
                    the answer (JSON, or SSE with its ending), written once for both
    engine_call.py  one engine request: timeouts, disconnects, abort, metrics
    fanout.py       n choices as n engine requests: seeds, interleaving, clean-up
    pd_calls.py     the two calls into PD (before submitting, and after a PD prefill);
                    PD's refusals become APIErrors
"""
