/* Exact int8 products on CPUs with AVX-512 VNNI (Cascade Lake and later, Zen 4): y[M, N] =
 * x[M, K] . w[N, K]^T with x and w int8 and y int32, the sums torch._int_mm gives
 * (quant/int8.py, backend "vnni"), and a window's gathered experts.
 *
 * Why: torch._int_mm streamed 3-5 GB/s on a 2-core Zen 4 for a decode step's few rows, and
 * our AVX2 kernel widens every weight byte to int16 first.  VPDPBUSD multiplies 64 bytes
 * and adds them in fours into 16 int32 lanes in one instruction.  It takes unsigned
 * bytes on one side: x + 128 (the byte with its sign bit flipped) is unsigned, and
 * x . w = (x + 128) . w - 128 * sum(w), where sum(w) comes from the same instruction over
 * a vector of ones as the weight streams by, once for all rows.  Products are at most
 * 255 * 128 and K below 2**16 keeps every sum inside int32: exact.
 *
 * Built at first use (server/model/kernels/native.py) with -mavx512f -mavx512bw
 * -mavx512vnni -fopenmp.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "expert_runs.h"
#include "int8_moe.h"

#define COLS 4
#define MAXR 4

static inline __m512i load_tail(const void *p, long n) {            /* n < 64 bytes */
    __mmask64 m = n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
    return _mm512_maskz_loadu_epi8(m, p);
}

/* Where row j of a block will be read PREFETCH bytes on: past the row's end, the same row
 * of the next block (the next COLS rows): a block's rows are short streams (1.5 KB at
 * K = 1536) that the hardware prefetcher alone follows late. */
#define PREFETCH 512
static inline const int8_t *ahead(const int8_t *w, int j, long K, long k) {
    long at = j * K + k + PREFETCH;
    return w + (k + PREFETCH >= K ? at + (COLS - 1) * K : at);
}

/* One step of a block over 64 bytes of K: the weight vectors (and, with SUMS, their sums),
 * then each row's products.  LOAD(p) loads 64 bytes at p (or the zero-padded tail).  With
 * SUMS the pass is a product's first over the block: it reads w from memory and fetches its
 * rows ahead; ``next``: the next block's weight, fetched into L2 by the first two passes of
 * 5 rows or more, as avx512_bf16.c's blocks do (which says why); NULL: none. */
#define STEP(R, LOAD, k, SUMS)                                                            \
    {                                                                                    \
        __m512i wv[COLS];                                                                \
        for (int j = 0; j < COLS; j++) {                                                 \
            if (next)                                                                    \
                _mm_prefetch((const char *)(next + j * K + (k)), _MM_HINT_T1);           \
            if (SUMS)                                                                    \
                _mm_prefetch((const char *)ahead(w, j, K, (k)), _MM_HINT_T0);            \
            wv[j] = LOAD(w + j * K + (k));                                               \
            if (SUMS) sum[j] = _mm512_dpbusd_epi32(sum[j], ones, wv[j]);                 \
        }                                                                                \
        for (int i = 0; i < R; i++) {                                                    \
            __m512i xv = LOAD(xu + i * ldx + (k));                                       \
            for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]); \
        }                                                                                \
    }

#define FULL(p) _mm512_loadu_si512((const void *)(p))
#define TAIL(p) load_tail((p), K - k64)

/* block_R_s: R rows through COLS weight rows, the weight rows' sums made as they stream
 * (into ws); block_R: the same rows' products with the sums a first pass made (ws), so
 * the later passes of a product over the same block spend no instruction on them (at 8
 * rows, 4 of every 40 multiply-adds; the int8 products of a batch are bound by them). */
