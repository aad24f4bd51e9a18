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
from server.text import special_tokens as st  # noqa: E402

DEFAULT_OUT = ROOT / "models" / "deepseek-v3-tiny-mtp"


def setup(threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def cpu_name() -> str:
    """The CPU's model name (for the card: training time depends on it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


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
    ap.add_argument("--sft-steps", type=int, default=None, help="override the number of stage-2 steps")
    ap.add_argument("--sft-lr", type=float, default=None, help="override the stage-2 peak learning rate")
    ap.add_argument("--sft-distill", type=float, default=None, help="override the stage-2 MTP distillation weight")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the settings')")
    ap.add_argument("--stage2-from", type=Path, default=None,
                    help="skip stage 1: take tokenizer and weights from this earlier output folder")
    args = ap.parse_args()

    s = spec.TrainSettings()
    if args.steps is not None:
        s = dataclasses.replace(s, steps=args.steps)
    if args.sft_steps is not None:
        s = dataclasses.replace(s, sft_steps=args.sft_steps)
    if args.num_chats is not None:
        s = dataclasses.replace(s, num_chats=args.num_chats)
    if args.sft_distill is not None:
        s = dataclasses.replace(s, sft_mtp_distill=args.sft_distill)
    if args.threads is not None:
        s = dataclasses.replace(s, threads=args.threads)
    setup(s.threads, s.seed)
    out: Path = args.out
    if args.eval_only:
        res = run_eval(out, s, args.eval_n)
        ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
        return 0 if ok else 1

    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    chats, prose = train.build_texts(s)
    if args.stage2_from:                      # reuse the tokenizer and weights of a stage-1 run
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(args.stage2_from / "tokenizer.json"))
    else:
        tok = render.train_tokenizer(chats + prose, s.vocab_size)
    render.write_tokenizer_files(tok, out, model_max_length=1024)
    ids = {k: tok.token_to_id(v) for k, v in spec.SPECIALS.items()}
    bos, eos, pad = ids["bos"], ids["eos"], ids["pad"]
    docs = [e.ids for e in tok.encode_batch(chats + prose)]
    prose_tokens = sum(len(d) for d in docs[len(chats):])
    rows, keep = train.pack_rows(docs, s.seq_len, pad, seed=s.seed)
    print(f"corpus: {len(chats)} chats, {len(prose)} prose docs ({prose_tokens} tokens), {len(rows)} rows "
          f"of {s.seq_len}; vocab {tok.get_vocab_size()} ({time.time() - t_start:.0f}s)")

    hf_cfg = spec.hf_config(tok.get_vocab_size(), bos, eos)
    from server.model.config import DeepseekConfig

    cfg = DeepseekConfig.from_hf(hf_cfg)
    model = train.init_model(cfg, s.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if args.stage2_from:
        from safetensors.torch import load_file

        state = load_file(str(args.stage2_from / "model.safetensors"))
        state.pop(f"model.layers.{cfg.num_hidden_layers}.embed_tokens.weight")
        model.load_state_dict(state, strict=True)
        log1 = json.loads((args.stage2_from / "training_log.json").read_text())
        history1, seconds1 = log1["history"], float(log1["train_seconds"])
        prior_stage_s = log1.get("stage_seconds", [seconds1])
        prior_sft = log1.get("sft_runs")
        if prior_sft is None and len(prior_stage_s) > 1:      # folder written before sft_runs was logged
            ps = log1["settings"]
            prior_sft = [{"steps": ps["sft_steps"], "lr": ps["sft_lr"], "warmup_steps": ps["sft_warmup_steps"],
                          "seed": ps["seed"] + 2, "seconds": prior_stage_s[1]}]
        prior_sft = prior_sft or []
        print(f"stage 1 weights from {args.stage2_from} ({seconds1:.0f}s of training there)")
    else:
        print(f"model: {n_params / 1e6:.2f} M parameters; stage 1: {s.steps} steps of {s.batch_size}x{s.seq_len}")
        t1 = time.time()
        history1 = train.train(model, rows, keep, dataclasses.replace(s, stage="pretrain"))
        seconds1 = time.time() - t1
        prior_stage_s, prior_sft = [seconds1], []

    # Stage 2: loss only on assistant-written tokens (and prose), fresh optimizer.
    tok_id = tok.token_to_id
    masks = [train.assistant_mask(d, tok_id(st.ASSISTANT), tok_id(st.TOOL_OUTPUTS_END), tok_id(st.THINK_START),
                                  tok_id("\u010a"), eos) for d in docs[:len(chats)]]
    masks += [[True] * len(d) for d in docs[len(chats):]]
    rows2, keep2 = train.pack_rows(docs, s.seq_len, pad, seed=s.seed + 2, masks=masks)
    if args.sft_lr is not None:
        s = dataclasses.replace(s, sft_lr=args.sft_lr)
    s2 = dataclasses.replace(s, steps=s.sft_steps, lr=s.sft_lr, warmup_steps=s.sft_warmup_steps,
                             mtp_distill=s.sft_mtp_distill, seed=s.seed + 2 + len(prior_sft), stage="sft")
    print(f"stage 2: {s2.steps} steps, {int(keep2.sum())} of {keep2.numel()} tokens are targets")
    t2 = time.time()
    history2 = train.train(model, rows2, keep2, s2)
    seconds2 = time.time() - t2
    stage_seconds = list(prior_stage_s) + [seconds2]
    sft_runs = prior_sft + [{"steps": s2.steps, "lr": s2.lr, "warmup_steps": s2.warmup_steps, "seed": s2.seed,
                             "mtp_distill": s2.mtp_distill, "seconds": seconds2}]
    train_seconds = sum(stage_seconds)
    history = [{"stage": "pretrain", **h} for h in history1] + [dict(h, stage=f"sft{len(sft_runs)}") for h in history2]
    export.write_model(model, out, hf_cfg, spec.generation_config(bos, eos))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB); "
          f"training {seconds1:.0f}s + {seconds2:.0f}s")

    res = run_eval(out, s, args.eval_n)
    info = {"parameters": n_params, "history": history, "train_seconds": train_seconds,
            "stage_seconds": stage_seconds, "sft_runs": sft_runs, "sft_targets": int(keep2.sum()),
            "total_seconds": time.time() - t_start, "prose_tokens": prose_tokens, "rows": len(rows),
            "train_tokens": (s.steps + sum(r["steps"] for r in sft_runs)) * s.batch_size * s.seq_len,
            "sft_distill": s2.mtp_distill, "cpu": cpu_name()}
    write_card(out, s, hf_cfg, res, info)
    (out / "training_log.json").write_text(json.dumps(
        {"settings": s.as_dict(), "history": history, "eval": res.figures, "counts": res.counts,
         "train_seconds": round(train_seconds), "stage_seconds": [round(x) for x in stage_seconds], "sft_runs": sft_runs,
         "total_seconds": round(info["total_seconds"])}, indent=1) + "\n")
    ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
