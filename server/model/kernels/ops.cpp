// Our C kernels as operators of torch's dispatcher (namespace mtp_native), so that a
// compiled graph calls them from C++: 2 us a call where the same operator defined in
// Python (gemm.kernel_operator) took 11 us, and a decode step makes about a hundred.
//
// The kernels themselves live in their own C libraries (half_avx2.c, avx512_bf16.c,
// avx512_vnni.c), each built only for CPUs with its instruction sets.  This file needs
// none: native.py hands it each kernel's entry points once that library loads
// (mtp_set_kernel), and an operator whose kernel is absent raises, never calls through a
// null pointer.  Every argument is checked before a kernel sees it: a broken rule is a
// RuntimeError, never a crash.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using mm_fn = void (*)(const void*, long, long, long, const void*, long, void*, long, int);
using mm_status_fn = int (*)(const void*, long, long, long, const void*, long, void*, long, int);
using rows_fn = void (*)(const void*, long, long, const void*, const void*, long, void*, int);
using rows_status_fn = int (*)(const void*, long, long, const void*, const void*, long, void*, int);
using moe_fn = void (*)(const void*, long, long, long, long, const void*, const void*, const void*,
                        const void*, long, const void*, const void*, void*, void*, void*, void*, void*,
                        int);
using heads_fn = void (*)(const void*, long, long, long, const void*, long, void*, int);
using half_heads_fn = void (*)(const void*, long, long, long, const void*, long, void*, void*, int);
using dynamic_mm_fn = int (*)(const void*, long, long, const void*, long, const void*, void*, int);
using half_moe_fn = int (*)(const void*, long, long, long, long, const void*, const void*, long, const void*,
                            const void*, void*, int);
using int8_moe_fn = int (*)(const void*, long, long, long, long, const void*, const void*, long, const void*,
                            const void*, const void*, const void*, void*, int);
using attend_fn = void (*)(const void*, long, long, long, const void*, long, const void*, float, long,
                           void*, void*, int);
using paged_fn = void (*)(const void*, long, long, long, const void*, long, const void*, long, const void*,
                          long, float, long, void*, void*, int);
using paged_i8_fn = void (*)(const void*, long, long, long, const void*, const void*, const void*, long, long,
                             const void*, long, const void*, long, float, long, void*, void*, void*, int);

struct Kernels {
  mm_fn bf16_mm = nullptr;           // avx512_bf16.c
  rows_fn bf16_rows = nullptr;
  attend_fn bf16_attend = nullptr;
  paged_fn bf16_attend_paged = nullptr;
  paged_i8_fn bf16_attend_paged_i8 = nullptr;
  moe_fn bf16_moe = nullptr;
  heads_fn bf16_heads = nullptr;
  mm_status_fn i8_mm = nullptr;      // avx512_vnni.c
  rows_status_fn i8_rows = nullptr;
  int8_moe_fn i8_moe = nullptr;
  mm_status_fn half_mm_bf16 = nullptr;   // half_avx2.c
  mm_fn half_mm_f16 = nullptr;
  mm_fn int8_mm = nullptr;
  rows_fn int8_rows = nullptr;
  dynamic_mm_fn int8_dynamic_mm = nullptr;
  half_moe_fn half_moe_bf16 = nullptr;
  int8_moe_fn int8_moe = nullptr;
  half_heads_fn half_heads = nullptr;    // mla_avx2.c
  paged_fn half_attend_paged = nullptr;
  paged_i8_fn half_attend_paged_i8 = nullptr;
} kernels;

void need(const void* fn, const char* name) {
  TORCH_CHECK(fn != nullptr, "mtp_native::", name, ": its kernel library is not loaded here");
}

void check_matrix(const at::Tensor& w, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous(),
              name, ": weight must be a contiguous 2-d CPU tensor of ", dtype);
}

void check_rows(const at::Tensor& x, at::ScalarType dtype, int64_t k, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.dim() == 2 && x.stride(1) == 1,
              name, ": rows must be a 2-d CPU tensor of ", dtype, " with unit column stride");
  TORCH_CHECK(x.size(1) == k, name, ": rows have ", x.size(1), " features, the weight ", k);
}

void check_experts(const at::Tensor& expert, const at::Tensor& w, int64_t rows, const char* name) {
  TORCH_CHECK(expert.scalar_type() == at::kLong && expert.dim() == 1 && expert.is_contiguous()
              && expert.size(0) == rows, name, ": one int64 expert id a row");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), name, ": experts must be contiguous [E, N, K]");
  if (rows > 0) {
    const int64_t* ids = expert.data_ptr<int64_t>();
    for (int64_t a = 0; a < rows; a++)
      TORCH_CHECK(ids[a] >= 0 && ids[a] < w.size(0), name, ": expert id ", ids[a], " outside [0, ",
                  w.size(0), ")");
  }
}

at::Tensor product(const at::Tensor& x, const at::Tensor& w, at::ScalarType xt, at::ScalarType wt,
                   at::ScalarType out, mm_fn fn, const char* name) {
  need(reinterpret_cast<const void*>(fn), name);
  check_matrix(w, wt, name);
  check_rows(x, xt, w.size(1), name);
  auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(out));
  fn(x.data_ptr(), x.size(0), w.size(1), x.stride(0), w.data_ptr(), w.size(0), y.data_ptr(), w.size(0),
     at::get_num_threads());
  return y;
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w) {
  return product(x, w, at::kBFloat16, at::kBFloat16, at::kFloat, kernels.bf16_mm, "bf16_mm");
}

