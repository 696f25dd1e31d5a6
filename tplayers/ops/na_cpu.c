/* Neighborhood attention (NATTEN semantics) on one CPU core: the compiled kernel behind
 * tplayers.na2d for fp32 / fp64 CPU tensors (see tplayers/ops/na_cpu.py, which builds this file
 * with the system C compiler, once, into a cache directory, and calls it through ctypes).
 *
 * Compiled once per element type: -DNA_DOUBLE selects double, else float; -DNA_LANES the lanes per
 * vector (the host's register width: AVX-512 16 floats / 8 doubles, AVX2 8 / 4).
 * No torch headers, no intrinsics: GCC vector extensions, lowered to whatever -march offers.
 *
 * Inputs are pixel-major, as tplayers passes them: q (B, Hq*Wq, heads*D), k (B, Hk*Wk, heads*D),
 * v (B, Hk*Wk, heads*Dv). Per (batch, head) plane the keys and values are transposed into
 * scratch laid out (row, channel, column), the queries one row at a time (the output and dq are
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
 */
#include "na_cpu_blocks.h"
#include "na_cpu_rows.h"
#include <unistd.h>

/* The work plan of a call: the column blocks of a row (the same for every row), cut into column
 * chunks whose keys stay in cache (see make_plan), and the tiles of MR query rows with their
 * key rows (na_cpu_rows.h). */
typedef struct {
    int nb, nc, nt;
    Lanes *blocks;
    long *bases;
    int *cb;       /* chunk c: blocks [cb[c], cb[c+1]) */
    long *cx0, *cx1; /* chunk c: key columns [cx0, cx1) transposed */
    int *order, *ustart;
    Urow *ur;
    long qw; /* widest chunk in query columns (row buffers' pitch) */
} Plan;

static long l2_bytes(void) {
    long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return n > 0 ? n : 1L << 20;
}

/* Chunks: all columns at once where the key rows a tile reads ((MR + kH - 1) rows of D + Dv
 * channels, twice that in backward with dK / dV) fit half the L2 cache over the whole row (every
 * 2-D benchmark shape); else runs of column blocks whose key span fits it (long 1-D rows: a row of
 * 4096 keys at d32 is 1 MiB, and its transposed planes fell out of L2 before they were read).
 * Sets g->kp, the key planes' pitch, to the widest span. */
static void make_plan(Geo *g, int backward, Plan *pl) {
    pl->blocks = row_blocks(g, &pl->nb, &pl->bases);
    int nb = pl->nb, kw = g->kw;
    pl->cb = malloc(sizeof(int) * (nb + 1));
    pl->cx0 = malloc(sizeof(long) * nb);
    pl->cx1 = malloc(sizeof(long) * nb);
    long nq = g->Hq < MR ? g->Hq : MR, rows = nq + g->kh - 1;
    long col = (rows + nq) * (g->D + g->Dv) * (long)sizeof(T) * (backward ? 2 : 1), budget = l2_bytes() / 4;
    long most = budget / col, jb[nb + 1];
    if (most < 4 * L) most = 4 * L;
    for (int bk = 0, j = 0; bk <= nb; bk++) { jb[bk] = j; if (bk < nb) j += pl->blocks[bk].n; }
    int nc = 0;
    if ((long)g->Wk * col <= budget) {
        pl->cb[0] = 0; pl->cx0[0] = 0; pl->cx1[0] = g->Wk; nc = 1;
    } else
        for (int bk = 0; bk < nb;) {
            long lo = pl->bases[(long)bk * kw], hi = pl->bases[(long)bk * kw + kw - 1] + L;
            int e = bk + 1;
            for (; e < nb; e++) {
                long l2 = pl->bases[(long)e * kw], h2 = pl->bases[(long)e * kw + kw - 1] + L;
                long nlo = l2 < lo ? l2 : lo, nhi = h2 > hi ? h2 : hi;
                if (nhi - nlo > most) break;
                lo = nlo; hi = nhi;
            }
            pl->cb[nc] = bk; pl->cx0[nc] = lo; pl->cx1[nc] = hi < g->Wk ? hi : g->Wk; nc++;
            bk = e;
        }
    pl->cb[nc] = nb;
    pl->nc = nc;
    long sw = 0, qw = 0;
    for (int c = 0; c < nc; c++) {
        sw = pl->cx1[c] - pl->cx0[c] > sw ? pl->cx1[c] - pl->cx0[c] : sw;
        qw = jb[pl->cb[c + 1]] - jb[pl->cb[c]] > qw ? jb[pl->cb[c + 1]] - jb[pl->cb[c]] : qw;
    }
    g->kp = sw;
    pl->qw = qw;
    pl->nt = (g->Hq + MR - 1) / MR;
    pl->order = malloc(sizeof(int) * g->Hq);
    pl->ustart = malloc(sizeof(int) * (pl->nt + 1));
    pl->ur = malloc(sizeof(Urow) * (size_t)g->Hq * g->kh);
    row_order(g, pl->order);
    plan_tiles(g, pl->order, pl->ur, pl->ustart);
}