#define BLOCK(R, NAME, SUMS)                                                               \
static void NAME(const uint8_t *xu, long ldx, const int8_t *w, long K, int32_t *y,         \
                 long ldy, const int8_t *next, int32_t *ws) {                              \
    const __m512i ones = _mm512_set1_epi8(1);                                            \
    __m512i acc[R][COLS], sum[COLS];                                                     \
    for (int j = 0; j < COLS; j++) {                                                     \
        sum[j] = _mm512_setzero_si512();                                                 \
        for (int i = 0; i < R; i++) acc[i][j] = _mm512_setzero_si512();                  \
    }                                                                                    \
    long k64 = K & ~63L;                                                                 \
    for (long k = 0; k < k64; k += 64) STEP(R, FULL, k, SUMS)                            \
    if (k64 < K) STEP(R, TAIL, k64, SUMS)                                                \
    for (int j = 0; j < COLS; j++) {                                                     \
        if (SUMS) ws[j] = _mm512_reduce_add_epi32(sum[j]);                               \
        for (int i = 0; i < R; i++) y[i * ldy + j] = _mm512_reduce_add_epi32(acc[i][j]) - 128 * ws[j]; \
    }                                                                                    \
}

BLOCK(1, block_1_s, 1)
BLOCK(2, block_2_s, 1)
BLOCK(3, block_3_s, 1)
BLOCK(4, block_4_s, 1)
BLOCK(1, block_1, 0)
BLOCK(2, block_2, 0)
BLOCK(3, block_3, 0)
BLOCK(4, block_4, 0)

static void column(const uint8_t *xu, long ldx, int rows, const int8_t *w, long K, int32_t *y,
                   long ldy) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512();
    for (long k = 0; k < K; k += 64)
        sum = _mm512_dpbusd_epi32(sum, ones, load_tail(w + k, K - k));
    int32_t s = _mm512_reduce_add_epi32(sum);
    for (int i = 0; i < rows; i++) {
        __m512i acc = _mm512_setzero_si512();
        for (long k = 0; k < K; k += 64)
            acc = _mm512_dpbusd_epi32(acc, load_tail(xu + i * ldx + k, K - k), load_tail(w + k, K - k));
        y[i * ldy] = _mm512_reduce_add_epi32(acc) - 128 * s;
    }
}

/* One weight row through one row of x (unsigned), as lanes: acc the products of x + 128,
 * sum the weight's own (``dot`` and ``dot1`` reduce them). */
static inline void dot_lanes(const uint8_t *xu, const int8_t *w, long K, __m512i *acc, __m512i *sum) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i a = _mm512_setzero_si512(), s = _mm512_setzero_si512();
    long k64 = K & ~63L;
    for (long k = 0; k < k64; k += 64) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        s = _mm512_dpbusd_epi32(s, ones, wv);
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512((const void *)(xu + k)), wv);
    }
    if (k64 < K) {
        __m512i wv = load_tail(w + k64, K - k64);
        s = _mm512_dpbusd_epi32(s, ones, wv);
        a = _mm512_dpbusd_epi32(a, load_tail(xu + k64, K - k64), wv);
    }
    *acc = a;
    *sum = s;
}

/* The exact product, as the blocks compute it; the weight row's sum goes to *wsum. */
static inline int32_t dot(const uint8_t *xu, const int8_t *w, long K, int32_t *wsum) {
    __m512i acc, sum;
    dot_lanes(xu, w, K, &acc, &sum);
    *wsum = _mm512_reduce_add_epi32(sum);
    return _mm512_reduce_add_epi32(acc) - 128 * *wsum;
}

/* ``dot`` for a lone row, which needs no weight sum back: acc - 128 x sum as vectors and
 * one reduction, where two reductions a weight row of 24 vectors (1536 bytes) weighed. */
static inline int32_t dot1(const uint8_t *xu, const int8_t *w, long K) {
    __m512i acc, sum;
    dot_lanes(xu, w, K, &acc, &sum);
    return _mm512_reduce_add_epi32(_mm512_sub_epi32(acc, _mm512_slli_epi32(sum, 7)));
}

/* Up to FEW rows (a decode window's) read each weight row once, in order, one stream per
 * thread (avx512_bf16.c says why); more rows take the blocks. */
#define FEW 4

/* Rows 1 .. R of a few-row window through a weight row the first row's pass brought into
 * L1 and summed (``s``): R chains in one pass, no second sum. */
