/* Products with 16-bit float weights on CPUs with AVX2 and FMA but no 16-bit float
 * arithmetic: y[M, N] = x[M, K] . w[N, K]^T, x and y float32, w bfloat16 or float16; a
 * window's routed MoE in one call (half_moe_bf16); and the exact integer sums of int8
 * weights with quantized activations (int8_* below).
 *
 * Why (kernels/half_cpu.py): there oneDNN converts the weight to float32 for every row it
 * multiplies, and converting it once for an MKL float32 GEMM writes and reads a float32
 * copy.  Here each vector of the weight is converted in registers once and multiplied
 * into every row of x, so the weight is read from memory once at any row count.
 *
 * Each output element's arithmetic does not depend on M or on the other rows (float16:
 * one chain of 8-lane fused multiply-adds over K; bfloat16: two, split_rows says how),
 * so a window of k+1 rows computes each row exactly as a one-row step does.
 *
 * Built at first use by kernels/native.py (cc -O3 -mavx2 -mfma -mf16c -fopenmp); its
 * OpenMP is the libgomp torch has loaded, so the two share one thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "expert_runs.h"
#include "int8_moe.h"

#define ROWS 4          /* rows of x per block: ROWS x COLS accumulators + COLS weight */
#define COLS 3          /* vectors + one x vector = the 16 ymm registers */

static inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float bf16_value(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline float f16_value(uint16_t h) {
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static void block_f16(const float *x, long ldx, const uint16_t *w, long K, float *y, long ldy,
                      int rows, int cols) {
    __m256 acc[ROWS][COLS];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_setzero_ps();
    long k8 = K & ~7L;
    for (long k = 0; k < k8; k += 8) {
        __m256 wv[COLS];
        for (int j = 0; j < COLS; j++)
            wv[j] = j < cols ? load_f16(w + j * K + k) : _mm256_setzero_ps();
        for (int i = 0; i < ROWS; i++) {
            if (i >= rows) break;
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = hsum(acc[i][j]);
            for (long k = k8; k < K; k++) s += x[i * ldx + k] * f16_value(w[j * K + k]);
            y[i * ldy + j] = s;
        }
}

/* Every ROWS x COLS block of an [M, N] output, the column blocks shared out over the
 * calling function's ``threads``: CALL sees the block's first row m and column n, and
 * its rows and cols. */
#define EACH_BLOCK(M, N, CALL)                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                     \
    for (long b_ = 0; b_ < ((N) + COLS - 1) / COLS; b_++) {                               \
        long n = b_ * COLS;                                                               \
        int cols = (N) - n < COLS ? (int)((N) - n) : COLS;                                \
        for (long m = 0; m < (M); m += ROWS) {                                            \
            int rows = (M) - m < ROWS ? (int)((M) - m) : ROWS;                            \
            CALL;                                                                         \
        }                                                                                 \
    }

/* bfloat16 weights take another arithmetic than the blocks above: a 32-byte load holds 16
 * weights, a pair in each 32-bit lane, and a shift and a mask make float32 of the even and
 * of the odd ones (2 operations for 16 weights, where widening takes 2 for 8).  Every
 * output element is two chains of fused multiply-adds over its 16-weight groups in order,
 * one over the even positions and one over the odd, then hsum(even + odd), then the last
 * K % 16 products one by one: the same at any M and in every function below (half_mm_bf16,
 * the experts), so a window's rows are a lone row's.  x is first split (``split_rows``):
 * each group of 16 values as its 8 even ones, then its 8 odd ones.
 *
 * Why: on a 2-core AMD EPYC (Zen 3, AVX2; a plain read 26-32 GB/s) one row through a
 * [32000, 1536] / [1024, 1536] / [1536, 512] bf16 weight streamed 19-23 GB/s in blocks of
 * 3 weight rows with widening; 24-30 GB/s this way, one weight row at a time per thread
 * (one stream) with its rows fetched 1 KB ahead. */
#define FEW 4           /* rows of x multiplied into a weight row per pass (2 x FEW chains) */
#define AHEAD 512       /* weights fetched ahead of the stream */

/* Room for n floats, 64-byte aligned: split rows K16 floats long then start on cache
 * lines (loads that straddle two lines cost two; aligned, the kernel ran 15-45% faster). */
static float *split_alloc(long n) {
    size_t bytes = ((size_t)(n + 1) * sizeof(float) + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

/* x float32 [M, K] (rows ldx apart) -> xs [M, K16] split as above, K16 = K & ~15. */
static void split_rows(const float *x, long M, long K, long ldx, float *xs) {
    long K16 = K & ~15L;
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K16; k += 16)
            for (int i = 0; i < 8; i++) {
                xs[m * K16 + k + i] = x[m * ldx + k + 2 * i];
                xs[m * K16 + k + 8 + i] = x[m * ldx + k + 2 * i + 1];
            }
}

/* ``rows`` (1..FEW, a constant where inlined) split rows of x through one bf16 weight row:
 * y[i * ldy] for row i.  x itself supplies the tail. */
static inline __attribute__((always_inline)) void pair_rows(
        const float *xs, long K16, const int rows, const float *x, long ldx, const uint16_t *w,
        long K, float *y, long ldy) {
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 ev[FEW], od[FEW];
    for (int i = 0; i < rows; i++) ev[i] = od[i] = _mm256_setzero_ps();
    for (long k = 0; k < K16; k += 16) {
        _mm_prefetch((const char *)(w + k + AHEAD), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
        for (int i = 0; i < rows; i++) {
            ev[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + i * K16 + k), we, ev[i]);
            od[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + i * K16 + k + 8), wo, od[i]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float s = hsum(_mm256_add_ps(ev[i], od[i]));
        for (long k = K16; k < K; k++) s += x[i * ldx + k] * bf16_value(w[k]);
        y[i * ldy] = s;
    }
}

/* Every row of x (split: xs) through one weight row, FEW at a time (the weight row read
 * from memory once, then from L1). */
static void weight_row(const float *xs, long K16, long M, const float *x, long ldx,
                       const uint16_t *w, long K, float *y, long ldy) {
    long m = 0;
    for (; m + FEW <= M; m += FEW)
        pair_rows(xs + m * K16, K16, FEW, x + m * ldx, ldx, w, K, y + m * ldy, ldy);
    switch (M - m) {
    case 1: pair_rows(xs + m * K16, K16, 1, x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    case 2: pair_rows(xs + m * K16, K16, 2, x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    case 3: pair_rows(xs + m * K16, K16, 3, x + m * ldx, ldx, w, K, y + m * ldy, ldy); break;
    default: break;
    }
}

/* Many rows (a prompt's): weight_row's order read every row of x from L2 or beyond for
 * each weight row and ran at 24-34 GMAC/s on 2 Zen 3 cores against MKL's 60 over a
 * converted copy.  Past STREAM_ROWS rows the weight goes in blocks of BLOCK rows and x in
 * tiles of TILE rows, both cut along K in spans of SPAN inputs so that a span of two rows
 * of x and of the block's weight rows stay in L1.  Each output's two chains are kept in
 * ``acc`` between spans and go on from there: pair_rows' multiply-adds in pair_rows' order,
 * so the same numbers as a row through weight_row (at any M: windows and prompts agree). */
#define STREAM_ROWS 16
#define BLOCK 16
#define TILE 64
#define SPAN 512

/* ``rows`` (1..2) rows of x (split, rows K16 apart) through ``cols`` (1..2) weight rows
 * (K apart) over inputs k0 .. k1, each output's chains read from and written back to acc
 * (16 floats an output: row i, weight row j at acc + i * acc_step + j * 16).  Two by two,
 * each vector of x loaded once for both weight rows (the empty asm keeps the compiler from
 * folding a load into every multiply-add): 57-61 GMAC/s on 2 Zen 3 cores at a prompt's
 * rows, 39-44 with pair_rows' FEW rows through one weight row (9 loads to 8). */
static inline __attribute__((always_inline)) void pair_span(
        const float *xs, long K16, const int rows, const uint16_t *w, long K, const int cols,
        long k0, long k1, float *acc, long acc_step) {
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 ev[2][2], od[2][2];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            ev[i][j] = _mm256_loadu_ps(acc + i * acc_step + j * 16);
            od[i][j] = _mm256_loadu_ps(acc + i * acc_step + j * 16 + 8);
        }
    for (long k = k0; k < k1; k += 16) {
        __m256i v[2];
        for (int j = 0; j < cols; j++) v[j] = _mm256_loadu_si256((const __m256i *)(w + j * K + k));
        for (int i = 0; i < rows; i++) {
            __m256 xe = _mm256_loadu_ps(xs + i * K16 + k);
            __asm__("" : "+x"(xe));                         /* one load for both */
            for (int j = 0; j < cols; j++)
                ev[i][j] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(v[j], 16)), ev[i][j]);
        }
        for (int i = 0; i < rows; i++) {
            __m256 xo = _mm256_loadu_ps(xs + i * K16 + k + 8);
            __asm__("" : "+x"(xo));                         /* one load for both */
            for (int j = 0; j < cols; j++)
                od[i][j] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v[j], odd)), od[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            _mm256_storeu_ps(acc + i * acc_step + j * 16, ev[i][j]);
            _mm256_storeu_ps(acc + i * acc_step + j * 16 + 8, od[i][j]);
        }
}

/* Rows 0 .. M of x (split: xs) through the weight rows [rows <= BLOCK, K] of one block;
 * acc: scratch of TILE * BLOCK * 16 floats. */
static void weight_block(const float *xs, long K16, long M, const float *x, long ldx,
                         const uint16_t *w, long rows, long K, float *y, long ldy, float *acc) {
    if (M <= STREAM_ROWS) {
        for (long n = 0; n < rows; n++)
            weight_row(xs, K16, M, x, ldx, w + n * K, K, y + n, ldy);
        return;
    }
    long step = rows * 16;
    for (long t = 0; t < M; t += TILE) {
        long tile = M - t < TILE ? M - t : TILE;
        memset(acc, 0, (size_t)(tile * step) * sizeof(float));
        for (long k0 = 0; k0 < K16; k0 += SPAN) {
            long k1 = K16 - k0 < SPAN ? K16 : k0 + SPAN;
            for (long m = 0; m < tile; m += 2) {
                const float *xm = xs + (t + m) * K16;
                for (long n = 0; n < rows; n += 2) {
                    const uint16_t *wn = w + n * K;
                    float *an = acc + m * step + n * 16;
                    int pair = (tile - m >= 2) * 2 + (rows - n >= 2);
                    switch (pair) {
                    case 3: pair_span(xm, K16, 2, wn, K, 2, k0, k1, an, step); break;
                    case 2: pair_span(xm, K16, 2, wn, K, 1, k0, k1, an, step); break;
                    case 1: pair_span(xm, K16, 1, wn, K, 2, k0, k1, an, step); break;
                    default: pair_span(xm, K16, 1, wn, K, 1, k0, k1, an, step); break;
                    }
                }
            }
        }
        for (long m = 0; m < tile; m++)                     /* pair_rows' ending */
            for (long n = 0; n < rows; n++) {
                const float *a = acc + m * step + n * 16;
                float s = hsum(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)));
                const float *xr = x + (t + m) * ldx;
                for (long k = K16; k < K; k++) s += xr[k] * bf16_value(w[n * K + k]);
                y[(t + m) * ldy + n] = s;
            }
    }
}

/* w: bfloat16 [N, K], rows contiguous; x float32 rows of stride ldx; y float32 of ldy.
 * Each thread one contiguous run of weight rows (of blocks past STREAM_ROWS rows).
 * Returns nonzero without memory for the split rows. */
int half_mm_bf16(const float *x, long M, long K, long ldx, const uint16_t *w, long N,
                 float *y, long ldy, int threads) {
    long K16 = K & ~15L;
    float *xs = split_alloc(M * K16);
    if (!xs) return 1;
    split_rows(x, M, K, ldx, xs);
    if (M <= STREAM_ROWS) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++)
            weight_row(xs, K16, M, x, ldx, w + n * K, K, y + n, ldy);
        free(xs);
        return 0;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *acc = split_alloc(TILE * BLOCK * 16);
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n += BLOCK)
            if (acc) weight_block(xs, K16, M, x, ldx, w + n * K, N - n < BLOCK ? N - n : BLOCK,
                                  K, y + n, ldy, acc);
        free(acc);
    }
    free(xs);
    return failed;
}

