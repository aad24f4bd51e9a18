"""The measurement behind choosing llguidance over xgrammar (docs/api.md, Structured output):
compile time of a three-field JSON schema and per-token mask + consume cost on the demo
tokenizer, one backend per run.

    python -m benchmarks.grammar_backends llg
    # xgrammar is not a dependency; to measure it without touching .venv's packages:
    pip download --no-deps xgrammar apache-tvm-ffi -d /tmp/xgr-wheels
    pip install --no-deps --target /tmp/xgr /tmp/xgr-wheels/*.whl
    PYTHONPATH=/tmp/xgr python -m benchmarks.grammar_backends xgr      # needs transformers
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks import harness
from server.testing.daemon import DEMO_MODEL

TOK = str(DEMO_MODEL / "tokenizer.json")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
TEXT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["x", "engineer", "paris"]})


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def llg(ids: list[int]) -> None:
    import llguidance
    import llguidance.torch as lt
    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(open(TOK).read())
    print("tokenizer %.1f ms" % _ms(t))
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t = time.perf_counter()
    m = llguidance.LLMatcher(lltok, g)
    print("compile %.2f ms" % _ms(t), m.get_error())
    bm = lt.allocate_token_bitmask(1, lltok.vocab_size)
    for _ in range(3):
        m.reset()
        t = time.perf_counter()
        for tid in ids:
            lt.fill_next_token_bitmask(m, bm, 0)
            assert m.consume_token(tid), m.get_error()
        lt.fill_next_token_bitmask(m, bm, 0)
        print("mask+consume per token %.1f us" % (_ms(t) / len(ids) * 1e3))


def xgr(ids: list[int], vocab_size: int) -> None:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=TOK)
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    comp = xgr.GrammarCompiler(info)
    print("tokenizer %.1f ms" % _ms(t))
    t = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA))
    print("compile %.2f ms" % _ms(t))
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    for _ in range(3):
        m.reset()
        t = time.perf_counter()
        for tid in ids:
            m.fill_next_token_bitmask(bm)
            assert m.accept_token(tid)
        m.fill_next_token_bitmask(bm)
        print("mask+consume per token %.1f us" % (_ms(t) / len(ids) * 1e3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backend", choices=("llg", "xgr"), help="llguidance or xgrammar")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(TOK)
    ids = tk.encode(TEXT, add_special_tokens=False).ids
    vocab_size = tk.get_vocab_size()
    print("vocab", vocab_size, "tokens", len(ids))
    if args.backend == "llg":
        llg(ids)
    else:
        xgr(ids, vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