#define LINE(R)                                                                           \
static inline void line_##R(const uint8_t *xu, long ldx, const int8_t *w, long K,        \
                            int32_t s, int32_t *y, long ldy) {                           \
    __m512i acc[R];                                                                      \
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_si512();                         \
    long k64 = K & ~63L;                                                                 \
    for (long k = 0; k < k64; k += 64) {                                                 \
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));                          \
        for (int i = 0; i < R; i++)                                                      \
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512((const void *)(xu + i * ldx + k)), wv); \
    }                                                                                    \
    if (k64 < K) {                                                                       \
        __m512i wv = load_tail(w + k64, K - k64);                                        \
        for (int i = 0; i < R; i++)                                                      \
            acc[i] = _mm512_dpbusd_epi32(acc[i], load_tail(xu + i * ldx + k64, K - k64), wv); \
    }                                                                                    \
    for (int i = 0; i < R; i++) y[i * ldy] = _mm512_reduce_add_epi32(acc[i]) - 128 * s;  \
}

LINE(1)
LINE(2)
LINE(3)

/* Weight row w through rows 0 .. rows (at most FEW) of x into y[m * ldy]: the first row
 * with the weight's sum, as ``dot`` (it streams the row from memory), the others from L1
 * without summing the weight again.  Why: ``dot`` row after row summed the same weight
 * row once a row: 4 rows through a 1536 x 1536 weight held in cache took 131 us, now 99
 * (2 rows 73 -> 66; the sums are exact integers, so no value changes). */
static inline void few(const uint8_t *xu, long ldx, int rows, const int8_t *w, long K,
                       int32_t *y, long ldy) {
    if (rows <= 0)
        return;
    if (rows == 1) {
        y[0] = dot1(xu, w, K);
        return;
    }
    int32_t s;
    y[0] = dot(xu, w, K, &s);
    switch (rows) {
    case 2: line_1(xu + ldx, ldx, w, K, s, y + ldy, ldy); break;
    case 3: line_2(xu + ldx, ldx, w, K, s, y + ldy, ldy); break;
    default: line_3(xu + ldx, ldx, w, K, s, y + ldy, ldy); break;
    }
}

/* Rows m .. m + rows through weight rows n .. n + COLS; ``ws``: the block's weight sums,
 * made by the pass at m = 0 (the first of a product) and read by the later ones. */
static inline void tile(const uint8_t *xu, long ldx, long m, int rows, const int8_t *w, long N,
                        long K, long n, int32_t *y, long ldy, const int8_t *next, int32_t *ws) {
    if (n + COLS > N) {
        for (long c = n; c < N; c++)
            column(xu + m * ldx, ldx, rows, w + c * K, K, y + m * ldy + c, ldy);
        return;
    }
    typedef void (*block_fn)(const uint8_t *, long, const int8_t *, long, int32_t *, long,
                             const int8_t *, int32_t *);
    static const block_fn blocks[2][MAXR] = {{block_1, block_2, block_3, block_4},
                                             {block_1_s, block_2_s, block_3_s, block_4_s}};
    blocks[m == 0][rows - 1](xu + m * ldx, ldx, w + n * K, K, y + m * ldy + n, ldy, next, ws);
}

static void product(const uint8_t *xu, long M, long K, long ldx, const int8_t *w, long N,
                    int32_t *y, long ldy, long b) {
    int32_t ws[COLS];
    for (long m = 0; m < M; m += MAXR) {
        int rows = M - m < MAXR ? (int)(M - m) : MAXR;
        long n = b * COLS;
        const int8_t *next = m <= MAXR && M > MAXR && n + 2 * COLS <= N ? w + (n + COLS) * K : NULL;
        tile(xu, ldx, m, rows, w, N, K, n, y, ldy, next, ws);
    }
}

/* x + 128 as unsigned bytes: the sign bit flipped. */
static uint8_t *unsigned_rows(const int8_t *x, long M, long K, long ldx) {
    uint8_t *xu = malloc((size_t)(M * K) + 64);
    if (xu == NULL) return NULL;
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) xu[m * K + k] = (uint8_t)x[m * ldx + k] ^ 0x80u;
    return xu;
}

/* x int8 rows of stride ldx, w int8 [N, K] rows contiguous -> y int32 of ldy; returns 0,
 * or -1 where the scratch could not be allocated (y untouched). */
