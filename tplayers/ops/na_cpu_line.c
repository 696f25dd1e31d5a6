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
#include "na_cpu_blocks.h"
#include "na_cpu_io.h"
#include "na_cpu_rows.h"
#include "na_cpu_plan.h"

#ifndef SB
#define SB 8 /* blocks per super-block of the scores */
#endif
#if NREG == 32
#define RQ_REGS 8
#else
#define RQ_REGS 4
#endif
#define RQ (RQ_REGS < L ? RQ_REGS : L) /* queries per pass of the P.V kernel (RQ x CVN accumulators) */
#define CVN 2 /* value channel vectors per pass */
#ifndef PACK_AHEAD
#define PACK_AHEAD (2 * L) /* value rows ahead that pack_rows requests */
#endif
#ifndef NA_STREAM
#define NA_STREAM 1
#endif

/* one call of the score kernel: positions [p, p + gb) of a super-block, read by blocks m[0..nm) */
typedef struct {
    int p, gb, nm, m[MR];
} LCall;

/* the score calls of a super-block of nr affine blocks with n slots (calls: room for LCALLS(n)
 * entries: every interval has at most SB blocks and as many groups as positions); returns their count */
#define LCALLS(n) (SB * (SB * L + (n)))
static int line_calls(int nr, int n, LCall *calls) {
    int cut[2 * SB + 2], nc = 0, count = 0;
    for (int m = 0; m < nr; m++) { cut[nc++] = m * L; cut[nc++] = m * L + n; }
    for (int x = 1; x < nc; x++) /* insertion sort */
        for (int y = x; y > 0 && cut[y - 1] > cut[y]; y--) { int t = cut[y]; cut[y] = cut[y - 1]; cut[y - 1] = t; }
    for (int x = 0; x + 1 < nc; x++) {
        int p0 = cut[x], p1 = cut[x + 1], ms[SB], nm = 0;
        if (p1 == p0) continue;
        for (int m = 0; m < nr; m++)
            if (m * L <= p0 && p0 < m * L + n) ms[nm++] = m;
        for (int j0 = 0; j0 < nm; j0 += MR) {
            int k = nm - j0 < MR ? nm - j0 : MR, gm = gb_max(k), len = p1 - p0, ng = (len + gm - 1) / gm;
            for (int s = 0, b0 = 0; s < ng; s++) {
                LCall *c = calls + count++;
                c->gb = (len - b0) / (ng - s);
                c->p = p0 + b0;
                c->nm = k;
                for (int j = 0; j < k; j++) c->m[j] = ms[j0 + j];
                b0 += c->gb;
            }
        }
    }
    return count;
}

/* slot offsets 0, 1, ..., GBMAX - 1: a call's gb positions p + b as sc_rows' slots (mode 0) */
static const long LN_POS[GBMAX] = {0, 1, 2, 3, 4, 5, 6, 7};

/* whether block bk is affine: all L lanes its own query, slot b at key column jb + rel + b */
static int line_affine(const Geo *g, const Plan *pl, int bk, long *rel) {
    const Lanes *ln = pl->blocks + bk;
    const long *base = pl->bases + (long)bk * g->kw;
    if (ln->mode != 0 || ln->n != L) return 0;
    for (int b = 1; b < g->kw; b++)
        if (base[b] != base[0] + b) return 0;
    *rel = base[0] - pl->jb[bk];
    return 1;
}

INL vt ldv(const void *x, int bf, long e) { return bf ? ld_h((const uint16_t *)x + e) : ld((const T *)x + e); }

/* x in every lane: one broadcast (splat's 0 + x keeps an add: 0 + -0 is +0; x - 0 is x) */
INL vt bcast(T x) { return x - (vt){0}; }

/* p = x, past the caches where nt (a 64-byte aligned... VBYTES-aligned p): outputs larger than the L2
 * are streamed to memory (no read of the lines they overwrite: a quarter of a cold call's traffic) */
INL void st_out(T *p, vt x, int nt) {
#if defined(__AVX512F__) && NA_VBYTES == 64
    if (nt) {
#ifdef NA_DOUBLE
        _mm512_stream_pd(p, (__m512d)x);
#else
        _mm512_stream_ps(p, (__m512)x);
#endif
        return;
    }
#elif defined(__AVX__) && NA_VBYTES == 32
    if (nt) {
#ifdef NA_DOUBLE
        _mm256_stream_pd(p, (__m256d)x);
#else
        _mm256_stream_ps(p, (__m256)x);
#endif
        return;
    }
#endif
    (void)nt;
    st(p, x);
}

