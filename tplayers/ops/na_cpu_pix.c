/* The kernels of the pixel routes (see na_cpu_pix.h): a unit of the kernel's build of its own (na_cpu.py
 * compiles the units side by side), so its instantiations compile beside na_cpu.c's, not after them. */
#include "na_cpu_blocks.h"
#include "na_cpu_io.h"
#include "na_cpu_rows.h"
#include "na_cpu_plan.h"
#include "na_cpu_pix.h"

/* a0[d] += w0 x[d] and a1[d] += w1 x[d] for the n channel vectors x of src, each loaded once */
INL void fma_two(const int n, vt *a0, vt *a1, vt w0, vt w1, const T *src) {
#pragma GCC unroll 8
    for (int d = 0; d < n && d < PIXMAX; d++) {
        const vt x = in_reg(ld(src + d * L)); /* GCC would fold the load into both FMAs */
        a0[d] += w0 * x;
        a1[d] += w1 * x;
    }
}

/* a[d] += w x[d] for the n channel vectors x of src */
INL void fma_one(const int n, vt *a, vt w, const T *src) {
#pragma GCC unroll 8
    for (int d = 0; d < n && d < PIXMAX; d++) a[d] += w * ld(src + d * L);
}

/* the key columns of block bk in the key row of Urow u: dk[x] += scale * sum dS[m][a, b][t] q[m][t]
 * and dv[x] += sum P[m][a, b][t] dO[m][t] over the Urow's nu (query row m, slot row a) and the
 * column's (b, t) pairs, PIXK columns at a time (pix_pairs). qrow[m] / grow[m]: the block's first
 * query of row m in q / dO (channels contiguous; lane t at toff[t] / toff[L + t]); dk / dv: the key
 * row's column 0, its pixels px[0] / px[1] elements apart (in the pixel ring: a pixel's nd / ndv
 * vectors, then the next pixel's; in place: the heads' channels between) */
INL void pix_kern(const int nd, const int ndv, const int nu, const Plan *pl, int bk, int kw, const Urow *u,
                  vt *const *ds, vt *const *p, const T *const *qrow, const T *const *grow, const long *toff, T *dk,
                  T *dv, const long *px, T scale) {
    const int *pxg = pl->px.g + 4 * pl->px.s[bk], *pxe = pl->px.e, nx = pl->px.n[bk];
    const T *wd[PIXR], *wp[PIXR], *qm[PIXR], *gm[PIXR];
    for (int j = 0; j < nu; j++) {
        wd[j] = (const T *)(ds[u->m[j]] + u->a[j] * kw);
        wp[j] = (const T *)(p[u->m[j]] + u->a[j] * kw);
        qm[j] = qrow[u->m[j]];
        gm[j] = grow[u->m[j]];
    }
    for (int gi = 0; gi < (nx + PIXK - 1) / PIXK; gi++) {
        const int *gp = pxg + 4 * gi;
        vt ak[2][PIXMAX], av[2][PIXMAX];
#pragma GCC unroll 8
        for (int d = 0; d < PIXMAX; d++) ak[0][d] = av[0][d] = ak[1][d] = av[1][d] = (vt){0};
        for (int e = gp[0]; PIXK == 2 && e < gp[1]; e++) { /* queries reading both columns */
            const int t = pxe[3 * e], o0 = pxe[3 * e + 1], o1 = pxe[3 * e + 2];
            const long qo = toff[t], go = toff[L + t];
#pragma GCC unroll 4
            for (int j = 0; j < nu; j++) {
                fma_two(nd, ak[0], ak[1], splat(wd[j][o0]), splat(wd[j][o1]), qm[j] + qo);
                fma_two(ndv, av[0], av[1], splat(wp[j][o0]), splat(wp[j][o1]), gm[j] + go);
            }
        }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) /* queries reading one of them */
            for (int e = gp[1 + c]; e < gp[2 + c]; e++) {
                const int t = pxe[3 * e], o = pxe[3 * e + 1];
                const long qo = toff[t], go = toff[L + t];
#pragma GCC unroll 4
                for (int j = 0; j < nu; j++) {
                    fma_one(nd, ak[c], splat(wd[j][o]), qm[j] + qo);
                    fma_one(ndv, av[c], splat(wp[j][o]), gm[j] + go);
                }
            }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) {
            if (PIXK * gi + c >= nx) break;
            const long x = pl->px.a[bk] + PIXK * gi + c;
            T *kx = dk + x * px[0], *vx = dv + x * px[1];
#pragma GCC unroll 8
            for (int d = 0; d < nd && d < PIXMAX; d++) st(kx + d * L, ld(kx + d * L) + ak[c][d] * scale);
#pragma GCC unroll 8
            for (int d = 0; d < ndv && d < PIXMAX; d++) st(vx + d * L, ld(vx + d * L) + av[c][d]);
        }
    }
}