void half_mm_f16(const float *x, long M, long K, long ldx, const uint16_t *w, long N,
                 float *y, long ldy, int threads) {
    EACH_BLOCK(M, N, block_f16(x + m * ldx, ldx, w + n * K, K, y + m * ldy + n, ldy, rows, cols))
}

/* A routed MoE's experts over their rows, in one call: xs float32 [A, H] holds each
 * expert's rows in turn (expert e's are rows offsets[e] .. offsets[e + 1]); gate_up
 * [E, 2I, H] (gate rows, then up rows) and down [E, H, I] are 16-bit.  ys[a] =
 * down_e . (silu(gate_e . xs[a]) * (up_e . xs[a])), float32 throughout; gu is scratch of
 * [A, 2I].  One parallel region for every expert: the per-expert calls it replaces cost
 * more in dispatch than in arithmetic at a batch's few rows an expert. */
/* Each expert's rows of x through its weight, w [E, N, K] -> y; the (expert, column
 * block) pairs shared out over the threads of the enclosing parallel region. */
static void each_expert(const float *x, long ldx, const long *offsets, long E,
                        const uint16_t *w, long N, long K, float *y, long ldy) {
    long blocks = (N + COLS - 1) / COLS;
    #pragma omp for schedule(dynamic, 8)
    for (long j = 0; j < E * blocks; j++) {
        long e = j / blocks, n = (j % blocks) * COLS;
        int cols = N - n < COLS ? (int)(N - n) : COLS;
        for (long m = offsets[e]; m < offsets[e + 1]; m += ROWS) {
            int rows = offsets[e + 1] - m < ROWS ? (int)(offsets[e + 1] - m) : ROWS;
            block_f16(x + m * ldx, ldx, w + (e * N + n) * K, K, y + m * ldy + n, ldy, rows, cols);
        }
    }
}

