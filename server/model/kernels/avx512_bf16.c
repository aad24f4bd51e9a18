/* Products with bfloat16 weights on CPUs with AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire
 * Rapids and later): y[M, N] = x[M, K] . w[N, K]^T with x and w bfloat16, y float32, and a
 * routed MoE's experts in one call.
 *
 * Why (server/model/kernels/avx512.py): oneDNN's bf16 product streamed a decode step's
 * weights at 60-70% of the memory's read bandwidth on a 2-core Zen 4, our AVX2 kernel
 * (half_avx2.c) converts each weight vector to float32 before its multiply-adds, which at
 * 4 rows and more costs more than the memory does.  VDPBF16PS multiplies 32 bf16 pairs
 * and adds them into 16 float32 lanes in one instruction, so up to 4 rows a weight vector
 * takes less time to multiply than to read.
 *
 * Every output element is one chain of VDPBF16PS over K in order, then the same
 * horizontal sum: its value does not depend on M or on the other rows, so a window of
 * k+1 rows computes each row exactly as a one-row step does (MTP stays lossless).
 *
 * Built at first use (server/model/kernels/native.py) with -mavx512f -mavx512bw
 * -mavx512bf16 -fopenmp; its OpenMP is the libgomp torch has loaded.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <alloca.h>
#include <stdlib.h>
#include <string.h>

#include "latent_paged.h"

#define COLS 4          /* weight rows streamed together: 4 reads in flight per thread */
#define MAXR 4          /* rows of x per block */

static inline __m512bh load_bh(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

static inline __m512bh load_bh_tail(const uint16_t *p, long n) {
    __mmask32 m = n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* Where row j of a block will be read PREFETCH elements on: past the row's end, the same
 * row of the next block (the next COLS rows).  A block's rows are short streams (3 KB at
 * K = 1536), which the hardware prefetcher alone follows late: 15-20% faster on Zen 4. */
#define PREFETCH 256
static inline const uint16_t *ahead(const uint16_t *w, int j, long K, long k) {
    long at = j * K + k + PREFETCH;
    return w + (k + PREFETCH >= K ? at + (COLS - 1) * K : at);
}

/* One block: ``R`` rows of x (constant) by ``COLS`` rows of w.  ``own``: the pass reads w
 * from memory (the first pass over the block), and fetches its rows ahead into L1.
 * ``next``: the next block's weight rows, fetched into L2 as this pass goes, at its own
 * offset in K; NULL: none.  ``product`` gives it to the first two passes of 5 or more rows
 * (the second pass reads w from cache).  Why: the passes' arithmetic and the memory took
 * turns (their times added up, at 8 rows about half and half); fetching a block ahead
 * overlaps them.  The first pass's requests alone left the memory idle through the
 * second (3-4 GB/s less at 8 rows); both passes' (the second's mostly already in flight)
 * keep it busy.  On the 2-core Zen 4, streamed (a plain read 30-33 GB/s), 8 rows: no
 * fetch ahead 16.9 GB/s, the second pass's 19.5, both passes' 22.5-26.7 (5 rows 18 -> 20
 * -> 22-29; 16 rows 15 -> 17 -> 14-18).  A batch-8 step of the 0.5b model, alternating
 * in one process: no fetch against the second pass's 53.5 / 53.0 ms (k=1: 89.9 / 81.0),
 * the second pass's against both passes' 48.3 / 44.7 (k=1: 92.6 / 84.1; 74.7 / 77.3 in an
 * earlier run, within its noise).  Values do not change: only where the weight waits. */
#define BLOCK(R)                                                                          \
static void block_##R(const uint16_t *x, long ldx, const uint16_t *w, long K, float *y,  \
                      long ldy, const uint16_t *next, int own) {                        \
    __m512 acc[R][COLS];                                                                 \
    for (int i = 0; i < R; i++)                                                          \
        for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_setzero_ps();                  \
    long k32 = K & ~31L;                                                                 \
    for (long k = 0; k < k32; k += 32) {                                                 \
        __m512bh wv[COLS];                                                               \
        for (int j = 0; j < COLS; j++) {                                                 \
            if (next)                                                                    \
                _mm_prefetch((const char *)(next + j * K + k), _MM_HINT_T1);             \
            if (own)                                                                     \
                _mm_prefetch((const char *)ahead(w, j, K, k), _MM_HINT_T0);              \
            wv[j] = load_bh(w + j * K + k);                                              \
        }                                                                                \
        for (int i = 0; i < R; i++) {                                                    \
            __m512bh xv = load_bh(x + i * ldx + k);                                      \
            for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]); \
        }                                                                                \
    }                                                                                    \
    if (k32 < K) {                                                                       \
        __m512bh wv[COLS];                                                               \
        for (int j = 0; j < COLS; j++) wv[j] = load_bh_tail(w + j * K + k32, K - k32);   \
        for (int i = 0; i < R; i++) {                                                    \
            __m512bh xv = load_bh_tail(x + i * ldx + k32, K - k32);                      \
            for (int j = 0; j < COLS; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]); \
        }                                                                                \
    }                                                                                    \
    for (int i = 0; i < R; i++)                                                          \
        for (int j = 0; j < COLS; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]); \
}

BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

/* The last columns (N % COLS of them), one weight row at a time: the same chain per
 * element as the blocks above. */
static void column(const uint16_t *x, long ldx, int rows, const uint16_t *w, long K, float *y,
                   long ldy) {
    for (int i = 0; i < rows; i++) {
        __m512 acc = _mm512_setzero_ps();
        long k32 = K & ~31L;
        for (long k = 0; k < k32; k += 32)
            acc = _mm512_dpbf16_ps(acc, load_bh(x + i * ldx + k), load_bh(w + k));
        if (k32 < K)
            acc = _mm512_dpbf16_ps(acc, load_bh_tail(x + i * ldx + k32, K - k32),
                                   load_bh_tail(w + k32, K - k32));
        y[i * ldy] = _mm512_reduce_add_ps(acc);
    }
}

/* One weight row through one row of x: the blocks' chain over K exactly (so a row's value
 * is the same whichever path computed it). */
static inline float dot(const uint16_t *x, const uint16_t *w, long K) {
    __m512 acc = _mm512_setzero_ps();
    long k32 = K & ~31L;
    for (long k = 0; k < k32; k += 32)
        acc = _mm512_dpbf16_ps(acc, load_bh(x + k), load_bh(w + k));
    if (k32 < K)
        acc = _mm512_dpbf16_ps(acc, load_bh_tail(x + k32, K - k32), load_bh_tail(w + k32, K - k32));
    return _mm512_reduce_add_ps(acc);
}

/* Two rows of x through one weight row, both chains in one pass over K: each the chain
 * ``dot`` makes (so the values are a lone row's), but the two in flight together, where
 * ``dot`` row after row waited on each multiply-add's latency twice.  A 2-row window (a
 * lone sequence's k=1 verify window; an expert two tokens chose): a batch-1 k=1 step of
 * the 0.5b model 32.4 -> 28.6 and 35.9 -> 28.3 ms, alternating in one process.  3-4 rows
 * go two at a time (``few_rows``): a k=2 step 45.5 -> 42.9 ms, a batch-8 step unchanged;
 * 3 or 4 chains in one pass were no faster (a batch-8 step 2.6% slower at 4). */
static inline void dot2(const uint16_t *x, long ldx, const uint16_t *w, long K, float *y,
                        long ldy) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long k32 = K & ~31L;
    for (long k = 0; k < k32; k += 32) {
        __m512bh wv = load_bh(w + k);
        a0 = _mm512_dpbf16_ps(a0, load_bh(x + k), wv);
        a1 = _mm512_dpbf16_ps(a1, load_bh(x + ldx + k), wv);
    }
    if (k32 < K) {
        __m512bh wv = load_bh_tail(w + k32, K - k32);
        a0 = _mm512_dpbf16_ps(a0, load_bh_tail(x + k32, K - k32), wv);
        a1 = _mm512_dpbf16_ps(a1, load_bh_tail(x + ldx + k32, K - k32), wv);
    }
    y[0] = _mm512_reduce_add_ps(a0);
    y[ldy] = _mm512_reduce_add_ps(a1);
}

/* Rows 0 .. rows (at most FEW) of x through one weight row into y[m * ldy], two at a time. */
static inline void few_rows(const uint16_t *x, long ldx, long rows, const uint16_t *w, long K,
                            float *y, long ldy) {
    long m = 0;
    for (; m + 2 <= rows; m += 2) dot2(x + m * ldx, ldx, w, K, y + m * ldy, ldy);
    if (m < rows) y[m * ldy] = dot(x + m * ldx, w, K);
}

/* Up to FEW rows of x, a decode window's, read each weight row once, in order, as one
 * stream per thread, and multiply it into every row from L1: on the 2-core Zen 4 a decode
 * step's weights streamed at 22-30 GB/s this way against 15-24 in blocks of 4 rows (the
 * blocks' 4 short streams a row apart).  More rows take the blocks, which reuse each x
 * vector across 4 weight rows. */
