"""lm-evaluation-harness against the daemon, end to end, on a small local data file.

Starts a daemon on the demo model (MTP k=1, conf/config.json), runs lm-eval's
``local-completions`` model on ``benchmarks/eval_data/capitals.yaml`` (8 multiple-choice
questions scored by loglikelihood: lm-eval sends ``echo: true, logprobs: 1,
max_tokens: 1`` with token-id prompts to /v1/completions and sums the prompt-token
logprobs of each choice), then checks every loglikelihood lm-eval logged against the
same sum computed in process from an engine with MTP off (within 1e-4).

    pip install -e '.[eval]'          # lm-eval is heavy: its own extra, not the test extra
    python -m benchmarks.lm_eval [--keep DIR]

Exit status 0 when lm-eval finished and every loglikelihood matched.  No network: the
data file is local and the tokenizer is the model folder's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import DEFAULT_CONFIG, start_daemon, stop_daemon
from server.testing.daemon import DEMO_MODEL as WEIGHTS

DATA = Path(__file__).resolve().parent / "eval_data"
TOL = 1e-4


def write_task(folder: Path) -> None:
    text = (DATA / "capitals.yaml").read_text().replace("DATA_FILE", str(DATA / "capitals.jsonl"))
    (folder / "capitals.yaml").write_text(text)


def run_lm_eval(base_url: str, model: str, task_dir: Path, out_dir: Path) -> Path:
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
            "--model_args", ",".join([
                f"model={model}", f"base_url={base_url}/v1/completions",
                "tokenizer_backend=huggingface", f"tokenizer={WEIGHTS}", "tokenized_requests=True",
                "num_concurrent=2", "max_retries=1", "timeout=120"]),
            "--tasks", "mtp_serve_capitals", "--include_path", str(task_dir), "--batch_size", "4",
            "--output_path", str(out_dir), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(args, env=env, cwd=out_dir, capture_output=True, text=True)
    if proc.returncode != 0 and "invalid choice: 'run'" in proc.stderr:   # lm-eval < 0.4.10
        proc = subprocess.run([a for a in args if a != "run"], env=env, cwd=out_dir,
                              capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-4000:])
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    samples = sorted(out_dir.rglob("samples_mtp_serve_capitals*.jsonl"))
    if not samples:
        raise SystemExit(f"lm_eval wrote no samples under {out_dir}")
    return samples[-1]


def reference_loglikelihoods(pairs: list[tuple[str, str]]) -> list[float]:
    """sum log p(continuation | context) with MTP off, tokenized as lm-eval does (context
    and context + continuation encoded separately, the continuation the tokens after the
    context's)."""
    from transformers import AutoTokenizer

    from server.engine.config import EngineConfig
    from server.engine.core import LLMEngine
    from server.engine.protocol import EngineRequest, SamplingParams
    from server.model.loading import load_checkpoint
    tok = AutoTokenizer.from_pretrained(WEIGHTS)
    model, _ = load_checkpoint(WEIGHTS)
    eng = LLMEngine(model.eval(), EngineConfig(num_speculative_tokens=0, num_blocks=256,
                                               max_seq_len=1024, max_queue_delay_us=0),
                    eos_token_ids=set())
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
        ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
        n_ctx = len(ctx_ids)
        if whole[:n_ctx] != ctx_ids:               # lm-eval splits at the context's length too
            n_ctx = len(tok(ctx.rstrip(), add_special_tokens=False)["input_ids"])
        res = eng.generate([EngineRequest(f"r{i}", whole, SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0))])[f"r{i}"]
        lps = res[0].prompt_logprobs
        out.append(sum(lp.logprob for lp in lps[n_ctx:]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="keep lm-eval's output here")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    target = start_daemon("eval", args.config_file, 1, args.threads,
                          extra_env={"MTP_SERVE_COMPILE": "0"})
    try:
        import asyncio
        write_task(work)
        samples = run_lm_eval(target.base_url, asyncio.run(harness.model_id(target)), work, work)
    finally:
        stop_daemon(target)
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    pairs, got = [], []
    for row in rows:
        args_ = row["arguments"]            # {"gen_args_0": {"arg_0": ctx, "arg_1": cont}, ...}
        for arg, resp in zip(args_.values() if isinstance(args_, dict) else args_, row["resps"]):
            ctx, cont = (arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else arg
            pairs.append((ctx, cont))
            got.append(float(resp[0][0]))
    want = reference_loglikelihoods(pairs)
    worst = max(abs(a - b) for a, b in zip(got, want))
    acc = sum(row["acc"] for row in rows) / len(rows)
    print(f"lm-eval local-completions: {len(rows)} questions, {len(got)} loglikelihood requests, "
          f"acc {acc:.3f}; max |daemon (MTP k=1) - engine (MTP off)| = {worst:.2e}")
    if args.keep:
        shutil.copytree(work, args.keep, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    if not all(math.isfinite(x) for x in got) or worst > TOL:
        print(f"FAIL: loglikelihoods differ by more than {TOL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