at::Tensor half_mm(const at::Tensor& x, const at::Tensor& w) {
  if (w.scalar_type() == at::kHalf)
    return product(x, w, at::kFloat, at::kHalf, at::kFloat, kernels.half_mm_f16, "half_mm");
  need(reinterpret_cast<const void*>(kernels.half_mm_bf16), "half_mm");
  check_matrix(w, at::kBFloat16, "half_mm");
  check_rows(x, at::kFloat, w.size(1), "half_mm");
  auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  int status = kernels.half_mm_bf16(x.data_ptr(), x.size(0), w.size(1), x.stride(0), w.data_ptr(),
                                    w.size(0), y.data_ptr(), w.size(0), at::get_num_threads());
  TORCH_CHECK(status == 0, "half_mm: no memory for the split rows");
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w) {       // x int16 (half_avx2.c)
  return product(x, w, at::kShort, at::kChar, at::kInt, kernels.int8_mm, "int8_mm");
}

// x float32 [M, K], w int8 [N, K], w_scale float32 [N] -> float32 [M, N]: the dynamic scheme's
// quantization of x, the exact sums and the scaling in one call (half_avx2.c int8_dynamic_mm).
at::Tensor int8_dynamic_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  const char* name = "int8_dynamic_mm";
  need(reinterpret_cast<const void*>(kernels.int8_dynamic_mm), name);
  check_matrix(w, at::kChar, name);
  check_rows(x, at::kFloat, w.size(1), name);
  TORCH_CHECK(x.is_contiguous(), name, ": rows must be contiguous");
  TORCH_CHECK(w_scale.device().is_cpu() && w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
              w_scale.numel() == w.size(0), name, ": one float32 scale a weight row");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return y;
  int status = kernels.int8_dynamic_mm(x.data_ptr(), x.size(0), w.size(1), w.data_ptr(), w.size(0),
                                       w_scale.data_ptr(), y.data_ptr(), at::get_num_threads());
  TORCH_CHECK(status == 0, name, ": no memory for the quantized rows");
  return y;
}

// The operands of a window's routed MoE in one call: x float32 [T, H], weights float32 [T, k],
// idx int64 [T, k <= 64] of ids in [0, E), gate_up [E, 2I, H] and down [E, H, I] of the experts'
// dtype (``what`` names it in the error).  Returns {T, H, I, k, E}.
struct MoeShape { int64_t T, H, I, k, E; };

MoeShape check_moe(const char* name, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx,
                   const at::Tensor& gate_up, const at::Tensor& down, at::ScalarType dtype, const char* what) {
  for (const at::Tensor* w : {&gate_up, &down})
    TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == dtype && w->dim() == 3 && w->is_contiguous(),
                name, ": experts must be contiguous 3-d CPU tensors of ", what);
  const int64_t E = gate_up.size(0), I2 = gate_up.size(1), H = gate_up.size(2), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && down.size(0) == E && down.size(1) == H && down.size(2) == I,
              name, ": gate_up is ", gate_up.sizes(), ", down ", down.sizes());
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous()
              && x.size(1) == H, name, ": x must be a contiguous [T, ", H, "] CPU tensor of float32");
  const int64_t T = x.size(0);
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.is_contiguous() &&
              idx.size(0) == T && idx.size(1) <= 64, name, ": idx must be a contiguous int64 [", T, ", k <= 64]");
  const int64_t k = idx.size(1);
  TORCH_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
              weights.dim() == 2 && weights.size(0) == T && weights.size(1) == k,
              name, ": weights must be a contiguous float32 [", T, ", ", k, "]");
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t a = 0; a < T * k; a++)
    TORCH_CHECK(ids[a] >= 0 && ids[a] < E, name, ": expert id ", ids[a], " outside [0, ", E, ")");
  return {T, H, I, k, E};
}

// x float32 [T, H], weights float32 [T, k], idx int64 [T, k], gate_up bf16 [E, 2I, H], down bf16
// [E, H, I] -> float32 [T, H]: a window's routed experts in one call (half_avx2.c
// half_moe_bf16, which sorts the pairs by expert itself).
at::Tensor half_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx,
                    const at::Tensor& gate_up, const at::Tensor& down) {
  const char* name = "half_moe";
  need(reinterpret_cast<const void*>(kernels.half_moe_bf16), name);
  const MoeShape m = check_moe(name, x, weights, idx, gate_up, down, at::kBFloat16, "BFloat16");
  auto out = at::empty({m.T, m.H}, x.options());
  if (m.T == 0) return out;
  int status = kernels.half_moe_bf16(x.data_ptr(), m.T, m.H, m.I, m.k, idx.data_ptr(), weights.data_ptr(), m.E,
                                     gate_up.data_ptr(), down.data_ptr(), out.data_ptr(), at::get_num_threads());
  TORCH_CHECK(status == 0, name, ": no memory for the experts' scratch");
  return out;
}

// x float32 [T, H], weights float32 [T, k], idx int64 [T, k], gate_up int8 [E, 2I, H] with
// gate_up_scale float32 [E, 2I], down int8 [E, H, I] with down_scale float32 [E, H] -> float32
// [T, H]: a window's routed int8 experts (dynamic scheme, bfloat16 activations) in one call
// (int8_moe.h), by ``fn``: half_avx2.c int8_moe or avx512_vnni.c i8_moe, the same numbers.
at::Tensor moe_int8(const char* name, int8_moe_fn fn, const at::Tensor& x, const at::Tensor& weights,
                    const at::Tensor& idx, const at::Tensor& gate_up, const at::Tensor& gate_up_scale,
                    const at::Tensor& down, const at::Tensor& down_scale) {
  need(reinterpret_cast<const void*>(fn), name);
  const MoeShape m = check_moe(name, x, weights, idx, gate_up, down, at::kChar, "int8");
  TORCH_CHECK(gate_up_scale.device().is_cpu() && gate_up_scale.scalar_type() == at::kFloat &&
              gate_up_scale.is_contiguous() && gate_up_scale.numel() == m.E * 2 * m.I &&
              down_scale.device().is_cpu() && down_scale.scalar_type() == at::kFloat &&
              down_scale.is_contiguous() && down_scale.numel() == m.E * m.H,
              name, ": scales must be contiguous float32 [E, 2I] and [E, H]");
  TORCH_CHECK(m.I <= 16384, name, ": at most 16384 intermediate features (the activation row's stack)");
  auto out = at::empty({m.T, m.H}, x.options());
  if (m.T == 0) return out;
  int status = fn(x.data_ptr(), m.T, m.H, m.I, m.k, idx.data_ptr(), weights.data_ptr(), m.E,
                  gate_up.data_ptr(), gate_up_scale.data_ptr(), down.data_ptr(), down_scale.data_ptr(),
                  out.data_ptr(), at::get_num_threads());
  TORCH_CHECK(status == 0, name, ": no memory for the experts' scratch");
  return out;
}

