"""llama.cpp beside us on the same weights, in one run: decode at batch 1 and 8, and a
256-token prompt, bf16 and int8, each row as tokens/s and as a share of the memory's
read bandwidth (read in this process before every timed job, ``harness.memory_bandwidth_gbps``;
the shares are against the median reading, ``memory_yardstick``).

The peer: llama.cpp from the llama-cpp-python 0.3.36 sdist on PyPI (its vendor/llama.cpp,
with ``convert_hf_to_gguf.py`` and ``gguf-py``), built only when asked (``--build``):

  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
  cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
  cmake --build build -j2 --target llama-bench llama-batched-bench

(several minutes on 2 cores, under ``nice -n 10``).  The realistic checkpoints
(benchmarks.models) are converted to GGUF bf16 and q8_0 with llama.cpp's own converter
(its DeepseekV3 class drops the MTP layer).  A tokenizer whose pre-tokenizer hash the
converter does not know is refused; then a local copy of the converter maps that hash to
"default" (tokenization only, not speed).  Everything lives under ``.cache/peers/``
(git-ignored; never built by the test suite).

Rows, every timed run alone and peer / ours alternating over ``--reps`` rounds:
  llama.cpp  ``llama-bench -t T -p 0 -n 64 -r 3`` (decode, batch 1),
             ``llama-bench -t T -p 256 -n 0 -r 3`` (256-token prompt),
             ``llama-batched-bench -t T -npp 32 -ntg 64 -npl 1,8`` (decode of 8 sequences: S_TG),
             on the bf16 and q8_0 GGUF files;
  ours       benchmarks.engine_step's engines (compiled step): decode at batch 1 and 8 with
             MTP off, k=1 and k=2 on the bf16 checkpoint, off and k=1 on its W8A8_DYNAMIC
             copy; the 256-token prompt (one prefill step of the engine, MTP off).  Batch 1
             and the prompt are the mean of 3 runs a round as llama-bench's -r 3, batch 8
             one run as llama-batched-bench.  Decode prompts are random ids, as
             llama.cpp's; batch 1 again on the bench prompts (``TEXT_B1``: what a draft's
             acceptance is on text), set against llama.cpp's batch-1 row.

Usage (from the repository root):
  python -m benchmarks.peers --build                 # get and build llama.cpp, convert, then run
  python -m benchmarks.peers --reps 3 --json peers_0.5b.json
  python -m benchmarks.peers --build --no-run        # only the build and the conversions

Each row: tokens/s (median over the rounds), the weight bytes a step reads
(harness.step_weight_bytes for ours; the GGUF's tensors for llama.cpp, its expected
experts at the batch), that rate's share of the memory's read bandwidth (bytes x steps/s
/ bandwidth), and ours / llama.cpp on the same row.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks import harness
from server.testing.daemon import ROOT

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = ROOT / ".cache" / "peers"
MODELS = ROOT / ".cache" / "bench-models"
BF16_MODEL = MODELS / "deepseek-v3-0.5b-mtp"
INT8_MODEL = MODELS / "deepseek-v3-0.5b-mtp-w8a8_dynamic"
TARGETS = ("llama-bench", "llama-batched-bench")
GGUF_TYPES = ("bf16", "q8_0")
PROMPT_TOKENS = 256


# --------------------------------------------------------------------------- getting llama.cpp

def source_dir(cache: Path = CACHE) -> Path:
    """vendor/llama.cpp of the unpacked sdist."""
    return cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def binary(name: str, cache: Path = CACHE) -> Path:
    return source_dir(cache) / "build" / "bin" / name


def built(cache: Path = CACHE) -> bool:
    return all(binary(t, cache).is_file() for t in TARGETS)


def _run(cmd: list, log, **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def build(cache: Path = CACHE, jobs: int = 2, log=print) -> None:
    """Download the sdist (pip), unpack it and build the two benchmark tools, each step
    skipped when its output is there.  Niced: the machine is shared."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", cache], log)
    src = source_dir(cache)
    if not (src / "CMakeLists.txt").is_file():
        log(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    if built(cache):
        return
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    _run(nice + ["cmake", "-S", src, "-B", src / "build", "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"], log)
    _run(nice + ["cmake", "--build", src / "build", f"-j{jobs}", "--target", *TARGETS], log)


def llama_cpp_commit(cache: Path = CACHE) -> str | None:
    """The llama.cpp commit the sdist vendors (its build-info, or the git HEAD it carries)."""
    info = source_dir(cache) / "build" / "common" / "build-info.cpp"
    if info.is_file():
        m = re.search(r'LLAMA_COMMIT\s*=\s*"([0-9a-f]+)"', info.read_text())
        if m and m.group(1) != "unknown":
            return m.group(1)
    return None


# --------------------------------------------------------------------------- converting

# Run in a child python: llama.cpp's converter with its gguf-py on the path, unchanged but
# for TextModel.get_vocab_base_pre, which maps a pre-tokenizer hash it does not know to
# "default" (the converter refuses such a tokenizer; the mapping changes tokenization only).
CONVERT_WRAPPER = '''\
import logging, runpy, sys
from hashlib import sha256
from pathlib import Path
here = Path(sys.argv.pop(1))
sys.path.insert(0, str(here))
sys.path.insert(1, str(here / "gguf-py"))
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        chktxt = known.__code__.co_consts  # the check text is the function's first string constant
        text = next(c for c in chktxt if isinstance(c, str) and "(normal)" in c)
        chkhsh = sha256(str(tokenizer.encode(text)).encode()).hexdigest()
        print(f"PEERS: pre-tokenizer hash {chkhsh} unknown to the converter: mapped to 'default'",
              flush=True)
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = str(here / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def gguf_path(model: Path, outtype: str, cache: Path = CACHE) -> Path:
    return cache / "gguf" / f"{model.name}-{outtype}.gguf"


def convert(model: Path, outtype: str, cache: Path = CACHE, log=print) -> tuple[Path, str | None]:
    """``model`` (a Hugging Face folder) as a GGUF file of ``outtype`` (bf16, q8_0), made
    once by llama.cpp's converter (through CONVERT_WRAPPER).  Returns (the file, the note
    of a mapped pre-tokenizer hash or None); the note is kept beside the file."""
    out = gguf_path(model, outtype, cache)
    note_file = out.with_suffix(".note")
    if out.is_file():
        return out, (note_file.read_text().strip() or None) if note_file.is_file() else None
    out.parent.mkdir(parents=True, exist_ok=True)
    wrapper = cache / "convert_wrapper.py"
    wrapper.write_text(CONVERT_WRAPPER)
    tmp = out.with_suffix(".part")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    cmd = nice + [sys.executable, wrapper, source_dir(cache), model, "--outtype", outtype, "--outfile", tmp]
    log("$ " + " ".join(str(c) for c in cmd))
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model} ({outtype}):\n"
                           + (proc.stdout + proc.stderr)[-3000:])
    notes = [line[len("PEERS: "):] for line in proc.stdout.splitlines() if line.startswith("PEERS: ")]
    note = notes[0] if notes else None
    note_file.write_text((note or "") + "\n")
    tmp.rename(out)
    log(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB)" + (f"; {note}" if note else ""))
    return out, note


# --------------------------------------------------------------------------- bytes a step reads

def gguf_tensors(path: Path, cache: Path = CACHE) -> tuple[list[tuple[str, int]], dict]:
    """([(tensor name, bytes)], {"experts": E, "experts_used": k, "vocab": V}) of a GGUF
    file, read with the sdist's gguf-py."""
    sys.path.insert(0, str(source_dir(cache) / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    reader = gguf.GGUFReader(str(path))

    def field(suffix: str) -> int:
        for name, f in reader.fields.items():
            if name.endswith(suffix) and f.data:
                return int(f.parts[f.data[0]][0])
        return 0
    tensors = [(t.name, int(t.n_bytes)) for t in reader.tensors]
    vocab = next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), 0)
    return tensors, {"experts": field(".expert_count"), "experts_used": field(".expert_used_count"),
                     "vocab": vocab}


def gguf_step_bytes(tensors: list[tuple[str, int]], info: dict, tokens: int) -> int:
    """Weight bytes llama.cpp reads in a step over ``tokens`` tokens (one forward: the
    sequences of a decode batch, or a prompt), counted as harness.active_weight_bytes
    counts ours: the embedding's rows looked up, the routed experts' expected distinct
    share (harness.expected_experts), every other tensor whole."""
    share = (harness.expected_experts(info["experts"], info["experts_used"], tokens) / info["experts"]
             if info.get("experts") else 1.0)
    total = 0.0
    for name, nbytes in tensors:
        if name == "token_embd.weight" and info.get("vocab"):
            total += nbytes * min(1.0, tokens / info["vocab"])
        elif "_exps." in name:
            total += nbytes * share
        else:
            total += nbytes
    return int(total)


# --------------------------------------------------------------------------- llama.cpp's outputs

def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's results, from its ``-o json`` array or its markdown table (the
    default): [{"test": "tg64" | "pp256", "n_prompt", "n_gen", "tok_s" (its mean over
    -r), "samples" (every repetition's t/s, json only), "model_type", "build"}]."""
    text = text.strip()
    start = text.find("[")
    if start >= 0 and text.rstrip().endswith("]"):
        out = []
        for r in json.loads(text[start:]):
            n_prompt, n_gen = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
            out.append({"test": f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0
                        else f"pp{n_prompt}+tg{n_gen}",
                        "n_prompt": n_prompt, "n_gen": n_gen, "tok_s": float(r["avg_ts"]),
                        "samples": [float(x) for x in r.get("samples_ts") or []],
                        "model_type": r.get("model_type"), "build": r.get("build_commit")})
        return out
    out, header = [], None
    build = None
    for line in text.splitlines():
        m = re.match(r"build:\s*(\S+)", line.strip())
        if m:
            build = m.group(1)
        if not line.lstrip().startswith("|"):
            continue
        cells = _cells(line)
        if "test" in cells and "t/s" in cells:
            header = cells
            continue
        if header is None or set("".join(cells)) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        test = row["test"]
        m_pp, m_tg = re.fullmatch(r"pp(\d+)", test), re.fullmatch(r"tg(\d+)", test)
        out.append({"test": test, "n_prompt": int(m_pp.group(1)) if m_pp else 0,
                    "n_gen": int(m_tg.group(1)) if m_tg else 0,
                    "tok_s": float(row["t/s"].split("±")[0]), "samples": [],
                    "model_type": row.get("model"), "build": None})
    for r in out:
        r["build"] = r["build"] or build
    return out


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's rows, from its markdown table (the default) or its
    ``--output-format jsonl`` lines: [{"pp", "tg", "pl" (sequences), "s_tg" (decode
    tokens/s of all sequences), "s_pp", "t_tg", "t_pp"}]."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            out.append({"pp": int(r["pp"]), "tg": int(r["tg"]), "pl": int(r["pl"]),
                        "s_tg": float(r["speed_tg"]), "s_pp": float(r["speed_pp"]),
                        "t_tg": float(r["t_tg"]), "t_pp": float(r["t_pp"])})
            continue
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        pp, tg, pl, _nkv, t_pp, s_pp, t_tg, s_tg, _t, _s = cells
        out.append({"pp": int(pp), "tg": int(tg), "pl": int(pl), "s_tg": float(s_tg),
                    "s_pp": float(s_pp), "t_tg": float(t_tg), "t_pp": float(t_pp)})
    return out


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's flags (/proc/cpuinfo's first "flags" line)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def vector_flags(flags: list[str]) -> list[str]:
    """The flags that choose a product kernel (llama.cpp's and ours), in VECTOR_FLAGS' order."""
    return [f for f in VECTOR_FLAGS if f in flags]


# --------------------------------------------------------------------------- the rows

DECODE_TOKENS = 64
BENCH_REPS = 3          # llama-bench's -r: its batch-1 decode and prompt rows are the mean of 3
BATCHES = (1, 8)
OUR_MODES = {"bf16": (("off", 0), ("k1", 1), ("k2", 2)), "int8": (("off", 0), ("k1", 1))}
GGUF_OF = {"bf16": "bf16", "int8": "q8_0"}        # our weights -> the peer's GGUF type
# Batch 1 again on text: the bench prompts (benchmarks/prompts.json, through the
# checkpoint's chat template), each round its own BENCH_REPS of them.  Why: a draft's
# acceptance is a property of the text; random ids are the worst case for MTP and no
# user's traffic (on the 0.5b model k=1 accepts 0.62 there, ~0.77 on the bench prompts).
# A step's bytes and time do not depend on the ids (MTP off on text and on random ids: 56.2
# and 56.5 tok/s, alternating), so the row is set against llama.cpp's batch-1 decode
# (llama-bench decodes random ids) and against our MTP off on the same prompts.
TEXT_B1 = "decode b1 (bench prompts)"
PEER_WORKLOAD = {TEXT_B1: "decode b1"}              # our workload -> llama.cpp's row it is set against


def peer_commands(gguf: Path, threads: int, cache: Path = CACHE) -> dict[str, list[str]]:
    """llama.cpp's three commands on one GGUF file: "decode b1", "prompt", "decode b8"."""
    bench, batched = str(binary("llama-bench", cache)), str(binary("llama-batched-bench", cache))
    t = str(threads)
    reps = str(BENCH_REPS)
    return {"decode b1": [bench, "-m", str(gguf), "-t", t, "-p", "0", "-n", str(DECODE_TOKENS), "-r", reps,
                          "-o", "json"],
            "prompt": [bench, "-m", str(gguf), "-t", t, "-p", str(PROMPT_TOKENS), "-n", "0", "-r", reps,
                       "-o", "json"],
            "decode b8": [batched, "-m", str(gguf), "-t", t, "-npp", "32", "-ntg", str(DECODE_TOKENS),
                          "-npl", "1,8"]}


def run_peer(cmd: list[str]) -> tuple[dict[str, float], str | None]:
    """One llama.cpp command: ({workload: tokens/s}, its build).  llama-batched-bench
    gives "decode b8" (S_TG at 8 sequences) and "decode b1 (batched-bench)" (at 1)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if Path(cmd[0]).name == "llama-batched-bench":
        rows = {r["pl"]: r for r in parse_batched_bench(proc.stdout + "\n" + proc.stderr)}
        if 8 not in rows:
            raise RuntimeError("llama-batched-bench printed no row for 8 sequences:\n" + proc.stdout[-2000:])
        out = {"decode b8": rows[8]["s_tg"]}
        if 1 in rows:
            out["decode b1 (batched-bench)"] = rows[1]["s_tg"]
        return out, None
    rows = parse_llama_bench(proc.stdout)
    if not rows:
        raise RuntimeError("llama-bench printed no result:\n" + proc.stdout[-2000:] + proc.stderr[-2000:])
    r = rows[0]
    return {"prompt" if r["n_gen"] == 0 else "decode b1": r["tok_s"]}, r["build"]


class Ours:
    """One checkpoint served by benchmarks.engine_step's engines (one per MTP mode, for
    up to 8 sequences), warmed up at both batch sizes and on the prompt."""

    def __init__(self, folder: Path, modes, compile_mode: str, log) -> None:
        import torch
        from types import SimpleNamespace
        from benchmarks import engine_step
        from server.model.config import TORCH_DTYPES
        from server.model.loading import load_checkpoint
        self.es, self.device, self.folder = engine_step, torch.device("cpu"), folder
        stored = json.loads((folder / "config.json").read_text()).get("torch_dtype") or "float32"
        t0 = time.perf_counter()
        self.model, _ = load_checkpoint(folder, dtype=TORCH_DTYPES[stored], device=self.device)
        self.vocab = self.model.config.vocab_size
        args = SimpleNamespace(max_tokens=DECODE_TOKENS, compile=compile_mode)
        self.engines = {}
        for mode, k in modes:
            t1 = time.perf_counter()
            eng = self.engines[mode] = engine_step.make_engine(self.model, k, args, self.device, max(BATCHES),
                                                               prompt_len=PROMPT_TOKENS)
            for b in BATCHES:
                engine_step.run(eng, engine_step.make_prompts(b, self.vocab, 999), 8, self.device, "w")
            log(f"{folder.name} {mode}: decode path {eng.runtime.decode_path}, ready in "
                f"{time.perf_counter() - t1:.0f} s")
        self.prompt = engine_step.make_prompts(1, self.vocab, 7, PROMPT_TOKENS)[0]
        self.text_prompts = harness.chat_prompt_ids(folder)
        for i in range(3):   # warm-up: the first prompts of a compiled engine may (re)compile
            engine_step.prompt_seconds(self.engines["off"], self.prompt, self.device, f"pw{i}")
        self.load_s = time.perf_counter() - t0

    def decode(self, mode: str, batch: int, text_round: int | None = None) -> dict:
        """At batch 1 the mean of BENCH_REPS runs, as llama-bench's row is (one run of ~1 s
        a mode moved a round by a noisy second); at batch 8 one run, as
        llama-batched-bench's.  ``tokens``: the first run's.  ``text_round``: batch 1 on
        that round's BENCH_REPS bench prompts (one a run) instead of random ids."""
        if text_round is None:
            prompts = [self.es.make_prompts(batch, self.vocab, batch)] * (BENCH_REPS if batch == 1 else 1)
        else:
            n = len(self.text_prompts)
            prompts = [[self.text_prompts[(text_round * BENCH_REPS + j) % n]] for j in range(BENCH_REPS)]
        runs = [self.es.run(self.engines[mode], p, DECODE_TOKENS, self.device, "r") for p in prompts]
        return {"tok_s": statistics.fmean(r["tok_s"] for r in runs),
                "step_ms": statistics.fmean(r["step_ms"] for r in runs),
                "tok_per_step": statistics.fmean(r["tok_per_step"] for r in runs), "tokens": runs[0]["tokens"]}

    def prompt_tok_s(self) -> float:
        """The mean of BENCH_REPS prefills, as llama-bench's prompt row."""
        return statistics.fmean(PROMPT_TOKENS / self.es.prompt_seconds(self.engines["off"], self.prompt, self.device)
                                for _ in range(BENCH_REPS))


def summarize(raw: dict, gbps: float, bytes_of) -> list[dict]:
    """The table's rows from the rounds' figures.

    ``raw``: {(side, weights, mode, workload): [per round {"tok_s", "tok_per_step"?}]};
    ``bytes_of(side, weights, mode, tokens)``: the weight bytes a step over ``tokens``
    tokens reads (a decode step of a batch: its sequences; MTP k: the batch x (1 + k) verify
    tokens and k draft passes, as harness.step_weight_bytes; a prompt: its tokens).
    A row: its tokens/s median, the bytes a step, tokens a sequence gets a step, steps/s
    (tokens/s / (batch x that)), the GB/s that streams, its share of ``gbps`` and the
    ratio to llama.cpp's row of the same workload on the same class of weights."""
    rows = []
    for (side, weights, mode, workload), runs in raw.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        per_step = statistics.median(r.get("tok_per_step") or 1.0 for r in runs)
        tokens = PROMPT_TOKENS if workload == "prompt" else int(re.search(r"b(\d+)", workload).group(1))
        nbytes = bytes_of(side, weights, mode, tokens)
        steps_s = _steps_per_s(workload, tokens, tok_s, per_step)
        share = harness.bandwidth_share(nbytes, steps_s, gbps)
        # Each round against the reading taken just before its job (the host's bandwidth
        # moved between ~28 and ~58 GB/s within minutes): a share that does not depend on
        # which level the run's median reading fell on.
        paired = [harness.bandwidth_share(nbytes, _steps_per_s(workload, tokens, r["tok_s"],
                                                               r.get("tok_per_step") or 1.0),
                                          r["gbps_before"]) for r in runs if r.get("gbps_before")]
        rows.append({"side": side, "weights": weights, "mode": mode, "workload": workload,
                     "tok_s": tok_s, "runs": [round(r["tok_s"], 2) for r in runs],
                     "step_bytes": nbytes, "tok_per_step": per_step, "steps_s": steps_s,
                     "stream_gbps": share * gbps, "share": share,
                     "share_paired": statistics.median(paired) if paired else None,
                     "vs_llama_cpp": None, "vs_llama_cpp_rounds": None})
    peer = {(r["weights"], r["workload"]): r for r in rows if r["side"] == "llama.cpp"}
    for r in rows:
        p = peer.get((r["weights"], PEER_WORKLOAD.get(r["workload"], r["workload"])))
        if r["side"] == "ours" and p is not None:
            r["vs_llama_cpp"] = r["tok_s"] / p["tok_s"]
            # Round by round: the two jobs of a round ran next to each other (the rounds
            # alternate their order), so both met the same level of the host.
            r["vs_llama_cpp_rounds"] = harness.round_ratios(r["runs"], p["runs"]) or None
    return rows


WORKLOADS = ("decode b1", TEXT_B1, "decode b8", "prompt", "decode b1 (batched-bench)")


def _steps_per_s(workload: str, tokens: int, tok_s: float, per_step: float) -> float:
    """Steps a second: a prompt's ``tokens`` in one step; a decode batch of ``tokens``
    sequences, ``per_step`` tokens each a step."""
    return tok_s / (tokens if workload == "prompt" else tokens * per_step)


def heads_int8(folder: Path) -> bool:
    """Whether the checkpoint's vocabulary head is int8 (training.quantize --quant-heads:
    not in compressed-tensors' ``ignore``, or typed in msModelSlim's description), as
    q8_0's is: then both sides read their heads a byte a weight."""
    from server.model.quant.formats import ignored
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if qc:
        return not ignored("lm_head", qc.get("ignore", []))
    desc = folder / "quant_model_description.json"
    return desc.is_file() and json.loads(desc.read_text()).get("lm_head.weight", "FLOAT") != "FLOAT"


def row_label(r: dict) -> str:
    if r["side"] == "llama.cpp":
        return f"llama.cpp {GGUF_OF[r['weights']]}"
    w = "bf16" if r["weights"] == "bf16" else "W8A8_DYNAMIC"
    if r.get("int8_head"):
        w += ", int8 head"
    return f"ours {w}, MTP {'off' if r['mode'] == 'off' else 'k=' + r['mode'][1:]}"


def _row_order(r: dict) -> tuple:
    """llama.cpp before ours, bf16 before int8, MTP off before k=1 before k=2."""
    return (r["side"] != "llama.cpp", r["weights"] != "bf16", ("-", "off", "k1", "k2").index(r["mode"]))


def format_table(rows: list[dict]) -> str:
    """The compact table (markdown): a line per side, weights and MTP mode; a cell per
    workload: tokens/s, share of the bandwidth, x llama.cpp."""
    labels: dict[str, dict[str, dict]] = {}
    for r in sorted(rows, key=_row_order):
        labels.setdefault(row_label(r), {})[r["workload"]] = r
    cols = ("decode b1", TEXT_B1, "decode b8", "prompt")
    out = ["| tokens/s (share of the memory's read bandwidth; x llama.cpp) | batch 1 decode | "
           "batch 1 decode, bench prompts (tokens a window) | batch 8 decode (all sequences) | "
           "256-token prompt |", "|---|---|---|---|---|"]
    for label, per in labels.items():
        cells = []
        for c in cols:
            r = per.get(c)
            if r is None:
                cells.append("")
                continue
            cell = f"{r['tok_s']:.1f} ({r['share']:.0%}"
            cell += f"; {r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] is not None else ""
            cell += f"; {r['tok_per_step']:.2f})" if c == TEXT_B1 and r["mode"] != "off" else ")"
            cells.append(cell)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_details(rows: list[dict]) -> str:
    """Every row (markdown): bytes a step, tokens a sequence a step, steps/s, GB/s, share."""
    out = ["| row | workload | tok/s (median) | runs | MB a step | tokens a seq. a step | steps/s | GB/s | "
           "share | x llama.cpp |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (WORKLOADS.index(r["workload"]), *_row_order(r))):
        ratio = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] is not None else "-"
        out.append(f"| {row_label(r)} | {r['workload']} | {r['tok_s']:.1f} | "
                   + " ".join(f"{x:.1f}" for x in r["runs"])
                   + f" | {r['step_bytes'] / 1e6:.0f} | {r['tok_per_step']:.2f} | {r['steps_s']:.1f} | "
                     f"{r['stream_gbps']:.1f} | {r['share']:.0%} | {ratio} |")
    return "\n".join(out)


def format_paired(rows: list[dict]) -> str:
    """Round by round (markdown): each round's share against the reading just before its
    job, and ours over llama.cpp's job of the same round; medians (ratio range)."""
    out = ["| row | workload | share, each round against the reading before it | "
           "x llama.cpp, round by round (range) |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (WORKLOADS.index(r["workload"]), *_row_order(r))):
        share = f"{r['share_paired']:.0%}" if r.get("share_paired") is not None else "-"
        v = r.get("vs_llama_cpp_rounds")
        ratio = f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" if v else "-"
        out.append(f"| {row_label(r)} | {r['workload']} | {share} | {ratio} |")
    return "\n".join(out)


def code_version() -> str:
    """The commit this checkout is at, and whether server/ or benchmarks/ differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "server", "benchmarks"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes in server/ or benchmarks/" if dirty else "")


# --------------------------------------------------------------------------- main

def memory_yardstick(measurements: list[dict]) -> float:
    """The bandwidth the shares are taken against: the median of the run's readings
    (harness.memory_bandwidth_gbps dicts: one before the engines are built, one before
    every timed job).  One reading strays both ways on this shared 2-vCPU machine:
    16.8 GB/s while others ran, 22-33 at rest, 38-49 inside one run's process between its
    timed jobs (2026-12-06); a median over dozens of them is what the rows met on the whole."""
    return statistics.median(m["gbps"] for m in measurements)


def _shown(path: str) -> str:
    """A path under the checkout as the report shows it: relative to it (links kept)."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def wait_for_quiet(threshold: float, max_s: float, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is below ``threshold`` (other programs on a
    shared machine idle), at most ``max_s`` seconds; returns the seconds waited."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= threshold and time.monotonic() - t0 < max_s:
        time.sleep(poll_s)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=harness.program(), description=__doc__.split("\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--build", action="store_true",
                    help="download the llama-cpp-python sdist, build llama-bench and llama-batched-bench, "
                         "convert the checkpoints (each step skipped when done)")
    ap.add_argument("--no-run", action="store_true", help="stop after the build and the conversions")
    ap.add_argument("--model", type=Path, default=BF16_MODEL, help="the bf16 checkpoint (benchmarks.models)")
    ap.add_argument("--int8-model", type=Path, default=INT8_MODEL, help="its W8A8_DYNAMIC copy")
    ap.add_argument("--cache", type=Path, default=CACHE, help="llama.cpp's sdist, build and GGUF files")
    ap.add_argument("--threads", type=int, default=2, help="threads of both sides (llama.cpp -t, torch)")
    ap.add_argument("--reps", type=int, default=3, help="rounds, peer and ours alternating; medians")
    ap.add_argument("--compile", choices=("on", "off"), default="on", help="our engines' compiled step")
    ap.add_argument("--wait-load", type=float, default=None,
                    help="before each timed job wait (up to --wait-max s) until the 1-minute load "
                         "average is below this: on a shared machine, runs alone where it can")
    ap.add_argument("--wait-max", type=float, default=600.0)
    ap.add_argument("--label", default=None,
                    help="what code ours is (default: the checkout's commit, from git)")
    ap.add_argument("--json", type=Path,
                    help="write the report (JSON) here; a bare file name goes under docs/bench/")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    cache = args.cache.absolute()
    folders = {"bf16": args.model.absolute(), "int8": args.int8_model.absolute()}
    for name, folder in folders.items():
        if not (folder / "config.json").is_file():
            ap.error(f"no checkpoint at {folder}: python -m benchmarks.models --size 0.5b --quantize w8a8_dynamic")
    if args.build:
        build(cache, log=log)
    elif not built(cache):
        ap.error(f"llama.cpp is not built under {cache}: run with --build (downloads the "
                 f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist from PyPI; several minutes)")
    ggufs, notes = {}, []
    for t in GGUF_TYPES:
        if not gguf_path(folders["bf16"], t, cache).is_file() and not args.build:
            ap.error(f"no {t} GGUF of {folders['bf16'].name} under {cache}: run with --build")
        ggufs[t], note = convert(folders["bf16"], t, cache, log)
        if note and note not in notes:
            notes.append(note)
    if args.no_run:
        return 0

    import torch
    from server.engine.child import keep_freed_pages
    torch.set_num_threads(args.threads)
    keep_freed_pages()
    t_start = time.perf_counter()
    flags = cpu_flags()
    gguf_info = {t: gguf_tensors(p, cache) for t, p in ggufs.items()}
    commands = {t: peer_commands(p, args.threads, cache) for t, p in ggufs.items()}
    log("loading our engines (compiles on first use) ...")
    ours = {w: Ours(folders[w], OUR_MODES[w], args.compile, log) for w in OUR_MODES}
    if args.wait_load:
        wait_for_quiet(args.wait_load, args.wait_max)
    memory = [harness.memory_bandwidth_gbps(args.threads)]
    log(f"memory read bandwidth {memory[0]['gbps']:.2f} GB/s")

    raw: dict[tuple, list[dict]] = {}
    first_tokens: dict[tuple, dict] = {}
    build_id = None

    def peer_job(weights: str, workload: str):
        def job():
            nonlocal build_id
            figures, b = run_peer(commands[GGUF_OF[weights]][workload])
            build_id = build_id or b
            for wl, tok_s in figures.items():
                raw.setdefault(("llama.cpp", weights, "-", wl), []).append(
                    {"tok_s": tok_s, "gbps_before": memory[-1]["gbps"]})
            return " ".join(f"{wl} {v:.1f}" for wl, v in figures.items())
        return f"llama.cpp {GGUF_OF[weights]} {workload}", job

    def ours_job(weights: str, workload: str):
        def job():
            if workload == "prompt":
                tok_s = ours[weights].prompt_tok_s()
                raw.setdefault(("ours", weights, "off", "prompt"), []).append(
                    {"tok_s": tok_s, "gbps_before": memory[-1]["gbps"]})
                return f"{tok_s:.1f}"
            b = int(re.search(r"b(\d+)", workload).group(1))
            text_round = rounds_done[(weights, workload)] if workload == TEXT_B1 else None
            rounds_done[(weights, workload)] += 1
            parts = []
            for mode, _k in OUR_MODES[weights]:
                r = ours[weights].decode(mode, b, text_round)
                first_tokens.setdefault((weights, workload, mode), r.pop("tokens"))
                r.pop("tokens", None)
                r["gbps_before"] = memory[-1]["gbps"]
                raw.setdefault(("ours", weights, mode, workload), []).append(r)
                parts.append(f"{mode} {r['tok_s']:.1f}")
            return " ".join(parts)
        return f"ours {weights} {workload}", job

    rounds_done: dict[tuple, int] = collections.Counter()
    jobs = []
    for workload in ("decode b1", "decode b8", "prompt"):
        for weights in ("bf16", "int8"):
            jobs += [peer_job(weights, workload), ours_job(weights, workload)]
            if workload == "decode b1":
                jobs.append(ours_job(weights, TEXT_B1))
    loads = []                     # the 1-minute load average before each timed job (a shared machine)
    for rep in range(args.reps):
        for label, job in (jobs if rep % 2 == 0 else jobs[::-1]):   # drift hits both sides alike
            waited = wait_for_quiet(args.wait_load, args.wait_max) if args.wait_load else 0.0
            loads.append(os.getloadavg()[0])
            memory.append(harness.memory_bandwidth_gbps(args.threads))   # a reading before every job
            t0 = time.perf_counter()
            shown = job()
            log(f"round {rep + 1}/{args.reps} {label}: {shown} tok/s ({time.perf_counter() - t0:.0f} s; "
                f"load before {loads[-1]:.1f}" + (f", waited {waited:.0f} s for it" if waited else "")
                + f"; memory read {memory[-1]['gbps']:.1f} GB/s before it)")
    gemv = harness.gemv_rates_gbps(args.threads)
    gbps = memory_yardstick(memory)

    def bytes_of(side: str, weights: str, mode: str, tokens: int) -> int:
        if side == "llama.cpp":
            return gguf_step_bytes(*gguf_info[GGUF_OF[weights]], tokens)
        if tokens == PROMPT_TOKENS:
            return harness.active_weight_bytes(folders[weights], tokens=tokens)
        return harness.step_weight_bytes(folders[weights], tokens, int(mode[1:]) if mode != "off" else 0)

    rows = summarize(raw, gbps, bytes_of)
    for r in rows:
        if r["side"] == "ours" and r["weights"] == "int8" and heads_int8(folders["int8"]):
            r["int8_head"] = True
    from benchmarks.engine_step import first_difference
    lossless = {}                  # greedy: MTP k=1 / k=2 emit MTP off's tokens (first round)
    for (weights, workload, mode), toks in first_tokens.items():
        if mode != "off":
            ref = first_tokens[(weights, workload, "off")]
            diffs = [d for d in (first_difference(ref[r], toks[r]) for r in toks) if d is not None]
            lossless[f"{weights} {workload} {mode}"] = {"same": not diffs, "requests_differing": len(diffs),
                                                  "earliest_position": min(diffs) if diffs else None}
    shown_commands = {t: {wl: " ".join(Path(c).name if i == 0 else _shown(c) if c.endswith(".gguf")
                                       else c for i, c in enumerate(cmd))
                          for wl, cmd in per.items()} for t, per in commands.items()}
    report = {**harness.report_header(), "code": args.label or code_version(),
              "llama_cpp": {"sdist": f"llama-cpp-python {LLAMA_CPP_PYTHON}", "build": build_id,
                            "cmake": "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF",
                            "commands": shown_commands, "converter_notes": notes,
                            "gguf_mb": {t: round(p.stat().st_size / 1e6) for t, p in ggufs.items()}},
              "ours": {"models": {w: _shown(str(f)) for w, f in folders.items()},
                       "compile": args.compile, "decode_tokens": DECODE_TOKENS,
                       "prompt_len_decode": ours["bf16"].es.PROMPT_LEN,
                       "decode_path": {w: {m: e.runtime.decode_path for m, e in o.engines.items()}
                                       for w, o in ours.items()},
                       "lossless": lossless},
              "threads": args.threads, "reps": args.reps, "torch": torch.__version__,
              "wait_load": args.wait_load,
              "cpu_flags": flags, "vector_flags": vector_flags(flags),
              "memory": {"bandwidth": memory, "gbps": gbps, "yardstick": "the median of the readings"},
              "gemv_diagnostic": gemv,
              "load_average_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
              "rows": rows, "wall_s": round(time.perf_counter() - t_start, 1)}
    print_report(report)
    harness.save_report(report, args.json)
    return 0


def print_report(rep: dict) -> None:
    m = rep["memory"]
    print(f"\n# benchmarks.peers {rep['date']}  machine: {rep['machine']} (shared)  torch {rep['torch']}  "
          f"threads {rep['threads']}  rounds {rep['reps']} (medians)")
    print(f"# ours: {rep['code']}; llama.cpp: {rep['llama_cpp']['sdist']} vendor/llama.cpp, build "
          f"{rep['llama_cpp']['build']}, cmake {rep['llama_cpp']['cmake']}")
    print(f"# CPU flags (vector): {' '.join(rep['vector_flags'])}")
    la = rep.get("load_average_1m")
    if la:
        print(f"# 1-minute load average before the timed jobs: {la['min']:.1f}-{la['max']:.1f} "
              f"(median {la['median']:.1f}; {rep['threads']} threads a side on {os.cpu_count()} cores)")
    readings = sorted(b["gbps"] for b in m["bandwidth"])
    print(f"# memory read bandwidth: {m['gbps']:.2f} GB/s, the median of {len(readings)} readings, one before "
          f"every timed job (range {readings[0]:.1f}-{readings[-1]:.1f}, quartiles "
          f"{readings[len(readings) // 4]:.1f}-{readings[3 * len(readings) // 4]:.1f}; each a plain read of "
          f"{m['bandwidth'][0]['mib']} MiB, {m['bandwidth'][0]['threads']} threads, median of 7)")
    g = rep["gemv_diagnostic"]
    print(f"# kernel diagnostic, not the limit: torch bf16 GEMV {g['bf16']:.2f} GB/s, int8 _int_mm "
          f"{g['int8'] or 0:.2f}, fp32 {g['fp32']:.2f}")
    print()
    print(format_table(rep["rows"]))
    print()
    print(format_details(rep["rows"]))
    print()
    print(format_paired(rep["rows"]))
    print()
    for t, per in rep["llama_cpp"]["commands"].items():
        for wl, cmd in per.items():
            print(f"# llama.cpp {t} {wl}: {cmd}")
    for note in rep["llama_cpp"]["converter_notes"]:
        print(f"# converter: {note}")
    ll = rep["ours"]["lossless"]
    if ll:
        print("# ours, greedy tokens identical to MTP off (first round): " + ", ".join(
            f"{k} yes" if v["same"] else f"{k} NO ({v['requests_differing']} request(s), from output position "
            f"{v['earliest_position']})" for k, v in ll.items()))
    print(f"# total {rep['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
