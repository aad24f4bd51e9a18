"""Predicted Outputs against MTP alone (``python -m benchmarks.prediction``, or
``benchmarks.serve --compare prediction [--realistic 0.5b]``).

One daemon with MTP k=1 per ``MTP_SERVE_PREDICTION_TOKENS`` value asked (``--prediction-tokens``,
default the daemon's 64).  Each prompt of the prompt set is asked once without a
prediction (its answer: greedy, ``max_tokens`` tokens, EOS ignored), then asked again,
one request at a time, four ways that alternate so machine drift hits each alike:

  none       no prediction: MTP k=1 alone, the baseline of every ratio;
  own        its own previous answer as the prediction (the edit-nothing case);
  edited     that answer with every 10th word replaced (about 10% of its tokens);
  unrelated  a fixed English paragraph no answer contains (no loss allowed).

Every answer should equal the first one (a prediction changes no token); in bf16 a
near-tie can flip with the window's shape, as it can between MTP off and k=1, so the table
gives the share of answers equal to the first ask for each kind (``none`` included) and
the run fails only where a prediction kind has fewer than ``none``.  Also: output
tokens/s (medians over --reps), the ratio to ``none``, and the prediction tokens the
usage reported accepted and rejected.
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.harness import RequestResult, Target, burst_of, start_daemon, stop_daemon

KINDS = ("none", "own", "edited", "unrelated")
UNRELATED = ("The committee met on Tuesday to review the budget for the new library wing. "
             "After a long discussion about shelving, lighting and the reading room, members "
             "agreed to postpone the vote until the architect sends revised drawings next month.")


def edited(text: str, every: int = 10) -> str:
    """``text`` with every ``every``-th word (from the 5th) replaced by one it lacks."""
    words = text.split(" ")
    for i in range(min(4, len(words) - 1), len(words), every):
        words[i] = "zebra" if words[i] != "zebra" else "quartz"
    return " ".join(words)


def _predictions(answers: list[str]) -> dict[str, list[str | None]]:
    n = len(answers)
    return {"none": [None] * n, "own": list(answers), "edited": [edited(a) for a in answers],
            "unrelated": [UNRELATED] * n}


def _request(base_url: str, model: str, prompts: list[list[dict]], predictions: list[str | None],
             answers: list[str | None], max_tokens: int, usage: list[dict]) -> harness.Request:
    """Prompt i, whole (not streamed), greedy, to ``max_tokens``; valid: the answer equals
    ``answers[i]`` (None: not checked, the answers are being collected)."""
    async def request(client: httpx.AsyncClient, i: int) -> RequestResult:
        body = {"model": model, "messages": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        if predictions[i] is not None:
            body["prediction"] = {"type": "content", "content": predictions[i]}
        data, latency = await harness.post_chat(client, base_url, body)
        text = data["choices"][0]["message"]["content"] or ""
        usage.append(data["usage"])
        if answers[i] is None:
            answers[i] = text
        return RequestResult(latency, latency, data["usage"]["completion_tokens"],
                             data["usage"]["prompt_tokens"],
                             None if answers[i] is text else text == answers[i])
    return request


def _prediction_counts(usage: list[dict]) -> dict:
    det = [u.get("completion_tokens_details") or {} for u in usage]
    spec = [u.get("speculative") or {} for u in usage]
    return {"accepted_prediction_tokens": sum(d.get("accepted_prediction_tokens", 0) for d in det),
            "rejected_prediction_tokens": sum(d.get("rejected_prediction_tokens", 0) for d in det),
            "mtp_draft_tokens": sum(s.get("mtp_draft_tokens", 0) for s in spec),
            "mtp_accepted_tokens": sum(s.get("mtp_accepted_tokens", 0) for s in spec),
            "completion_tokens": sum(u["completion_tokens"] for u in usage)}


def run(args) -> int:
    reps = args.reps or (1 if args.quick else 3)
    n_prompts = args.requests or (4 if args.quick else 8)
    prompts = harness.load_prompts()["prompts"][:n_prompts]
    values = [int(v) for v in (getattr(args, "prediction_tokens", None) or "64").split(",")]
    realistic = getattr(args, "model", None) is not None
    compile_dir = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    env = ({"MTP_SERVE_COMPILE_WAIT": "1", "MTP_SERVE_COMPILE_CACHE": str(compile_dir / "run"),
            "TORCHINDUCTOR_CACHE_DIR": str(compile_dir / "run-inductor")} if realistic else {})
    targets: list[Target] = []
    raw: dict[str, dict[str, list[dict]]] = {}
    counts: dict[str, dict[str, dict]] = {}
    answers: list[str | None] = [None] * len(prompts)
    try:
        for p in values:
            print(f"starting daemon P={p} ...", file=sys.stderr)
            targets.append(start_daemon(f"P{p}", args.config_file, 1, args.threads,
                                        weights=getattr(args, "model", None),
                                        extra_env={**env, "MTP_SERVE_PREDICTION_TOKENS": str(p)},
                                        timeout=1800.0 if realistic else 300.0))
        model = asyncio.run(harness.model_id(targets[0]))
        warm = {t.name: harness.chat_warm_up(t, model, prompts) for t in targets}
        first: list[dict] = []
        asyncio.run(burst_of(targets[0], 1, len(prompts), _request(
            targets[0].base_url, model, prompts, [None] * len(prompts), answers, args.max_tokens, first)))
        preds = _predictions([a or "" for a in answers])
        for t in targets:
            raw[t.name] = {kind: [] for kind in KINDS}
            counts[t.name] = {kind: [] for kind in KINDS}
        for _ in range(reps):
            for t in targets:
                for kind in KINDS:               # alternate so drift hits every kind
                    usage: list[dict] = []
                    r = asyncio.run(burst_of(t, 1, len(prompts), _request(
                        t.base_url, model, prompts, preds[kind], answers, args.max_tokens, usage)))
                    raw[t.name][kind].append(r)
                    counts[t.name][kind].append(_prediction_counts(usage))
                    print(f"  {t.name} {kind}: {r['output_tok_s']:.1f} tok/s, same answers "
                          f"{r['valid']:.2f}", file=sys.stderr)
    finally:
        for t in targets:
            stop_daemon(t)
    med = {name: {kind: harness.medians(runs) for kind, runs in per.items()} for name, per in raw.items()}
    what = f"model {args.model.name}" if realistic else "demo model"
    print(f"\nPredicted Outputs, MTP k=1, concurrency 1, {what}, {harness.machine()}, {reps} rep(s), "
          f"{len(prompts)} prompts x {args.max_tokens} tokens")
    print(f"{'P':>4} {'kind':>10} {'tok/s':>8} {'x none':>7} {'same answer':>12} "
          f"{'pred accepted':>14} {'pred rejected':>14} {'MTP accept':>11}")
    for name in med:
        base = med[name]["none"]["output_tok_s"]
        for kind in KINDS:
            m, c = med[name][kind], counts[name][kind][-1]
            mtp = c["mtp_accepted_tokens"] / c["mtp_draft_tokens"] if c["mtp_draft_tokens"] else 0.0
            print(f"{name[1:]:>4} {kind:>10} {m['output_tok_s']:>8.1f} {m['output_tok_s'] / base:>6.2f}x "
                  f"{m['valid']:>12.2f} {c['accepted_prediction_tokens']:>14} "
                  f"{c['rejected_prediction_tokens']:>14} {mtp:>11.2f}")
    print("warm-up (4 requests of 8 tokens, not in the medians): " + ", ".join(
        f"{n} {w['output_tok_s']:.1f} tok/s" for n, w in warm.items()))
    ratios = {name: {kind: med[name][kind]["output_tok_s"] / med[name]["none"]["output_tok_s"]
                     for kind in KINDS} for name in med}
    harness.save_report({**harness.report_header(reps=reps, max_tokens=args.max_tokens,
                                                 model=what, prompts=len(prompts)),
                         "results": med, "ratios": ratios, "prediction_counts": counts,
                         "warmup": warm, "start_s": {t.name: t.start_s for t in targets}}, args.json)
    bad = [f"{n} {k}" for n in med for k in KINDS
           if (med[n][k]["valid"] or 0) < (med[n]["none"]["valid"] or 0)]
    if bad:
        print(f"ANSWERS CHANGED WITH A PREDICTION: {bad}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "concurrency 1 only")
    ap.add_argument("--prediction-tokens", default="64",
                    help="comma-separated MTP_SERVE_PREDICTION_TOKENS values, one daemon each")
    ap.add_argument("--requests", type=int, default=None, help="prompts (default 8; 4 with --quick)")
    ap.add_argument("--model", type=Path, default=None, help="serve this checkpoint folder")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
