"""What a decode step costs besides reading weights: the same steps with the product kernels
swapped for ones that only zero their outputs.

Why: a profiler's figure for the rest of a step (the graphs' glue, the operators' checks
and allocations, Python, sampling) comes out two to three times too large at batch 1 (a
~600-event step pays the profiler's cost per event), and a step's time less its products'
sum mixes in how the memory behaved that second.  Swapping the kernels in place
(``native.set_kernel``, the hook kernels/native.py registers them through) leaves every other
part of the step exactly as served: the same compiled graphs, the same operators, the
same engine.  The real, the stubbed and the timed steps (below) take turns round by round,
with a plain read of the memory between rounds; each row: median step time, median
stubbed step time, the stubbed share of the step, and the real step's weight bytes
against the read.

A third kind of round runs the real kernels each wrapped in a timer (two clock reads a
call): every kernel's time and weight bytes per step, by operator and shape, so each
product's own streaming rate inside the served step, and what the step spends besides its
kernels *as the kernels leave the caches*.  Why both: swapped out, the kernels leave the
rest of the step its caches; served, each kernel streams megabytes through them first, and
on the 2-core Zen 4 the same glue took 2-4x its stubbed time after kernels that only
streamed the weights (no arithmetic).

The no-op kernels cover the AVX-512 set (bf16: ``bf16_mm``, ``bf16_heads``, ``bf16_moe``,
``bf16_attend_paged``; VNNI int8: ``i8_mm``, ``i8_moe``).  Not swapped, so counted as
"besides": an MTP layer's eager routed MoE (``bf16_experts`` through ctypes, ~0.15 ms a
batch-1 k=1 step on the 0.5b model) and anything torch multiplies itself.  Tokens from a
stubbed step are meaningless (all-zero logits); only its time is used.

Usage (repository root):
  python -m benchmarks.besides_products --model .cache/bench-models/deepseek-v3-0.5b-mtp --batch 1,8 --modes off,k1
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.engine_step import make_engine, make_prompts
from benchmarks.peers import cpu_flags, vector_flags
from server.engine.protocol import EngineRequest, SamplingParams

NO_OP_SOURCE = r"""
#include <string.h>
static void zero_rows(float *y, long rows, long cols, long ld) {
    for (long r = 0; r < rows; r++) memset(y + r * ld, 0, (size_t)cols * sizeof(float));
}
void bf16_mm(const void *x, long M, long K, long ldx, const void *w, long N, float *y, long ldy,
             int threads) { zero_rows(y, M, N, ldy); }
void bf16_heads(const void *x, long T, long nh, long K, const void *w, long N, float *y,
                int threads) { memset(y, 0, (size_t)(T * nh * N) * sizeof(float)); }
void bf16_moe(const void *x, long T, long H, long I, long k, const long *src, const long *pairs,
              const float *pw, const long *offsets, long E, const void *gate_up, const void *down,
              void *xs, float *gu, void *act, float *ys, float *out, int threads) {
    memset(out, 0, (size_t)(T * H) * sizeof(float));
}
void bf16_attend_paged(const void *q, long B, long R, long D, const void *cache, long bs,
                       const long *tables, long nb, const long *pos, long Q, float scale, long kvr,
                       float *out, float *p, int threads) {
    memset(out, 0, (size_t)(B * R * kvr) * sizeof(float));
}
int i8_mm(const void *x, long M, long K, long ldx, const void *w, long N, int *y, long ldy,
          int threads) {
    for (long r = 0; r < M; r++) memset(y + r * ldy, 0, (size_t)N * sizeof(int));
    return 0;
}
int i8_moe(const float *x, long T, long H, long I, long k, const long *idx, const float *wt, long E,
           const void *gate_up, const float *gus, const void *down, const float *ds, float *out,
           int threads) {
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    return 0;
}
"""
SWAPPED = {"avx512_bf16": ("bf16_mm", "bf16_heads", "bf16_moe", "bf16_attend_paged"),
           "avx512_vnni": ("i8_mm", "i8_moe")}

# The same entry points, each the real kernel (``real_<name>``, set from Python) between two
# clock reads; kt_* read the table: per (kernel, rows, N, K) its calls, nanoseconds and
# weight bytes (a MoE: the chosen experts' gate, up and down; attention: none, as weights).
TIMED_SOURCE = r"""
#include <string.h>
#include <time.h>
typedef struct { int kernel; long rows, n, k, calls; double ns, bytes; } kt_entry;
static kt_entry table[1024];
static int used;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void add(int kernel, long rows, long n, long k, double ns, double bytes) {
    for (int i = 0; i < used; i++)
        if (table[i].kernel == kernel && table[i].rows == rows && table[i].n == n && table[i].k == k) {
            table[i].calls++; table[i].ns += ns; table[i].bytes += bytes; return;
        }
    if (used < 1024) table[used++] = (kt_entry){kernel, rows, n, k, 1, ns, bytes};
}
void kt_reset(void) { used = 0; }
int kt_count(void) { return used; }
const kt_entry *kt_get(int i) { return &table[i]; }
static long chosen(const long *offsets, long E) {
    long n = 0;
    for (long e = 0; e < E; e++) n += offsets[e + 1] > offsets[e];
    return n;
}
static long distinct(const long *idx, long n, long E) {
    unsigned char seen[4096] = {0};
    long d = 0;
    for (long i = 0; i < n; i++)
        if (idx[i] >= 0 && idx[i] < E && idx[i] < 4096 && !seen[idx[i]]) { seen[idx[i]] = 1; d++; }
    return d;
}
typedef void (*mm_t)(const void *, long, long, long, const void *, long, float *, long, int);
typedef void (*heads_t)(const void *, long, long, long, const void *, long, float *, int);
typedef void (*moe_t)(const void *, long, long, long, long, const long *, const long *, const float *,
                      const long *, long, const void *, const void *, void *, float *, void *, float *,
                      float *, int);