static void experts_f16(const float *xs, long H, long I, const long *offsets,
                    long E, const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                    int threads) {
    long A = offsets[E], I2 = 2 * I;
    #pragma omp parallel num_threads(threads)
    {
        each_expert(xs, H, offsets, E, gate_up, I2, H, gu, I2);
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++)
            for (long i = 0; i < I; i++) {
                float g = gu[a * I2 + i];
                gu[a * I2 + i] = g / (1.0f + expf(-g)) * gu[a * I2 + I + i];
            }
        each_expert(gu, I2, offsets, E, down, H, I, ys, H);
    }
}

/* Each chosen expert's rows of x (split: xs) through its bf16 weight [N, K] -> y: the
 * (chosen expert, block of weight rows) pairs shared out over the threads of the
 * enclosing parallel region, each thread one contiguous run of them (one stream), as
 * half_mm_bf16. */
static void each_expert_bf16(const float *xs, long K16, const float *x, long ldx,
                             const long *offsets, const long *chosen, long used,
                             const uint16_t *w, long N, long K, float *y, long ldy, float *acc) {
    long blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp for schedule(static)
    for (long j = 0; j < used * blocks; j++) {
        long e = chosen[j / blocks], n = j % blocks * BLOCK, first = offsets[e];
        weight_block(xs + first * K16, K16, offsets[e + 1] - first, x + first * ldx, ldx,
                     w + (e * N + n) * K, N - n < BLOCK ? N - n : BLOCK, K, y + first * ldy + n,
                     ldy, acc);
    }
}

/* ``experts`` for bf16 weights in half_mm_bf16's arithmetic (an expert's row alone gives
 * what it gives among others, and what half_mm_bf16 gives through the same weight); an
 * expert without rows is not read.  Returns nonzero without memory for the split rows. */
