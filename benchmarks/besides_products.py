"""What a decode step costs besides reading weights: the same steps with the product kernels
swapped for ones that only zero their outputs.

Why: a profiler's figure for the rest of a step (the graphs' glue, the operators' checks
and allocations, Python, sampling) comes out two to three times too large at batch 1 (a
~600-event step pays the profiler's cost per event), and a step's time less its products'
sum mixes in how the memory behaved that second.  Swapping the kernels in place
(``native.set_kernel``, the hook kernels/native.py registers them through) leaves every other
part of the step exactly as served: the same compiled graphs, the same operators, the
same engine.  The real and the stubbed steps alternate round by round, with a plain read
of the memory between rounds; each row: median step time, median stubbed step time, the
stubbed share of the step, and the real step's weight bytes against the read.

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


class KernelSwap:
    """The product kernels, switchable between the real ones and the no-op ones."""

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
        src, lib = Path(self._dir.name) / "no_op.c", Path(self._dir.name) / "no_op.so"
        src.write_text(NO_OP_SOURCE)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        self._no_op = ctypes.CDLL(str(lib))
        self._real = {}
        for kernel, names in SWAPPED.items():
            lib_real = native.kernel_library(kernel)
            if lib_real is not None:
                self._real.update({n: getattr(lib_real, n) for n in names})

    def use(self, no_op: bool) -> None:
        for name, real in self._real.items():
            self._set(name, getattr(self._no_op, name) if no_op else real)


def decode_steps(engine, vocab: int, batch: int, steps: int, seed: int) -> list[float]:
    """Seconds of ``steps`` decode steps of ``batch`` fresh greedy requests (after their
    prefill and 3 untimed steps); the requests are then served to their end."""
    sp = SamplingParams(max_tokens=steps * 3 + 16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, vocab, seed)):
        engine.add_request(EngineRequest(f"b{seed}-{i}", p, sp))
    for _ in range(4):
        engine.step()
        engine.finish_step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        engine.finish_step()
        times.append(time.perf_counter() - t0)
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
            swap.use(False)
            t0 = time.perf_counter()
            decode_steps(engine, vocab, batch, 4, 1)              # compiles or loads the graphs
            warm = time.perf_counter() - t0
            real, stub, reads = [], [], []
            for r in range(args.rounds):
                for no_op in ((False, True) if r % 2 == 0 else (True, False)):
                    swap.use(no_op)
                    step = statistics.median(decode_steps(engine, vocab, batch, args.steps, 10 + r))
                    (stub if no_op else real).append(step)
                swap.use(False)
                reads.append(harness.memory_bandwidth_gbps(torch.get_num_threads(), reps=3)["gbps"])
            step_ms, stub_ms = 1e3 * statistics.median(real), 1e3 * statistics.median(stub)
            gbps = statistics.median(reads)
            nbytes = harness.step_weight_bytes(args.model, batch, k)
            row = {"mode": mode, "batch": batch, "step_ms": round(step_ms, 3),
                   "besides_products_ms": round(stub_ms, 3),
                   "besides_share": round(stub_ms / step_ms, 4),
                   "read_gbps": round(gbps, 1), "step_weight_bytes": nbytes,
                   "weight_share_of_read": round(nbytes / (step_ms / 1e3) / (gbps * 1e9), 4),
                   "rounds_ms": [round(1e3 * t, 2) for t in real],
                   "stubbed_rounds_ms": [round(1e3 * t, 3) for t in stub],
                   "warm_up_s": round(warm, 1)}
            rows.append(row)
            print(f"{mode:>3} batch {batch}: step {step_ms:.2f} ms, besides products {stub_ms:.2f} ms "
                  f"({100 * stub_ms / step_ms:.1f}%); weights {nbytes / 1e6:.0f} MB a step at "
                  f"{100 * row['weight_share_of_read']:.0f}% of the read ({gbps:.1f} GB/s); "
                  f"warm-up {warm:.1f} s", flush=True)
            del engine
    if args.json:
        harness.save_report(harness.report_header(
            model=args.model, threads=torch.get_num_threads(),
            vector_flags=vector_flags(cpu_flags()), rows=rows), Path(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
