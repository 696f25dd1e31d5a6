/* The key planes in and out (included by na_cpu.c after na_cpu_plan.h): K / V rows into the ring
 * as the tiles reach them, and the backward's dK / dV of each row out to the dense tensors as it
 * leaves (ring_rows). */
#ifndef NA_CPU_KEYS_H
#define NA_CPU_KEYS_H
#include "na_cpu_plan.h"

/* chunk ch's dK (or dV) plane of (b, h) into x: the columns an earlier chunk wrote are added to,
 * the others written; columns no chunk reads are zeroed (no zero-filled tensor beforehand: the
 * chunks of a long row overlap only by their windows' span) */
static void key_planes_out(const Geo *g, const Plan *pl, int ch, int b, int h, const T *src, int C, T *x, int r0,
                           int r1) { /* rows [r0, r1), src: row r0's */
    long done = 0, x0 = pl->cx0[ch], x1 = pl->cx1[ch]; /* columns [0, done) written by chunks < ch */
    for (int c = 0; c < ch; c++) done = pl->cx1[c] > done ? pl->cx1[c] : done;
    for (long j = done; j < x0; j++) zero_cols(x, b, h, g, C, j, r0, r1);
    long ov = done < x0 ? x0 : done < x1 ? done : x1;
    if (ov > x0) from_rows(src, g->kp, b, h, g->heads, g->Hk, g->Wk, C, r0, r1, x0, ov - x0, 1, x);
    if (x1 > ov) from_rows(src + (ov - x0), g->kp, b, h, g->heads, g->Hk, g->Wk, C, r0, r1, ov, x1 - ov, 2, x);
    if (ch == pl->nc - 1)
        for (long j = x1 > done ? x1 : done; j < g->Wk; j++) zero_cols(x, b, h, g, C, j, r0, r1);
}

/* the backward's dK / dV of key rows [r0, r1) out of their ring slots (row r in slot r % ring) */
static void ring_out(const Geo *g, const Plan *pl, int ch, int b, int h, int r0, int r1, const T *dkt, const T *dvt,
                     T *dk, T *dv) {
    const int R = pl->ring;
    for (int r = r0; r < r1;) {
        int slot = r % R, run = r1 - r < R - slot ? r1 - r : R - slot;
        key_planes_out(g, pl, ch, b, h, dkt + slot * (long)g->D * g->kp, g->D, dk, r, r + run);
        key_planes_out(g, pl, ch, b, h, dvt + slot * (long)g->Dv * g->kp, g->Dv, dv, r, r + run);
        r += run;
    }
}

/* key rows [*done, upto] into the ring (ring_rows): with the backward's dK / dV, each slot's
 * previous row's written out first (no later tile reads it) and zeroed (dkt NULL: the forward, or
 * not wanted); its K and its V transposed (k / v NULL: not, as for rows no tile reads, whose dK / dV
 * are zero, or V in the forward's pixel ring);
 * *done = upto + 1 */
static void ring_in_kv(const Geo *g, const Plan *pl, int ch, int b, int h, int *done, int upto, const void *k,
                       const void *v, int bf, const long *sk, const long *sv, T *kt, T *vt, T *dkt, T *dvt, T *dk, T *dv) {
    const int R = pl->ring;
    const long kr = (long)g->D * g->kp, vr = (long)g->Dv * g->kp;
    while (*done <= upto) {
        int r = *done, slot = r % R, run = upto + 1 - r < R - slot ? upto + 1 - r : R - slot;
        if (dkt) {
            if (r >= R) ring_out(g, pl, ch, b, h, r - R, r - R + run, dkt, dvt, dk, dv); /* the slots' rows */
            memset(dkt + slot * kr, 0, sizeof(T) * run * kr);
            memset(dvt + slot * vr, 0, sizeof(T) * run * vr);
        }
        if (k)
            to_rows_x(k, bf, sk, b, h, r, r + run, g->Wk, pl->cx0[ch], pl->cx1[ch] - pl->cx0[ch], g->kp, g->D, 1,
                      kt + slot * kr);
        if (v)
            to_rows_x(v, bf, sv, b, h, r, r + run, g->Wk, pl->cx0[ch], pl->cx1[ch] - pl->cx0[ch], g->kp, g->Dv, 1,
                      vt + slot * vr);
        *done += run;
    }
}

#endif