#define FEW 4

/* Rows m .. m+rows of x through columns n .. n+COLS (or the tail columns) of w. */
static inline void tile(const uint16_t *x, long ldx, long m, int rows, const uint16_t *w,
                        long N, long K, long n, float *y, long ldy, const uint16_t *next) {
    if (n + COLS > N) {
        for (long c = n; c < N; c++)
            column(x + m * ldx, ldx, rows, w + c * K, K, y + m * ldy + c, ldy);
        return;
    }
    const uint16_t *xs = x + m * ldx, *ws = w + n * K;
    float *ys = y + m * ldy + n;
    switch (rows) {
    case 1: block_1(xs, ldx, ws, K, ys, ldy, next, m == 0); break;
    case 2: block_2(xs, ldx, ws, K, ys, ldy, next, m == 0); break;
    case 3: block_3(xs, ldx, ws, K, ys, ldy, next, m == 0); break;
    default: block_4(xs, ldx, ws, K, ys, ldy, next, m == 0); break;
    }
}

/* Every column block of one product, rows inner: a block's weight rows are read from
 * memory once and stay in cache for the rows after the first MAXR. */
static void product(const uint16_t *x, long M, long K, long ldx, const uint16_t *w, long N,
                    float *y, long ldy, long b) {
    long n = b * COLS;
    for (long m = 0; m < M; m += MAXR) {
        int rows = M - m < MAXR ? (int)(M - m) : MAXR;
        /* The first two passes fetch the next block (block_R says why). */
        const uint16_t *next = m <= MAXR && M > MAXR && n + 2 * COLS <= N ? w + (n + COLS) * K : NULL;
        tile(x, ldx, m, rows, w, N, K, n, y, ldy, next);
    }
}

/* w: bfloat16 [N, K], rows contiguous; x bfloat16 rows of stride ldx; y float32 of ldy. */
void bf16_mm(const uint16_t *x, long M, long K, long ldx, const uint16_t *w, long N, float *y,
             long ldy, int threads) {
    if (M <= FEW) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++)
            few_rows(x, ldx, M, w + n * K, K, y + n, ldy);
        return;
    }
    long blocks = (N + COLS - 1) / COLS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++)
        product(x, M, K, ldx, w, N, y, ldy, b);
}

/* Rows first .. first + rows of x through columns b * COLS .. of expert e's weight. */
static inline void expert_block(const uint16_t *x, long ldx, long first, long rows,
                                const uint16_t *we, long N, long K, float *y, long ldy, long b) {
    if (rows > FEW) {
        product(x + first * ldx, rows, K, ldx, we, N, y + first * ldy, ldy, b);
        return;
    }
    for (long n = b * COLS; n < b * COLS + COLS && n < N; n++)
        few_rows(x + first * ldx, ldx, rows, we + n * K, K, y + first * ldy + n, ldy);
}

/* Each chosen expert's rows of x through its weight, w [E, N, K] -> y; the (chosen expert,
 * column block) pairs shared out over the threads of the enclosing parallel region, each
 * thread one contiguous run of them: a single stream (at 1-2 tokens a window on the 0.5b
 * model, 10% faster than handing out blocks of 4 as threads ask: their streams
 * interleave).  Experts with more than FEW rows too, since their blocks fetch the next one
 * ahead (block_R): handing blocks out as threads asked, 8 and 16 tokens of a skewed
 * router streamed 17.7 and 17.4 GB/s, one run each 20.9 and 20.4 (a plain read 27). */
static void each_expert(const uint16_t *x, long ldx, const long *offsets, long E,
                        const uint16_t *w, long N, long K, float *y, long ldy) {
    long blocks = (N + COLS - 1) / COLS, used = 0;
    long *chosen = alloca((size_t)E * sizeof(long));
    for (long e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) chosen[used++] = e;
    #pragma omp for schedule(static)
    for (long j = 0; j < used * blocks; j++) {
        long e = chosen[j / blocks];
        expert_block(x, ldx, offsets[e], offsets[e + 1] - offsets[e], w + e * N * K, N, K, y,
                     ldy, j % blocks);
    }
}