at::Tensor int8_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx,
                    const at::Tensor& gate_up, const at::Tensor& gate_up_scale, const at::Tensor& down,
                    const at::Tensor& down_scale) {
  return moe_int8("int8_moe", kernels.int8_moe, x, weights, idx, gate_up, gate_up_scale, down, down_scale);
}

at::Tensor i8_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx,
                  const at::Tensor& gate_up, const at::Tensor& gate_up_scale, const at::Tensor& down,
                  const at::Tensor& down_scale) {
  return moe_int8("i8_moe", kernels.i8_moe, x, weights, idx, gate_up, gate_up_scale, down, down_scale);
}

at::Tensor i8_mm(const at::Tensor& x, const at::Tensor& w) {
  need(reinterpret_cast<const void*>(kernels.i8_mm), "i8_mm");
  check_matrix(w, at::kChar, "i8_mm");
  check_rows(x, at::kChar, w.size(1), "i8_mm");
  auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kInt));
  int status = kernels.i8_mm(x.data_ptr(), x.size(0), w.size(1), x.stride(0), w.data_ptr(), w.size(0),
                             y.data_ptr(), w.size(0), at::get_num_threads());
  TORCH_CHECK(status == 0, "i8_mm: no memory for the activations' scratch");
  return y;
}

at::Tensor rows_product(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w,
                        at::ScalarType xt, at::ScalarType wt, at::ScalarType out, const void* fn,
                        bool status, const char* name) {
  need(fn, name);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == wt, name, ": experts must be CPU ", wt);
  check_experts(expert, w, x.size(0), name);
  check_rows(x, xt, w.size(2), name);
  TORCH_CHECK(x.is_contiguous(), name, ": rows must be contiguous");
  auto y = at::empty({x.size(0), w.size(1)}, x.options().dtype(out));
  if (status) {
    int s = reinterpret_cast<rows_status_fn>(const_cast<void*>(fn))(
        x.data_ptr(), x.size(0), x.size(1), expert.data_ptr(), w.data_ptr(), w.size(1), y.data_ptr(),
        at::get_num_threads());
    TORCH_CHECK(s == 0, name, ": no memory for the activations' scratch");
  } else {
    reinterpret_cast<rows_fn>(const_cast<void*>(fn))(x.data_ptr(), x.size(0), x.size(1), expert.data_ptr(),
                                                     w.data_ptr(), w.size(1), y.data_ptr(),
                                                     at::get_num_threads());
  }
  return y;
}

at::Tensor bf16_rows(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w) {
  return rows_product(x, expert, w, at::kBFloat16, at::kBFloat16, at::kFloat,
                      reinterpret_cast<const void*>(kernels.bf16_rows), false, "bf16_rows");
}

at::Tensor i8_rows(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w) {
  return rows_product(x, expert, w, at::kChar, at::kChar, at::kInt,
                      reinterpret_cast<const void*>(kernels.i8_rows), true, "i8_rows");
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& expert, const at::Tensor& w) {
  return rows_product(x, expert, w, at::kShort, at::kChar, at::kInt,
                      reinterpret_cast<const void*>(kernels.int8_rows), false, "int8_rows");
}

// x bf16 [T, nH, K], w bf16 [nH, N, K] -> float32 [T, nH, N]: each head's rows through its
// own weight (avx512_bf16.c bf16_heads; mla_avx2.c half_heads, with a float32 copy of x).
at::Tensor heads_product(const at::Tensor& x, const at::Tensor& w, const char* name) {
  for (const at::Tensor* t : {&x, &w})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->is_contiguous(),
                name, ": x and w must be contiguous 3-d CPU tensors of BFloat16");
  TORCH_CHECK(x.size(1) == w.size(0) && x.size(2) == w.size(2), name, ": x is ", x.sizes(), ", w ", w.sizes());
  return at::empty({x.size(0), x.size(1), w.size(1)}, x.options().dtype(at::kFloat));
}

at::Tensor bf16_heads(const at::Tensor& x, const at::Tensor& w) {
  need(reinterpret_cast<const void*>(kernels.bf16_heads), "bf16_heads");
  auto y = heads_product(x, w, "bf16_heads");
  if (x.size(0) > 0)
    kernels.bf16_heads(x.data_ptr(), x.size(0), x.size(1), x.size(2), w.data_ptr(), w.size(1), y.data_ptr(),
                       at::get_num_threads());
  return y;
}

// Rows past which bf16_heads_wide hands the product to oneDNN's bf16 batched GEMM, as
// avx512.py's KERNEL_ROWS does for the eager projections.  Why: a prompt's rows (the
// compiled prefill graphs call it for every length) make the product arithmetic, with the
// weights in cache, and at K = 128 (W_UK) each output is 4 VDPBF16PS and a horizontal sum:
// on the 2-core Zen 4 the kernel took 1.95 ms for 256 rows of the 0.5b model's 12 heads,
// oneDNN 0.89 (W_UV, K = 384: 1.09 against 0.79).  Decode windows' graphs call bf16_heads,
// the kernel at any rows: a row's values then do not depend on the window's size, which
// keeps MTP's verify windows exact at every batch.
constexpr int64_t kHeadsKernelRows = 64;

at::Tensor bf16_heads_wide(const at::Tensor& x, const at::Tensor& w) {
  if (x.size(0) <= kHeadsKernelRows)
    return bf16_heads(x, w);
  auto y = heads_product(x, w, "bf16_heads_wide");
  // [nH, T, K] . [nH, K, N] -> [nH, T, N], back to [T, nH, N].
  y.copy_(at::bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1));
  return y;
}