typedef void (*attend_t)(const void *, long, long, long, const void *, long, const long *, long,
                         const long *, long, float, long, float *, float *, int);
typedef int (*i8_mm_t)(const void *, long, long, long, const void *, long, int *, long, int);
typedef int (*i8_moe_t)(const float *, long, long, long, long, const long *, const float *, long,
                        const void *, const float *, const void *, const float *, float *, int);
mm_t real_bf16_mm; heads_t real_bf16_heads; moe_t real_bf16_moe; attend_t real_bf16_attend_paged;
i8_mm_t real_i8_mm; i8_moe_t real_i8_moe;
void bf16_mm(const void *x, long M, long K, long ldx, const void *w, long N, float *y, long ldy, int threads) {
    double t = now(); real_bf16_mm(x, M, K, ldx, w, N, y, ldy, threads);
    add(0, M, N, K, now() - t, 2.0 * N * K);
}
void bf16_heads(const void *x, long T, long nh, long K, const void *w, long N, float *y, int threads) {
    double t = now(); real_bf16_heads(x, T, nh, K, w, N, y, threads);
    add(1, T, nh * N, K, now() - t, 2.0 * nh * N * K);
}
void bf16_moe(const void *x, long T, long H, long I, long k, const long *src, const long *pairs,
              const float *pw, const long *offsets, long E, const void *gate_up, const void *down,
              void *xs, float *gu, void *act, float *ys, float *out, int threads) {
    double t = now();
    real_bf16_moe(x, T, H, I, k, src, pairs, pw, offsets, E, gate_up, down, xs, gu, act, ys, out, threads);
    add(2, T, chosen(offsets, E), H, now() - t, 2.0 * chosen(offsets, E) * 3 * H * I);
}
void bf16_attend_paged(const void *q, long B, long R, long D, const void *cache, long bs,
                       const long *tables, long nb, const long *pos, long Q, float scale, long kvr,
                       float *out, float *p, int threads) {
    double t = now();
    real_bf16_attend_paged(q, B, R, D, cache, bs, tables, nb, pos, Q, scale, kvr, out, p, threads);
    add(3, B * Q, R / Q, D, now() - t, 0.0);
}
int i8_mm(const void *x, long M, long K, long ldx, const void *w, long N, int *y, long ldy, int threads) {
    double t = now(); int r = real_i8_mm(x, M, K, ldx, w, N, y, ldy, threads);
    add(4, M, N, K, now() - t, (double)N * K);
    return r;
}
int i8_moe(const float *x, long T, long H, long I, long k, const long *idx, const float *wt, long E,
           const void *gate_up, const float *gus, const void *down, const float *ds, float *out,
           int threads) {
    double t = now(); int r = real_i8_moe(x, T, H, I, k, idx, wt, E, gate_up, gus, down, ds, out, threads);
    long d = distinct(idx, T * k, E);
    add(5, T, d, H, now() - t, 3.0 * d * H * I);
    return r;
}
"""
TIMED_KERNELS = ("bf16_mm", "bf16_heads", "bf16_moe", "bf16_attend_paged", "i8_mm", "i8_moe")


class _Entry(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_int), ("rows", ctypes.c_long), ("n", ctypes.c_long), ("k", ctypes.c_long),
                ("calls", ctypes.c_long), ("ns", ctypes.c_double), ("bytes", ctypes.c_double)]


class KernelSwap:
    """The product kernels, switchable between the real ones ("real"), the no-op ones
    ("no-op") and the real ones behind timers ("timed", read by ``kernel_times``)."""

    def __init__(self) -> None:
        from server.model.kernels import native
        from server.model.kernels.cpu import cpu_caps
        caps = cpu_caps()
        if not (caps.avx512f and caps.avx512bw and caps.avx512_bf16):
            sys.exit("benchmarks.besides_products: the no-op kernels stand in for the AVX-512 BF16 "
                     "ones, which this CPU does not run (vector flags: "
                     f"{' '.join(vector_flags(cpu_flags())) or 'unknown'})")
        cc = shutil.which("cc")
        if cc is None or not native.native_ops():
            sys.exit("benchmarks.besides_products: needs our C++ operators (a C and C++ compiler)")
        self._set = native.set_kernel
        self._dir = tempfile.TemporaryDirectory(prefix="no-op-kernels-")
        self._no_op = self._build(cc, "no_op", NO_OP_SOURCE)
        self._timed = self._build(cc, "timed", TIMED_SOURCE)
        self._timed.kt_get.restype = ctypes.POINTER(_Entry)
        self._real = {}
        for kernel, names in SWAPPED.items():
            lib_real = native.kernel_library(kernel)
            if lib_real is not None:
                self._real.update({n: getattr(lib_real, n) for n in names})
        for name, real in self._real.items():
            ctypes.c_void_p.in_dll(self._timed, f"real_{name}").value = ctypes.cast(real, ctypes.c_void_p).value

    def _build(self, cc: str, name: str, source: str) -> ctypes.CDLL:
        src, lib = Path(self._dir.name) / f"{name}.c", Path(self._dir.name) / f"{name}.so"
        src.write_text(source)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        return ctypes.CDLL(str(lib))

    def use(self, kind: str) -> None:
        """"real", "no-op" or "timed" kernels from now on."""
        lib = {"no-op": self._no_op, "timed": self._timed}.get(kind)
        for name, real in self._real.items():
            self._set(name, real if lib is None else getattr(lib, name))

    def reset_times(self) -> None:
        self._timed.kt_reset()

    def kernel_times(self, steps: int) -> list[dict]:
        """What the timed kernels recorded since ``reset_times``, per step of ``steps``, by
        kernel and shape: rows, n (output columns; a MoE: experts chosen; attention: heads),
        k, calls, microseconds and weight MB a step, GB/s; slowest first."""
        out = []
        for i in range(self._timed.kt_count()):
            e = self._timed.kt_get(i).contents
            out.append({"kernel": TIMED_KERNELS[e.kernel], "rows": e.rows, "n": e.n, "k": e.k,
                        "calls_per_step": round(e.calls / steps, 2), "us_per_step": round(e.ns / steps / 1e3, 1),
                        "mb_per_step": round(e.bytes / steps / 1e6, 2),
                        "gbps": round(e.bytes / e.ns, 1) if e.bytes else None})
        return sorted(out, key=lambda r: -r["us_per_step"])


def decode_steps(engine, vocab: int, batch: int, steps: int, seed: int,
                 before_timed=None, after_timed=None) -> list[float]:
    """Seconds of ``steps`` decode steps of ``batch`` fresh greedy requests (after their
    prefill and 3 untimed steps); the requests are then served to their end.
    ``before_timed`` / ``after_timed``: called just before the first / after the last
    timed step."""
    sp = SamplingParams(max_tokens=steps * 3 + 16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, vocab, seed)):
        engine.add_request(EngineRequest(f"b{seed}-{i}", p, sp))
    for _ in range(4):
        engine.step()
        engine.finish_step()
    if before_timed is not None:
        before_timed()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        engine.finish_step()
        times.append(time.perf_counter() - t0)
    if after_timed is not None:
        after_timed()
    while engine.has_unfinished():
        engine.step()
        engine.finish_step()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--modes", default="off,k1", help="off, k1, k2, ...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps a round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--show", type=int, default=12, help="kernels (slowest first) printed a row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from server.engine.child import keep_freed_pages
    from server.model.loading import load_checkpoint
    keep_freed_pages()
    device = torch.device("cpu")
    swap = KernelSwap()
    model, _ = load_checkpoint(Path(args.model), dtype=None, device=device)
    vocab = model.config.vocab_size
    rows = []

    class EngineArgs:
        max_tokens = args.steps * 3 + 32
        compile = "on"
    for mode in args.modes.split(","):
        k = 0 if mode == "off" else int(mode[1:])
        for batch in (int(b) for b in args.batch.split(",")):
            engine = make_engine(model, k, EngineArgs, device, batch)
            swap.use("real")
            t0 = time.perf_counter()
            decode_steps(engine, vocab, batch, 4, 1)              # compiles or loads the graphs
            warm = time.perf_counter() - t0
            reads: list[float] = []
            steps = {"real": [], "no-op": [], "timed": []}
            timed_rounds = []               # (kernels' ms a step, the timed step's ms, the table)
            kinds = list(steps)
            for r in range(args.rounds):
                for kind in kinds[r % 3:] + kinds[:r % 3]:            # each kind first in turn
                    swap.use(kind)
                    tables = []
                    step = statistics.median(decode_steps(
                        engine, vocab, batch, args.steps, 10 + r, before_timed=swap.reset_times,
                        after_timed=lambda: tables.append(swap.kernel_times(args.steps))))
                    steps[kind].append(step)
                    if kind == "timed":
                        timed_rounds.append((sum(e["us_per_step"] for e in tables[0]) / 1e3, 1e3 * step, tables[0]))
                swap.use("real")
                reads.append(harness.memory_bandwidth_gbps(torch.get_num_threads(), reps=3)["gbps"])
            real, stub = steps["real"], steps["no-op"]
            step_ms, stub_ms = 1e3 * statistics.median(real), 1e3 * statistics.median(stub)
            kernels_ms, timed_ms, table = sorted(timed_rounds, key=lambda t: t[0])[len(timed_rounds) // 2]
            besides_in_steps = statistics.median(t[1] - t[0] for t in timed_rounds)
            gbps = statistics.median(reads)
            nbytes = harness.step_weight_bytes(args.model, batch, k)
            row = {"mode": mode, "batch": batch, "step_ms": round(step_ms, 3),
                   "besides_products_ms": round(stub_ms, 3),
                   "besides_share": round(stub_ms / step_ms, 4),
                   "read_gbps": round(gbps, 1), "step_weight_bytes": nbytes,
                   "weight_share_of_read": round(nbytes / (step_ms / 1e3) / (gbps * 1e9), 4),
                   "rounds_ms": [round(1e3 * t, 2) for t in real],
                   "stubbed_rounds_ms": [round(1e3 * t, 3) for t in stub],
                   "timed_step_ms": round(timed_ms, 3), "kernels_ms": round(kernels_ms, 3),
                   "besides_kernels_in_steps_ms": round(besides_in_steps, 3),
                   "kernels": table, "warm_up_s": round(warm, 1)}
            rows.append(row)
            print(f"{mode:>3} batch {batch}: step {step_ms:.2f} ms, besides products {stub_ms:.2f} ms "
                  f"({100 * stub_ms / step_ms:.1f}%); weights {nbytes / 1e6:.0f} MB a step at "
                  f"{100 * row['weight_share_of_read']:.0f}% of the read ({gbps:.1f} GB/s); "
                  f"warm-up {warm:.1f} s", flush=True)
            weights_mb = sum(e["mb_per_step"] for e in table)
            print(f"    served with timers: step {timed_ms:.2f} ms, kernels {kernels_ms:.2f} ms "
                  f"({weights_mb:.0f} MB, {weights_mb / kernels_ms:.1f} GB/s), besides them "
                  f"{besides_in_steps:.2f} ms a step (median of the rounds)", flush=True)
            for e in table[:args.show]:
                rate = f", {e['gbps']:.1f} GB/s" if e["gbps"] else ""
                print(f"    {e['kernel']:>17} rows {e['rows']:<3} n {e['n']:<6} k {e['k']:<5} "
                      f"{e['calls_per_step']:5.1f} calls {e['us_per_step']:8.1f} us a step{rate}", flush=True)
            del engine
    if args.json:
        harness.save_report(harness.report_header(
            model=args.model, threads=torch.get_num_threads(),
            vector_flags=vector_flags(cpu_flags()), rows=rows), Path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
