/* MLA's absorbed attention on CPUs with AVX2 and FMA but no 16-bit float arithmetic: the
 * per-head products W_UK / W_UV (half_heads) and the attention of a decode window over
 * the latent cache read in place through the block tables (half_attend_paged, and
 * half_attend_paged_i8 for an int8 cache).  The same operators as avx512_bf16.c's
 * bf16_heads / bf16_attend_paged / bf16_attend_paged_i8, made of 8-lane float32 FMAs.
 *
 * Why (kernels/half_cpu.py): on the 0.5b model (2-core Zen 3, batch 1) a layer's absorbed
 * attention ran as Inductor reductions and float32 bmms: W_UK folded in with the gathered
 * and masked context ~150 us, the scores and the weighted sum 95 us (MKL's threading, for
 * 12 rows over ~100 positions), W_UV ~60 us: ~300 us of a ~1.5 ms layer, where reading
 * the two 1.2 MB head weights takes ~70.
 *
 * Every output's arithmetic is fixed by its own row: a head product is one set of chains
 * over K; a score one chain over the row, the softmax and the weighted sum in the order
 * of positions.  So a window of k+1 tokens computes each token as a one-token step does
 * (MTP stays lossless), however the heads are grouped among the threads.
 *
 * Built at first use by kernels/native.py (cc -O3 -mavx2 -mfma -fopenmp).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "latent_paged.h"

#define HEAD_COLS 4       /* weight rows a work item of half_heads takes */
#define SUM_HEADS 2       /* heads a weighted-sum pass accumulates together */
#define SUM_VECS 4        /* 8-column vectors a weighted-sum pass keeps (SUM_HEADS x SUM_VECS acc) */
#define MAX_FEATURES 1024 /* most features of a query row (ops.cpp checks: HALF_MAX_FEATURES) */

/* 8 bf16 values as float32 (exact). */
static inline __m256 widen8(const uint16_t *p) {
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bf16, rounded to nearest even (finite values). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The lanes below n (n < 8) of a masked load / store. */
static inline __m256i lanes(long n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* bf16 values p[0..n) -> float32 f[0..n). */
static void widen_row(const uint16_t *p, long n, float *f) {
    long k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(f + k, widen8(p + k));
    for (; k < n; k++) f[k] = bf16_value(p[k]);
}

/* x (float32) . w (bf16) over K: four chains over 32 columns at a time, then 8 at a time
 * into the first, then the scalar tail: fixed by K alone. */
static inline float dot(const float *x, const uint16_t *w, long K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), widen8(w + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), widen8(w + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), widen8(w + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(w + k), a0);
    float t = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) t += x[k] * bf16_value(w[k]);
    return t;
}

/* Each head's rows through that head's weight: y[t, h] = w[h] . x[t, h], x bf16 [T, nH, K],
 * w bf16 [nH, N, K], y float32 [T, nH, N].  x is widened once into xf (float32 scratch,
 * x's shape); a work item is HEAD_COLS weight rows of one head, each read from memory once
 * and from L1 for every row of x. */
void half_heads(const uint16_t *x, long T, long nh, long K, const uint16_t *w, long N, float *y,
                float *xf, int threads) {
    long blocks = (N + HEAD_COLS - 1) / HEAD_COLS;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long r = 0; r < T * nh; r++) widen_row(x + r * K, K, xf + r * K);
        #pragma omp for schedule(static)
        for (long j = 0; j < nh * blocks; j++) {
            long h = j / blocks, n0 = j % blocks * HEAD_COLS;
            for (long n = n0; n < n0 + HEAD_COLS && n < N; n++) {
                const uint16_t *wr = w + (h * N + n) * K;
                for (long t = 0; t < T; t++) y[(t * nh + h) * N + n] = dot(xf + (t * nh + h) * K, wr, K);
            }
        }
    }
}

/* e^x of 8 lanes (Cephes' expf polynomial, ~1 ulp) for x <= 0 (a softmax's shifted
 * scores); below -87.3 it flushes towards 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* p[0..end) = softmax(p * scale), end >= 1. */