at::Tensor half_heads(const at::Tensor& x, const at::Tensor& w) {
  need(reinterpret_cast<const void*>(kernels.half_heads), "half_heads");
  auto y = heads_product(x, w, "half_heads");
  auto xf = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (x.size(0) > 0)
    kernels.half_heads(x.data_ptr(), x.size(0), x.size(1), x.size(2), w.data_ptr(), w.size(1), y.data_ptr(),
                       xf.data_ptr(), at::get_num_threads());
  return y;
}

// x bf16 [T, H], weights float32 [T, k], idx int64 [T, k] (the router's choice), gate_up
// bf16 [E, 2I, H], down bf16 [E, H, I] -> float32 [T, H]: the routed experts' weighted sum
// (avx512_bf16.c bf16_moe).  The pairs are sorted here, by expert and stably, as the eager
// MoE sorts them, so each expert's rows and each token's sum come in the same order.
at::Tensor bf16_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx,
                    const at::Tensor& gate_up, const at::Tensor& down) {
  need(reinterpret_cast<const void*>(kernels.bf16_moe), "bf16_moe");
  for (const at::Tensor* w : {&gate_up, &down})
    TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == at::kBFloat16 && w->dim() == 3 && w->is_contiguous(),
                "bf16_moe: experts must be contiguous 3-d CPU tensors of BFloat16");
  const int64_t E = gate_up.size(0), I2 = gate_up.size(1), H = gate_up.size(2), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && down.size(0) == E && down.size(1) == H && down.size(2) == I,
              "bf16_moe: gate_up is ", gate_up.sizes(), ", down ", down.sizes());
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous()
              && x.size(1) == H, "bf16_moe: x must be a contiguous [T, ", H, "] CPU tensor of BFloat16");
  const int64_t T = x.size(0);
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.is_contiguous() && idx.size(0) == T,
              "bf16_moe: idx must be a contiguous int64 [", T, ", k]");
  const int64_t k = idx.size(1);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2
              && weights.size(0) == T && weights.size(1) == k,
              "bf16_moe: weights must be a contiguous float32 [", T, ", ", k, "]");
  const int64_t A = T * k;
  const int64_t* ids = idx.data_ptr<int64_t>();
  auto longs = x.options().dtype(at::kLong);
  auto offsets = at::zeros({E + 1}, longs);
  auto src = at::empty({A}, longs), pairs = at::empty({A}, longs);
  auto pair_weights = at::empty({A}, weights.options());
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; a++) {
    TORCH_CHECK(ids[a] >= 0 && ids[a] < E, "bf16_moe: expert id ", ids[a], " outside [0, ", E, ")");
    off[ids[a] + 1]++;
  }
  for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + E);
  int64_t* s = src.data_ptr<int64_t>();
  int64_t* rows = pairs.data_ptr<int64_t>();
  float* pw = pair_weights.data_ptr<float>();
  const float* wt = weights.data_ptr<float>();
  for (int64_t a = 0; a < A; a++) {              // a = t * k + j: stable in (token, choice)
    int64_t at_row = next[ids[a]]++;
    s[at_row] = a / k;
    rows[a] = at_row;
    pw[a] = wt[a];
  }
  for (int64_t t = 0; t < T; t++)                // each token's rows ascending (by expert)
    for (int64_t j = 1; j < k; j++)
      for (int64_t i = t * k + j; i > t * k && rows[i - 1] > rows[i]; i--) {
        std::swap(rows[i - 1], rows[i]);
        std::swap(pw[i - 1], pw[i]);
      }
  auto xs = at::empty({A, H}, x.options());
  auto gu = at::empty({A, I2}, x.options().dtype(at::kFloat));
  auto act = at::empty({A, I}, x.options());
  auto ys = at::empty({A, H}, x.options().dtype(at::kFloat));
  auto out = at::empty({T, H}, x.options().dtype(at::kFloat));
  if (T == 0) return out;
  kernels.bf16_moe(x.data_ptr(), T, H, I, k, s, rows, pw, off, E, gate_up.data_ptr(), down.data_ptr(),
                   xs.data_ptr(), gu.data_ptr(), act.data_ptr(), ys.data_ptr(), out.data_ptr(),
                   at::get_num_threads());
  return out;
}

// q bf16 [B, R, D], ctx bf16 [B, S, D], bias float32 [B, R, S] -> float32 [B, R, kvr].
at::Tensor bf16_attend(const at::Tensor& q, const at::Tensor& ctx, const at::Tensor& bias, double scale,
                       int64_t kvr) {
  need(reinterpret_cast<const void*>(kernels.bf16_attend), "bf16_attend");
  for (const at::Tensor* t : {&q, &ctx})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->is_contiguous(),
                "bf16_attend: q and ctx must be contiguous 3-d CPU tensors of BFloat16");
  TORCH_CHECK(bias.device().is_cpu() && bias.scalar_type() == at::kFloat && bias.dim() == 3 && bias.is_contiguous(),
              "bf16_attend: bias must be a contiguous 3-d CPU tensor of Float");
  const int64_t B = q.size(0), R = q.size(1), D = q.size(2), S = ctx.size(1);
  TORCH_CHECK(ctx.size(0) == B && ctx.size(2) == D, "bf16_attend: ctx is ", ctx.sizes(), ", q ", q.sizes());
  TORCH_CHECK(bias.size(0) == B && bias.size(1) == R && bias.size(2) == S, "bf16_attend: bias is ",
              bias.sizes(), ", want [", B, ", ", R, ", ", S, "]");
  TORCH_CHECK(kvr > 0 && kvr <= D, "bf16_attend: kvr ", kvr, " outside (0, ", D, "]");
  auto out = at::empty({B, R, kvr}, q.options().dtype(at::kFloat));
  auto p = at::empty({B, R, S}, q.options().dtype(at::kFloat));
  kernels.bf16_attend(q.data_ptr(), B, R, D, ctx.data_ptr(), S, bias.data_ptr(), static_cast<float>(scale), kvr,
                      out.data_ptr(), p.data_ptr(), at::get_num_threads());
  return out;
}