static void free_plan(Plan *pl) {
    free(pl->blocks); free(pl->bases); free(pl->cb); free(pl->cx0); free(pl->cx1);
    free(pl->order); free(pl->ustart); free(pl->ur);
}

/* first query column of each block: jb[nb + 1] */
static void block_starts(const Plan *pl, long *jb) {
    jb[0] = 0;
    for (int bk = 0; bk < pl->nb; bk++) jb[bk + 1] = jb[bk] + pl->blocks[bk].n;
}

static long scratch_of(const Geo *g, const Plan *pl, int backward) {
    long pk = (long)g->Hk * g->kp, D = g->D, Dv = g->Dv, qw = pl->qw;
    long fwd = D * pk + PAD + Dv * pk + PAD + MR * D * qw + PAD + MR * Dv * qw + PAD;
    if (!backward) return fwd;
    return fwd + MR * Dv * qw + PAD + MR * qw + PAD + MR * D * qw + PAD + (backward == 1 ? D * pk + Dv * pk + 2 * PAD : 0);
}

/* scratch elements the kernels need (dims as below; the caller allocates them); backward:
 * 0 forward, 1 backward with dk and dv, 2 backward without */
long na_scratch(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    Plan pl;
    make_plan(&g, backward, &pl);
    long n = scratch_of(&g, &pl, backward);
    free_plan(&pl);
    return n;
}

/* column chunks of a call's plan (backward as in na_scratch): more than 1 where the rows' keys
 * do not fit the cache budget (tests check that path is taken) */
int na_chunks(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    Plan pl;
    make_plan(&g, backward, &pl);
    int n = pl.nc;
    free_plan(&pl);
    return n;
}

static T *carve(T **next, long n) { T *p = *next; memset(p + n, 0, PAD * sizeof(T)); *next = p + n + PAD; return p; }

static vt *vec_alloc(long n) {
    vt *p = aligned_alloc(_Alignof(vt), sizeof(vt) * (n > 0 ? n : 1));
    memset(p, 0, sizeof(vt) * (n > 0 ? n : 1));
    return p;
}

