"""Benchmarks and reliability runs against the daemon and the engine; run from the
repository root (not installed with ``server``), one module per comparison:

    python -m benchmarks.serve            MTP off / k=1 / k=2 vs transformers over a concurrency sweep,
                                          or --compare async|quant|kv|compile|process|tp|pd|kvpool|structured
    python -m benchmarks.kvpool           the prefix cache without / with the host (and disk) KV tier
    python -m benchmarks.pd               a co-located daemon vs 1 prefill + 1 decode + the coordinator
    python -m benchmarks.structured       MTP k=1 with vs without a json_schema constraint
    python -m benchmarks.checkouts        the serving path of two checkouts side by side
    python -m benchmarks.engine_step      engine-level decode step timing, MTP off / k=1 / k=2 (GPU or CPU)
    python -m benchmarks.peers            llama.cpp beside us on the same weights (--build gets and builds it),
                                          each row's share of the memory's read bandwidth
    python -m benchmarks.closed_loop      adaptive speculation vs MTP off, engines taking turns, closed loop
    python -m benchmarks.acceptance       MTP acceptance of seeded vs unseeded sampling
    python -m benchmarks.grammar_backends llguidance vs xgrammar: compile and per-token mask cost
    python -m benchmarks.lm_eval          lm-evaluation-harness against the daemon (the eval extra)
    python -m benchmarks.soak             soak and chaos run: leaks, 5xx, the KV pool back to free
    python -m benchmarks.hostile          hostile requests: do they slow the others, keep memory?

harness.py holds what they share (daemons through server.testing.daemon, bursts, medians,
warm-up, the machine line, flags, JSON reports under docs/bench/); prompts.json is the
bench prompt set, eval_data/ lm_eval's task.
"""
