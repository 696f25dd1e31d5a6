/* Neighborhood attention (NATTEN semantics) on one CPU core: the compiled kernel behind
 * tplayers.na2d for fp32 / fp64 CPU tensors (see tplayers/ops/na_cpu.py, which builds this file
 * with the system C compiler, once, into a cache directory, and calls it through ctypes).
 *
 * Compiled once per element type: -DNA_DOUBLE selects double, else float; -DNA_LANES the lanes per
 * vector (the host's register width: AVX-512 16 floats / 8 doubles, AVX2 8 / 4).
 * No torch headers, no intrinsics: GCC vector extensions, lowered to whatever -march offers.
 *
 * Inputs are pixel-major, as tplayers passes them: q (B, Hq*Wq, heads*D), k (B, Hk*Wk, heads*D),
 * v (B, Hk*Wk, heads*Dv); q, k and v may be bf16 in the fp32 build (bf = 1: widened exactly as the
 * transposes read them; everything else, the output and the gradients included, is fp32). Per (batch, head) plane the keys and values are transposed into
 * scratch laid out (row, channel, column), a ring of the rows the tiles read (ring_rows in
 * na_cpu_plan.h; the backward's dK / dV rows leave it for the tensors), the queries one row at a time (the output and dq are
 * written back a row at a time), so that L consecutive queries of one row are one vector, and so are the
 * L keys they meet at one window offset (a shifted load): every score is a vertical FMA, no
 * horizontal sums. The window is the product of a row window and a column window, given as
 * per-dimension tables built by tplayers' geometry code (na_layout.axis_tiles):
 *   rows[3][Hq][kH]: local key row, valid (0/1: causal), bias row index of query row i, slot a;
 *   cols[3][Wq][kW]: the same along the columns.
 * A block is up to L consecutive queries of one row (spare lanes repeat its last query and are
 * never stored). Inside a block, lane t's key column at slot b is base_b + perm[t]: perm is the
 * identity in the interior (a plain load) and a shuffle near the borders (windows shifted inside
 * the image: lanes share keys); a block holds as many queries as one shuffle can serve. Forward
 * keeps nothing but the output; backward computes the softmax again per block (flash-style).
 *
 * Tiles (issue 35): the work unit is a tile of MR query rows x one block. The rows' windows
 * overlap in their key rows, so each key vector is loaded once per tile and multiplied into every
 * row that reads it: register-blocked FMA micro-kernels (na_cpu_rows.h) for S = Q K^T and
 * dP = dO V^T (rows x slots of accumulators), O = P V and dQ = dS K (rows x channels) and the
 * dK / dV sums (rows summed per key vector before its shuffle-add). Only the scores a query
 * needs are computed; the softmax (max, exp, sum) runs over a row's whole window at once (the
 * scores of a tile fit L1/L2). MR follows the ISA's vector registers (4 rows with 32, 3 with 16).
 * Rows whose keys would not stay in the cache (long 1-D rows) run in column chunks: each chunk
 * transposes only its key span (make_plan: a quarter of the L2 size from sysconf).
 * Where the head dims are whole vectors, the backward's dK / dV (and, for 2-D windows over values of
 * 128 bytes a pixel or more, the forward's O = P V) run on the user's layout instead: per key pixel
 * (per query) its channel vectors summed over a broadcast weight per pair (na_cpu_pix.h).
 * 1-D windows of one vector skip the planes: na_forward_1d, na_backward_1d (na_cpu_direct_fwd.c,
 * na_cpu_direct_bwd.c; na_cpu_plans.py); wider 1-D windows run na_forward_line (na_cpu_line.c:
 * blocks of queries as the tile's rows, the values and the output in place). Each .c file is a unit
 * of the build (na_cpu.py compiles them side by side and links them into one library).
 */
#include "na_cpu_blocks.h"
#include "na_cpu_io.h"
#include "na_cpu_rows.h"
#include "na_cpu_kv.h"
#include "na_cpu_plan.h"
#include "na_cpu_keys.h"
#include "na_cpu_pix.h"
#include "na_cpu_probes.h"