/* e^x of 16 lanes (Cephes' expf polynomial, ~1 ulp; -inf..88, larger x inf). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The first min(n, 16) lanes. */
static inline __mmask16 first(long n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

/* bf16(silu(g) * u) of 16 lanes (the first n < 16 at a tail), rounded to nearest even. */
static inline void swiglu16(const float *g, const float *u, uint16_t *out, long n) {
    __mmask16 m = first(n);
    __m512 gv = _mm512_maskz_loadu_ps(m, g), uv = _mm512_maskz_loadu_ps(m, u);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 v = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv);
    __m512i packed = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
    _mm512_mask_storeu_epi16(out, (__mmask32)m, packed);
}

/* A routed MoE's experts over their rows, run by every thread of an enclosing parallel
 * region: xs bf16 [A, H] holds each expert's rows in turn (expert e's are rows offsets[e]
 * .. offsets[e + 1]); gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]
 * bf16.  ys[a] = down_e . bf16(silu(gate_e . xs[a]) * (up_e . xs[a])), float32; gu float32
 * [A, 2I] and act bf16 [A, I] are scratch.  An expert without rows is not read. */
static void experts_body(const uint16_t *xs, long H, long I, const long *offsets, long E,
                         const uint16_t *gate_up, const uint16_t *down, float *gu, uint16_t *act,
                         float *ys) {
    long A = offsets[E], I2 = 2 * I;
    each_expert(xs, H, offsets, E, gate_up, I2, H, gu, I2);
    #pragma omp for schedule(static)
    for (long a = 0; a < A; a++)
        for (long i = 0; i < I; i += 16)
            swiglu16(gu + a * I2 + i, gu + a * I2 + I + i, act + a * I + i, I - i);
    each_expert(act, I, offsets, E, down, H, I, ys, H);
}

/* ``experts_body`` in one call (the eager MoE's sorted rows). */
void bf16_experts(const uint16_t *xs, long H, long I, const long *offsets, long E,
                  const uint16_t *gate_up, const uint16_t *down, float *gu, uint16_t *act,
                  float *ys, int threads) {
    #pragma omp parallel num_threads(threads)
    experts_body(xs, H, I, offsets, E, gate_up, down, gu, act, ys);
}

/* Row a of x through expert expert[a] of w bf16 [E, N, K] -> y float32 [A, N]: a window's
 * gathered experts, each chosen expert's rows read in place. */
void bf16_rows(const uint16_t *x, long A, long K, const long *expert, const uint16_t *w, long N,
               float *y, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < A * N; j++) {
        long a = j / N, n = j % N;
        y[j] = dot(x + a * K, w + (expert[a] * N + n) * K, K);
    }
}


/* Each head's rows through that head's weight: y[t, h] = w[h] . x[t, h], x bf16 [T, nH, K],
 * w bf16 [nH, N, K], y float32 [T, nH, N]; (head, column block) pairs over the threads.
 * Why: the absorbed attention's W_UK / W_UV as bf16_rows read a head's weight once per
 * token (7% of a batch-8 step on the 0.5b model); grouped by head, once a step. */
void bf16_heads(const uint16_t *x, long T, long nh, long K, const uint16_t *w, long N, float *y,
                int threads) {
    long blocks = (N + COLS - 1) / COLS, ldx = nh * K, ldy = nh * N;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < nh * blocks; j++) {
        long h = j / blocks, b = j % blocks;
        const uint16_t *xh = x + h * K, *wh = w + h * N * K;
        float *yh = y + h * N;
        if (T > FEW) {
            product(xh, T, K, ldx, wh, N, yh, ldy, b);
            continue;
        }
        for (long n = b * COLS; n < b * COLS + COLS && n < N; n++)
            few_rows(xh, ldx, T, wh + n * K, K, yh + n, ldy);
    }
}

/* Four positions' scores at once (four independent chains, so their latencies overlap),
 * each the same chain over k as ``dot``. */
static inline void dot4(const uint16_t *x, const uint16_t *w, long D, float *y) {
    __m512 acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm512_setzero_ps();
    long k32 = D & ~31L;
    for (long k = 0; k < k32; k += 32) {
        __m512bh xv = load_bh(x + k);
        for (int j = 0; j < 4; j++) acc[j] = _mm512_dpbf16_ps(acc[j], xv, load_bh(w + j * D + k));
    }
    if (k32 < D) {
        __m512bh xv = load_bh_tail(x + k32, D - k32);
        for (int j = 0; j < 4; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, load_bh_tail(w + j * D + k32, D - k32));
    }
    for (int j = 0; j < 4; j++) y[j] = _mm512_reduce_add_ps(acc[j]);
}

#define SUM_VECS 8      /* float32 accumulators of the weighted sum: 8 chains hide FMA latency */