/* rows [x0, x0 + n) of plane (b, h) of x (element strides xs; bf16 when bf) into dst (n, C): the
 * values of a chunk, read once in pixel order */
static void pack_rows(const void *x, int bf, const long *xs, int b, int h, long x0, long n, int C, T *dst) {
    long e = b * xs[0] + h * xs[2] + x0 * xs[1];
    const int es = bf ? 2 : sizeof(T);
    for (long r = 0; r < n; r++, e += xs[1]) {
        const char *ahead = (const char *)x + (e + PACK_AHEAD * xs[1]) * es;
        for (int c = 0; c < C * es; c += 64) __builtin_prefetch(ahead + c); /* every line of the row */
        for (int c = 0; c < C; c += L) st(dst + r * C + c, ldv(x, bf, e + c));
    }
}

/* P.V of queries [t0, t0 + RQ) of an affine block, channel vectors [c0, c0 + nv): query r's slot s is
 * key t0 + r + s of the block (value row e0 + key * ps); w: the n weight vectors (lane = query) */
INL void pv_group(const int nv, const T *w, const T *inv, int n, const T *v, long e0, long ps, int t0, int c0, T *o,
                  long os, int nt) {
    vt acc[RQ][CVN];
#pragma GCC unroll 8
    for (int r = 0; r < RQ; r++)
#pragma GCC unroll 2
        for (int q = 0; q < nv; q++) acc[r][q] = (vt){0};
    const T *pw = w + t0; /* query r, slot s: pw[s L + r] */
    long e = e0 + (long)t0 * ps + (long)c0 * L;
    int j = 0;
    for (; j < RQ - 1; j++, e += ps) { /* ramp up: queries r <= j */
        vt x[CVN];
#pragma GCC unroll 2
        for (int q = 0; q < nv; q++) x[q] = ld(v + e + q * L);
#pragma GCC unroll 8
        for (int r = 0; r < RQ; r++)
            if (r <= j) {
                vt ws = bcast(pw[(j - r) * L + r]);
#pragma GCC unroll 2
                for (int q = 0; q < nv; q++) acc[r][q] += ws * x[q];
            }
    }
    for (; j < n; j++, e += ps) { /* every query */
        vt x[CVN];
#pragma GCC unroll 2
        for (int q = 0; q < nv; q++) x[q] = ld(v + e + q * L);
        const T *pj = pw + (long)j * L;
#pragma GCC unroll 8
        for (int r = 0; r < RQ; r++) {
            vt ws = bcast(pj[r - r * L]);
#pragma GCC unroll 2
            for (int q = 0; q < nv; q++) acc[r][q] += ws * x[q];
        }
    }
    for (; j < n + RQ - 1; j++, e += ps) { /* ramp down: queries r > j - n */
        vt x[CVN];
#pragma GCC unroll 2
        for (int q = 0; q < nv; q++) x[q] = ld(v + e + q * L);
#pragma GCC unroll 8
        for (int r = 0; r < RQ; r++)
            if (r > j - n) {
                vt ws = bcast(pw[(j - r) * L + r]);
#pragma GCC unroll 2
                for (int q = 0; q < nv; q++) acc[r][q] += ws * x[q];
            }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RQ; r++)
#pragma GCC unroll 2
        for (int q = 0; q < nv; q++) st_out(o + (long)(t0 + r) * os + (long)(c0 + q) * L, acc[r][q] * inv[t0 + r], nt);
}

/* P.V of an affine block (n >= RQ): query t's slot s at value row e0 + (t + s) ps */
static void pv_affine(const T *w, const T *inv, int n, int ndv, const T *v, long e0, long ps, T *o, long os, int nt) {
    for (int t0 = 0; t0 < L; t0 += RQ)
        for (int c0 = 0; c0 < ndv; c0 += CVN) {
            if (ndv - c0 >= 2) pv_group(2, w, inv, n, v, e0, ps, t0, c0, o, os, nt);
            else pv_group(1, w, inv, n, v, e0, ps, t0, c0, o, os, nt);
        }
}

/* P.V of any block, one query at a time: lane t (t < nq) reads the value rows of its window's keys
 * ki[t kw + s] (e0 + key ps) */