// q bf16 [B, R, D], cache bf16 [blocks, bs, D], tables int64 [B, nb], pos int64 [B, Q]
// (R a multiple of Q) -> float32 [B, R, kvr]: bf16_attend over each sequence's positions
// 0 .. pos read through its block table.  Every block a row can see is checked first.
// The rules both paged attentions check before a kernel reads anything: q bf16 [B, R, D],
// tables / positions int64 [B, nb] / [B, Q] (R a multiple of Q), every position inside its
// table and every block a query can see inside the cache's ``blocks`` of ``bs`` rows.
void check_paged(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& pos, int64_t blocks,
                 int64_t bs, int64_t kvr, const char* name) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.is_contiguous(),
              name, ": q must be a contiguous 3-d CPU tensor of BFloat16");
  for (const at::Tensor* t : {&tables, &pos})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 2 && t->is_contiguous(),
                name, ": block tables and positions must be contiguous 2-d CPU tensors of int64");
  const int64_t B = q.size(0), R = q.size(1), nb = tables.size(1), Q = pos.size(1);
  TORCH_CHECK(tables.size(0) == B && pos.size(0) == B, name, ": ", B, " sequences in q, ",
              tables.size(0), " block tables, ", pos.size(0), " position rows");
  TORCH_CHECK(Q > 0 && R % Q == 0, name, ": ", R, " query rows are not ", Q, " tokens' heads");
  TORCH_CHECK(kvr > 0 && kvr <= q.size(2), name, ": kvr ", kvr, " outside (0, ", q.size(2), "]");
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < Q; t++) {
      const int64_t p = ps[b * Q + t];
      TORCH_CHECK(p >= 0 && p < nb * bs, name, ": position ", p, " outside the ", nb * bs,
                  " its block table holds");
      for (int64_t k = 0; k <= p / bs; k++)
        TORCH_CHECK(tb[b * nb + k] >= 0 && tb[b * nb + k] < blocks, name, ": block ", tb[b * nb + k],
                    " outside the cache's ", blocks);
    }
}

// mla_avx2.c keeps a work item's queries in float32 on its stack: rows of at most this many
// features (DeepSeek-V3's are 576).
constexpr int64_t HALF_MAX_FEATURES = 1024;

at::Tensor attend_paged(paged_fn fn, const char* name, int64_t max_d, const at::Tensor& q,
                        const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& pos, double scale,
                        int64_t kvr) {
  need(reinterpret_cast<const void*>(fn), name);
  TORCH_CHECK(q.dim() < 3 || q.size(2) <= max_d, name, ": rows of ", q.size(2), " features; at most ", max_d);
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kBFloat16 && cache.dim() == 3 &&
              cache.is_contiguous(), name, ": cache must be a contiguous 3-d CPU tensor of BFloat16");
  check_paged(q, tables, pos, cache.size(0), cache.size(1), kvr, name);
  const int64_t B = q.size(0), R = q.size(1), D = q.size(2), bs = cache.size(1);
  const int64_t nb = tables.size(1), Q = pos.size(1);
  TORCH_CHECK(cache.size(2) == D, name, ": cache rows have ", cache.size(2), " features, q ", D);
  auto out = at::empty({B, R, kvr}, q.options().dtype(at::kFloat));
  auto p = at::empty({B, R, nb * bs}, q.options().dtype(at::kFloat));
  if (B * R == 0) return out;
  fn(q.data_ptr(), B, R, D, cache.data_ptr(), bs, tables.data_ptr(), nb, pos.data_ptr(), Q,
     static_cast<float>(scale), kvr, out.data_ptr(), p.data_ptr(), at::get_num_threads());
  return out;
}

// An int8 latent cache's tensors (latent int8 [blocks, bs, L], scale float32 [blocks, bs, 1],
// rope bf16 [blocks, bs, P], L + P = D): bf16_attend_paged over its rows dequantized.
at::Tensor attend_paged_i8(paged_i8_fn fn, const char* name, int64_t max_d, const at::Tensor& q,
                           const at::Tensor& latent, const at::Tensor& scales, const at::Tensor& rope,
                           const at::Tensor& tables, const at::Tensor& pos, double scale, int64_t kvr) {
  need(reinterpret_cast<const void*>(fn), name);
  TORCH_CHECK(q.dim() < 3 || q.size(2) <= max_d, name, ": rows of ", q.size(2), " features; at most ", max_d);
  TORCH_CHECK(latent.device().is_cpu() && latent.scalar_type() == at::kChar && latent.dim() == 3 &&
              latent.is_contiguous(), name, ": latent must be a contiguous 3-d CPU tensor of int8");
  const int64_t blocks = latent.size(0), bs = latent.size(1), L = latent.size(2);
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == blocks * bs, name, ": scale must be a contiguous float32 tensor of one value a row");
  TORCH_CHECK(rope.device().is_cpu() && rope.scalar_type() == at::kBFloat16 && rope.dim() == 3 &&
              rope.is_contiguous() && rope.size(0) == blocks && rope.size(1) == bs, name,
              ": rope must be a contiguous [blocks, block size, P] CPU tensor of BFloat16");
  check_paged(q, tables, pos, blocks, bs, kvr, name);
  const int64_t B = q.size(0), R = q.size(1), D = q.size(2), nb = tables.size(1), Q = pos.size(1);
  TORCH_CHECK(L + rope.size(2) == D, name, ": cache rows have ", L, " + ", rope.size(2), " features, q ", D);
  const int threads = at::get_num_threads();
  auto out = at::empty({B, R, kvr}, q.options().dtype(at::kFloat));
  auto p = at::empty({B, R, nb * bs}, q.options().dtype(at::kFloat));
  auto buf = at::empty({B, nb * bs, D}, q.options());
  if (B * R == 0) return out;
  fn(q.data_ptr(), B, R, D, latent.data_ptr(), scales.data_ptr(), rope.data_ptr(), bs, L, tables.data_ptr(), nb,
     pos.data_ptr(), Q, static_cast<float>(scale), kvr, out.data_ptr(), p.data_ptr(), buf.data_ptr(), threads);
  return out;
}