/* the plan of a call (dims, rows, cols as na_forward's; backward as na_scratch's), with the
 * backward's fuse tables; built once per shape by the caller (na_cpu.py caches it), freed by
 * na_plan_free */
void *na_plan(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    Plan *pl = malloc(sizeof(Plan));
    make_plan(&g, backward, pl);
    if (backward) {
        pl->shifts = aligned_alloc(_Alignof(vi), sizeof(vi) * 4 * g.kw * pl->nb);
        pl->fused = malloc(sizeof(int) * pl->nb);
        pl->fstart = malloc(sizeof(int) * (pl->nb + 1));
        pl->shix = malloc(sizeof(int) * pl->nb);
        fuse_tables(&g, pl, pl->shifts, pl->shix, pl->fused, pl->fstart, &pl->folds);
        key_blocks(&g, pl);
        if (backward == 1 && pix_shape(&g, pl)) pix_pairs(&g, pl, 1, &pl->px);
        if (pq_shape(&g, pl)) pix_pairs(&g, pl, 0, &pl->pq);
    } else if (pxf_shape(&g, pl))
        pix_pairs(&g, pl, 0, &pl->px);
    ring_rows(&g, pl);
    return pl;
}

void na_plan_free(void *pl) {
    free_plan(pl);
    free(pl);
}

static long scratch_of(const Geo *g, const Plan *pl, int backward) {
    long pk = (long)pl->ring * g->kp, D = g->D, Dv = g->Dv, qw = pl->qw; /* the planes: a ring of rows */
    if (!backward) return PAD + D * pk + PAD + Dv * pk + PAD + MR * D * qw + PAD + MR * Dv * qw + PAD;
    long qp = qw + 2 * pl->kpad; /* the backward's Q and dO rows: padded for key_sums */
    long keys = pl->kpad ? 2 * (MR * g->nk * qp + PAD) : 0;
    long line = g->Hq == 1 && g->Hk == 1 && g->kh == 1 ? D * pk + PAD : 0; /* na_backward_line's packed keys */
    return PAD + D * pk + PAD + Dv * pk + PAD + MR * D * qp + PAD + MR * Dv * qp + PAD + MR * D * qw + PAD + line +
           (backward == 1 ? D * pk + Dv * pk + 2 * PAD + keys + MR * D * qw + PAD : 0) + /* pix_widen's rows */
           (backward && pq_shape(g, pl) ? D * pk + PAD : 0); /* the dQ route's pixel ring of keys */
}

/* the scratch elements of a call on plan pl (na_plan) */
long na_plan_scratch(const int64_t *dims, const void *pl) {
    Geo g = make_geo(dims, NULL, NULL, NULL, 1.0);
    const Plan *p = pl;
    g.kp = p->kp;
    return scratch_of(&g, p, p->backward);
}

/* scratch elements the kernels need (dims as below; the caller allocates them); backward:
 * 0 forward, 1 backward with dk and dv, 2 backward without */
long na_scratch(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    void *pl = na_plan(dims, rows, cols, backward);
    long n = na_plan_scratch(dims, pl);
    na_plan_free(pl);
    return n;
}

