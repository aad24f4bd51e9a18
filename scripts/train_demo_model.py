#!/usr/bin/env python
"""Build the bundled demo model: corpus, tokenizer, joint main + MTP training, evaluation.

    .venv/bin/python scripts/train_demo_model.py                 # full run, writes models/deepseek-v3-tiny-mtp
    .venv/bin/python scripts/train_demo_model.py --eval-only     # re-run the evaluation on the committed model

Everything is offline and seeded (see scripts/demo_model/spec.py); modules in scripts/demo_model/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from demo_model import corpus, evaluate, export, render, spec, train  # noqa: E402
from demo_model.card import write_card  # noqa: E402

DEFAULT_OUT = ROOT / "models" / "deepseek-v3-tiny-mtp"


def setup(threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def run_eval(out: Path, s: spec.TrainSettings, n: int) -> evaluate.EvalResult:
    from server.model.loader import load_checkpoint

    model, _info = load_checkpoint(out, dtype=torch.float32)
    res = evaluate.evaluate(model, out, seed=s.eval_seed, n_tool=n, n_think=n, n_plain=n)
    print(res.table())
    print(f"counts: {res.counts}  ({res.seconds:.0f}s)")
    for kind, texts in res.samples.items():
        for t in texts:
            print(f"  [{kind}] {t!r}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--eval-only", action="store_true", help="evaluate the model in --out and exit")
    ap.add_argument("--eval-n", type=int, default=30, help="prompts per evaluation set")
    ap.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    ap.add_argument("--num-chats", type=int, default=None, help="override the number of synthetic chats")
    args = ap.parse_args()

    s = spec.TrainSettings()
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    if args.num_chats is not None:
        s = dataclasses.replace(s, num_chats=args.num_chats)
    setup(s.threads, s.seed)
    out: Path = args.out
    if args.eval_only:
        res = run_eval(out, s, args.eval_n)
        ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
        return 0 if ok else 1

    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    chats, prose = train.build_texts(s)
    tok = render.train_tokenizer(chats + prose, s.vocab_size)
    render.write_tokenizer_files(tok, out, model_max_length=1024)
    bos, eos, pad = (tok.token_to_id(t) for t in (spec.SPECIALS["bos"], spec.SPECIALS["eos"], spec.SPECIALS["pad"]))
    docs = [e.ids for e in tok.encode_batch(chats + prose)]
    prose_tokens = sum(len(d) for d in docs[len(chats):])
    rows = train.pack_rows(docs, s.seq_len, pad, seed=s.seed)
    print(f"corpus: {len(chats)} chats, {len(prose)} prose docs ({prose_tokens} tokens), {len(rows)} rows "
          f"of {s.seq_len}; vocab {tok.get_vocab_size()} ({time.time() - t_start:.0f}s)")

    hf_cfg = spec.hf_config(tok.get_vocab_size(), bos, eos)
    from server.model.config import DeepseekConfig

    cfg = DeepseekConfig.from_hf(hf_cfg)
    model = train.init_model(cfg, s.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; training {s.steps} steps of {s.batch_size}x{s.seq_len}")
    t_train = time.time()
    history = train.train(model, rows, s, pad)
    train_seconds = time.time() - t_train
    export.write_model(model, out, hf_cfg, spec.generation_config(bos, eos))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB); training {train_seconds:.0f}s")

    res = run_eval(out, s, args.eval_n)
    info = {"parameters": n_params, "history": history, "train_seconds": train_seconds,
            "total_seconds": time.time() - t_start, "prose_tokens": prose_tokens, "rows": len(rows),
            "train_tokens": s.steps * s.batch_size * s.seq_len}
    write_card(out, s, hf_cfg, res, info)
    (out / "training_log.json").write_text(json.dumps(
        {"settings": s.as_dict(), "history": history, "eval": res.figures, "counts": res.counts,
         "train_seconds": round(train_seconds), "total_seconds": round(info["total_seconds"])}, indent=1) + "\n")
    ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