// The operators over those: avx512_bf16.c's and mla_avx2.c's kernels.
at::Tensor bf16_attend_paged(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                             const at::Tensor& pos, double scale, int64_t kvr) {
  return attend_paged(kernels.bf16_attend_paged, "bf16_attend_paged", INT64_MAX, q, cache, tables, pos, scale,
                      kvr);
}

at::Tensor half_attend_paged(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                             const at::Tensor& pos, double scale, int64_t kvr) {
  return attend_paged(kernels.half_attend_paged, "half_attend_paged", HALF_MAX_FEATURES, q, cache, tables, pos,
                      scale, kvr);
}

at::Tensor bf16_attend_paged_i8(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& scales,
                                const at::Tensor& rope, const at::Tensor& tables, const at::Tensor& pos,
                                double scale, int64_t kvr) {
  return attend_paged_i8(kernels.bf16_attend_paged_i8, "bf16_attend_paged_i8", INT64_MAX, q, latent, scales, rope,
                         tables, pos, scale, kvr);
}

at::Tensor half_attend_paged_i8(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& scales,
                                const at::Tensor& rope, const at::Tensor& tables, const at::Tensor& pos,
                                double scale, int64_t kvr) {
  return attend_paged_i8(kernels.half_attend_paged_i8, "half_attend_paged_i8", HALF_MAX_FEATURES, q, latent, scales,
                         rope, tables, pos, scale, kvr);
}

// float32 logits [R, V] -> int64 [R]: each row's first largest value, a NaN counting as
// larger than any number (torch.argmax's rule, so the same ids).  Why: torch's CPU argmax
// took 29 us a 32000-wide row on the 2-core Zen 4 (171 us at DeepSeek-V3's 129280), one
// element at a time; a greedy step takes one a verified row and one a draft.  Here a row
// is two SSE2 passes: its maximum, then where it first occurs (8 us a 32000-wide row, 30
// at 129280; 8 rows 70 against torch's 135 us on its 2 threads).
int64_t first_max(const float* row, int64_t n) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__SSE2__)
  // Four lanes by four vectors: MAXPS drops a NaN, CMPUNORDPS notes it.
  __m128 m[4], u = _mm_setzero_ps();
  for (int j = 0; j < 4; j++) m[j] = _mm_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 4; j++) {
      const __m128 v = _mm_loadu_ps(row + i + 4 * j);
      u = _mm_or_ps(u, _mm_cmpunord_ps(v, v));
      m[j] = _mm_max_ps(v, m[j]);
    }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3])));
  for (float v : lanes) top = v > top ? v : top;
  nan = _mm_movemask_ps(u) != 0;
#endif
  for (; i < n; i++) {
    const float v = row[i];
    nan |= v != v;
    top = v > top ? v : top;
  }
  i = 0;
#if defined(__SSE2__)
  const __m128 t = _mm_set1_ps(top);
  for (; i + 4 <= n; i += 4) {
    const __m128 v = _mm_loadu_ps(row + i);
    const int hit = _mm_movemask_ps(nan ? _mm_cmpunord_ps(v, v) : _mm_cmpeq_ps(v, t));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; i++)
    if (nan ? row[i] != row[i] : row[i] == top) return i;
  return 0;                                     // a row of -inf only: its first
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2
              && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be a non-empty float32 [R, V] CPU tensor with unit column stride");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; r++) ids[r] = first_max(x + r * ld, V);
  return out;
}

/* The screened head's rows (engine/sample/screened_head.py): each row x of the head's
 * input (bf16 or float32 [M, K]) quantized as the dynamic scheme does (s = max|x| / 127,
 * q = round(x / s) within +-127) and the norms its bound takes, in double: |s q|,
 * |x - s q|, |x|.  Returns (q int8 [M, K], float32 [M, 4]: s and the three norms); a row
 * holding a NaN or an infinity gets NaN norms.  One pass where ~20 torch operations took
 * ~0.2 ms a call. */
std::tuple<at::Tensor, at::Tensor> screen_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1
              && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "screen_rows: x must be a bf16 or float32 [M, K] CPU tensor with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto stats = at::empty({M, 4}, x.options().dtype(at::kFloat));
  std::vector<float> row(K);
  int8_t* qp = q.data_ptr<int8_t>();
  float* st = stats.data_ptr<float>();
  const bool half = x.scalar_type() == at::kBFloat16;
  for (int64_t m = 0; m < M; m++) {
    if (half) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * ld;
      for (int64_t k = 0; k < K; k++) {
        uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
        std::memcpy(&row[k], &bits, sizeof(float));
      }
    } else {
      std::memcpy(row.data(), x.data_ptr<float>() + m * ld, static_cast<size_t>(K) * sizeof(float));
    }
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < K; k++) {
      finite = finite && std::isfinite(row[k]);
      amax = std::max(amax, std::fabs(row[k]));
    }
    const float sc = std::max(amax, 1e-10f) / 127.0f;
    double hat2 = 0.0, r2 = 0.0, x2 = 0.0;
    for (int64_t k = 0; k < K; k++) {
      float v = std::nearbyint(row[k] / sc);
      v = std::min(127.0f, std::max(-127.0f, v));
      qp[m * K + k] = static_cast<int8_t>(finite ? v : 0.0f);
      const double hat = static_cast<double>(v) * sc, xv = row[k];
      hat2 += hat * hat;
      r2 += (xv - hat) * (xv - hat);
      x2 += xv * xv;
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    st[m * 4 + 0] = sc;
    st[m * 4 + 1] = finite ? static_cast<float>(std::sqrt(hat2)) : nan;
    st[m * 4 + 2] = finite ? static_cast<float>(std::sqrt(r2)) : nan;
    st[m * 4 + 3] = finite ? static_cast<float>(std::sqrt(x2)) : nan;
  }
  return {q, stats};
}