/* dims: B, heads, Hq, Wq, Hk, Wk, D, Dv, kH, kW, bias table rows. Planes [p0, p1) of the B*heads (batch-major). */
void na_forward(const void *q, const void *k, const void *v, const T *table, T *out, const int64_t *dims,
                const int32_t *rows, const int32_t *cols, double scale, const void *plan, T *scratch, int p0, int p1,
                int bf, const int64_t *sx) {
    Geo g;
    long sq[4], sk[4], sv[4];
    const Plan pl = open_call(&g, dims, rows, cols, table, scale, plan, sx, sq, sk, sv);
    long rk = (long)pl.ring * g.kp, qw = pl.qw;
    const long *jb = pl.jb;
    const int nt = output_streamed(&g), pxf = pxf_ok(&g, &pl, sv); /* the forward's P V on V's layout */
    T *next = scratch_start(scratch);
    T *kt = carve(&next, g.D * rk), *vtp = carve(&next, g.Dv * rk);
    T *qr = carve(&next, MR * g.D * qw), *orow = carve(&next, MR * g.Dv * qw);
    memset(qr, 0, sizeof(T) * MR * g.D * qw);
    vt *sbuf = vec_alloc(2L * MR * g.nkp + (long)MR * g.Dv), *s[MR], *add[MR], *acc[MR];
    const T **vrow = pxf ? malloc(sizeof(T *) * MR * g.kh) : NULL; /* pxf_ring_rows */
    for (int m = 0; m < MR; m++) {
        s[m] = sbuf + (long)m * g.nkp;
        add[m] = sbuf + (long)(MR + m) * g.nkp;
        acc[m] = sbuf + 2L * MR * g.nkp + (long)m * g.Dv;
    }
    for (int ch = 0; ch < pl.nc; ch++) { /* chunk-major: a chunk's heads while its pixels are in cache */
        for (int pn = p0; pn < p1; pn++) {
            int b = pn / g.heads, h = pn % g.heads;
            long x0 = pl.cx0[ch], jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
            int done = 0, vdone = 0; /* key rows transposed (ring_in_kv), value rows copied (pxf_in) */
            for (int t = 0; t < pl.nt; t++) {
                ring_in_kv(&g, &pl, ch, b, h, &done, pl.upto[t], k, pxf ? NULL : v, bf, sk, sv, kt, vtp, NULL, NULL,
                           NULL, NULL);
                if (pxf) pxf_in(&g, pl.ring, b, h, &vdone, pl.upto[t], v, bf, sv, g.Dv, vtp);
                const int *rowi = pl.order + t * MR;
                int nm = g.Hq - t * MR < MR ? g.Hq - t * MR : MR;
                const Urow *u0 = pl.ur + pl.ustart[t], *u1 = pl.ur + pl.ustart[t + 1];
                if (pxf) pxf_ring_rows(&g, pl.ring, rowi, nm, vtp, g.Dv, vrow);
                for (int m = 0; m < nm; m++)
                    to_rows_x(q, bf, sq, b, h, rowi[m], rowi[m] + 1, g.Wq, jlo, jn, qw, g.D, g.scale, qr + m * g.D * qw);
                for (int bk = pl.cb[ch]; bk < pl.cb[ch + 1]; bk++) {
                    const Lanes *ln = pl.blocks + bk;
                    const long *base = pl.bases + (long)bk * g.kw, jq = jb[bk] - jlo;
                    const T *xrow[MR];
                    vt *a[MR], inv[MR];
                    for (int m = 0; m < nm; m++) {
                        xrow[m] = qr + m * g.D * qw + jq;
                        a[m] = block_add(&g, rowi[m], jb[bk], h, ln, add[m]) ? add[m] : NULL;
                    }
                    tile_scores(&g, ln->mode, ln, u0, u1, g.D, xrow, qw, kt, x0, base, s);
                    for (int m = 0; m < nm; m++) {
                        inv[m] = softmax(g.nk, s[m], a[m]);
                        if (pxf)
                            pxf_rows(&g, &pl.px, bk, s[m], inv[m], vrow + m * g.kh, g.Dv,
                                     out + (((long)b * g.Hq + rowi[m]) * g.Wq + jb[bk]) * g.heads * g.Dv + h * g.Dv,
                                     (long)g.heads * g.Dv, nt);
                        else
                            memset(acc[m], 0, sizeof(vt) * g.Dv);
                    }
                    if (pxf) continue;
                    tile_apply(&g, ln->mode, ln, u0, u1, g.Dv, s, vtp, x0, base, acc);
                    for (int m = 0; m < nm; m++)
                        if (g.Dv % L == 0) /* straight to the output (3-D 16^3 k5 1.05-1.09x, 2-D 1.06x) */
                            out_block(acc[m], inv[m], ln->n, b, h, g.heads, g.Hq, g.Wq, g.Dv, rowi[m], jb[bk], out, nt);
                        else
                            for (int c = 0; c < g.Dv; c++) {
                                vt r = acc[m][c] * inv[m];
                                if (ln->n == L) st(orow + (m * g.Dv + c) * qw + jq, r); /* no memcpy call */
                                else memcpy(orow + (m * g.Dv + c) * qw + jq, &r, ln->n * sizeof(T));
                            }
                }
                for (int m = 0; m < nm && g.Dv % L; m++)
                    from_rows(orow + m * g.Dv * qw, qw, b, h, g.heads, g.Hq, g.Wq, g.Dv, rowi[m], rowi[m] + 1, jlo, jn, 0,
                              out);
            }
        }
    }
    if (nt) nt_fence(); /* the streamed stores before the caller reads the output */
    free(sbuf);
    free(vrow);
}