int half_experts_bf16(const float *xs, long H, long I, const long *offsets, long E,
                      const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                      int threads) {
    long A = offsets[E], I2 = 2 * I, H16 = H & ~15L, I16 = I & ~15L, used = 0;
    float *sx = split_alloc(A * H16 + A * I16);
    long *chosen = malloc((size_t)(E + 1) * sizeof(long));
    int failed = 0;
    if (!sx || !chosen) {
        free(sx);
        free(chosen);
        return 1;
    }
    float *sa = sx + A * H16;
    for (long e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) chosen[used++] = e;
    split_rows(xs, A, H, H, sx);
    #pragma omp parallel num_threads(threads)
    {
        float *acc = split_alloc(TILE * BLOCK * 16);
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (failed) {
            free(acc);
            acc = NULL;
        }
        if (acc) each_expert_bf16(sx, H16, xs, H, offsets, chosen, used, gate_up, I2, H, gu, I2, acc);
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++) {
            for (long i = 0; i < I; i++) {
                float g = gu[a * I2 + i];
                gu[a * I2 + i] = g / (1.0f + expf(-g)) * gu[a * I2 + I + i];
            }
            split_rows(gu + a * I2, 1, I, I2, sa + a * I16);
        }
        if (acc) each_expert_bf16(sa, I16, gu, I2, offsets, chosen, used, down, H, I, ys, H, acc);
        free(acc);
    }
    free(sx);
    free(chosen);
    return failed;
}

void half_experts_f16(const float *xs, long H, long I, const long *offsets, long E,
                      const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                      int threads) {
    experts_f16(xs, H, I, offsets, E, gate_up, down, gu, ys, threads);
}

/* Int8 weights (server/model/quant.py, backend "avx2"): x holds the quantized activations
 * as int16, w int8 [N, K]; y int32 [M, N] the exact sums, as torch._int_mm gives them.
 * Sixteen weights at a time are widened to int16 in registers and multiplied and added in
 * pairs into int32 lanes (vpmaddwd: a product is at most 128 * 128, so nothing saturates or
 * overflows below 131072 inputs).  The weight is read as int8, a byte a value. */
static inline __m256i load_i8(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    return _mm_cvtsi128_si32(s);
}

static void block_i8(const int16_t *x, long ldx, const int8_t *w, long K, int32_t *y, long ldy,
                     int rows, int cols) {
    __m256i acc[ROWS][COLS];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_setzero_si256();
    long k16 = K & ~15L;
    for (long k = 0; k < k16; k += 16) {
        __m256i wv[COLS];
        for (int j = 0; j < COLS; j++)
            wv[j] = j < cols ? load_i8(w + j * K + k) : _mm256_setzero_si256();
        for (int i = 0; i < ROWS; i++) {
            if (i >= rows) break;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i * ldx + k));
            for (int j = 0; j < COLS; j++)
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            int32_t t = hsum_i32(acc[i][j]);
            for (long k = k16; k < K; k++) t += (int32_t)x[i * ldx + k] * w[j * K + k];
            y[i * ldy + j] = t;
        }
}

/* Up to FEW rows of x (packed to int8, rows[i]) through one int8 weight row: the exact sums.  Each
 * 32 weights: |w| as unsigned bytes times x with w's sign (vpmaddubsw; a pair of products
 * is at most 2 x 128 x 127 = 32512, so the 16-bit sums never saturate; x is within +-127,
 * so its sign flip never overflows), then pairs of those into int32 lanes (vpmaddwd by 1):
 * 32 products in 4 operations a row, where widening to int16 took 6 for 32.  Why: on a
 * 2-core AMD EPYC (Zen 3, AVX2) the W8A8 model's batch-1 step read its int8 weights at
 * 16-20 GB/s through the widening blocks, llama.cpp's q8_0 (this same trick) at 20. */
static inline __attribute__((always_inline)) void i8_dot_rows(int8_t *const *rows, const int m,
                                                               const int8_t *w, long K, int32_t *y,
                                                               long ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[FEW];
    for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_si256();
    long k32 = K & ~31L;
    for (long k = 0; k < k32; k += 32) {
        _mm_prefetch((const char *)(w + k + 2 * AHEAD), _MM_HINT_T0);
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256i aw = _mm256_abs_epi8(wv);
        for (int i = 0; i < m; i++) {
            __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(rows[i] + k)), wv);
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
    }
    for (int i = 0; i < m; i++) {
        int32_t t = hsum_i32(acc[i]);
        for (long k = k32; k < K; k++) t += (int32_t)rows[i][k] * w[k];
        y[i * ldy] = t;
    }
}