/* dims: B, heads, Hq, Wq, Hk, Wk, D, Dv, kH, kW, bias table rows. Planes [p0, p1) of the B*heads (batch-major). */
void na_forward(const T *q, const T *k, const T *v, const T *table, T *out, const int64_t *dims,
                const int32_t *rows, const int32_t *cols, double scale, T *scratch, int p0, int p1) {
    Geo g = make_geo(dims, rows, cols, table, scale);
    Plan pl;
    make_plan(&g, 0, &pl);
    long pk = (long)g.Hk * g.kp, qw = pl.qw, sq[4], sk[4], sv[4], jb[pl.nb + 1];
    block_starts(&pl, jb);
    dense_strides(g.Hq, g.Wq, g.heads, g.D, sq);
    dense_strides(g.Hk, g.Wk, g.heads, g.D, sk);
    dense_strides(g.Hk, g.Wk, g.heads, g.Dv, sv);
    T *next = scratch;
    T *kt = carve(&next, g.D * pk), *vtp = carve(&next, g.Dv * pk);
    T *qr = carve(&next, MR * g.D * qw), *orow = carve(&next, MR * g.Dv * qw);
    memset(qr, 0, sizeof(T) * MR * g.D * qw);
    vt *sbuf = vec_alloc(2L * MR * g.nkp + (long)MR * g.Dv), *s[MR], *add[MR], *acc[MR];
    for (int m = 0; m < MR; m++) {
        s[m] = sbuf + (long)m * g.nkp;
        add[m] = sbuf + (long)(MR + m) * g.nkp;
        acc[m] = sbuf + 2L * MR * g.nkp + (long)m * g.Dv;
    }
    for (int pn = p0; pn < p1; pn++) {
        int b = pn / g.heads, h = pn % g.heads;
        for (int ch = 0; ch < pl.nc; ch++) {
            long x0 = pl.cx0[ch], jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
            to_rows(k, sk, b, h, 0, g.Hk, g.Wk, x0, pl.cx1[ch] - x0, g.kp, g.D, 1, kt);
            to_rows(v, sv, b, h, 0, g.Hk, g.Wk, x0, pl.cx1[ch] - x0, g.kp, g.Dv, 1, vtp);
            for (int t = 0; t < pl.nt; t++) {
                const int *rowi = pl.order + t * MR;
                int nm = g.Hq - t * MR < MR ? g.Hq - t * MR : MR;
                const Urow *u0 = pl.ur + pl.ustart[t], *u1 = pl.ur + pl.ustart[t + 1];
                for (int m = 0; m < nm; m++)
                    to_rows(q, sq, b, h, rowi[m], rowi[m] + 1, g.Wq, jlo, jn, qw, g.D, g.scale, qr + m * g.D * qw);
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
                        memset(acc[m], 0, sizeof(vt) * g.Dv);
                    }
                    tile_apply(&g, ln->mode, ln, u0, u1, g.Dv, s, vtp, x0, base, acc);
                    for (int m = 0; m < nm; m++)
                        for (int c = 0; c < g.Dv; c++) {
                            vt r = acc[m][c] * inv[m];
                            memcpy(orow + (m * g.Dv + c) * qw + jq, &r, ln->n * sizeof(T));
                        }
                }
                for (int m = 0; m < nm; m++)
                    from_rows(orow + m * g.Dv * qw, qw, b, h, g.heads, g.Hq, g.Wq, g.Dv, rowi[m], rowi[m] + 1, jlo, jn, 0,
                              out);
            }
        }
    }
    free(sbuf);
    free_plan(&pl);
}

/* the rest of one query row's dK / dV in a block, beyond the row-blocked shuffle sums: with sh
 * (fused), the lanes that share a key with an earlier lane (borders: ex, count then (lane, key
 * lane) pairs) one by one; without (slots too far apart for two registers), every slot's
 * read-modify-write of a shifted (near borders, shuffled) vector. qrow / grow: the row's Q and dO
 * at pitch rs; off / voff: its keys' offsets in the dK / dV planes. */
INL void kv_rest(int mode, const Geo *g, const Lanes *ln, const T *qrow, const T *grow, long rs, const vt *p,
                 const vt *ds, T *dkt, T *dvt, const long *off, const long *voff, int fused, const int *ex,
                 const long *rb) {
    if (fused) {
        int dense = g->kw <= L;
        for (int b = 0; b < g->kw; b++) dense &= rb[b] == b;
        for (int e = 0; e < ex[0]; e++) {
            int t = ex[1 + 2 * e], u = ex[2 + 2 * e];
            for (int a = 0; a < g->kh; a++) {
                const T *dsa = (const T *)(ds + a * g->kw), *pa = (const T *)(p + a * g->kw);
                if (dense) { /* slots at consecutive columns: one vector over the slots */
                    vt dsx = {0}, px = {0};
                    for (int b = 0; b < g->kw; b++) { dsx[b] = dsa[b * L + t]; px[b] = pa[b * L + t]; }
                    for (int c = 0; c < g->D; c++) {
                        T *d = dkt + off[a * g->kw] + (long)c * g->kp + u;
                        st(d, ld(d) + dsx * qrow[(long)c * rs + t]);
                    }
                    for (int c = 0; c < g->Dv; c++) {
                        T *d = dvt + voff[a * g->kw] + (long)c * g->kp + u;
                        st(d, ld(d) + px * grow[(long)c * rs + t]);
                    }
                    continue;
                }
                for (int c = 0; c < g->D; c++) {
                    T x = qrow[(long)c * rs + t], *d = dkt + off[a * g->kw] + (long)c * g->kp + u;
                    for (int b = 0; b < g->kw; b++) d[rb[b]] += dsa[b * L + t] * x;
                }
                for (int c = 0; c < g->Dv; c++) {
                    T x = grow[(long)c * rs + t], *d = dvt + voff[a * g->kw] + (long)c * g->kp + u;
                    for (int b = 0; b < g->kw; b++) d[rb[b]] += pa[b * L + t] * x;
                }
            }
        }
        return;
    }
    /* slots b and b + 1 overlap, so b is the outer loop: an overlapping load comes kH * (D + Dv)
     * stores after the store it overlaps, not right after it (a partial store-to-load forward stalls) */
    for (int b = 0; b < g->kw; b++)
        for (int ab = b; ab < g->nk; ab += g->kw) {
            for (int c = 0; c < g->D; c++)
                kadd(dkt + off[ab] + (long)c * g->kp, ds[ab] * ld(qrow + (long)c * rs), mode, ln);
            for (int c = 0; c < g->Dv; c++)
                kadd(dvt + voff[ab] + (long)c * g->kp, p[ab] * ld(grow + (long)c * rs), mode, ln);
        }
}