/* The screened head's candidates (engine/sample/screened_head.py): with each row's
 * ``screen_rows`` stats (s, |s q|, |x - s q|, |x|), a = |s q| and b = |x - s q| + chain |x|,
 * the screened logit l = sums[m, j] * col_scale[j] * s and its bound B = (b w_norm[j] +
 * a d_norm[j]) c_bound + |l| c_abs + 1e-30; the columns j where, for some row m, l + B reaches the
 * row's largest l - B, ascending.  Two SSE2 passes over the sums (each recomputing l and
 * B, nothing [M, V] stored), where torch's ~12 operations on [M, V] took ~0.3 ms at V =
 * 32000 and the scalar loops ~0.12. */
struct ScreenRow {
  __m128 rs, a, b, cb, ca, sign, tiny;   // tiny: an absolute floor (flushed denormals)
  const float *cs, *dn, *wn;
  // l and B of columns j .. j + 3 of the row's int32 sums
  inline void at(const int32_t* row, int64_t j, __m128& l, __m128& B) const {
    l = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j))),
                              _mm_loadu_ps(cs + j)), rs);
    __m128 e = _mm_add_ps(_mm_mul_ps(b, _mm_loadu_ps(wn + j)), _mm_mul_ps(a, _mm_loadu_ps(dn + j)));
    B = _mm_add_ps(_mm_add_ps(_mm_mul_ps(e, cb), _mm_mul_ps(_mm_andnot_ps(sign, l), ca)), tiny);
  }
  inline void one(const int32_t* row, int64_t j, float& l, float& B) const {
    l = static_cast<float>(row[j]) * cs[j] * _mm_cvtss_f32(rs);
    float e = _mm_cvtss_f32(b) * wn[j] + _mm_cvtss_f32(a) * dn[j];
    B = e * _mm_cvtss_f32(cb) + std::fabs(l) * _mm_cvtss_f32(ca) + _mm_cvtss_f32(tiny);
  }
};

at::Tensor screen_candidates(const at::Tensor& sums, const at::Tensor& stats,
                             const at::Tensor& col_scale, const at::Tensor& d_norm,
                             const at::Tensor& w_norm, double chain, double c_bound, double c_abs) {
  TORCH_CHECK(sums.device().is_cpu() && sums.scalar_type() == at::kInt && sums.dim() == 2
              && sums.is_contiguous(), "screen_candidates: sums must be contiguous int32 [M, V]");
  const int64_t M = sums.size(0), V = sums.size(1);
  for (const at::Tensor* t : {&col_scale, &d_norm, &w_norm})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous()
                && t->numel() == V,
                "screen_candidates: column vectors must be contiguous float32 of V values");
  TORCH_CHECK(stats.device().is_cpu() && stats.scalar_type() == at::kFloat && stats.is_contiguous()
              && stats.dim() == 2 && stats.size(0) == M && stats.size(1) == 4,
              "screen_candidates: stats must be screen_rows' contiguous float32 [M, 4]");
  const int32_t* S = sums.data_ptr<int32_t>();
  const float* st = stats.data_ptr<float>();
  std::vector<ScreenRow> rows(M);
  for (int64_t m = 0; m < M; m++)   // a = |s q|, b = |x - s q| + chain |x|
    rows[m] = ScreenRow{_mm_set1_ps(st[m * 4]), _mm_set1_ps(st[m * 4 + 1]),
                        _mm_set1_ps(st[m * 4 + 2] + static_cast<float>(chain) * st[m * 4 + 3]),
                        _mm_set1_ps(static_cast<float>(c_bound)), _mm_set1_ps(static_cast<float>(c_abs)),
                        _mm_set1_ps(-0.0f), _mm_set1_ps(1e-30f), col_scale.data_ptr<float>(), d_norm.data_ptr<float>(),
                        w_norm.data_ptr<float>()};
  const int64_t V8 = V & ~int64_t{7}, V4 = V & ~int64_t{3};
  std::vector<float> floor(M);
  for (int64_t m = 0; m < M; m++) {
    const ScreenRow& r = rows[m];
    const int32_t* row = S + m * V;
    const float inf = std::numeric_limits<float>::infinity();
    __m128 b0 = _mm_set1_ps(-inf), b1 = b0, l, B;
    for (int64_t j = 0; j < V8; j += 8) {             // two chains: max's latency, not its rate
      r.at(row, j, l, B);
      b0 = _mm_max_ps(b0, _mm_sub_ps(l, B));
      r.at(row, j + 4, l, B);
      b1 = _mm_max_ps(b1, _mm_sub_ps(l, B));
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_max_ps(b0, b1));
    float best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    for (int64_t j = V8; j < V; j++) {
      float lj, Bj;
      r.one(row, j, lj, Bj);
      best = std::max(best, lj - Bj);
    }
    floor[m] = best;
  }
  std::vector<int64_t> keep;
  for (int64_t j = 0; j < V4; j += 4) {
    int hit = 0;
    for (int64_t m = 0; m < M && hit != 0xF; m++) {
      __m128 l, B;
      rows[m].at(S + m * V, j, l, B);
      hit |= _mm_movemask_ps(_mm_cmpge_ps(_mm_add_ps(l, B), _mm_set1_ps(floor[m])));
    }
    for (int i = 0; i < 4; i++)
      if (hit >> i & 1) keep.push_back(j + i);
  }
  for (int64_t j = V4; j < V; j++)
    for (int64_t m = 0; m < M; m++) {
      float lj, Bj;
      rows[m].one(S + m * V, j, lj, Bj);
      if (lj + Bj >= floor[m]) {
        keep.push_back(j);
        break;
      }
    }
  auto out = at::empty({static_cast<int64_t>(keep.size())}, sums.options().dtype(at::kLong));
  std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

