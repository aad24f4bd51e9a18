/* The paged latent attention's plain-C parts, shared by its kernels of each ISA
 * (avx512_bf16.c's bf16_attend_paged*, mla_avx2.c's half_attend_paged*): where a position's
 * cache row is, how a window's heads are grouped into work items, and which rows a window's
 * queries can see.  Included by both; kernels/native.py's build tag hashes this header with
 * each source, so an edit here rebuilds them. */
#ifndef MTP_LATENT_PAGED_H
#define MTP_LATENT_PAGED_H

#include <stdint.h>

#define GROUP_HEADS 8     /* most heads a work item scores together */

/* Position s of a sequence: row s % bs of cache block table[s / bs]. */
static inline const uint16_t *cache_row(const uint16_t *cache, long bs, const long *table, long D,
                                        long s) {
    return cache + (table[s / bs] * bs + s % bs) * D;
}

/* Heads a work item takes: enough groups for every thread where the tokens are fewer, of at
 * most GROUP_HEADS heads; returns the number of groups. */
static long head_groups(long heads, long tokens, int threads, long *size) {
    long groups = (heads + GROUP_HEADS - 1) / GROUP_HEADS;
    long want = (threads + tokens - 1) / tokens;
    if (want > groups) groups = want < heads ? want : heads;
    *size = (heads + groups - 1) / groups;
    return (heads + *size - 1) / *size;
}

/* Work item ``item`` of ``groups`` a token (groups of ``size`` of the token's ``heads``): its
 * first query row (token * heads + its first head); *n: its heads. */
static inline long group_rows(long item, long groups, long size, long heads, int *n) {
    long token = item / groups, h0 = item % groups * size;
    *n = (int)(heads - h0 < size ? heads - h0 : size);
    return token * heads + h0;
}

/* Row r of a gathered int8 context (sequence r / S, position r % S; tables [B, nb] of
 * blocks of bs rows, positions pos [B, Q]): its cache slot, or -1 where no query of the
 * sequence's window sees it. */
static inline long visible_slot(long r, long S, const long *pos, long Q, const long *tables, long nb,
                                long bs) {
    long b = r / S, s = r % S, last = 0;
    for (long t = 0; t < Q; t++) last = pos[b * Q + t] > last ? pos[b * Q + t] : last;
    return s > last ? -1 : tables[b * nb + s / bs] * bs + s % bs;
}

#endif