/* dtable[h] += dS of query row i's block at j0 (its n live lanes) */
static void table_grad(const Geo *g, const Lanes *ln, int i, long j0, int h, const vt *ds, T *dtable) {
    const int32_t *rr = g->rows + 2 * g->Hq * g->kh, *rc = g->cols + 2 * g->Wq * g->kw;
    T *tab = dtable + (size_t)h * g->tr * g->tw;
    for (int ab = 0; ab < g->nk; ab++) {
        int ra = rr[i * g->kh + ab / g->kw] * g->tw, b = ab % g->kw;
        for (int t = 0; t < ln->n; t++) tab[ra + rc[(j0 + t) * g->kw + b]] += ds[ab][t];
    }
}

/* per block: fused[bk] when its kW slots' keys lie within 2L columns of slot 0's base, then per
 * slot the two shuffle masks (first lane of each key: shifts, 2 kW per block) and the lanes sharing
 * a key with an earlier one (extra, 2L + 1 per block); rshift: slot b's base minus slot 0's */
static void fuse_tables(const Geo *g, const Plan *pl, vi *shifts, int *fused, int *extra, long *rshift) {
    for (int bk = 0; bk < pl->nb; bk++) {
        const long *base = pl->bases + (long)bk * g->kw;
        const Lanes *ln = pl->blocks + bk;
        int first[L], *ex = extra + (2 * L + 1) * bk, maxp = 0;
        for (int u = 0; u < L; u++) first[u] = -1;
        ex[0] = 0;
        for (int t = 0; t < ln->n; t++) {
            int u = ln->perm[t];
            maxp = u > maxp ? u : maxp;
            if (first[u] < 0) first[u] = t;
            else { ex[1 + 2 * ex[0]] = t; ex[2 + 2 * ex[0]] = u; ex[0]++; }
        }
        fused[bk] = 1;
        for (int b = 0; b < g->kw; b++) {
            long r = base[b] - base[0];
            rshift[(long)bk * g->kw + b] = r;
            if (r < 0 || r + maxp >= 2 * L) { fused[bk] = 0; break; }
            for (int u = 0; u < L; u++) {
                long lo = u - r, hi = u + L - r;
                shifts[2 * (long)bk * g->kw + 2 * b][u] = lo >= 0 && lo < L && first[lo] >= 0 ? first[lo] : L;
                shifts[2 * (long)bk * g->kw + 2 * b + 1][u] = hi >= 0 && hi < L && first[hi] >= 0 ? first[hi] : L;
            }
        }
    }
}

/* gradients of na_forward: dq (overwritten), dk and dv (accumulated: the caller zeroes them; both
 * NULL: not wanted) and dtable (accumulated; NULL without a bias). dout has element strides sd
 * (batch, pixel, head, channel). */