/* 16 bf16 values (masked to n < 16 at a tail) widened to float32: a 512-bit masked load
 * with the first 16 lanes, so no AVX512VL is needed. */
static inline __m512 widen16(const uint16_t *p, long n) {
    __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)first(n), (const void *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* p[0..end) = softmax(p * scale + bias), -inf bias lanes exactly 0; false when nothing
 * is visible.  A NULL bias is all zeros (every position before ``end`` visible). */
static int softmax_row(float *p, const float *bias, long end, float scale) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 top = ninf;
    for (long s = 0; s < end; s += 16) {
        __mmask16 m = first(end - s);
        __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + s) : _mm512_setzero_ps();
        __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + s), _mm512_set1_ps(scale), b);
        /* A -inf bias wins whatever the score (a NaN row the query cannot see). */
        v = _mm512_mask_blend_ps(_mm512_mask_cmp_ps_mask(m, b, ninf, _CMP_NEQ_OQ), ninf, v);
        _mm512_mask_storeu_ps(p + s, m, v);
        top = _mm512_max_ps(top, v);
    }
    float t = _mm512_reduce_max_ps(top);
    if (t == -INFINITY) return 0;
    __m512 vt = _mm512_set1_ps(t), sum = _mm512_setzero_ps();
    for (long s = 0; s < end; s += 16) {
        __mmask16 m = first(end - s);
        __m512 v = _mm512_maskz_loadu_ps(m, p + s);
        __mmask16 live = _mm512_mask_cmp_ps_mask(m, v, ninf, _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, vt)));
        _mm512_mask_storeu_ps(p + s, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (long s = 0; s < end; s += 16) {
        __mmask16 m = first(end - s);
        _mm512_mask_storeu_ps(p + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + s), inv));
    }
    return 1;
}

/* o[0..cols) = sum_s p[s] * ctx[s, 0..cols) (cols <= SUM_VECS x 16), in the order of s;
 * a whole block of SUM_VECS vectors takes unmasked loads. */
static inline void weighted_sum(const float *p, long end, const uint16_t *ctx, long D, long cols,
                                float *o) {
    __m512 acc[SUM_VECS];
    int vecs = (int)((cols + 15) / 16);
    for (int v = 0; v < SUM_VECS; v++) acc[v] = _mm512_setzero_ps();
    if (cols == SUM_VECS * 16) {
        for (long s = 0; s < end; s++) {
            if (p[s] == 0.0f) continue;
            __m512 w = _mm512_set1_ps(p[s]);
            const uint16_t *row = ctx + s * D;
            for (int v = 0; v < SUM_VECS; v++) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(row + v * 16));
                __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                acc[v] = _mm512_fmadd_ps(w, f, acc[v]);
            }
        }
    } else {
        for (long s = 0; s < end; s++) {
            if (p[s] == 0.0f) continue;
            __m512 w = _mm512_set1_ps(p[s]);
            const uint16_t *row = ctx + s * D;
            for (int v = 0; v < vecs; v++)
                acc[v] = _mm512_fmadd_ps(w, widen16(row + v * 16, cols - v * 16), acc[v]);
        }
    }
    for (int v = 0; v < vecs; v++)
        _mm512_mask_storeu_ps(o + v * 16, first(cols - v * 16), acc[v]);
}

/* The absorbed attention of a decode window, each query row alone:
 * out[b, r] = sum_s softmax_s(q[b, r] . ctx[b, s] * scale + bias[b, r, s]) * ctx[b, s, :kvr].
 * q bf16 [B, R, D], ctx bf16 [B, S, D], bias float32 [B, R, S] (-inf: not visible), out
 * float32 [B, R, kvr], p float32 [B, R, S] scratch.  Scores are ``dot``'s chains, the
 * softmax and the weighted sum float32 in the order of s: a row's result does not depend
 * on R or on the other rows (a verify window's rows equal the same rows one at a time).
 * Why: oneDNN's bf16 bmm spent 100-150 us a layer on the 0.5b model's 12 heads over ~170
 * positions (its threading, not its arithmetic), ~8% of a batch-1 decode step; this
 * kernel ~25 us. */
