"""Teacher-forced next-token agreement of an int8 copy with its bf16 original.

Why: an int8 checkpoint that is fast but answers otherwise is no gain.  Throughput says
nothing about that, and free-running greedy text diverges at the first near-tie and
then compares unrelated continuations.  So the bf16 model writes a greedy continuation
of each prompt, both models read prompt + continuation in one forward, and at each
generated position the int8 model's argmax is set against the bf16 token.  Positions
where the bf16 model's top-2 logits are closer than ``--margin`` are near-ties (any
rounding may flip them) and are counted apart: the figure is agreement on the others.

    python -m benchmarks.agreement --model .cache/bench-models/deepseek-v3-0.5b-mtp \
        --against .cache/bench-models/deepseek-v3-0.5b-mtp-w8a8_dynamic [--against ...]

Prompts: benchmarks/prompts.json (the serving benchmark's), rendered by the checkpoint's
chat template; ``--prompts`` of them, ``--tokens`` generated each.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks import harness
from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from server.text.tokenizer import Tokenizer

PROMPTS = Path(__file__).with_name("prompts.json")


def continuations(model, tok: Tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The model's greedy continuation of each prompt (EOS ignored: every position counts)."""
    cfg = EngineConfig(block_size=16, num_blocks=64 * len(prompts) + 64, max_batch_size=8,
                       max_queue_delay_us=0, max_seq_len=max(map(len, prompts)) + new_tokens + 8)
    eng = LLMEngine(model, cfg, tok, eos_token_ids=set())
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [EngineRequest(f"a{i}", p, sp) for i, p in enumerate(prompts)]
    outs = eng.generate(reqs)
    return [[t for o in outs[r.request_id] for t in o.token_ids] for r in reqs]


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model.forward_full(torch.tensor([ids]))[0]).float()


def agreement(reference: list[torch.Tensor], model, sequences: list[tuple[list[int], list[int]]],
              margin: float) -> dict:
    """Counts of agreeing positions, on decided positions and on near-ties."""
    counts = {"decided": 0, "decided_agree": 0, "near_tie": 0, "near_tie_agree": 0}
    for ref_logits, (prompt, cont) in zip(reference, sequences):
        logits = next_token_logits(model, prompt + cont)
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(cont))
        ref, got = ref_logits[span], logits[span].argmax(-1)
        top2 = ref.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) >= margin
        agree = got == torch.tensor(cont)
        counts["decided"] += int(decided.sum())
        counts["decided_agree"] += int((agree & decided).sum())
        counts["near_tie"] += int((~decided).sum())
        counts["near_tie_agree"] += int((agree & ~decided).sum())
    counts["agreement"] = counts["decided_agree"] / max(1, counts["decided"])
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the bf16 (reference) checkpoint")
    ap.add_argument("--against", type=Path, action="append", required=True, help="an int8 copy (repeatable)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--margin", type=float, default=0.1,
                    help="bf16 top-2 logit gap below which a position is a near-tie (default 0.1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    tok = Tokenizer.from_dir(args.model)
    chats = json.loads(PROMPTS.read_text())["prompts"][:args.prompts]
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True))
               for c in chats]
    ref_model, _ = load_checkpoint(args.model)
    ref_model.eval()
    conts = continuations(ref_model, tok, prompts, args.tokens)
    sequences = list(zip(prompts, conts))
    reference = [next_token_logits(ref_model, p + c) for p, c in sequences]
    del ref_model
    report = {"model": harness.shown_path(args.model), "prompts": len(prompts), "tokens": args.tokens,
              "margin": args.margin, "copies": {}}
    print(f"# agreement with {args.model.name}: {len(prompts)} prompts x {args.tokens} greedy tokens, "
          f"near-tie margin {args.margin}")
    print(f"{'copy':48} {'quantization':40} {'agree':>7} {'decided':>8} {'near-ties (agree)':>18}")
    for path in args.against:
        model, info = load_checkpoint(path)
        model.eval()
        c = agreement(reference, model, sequences, args.margin)
        c["quantization"] = info.quantization
        report["copies"][harness.shown_path(path)] = c
        print(f"{path.name:48} {str(info.quantization)[:40]:40} {c['agreement']:7.3f} {c['decided']:8d} "
              f"{c['near_tie']:>9d} ({c['near_tie_agree']})")
        del model
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