/* one query row's dK / dV in a block whose slots are too far apart for the two-register sums
 * (unfused): every slot's read-modify-write of a shifted (near borders, shuffled) vector. qrow /
 * grow: the row's Q and dO at pitch rs; off / voff: its keys' offsets in the dK / dV planes.
 * Slots b and b + 1 overlap, so b is the outer loop: an overlapping load comes kH * (D + Dv)
 * stores after the store it overlaps, not right after it (a partial store-to-load forward stalls) */
INL void kv_slots(int mode, const Geo *g, const Lanes *ln, const T *qrow, const T *grow, long rs, const vt *p,
                  const vt *ds, T *dkt, T *dvt, const long *off, const long *voff) {
    for (int b = 0; b < g->kw; b++)
        for (int ab = b; ab < g->nk; ab += g->kw) {
            for (int c = 0; c < g->D; c++)
                kadd(dkt + off[ab] + (long)c * g->kp, ds[ab] * ld(qrow + (long)c * rs), mode, ln);
            for (int c = 0; c < g->Dv; c++)
                kadd(dvt + voff[ab] + (long)c * g->kp, p[ab] * ld(grow + (long)c * rs), mode, ln);
        }
}

/* zeros after column jn of tile row m's Q / dO rows and its key_sums weights (pitch qp, data
 * from kpad): key_sums reads up to kpad columns past them */
static void key_tails(int m, int nk, int D, int Dv, long jn, long qw, long qp, T *qm, T *gm, T *dsk, T *pk_, long kpad) {
    long n = qp - kpad - jn;
    for (int c = 0; c < D; c++) memset(qm + c * qp + jn, 0, n * sizeof(T));
    for (int c = 0; c < Dv; c++) memset(gm + c * qp + jn, 0, n * sizeof(T));
    for (int ab = 0; ab < nk; ab++) {
        memset(dsk + (m * nk + ab) * qp + kpad + jn, 0, n * sizeof(T));
        memset(pk_ + (m * nk + ab) * qp + kpad + jn, 0, n * sizeof(T));
    }
    (void)qw;
}

#define KC 8 /* channels per key_sums pass */
/* key-centric dK (or dV) of key row u->row over a chunk's key columns [x0, x0 + xn): for each
 * vector of L keys, d[c][keys] += sum over the Urow's (query row m, slot row a) and slots b of
 * w[m][a kW + b][queries] * x[m][c][queries], where query = key - relpat[b] (the affine key
 * of the key-centric blocks; the other blocks' weights are zero): plain (unaligned) loads, no
 * shuffles, every key's sum in a register (kv_slots' per-slot read-modify-writes of
 * overlapping vectors stalled on partial store forwards). w: (MR, nk, qp) and x: (MR, C, qp),
 * both with data from column kpad of their rows (zeros around) */