void bf16_attend(const uint16_t *q, long B, long R, long D, const uint16_t *ctx, long S,
                 const float *bias, float scale, long kvr, float *out, float *p, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < B * R; j++) {
        long b = j / R;
        const uint16_t *qr = q + j * D, *cb = ctx + b * S * D;
        const float *br = bias + j * S;
        float *pr = p + j * S, *o = out + j * kvr;
        /* Positions past the last visible one are skipped (a batch's shorter sequences). */
        long end = S;
        while (end > 0 && br[end - 1] == -INFINITY) end--;
        long s = 0;
        for (; s + 4 <= end; s += 4) dot4(qr, cb + s * D, D, pr + s);
        for (; s < end; s++) pr[s] = dot(qr, cb + s * D, D);
        if (!softmax_row(pr, br, end, scale)) {            /* nothing visible: zeros */
            for (long c = 0; c < kvr; c++) o[c] = 0.0f;
            continue;
        }
        for (long c0 = 0; c0 < kvr; c0 += SUM_VECS * 16) {
            long cols = kvr - c0 < SUM_VECS * 16 ? kvr - c0 : SUM_VECS * 16;
            weighted_sum(pr, end, cb + c0, D, cols, o + c0);
        }
    }
}

#define SUM_HEADS 3       /* heads a weighted-sum pass accumulates together (3 x SUM_VECS regs) */

/* Scores of n <= GROUP_HEADS heads' queries (consecutive rows of D) at positions 0 ..
 * end: p[h * S + s] = q_h . row_s, each the chain ``dot`` makes, every context row read
 * once for all n heads.  Inlined with n a constant (``group_scores``), so the n chains
 * live in registers. */
static inline __attribute__((always_inline)) void scores_n(
        const uint16_t *q, const int n, long D, const uint16_t *cache, long bs, const long *table,
        long end, float *p, long S) {
    long k32 = D & ~31L;
    for (long s = 0; s < end; s++) {
        const uint16_t *row = cache_row(cache, bs, table, D, s);
        __m512 acc[GROUP_HEADS];
        for (int h = 0; h < n; h++) acc[h] = _mm512_setzero_ps();
        for (long k = 0; k < k32; k += 32) {
            __m512bh r = load_bh(row + k);
            for (int h = 0; h < n; h++) acc[h] = _mm512_dpbf16_ps(acc[h], load_bh(q + h * D + k), r);
        }
        if (k32 < D) {
            __m512bh r = load_bh_tail(row + k32, D - k32);
            for (int h = 0; h < n; h++)
                acc[h] = _mm512_dpbf16_ps(acc[h], load_bh_tail(q + h * D + k32, D - k32), r);
        }
        for (int h = 0; h < n; h++) p[h * S + s] = _mm512_reduce_add_ps(acc[h]);
    }
}

static void group_scores(const uint16_t *q, int n, long D, const uint16_t *cache, long bs,
                         const long *table, long end, float *p, long S) {
    switch (n) {
    case 1: scores_n(q, 1, D, cache, bs, table, end, p, S); break;
    case 2: scores_n(q, 2, D, cache, bs, table, end, p, S); break;
    case 3: scores_n(q, 3, D, cache, bs, table, end, p, S); break;
    case 4: scores_n(q, 4, D, cache, bs, table, end, p, S); break;
    case 5: scores_n(q, 5, D, cache, bs, table, end, p, S); break;
    case 6: scores_n(q, 6, D, cache, bs, table, end, p, S); break;
    case 7: scores_n(q, 7, D, cache, bs, table, end, p, S); break;
    default: scores_n(q, 8, D, cache, bs, table, end, p, S); break;
    }
}

/* ``weighted_sum`` of n <= SUM_HEADS heads at once over a whole block of SUM_VECS vectors
 * (head h: weights p + h * S, output o + h * ldo), each context row's columns c0 .. c0 +
 * SUM_VECS x 16 loaded once for them: each head's sums the same, in the same order.
 * Inlined with n a constant, as ``scores_n``. */
