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
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

using mm_fn = void (*)(const void*, long, long, long, const void*, long, void*, long, int);
using mm_status_fn = int (*)(const void*, long, long, long, const void*, long, void*, long, int);
using rows_fn = void (*)(const void*, long, long, const void*, const void*, long, void*, int);
using rows_status_fn = int (*)(const void*, long, long, const void*, const void*, long, void*, int);
using attend_fn = void (*)(const void*, long, long, long, const void*, long, const void*, float, long,
                           void*, void*, int);

struct Kernels {
  mm_fn bf16_mm = nullptr;           // avx512_bf16.c
  rows_fn bf16_rows = nullptr;
  attend_fn bf16_attend = nullptr;
  mm_status_fn i8_mm = nullptr;      // avx512_vnni.c
  rows_status_fn i8_rows = nullptr;
  mm_fn half_mm_bf16 = nullptr;      // half_avx2.c
  mm_fn half_mm_f16 = nullptr;
  mm_fn int8_mm = nullptr;
  rows_fn int8_rows = nullptr;
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
  bool f16 = w.scalar_type() == at::kHalf;
  return product(x, w, at::kFloat, f16 ? at::kHalf : at::kBFloat16, at::kFloat,
                 f16 ? kernels.half_mm_f16 : kernels.half_mm_bf16, "half_mm");
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w) {       // x int16 (half_avx2.c)
  return product(x, w, at::kShort, at::kChar, at::kInt, kernels.int8_mm, "int8_mm");
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

}  // namespace

extern "C" int mtp_set_kernel(const char* name, void* fn) {
  struct { const char* name; void** slot; } slots[] = {
      {"bf16_mm", reinterpret_cast<void**>(&kernels.bf16_mm)},
      {"bf16_rows", reinterpret_cast<void**>(&kernels.bf16_rows)},
      {"bf16_attend", reinterpret_cast<void**>(&kernels.bf16_attend)},
      {"i8_mm", reinterpret_cast<void**>(&kernels.i8_mm)},
      {"i8_rows", reinterpret_cast<void**>(&kernels.i8_rows)},
      {"half_mm_bf16", reinterpret_cast<void**>(&kernels.half_mm_bf16)},
      {"half_mm_f16", reinterpret_cast<void**>(&kernels.half_mm_f16)},
      {"int8_mm", reinterpret_cast<void**>(&kernels.int8_mm)},
      {"int8_rows", reinterpret_cast<void**>(&kernels.int8_rows)},
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
  m.def("i8_mm(Tensor x, Tensor w) -> Tensor");
  m.def("i8_rows(Tensor x, Tensor expert, Tensor w) -> Tensor");
  m.def("half_mm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_rows(Tensor x, Tensor expert, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_native, CPU, m) {
  m.impl("bf16_mm", &bf16_mm);
  m.impl("bf16_rows", &bf16_rows);
  m.impl("bf16_attend", &bf16_attend);
  m.impl("i8_mm", &i8_mm);
  m.impl("i8_rows", &i8_rows);
  m.impl("half_mm", &half_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_rows", &int8_rows);
}
