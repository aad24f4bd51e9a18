"""Build the bundled demo model: corpus, tokenizer, joint main + MTP training, evaluation.

    .venv/bin/python -m training                 # full run (~80 min, 1 thread), writes models/deepseek-v3-tiny-mtp
    .venv/bin/python -m training --eval-only     # re-run the evaluation on the committed model
    .venv/bin/python -m training --no-copy-pretrain --stage3-from DIR --copy-steps 600   # EXPERIMENTAL: only stage 3 (copy), from an older stage-2 output

Run from the repository root.  Everything is offline and seeded (see training/spec.py);
the recipe's modules are in training/.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from server.text import special_tokens as st  # noqa: E402

from . import copy_heads, copy_layers, corpus, evaluate, export, render, spec, train  # noqa: E402
from .card import write_card  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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


def run_eval(out: Path, s: spec.TrainSettings, n: int, n_copy: int = 40) -> evaluate.EvalResult:
    from server.model.loading import load_checkpoint

    model, _info = load_checkpoint(out, dtype=torch.float32)
    res = evaluate.evaluate(model, out, seed=s.eval_seed, n_tool=n, n_think=n, n_plain=n, n_copy=n_copy)
    print(res.table())
    print(f"counts: {res.counts}  ({res.seconds:.0f}s)")
    for kind, texts in res.samples.items():
        for t in texts:
            print(f"  [{kind}] {t!r}")
    return res


def sft_data(tok, s: spec.TrainSettings, chats: list[str], encs) -> tuple:
    """Stage 2's rows from build_texts' chats and the encodings of chats + prose: loss only on
    what the assistant writes (and the prose), tool-argument values weighted sft_arg_weight;
    the copying drills (build_texts' last documents) dropped unless sft_drills."""
    pad = tok.token_to_id(st.PAD)
    docs = [e.ids for e in encs]
    n_drills = train.drill_count(s)
    if n_drills and not s.sft_drills:
        docs, encs = docs[:len(docs) - n_drills], encs[:len(encs) - n_drills]
    mask_of = train.assistant_masker(tok)
    masks = [mask_of(d) for d in docs[:len(chats)]]
    masks += [[True] * len(d) for d in docs[len(chats):]]
    if s.sft_arg_weight == 1.0:
        rows, keep = train.pack_rows(docs, s.seq_len, pad, seed=s.seed + 2, masks=masks)
        return rows, keep, None
    # tool-argument values (what a call copies from the prompt) weighted up
    weights = [train.copy_value_weights(t, e.offsets, s.sft_arg_weight) for t, e in zip(chats, encs)]
    weights += [[1.0] * len(d) for d in docs[len(chats):]]
    return train.pack_rows(docs, s.seq_len, pad, seed=s.seed + 2, masks=masks, weights=weights)


def copy_stage_data(tok, s: spec.TrainSettings, prose: list[str], seed: int, n_chats: int, n_drills: int,
                    base_tok=None):
    """Stage 3's rows: ``n_chats`` copy-stage chats (corpus.make_copy_chat), ``n_drills`` copying
    drills and ``prose``, with the name-splitting tokenizer ``tok``; loss on what the assistant
    writes (on every drill and prose token), tool-argument values weighted up. With ``base_tok``
    (copy_mixed_tokens) the assistant's own text but for the argument values, and the prose, are
    in ``base_tok``'s pieces (train.encode_mixed); the drills, which are copying, stay name-split."""
    import random

    rng = random.Random(seed)
    texts = [render.render_chat(corpus.make_copy_chat(rng, s.copy_city_share)) for _ in range(n_chats)]
    drills = [render.prose_text(corpus.copy_drill(rng)) for _ in range(n_drills)]
    mask_of = train.assistant_masker(tok)
    if base_tok is not None:
        mixed = [train.encode_mixed(t, tok, base_tok, mask_of, s.copy_arg_weight) for t in texts]
        docs = [m[0] for m in mixed] + [e.ids for e in base_tok.encode_batch(prose) + tok.encode_batch(drills)]
        masks = [m[1] for m in mixed]
        weights = [m[2] for m in mixed]
    else:
        encs = tok.encode_batch(texts + prose + drills)
        docs = [e.ids for e in encs]
        masks = [mask_of(d) for d in docs[:len(texts)]]
        weights = [train.copy_value_weights(t, e.offsets, s.copy_arg_weight) for t, e in zip(texts, encs)]
    masks += [[True] * len(d) for d in docs[len(texts):]]
    weights += [[1.0] * len(d) for d in docs[len(texts):]]
    return train.pack_rows(docs, s.seq_len, tok.token_to_id(st.PAD), seed=seed, masks=masks, weights=weights)


def appended_copy_stage(model, hf_cfg: dict, tok, rows, keep, weights, s: spec.TrainSettings, bos: int):
    """Stage 3 as copy_layers.py builds it: a previous-token layer and ``copy_append_layers``
    copy layers appended to the frozen stage-2 model; returns (model, its config, history)."""
    n_new = 1 + s.copy_append_layers
    model, hf_cfg = copy_layers.extend(model, hf_cfg, n_new, seed=s.seed + 4)
    t = time.time()
    trunk = copy_layers.trunk_outputs(model, rows, hf_cfg["num_hidden_layers"] - n_new)
    print(f"stage 3: {n_new} layers appended; the stage-2 output of {len(rows)} rows computed ({time.time() - t:.0f}s)")
    history = copy_layers.train_copy_layers(model, rows, keep, weights, trunk, copy_heads.name_token_classes(tok), bos,
                                            tok.token_to_id(st.ASSISTANT), s)
    return model, hf_cfg, [dict(h, stage="copy") for h in history]


def heads_copy_stage(model, tok, rows3, keep3, w3, s: spec.TrainSettings, s3: spec.TrainSettings, bos: int,
                     t3: float) -> list[dict]:
    """Stage 3 with copy heads inside the stage-2 layers (copy_heads.py; spec.py has why it is
    off): the value fit, head supervision, optional retention and the 3b pass; returns history."""
    classes = copy_heads.name_token_classes(tok)
    supervision = None
    teacher = None
    if s.copy_retain:               # the stage-2 weights, frozen, before the value fit changes them
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    if s.copy_value_init:
        ce, at_rest = copy_heads.fit_copy_values(model, rows3[:s.copy_fit_rows], classes, s.copy_layers,
                                                 s.copy_value_init, seed=s.seed + 5, bos_id=bos,
                                                 silence=s.copy_value_silence)
        print(f"copy heads: value path of head {copy_heads.HEAD} in layers {list(s.copy_layers)} fitted "
              f"(readout CE {ce:.3f}, {at_rest:.2f} of a name's size at rest) on {s.copy_fit_rows} rows; "
              f"{time.time() - t3:.0f}s")
    if s.copy_supervision:
        supervision = copy_heads.CopySupervision(model, classes, bos, s.copy_prev_layer, s.copy_layers,
                                                 s.copy_mtp_supervision, s.copy_value_weight, s.copy_sink_weight,
                                                 args_only=s.copy_args_only)
    history = [dict(h, stage="copy") for h in train.train(model, rows3, keep3, s3, weights=w3,
                                                          supervision=supervision,
                                                          supervision_weight=s.copy_supervision,
                                                          teacher=teacher, retain_weight=s.copy_retain)]
    if s.polish_steps > 0:          # stage 3b: new copy chats, no drills, a low rate, supervision kept
        rows_p, keep_p, w_p = copy_stage_data(tok, s, [render.prose_text(d) for d in corpus.prose_documents()],
                                              s.copy_corpus_seed + 1, s.polish_chats, 0)
        sp = dataclasses.replace(s, steps=s.polish_steps, lr=s.polish_lr, warmup_steps=s.polish_warmup_steps,
                                 mtp_distill=s.copy_mtp_distill, seed=s.seed + 6, stage="polish")
        print(f"stage 3b: {sp.steps} steps, {len(rows_p)} rows (no drills), lr {sp.lr:g}")
        history += [dict(h, stage="polish") for h in train.train(model, rows_p, keep_p, sp, weights=w_p,
                                                                 supervision=supervision,
                                                                 supervision_weight=s.copy_supervision,
                                                                 teacher=teacher, retain_weight=s.copy_retain)]
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--eval-only", action="store_true", help="evaluate the model in --out and exit")
    ap.add_argument("--eval-n", type=int, default=60, help="prompts per evaluation set (the card's figures)")
    ap.add_argument("--copy-eval-n", type=int, default=80, help="held-out city-copy prompts (the card's figures)")
    ap.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    ap.add_argument("--num-chats", type=int, default=None, help="override the number of synthetic chats")
    ap.add_argument("--sft-steps", type=int, default=None, help="override the number of stage-2 steps")
    ap.add_argument("--sft-lr", type=float, default=None, help="override the stage-2 peak learning rate")
    ap.add_argument("--sft-distill", type=float, default=None, help="override the stage-2 MTP distillation weight")
    ap.add_argument("--copy-steps", type=int, default=None, help="override the number of stage-3 steps (0: no stage 3)")
    ap.add_argument("--copy-lr", type=float, default=None, help="override the stage-3 peak learning rate")
    ap.add_argument("--copy-weight", type=float, default=None, help="override the stage-3 argument-value loss weight")
    ap.add_argument("--copy-chats", type=int, default=None, help="override the number of stage-3 chats")
    ap.add_argument("--copy-drills", type=int, default=None, help="override the number of stage-3 copying drills")
    ap.add_argument("--copy-pretrain", action=argparse.BooleanOptionalAction, default=None,
                    help="copying from stage 1 on: name-split tokenizer, copy chats, drills (default: the settings')")
    ap.add_argument("--pretrain-drills", type=int, default=None, help="override the number of stage-1 copying drills")
    ap.add_argument("--sft-arg-weight", type=float, default=None,
                    help="override the stage-2 loss weight of tool-argument values")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the settings')")
    ap.add_argument("--stage2-from", type=Path, default=None,
                    help="skip stage 1: take tokenizer and weights from this earlier output folder")
    ap.add_argument("--stage3-from", type=Path, default=None,
                    help="skip stages 1 and 2: take tokenizer and weights from this stage-2 output folder")
    ap.add_argument("--no-eval", action="store_true", help="skip the evaluation (probes)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override any spec.TrainSettings field (repeatable; tuples as 2,3,4)")
    args = ap.parse_args(argv)

    s = spec.TrainSettings()
    overrides = {"steps": args.steps, "sft_steps": args.sft_steps, "num_chats": args.num_chats,
                 "sft_mtp_distill": args.sft_distill, "threads": args.threads, "sft_lr": args.sft_lr,
                 "copy_steps": args.copy_steps, "copy_lr": args.copy_lr, "copy_arg_weight": args.copy_weight,
                 "copy_chats": args.copy_chats, "copy_drills": args.copy_drills,
                 "copy_pretrain": args.copy_pretrain, "pretrain_drills": args.pretrain_drills,
                 "sft_arg_weight": args.sft_arg_weight}
    s = dataclasses.replace(s, **{k: v for k, v in overrides.items() if v is not None})
    try:
        s = spec.with_overrides(s, args.set)
    except ValueError as e:
        ap.error(str(e))
    if s.copy_heads_from_start and not s.copy_pretrain:
        ap.error("copy_heads_from_start needs --copy-pretrain (the name-split tokenizer from the start)")
    setup(s.threads, s.seed)
    out: Path = args.out
    if args.eval_only:
        res = run_eval(out, s, args.eval_n, args.copy_eval_n)
        ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
        return 0 if ok else 1
    if args.stage2_from and args.stage3_from:
        ap.error("--stage2-from and --stage3-from exclude each other")

    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    chats, prose = train.build_texts(s)
    prior = args.stage3_from or args.stage2_from
    if prior:                                 # reuse the tokenizer and weights of an earlier run
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(prior / "tokenizer.json"))
        if render.has_name_split(tok) != s.copy_pretrain:
            raise SystemExit(f"{prior}'s tokenizer {'has' if render.has_name_split(tok) else 'lacks'} the name-split "
                             f"rule; copy_pretrain is {s.copy_pretrain} (a stage-3 output, or the other corpus?)")
        if render.has_spelt_names(tok) != s.spell_names:
            raise SystemExit(f"{prior}'s tokenizer {'spells' if render.has_spelt_names(tok) else 'does not spell'} "
                             f"names; spell_names is {s.spell_names}")
    else:
        tok = render.train_tokenizer(chats + prose, s.vocab_size, name_split=s.copy_pretrain,
                                     spell_names=s.spell_names)
    ids = {k: tok.token_to_id(v) for k, v in spec.SPECIALS.items()}
    bos, eos, pad = ids["bos"], ids["eos"], ids["pad"]
    encs = tok.encode_batch(chats + prose)
    docs = [e.ids for e in encs]
    prose_tokens = sum(len(d) for d in docs[len(chats):])
    rows, keep = train.pack_rows(docs, s.seq_len, pad, seed=s.seed)
    print(f"corpus: {len(chats)} chats, {len(prose)} prose docs ({prose_tokens} tokens), {len(rows)} rows "
          f"of {s.seq_len}; vocab {tok.get_vocab_size()} ({time.time() - t_start:.0f}s)")

    hf_cfg = spec.hf_config(tok.get_vocab_size(), bos, eos)
    from server.model.config import DeepseekConfig

    cfg = DeepseekConfig.from_hf(hf_cfg)
    model = train.init_model(cfg, s.seed)
    n_params = sum(p.numel() for p in model.parameters())
    history_prev: list[dict] = []
    early = None                 # copy heads supervised from stage 1 on (copy_heads_from_start)
    if s.copy_heads_from_start:
        early = copy_heads.CopySupervision(model, copy_heads.name_token_classes(tok), bos, s.copy_prev_layer,
                                           s.copy_layers, s.copy_mtp_supervision, s.copy_value_weight,
                                           s.copy_sink_weight, aligned=s.copy_aligned)
    if prior:
        from safetensors.torch import load_file

        state = load_file(str(prior / "model.safetensors"))
        state.pop(f"model.layers.{cfg.num_hidden_layers}.embed_tokens.weight")
        model.load_state_dict(state, strict=True)
        log1 = json.loads((prior / "training_log.json").read_text())
        seconds1 = float(log1["train_seconds"])
        prior_stage_s = log1.get("stage_seconds", [seconds1])
        prior_sft = log1.get("sft_runs")
        if prior_sft is None and len(prior_stage_s) > 1:      # folder written before sft_runs was logged
            ps = log1["settings"]
            prior_sft = [{"steps": ps["sft_steps"], "lr": ps["sft_lr"], "warmup_steps": ps["sft_warmup_steps"],
                          "seed": ps["seed"] + 2, "seconds": prior_stage_s[1]}]
        prior_sft = prior_sft or []
        if args.stage3_from:
            if log1.get("copy_run") or not prior_sft:
                raise SystemExit(f"{prior} is not a stage-2 output")
            history_prev = log1["history"]
        else:
            if log1.get("copy_run"):
                raise SystemExit(f"{prior} is a stage-3 output; give a stage-1/2 output")
            history_prev = [{"stage": "pretrain", **h} for h in log1["history"]]
        print(f"weights from {prior} ({seconds1:.0f}s of training there)")
    else:
        print(f"model: {n_params / 1e6:.2f} M parameters; stage 1: {s.steps} steps of {s.batch_size}x{s.seq_len}")
        t1 = time.time()
        history_prev = [{"stage": "pretrain", **h} for h in train.train(model, rows, keep, dataclasses.replace(s, stage="pretrain"),
                                                                         supervision=early,
                                                                         supervision_weight=s.copy_supervision)]
        prior_stage_s, prior_sft = [time.time() - t1], []

    # Stage 2: loss only on assistant-written tokens (and prose), fresh optimizer.
    rows2, keep2, w2 = sft_data(tok, s, chats, encs)
    del encs, docs
    if args.stage3_from:
        stage_seconds, sft_runs = list(prior_stage_s), prior_sft
        history = history_prev
        s2 = dataclasses.replace(s, mtp_distill=prior_sft[-1].get("mtp_distill", s.sft_mtp_distill))
    else:
        s2 = dataclasses.replace(s, steps=s.sft_steps, lr=s.sft_lr, warmup_steps=s.sft_warmup_steps,
                                 mtp_distill=s.sft_mtp_distill, seed=s.seed + 2 + len(prior_sft), stage="sft")
        print(f"stage 2: {s2.steps} steps, {int(keep2.sum())} of {keep2.numel()} tokens are targets")
        t2 = time.time()
        history2 = train.train(model, rows2, keep2, s2, weights=w2, supervision=early,
                               supervision_weight=s.copy_supervision)
        seconds2 = time.time() - t2
        sft_runs = prior_sft + [{"steps": s2.steps, "lr": s2.lr, "warmup_steps": s2.warmup_steps, "seed": s2.seed,
                                 "mtp_distill": s2.mtp_distill, "arg_weight": s.sft_arg_weight, "seconds": seconds2}]
        stage_seconds = list(prior_stage_s) + [seconds2]
        history = history_prev + [dict(h, stage=f"sft{len(sft_runs)}") for h in history2]
        if s.refresh_steps and not s.wide_topics:
            # Stage 2b: a second SFT run on the corpus rebuilt with wide search topics (spec.py),
            # exactly what --stage2-from <stage-2 output> --set wide_topics=1 runs.
            sr = dataclasses.replace(s, wide_topics=True)
            chats_r, prose_r = train.build_texts(sr)
            rows_r, keep_r, w_r = sft_data(tok, sr, chats_r, tok.encode_batch(chats_r + prose_r))
            del chats_r, prose_r
            s2 = dataclasses.replace(s2, steps=s.refresh_steps, lr=s.refresh_lr, seed=s.seed + 2 + len(sft_runs))
            print(f"stage 2b: {s2.steps} steps, {int(keep_r.sum())} of {keep_r.numel()} tokens are targets "
                  "(search requests over wide topics)")
            t2 = time.time()
            history2 = train.train(model, rows_r, keep_r, s2, weights=w_r, supervision=early,
                                   supervision_weight=s.copy_supervision)
            seconds2 = time.time() - t2
            sft_runs = sft_runs + [{"steps": s2.steps, "lr": s2.lr, "warmup_steps": s2.warmup_steps, "seed": s2.seed,
                                    "mtp_distill": s2.mtp_distill, "arg_weight": s.sft_arg_weight,
                                    "wide_topics": True, "refresh": True, "seconds": seconds2}]
            stage_seconds = stage_seconds + [seconds2]
            history = history + [dict(h, stage=f"sft{len(sft_runs)}") for h in history2]

    # Stage 3: copy the city from the prompt (name-splitting tokenizer, weighted argument values).
    copy_run = None
    copy_targets = 0
    if s.copy_steps > 0:
        torch.set_num_threads(s.copy_threads)
        base_tok = tok if s.copy_mixed_tokens else None
        tok = render.with_name_split(tok)
        n_piece_names = corpus.use_piece_names(tok, s.copy_piece_name_count) if s.copy_piece_names else 0
        t3 = time.time()
        prose3 = [render.prose_text(d) for d in corpus.prose_documents()][:s.copy_prose_docs or None]
        rows3, keep3, w3 = copy_stage_data(tok, s, prose3, s.copy_corpus_seed, s.copy_chats, s.copy_drills,
                                              base_tok)
        copy_targets = int(keep3.sum())
        s3 = dataclasses.replace(s, steps=s.copy_steps, lr=s.copy_lr, warmup_steps=s.copy_warmup_steps,
                                 mtp_distill=s.copy_mtp_distill, seed=s.seed + 3, stage="copy")
        print(f"stage 3: {s3.steps} steps, {len(rows3)} rows, {copy_targets} targets "
              f"({int((w3 > 1).sum())} argument-value tokens at weight {s.copy_arg_weight:g}); "
              f"data {time.time() - t3:.0f}s")
        t3 = time.time()
        if s.copy_append_layers:
            model, hf_cfg, history3 = appended_copy_stage(model, hf_cfg, tok, rows3, keep3, w3, s, bos)
            n_params = sum(p.numel() for p in model.parameters())
        else:
            history3 = heads_copy_stage(model, tok, rows3, keep3, w3, s, s3, bos, t3)
        seconds3 = time.time() - t3
        copy_run = {"steps": s3.steps, "lr": s3.lr, "warmup_steps": s3.warmup_steps, "seed": s3.seed,
                    "mtp_distill": s3.mtp_distill, "arg_weight": s.copy_arg_weight, "chats": s.copy_chats,
                    "corpus_seed": s.copy_corpus_seed, "rows": len(rows3), "drills": s.copy_drills,
                    "piece_names": n_piece_names,
                    "city_share": s.copy_city_share,
                    "prev_layer": s.copy_prev_layer, "copy_layers": list(s.copy_layers),
                    "mtp_supervision": s.copy_mtp_supervision, "supervision": s.copy_supervision,
                    "value_weight": s.copy_value_weight, "value_init": s.copy_value_init, "value_silence": s.copy_value_silence,
                    "sink_weight": s.copy_sink_weight, "retain": s.copy_retain, "args_only": s.copy_args_only,
                    "append_layers": s.copy_append_layers, "mtp_retain": s.copy_mtp_retain,
                    "chat_ce": s.copy_chat_ce, "mtp_train": s.copy_mtp_train, "mtp_lr": s.copy_mtp_lr,
                    "all_names": s.copy_all_names, "mixed_tokens": s.copy_mixed_tokens,
                    "train_mlp": s.copy_train_mlp,
                    "prose_docs": len(prose3),
                    "polish_steps": 0 if s.copy_append_layers else s.polish_steps, "polish_lr": s.polish_lr, "polish_chats": s.polish_chats,
                    "seconds": seconds3}
        stage_seconds = stage_seconds + [seconds3]
        torch.set_num_threads(s.threads)
        history = history + history3
    train_seconds = sum(stage_seconds)
    render.write_tokenizer_files(tok, out, model_max_length=1024)
    export.write_model(model, out, hf_cfg, spec.generation_config(bos, eos))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB); "
          f"training {' + '.join(f'{x:.0f}s' for x in stage_seconds)}")
    if args.no_eval:
        return 0

    res = run_eval(out, s, args.eval_n, args.copy_eval_n)
    sft_steps_all = sum(r["steps"] for r in sft_runs)
    info = {"parameters": n_params, "history": history, "train_seconds": train_seconds,
            "stage_seconds": stage_seconds, "sft_runs": sft_runs, "sft_targets": int(keep2.sum()),
            "copy_run": copy_run, "copy_targets": copy_targets,
            "total_seconds": time.time() - t_start, "prose_tokens": prose_tokens, "rows": len(rows),
            "train_tokens": (s.steps + sft_steps_all + (copy_run["steps"] if copy_run else 0)) * s.batch_size * s.seq_len,
            "sft_distill": s2.mtp_distill, "cpu": cpu_name(),
            "stage3_from": str(args.stage3_from) if args.stage3_from else None,
            "stage3_base_sha256": (hashlib.sha256((args.stage3_from / "model.safetensors").read_bytes()).hexdigest()
                                   if args.stage3_from else None)}
    write_card(out, s, hf_cfg, res, info)
    (out / "training_log.json").write_text(json.dumps(
        {"settings": s.as_dict(), "history": history, "eval": res.figures, "counts": res.counts,
         "train_seconds": round(train_seconds), "stage_seconds": [round(x) for x in stage_seconds], "sft_runs": sft_runs,
         "copy_run": copy_run, "stage3_base_sha256": info["stage3_base_sha256"],
         "total_seconds": round(info["total_seconds"])}, indent=1) + "\n")
    ok = all(res.figures[k] >= v for k, v in evaluate.TARGETS.items())
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
