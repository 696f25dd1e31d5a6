/* The 1-D backward on the planes (issue 35; a unit of the kernel's build, see na_cpu.py): windows wider
 * than one vector (na_backward_1d runs the others), one query row and one key row, head dims of whole
 * vectors (na_cpu_plans.backward_line). na_backward's tiles have one query row in 1-D, so its score
 * kernel there runs one row (one key load per FMA); here, as in na_forward_line (na_cpu_line.h):
 *   P and dP: the scores of super-blocks of consecutive affine blocks, each shifted load of a key
 *   (value) vector serving every block whose window holds it (line_calls), Q and dO transposed into
 *   planes; other blocks one at a time (tile_scores, one row).
 *   dS = P (dP - delta) per block (softmax_delta: delta = rowsum(dO * O) from P and dP).
 *   dQ = scale dS K: lanes over the channels, the keys packed (column, D) once per chunk, RQ
 *   consecutive queries sharing each key row load (pv_affine; pv_lanes elsewhere), written in place.
 *   dK += scale dS^T Q, dV += P^T dO: the pixel route on q and dO read in place, added into dK / dV in
 *   place (each key column zeroed before the first chunk reaching it): per super-block (pxl_rows: each
 *   key's sums over all its blocks' queries in registers, one read-modify-write per key and run), per
 *   block for the others (pix_rows, na_cpu_pix.h).
 * 1-D 1x4096 h4 d32 k33 (AVX-512): see benchmarks/RESULTS.md ("fifteenth session"). */
#include "na_cpu_line.h"
#include "na_cpu_pix.h"

/* block bk's gradients from its scores s (P) and dP ds (slot vectors, one row), in place: the weights,
 * dS, then dQ (dq: the block's first query, pixel pitch ops), dK / dV where not aff (pix_rows; dk NULL:
 * not wanted; affine blocks: their super-block's pxl_rows, after all its blocks' weights)
 * and dtable (NULL without a bias). qrow / grow: the block's first query in q (or its widened rows) and
 * in dO, lanes at toff (pix_rows') */
static void line_grads(const Geo *g, const Plan *pl, int bk, int h, int aff, long rel, vt *s, vt *ds, vt *add,
                       const T *kpk, long x0, const T *scl, T *dq, long ops, const T *qrow, const T *grow,
                       const long *toff, T *dk, T *dv, const long *pxs, T *dtable) {
    const Lanes *ln = pl->blocks + bk;
    const int n = g->kw;
    const long jb = pl->jb[bk];
    vt inv = softmax(g->nk, s, block_add(g, 0, jb, h, ln, add) ? add : NULL);
    inv = (vt)((vi)inv & ln->live); /* spare lanes: P = 0, so they add nothing */
    vt dl = softmax_delta(g->nk, s, inv, ds);
    for (int ab = 0; ab < g->nk; ab++) ds[ab] = s[ab] * (ds[ab] - dl);
    if (aff) pv_affine((const T *)ds, scl, n, g->D / L, kpk, (jb + rel - x0) * g->D, g->D, dq, ops, 0);
    else pv_lanes((const T *)ds, scl, n, ln->n, g->D / L, g->cols + jb * n, kpk, -x0 * g->D, g->D, dq, ops);
    if (dk && !aff) {
        const Urow u = {.row = 0, .n = 1, .mask = 1, .m = {0}, .a = {0}};
        vt *dsv[MR] = {ds}, *pv[MR] = {s};
        const T *qp_[MR] = {qrow}, *gp_[MR] = {grow};
        pix_rows(g->D / L, g->Dv / L, pl, bk, n, &u, dsv, pv, qp_, gp_, toff, dk, dv, pxs, g->scale);
    }
    if (dtable) table_grad(g, ln, 0, jb, h, ds, dtable);
}

/* na_backward's arguments and results on 1-D calls (Hq = Hk = kH = 1) whose D and Dv are whole vectors
 * (at most PIXMAX), q and dO with unit channel stride; a backward plan (na_plan with backward 1 or 2:
 * dk / dv NULL) */