static void key_sums(const Geo *g, const Plan *pl, const Urow *u, const T *w, const T *x, long qp, int C, T *d, long x0,
                     long xn, long jlo) {
    const long *rel = pl->relpat;
    for (int c0 = 0; c0 < C; c0 += KC) {
        long cs[KC];
        for (int q = 0; q < KC; q++) cs[q] = (c0 + q < C ? c0 + q : C - 1) * qp;
        for (long U = 0; U < xn; U += L) {
            vt acc[KC];
#pragma GCC unroll 8
            for (int q = 0; q < KC; q++) acc[q] = (vt){0};
            for (int j = 0; j < u->n; j++) {
                int m = u->m[j];
                const T *wr = w + (m * g->nk + u->a[j] * g->kw) * qp, *xr = x + (long)m * C * qp;
                for (int b = 0; b < g->kw; b++) {
                    long jj = x0 + U - rel[b] - jlo; /* query column of lane 0 (>= -kpad) */
                    vt wv = ld(wr + b * qp + pl->kpad + jj);
#pragma GCC unroll 8
                    for (int q = 0; q < KC; q++) acc[q] += wv * ld(xr + cs[q] + jj);
                }
            }
#pragma GCC unroll 8
            for (int q = 0; q < KC; q++)
                if (c0 + q < C) { /* lanes past the chunk add zeros (into the next row or the pad) */
                    T *dc = d + (c0 + q) * g->kp + U;
                    st(dc, ld(dc) + acc[q]);
                }
        }
    }
}

/* gradients of na_forward: dq, dk and dv (overwritten; dk and dv both NULL: not wanted) and
 * dtable (accumulated; NULL without a bias). dout has element strides sd
 * (batch, pixel, head, channel). */