static inline __attribute__((always_inline)) void sums_n(
        const float *p, long S, const int n, long end, const uint16_t *cache, long bs,
        const long *table, long D, long c0, float *o, long ldo) {
    __m512 acc[SUM_HEADS][SUM_VECS];
    for (int h = 0; h < n; h++)
        for (int v = 0; v < SUM_VECS; v++) acc[h][v] = _mm512_setzero_ps();
    for (long s = 0; s < end; s++) {
        const uint16_t *row = cache_row(cache, bs, table, D, s) + c0;
        __m512 f[SUM_VECS];
        for (int v = 0; v < SUM_VECS; v++) {
            __m256i h16 = _mm256_loadu_si256((const __m256i *)(row + v * 16));
            f[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16));
        }
        for (int h = 0; h < n; h++) {
            float w = p[h * S + s];
            if (w == 0.0f) continue;
            __m512 wv = _mm512_set1_ps(w);
            for (int v = 0; v < SUM_VECS; v++) acc[h][v] = _mm512_fmadd_ps(wv, f[v], acc[h][v]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int v = 0; v < SUM_VECS; v++) _mm512_storeu_ps(o + h * ldo + v * 16, acc[h][v]);
}

/* ``weighted_sum`` through the block table for n heads: whole blocks of columns SUM_HEADS
 * heads at a time (``sums_n``), a tail block head by head. */
static void group_weighted_sum(const float *p, long S, int n, long end, const uint16_t *cache, long bs,
                               const long *table, long D, long kvr, float *o) {
    for (long c0 = 0; c0 < kvr; c0 += SUM_VECS * 16) {
        long cols = kvr - c0;
        if (cols >= SUM_VECS * 16) {
            for (int h = 0; h < n; h += SUM_HEADS) {
                const float *ph = p + h * S;
                float *oh = o + h * kvr + c0;
                switch (n - h) {
                case 1: sums_n(ph, S, 1, end, cache, bs, table, D, c0, oh, kvr); break;
                case 2: sums_n(ph, S, 2, end, cache, bs, table, D, c0, oh, kvr); break;
                default: sums_n(ph, S, SUM_HEADS, end, cache, bs, table, D, c0, oh, kvr); break;
                }
            }
            continue;
        }
        for (int h = 0; h < n; h++) {
            __m512 acc[SUM_VECS];
            int vecs = (int)((cols + 15) / 16);
            for (int v = 0; v < SUM_VECS; v++) acc[v] = _mm512_setzero_ps();
            for (long s = 0; s < end; s++) {
                float w = p[h * S + s];
                if (w == 0.0f) continue;
                __m512 wv = _mm512_set1_ps(w);
                const uint16_t *row = cache_row(cache, bs, table, D, s) + c0;
                for (int v = 0; v < vecs; v++)
                    acc[v] = _mm512_fmadd_ps(wv, widen16(row + v * 16, cols - v * 16), acc[v]);
            }
            for (int v = 0; v < vecs; v++)
                _mm512_mask_storeu_ps(o + h * kvr + c0 + v * 16, first(cols - v * 16), acc[v]);
        }
    }
}

/* One work item of the paged attention: n heads of one token (queries q, consecutive rows
 * of D; scores p, rows S apart; outputs o, rows kvr apart) over positions 0 .. end. */
static void attend_group(const uint16_t *q, int n, long D, const uint16_t *cache, long bs,
                         const long *table, long end, float scale, long kvr, float *p, long S,
                         float *o) {
    group_scores(q, n, D, cache, bs, table, end, p, S);
    for (int h = 0; h < n; h++)
        if (!softmax_row(p + h * S, NULL, end, scale))          /* nothing visible: zeros */
            for (long s = 0; s < end; s++) p[h * S + s] = 0.0f;
    group_weighted_sum(p, S, n, end, cache, bs, table, D, kvr, o);
}

/* ``bf16_attend`` reading the latent cache in place through the block tables, with the
 * causal mask from the positions: query row r of sequence b (window token t = r / heads,
 * heads = R / Q) sees positions 0 .. pos[b, t].  cache bf16 [blocks, bs, D], tables int64
 * [B, nb], pos int64 [B, Q], p float32 [B, R, nb * bs] scratch.  A work item is a group of
 * one token's heads: MLA's heads share every context row, so a row is read once a group,
 * not once a head as bf16_attend reads it (the 0.5b model's 12 heads at 1536 positions,
 * 2 threads: 241 us a layer there, 172 here, besides the gather it no longer needs).  Each
 * head's chains are ``bf16_attend``'s, in the same order: the same numbers, without the
 * step's gathered copy of every context, its masking and its [B, R, S] bias. */
void bf16_attend_paged(const uint16_t *q, long B, long R, long D, const uint16_t *cache, long bs,
                       const long *tables, long nb, const long *pos, long Q, float scale, long kvr,
                       float *out, float *p, int threads) {
    long heads = R / Q, S = nb * bs, tokens = B * Q, size;
    long groups = head_groups(heads, tokens, threads, &size);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < tokens * groups; item++) {
        int n;
        long j = group_rows(item, groups, size, heads, &n), token = j / heads;
        attend_group(q + j * D, n, D, cache, bs, tables + token / Q * nb, pos[token] + 1, scale, kvr,
                     p + j * S, S, out + j * kvr);
    }
}

