/* What the 1-D kernels on the planes share (included by na_cpu_line.c, the forward, and by
 * na_cpu_line_bwd.c, the backward): the super-blocks of affine blocks whose score calls share key
 * loads (line_calls), the packed rows of a chunk (pack_rows) and the sums over a window of
 * broadcast weights times pixel-major rows (pv_affine, pv_lanes: the forward's P.V, the
 * backward's dQ = dS K). See na_cpu_line.c for the design. */
#ifndef NA_CPU_LINE_H
#define NA_CPU_LINE_H
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

/* a call's super-blocks: the affine blocks (aff[bk], rel[bk]: line_affine, with at least RQ slots;
 * the others run alone), the score calls of a full super-block (full, nfull) and room for a
 * shorter one's (calls); the 1-D forward's and backward's */
typedef struct {
    long *rel;
    int *aff, nfull;
    LCall *calls, *full;
} LineRuns;

static LineRuns line_runs(const Geo *g, const Plan *pl) {
    LineRuns r = {malloc(sizeof(long) * (pl->nb + 1)), malloc(sizeof(int) * (pl->nb + 1)), 0,
                  malloc(sizeof(LCall) * LCALLS(g->kw)), malloc(sizeof(LCall) * LCALLS(g->kw))};
    for (int bk = 0; bk < pl->nb; bk++) r.aff[bk] = g->kw >= RQ && line_affine(g, pl, bk, r.rel + bk);
    r.nfull = line_calls(SB, g->kw, r.full);
    return r;
}

static void line_runs_free(LineRuns *r) {
    free(r->rel);
    free(r->aff);
    free(r->calls);
    free(r->full);
}

/* the super-block from affine block bk (blocks before end, the same rel): its block count; *cl, *nc
 * its score calls */
static int line_run(LineRuns *r, int bk, int end, int n, const LCall **cl, int *nc) {
    int nr = 1;
    while (nr < SB && bk + nr < end && r->aff[bk + nr] && r->rel[bk + nr] == r->rel[bk]) nr++;
    *nc = nr == SB ? r->nfull : line_calls(nr, n, r->calls);
    *cl = nr == SB ? r->full : r->calls;
    return nr;
}

/* a super-block's scores: block m's slot vectors s + m nkp = x . y over C channels, x the first
 * block's queries (channel pitch xs), y the key plane at the run's first key (channel pitch ys) */
static void line_scores(const LCall *cl, int nc, int C, const T *x, long xs, const T *y, long ys, vt *s, long nkp) {
    for (int c = 0; c < nc; c++) {
        const T *qp[MR];
        vt *sp[MR];
        for (int j = 0; j < cl[c].nm; j++) {
            const int m = cl[c].m[j];
            qp[j] = x + m * L;
            sp[j] = s + m * nkp + cl[c].p - m * L;
        }
        sc_rows(0, cl[c].nm, cl[c].gb, NULL, C, qp, xs, y + cl[c].p, LN_POS, ys, sp);
    }
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

#endif