int i8_mm(const int8_t *x, long M, long K, long ldx, const int8_t *w, long N, int32_t *y,
          long ldy, int threads) {
    uint8_t *xu = unsigned_rows(x, M, K, ldx);
    if (xu == NULL) return -1;
    if (M <= FEW) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++)
            few(xu, K, (int)M, w + n * K, K, y + n, ldy);
    } else {
        long blocks = (N + COLS - 1) / COLS;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long b = 0; b < blocks; b++)
            product(xu, M, K, K, w, N, y, ldy, b);
    }
    free(xu);
    return 0;
}

/* Row a of x through expert expert[a] of w int8 [E, N, K] -> y int32 [A, N], the rows of
 * each expert together: its weight is read once for all of them (the sums are exact, so
 * the grouping changes no number).  Why: a window's gathered experts past a few tokens
 * chose the same experts again (8 tokens x top-4 of 16 experts: 32 rows, ~15 experts),
 * and reading an expert once a row cost ~2x the bytes of the routed MoE.  The (run of one
 * expert, column block) pairs are shared out as one contiguous run a thread (one stream
 * each), runs of more than FEW rows too: handing their blocks out as threads asked, 8 and
 * 16 tokens of a skewed router streamed 15.7 and 14.0 GB/s, in contiguous runs 22.8 and
 * 20.0 (a plain read 29-30).  Returns 0, or -1 without memory for the scratch (y
 * untouched). */
int i8_rows(const int8_t *x, long A, long K, const long *expert, const int8_t *w, long N,
            int32_t *y, int threads) {
    long *order = malloc((size_t)(2 * A + 1) * sizeof(long));
    uint8_t *xu = malloc((size_t)(A * K) + 64);
    int32_t *ys = malloc((size_t)(A * N) * sizeof(int32_t) + 64);
    if (order == NULL || xu == NULL || ys == NULL) {
        free(order); free(xu); free(ys);
        return -1;
    }
    long *starts = order + A, runs = expert_runs(expert, A, order, starts);
    long blocks = (N + COLS - 1) / COLS;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++)
            for (long k = 0; k < K; k++) xu[a * K + k] = (uint8_t)x[order[a] * K + k] ^ 0x80u;
        #pragma omp for schedule(static)
        for (long j = 0; j < runs * blocks; j++) {
            long r = j / blocks, b = j % blocks, first = starts[r];
            long rows = starts[r + 1] - first;
            const int8_t *we = w + expert[order[first]] * N * K;
            if (rows > FEW) {
                product(xu + first * K, rows, K, K, we, N, ys + first * N, N, b);
            } else {
                for (long n = b * COLS; n < b * COLS + COLS && n < N; n++)
                    few(xu + first * K, K, (int)rows, we + n * K, K, ys + first * N + n, N);
            }
        }
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++) memcpy(y + order[a] * N, ys + a * N, (size_t)N * sizeof(int32_t));
    }
    free(order); free(xu); free(ys);
    return 0;
}

/* Rows [0, m) of unsigned activations (stride ldx) through one weight row: i8_moe's part
 * (int8_moe.h), ``few`` rows a pass. */
static void i8_moe_rows(const int8_t *rows, long m, long ldx, const int8_t *w, long K, int32_t *y,
                        long ldy) {
    for (long i0 = 0; i0 < m; i0 += FEW) {
        int c = m - i0 < FEW ? (int)(m - i0) : FEW;
        few((const uint8_t *)rows + i0 * ldx, ldx, c, w, K, y + i0 * ldy, ldy);
    }
}

/* A decode window's routed MoE of int8 experts in one call (int8_moe.h moe_int8 says what
 * and why; half_avx2.c's int8_moe is the same but for its products): where the gathered
 * experts took two i8_rows calls and the compiled graph's scaling, activation and
 * requantizing between them. */
int i8_moe(const float *x, long T, long H, long I, long k, const long *idx, const float *wt,
           long E, const int8_t *gate_up, const float *gus, const int8_t *down, const float *ds,
           float *out, int threads) {
    return moe_int8(x, T, H, I, k, idx, wt, E, gate_up, gus, down, ds, out, threads, 1, i8_moe_rows);
}