extern "C" int mtp_set_kernel(const char* name, void* fn) {
  struct { const char* name; void** slot; } slots[] = {
      {"bf16_mm", reinterpret_cast<void**>(&kernels.bf16_mm)},
      {"bf16_rows", reinterpret_cast<void**>(&kernels.bf16_rows)},
      {"bf16_attend", reinterpret_cast<void**>(&kernels.bf16_attend)},
      {"bf16_attend_paged", reinterpret_cast<void**>(&kernels.bf16_attend_paged)},
      {"bf16_attend_paged_i8", reinterpret_cast<void**>(&kernels.bf16_attend_paged_i8)},
      {"bf16_moe", reinterpret_cast<void**>(&kernels.bf16_moe)},
      {"bf16_heads", reinterpret_cast<void**>(&kernels.bf16_heads)},
      {"i8_mm", reinterpret_cast<void**>(&kernels.i8_mm)},
      {"i8_rows", reinterpret_cast<void**>(&kernels.i8_rows)},
      {"i8_moe", reinterpret_cast<void**>(&kernels.i8_moe)},
      {"half_mm_bf16", reinterpret_cast<void**>(&kernels.half_mm_bf16)},
      {"half_mm_f16", reinterpret_cast<void**>(&kernels.half_mm_f16)},
      {"int8_mm", reinterpret_cast<void**>(&kernels.int8_mm)},
      {"int8_rows", reinterpret_cast<void**>(&kernels.int8_rows)},
      {"int8_dynamic_mm", reinterpret_cast<void**>(&kernels.int8_dynamic_mm)},
      {"half_moe_bf16", reinterpret_cast<void**>(&kernels.half_moe_bf16)},
      {"int8_moe", reinterpret_cast<void**>(&kernels.int8_moe)},
      {"half_heads", reinterpret_cast<void**>(&kernels.half_heads)},
      {"half_attend_paged", reinterpret_cast<void**>(&kernels.half_attend_paged)},
      {"half_attend_paged_i8", reinterpret_cast<void**>(&kernels.half_attend_paged_i8)},
  };
  for (auto& s : slots)
    if (std::strcmp(s.name, name) == 0) {
      *s.slot = fn;
      return 0;
    }
  return -1;
}

TORCH_LIBRARY_FRAGMENT(mtp_native, m) {
  m.def("bf16_mm(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_rows(Tensor x, Tensor expert, Tensor w) -> Tensor");
  m.def("bf16_attend(Tensor q, Tensor ctx, Tensor bias, float scale, int kvr) -> Tensor");
  m.def("bf16_attend_paged(Tensor q, Tensor cache, Tensor tables, Tensor pos, float scale, int kvr) -> Tensor");
  m.def("bf16_attend_paged_i8(Tensor q, Tensor latent, Tensor scales, Tensor rope, Tensor tables, Tensor pos, "
        "float scale, int kvr) -> Tensor");
  m.def("bf16_moe(Tensor x, Tensor weights, Tensor idx, Tensor gate_up, Tensor down) -> Tensor");
  m.def("bf16_heads(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_heads_wide(Tensor x, Tensor w) -> Tensor");
  m.def("i8_mm(Tensor x, Tensor w) -> Tensor");
  m.def("i8_rows(Tensor x, Tensor expert, Tensor w) -> Tensor");
  m.def("i8_moe(Tensor x, Tensor weights, Tensor idx, Tensor gate_up, Tensor gate_up_scale, Tensor down, "
        "Tensor down_scale) -> Tensor");
  m.def("half_mm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_rows(Tensor x, Tensor expert, Tensor w) -> Tensor");
  m.def("int8_dynamic_mm(Tensor x, Tensor w, Tensor w_scale) -> Tensor");
  m.def("half_moe(Tensor x, Tensor weights, Tensor idx, Tensor gate_up, Tensor down) -> Tensor");
  m.def("int8_moe(Tensor x, Tensor weights, Tensor idx, Tensor gate_up, Tensor gate_up_scale, Tensor down, "
        "Tensor down_scale) -> Tensor");
  m.def("half_heads(Tensor x, Tensor w) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("screen_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("screen_candidates(Tensor sums, Tensor stats, Tensor col_scale, Tensor d_norm, Tensor w_norm, "
        "float chain, float c_bound, float c_abs) -> Tensor");
  m.def("half_attend_paged(Tensor q, Tensor cache, Tensor tables, Tensor pos, float scale, int kvr) -> Tensor");
  m.def("half_attend_paged_i8(Tensor q, Tensor latent, Tensor scales, Tensor rope, Tensor tables, Tensor pos, "
        "float scale, int kvr) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_native, CPU, m) {
  m.impl("bf16_mm", &bf16_mm);
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_attend", &bf16_attend);
  m.impl("bf16_attend_paged", &bf16_attend_paged);
  m.impl("bf16_attend_paged_i8", &bf16_attend_paged_i8);
  m.impl("bf16_moe", &bf16_moe);
  m.impl("bf16_heads", &bf16_heads);
  m.impl("bf16_heads_wide", &bf16_heads_wide);
  m.impl("i8_mm", &i8_mm);
  m.impl("i8_rows", &i8_rows);
  m.impl("i8_moe", &i8_moe);
  m.impl("half_mm", &half_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_rows", &int8_rows);
  m.impl("int8_dynamic_mm", &int8_dynamic_mm);
  m.impl("half_moe", &half_moe);
  m.impl("int8_moe", &int8_moe);
  m.impl("half_heads", &half_heads);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("screen_rows", &screen_rows);
  m.impl("screen_candidates", &screen_candidates);
  m.impl("half_attend_paged", &half_attend_paged);
  m.impl("half_attend_paged_i8", &half_attend_paged_i8);
}