static void pv_lanes(const T *w, const T *inv, int n, int nq, int ndv, const int32_t *ki, const T *v, long e0, long ps,
                     T *o, long os) {
    for (int t = 0; t < nq; t++) {
        vt acc[2][DMAX];
        for (int q = 0; q < ndv; q++) acc[0][q] = acc[1][q] = (vt){0};
        int s = 0;
        for (; s + 2 <= n; s += 2)
            for (int a = 0; a < 2; a++) {
                vt ws = bcast(w[(s + a) * L + t]);
                long e = e0 + ki[t * n + s + a] * ps;
                for (int q = 0; q < ndv; q++) acc[a][q] += ws * ld(v + e + (long)q * L);
            }
        for (; s < n; s++) {
            vt ws = bcast(w[s * L + t]);
            long e = e0 + ki[t * n + s] * ps;
            for (int q = 0; q < ndv; q++) acc[0][q] += ws * ld(v + e + (long)q * L);
        }
        for (int q = 0; q < ndv; q++) st(o + (long)t * os + (long)q * L, (acc[0][q] + acc[1][q]) * inv[t]);
    }
}

/* the blocks of a call that na_forward_line runs in super-blocks (dims, rows, cols as na_forward's;
 * tests check that path is taken) */
int na_line_blocks(const int64_t *dims, const int32_t *rows, const int32_t *cols) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    Plan pl;
    make_plan(&g, 0, &pl);
    int count = 0;
    long rel;
    for (int bk = 0; bk < pl.nb; bk++) count += g.kw >= RQ && line_affine(&g, &pl, bk, &rel);
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
    T *next = scratch;
    T *kt = carve(&next, g.D * pk), *vp = carve(&next, g.Dv * pk);
    T *qr = carve(&next, MR * g.D * qw);
    memset(qr, 0, sizeof(T) * g.D * qw);
    vt *sbuf = vec_alloc((long)(SB + 2) * nkp), *add = sbuf + (long)SB * nkp;
    T *inv = (T *)(sbuf + (long)(SB + 1) * nkp); /* a block's 1 / sum per lane */
    long *rel = malloc(sizeof(long) * (pl.nb + 1));
    int *aff = malloc(sizeof(int) * (pl.nb + 1));
    for (int bk = 0; bk < pl.nb; bk++) aff[bk] = n >= RQ && line_affine(&g, &pl, bk, rel + bk); /* else alone */
    LCall *calls = malloc(sizeof(LCall) * LCALLS(n)), *full = malloc(sizeof(LCall) * LCALLS(n));
    int nfull = line_calls(SB, n, full);
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
                if (!aff[bk]) { /* one block alone: na_forward's tile of one row */
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
                int nr = 1;
                while (nr < SB && bk + nr < pl.cb[ch + 1] && aff[bk + nr] && rel[bk + nr] == rel[bk]) nr++;
                int nc = nr == SB ? nfull : line_calls(nr, n, calls);
                const LCall *cl = nr == SB ? full : calls;
                const T *kr = kt + jb[bk] + rel[bk] - x0, *qb = qr + jb[bk] - jlo;
                for (int c = 0; c < nc; c++) {
                    const T *qp[MR];
                    vt *sp[MR];
                    for (int j = 0; j < cl[c].nm; j++) {
                        int m = cl[c].m[j];
                        qp[j] = qb + m * L;
                        sp[j] = sbuf + (long)m * nkp + cl[c].p - m * L;
                    }
                    sc_rows(0, cl[c].nm, cl[c].gb, NULL, g.D, qp, qw, kr + cl[c].p, LN_POS, g.kp, sp);
                }
                for (int m = 0; m < nr; m++) {
                    vt *s = sbuf + (long)m * nkp;
                    line_softmax(&g, &pl, bk + m, h, s, add, inv);
                    pv_affine((const T *)s, inv, n, ndv, vp, (jb[bk + m] + rel[bk] - x0) * g.Dv, g.Dv,
                              out + oe + jb[bk + m] * ops, ops, nt);
                }
                bk += nr;
            }
        }
    }
#if defined(__SSE2__)
    if (nt) _mm_sfence(); /* the streamed stores before the caller reads the output */
#endif
    free(calls);
    free(full);
    free(aff);
    free(rel);
    free(sbuf);
}