static void softmax_row(float *p, long end, float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 top = _mm256_set1_ps(-INFINITY);
    long s = 0;
    for (; s + 8 <= end; s += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + s), sc);
        _mm256_storeu_ps(p + s, v);
        top = _mm256_max_ps(top, v);
    }
    __m256i tail = lanes(end - s);
    if (s < end) {
        __m256 v = _mm256_mul_ps(_mm256_maskload_ps(p + s, tail), sc);
        _mm256_maskstore_ps(p + s, tail, v);
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(tail)));
    }
    __m256 vt = _mm256_set1_ps(hmax(top)), sum = _mm256_setzero_ps();
    for (s = 0; s + 8 <= end; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), vt));
        _mm256_storeu_ps(p + s, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (s < end) {
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + s, tail), vt)),
                                 _mm256_castsi256_ps(tail));
        _mm256_maskstore_ps(p + s, tail, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
    for (s = 0; s + 8 <= end; s += 8) _mm256_storeu_ps(p + s, _mm256_mul_ps(_mm256_loadu_ps(p + s), inv));
    if (s < end) _mm256_maskstore_ps(p + s, tail, _mm256_mul_ps(_mm256_maskload_ps(p + s, tail), inv));
}

/* Scores of n <= GROUP_HEADS heads' queries (float32, consecutive rows of D) at positions
 * 0 .. end: p[h * S + s] = q_h . row_s, one chain a head (8 lanes over D, then the scalar
 * tail), every context row read once for all n heads.  Inlined with n a constant. */
static inline __attribute__((always_inline)) void scores_n(
        const float *q, const int n, long D, const uint16_t *cache, long bs, const long *table,
        long end, float *p, long S) {
    long d8 = D & ~7L;
    for (long s = 0; s < end; s++) {
        const uint16_t *row = cache_row(cache, bs, table, D, s);
        __m256 acc[GROUP_HEADS];
        for (int h = 0; h < n; h++) acc[h] = _mm256_setzero_ps();
        for (long k = 0; k < d8; k += 8) {
            __m256 r = widen8(row + k);
            for (int h = 0; h < n; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + k), r, acc[h]);
        }
        for (int h = 0; h < n; h++) {
            float t = hsum(acc[h]);
            for (long k = d8; k < D; k++) t += q[h * D + k] * bf16_value(row[k]);
            p[h * S + s] = t;
        }
    }
}

