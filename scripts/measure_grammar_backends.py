#!/usr/bin/env python
"""The measurement behind choosing llguidance over xgrammar (docs/api.md, Structured output):
compile time of a three-field JSON schema and per-token mask + consume cost on the demo
tokenizer, one backend per run.

    scripts/measure_grammar_backends.py llg
    # xgrammar is not a dependency; to measure it without touching .venv's packages:
    pip download --no-deps xgrammar apache-tvm-ffi -d /tmp/xgr-wheels
    pip install --no-deps --target /tmp/xgr /tmp/xgr-wheels/*.whl
    PYTHONPATH=/tmp/xgr scripts/measure_grammar_backends.py xgr      # needs transformers
"""
import json, sys, time
import torch
from pathlib import Path
TOK = str(Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-tiny-mtp" / "tokenizer.json")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
TEXT = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["x", "engineer", "paris"]})
from tokenizers import Tokenizer
tk = Tokenizer.from_file(TOK)
ids = tk.encode(TEXT, add_special_tokens=False).ids
V = tk.get_vocab_size()
print("vocab", V, "tokens", len(ids))
which = sys.argv[1]
if which == "llg":
    import llguidance, llguidance.torch as lt
    t = time.perf_counter(); lltok = llguidance.LLTokenizer(open(TOK).read()); print("tokenizer %.1f ms" % ((time.perf_counter()-t)*1e3))
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t = time.perf_counter(); m = llguidance.LLMatcher(lltok, g); print("compile %.2f ms" % ((time.perf_counter()-t)*1e3), m.get_error())
    bm = lt.allocate_token_bitmask(1, lltok.vocab_size)
    for rep in range(3):
        m.reset(); t = time.perf_counter()
        for tid in ids:
            lt.fill_next_token_bitmask(m, bm, 0); assert m.consume_token(tid), m.get_error()
        lt.fill_next_token_bitmask(m, bm, 0)
        print("mask+consume per token %.1f us" % ((time.perf_counter()-t)/len(ids)*1e6))
else:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=TOK)
    t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V); comp = xgr.GrammarCompiler(info); print("tokenizer %.1f ms" % ((time.perf_counter()-t)*1e3))
    t = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(SCHEMA)); print("compile %.2f ms" % ((time.perf_counter()-t)*1e3))
    m = xgr.GrammarMatcher(cg); bm = xgr.allocate_token_bitmask(1, V)
    for rep in range(3):
        m.reset(); t = time.perf_counter()
        for tid in ids:
            m.fill_next_token_bitmask(bm); assert m.accept_token(tid)
        m.fill_next_token_bitmask(bm)
        print("mask+consume per token %.1f us" % ((time.perf_counter()-t)/len(ids)*1e6))
