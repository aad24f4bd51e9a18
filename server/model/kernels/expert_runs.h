/* Rows grouped by the expert each goes through, for the int8 kernels' gathered experts
 * (half_avx2.c's int8_rows, avx512_vnni.c's i8_rows): each chosen expert is then read once
 * for all its rows.  Included by both; kernels/native.py's build tag hashes this header
 * with each source, so an edit here rebuilds them. */
#ifndef MTP_EXPERT_RUNS_H
#define MTP_EXPERT_RUNS_H

/* order[0 .. A): the rows 0 .. A sorted by expert[row], stably (insertion sort: a window's
 * rows are few); starts[r]: where the r-th expert's run begins in order, starts[runs] = A.
 * Returns the number of runs. */
static long expert_runs(const long *expert, long A, long *order, long *starts) {
    long runs = 0;
    for (long a = 0; a < A; a++) {
        long i = a;
        for (; i > 0 && expert[order[i - 1]] > expert[a]; i--) order[i] = order[i - 1];
        order[i] = a;
    }
    for (long a = 0; a < A; a++)
        if (a == 0 || expert[order[a]] != expert[order[a - 1]]) starts[runs++] = a;
    starts[runs] = A;
    return runs;
}

#endif