/* ``i8_dot_rows`` for m (1..FEW) rows, each count its own unrolled copy. */
static void i8_rows_n(int8_t *const *rows, long m, const int8_t *w, long K, int32_t *y, long ldy) {
    switch (m) {
    case 1: i8_dot_rows(rows, 1, w, K, y, ldy); break;
    case 2: i8_dot_rows(rows, 2, w, K, y, ldy); break;
    case 3: i8_dot_rows(rows, 3, w, K, y, ldy); break;
    default: i8_dot_rows(rows, FEW, w, K, y, ldy); break;
    }
}

/* x int16 [M, K] (rows ldx apart) -> int8 [M, K]; NULL where a value is outside +-127 (a
 * static scheme's activations with a zero point reach -128 and past it) or without memory:
 * the callers then take the widening blocks, the same exact sums. */
static int8_t *packed_rows(const int16_t *x, long M, long K, long ldx) {
    int8_t *xq = malloc((size_t)(M * K + 1));
    if (!xq) return NULL;
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) {
            int16_t v = x[m * ldx + k];
            if (v < -127 || v > 127) {
                free(xq);
                return NULL;
            }
            xq[m * K + k] = (int8_t)v;
        }
    return xq;
}

/* Packed int8 rows xq [M, K] through w int8 [N, K] -> y int32 [M, N] (rows ldy apart), the
 * exact sums. */
static void int8_product(const int8_t *xq, long M, long K, const int8_t *w, long N, int32_t *y,
                         long ldy, int threads) {
    if (M <= STREAM_ROWS) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++)
            for (long m = 0; m < M; m += FEW) {             /* the weight row from L1 after */
                int8_t *rows[FEW];
                long count = M - m < FEW ? M - m : FEW;
                for (long i = 0; i < count; i++) rows[i] = (int8_t *)xq + (m + i) * K;
                i8_rows_n(rows, count, w + n * K, K, y + m * ldy + n, ldy);
            }
    } else {
        /* A prompt's rows: FEW rows of x stay in L1 while a block of BLOCK weight rows (in
         * L2) goes through them; each weight row through every row of x read those from L2
         * or beyond ([1536, 1536] at 256 rows: 46 -> 74 GMAC/s on 2 Zen 3 cores).  The sums
         * are exact, so any order gives them. */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long n0 = 0; n0 < N; n0 += BLOCK)
            for (long m = 0; m < M; m += FEW) {
                int8_t *rows[FEW];
                long count = M - m < FEW ? M - m : FEW;
                for (long i = 0; i < count; i++) rows[i] = (int8_t *)xq + (m + i) * K;
                for (long n = n0; n < n0 + BLOCK && n < N; n++)
                    i8_rows_n(rows, count, w + n * K, K, y + m * ldy + n, ldy);
            }
    }
}

void int8_mm(const int16_t *x, long M, long K, long ldx, const int8_t *w, long N, int32_t *y,
             long ldy, int threads) {
    int8_t *xq = packed_rows(x, M, K, ldx);
    if (!xq) {
        EACH_BLOCK(M, N,
                   block_i8(x + m * ldx, ldx, w + n * K, K, y + m * ldy + n, ldy, rows, cols))
        return;
    }
    int8_product(xq, M, K, w, N, y, ldy, threads);
    free(xq);
}

/* The dynamic scheme's whole product in one call (eager: a prompt's layers): x float32
 * [M, K] quantized row by row (quantize_row), the exact sums through w int8 [N, K], then
 * y float32 [M, N] = float(sum) x (s_m x ws[n]) -- QuantLinear's operations in its order,
 * so the same numbers.  Why: eager, those took ~10 torch operations a product, ~14% of the
 * W8A8 0.5b model's 256-token prompt on 2 Zen 3 cores.  Returns 1 without memory. */