void na_backward(const T *dout, const int64_t *sd, const void *q, const void *k, const void *v, const T *table,
                 const T *out, T *dq, T *dk, T *dv, T *dtable, const int64_t *dims, const int32_t *rows,
                 const int32_t *cols, double scale, const void *plan, T *scratch, int p0, int p1, int bf,
                 const int64_t *sx) {
    Geo g;
    int kv = dk != NULL;
    long sq[4], sk[4], sv[4];
    (void)out; /* delta = rowsum(dO * O) comes from P and dP (softmax_delta) */
    /* a backward plan (na_plan with backward 1 or 2) */
    const Plan pl = open_call(&g, dims, rows, cols, table, scale, plan, sx, sq, sk, sv);
    long sdo[4] = {sd[0], sd[1], sd[2], sd[3]};
    const int pix = kv && pix_ok(&g, &pl, sq, sdo); /* dK / dV on the user's layout (na_cpu_pix.h) */
    const int pin = pix && pl.nc > 1; /* ... added in place (column chunks), else through the pixel ring */
    const int pq = pq_ok(&g, &pl, sk); /* dQ on the user's layout, over a pixel ring of keys (na_cpu_pix.h) */
    const long pxs[2] = {pin ? (long)g.heads * g.D : g.D, pin ? (long)g.heads * g.Dv : g.Dv}; /* its pixel pitches */
    long pk = (long)pl.ring * g.kp, qw = pl.qw; /* the planes' rows: a ring (ring_in_kv) */
    long kpad = kv && !pix ? pl.kpad : 0, qp = qw + 2 * kpad; /* Q and dO rows: pitch qp, data from kpad */
    const long *jb = pl.jb;
    const int nd = g.D / L, ndv = g.Dv / L;
    long toff[2 * L]; /* pix: lane t's offsets in q and in dO */
    for (int t = 0; t < L; t++) { toff[t] = t * (bf ? g.D : sq[1]); toff[L + t] = t * sdo[1]; }
    T *next = scratch_start(scratch);
    T *kt = carve(&next, g.D * pk), *vtp = carve(&next, g.Dv * pk);
    T *qr0 = carve(&next, MR * g.D * qp), *gr0 = carve(&next, MR * g.Dv * qp), *dqr = carve(&next, MR * g.D * qw);
    T *dkt = kv ? carve(&next, g.D * pk) : NULL, *dvt = kv ? carve(&next, g.Dv * pk) : NULL; /* pix: (ring, Wk, C) */
    T *qn = pix && bf ? carve(&next, MR * g.D * qw) : NULL; /* pix on bf16 q: its rows widened */
    T *kn = pq ? carve(&next, g.D * pk) : NULL; /* pq: (ring, Wk, D) */
    T *dsk = kpad ? carve(&next, MR * g.nk * qp) : NULL, *pk_ = kpad ? carve(&next, MR * g.nk * qp) : NULL;
    T *qr = qr0 + kpad, *gr = gr0 + kpad;
    memset(qr0, 0, sizeof(T) * MR * g.D * qp);
    memset(gr0, 0, sizeof(T) * MR * g.Dv * qp);
    if (kpad) {
        memset(dsk, 0, sizeof(T) * MR * g.nk * qp);
        memset(pk_, 0, sizeof(T) * MR * g.nk * qp);
    }
    long dmax = g.D > g.Dv ? g.D : g.Dv;
    vt *sbuf = vec_alloc(3L * MR * g.nkp + (long)MR * g.D), *p[MR], *ds[MR], *add[MR], *acc[MR];
    for (int m = 0; m < MR; m++) {
        p[m] = sbuf + (long)m * g.nkp;
        ds[m] = sbuf + (long)(MR + m) * g.nkp;
        add[m] = sbuf + (long)(2 * MR + m) * g.nkp;
        acc[m] = sbuf + 3L * MR * g.nkp + (long)m * g.D;
    }
    long *off = malloc(sizeof(long) * 2 * g.nkp), *voff = off + g.nkp;
    const T **vrow = pq ? malloc(sizeof(T *) * MR * g.kh) : NULL; /* pxf_ring_rows */
    const vi *shifts = pl.shifts, *folds = pl.folds;
    const int *fused = pl.fused, *fstart = pl.fstart, *shix = pl.shix;
    (void)dmax;
    long zx = 0; /* pin: key columns [0, zx) cleared */
    for (int ch = 0; ch < pl.nc; ch++) { /* chunk-major, as in na_forward */
        const long zx1 = ch == pl.nc - 1 ? g.Wk : pl.cx1[ch] > zx ? pl.cx1[ch] : zx;
        for (int pn = p0; pn < p1; pn++) {
            int b = pn / g.heads, h = pn % g.heads;
            long x0 = pl.cx0[ch], xn = pl.cx1[ch] - x0, jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
            int done = 0; /* key rows in the ring */
            int pdone = 0, kdone = 0; /* pix, pq: key rows in their rings */
            if (pin) pix_zero(&g, b, h, zx, zx1, dk, dv);
            for (int t = 0; t < pl.nt; t++) {
                if (pix && !pin) pix_in(&g, pl.ring, b, h, &pdone, pl.upto[t], dkt, dvt, dk, dv);
                ring_in_kv(&g, &pl, ch, b, h, &done, pl.upto[t], k, v, bf, sk, sv, kt, vtp, pix ? NULL : dkt,
                           pix ? NULL : dvt, dk, dv);
                if (pq) pxf_in(&g, pl.ring, b, h, &kdone, pl.upto[t], k, bf, sk, g.D, kn);
                const int *rowi = pl.order + t * MR;
                int nm = g.Hq - t * MR < MR ? g.Hq - t * MR : MR;
                const Urow *u0 = pl.ur + pl.ustart[t], *u1 = pl.ur + pl.ustart[t + 1];
                if (pq) pxf_ring_rows(&g, pl.ring, rowi, nm, kn, g.D, vrow);
                for (int m = 0; m < nm; m++) {
                    int i = rowi[m];
                    T *qm = qr + m * g.D * qp, *gm = gr + m * g.Dv * qp;
                    to_rows_x(q, bf, sq, b, h, i, i + 1, g.Wq, jlo, jn, qp, g.D, g.scale, qm);
                    to_rows(dout, sdo, b, h, i, i + 1, g.Wq, jlo, jn, qp, g.Dv, 1, gm);
                    if (kpad) /* key_sums reads past jn: zeros there (a wider chunk's rows were here) */
                        key_tails(m, g.nk, g.D, g.Dv, jn, qw, qp, qm, gm, dsk, pk_, kpad);
                    if (qn) pix_widen(q, sq, b, h, i, g.Wq, jlo, jn, g.D, qn + m * qw * g.D);
                }
                for (int bk = pl.cb[ch]; bk < pl.cb[ch + 1]; bk++) {
                    const Lanes *ln = pl.blocks + bk;
                    const long *base = pl.bases + (long)bk * g.kw, jq = jb[bk] - jlo;
                    const T *xrow[MR], *grow[MR];
                    vt *a[MR];
                    for (int m = 0; m < nm; m++) {
                        xrow[m] = qr + m * g.D * qp + jq;
                        grow[m] = gr + m * g.Dv * qp + jq;
                        a[m] = block_add(&g, rowi[m], jb[bk], h, ln, add[m]) ? add[m] : NULL;
                    }
                    tile_scores(&g, ln->mode, ln, u0, u1, g.D, xrow, qp, kt, x0, base, p);
                    tile_scores(&g, ln->mode, ln, u0, u1, g.Dv, grow, qp, vtp, x0, base, ds); /* dP = dO . V */
                    for (int m = 0; m < nm; m++) {
                        vt inv = softmax(g.nk, p[m], a[m]);
                        inv = (vt)((vi)inv & ln->live); /* spare lanes: P = 0, so they add nothing below */
                        vt dl = softmax_delta(g.nk, p[m], inv, ds[m]);
                        for (int ab = 0; ab < g.nk; ab++) ds[m][ab] = p[m][ab] * (ds[m][ab] - dl);
                        if (pq) /* dQ = scale dS K per query, stored in place (streamed: written once) */
                            pxf_rows(&g, &pl.pq, bk, ds[m], splat(g.scale), vrow + m * g.kh, g.D,
                                     dq + (((long)b * g.Hq + rowi[m]) * g.Wq + jb[bk]) * g.heads * g.D + h * g.D,
                                     (long)g.heads * g.D, 1);
                        else
                            memset(acc[m], 0, sizeof(vt) * g.D);
                    }
                    if (!pq) {
                        tile_apply(&g, ln->mode, ln, u0, u1, g.D, ds, kt, x0, base, acc); /* dQ = dS K */
                        for (int m = 0; m < nm; m++)
                            for (int c = 0; c < g.D; c++) {
                                vt r = acc[m][c] * g.scale;
                                if (ln->n == L) st(dqr + (m * g.D + c) * qw + jq, r);
                                else memcpy(dqr + (m * g.D + c) * qw + jq, &r, ln->n * sizeof(T));
                            }
                    }
                    if (pix) { /* dK += dS^T Q, dV += P^T dO per key pixel, on the user's layout */
                        const T *qp_[MR], *gp_[MR];
                        for (int m = 0; m < nm; m++) {
                            qp_[m] = qn ? qn + (m * qw + jq) * g.D
                                        : (const T *)q + b * sq[0] + ((long)rowi[m] * g.Wq + jb[bk]) * sq[1] + h * sq[2];
                            gp_[m] = dout + b * sdo[0] + ((long)rowi[m] * g.Wq + jb[bk]) * sdo[1] + h * sdo[2];
                        }
                        for (const Urow *u = u0; u < u1; u++) {
                            /* in place: the key row's pixel 0 (u->row is its ring slot: the row is the one its
                             * first pair's query row reads at slot row a), else its slot in the pixel ring */
                            const long kx = pin ? ((long)b * g.Hk + g.rows[rowi[u->m[0]] * g.kh + u->a[0]]) * g.Wk : u->row;
                            pix_rows(nd, ndv, &pl, bk, g.kw, u, ds, p, qp_, gp_, toff,
                                     pin ? dk + kx * pxs[0] + h * g.D : dkt + kx * g.Wk * g.D,
                                     pin ? dv + kx * pxs[1] + h * g.Dv : dvt + kx * g.Wk * g.Dv, pxs, g.scale);
                        }
                    } else if (kv && fused[bk]) { /* dK += dS^T Q, dV += P^T dO: a tile's rows summed per key row */
                        const vi *sh = shifts + 4 * (long)g.kw * shix[bk], *fold = folds + 2 * fstart[bk];
                        int nf = fstart[bk + 1] - fstart[bk];
                        for (const Urow *u = u0; u < u1; u++) {
                            const vt *wk[MR], *wv[MR];
                            const T *rq[MR], *rg[MR];
                            for (int j = 0; j < u->n; j++) {
                                wk[j] = ds[u->m[j]] + u->a[j] * g.kw;
                                wv[j] = p[u->m[j]] + u->a[j] * g.kw;
                                rq[j] = xrow[u->m[j]];
                                rg[j] = grow[u->m[j]];
                            }
                            sl_rows(u->n, g.kw, g.D, wk, rq, qp, sh, dkt + (long)u->row * g.D * g.kp + base[0] - x0, g.kp, nf,
                                    fold, fused[bk] == 2);
                            sl_rows(u->n, g.kw, g.Dv, wv, rg, qp, sh, dvt + (long)u->row * g.Dv * g.kp + base[0] - x0,
                                    g.kp, nf, fold, fused[bk] == 2);
                        }
                    }
                    if (kpad) /* key_sums' weights: this block's P and dS, or zeros (kv_slots adds it) */
                        for (int m = 0; m < nm; m++)
                            for (int ab = 0; ab < g.nk; ab++) {
                                T *wd = dsk + (m * g.nk + ab) * qp + kpad + jq, *wp = pk_ + (m * g.nk + ab) * qp + kpad + jq;
                                if (pl.keyc[bk]) { st(wd, ds[m][ab]); st(wp, p[m][ab]); } /* mode 0: n == L */
                                else { memset(wd, 0, ln->n * sizeof(T)); memset(wp, 0, ln->n * sizeof(T)); }
                            }
                    for (int m = 0; m < nm; m++) {
                        int i = rowi[m];
                        if (kv && !pix && !fused[bk] && !(kpad && pl.keyc[bk])) {
                            key_offsets(&g, i, base, x0, g.D, pl.ring, off);
                            key_offsets(&g, i, base, x0, g.Dv, pl.ring, voff);
                            if (ln->mode == 0)
                                kv_slots(0, &g, ln, xrow[m], grow[m], qp, p[m], ds[m], dkt, dvt, off, voff);
                            else
                                kv_slots(1, &g, ln, xrow[m], grow[m], qp, p[m], ds[m], dkt, dvt, off, voff);
                        }
                        if (dtable) table_grad(&g, ln, i, jb[bk], h, ds[m], dtable);
                    }
                }
                if (kpad) /* dK += dS^T Q, dV += P^T dO of the key-centric blocks, per key row */
                    for (const Urow *u = u0; u < u1; u++) {
                        key_sums(&g, &pl, u, dsk, qr, qp, g.D, dkt + (long)u->row * g.D * g.kp, x0, xn, jlo);
                        key_sums(&g, &pl, u, pk_, gr, qp, g.Dv, dvt + (long)u->row * g.Dv * g.kp, x0, xn, jlo);
                    }
                for (int m = 0; m < nm && !pq; m++)
                    from_rows(dqr + m * g.D * qw, qw, b, h, g.heads, g.Hq, g.Wq, g.D, rowi[m], rowi[m] + 1, jlo, jn, 2, dq);
            }
            if (pix && !pin) pix_end(&g, pl.ring, b, h, pdone, dkt, dvt, dk, dv);
            if (kv && !pix) { /* the rows no tile read (zeros), then the ring's last rows */
                ring_in_kv(&g, &pl, ch, b, h, &done, g.Hk - 1, NULL, NULL, bf, sk, sv, kt, vtp, dkt, dvt, dk, dv);
                ring_out(&g, &pl, ch, b, h, g.Hk > pl.ring ? g.Hk - pl.ring : 0, g.Hk, dkt, dvt, dk, dv);
            }
        }
        zx = zx1;
    }
    nt_fence();
    free(sbuf);
    free(off);
    free(vrow);
}