void na_backward_line(const T *dout, const int64_t *sd, const void *q, const void *k, const void *v, const T *table,
                      const T *out, T *dq, T *dk, T *dv, T *dtable, const int64_t *dims, const int32_t *rows,
                      const int32_t *cols, double scale, const void *plan, T *scratch, int p0, int p1, int bf,
                      const int64_t *sx) {
    Geo g;
    long sq[4], sk[4], sv[4];
    (void)out;
    const Plan pl = open_call(&g, dims, rows, cols, table, scale, plan, sx, sq, sk, sv);
    const int n = g.kw, nkp = g.nkp;
    const long pk = (long)pl.ring * g.kp, qw = pl.qw, *jb = pl.jb;
    const long pxs[2] = {(long)g.heads * g.D, (long)g.heads * g.Dv}; /* dK / dV in place (pix_rows) */
    T *next = scratch_start(scratch); /* within scratch_of's backward budget (its 1-D term) */
    T *kt = carve(&next, g.D * pk), *vtr = carve(&next, g.Dv * pk), *kpk = carve(&next, g.D * pk);
    T *qr = carve(&next, g.D * qw), *gr = carve(&next, g.Dv * qw), *qn = bf ? carve(&next, g.D * qw) : NULL;
    memset(qr, 0, sizeof(T) * g.D * qw);
    memset(gr, 0, sizeof(T) * g.Dv * qw);
    vt *sbuf = vec_alloc((2L * SB + 1) * nkp + 1), *dsb = sbuf + (long)SB * nkp, *add = sbuf + 2L * SB * nkp;
    T scl[L];
    long toff[2 * L];
    for (int t = 0; t < L; t++) {
        scl[t] = g.scale;
        toff[t] = t * (bf ? g.D : sq[1]);
        toff[L + t] = t * sd[1];
    }
    LineRuns lr = line_runs(&g, &pl);
    long zx = 0; /* dK / dV columns [0, zx) zeroed */
    for (int ch = 0; ch < pl.nc; ch++) { /* chunk-major: a chunk's heads while its pixels are in cache */
        const long x0 = pl.cx0[ch], xn = pl.cx1[ch] - x0, jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
        const long zx1 = ch == pl.nc - 1 ? g.Wk : pl.cx1[ch] > zx ? pl.cx1[ch] : zx;
        for (int pn = p0; pn < p1; pn++) {
            const int b = pn / g.heads, h = pn % g.heads;
            const long oe = ((long)b * g.Wq * g.heads + h) * g.D, ops = (long)g.heads * g.D;
            if (dk) pix_zero(&g, b, h, zx, zx1, dk, dv);
            to_rows_x(k, bf, sk, b, h, 0, 1, g.Wk, x0, xn, g.kp, g.D, 1, kt);
            to_rows_x(v, bf, sv, b, h, 0, 1, g.Wk, x0, xn, g.kp, g.Dv, 1, vtr);
            pack_rows(k, bf, sk, b, h, x0, xn, g.D, kpk); /* dQ's keys, (column, D) */
            to_rows_x(q, bf, sq, b, h, 0, 1, g.Wq, jlo, jn, qw, g.D, g.scale, qr);
            to_rows(dout, sd, b, h, 0, 1, g.Wq, jlo, jn, qw, g.Dv, 1, gr);
            if (qn) pix_widen(q, sq, b, h, 0, g.Wq, jlo, jn, g.D, qn);
            const T *q0 = qn ? qn - jlo * g.D : (const T *)q + b * sq[0] + h * sq[2]; /* query j at q0 + j toff[1] */
            const T *g0 = dout + b * sd[0] + h * sd[2];
            const long qst = qn ? g.D : sq[1];
            T *dkp = dk ? dk + (long)b * g.Wk * pxs[0] + h * g.D : NULL, *dvp = dk ? dv + (long)b * g.Wk * pxs[1] + h * g.Dv : NULL;
#define GRADS(BK, S, DS, AFF, REL)                                                                                   \
    line_grads(&g, &pl, BK, h, AFF, REL, S, DS, add, kpk, x0, scl, dq + oe + jb[BK] * ops, ops, q0 + jb[BK] * qst, \
               g0 + jb[BK] * sd[1], toff, dkp, dvp, pxs, dtable)
            for (int bk = pl.cb[ch]; bk < pl.cb[ch + 1];) {
                if (!lr.aff[bk]) { /* one block alone: na_backward's tile of one row */
                    const Lanes *ln = pl.blocks + bk;
                    const Urow *u0 = pl.ur + pl.ustart[0], *u1 = pl.ur + pl.ustart[1];
                    const T *xrow[MR] = {qr + jb[bk] - jlo}, *grow[MR] = {gr + jb[bk] - jlo};
                    vt *s[MR] = {sbuf}, *d[MR] = {dsb};
                    tile_scores(&g, ln->mode, ln, u0, u1, g.D, xrow, qw, kt, x0, pl.bases + (long)bk * n, s);
                    tile_scores(&g, ln->mode, ln, u0, u1, g.Dv, grow, qw, vtr, x0, pl.bases + (long)bk * n, d);
                    GRADS(bk, sbuf, dsb, 0, 0);
                    bk++;
                    continue;
                }
                const LCall *cl;
                int nc, nr = line_run(&lr, bk, pl.cb[ch + 1], n, &cl, &nc);
                const long kx = jb[bk] + lr.rel[bk] - x0, qx = jb[bk] - jlo;
                line_scores(cl, nc, g.D, qr + qx, qw, kt + kx, g.kp, sbuf, nkp);   /* P: Q . K */
                line_scores(cl, nc, g.Dv, gr + qx, qw, vtr + kx, g.kp, dsb, nkp); /* dP: dO . V */
                for (int m = 0; m < nr; m++) GRADS(bk + m, sbuf + (long)m * nkp, dsb + (long)m * nkp, 1, lr.rel[bk]);
                if (dk) /* the run's dK / dV, each key's sums over the run at once */
                    pxl_rows(g.D / L, g.Dv / L, nr, n, nkp, (const T *)dsb, (const T *)sbuf, q0, qst, g0, sd[1], jb[bk],
                             lr.rel[bk], dkp, dvp, pxs, g.scale);
                bk += nr;
            }
#undef GRADS
        }
        zx = zx1;
    }
    line_runs_free(&lr);
    free(sbuf);
}