static void group_scores(const float *q, int n, long D, const uint16_t *cache, long bs,
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

/* o_h[c0 ..) += sum_s p_h[s] * row_s[c0 ..] for n <= SUM_HEADS heads over ``vecs`` <=
 * SUM_VECS vectors of 8 columns (the last one ``last`` lanes wide, 1..8), in the order of
 * s, zero weights skipped: a head's sums do not depend on the others.  Inlined with n and
 * vecs constants. */
static inline __attribute__((always_inline)) void sums_n(
        const float *p, long S, const int n, long end, const uint16_t *cache, long bs,
        const long *table, long D, long c0, const int vecs, long last, float *o, long ldo) {
    __m256 acc[SUM_HEADS][SUM_VECS];
    __m256i tail = lanes(last);
    for (int h = 0; h < n; h++)
        for (int v = 0; v < vecs; v++) acc[h][v] = _mm256_setzero_ps();
    for (long s = 0; s < end; s++) {
        const uint16_t *row = cache_row(cache, bs, table, D, s) + c0;
        __m256 f[SUM_VECS];
        for (int v = 0; v < vecs; v++) {
            if (v == vecs - 1 && last < 8) {
                float part[8] = {0};
                for (long c = 0; c < last; c++) part[c] = bf16_value(row[v * 8 + c]);
                f[v] = _mm256_loadu_ps(part);
            } else {
                f[v] = widen8(row + v * 8);
            }
        }
        for (int h = 0; h < n; h++) {
            float wt = p[h * S + s];
            if (wt == 0.0f) continue;
            __m256 wv = _mm256_set1_ps(wt);
            for (int v = 0; v < vecs; v++) acc[h][v] = _mm256_fmadd_ps(wv, f[v], acc[h][v]);
        }
    }
    for (int h = 0; h < n; h++)
        for (int v = 0; v < vecs; v++) {
            if (v == vecs - 1 && last < 8)
                _mm256_maskstore_ps(o + h * ldo + v * 8, tail, acc[h][v]);
            else
                _mm256_storeu_ps(o + h * ldo + v * 8, acc[h][v]);
        }
}

/* The weighted sums of n heads (outputs rows kvr apart) over blocks of SUM_VECS x 8
 * columns, SUM_HEADS heads at a time. */
static void group_weighted_sum(const float *p, long S, int n, long end, const uint16_t *cache, long bs,
                               const long *table, long D, long kvr, float *o) {
    for (long c0 = 0; c0 < kvr; c0 += SUM_VECS * 8) {
        long cols = kvr - c0 < SUM_VECS * 8 ? kvr - c0 : SUM_VECS * 8;
        int vecs = (int)((cols + 7) / 8);
        long last = cols - (vecs - 1) * 8;
        for (int h = 0; h < n; h += SUM_HEADS) {
            const float *ph = p + h * S;
            float *oh = o + h * kvr + c0;
            if (n - h >= 2 && vecs == SUM_VECS)
                sums_n(ph, S, 2, end, cache, bs, table, D, c0, SUM_VECS, last, oh, kvr);
            else if (vecs == SUM_VECS)
                sums_n(ph, S, 1, end, cache, bs, table, D, c0, SUM_VECS, last, oh, kvr);
            else
                for (int g = h; g < n && g < h + SUM_HEADS; g++) {    /* the columns' tail */
                    const float *pg = p + g * S;
                    float *og = o + g * kvr + c0;
                    switch (vecs) {
                    case 1: sums_n(pg, S, 1, end, cache, bs, table, D, c0, 1, last, og, kvr); break;
                    case 2: sums_n(pg, S, 1, end, cache, bs, table, D, c0, 2, last, og, kvr); break;
                    default: sums_n(pg, S, 1, end, cache, bs, table, D, c0, 3, last, og, kvr); break;
                    }
                }
        }
    }
}

/* One work item: n heads of one token (queries q bf16, consecutive rows of D; scores p,
 * rows S apart; outputs o, rows kvr apart) over positions 0 .. end (end >= 1). */
static void attend_group(const uint16_t *q, int n, long D, const uint16_t *cache, long bs,
                         const long *table, long end, float scale, long kvr, float *p, long S,
                         float *o) {
    float qf[GROUP_HEADS * MAX_FEATURES];                /* 32 KB of the thread's stack */
    widen_row(q, n * D, qf);
    group_scores(qf, n, D, cache, bs, table, end, p, S);
    for (int h = 0; h < n; h++) softmax_row(p + h * S, end, scale);
    group_weighted_sum(p, S, n, end, cache, bs, table, D, kvr, o);
}

/* The absorbed attention of a decode window over the latent cache, read in place: query
 * row r of sequence b (window token t = r / heads, heads = R / Q) sees positions 0 ..
 * pos[b, t].  q bf16 [B, R, D], cache bf16 [blocks, bs, D], tables int64 [B, nb], pos int64
 * [B, Q], out float32 [B, R, kvr] = sum_s softmax_s(q . row_s * scale) * row_s[:kvr],
 * p float32 [B, R, nb * bs] scratch.  A work item is a group of one token's heads (MLA's
 * heads share every context row, read once a group). */
void half_attend_paged(const uint16_t *q, long B, long R, long D, const uint16_t *cache, long bs,
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

/* ``half_attend_paged`` on an int8 latent cache (layers/latent_cache.py Int8LatentCache):
 * latent int8 [blocks, bs, L], scale float32 [blocks, bs], rope bf16 [blocks, bs, P], L + P
 * = D.  Every sequence's rows up to its window's largest position are first dequantized
 * as the step's int8_gather does them (bf16(float(q) x scale), rounded to nearest even; the
 * RoPE part as stored) into buf (bf16 [B, nb * bs, D]), then attended over. */
void half_attend_paged_i8(const uint16_t *q, long B, long R, long D, const int8_t *latent,
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
            float sc = scales[slot];
            uint16_t *o = buf + r * D;
            for (long c = 0; c < L; c++) o[c] = bf16_round((float)lq[c] * sc);
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
