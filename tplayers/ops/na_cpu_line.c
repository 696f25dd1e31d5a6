/* The 1-D forward on the planes (issue 35; a unit of the kernel's build, see na_cpu.py): windows wider
 * than one vector (na_forward_1d runs the others), one query row and one key row. The queries and
 * the keys are transposed into planes as in na_forward (a block of L queries is one vector, slot b's
 * L keys a shifted load); a chunk's values are packed (column, Dv) once per plane (pack_rows: read
 * in pixel order, which the hardware prefetches: P.V reading them in place stalled on memory in a
 * cold call) and the output is written where it goes (streamed past the caches where it is larger
 * than the L2).
 *   Scores: a 1-D row is a single query row, so na_forward's tiles (MR rows sharing key rows) have
 *   one row each. Here the rows of the register-blocked score kernel (sc_rows in mode 0
 *   with the key vector held in a register) are consecutive blocks instead: in a run of "affine"
 *   blocks (L queries, identity lanes, slot b at key column j0 + rel + b: dilation 1, away from the
 *   borders) block m's slot b reads the key vector at position m L + b of the run, so one shifted
 *   load of position p serves every block whose window holds it (at k33 on 16 lanes 2-3 of them):
 *   super-blocks of SB blocks, their positions cut into intervals read by the same blocks
 *   (line_calls).
 *   Softmax per block (na_cpu_blocks.h's softmax, block_add's mask / bias); 1 / sum scales the
 *   output at its store.
 *   Output: lanes over the value channels, O[query] = sum over slots of the weight (a broadcast
 *   scalar) times the value row; RQ consecutive queries at once in an affine block (query r's slot
 *   j - r is key j of the group: one load of a value row serves RQ queries), each query alone
 *   elsewhere (borders, dilation, stride: keys from the window table). No output plane. */
#include "na_cpu_line.h"

/* the blocks of a call that na_forward_line runs in super-blocks (dims, rows, cols as na_forward's;
 * tests check that path is taken) */
int na_line_blocks(const int64_t *dims, const int32_t *rows, const int32_t *cols) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    Plan pl;
    make_plan(&g, 0, &pl);
    LineRuns lr = line_runs(&g, &pl);
    int count = 0;
    for (int bk = 0; bk < pl.nb; bk++) count += lr.aff[bk];
    line_runs_free(&lr);
    free_plan(&pl);
    return count;
}

/* softmax of block bk's scores s (row 0), in place: the weights; inv[lane]: 1 / their sum (P.V scales the output) */
static void line_softmax(const Geo *g, const Plan *pl, int bk, int h, vt *s, vt *add, T *inv) {
    vt *a = block_add(g, 0, pl->jb[bk], h, pl->blocks + bk, add) ? add : NULL;
    st(inv, softmax(g->nk, s, a));
}

/* na_forward's arguments; 1-D calls (Hq = Hk = kH = 1: the plan's ring of key rows is the one row)
 * with Dv a multiple of the lanes, at most DMAX vectors (na_cpu_plans.forward_line) */
void na_forward_line(const void *q, const void *k, const void *v, const T *table, T *out, const int64_t *dims,
                     const int32_t *rows, const int32_t *cols, double scale, const void *plan, T *scratch, int p0,
                     int p1, int bf, const int64_t *sx) {
    Geo g;
    long sq[4], sk[4], sv[4];
    const Plan pl = open_call(&g, dims, rows, cols, table, scale, plan, sx, sq, sk, sv);
    const int n = g.kw, nkp = g.nkp, ndv = g.Dv / L;
    long pk = (long)g.Hk * g.kp, qw = pl.qw;
    const long *jb = pl.jb;
    T *next = scratch_start(scratch);
    T *kt = carve(&next, g.D * pk), *vp = carve(&next, g.Dv * pk);
    T *qr = carve(&next, MR * g.D * qw);
    memset(qr, 0, sizeof(T) * g.D * qw);
    vt *sbuf = vec_alloc((long)(SB + 2) * nkp), *add = sbuf + (long)SB * nkp;
    T *inv = (T *)(sbuf + (long)(SB + 1) * nkp); /* a block's 1 / sum per lane */
    LineRuns lr = line_runs(&g, &pl);
    /* stream the output past the caches where it is larger than the L2 and its rows are aligned */
    int nt = NA_STREAM && (long)g.B * g.Wq * g.heads * g.Dv * (long)sizeof(T) > l2_bytes() &&
             (uintptr_t)out % NA_VBYTES == 0 && (g.Dv * sizeof(T)) % NA_VBYTES == 0;
    for (int ch = 0; ch < pl.nc; ch++) { /* chunk-major: a chunk's heads while its pixels are in cache */
        for (int pn = p0; pn < p1; pn++) {
            int b = pn / g.heads, h = pn % g.heads;
            long x0 = pl.cx0[ch], jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
            long oe = ((long)b * g.Wq * g.heads + h) * g.Dv, ops = (long)g.heads * g.Dv;
            to_rows_x(k, bf, sk, b, h, 0, g.Hk, g.Wk, x0, pl.cx1[ch] - x0, g.kp, g.D, 1, kt);
            to_rows_x(q, bf, sq, b, h, 0, 1, g.Wq, jlo, jn, qw, g.D, g.scale, qr);
            pack_rows(v, bf, sv, b, h, x0, pl.cx1[ch] - x0, g.Dv, vp); /* the chunk's values, (column, Dv) */
            for (int bk = pl.cb[ch]; bk < pl.cb[ch + 1];) {
                const Lanes *ln = pl.blocks + bk;
                if (!lr.aff[bk]) { /* one block alone: na_forward's tile of one row */
                    const T *xrow[MR] = {qr + jb[bk] - jlo};
                    vt *s[MR] = {sbuf};
                    tile_scores(&g, ln->mode, ln, pl.ur + pl.ustart[0], pl.ur + pl.ustart[1], g.D, xrow, qw, kt, x0,
                                pl.bases + (long)bk * n, s);
                    line_softmax(&g, &pl, bk, h, sbuf, add, inv);
                    pv_lanes((const T *)sbuf, inv, n, ln->n, ndv, cols + jb[bk] * n, vp, -x0 * g.Dv, g.Dv,
                             out + oe + jb[bk] * ops, ops);
                    bk++;
                    continue;
                }
                const LCall *cl;
                int nc, nr = line_run(&lr, bk, pl.cb[ch + 1], n, &cl, &nc);
                const long rel = lr.rel[bk];
                line_scores(cl, nc, g.D, qr + jb[bk] - jlo, qw, kt + jb[bk] + rel - x0, g.kp, sbuf, nkp);
                for (int m = 0; m < nr; m++) {
                    vt *s = sbuf + (long)m * nkp;
                    line_softmax(&g, &pl, bk + m, h, s, add, inv);
                    pv_affine((const T *)s, inv, n, ndv, vp, (jb[bk + m] + rel - x0) * g.Dv, g.Dv,
                              out + oe + jb[bk + m] * ops, ops, nt);
                }
                bk += nr;
            }
        }
    }
#if defined(__SSE2__)
    if (nt) _mm_sfence(); /* the streamed stores before the caller reads the output */
#endif
    line_runs_free(&lr);
    free(sbuf);
}
