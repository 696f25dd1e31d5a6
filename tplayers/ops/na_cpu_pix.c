/* The kernels of the pixel routes (see na_cpu_pix.h): a unit of the kernel's build of its own (na_cpu.py
 * compiles the units side by side), so its instantiations compile beside na_cpu.c's, not after them. */
#include "na_cpu_blocks.h"
#include "na_cpu_io.h"
#include "na_cpu_rows.h"
#include "na_cpu_plan.h"
#include "na_cpu_pix.h"

/* a[k][d] += w[k] x[d], k < kx, for the n channel vectors x of src, each loaded once (in a register
 * where several weights use it: GCC would fold the load into every FMA) */
INL void fma_keys(const int n, const int kx, vt (*a)[PIXMAX], const vt *w, const T *src) {
#pragma GCC unroll 8
    for (int d = 0; d < n && d < PIXMAX; d++) {
        const vt x = kx > 1 ? in_reg(ld(src + d * L)) : ld(src + d * L);
#pragma GCC unroll 4
        for (int k = 0; k < kx; k++) a[k][d] += w[k] * x;
    }
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
                fma_keys(nd, 2, ak, (vt[2]){splat(wd[j][o0]), splat(wd[j][o1])}, qm[j] + qo);
                fma_keys(ndv, 2, av, (vt[2]){splat(wp[j][o0]), splat(wp[j][o1])}, gm[j] + go);
            }
        }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) /* queries reading one of them */
            for (int e = gp[1 + c]; e < gp[2 + c]; e++) {
                const int t = pxe[3 * e], o = pxe[3 * e + 1];
                const long qo = toff[t], go = toff[L + t];
#pragma GCC unroll 4
                for (int j = 0; j < nu; j++) {
                    fma_keys(nd, 1, ak + c, (vt[1]){splat(wd[j][o])}, qm[j] + qo);
                    fma_keys(ndv, 1, av + c, (vt[1]){splat(wp[j][o])}, gm[j] + go);
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
#define PIXN(ND, NDV)                                  \
    switch (u->n) {                                    \
        case 1: PIX(ND, NDV, 1); return;               \
        case 2: PIX(ND, NDV, 2); return;               \
        case 3: PIX(ND, NDV, 3); return;               \
        case 4: PIX(ND, NDV, MR > 3 ? 4 : MR); return; \
        default: PIX(ND, NDV, u->n); return;           \
    }
    if (nd == 2 && ndv == 2) PIXN(2, 2)
    else if (nd == 1 && ndv == 1) PIXN(1, 1)
    else if (nd == 4 && ndv == 4) PIXN(4, 4)
    PIX(nd, ndv, u->n);
#undef PIXN
#undef PIX
}

/* a query row's block bk: o[t] = inv[t] * sum over its window of P[a, b][t] * V[key], from the
 * softmax's exponentials sw (the block's slot vectors), 1 / sums inv and the ring's rows of its slot
 * rows vr (pxf_ring_rows); o: the block's first query in the output (pixel stride ost), streamed
 * where nt */
INL void pxf_kern(const int nd, const Geo *g, const PixPairs *pp, int bk, const vt *sw, vt inv, const T *const *vr,
                  T *o, long ost, int nt) {
    const int *gp0 = pp->g + 4 * pp->s[bk], *pxe = pp->e, nl = pp->n[bk], kh = g->kh, Dv = nd * L;
    const long wa = (long)g->kw * L; /* the weights of slot row a + 1 follow those of a by wa */
    const T *w0 = (const T *)sw;
    for (int gi = 0; gi < (nl + PIXK - 1) / PIXK; gi++) {
        const int *gp = gp0 + 4 * gi;
        vt acc[2][PIXMAX];
#pragma GCC unroll 8
        for (int d = 0; d < PIXMAX; d++) acc[0][d] = acc[1][d] = (vt){0};
        for (int e = gp[0]; PIXK == 2 && e < gp[1]; e++) { /* keys both queries read */
            const long x = (long)pxe[3 * e] * Dv, dy = pxe[3 * e + 2] - pxe[3 * e + 1];
            const T *wx = w0 + pxe[3 * e + 1];
#pragma GCC unroll 2
            for (int a = 0; a < kh; a++, wx += wa) fma_keys(nd, 2, acc, (vt[2]){splat(wx[0]), splat(wx[dy])}, vr[a] + x);
        }
#pragma GCC unroll 2
        for (int c = 0; c < PIXK; c++) /* keys one of them reads */
            for (int e = gp[1 + c]; e < gp[2 + c]; e++) {
                const long x = (long)pxe[3 * e] * Dv;
                const T *wx = w0 + pxe[3 * e + 1];
                for (int a = 0; a < kh; a++, wx += wa) fma_keys(nd, 1, acc + c, (vt[1]){splat(*wx)}, vr[a] + x);
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

/* lane c's window start in a group of pattern P (pxa_block), from the first lane's */
#define PXOFF(P, c) (((P) & 1 && (c) > 0) + ((P) >> 1 & 1 && (c) > 1) + ((P) >> 2 & 1 && (c) > 2))

/* one pass of the group of PXQ queries from lane t0 of a block that pxa_kern takes (pattern P),
 * channel vectors [d0, d0 + PXN(nd)): key column s + u for u below PXOFF(P, PXQ - 1) + KW, query t0 + c
 * at slot u - PXOFF(P, c), each value vector loaded once for the group; with KW and P constants,
 * each column's queries are known at compile time (no FMA of a weight outside a window); then
 * o[t] = inv[t] * sum */
INL void pxa_pass(const int nd, const int KW, const int P, const Geo *g, int t0, int d0, long s, const T *w, vt inv,
                  const T *const *vr, T *o, long ost, int nt) {
    const int kh = g->kh, Dv = nd * L, NU = PXOFF(P, PXQ - 1) + KW, ND = PXN(nd);
    vt acc[PXQ][PIXMAX];
#pragma GCC unroll 4
    for (int c = 0; c < PXQ; c++)
#pragma GCC unroll 8
        for (int d = 0; d < ND && d < PIXMAX; d++) acc[c][d] = (vt){0};
    for (int a = 0; a < kh; a++) {
        const T *wr = w + (long)a * KW * L + t0, *vx = vr[a] + s * Dv + d0 * L;
        in_reg_ptr(&vx);
#pragma GCC unroll 16
        for (int u = 0; u < NU; u++) {
            vt wv[PXQ];
#pragma GCC unroll 4
            for (int c = 0; c < PXQ; c++) { /* query t0 + c reads the column at slot b (if in its window) */
                const int b = u - PXOFF(P, c);
                wv[c] = b >= 0 && b < KW ? splat(wr[b * L + c]) : (vt){0};
            }
#pragma GCC unroll 8
            for (int d = 0; d < ND && d < PIXMAX; d++) {
                const vt x = in_reg(ld(vx + (long)u * Dv + d * L));
#pragma GCC unroll 4
                for (int c = 0; c < PXQ; c++)
                    if (u >= PXOFF(P, c) && u - PXOFF(P, c) < KW) acc[c][d] += wv[c] * x; /* compile-time */
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < PXQ; c++) {
        const vt sc = splat(((const T *)&inv)[t0 + c]);
        T *ot = o + (t0 + c) * ost + d0 * L;
#pragma GCC unroll 8
        for (int d = 0; d < ND && d < PIXMAX; d++) {
            if (nt) st_nt(ot + d * L, acc[c][d] * sc);
            else st(ot + d * L, acc[c][d] * sc);
        }
    }
}

/* the group of PXQ queries from lane t0 (pattern P), its channels in passes of PXN(nd) */
INL void pxa_group(const int nd, const int KW, const int P, const Geo *g, const PixPairs *pp, int bk, int t0,
                   const T *w, vt inv, const T *const *vr, T *o, long ost, int nt) {
    const long s = g->cols[(long)(pp->j[bk] + t0) * KW]; /* the group's first key column */
    for (int d0 = 0; d0 < nd; d0 += PXN(nd)) pxa_pass(nd, KW, P, g, t0, d0, s, w, inv, vr, o, ost, nt);
}

/* pxf_kern on a block that pp->f takes (pxa_block): PXQ queries at a time share each value load, the
 * pairs addressed from lane and slot (no tables) */
INL void pxa_kern(const int nd, const int KW, const Geo *g, const PixPairs *pp, int bk, const vt *sw, vt inv,
                  const T *const *vr, T *o, long ost, int nt) {
    const T *w = (const T *)sw;
#define PXG(P) pxa_group(nd, KW, P, g, pp, bk, t0, w, inv, vr, o, ost, nt)
    for (int t0 = 0; t0 < L; t0 += PXQ) {
        const int pat = pp->f[bk] >> (1 + 3 * (t0 / PXQ)) & 7;
        if (pat == PXSTEP) PXG(PXSTEP);
        else if (pat == 0) PXG(0);
        else if (PXALL) switch (pat) {
            case 1: PXG(1); break;
            case 2: PXG(2); break;
            case 3: PXG(3); break;
            case 4: PXG(4); break;
            case 5: PXG(5); break;
            default: PXG(6); break;
        }
    }
#undef PXG
}

HIDDEN void pxf_rows(const Geo *g, const PixPairs *pp, int bk, const vt *sw, vt inv, const T *const *vr, int C, T *o,
                     long ost, int nt) {
    const int nd = C / L;
#define PXA(ND, KW) pxa_kern(ND, KW, g, pp, bk, sw, inv, vr, o, ost, nt)
    if (pp->f[bk] && pxa_dims(g, C)) {
        if (nd == 2) {
            if (g->kw == 7) PXA(2, 7);
            else if (g->kw == 5) PXA(2, 5);
            else PXA(2, 3);
        } else {
            if (g->kw == 7) PXA(4, 7);
            else if (g->kw == 5) PXA(4, 5);
            else PXA(4, 3);
        }
        return;
    }
#undef PXA
    if (nd == 2) pxf_kern(2, g, pp, bk, sw, inv, vr, o, ost, nt);
    else if (nd == 1) pxf_kern(1, g, pp, bk, sw, inv, vr, o, ost, nt);
    else if (nd == 4) pxf_kern(4, g, pp, bk, sw, inv, vr, o, ost, nt);
    else pxf_kern(nd, g, pp, bk, sw, inv, vr, o, ost, nt);
}


/* one query t's terms of keys [x, x + kx) (only those whose slot is in its window where edge) */
INL void pxl_query(const int nd, const int ndv, const int kx, const int edge, int n, long mp, const T *ds, const T *p,
                   const T *q, const T *go, long J, long rel, long t, long x, vt (*ak)[PIXMAX], vt (*av)[PIXMAX]) {
    const long u = t - J, w = (u / L) * mp + (x - rel - t) * L + u % L;
    vt wd[4], wp[4];
#pragma GCC unroll 4
    for (int k = 0; k < kx; k++) {
        const long b = x + k - rel - t;
        const int in = !edge || (b >= 0 && b < n);
        wd[k] = in ? splat(ds[w + k * L]) : (vt){0};
        wp[k] = in ? splat(p[w + k * L]) : (vt){0};
    }
    fma_keys(nd, kx, ak, wd, q);
    fma_keys(ndv, kx, av, wp, go);
}

/* dK / dV of a run of nr affine 1-D blocks (na_backward_line's super-block): query t in [J, J + nr L)
 * reads key t + rel + b for b < n, its weights at ds / p + m nkp L + b L + (t - J) % L (block m =
 * (t - J) / L); dk[x] += scale sum_t dS[t][x] q[t], dv[x] += sum_t P[t][x] dO[t] (q[t] at q0 + t qst,
 * dO[t] at g0 + t gst; key x at dk + x px[0], dv + x px[1]). KX key columns at a time share each
 * query's loads; each key's sums over the whole run stay in registers (one read-modify-write per key
 * and run, not per block) */
INL void pxl_kern(const int nd, const int ndv, const int KX, int nr, int n, long nkp, const T *ds, const T *p,
                  const T *q0, long qst, const T *g0, long gst, long J, long rel, T *dk, T *dv, const long *px,
                  T scale) {
    const long t1 = J + (long)nr * L, xa = J + rel, xb = t1 + rel + n - 1, mp = nkp * L;
    for (long x = xa; x < xb; x += KX) {
        vt ak[4][PIXMAX], av[4][PIXMAX];
#pragma GCC unroll 4
        for (int k = 0; k < KX; k++)
#pragma GCC unroll 8
            for (int d = 0; d < PIXMAX; d++) ak[k][d] = av[k][d] = (vt){0};
        const int kx = xb - x < KX ? (int)(xb - x) : KX;
        const long lo = x - rel - n + 1 > J ? x - rel - n + 1 : J;                   /* key x's first query */
        const long hi = x + kx - 1 - rel < t1 - 1 ? x + kx - 1 - rel : t1 - 1;       /* key x + kx - 1's last */
        const long flo = x + kx - rel - n > lo ? x + kx - rel - n : lo;              /* every key from here */
        const long fhi = x - rel < hi ? x - rel : hi;                                /* ... to here */
        if (kx == KX) {
            long t = lo;
            for (; t < flo && t <= hi; t++) pxl_query(nd, ndv, KX, 1, n, mp, ds, p, q0 + t * qst, g0 + t * gst, J, rel, t, x, ak, av);
            for (; t <= fhi; t++) pxl_query(nd, ndv, KX, 0, n, mp, ds, p, q0 + t * qst, g0 + t * gst, J, rel, t, x, ak, av);
            for (; t <= hi; t++) pxl_query(nd, ndv, KX, 1, n, mp, ds, p, q0 + t * qst, g0 + t * gst, J, rel, t, x, ak, av);
        } else
            for (long t = lo; t <= hi; t++)
                pxl_query(nd, ndv, KX, 1, n, mp, ds, p, q0 + t * qst, g0 + t * gst, J, rel, t, x, ak, av);
#pragma GCC unroll 4
        for (int k = 0; k < KX; k++) {
            if (k >= kx) break;
            T *kp = dk + (x + k) * px[0], *vp = dv + (x + k) * px[1];
#pragma GCC unroll 8
            for (int d = 0; d < nd && d < PIXMAX; d++) st(kp + d * L, ld(kp + d * L) + ak[k][d] * scale);
#pragma GCC unroll 8
            for (int d = 0; d < ndv && d < PIXMAX; d++) st(vp + d * L, ld(vp + d * L) + av[k][d]);
        }
    }
}

/* pxl_kern with the channel vectors and the key columns per pass as constants where common: as many
 * columns as keep 16 accumulators with 32 vector registers, 8 with 16 (1-D 4096 h4 d32 k33 backward
 * with its forward, against the per-block pixel route: AVX-512 1.03-1.06x, AVX2 1.07x; 4 columns over
 * 2 with AVX-512 1.01-1.03x; AVX2 with dK and dV in passes of their own, two columns each, 1.00x) */
HIDDEN void pxl_rows(int nd, int ndv, int nr, int n, long nkp, const T *ds, const T *p, const T *q0, long qst,
                     const T *g0, long gst, long J, long rel, T *dk, T *dv, const long *px, T scale) {
#define PXL(ND, NDV, KX) pxl_kern(ND, NDV, KX, nr, n, nkp, ds, p, q0, qst, g0, gst, J, rel, dk, dv, px, scale)
    if (nd == 2 && ndv == 2) PXL(2, 2, NREG == 32 ? 4 : 2);
    else if (nd == 4 && ndv == 4) PXL(4, 4, NREG == 32 ? 2 : 1);
    else if (nd == 1 && ndv == 1) PXL(1, 1, 4);
    else PXL(nd, ndv, 1);
#undef PXL
}