/* pix_kern with the channel vectors and the Urow's query rows as constants where common. toff: the
 * lanes' offsets in q (L) and in dO (L) */
HIDDEN void pix_rows(int nd, int ndv, const Plan *pl, int bk, int kw, const Urow *u, vt *const *ds, vt *const *p,
                     const T *const *qrow, const T *const *grow, const long *toff, T *dk, T *dv, const long *px,
                     T scale) {
#define PIX(ND, NDV, NU) pix_kern(ND, NDV, NU, pl, bk, kw, u, ds, p, qrow, grow, toff, dk, dv, px, scale)
#define PIXN(ND, NDV)                                 \
    switch (u->n) {                                   \
        case 1: PIX(ND, NDV, 1); return;              \
        case 2: PIX(ND, NDV, 2); return;              \
        case 3: PIX(ND, NDV, 3); return;              \
        case 4: PIX(ND, NDV, 4); return;              \
        default: PIX(ND, NDV, u->n); return;          \
    }
    if (nd == 2 && ndv == 2) PIXN(2, 2)
    else if (nd == 1 && ndv == 1) PIXN(1, 1)
    else if (nd == 4 && ndv == 4) PIXN(4, 4)
    PIX(nd, ndv, u->n);
#undef PIXN
#undef PIX
}

/* query row i of block bk: o[t] = inv[t] * sum over its window of P[a, b][t] * V[key], from the
 * softmax's exponentials sw (the block's slot vectors), 1 / sums inv and the ring vn; o: the block's
 * first query in the output (pixel stride ost), streamed where nt */
INL void pxf_kern(const int nd, const Geo *g, const PixPairs *pp, int bk, int i, const vt *sw, vt inv, const T *vn,
                  int ring, T *o, long ost, int nt) {
    const int *gp0 = pp->g + 4 * pp->s[bk], *pxe = pp->e, nl = pp->n[bk], kh = g->kh, Dv = nd * L;
    const long wa = (long)g->kw * L; /* the weights of slot row a + 1 follow those of a by wa */
    const T *vr[kh], *w0 = (const T *)sw;
    for (int a = 0; a < kh; a++) vr[a] = vn + (long)(g->rows[i * kh + a] % ring) * g->Wk * Dv;
    for (int gi = 0; gi < (nl + PIXK - 1) / PIXK; gi++) {
        const int *gp = gp0 + 4 * gi;
        vt acc[2][PIXMAX];
#pragma GCC unroll 8
        for (int d = 0; d < PIXMAX; d++) acc[0][d] = acc[1][d] = (vt){0};
        for (int e = gp[0]; PIXK == 2 && e < gp[1]; e++) { /* keys both queries read */
            const long x = (long)pxe[3 * e] * Dv, dy = pxe[3 * e + 2] - pxe[3 * e + 1];
            const T *wx = w0 + pxe[3 * e + 1];
#pragma GCC unroll 2
            for (int a = 0; a < kh; a++, wx += wa) fma_two(nd, acc[0], acc[1], splat(wx[0]), splat(wx[dy]), vr[a] + x);
        }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) /* keys one of them reads */
            for (int e = gp[1 + c]; e < gp[2 + c]; e++) {
                const long x = (long)pxe[3 * e] * Dv;
                const T *wx = w0 + pxe[3 * e + 1];
                for (int a = 0; a < kh; a++, wx += wa) fma_one(nd, acc[c], splat(*wx), vr[a] + x);
            }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) {
            const int t = PIXK * gi + c;
            if (t >= nl) break;
            const vt sc = splat(((const T *)&inv)[t]);
            T *ot = o + t * ost;
#pragma GCC unroll 8
            for (int d = 0; d < nd && d < PIXMAX; d++) {
                if (nt) st_nt(ot + d * L, acc[c][d] * sc);
                else st(ot + d * L, acc[c][d] * sc);
            }
        }
    }
}

HIDDEN void pxf_rows(const Geo *g, const PixPairs *pp, int bk, int i, const vt *sw, vt inv, const T *vn, int ring, int C,
                     T *o, long ost, int nt) {
    const int nd = C / L;
    if (nd == 2) pxf_kern(2, g, pp, bk, i, sw, inv, vn, ring, o, ost, nt);
    else if (nd == 1) pxf_kern(1, g, pp, bk, i, sw, inv, vn, ring, o, ost, nt);
    else if (nd == 4) pxf_kern(4, g, pp, bk, i, sw, inv, vn, ring, o, ost, nt);
    else pxf_kern(nd, g, pp, bk, i, sw, inv, vn, ring, o, ost, nt);
}

