/* A decode window's routed MoE of int8 experts (the dynamic scheme) in one call, for
 * bfloat16 activations: quant.experts.gathered_int8_experts, operation for operation.
 * Included by the int8 kernels (half_avx2.c int8_moe, avx512_vnni.c i8_moe), each with its
 * own product of a few quantized rows through one weight row; everything else -- the
 * quantization, the grouping by expert, the scaling and roundings, the activation, the
 * weighted sum -- is this one code, so the two ISAs give the same numbers (their sums are
 * exact integers).  Needs AVX2 (quantize_row); kernels/native.py hashes this header into
 * each kernel's build tag. */
#ifndef MTP_INT8_MOE_H
#define MTP_INT8_MOE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "expert_runs.h"

/* float -> the nearest bfloat16 (ties to even), as a float: torch's rounding of a float32
 * result to bfloat16 (NaN stays NaN). */
static inline float bf16_round(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x007FFFFFu)) return f;
    v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u;
    return v.f;
}

/* The dynamic scheme's activation quantization of one row (quant/int8.py row_scales and
 * quantize_rows, operation for operation): s = max(max|x|, 1e-10) / 127, q = round(x / s)
 * to nearest even, clamped to +-127. */
static float quantize_row(const float *x, long K, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float amax = 0.0f;
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    for (; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    float s = (amax > 1e-10f ? amax : 1e-10f) / 127.0f;
    const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(i16, i16));
    }
    for (; k < K; k++) {
        float v = nearbyintf(x[k] / s);
        q[k] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    return s;
}

/* The ISA's part: rows [0, m) of quantized activations (row i at rows + i * ldx, K bytes;
 * sign bits flipped where the window was made with ``flip``) through one weight row w
 * [K] -> the exact sums y[i * ldy]. */
typedef void (*moe_rows_fn)(const int8_t *rows, long m, long ldx, const int8_t *w, long K,
                            int32_t *y, long ldy);

/* Each run of one expert's pairs (their quantized rows side by side at x + first * K)
 * through every row of that expert's weight in w [E, N, K] -> the exact sums y[first * N +
 * n]; the (run, weight row) pairs shared out as one contiguous stretch a thread.  A
 * worksharing loop of moe_int8's parallel region (its gate/up and its down products). */
static void expert_sums(const int8_t *x, long K, const int8_t *w, long N, int32_t *y, long runs,
                        const long *starts, const long *order, const long *idx, moe_rows_fn rows) {
    #pragma omp for schedule(static)
    for (long j = 0; j < runs * N; j++) {
        long r = j / N, n = j % N, first = starts[r];
        rows(x + first * K, starts[r + 1] - first, K, w + (idx[order[first]] * N + n) * K, K,
             y + first * N + n, N);
    }
}

/* x float32 [T, H] (bfloat16 values); token t's k experts idx[t * k ..] of weights
 * wt[t * k ..]; gate_up int8 [E, 2I, H] with scales gus [E, 2I]; down int8 [E, H, I] with
 * ds [E, H] -> out float32 [T, H].  Each token's row quantized by its own scale (s = max(
 * max|x|, 1e-10) / 127, round to nearest even, clamped to +-127); each (token, expert)
 * pair's exact sums through the expert's gate and up rows, times (s x scale), rounded to
 * bfloat16; act = bf16(bf16(g / (1 + exp(-g))) x u), quantized by its own scale; the exact
 * sums through the expert's down rows, times (s2 x scale), rounded to bfloat16; out[t] =
 * the token's k outputs times their weights (each product rounded, then added from +0, in
 * the token's order).  The pairs run grouped by expert, their rows side by side (each
 * chosen expert's rows read once for all its pairs; each thread one contiguous run of
 * (expert, weight row) pairs), all in one parallel region.  ``flip``: the quantized rows
 * are handed to ``rows`` as x + 128 (unsigned bytes, VPDPBUSD's side).  Why one call: two
 * rows-kernel calls and torch's scaling, activation and requantizing between them took ~0.5
 * ms of a ~0.95 ms W8A8 0.5b MoE layer on 2 Zen 3 cores (profiled), whose experts' int8
 * bytes take ~0.3 ms to read.  Returns 1 without memory, 2 for k past 64 or an expert id
 * outside [0, E). */
static int moe_int8(const float *x, long T, long H, long I, long k, const long *idx, const float *wt,
                    long E, const int8_t *gate_up, const float *gus, const int8_t *down,
                    const float *ds, float *out, int threads, int flip, moe_rows_fn rows) {
    long A = T * k, I2 = 2 * I;
    if (k > 64) return 2;
    for (long a = 0; a < A; a++)
        if (idx[a] < 0 || idx[a] >= E) return 2;
    long *order = malloc((size_t)(2 * A + 2) * sizeof(long));
    long *at = malloc((size_t)(A + 1) * sizeof(long));          /* sorted place of each pair */
    int8_t *xq = malloc((size_t)(T * H + A * H + A * I) + 1);
    float *s = malloc((size_t)(T + A + 1) * sizeof(float));
    int32_t *acc = malloc((size_t)(A * I2 + A * H + 1) * sizeof(int32_t));
    if (!order || !at || !xq || !s || !acc) {
        free(order); free(at); free(xq); free(s); free(acc);
        return 1;
    }
    long *starts = order + A, runs = expert_runs(idx, A, order, starts);
    for (long r = 0; r < A; r++) at[order[r]] = r;
    int8_t *xs = xq + T * H;                                    /* x, quantized, sorted */
    int8_t *aq = xs + A * H;                                    /* act, quantized, sorted */
    const uint8_t mask = flip ? 0x80u : 0u;
    float *s2 = s + T;
    int32_t *gu = acc, *dn = acc + A * I2;                      /* sums, in sorted order */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) s[t] = quantize_row(x + t * H, H, xq + t * H);
        #pragma omp for schedule(static)
        for (long r = 0; r < A; r++) {
            const int8_t *src = xq + order[r] / k * H;
            for (long h = 0; h < H; h++) xs[r * H + h] = (int8_t)((uint8_t)src[h] ^ mask);
        }
        expert_sums(xs, H, gate_up, I2, gu, runs, starts, order, idx, rows);
        #pragma omp for schedule(static)
        for (long r = 0; r < A; r++) {
            long pair = order[r], t = pair / k, e = idx[pair];
            float act[I];
            for (long i = 0; i < I; i++) {
                float g = bf16_round((float)gu[r * I2 + i] * (s[t] * gus[e * I2 + i]));
                float u = bf16_round((float)gu[r * I2 + I + i] * (s[t] * gus[e * I2 + I + i]));
                act[i] = bf16_round(bf16_round(g / (1.0f + expf(-g))) * u);
            }
            s2[r] = quantize_row(act, I, aq + r * I);
            if (flip)
                for (long i = 0; i < I; i++) aq[r * I + i] = (int8_t)((uint8_t)aq[r * I + i] ^ mask);
        }
        expert_sums(aq, I, down, H, dn, runs, starts, order, idx, rows);
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++)
            for (long h = 0; h < H; h++) {
                float sum = 0.0f;
                for (long j = 0; j < k; j++) {
                    long pair = t * k + j, r = at[pair], e = idx[pair];
                    float y = bf16_round((float)dn[r * H + h] * (s2[r] * ds[e * H + h]));
                    float p = y * wt[pair];
                    __asm__("" : "+x"(p));                         /* rounded product, then the add */
                    sum += p;
                }
                out[t * H + h] = sum;
            }
    }
    free(order); free(at); free(xq); free(s); free(acc);
    return 0;
}

#endif
