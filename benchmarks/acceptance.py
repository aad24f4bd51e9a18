"""MTP acceptance of seeded vs unseeded sampling on the demo model, in process.

Seeded sampled requests are verified by coupling (server/engine/sample/sampler.py) and emit
exactly what MTP off emits; unseeded ones keep probability-ratio verification.  This
prints the acceptance rate of each at k=1 and k=2 (the same 48 chat prompts, temperature
0.9, top_p 0.95, 64 tokens, 8 at a time) and checks the seeded outputs against MTP off.

    python -m benchmarks.acceptance [--constrained]   # --constrained: a json_schema grammar on every request
"""
from __future__ import annotations

import argparse
import sys

from benchmarks import harness
from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from server.testing.daemon import DEMO_MODEL as DEMO
from server.text.tokenizer import Tokenizer
TOPICS = ["the weather in Paris", "Tokyo", "the moon", "prime numbers", "Rome", "baking bread",
          "the ocean", "Oslo", "music", "Cairo", "trains", "Lima"]
ASKS = ["Tell me about {}.", "What do you know about {}?", "Write a sentence on {}.", "Explain {} briefly."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--constrained", action="store_true")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(DEMO)
    model, _ = load_checkpoint(DEMO)
    model.eval()
    grammar = None
    if args.constrained:
        from server.api.openai.grammars import response_format_grammar
        grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
            "type": "object", "properties": {"topic": {"type": "string", "maxLength": 30},
                                             "fact": {"type": "string", "maxLength": 60}},
            "required": ["topic", "fact"]}}}).grammar
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a.format(t)}],
                                                  add_generation_prompt=True), add_special_tokens=False)
               for t in TOPICS for a in ASKS]
    outs = {}
    for seeded in (True, False):
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=64, temperature=0.9, top_p=0.95,
                                                         seed=i if seeded else None, grammar=grammar))
                for i, p in enumerate(prompts)]
        for k in (0, 1, 2):
            eng = LLMEngine(model, EngineConfig(num_speculative_tokens=k, tokenizer_dir=str(DEMO), max_seq_len=1024,
                                                num_blocks=1024, max_queue_delay_us=0, max_batch_size=8), tok)
            res = eng.generate(reqs)
            outs[(seeded, k)] = {r: [t for o in v for t in o.token_ids] for r, v in res.items()}
            st = eng.stats()
            if k:
                rate = st.num_accepted_tokens / max(1, st.num_draft_tokens)
                same = outs[(seeded, k)] == outs[(seeded, 0)]
                print(f"{'seeded' if seeded else 'unseeded':>8} k={k}: acceptance {rate:.2f}, "
                      f"{st.num_draft_tokens} draft tokens" + (f", identical to MTP off: {same}" if seeded else ""))
    return 0 if all(outs[(True, k)] == outs[(True, 0)] for k in (1, 2)) else 1


if __name__ == "__main__":
    sys.exit(main())