int int8_dynamic_mm(const float *x, long M, long K, const int8_t *w, long N, const float *ws, float *y,
                    int threads) {
    int8_t *xq = malloc((size_t)(M * K) + 1);
    float *s = malloc((size_t)M * sizeof(float) + 1);
    int32_t *acc = malloc((size_t)(M * N) * sizeof(int32_t) + 1);
    if (!xq || !s || !acc) {
        free(xq);
        free(s);
        free(acc);
        return 1;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) s[m] = quantize_row(x + m * K, K, xq + m * K);
    int8_product(xq, M, K, w, N, acc, N, threads);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float f = s[m] * ws[n];
            y[m * N + n] = (float)acc[m * N + n] * f;
        }
    free(xq);
    free(s);
    free(acc);
    return 0;
}

/* Row a of x through expert expert[a] of w int8 [E, N, K] -> y int32 [A, N]: the gathered
 * experts of a window (quant.gathered_int8_experts), the rows grouped by expert (a stable
 * sort), so each chosen expert is read once for all its rows, each thread one contiguous
 * run of (expert, weight row) pairs.  Why: read once a row, a batch-8 window of the W8A8
 * 0.5b model read its experts about twice; grouped, the gathered MoE serves windows of up
 * to 64 tokens (static_decode.GROUPED_GATHER_MAX_TOKENS) instead of 4. */
void int8_rows(const int16_t *x, long A, long K, const long *expert, const int8_t *w, long N,
               int32_t *y, int threads) {
    long *order = malloc((size_t)(2 * A + 2) * sizeof(long));
    int32_t *ys = malloc((size_t)(A * N + 1) * sizeof(int32_t));
    int8_t *xq = packed_rows(x, A, K, K);
    if (!order || !ys || !xq) {                    /* row by row, the widening blocks */
        free(order); free(ys); free(xq);
        long blocks = (N + COLS - 1) / COLS;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long j = 0; j < A * blocks; j++) {
            long a = j / blocks, n = (j % blocks) * COLS;
            int cols = N - n < COLS ? (int)(N - n) : COLS;
            block_i8(x + a * K, K, w + (expert[a] * N + n) * K, K, y + a * N + n, N, 1, cols);
        }
        return;
    }
    long *starts = order + A, runs = expert_runs(expert, A, order, starts);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long j = 0; j < runs * N; j++) {
            long r = j / N, n = j % N, first = starts[r];
            /* the run's rows, in sorted order: xq row order[i] for i in the run */
            int8_t *rows[FEW];
            long count = starts[r + 1] - first;
            const int8_t *we = w + (expert[order[first]] * N + n) * K;
            for (long i0 = 0; i0 < count; i0 += FEW) {
                long m = count - i0 < FEW ? count - i0 : FEW;
                for (long i = 0; i < m; i++) rows[i] = xq + order[first + i0 + i] * K;
                i8_rows_n(rows, m, we, K, ys + (first + i0) * N + n, N);
            }
        }
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++) memcpy(y + order[a] * N, ys + a * N, (size_t)N * sizeof(int32_t));
    }
    free(order); free(ys); free(xq);
}

/* A routed MoE of a decode window in one call, from the router's choice to the weighted
 * sum: x float32 [T, H]; token t's k experts idx[t * k ..] (int64) of weights wt[t * k ..]
 * (float32); gate_up [E, 2I, H], down [E, H, I] bf16 -> out float32 [T, H].  The (token,
 * expert) pairs sorted by expert (stable, as the eager MoE's argsort) run through
 * ``half_experts_bf16``'s body; out[t] = the token's outputs times their weights (each
 * product rounded, then added: no fused multiply-add), added from +0 in the order of their
 * experts: the eager MoE's float32 ``index_add_`` (layers/moe.py), value for value.
 * Why: the same in torch operators around the experts' call cost 0.2-0.27 ms a layer on
 * the 0.5b model (a sort, a count read on the host, gathers, a scatter), ~9% of a batch-1
 * step.  Returns 1 without memory for its scratch, 2 for an expert id outside [0, E) or
 * k > 64. */