void na_backward(const T *dout, const int64_t *sd, const T *q, const T *k, const T *v, const T *table, const T *out,
                 T *dq, T *dk, T *dv, T *dtable, const int64_t *dims, const int32_t *rows, const int32_t *cols,
                 double scale, T *scratch, int p0, int p1) {
    Geo g = make_geo(dims, rows, cols, table, scale);
    int kv = dk != NULL;
    Plan pl;
    make_plan(&g, kv ? 1 : 2, &pl);
    long pk = (long)g.Hk * g.kp, qw = pl.qw, jb[pl.nb + 1], sq[4], sk[4], sv[4], so[4];
    long sdo[4] = {sd[0], sd[1], sd[2], sd[3]};
    block_starts(&pl, jb);
    dense_strides(g.Hq, g.Wq, g.heads, g.D, sq);
    dense_strides(g.Hk, g.Wk, g.heads, g.D, sk);
    dense_strides(g.Hk, g.Wk, g.heads, g.Dv, sv);
    dense_strides(g.Hq, g.Wq, g.heads, g.Dv, so);
    T *next = scratch;
    T *kt = carve(&next, g.D * pk), *vtp = carve(&next, g.Dv * pk);
    T *qr = carve(&next, MR * g.D * qw), *orow = carve(&next, MR * g.Dv * qw);
    T *gr = carve(&next, MR * g.Dv * qw), *delta = carve(&next, MR * qw), *dqr = carve(&next, MR * g.D * qw);
    T *dkt = kv ? carve(&next, g.D * pk) : NULL, *dvt = kv ? carve(&next, g.Dv * pk) : NULL;
    memset(qr, 0, sizeof(T) * MR * g.D * qw);
    memset(gr, 0, sizeof(T) * MR * g.Dv * qw);
    memset(delta, 0, sizeof(T) * MR * qw);
    long dmax = g.D > g.Dv ? g.D : g.Dv;
    vt *sbuf = vec_alloc(3L * MR * g.nkp + (long)MR * g.D), *p[MR], *ds[MR], *add[MR], *acc[MR];
    for (int m = 0; m < MR; m++) {
        p[m] = sbuf + (long)m * g.nkp;
        ds[m] = sbuf + (long)(MR + m) * g.nkp;
        add[m] = sbuf + (long)(2 * MR + m) * g.nkp;
        acc[m] = sbuf + 3L * MR * g.nkp + (long)m * g.D;
    }
    long *off = malloc(sizeof(long) * 2 * g.nkp), *voff = off + g.nkp;
    vi *shifts = aligned_alloc(_Alignof(vi), sizeof(vi) * 2 * g.kw * pl.nb);
    int *fused = malloc(sizeof(int) * pl.nb), *extra = malloc(sizeof(int) * (2 * L + 1) * pl.nb);
    long *rshift = malloc(sizeof(long) * g.kw * pl.nb);
    fuse_tables(&g, &pl, shifts, fused, extra, rshift);
    (void)dmax;
    for (int pn = p0; pn < p1; pn++) {
        int b = pn / g.heads, h = pn % g.heads;
        for (int ch = 0; ch < pl.nc; ch++) {
            long x0 = pl.cx0[ch], xn = pl.cx1[ch] - x0, jlo = jb[pl.cb[ch]], jn = jb[pl.cb[ch + 1]] - jlo;
            to_rows(k, sk, b, h, 0, g.Hk, g.Wk, x0, xn, g.kp, g.D, 1, kt);
            to_rows(v, sv, b, h, 0, g.Hk, g.Wk, x0, xn, g.kp, g.Dv, 1, vtp);
            if (kv) {
                memset(dkt, 0, g.D * pk * sizeof(T));
                memset(dvt, 0, g.Dv * pk * sizeof(T));
            }
            for (int t = 0; t < pl.nt; t++) {
                const int *rowi = pl.order + t * MR;
                int nm = g.Hq - t * MR < MR ? g.Hq - t * MR : MR;
                const Urow *u0 = pl.ur + pl.ustart[t], *u1 = pl.ur + pl.ustart[t + 1];
                for (int m = 0; m < nm; m++) {
                    int i = rowi[m];
                    T *qm = qr + m * g.D * qw, *gm = gr + m * g.Dv * qw, *om = orow + m * g.Dv * qw, *dl = delta + m * qw;
                    to_rows(q, sq, b, h, i, i + 1, g.Wq, jlo, jn, qw, g.D, g.scale, qm);
                    to_rows(dout, sdo, b, h, i, i + 1, g.Wq, jlo, jn, qw, g.Dv, 1, gm);
                    to_rows(out, so, b, h, i, i + 1, g.Wq, jlo, jn, qw, g.Dv, 1, om);
                    for (int j = 0; j < jn; j++) dl[j] = 0; /* rowsum(dO * O) */
                    for (int c = 0; c < g.Dv; c++)
                        for (int j = 0; j < jn; j++) dl[j] += gm[c * qw + j] * om[c * qw + j];
                }
                for (int bk = pl.cb[ch]; bk < pl.cb[ch + 1]; bk++) {
                    const Lanes *ln = pl.blocks + bk;
                    const long *base = pl.bases + (long)bk * g.kw, jq = jb[bk] - jlo;
                    const T *xrow[MR], *grow[MR];
                    vt *a[MR];
                    for (int m = 0; m < nm; m++) {
                        xrow[m] = qr + m * g.D * qw + jq;
                        grow[m] = gr + m * g.Dv * qw + jq;
                        a[m] = block_add(&g, rowi[m], jb[bk], h, ln, add[m]) ? add[m] : NULL;
                    }
                    tile_scores(&g, ln->mode, ln, u0, u1, g.D, xrow, qw, kt, x0, base, p);
                    tile_scores(&g, ln->mode, ln, u0, u1, g.Dv, grow, qw, vtp, x0, base, ds); /* dP = dO . V */
                    for (int m = 0; m < nm; m++) {
                        vt inv = softmax(g.nk, p[m], a[m]);
                        inv = (vt)((vi)inv & ln->live); /* spare lanes: P = 0, so they add nothing below */
                        vt dl = ld(delta + m * qw + jq);
                        for (int ab = 0; ab < g.nk; ab++) {
                            p[m][ab] *= inv;
                            ds[m][ab] = p[m][ab] * (ds[m][ab] - dl);
                        }
                        memset(acc[m], 0, sizeof(vt) * g.D);
                    }
                    tile_apply(&g, ln->mode, ln, u0, u1, g.D, ds, kt, x0, base, acc); /* dQ = dS K */
                    for (int m = 0; m < nm; m++)
                        for (int c = 0; c < g.D; c++) {
                            vt r = acc[m][c] * g.scale;
                            memcpy(dqr + (m * g.D + c) * qw + jq, &r, ln->n * sizeof(T));
                        }
                    if (kv && fused[bk]) { /* dK += dS^T Q, dV += P^T dO: a tile's rows summed per key row */
                        const vi *sh = shifts + 2 * (long)g.kw * bk;
                        for (const Urow *u = u0; u < u1; u++) {
                            const vt *wk[MR], *wv[MR];
                            const T *rq[MR], *rg[MR];
                            for (int j = 0; j < u->n; j++) {
                                wk[j] = ds[u->m[j]] + u->a[j] * g.kw;
                                wv[j] = p[u->m[j]] + u->a[j] * g.kw;
                                rq[j] = xrow[u->m[j]];
                                rg[j] = grow[u->m[j]];
                            }
                            sl_rows(u->n, g.kw, g.D, wk, rq, qw, sh, dkt + (long)u->row * g.D * g.kp + base[0] - x0, g.kp);
                            sl_rows(u->n, g.kw, g.Dv, wv, rg, qw, sh, dvt + (long)u->row * g.Dv * g.kp + base[0] - x0,
                                    g.kp);
                        }
                    }
                    for (int m = 0; m < nm; m++) {
                        int i = rowi[m];
                        if (kv && (!fused[bk] || extra[(2 * L + 1) * bk] > 0)) {
                            key_offsets(&g, i, base, x0, g.D, off);
                            key_offsets(&g, i, base, x0, g.Dv, voff);
                            if (ln->mode == 0)
                                kv_rest(0, &g, ln, xrow[m], grow[m], qw, p[m], ds[m], dkt, dvt, off, voff, fused[bk],
                                        extra + (2 * L + 1) * bk, rshift + (long)bk * g.kw);
                            else
                                kv_rest(1, &g, ln, xrow[m], grow[m], qw, p[m], ds[m], dkt, dvt, off, voff, fused[bk],
                                        extra + (2 * L + 1) * bk, rshift + (long)bk * g.kw);
                        }
                        if (dtable) table_grad(&g, ln, i, jb[bk], h, ds[m], dtable);
                    }
                }
                for (int m = 0; m < nm; m++)
                    from_rows(dqr + m * g.D * qw, qw, b, h, g.heads, g.Hq, g.Wq, g.D, rowi[m], rowi[m] + 1, jlo, jn, 0, dq);
            }
            if (kv) {
                from_rows(dkt, g.kp, b, h, g.heads, g.Hk, g.Wk, g.D, 0, g.Hk, x0, xn, pl.nc > 1, dk);
                from_rows(dvt, g.kp, b, h, g.heads, g.Hk, g.Wk, g.Dv, 0, g.Hk, x0, xn, pl.nc > 1, dv);
            }
        }
    }
    free(sbuf);
    free(off);
    free(shifts);
    free(fused);
    free(extra);
    free(rshift);
    free_plan(&pl);
}