/* ``bf16_attend_paged`` on an int8 latent cache (layers/latent_cache.py Int8LatentCache):
 * latent int8 [blocks, bs, L], scale float32 [blocks, bs] (one a token), rope bf16 [blocks,
 * bs, P], L + P = D.  First every sequence's rows up to its window's largest position are
 * dequantized as the step's int8_gather does them (bf16(float(q) x scale), rounded to
 * nearest even; the RoPE part as stored) into buf (bf16 [B, nb * bs, D]), shared out row
 * by row; then the work items attend over them: the numbers of bf16_attend over the
 * gathered int8 context, without the step's masked copy and bias. */
void bf16_attend_paged_i8(const uint16_t *q, long B, long R, long D, const int8_t *latent,
                          const float *scales, const uint16_t *rope, long bs, long L, const long *tables,
                          long nb, const long *pos, long Q, float scale, long kvr, float *out, float *p,
                          uint16_t *buf, int threads) {
    long heads = R / Q, S = nb * bs, tokens = B * Q, P = D - L, size;
    long groups = head_groups(heads, tokens, threads, &size);
    static const long whole = 0;                            /* a sequence's rows: one block of S */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long r = 0; r < B * S; r++) {
            long slot = visible_slot(r, S, pos, Q, tables, nb, bs);
            if (slot < 0) continue;                           /* no query of its sequence sees it */
            const int8_t *lq = latent + slot * L;
            __m512 sc = _mm512_set1_ps(scales[slot]);
            uint16_t *o = buf + r * D;
            for (long c = 0; c < L; c += 16) {
                __mmask16 m = first(L - c);
                __m128i b8 = _mm512_castsi512_si128(_mm512_maskz_loadu_epi8((__mmask64)m, lq + c));
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8)), sc);
                __m512i h = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(f));
                _mm512_mask_storeu_epi16(o + c, (__mmask32)m, h);
            }
            memcpy(o + L, rope + slot * P, (size_t)P * sizeof(uint16_t));
        }
        #pragma omp for schedule(static)
        for (long item = 0; item < tokens * groups; item++) {
            int n;
            long j = group_rows(item, groups, size, heads, &n), token = j / heads;
            attend_group(q + j * D, n, D, buf + token / Q * S * D, S, &whole, pos[token] + 1, scale, kvr,
                         p + j * S, S, out + j * kvr);
        }
    }
}

/* A routed MoE of a decode window in one call, from the router's choice to the weighted
 * sum, with no reading of the choice on the host: the graph of a step calls it.
 * x bf16 [T, H]; the window's T * k (token, expert) pairs sorted by expert (stable, as
 * the eager MoE's argsort): row a of the sort is token src[a]'s, expert e's rows are
 * offsets[e] .. offsets[e + 1].  Token t's pairs are rows pairs[t * k ..] (ascending), of
 * weights pair_weights[t * k ..].  out float32 [T, H] = sum over the token's pairs, in
 * that order from +0, of ys[a] * weight: the eager MoE's float32 index_add_, value for
 * value.  xs, gu, act, ys: scratch (experts_body).
 * Why: the eager MoE read the expert counts on the host (a graph break) and spent 15-20%
 * of a batch-8 step on the 0.5b model in its small ops; the gathered form (bf16_rows)
 * reads an expert once per token that chose it, which past 4 tokens on 16 experts costs
 * more bytes than it saves. */
void bf16_moe(const uint16_t *x, long T, long H, long I, long k, const long *src,
              const long *pairs, const float *pair_weights, const long *offsets, long E,
              const uint16_t *gate_up, const uint16_t *down, uint16_t *xs, float *gu,
              uint16_t *act, float *ys, float *out, int threads) {
    long A = offsets[E];
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long a = 0; a < A; a++)
            for (long h = 0; h < H; h++) xs[a * H + h] = x[src[a] * H + h];
        experts_body(xs, H, I, offsets, E, gate_up, down, gu, act, ys);
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++)
            for (long c = 0; c < H; c += 16) {
                __mmask16 m = first(H - c);
                __m512 acc = _mm512_setzero_ps();
                for (long j = 0; j < k; j++) {
                    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ys + pairs[t * k + j] * H + c),
                                             _mm512_set1_ps(pair_weights[t * k + j]));
                    __asm__("" : "+v"(p));      /* rounded product, then the add: no FMA */
                    acc = _mm512_add_ps(acc, p);
                }
                _mm512_mask_storeu_ps(out + t * H + c, m, acc);
            }
    }
}