int half_moe_bf16(const float *x, long T, long H, long I, long k, const long *idx, const float *wt,
                  long E, const uint16_t *gate_up, const uint16_t *down, float *out, int threads) {
    long A = T * k, I2 = 2 * I;
    if (k > 64) return 2;                                      /* the combine's bound */
    long *offsets = calloc((size_t)(E + 1), sizeof(long));
    long *at = malloc((size_t)(A + 1) * sizeof(long));         /* sorted row of each pair */
    long *src = malloc((size_t)(A + 1) * sizeof(long));        /* pair of each sorted row */
    float *xs = malloc((size_t)(A * H + A * I2 + A * H + 1) * sizeof(float));
    if (!offsets || !at || !src || !xs) {
        free(offsets); free(at); free(src); free(xs);
        return 1;
    }
    for (long a = 0; a < A; a++) {
        if (idx[a] < 0 || idx[a] >= E) {                       /* no such expert */
            free(offsets); free(at); free(src); free(xs);
            return 2;
        }
        offsets[idx[a] + 1]++;
    }
    for (long e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    {
        long *next = malloc((size_t)(E + 1) * sizeof(long));
        if (!next) {
            free(offsets); free(at); free(src); free(xs);
            return 1;
        }
        memcpy(next, offsets, (size_t)E * sizeof(long));
        for (long a = 0; a < A; a++) {                         /* stable: pairs in order */
            long r = next[idx[a]]++;
            at[a] = r;
            src[r] = a;
        }
        free(next);
    }
    float *gu = xs + A * H, *ys = gu + A * I2;
    for (long r = 0; r < A; r++) memcpy(xs + r * H, x + src[r] / k * H, (size_t)H * sizeof(float));
    int status = half_experts_bf16(xs, H, I, offsets, E, gate_up, down, gu, ys, threads);
    if (status == 0) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long t = 0; t < T; t++) {
            long order[64];                                    /* the token's pairs by expert */
            long n = k < 64 ? k : 64;
            for (long j = 0; j < n; j++) order[j] = t * k + j;
            for (long j = 1; j < n; j++)                       /* insertion sort: stable */
                for (long i = j; i > 0 && idx[order[i - 1]] > idx[order[i]]; i--) {
                    long s = order[i]; order[i] = order[i - 1]; order[i - 1] = s;
                }
            for (long c = 0; c < H; c += 8) {
                long left = H - c;
                __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                __m256 acc = _mm256_setzero_ps();
                for (long j = 0; j < n; j++) {
                    __m256 p = _mm256_mul_ps(_mm256_maskload_ps(ys + at[order[j]] * H + c, m),
                                             _mm256_set1_ps(wt[order[j]]));
                    __asm__("" : "+x"(p));                     /* rounded product, then the add */
                    acc = _mm256_add_ps(acc, p);
                }
                _mm256_maskstore_ps(out + t * H + c, m, acc);
            }
        }
    }
    free(offsets); free(at); free(src); free(xs);
    return status;
}

/* Rows [0, m) of int8 activations (stride ldx) through one weight row: int8_moe's part
 * (int8_moe.h), FEW rows a pass. */
static void i8_moe_rows(const int8_t *rows, long m, long ldx, const int8_t *w, long K, int32_t *y,
                        long ldy) {
    for (long i0 = 0; i0 < m; i0 += FEW) {
        long c = m - i0 < FEW ? m - i0 : FEW;
        int8_t *p[FEW];
        for (long i = 0; i < c; i++) p[i] = (int8_t *)rows + (i0 + i) * ldx;
        i8_rows_n(p, c, w, K, y + i0 * ldy, ldy);
    }
}

/* A decode window's routed MoE of int8 experts in one call (int8_moe.h moe_int8 says
 * what and why), the products by i8_rows_n. */
int int8_moe(const float *x, long T, long H, long I, long k, const long *idx, const float *wt,
             long E, const int8_t *gate_up, const float *gus, const int8_t *down, const float *ds,
             float *out, int threads) {
    return moe_int8(x, T, H, I, k, idx, wt, E, gate_up, gus, down, ds, out, threads, 0, i8_moe_rows);
}
