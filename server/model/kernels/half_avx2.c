/* Products with 16-bit float weights on CPUs with AVX2 and FMA but no 16-bit float
 * arithmetic: y[M, N] = x[M, K] . w[N, K]^T, x and y float32, w bfloat16 or float16; and
 * the exact integer sums of int8 weights with quantized activations (int8_* below).
 *
 * Why (server/model/bf16_cpu.py): there oneDNN converts the weight to float32 for every
 * row it multiplies, and converting it once for an MKL float32 GEMM writes and reads a
 * float32 copy.  Here each 8-wide vector of the weight is converted in registers once and
 * multiplied into up to ROWS rows of x, so the weight is read from memory once at any
 * row count.
 *
 * Every output element is one chain of 8-lane fused multiply-adds over K in order, then
 * the same horizontal sum: its value does not depend on M or on the other rows, so a
 * window of k+1 rows computes each row exactly as a one-row step does.
 *
 * Built at first use by server/model/bf16_cpu.py (cc -O3 -mavx2 -mfma -mf16c -fopenmp);
 * its OpenMP is the libgomp torch has loaded, so the two share one thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define ROWS 4          /* rows of x per block: ROWS x COLS accumulators + COLS weight */
#define COLS 3          /* vectors + one x vector = the 16 ymm registers */

static inline __m256 load_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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

#define BLOCK(NAME, LOAD, VALUE)                                                          \
static void NAME(const float *x, long ldx, const uint16_t *w, long K, float *y, long ldy,  \
                 int rows, int cols) {                                                     \
    __m256 acc[ROWS][COLS];                                                                \
    for (int i = 0; i < ROWS; i++)                                                         \
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_setzero_ps();                    \
    long k8 = K & ~7L;                                                                     \
    for (long k = 0; k < k8; k += 8) {                                                     \
        __m256 wv[COLS];                                                                   \
        for (int j = 0; j < COLS; j++)                                                     \
            wv[j] = j < cols ? LOAD(w + j * K + k) : _mm256_setzero_ps();                  \
        for (int i = 0; i < ROWS; i++) {                                                   \
            if (i >= rows) break;                                                          \
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                  \
            for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                  \
    }                                                                                      \
    for (int i = 0; i < rows; i++)                                                         \
        for (int j = 0; j < cols; j++) {                                                   \
            float s = hsum(acc[i][j]);                                                     \
            for (long k = k8; k < K; k++) s += x[i * ldx + k] * VALUE(w[j * K + k]);       \
            y[i * ldy + j] = s;                                                            \
        }                                                                                  \
}

BLOCK(block_bf16, load_bf16, bf16_value)
BLOCK(block_f16, load_f16, f16_value)

typedef void (*block_fn)(const float *, long, const uint16_t *, long, float *, long, int, int);

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

static void product(block_fn block, const float *x, long M, long K, long ldx,
                    const uint16_t *w, long N, float *y, long ldy, int threads) {
    EACH_BLOCK(M, N,
               block(x + m * ldx, ldx, w + n * K, K, y + m * ldy + n, ldy, rows, cols))
}

/* w: bfloat16 [N, K], rows contiguous; x float32 rows of stride ldx; y float32 of ldy. */
void half_mm_bf16(const float *x, long M, long K, long ldx, const uint16_t *w, long N,
                  float *y, long ldy, int threads) {
    product(block_bf16, x, M, K, ldx, w, N, y, ldy, threads);
}

void half_mm_f16(const float *x, long M, long K, long ldx, const uint16_t *w, long N,
                 float *y, long ldy, int threads) {
    product(block_f16, x, M, K, ldx, w, N, y, ldy, threads);
}

/* A routed MoE's experts over their rows, in one call: xs float32 [A, H] holds each
 * expert's rows in turn (expert e's are rows offsets[e] .. offsets[e + 1]); gate_up
 * [E, 2I, H] (gate rows, then up rows) and down [E, H, I] are 16-bit.  ys[a] =
 * down_e . (silu(gate_e . xs[a]) * (up_e . xs[a])), float32 throughout; gu is scratch of
 * [A, 2I].  One parallel region for every expert: the per-expert calls it replaces cost
 * more in dispatch than in arithmetic at a batch's few rows an expert. */
/* Each expert's rows of x through its weight, w [E, N, K] -> y; the (expert, column
 * block) pairs shared out over the threads of the enclosing parallel region. */
static void each_expert(block_fn block, const float *x, long ldx, const long *offsets, long E,
                        const uint16_t *w, long N, long K, float *y, long ldy) {
    long blocks = (N + COLS - 1) / COLS;
    #pragma omp for schedule(dynamic, 8)
    for (long j = 0; j < E * blocks; j++) {
        long e = j / blocks, n = (j % blocks) * COLS;
        int cols = N - n < COLS ? (int)(N - n) : COLS;
        for (long m = offsets[e]; m < offsets[e + 1]; m += ROWS) {
            int rows = offsets[e + 1] - m < ROWS ? (int)(offsets[e + 1] - m) : ROWS;
            block(x + m * ldx, ldx, w + (e * N + n) * K, K, y + m * ldy + n, ldy, rows, cols);
        }
    }
}

static void experts(block_fn block, const float *xs, long H, long I, const long *offsets,
                    long E, const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                    int threads) {
    long A = offsets[E], I2 = 2 * I;
    #pragma omp parallel num_threads(threads)
    {
        each_expert(block, xs, H, offsets, E, gate_up, I2, H, gu, I2);
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++)
            for (long i = 0; i < I; i++) {
                float g = gu[a * I2 + i];
                gu[a * I2 + i] = g / (1.0f + expf(-g)) * gu[a * I2 + I + i];
            }
        each_expert(block, gu, I2, offsets, E, down, H, I, ys, H);
    }
}

void half_experts_bf16(const float *xs, long H, long I, const long *offsets, long E,
                       const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                       int threads) {
    experts(block_bf16, xs, H, I, offsets, E, gate_up, down, gu, ys, threads);
}

void half_experts_f16(const float *xs, long H, long I, const long *offsets, long E,
                      const uint16_t *gate_up, const uint16_t *down, float *gu, float *ys,
                      int threads) {
    experts(block_f16, xs, H, I, offsets, E, gate_up, down, gu, ys, threads);
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

void int8_mm(const int16_t *x, long M, long K, long ldx, const int8_t *w, long N, int32_t *y,
             long ldy, int threads) {
    EACH_BLOCK(M, N,
               block_i8(x + m * ldx, ldx, w + n * K, K, y + m * ldy + n, ldy, rows, cols))
}

/* Row a of x through expert expert[a] of w int8 [E, N, K] -> y int32 [A, N]: the gathered
 * experts of a window (quant.gathered_int8_experts), each chosen expert's rows read in
 * place. */
void int8_rows(const int16_t *x, long A, long K, const long *expert, const int8_t *w, long N,
               int32_t *y, int threads) {
    long blocks = (N + COLS - 1) / COLS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < A * blocks; j++) {
        long a = j / blocks, n = (j % blocks) * COLS;
        int cols = N - n < COLS ? (int)(N - n) : COLS;
        block_i8(x + a * K, K, w + (expert[a] * N + n) * K, K, y + a * N + n, N, 1, cols);
    }
}
