/* The 1-D backward on the user's layout, na_backward_1d: a unit of the kernel's build (see
 * na_cpu_direct.h for the algorithm). */
#include "na_cpu_direct.h"

/* the n (<= L) slots' dot products of a (na vectors) with rows kc[s] of plane (b, h) of x (C channels
 * per head), as one vector of slots: products summed over the vectors, then across lanes (unrolled
 * over L: the products stay in registers) */
INL vt slot_dots(const void *x, int bf, const vt *a, const int na, const int32_t *kc, long b, int Wk, int heads, int h,
                 int C, int n) {
    vt p[L];
#pragma GCC unroll 16
    for (int s = 0; s < L; s++) {
        vt acc = {0};
        if (s < n) {
            const long e = ((b * Wk + kc[s]) * heads + h) * C;
#pragma GCC unroll 16
            for (int d = 0; d < na; d++) acc += a[d] * ldx(x, bf, e + (long)d * L);
        }
        p[s] = acc;
    }
    return hsum_tree(p, n);
}

#define GB 4 /* queries whose softmax chains (reductions across lanes, exp) run side by side */

/* one plane's queries (nd, ndv: compile-time where common), GB at a time; see na_backward_1d */
INL void bwd_plane(const T *dout, const int64_t *sd, const void *q, const void *k, const void *v, const T *tab,
                   T *dq, T *dk, T *dv, T *dtab, long b, int h, int heads, int Wq, int Wk, int n, const int nd,
                   const int ndv, T sc, const int32_t *ki, const int32_t *ok, const int32_t *rel, int row_ok, int bf) {
    const int D = nd * L, Dv = ndv * L;
    for (int i0 = 0; i0 < Wq; i0 += GB) {
        const int ng = Wq - i0 < GB ? Wq - i0 : GB;
        vt S[GB], dP[GB], P[GB], dS[GB];
        for (int g = 0; g < ng; g++) { /* scores and dP = dO . V per slot */
            const int i = i0 + g;
            const long qe = ((b * Wq + i) * heads + h) * D, ge = b * sd[0] + i * sd[1] + h * sd[2];
            const int32_t *kc = ki + (long)i * n, *oki = ok + (long)i * n, *rl = rel + (long)i * n;
            vt qv[DMAX], gv[DMAX], add = splat(-INFINITY); /* lanes past n and masked slots: -inf */
#pragma GCC unroll 16
            for (int d = 0; d < nd; d++) qv[d] = ldx(q, bf, qe + (long)d * L) * sc;
#pragma GCC unroll 16
            for (int d = 0; d < ndv; d++) gv[d] = ld(dout + ge + (long)d * L);
            if (row_ok)
                for (int s = 0; s < n; s++)
                    if (oki[s]) add[s] = tab ? tab[rl[s]] : 0;
            S[g] = slot_dots(k, bf, qv, nd, kc, b, Wk, heads, h, D, n) + add;
            dP[g] = slot_dots(v, bf, gv, ndv, kc, b, Wk, heads, h, Dv, n);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GB; g++) /* the softmax and dS = P (dP - sum P dP), chains side by side */
            if (g < ng) {
                vt E = vexp(S[g] - seg_reduce(S[g], L, 0));
                P[g] = E * (1 / seg_reduce(E, L, 1)); /* as the forward: exp times 1 / sum */
                dS[g] = P[g] * (dP[g] - seg_reduce(P[g] * dP[g], L, 1));
            }
        for (int g = 0; g < ng; g++) { /* dQ; dK and dV into the key rows, query after query */
            const int i = i0 + g;
            const long qe = ((b * Wq + i) * heads + h) * D, ge = b * sd[0] + i * sd[1] + h * sd[2];
            const int32_t *kc = ki + (long)i * n, *oki = ok + (long)i * n, *rl = rel + (long)i * n;
            vt acc[DMAX], qv[DMAX], gv[DMAX]; /* q and dO once per query (the dK / dV stores may alias them) */
#pragma GCC unroll 16
            for (int d = 0; d < nd; d++) {
                acc[d] = (vt){0};
                qv[d] = ldx(q, bf, qe + (long)d * L) * sc;
            }
#pragma GCC unroll 16
            for (int d = 0; d < ndv; d++) gv[d] = ld(dout + ge + (long)d * L);
            for (int s = 0; s < n; s++) {
                const long kr = (b * Wk + kc[s]) * heads + h;
                const vt w = splat(dS[g][s]);
#pragma GCC unroll 16
                for (int d = 0; d < nd; d++) acc[d] += w * ldx(k, bf, kr * D + (long)d * L);
                if (!dk) continue;
                const vt pw = splat(P[g][s]);
                T *dkr = dk + kr * D, *dvr = dv + kr * Dv;
#pragma GCC unroll 16
                for (int d = 0; d < nd; d++) st(dkr + d * L, ld(dkr + d * L) + w * qv[d]);
#pragma GCC unroll 16
                for (int d = 0; d < ndv; d++) st(dvr + d * L, ld(dvr + d * L) + pw * gv[d]);
            }
#if NA_VBYTES == 32 /* a 64-byte line is two vectors: streamed whole (st_nt2) */
            int d = 0;
            for (; d + 1 < nd; d += 2) st_nt2(dq + qe + (long)d * L, acc[d] * sc, acc[d + 1] * sc);
            for (; d < nd; d++) st(dq + qe + (long)d * L, acc[d] * sc);
#else
#pragma GCC unroll 16
            for (int d = 0; d < nd; d++) st_nt(dq + qe + (long)d * L, acc[d] * sc);
#endif
            if (dtab)
                for (int s = 0; s < n; s++)
                    if (row_ok && oki[s]) dtab[rl[s]] += dS[g][s];
        }
    }
}

/* gradients of na_forward_1d for planes [p0, p1) of the B * heads (batch-major): dq, dk and dv where
 * they go (dk, dv: this call's planes zeroed first; both NULL: not wanted), dtable accumulated (NULL
 * without a bias). dout: element strides sd (batch, pixel, head; channels contiguous). */
void na_backward_1d(const T *dout, const int64_t *sd, const void *q, const void *k, const void *v, const T *table,
                    T *dq, T *dk, T *dv, T *dtable, const int64_t *dims, const int32_t *rows, const int32_t *cols,
                    double scale, int p0, int p1, int bf) {
    const int heads = (int)dims[1], Wq = (int)dims[3], Wk = (int)dims[5], D = (int)dims[6], Dv = (int)dims[7];
    const int n = (int)dims[9], tw = 2 * n - 1, nd = D / L, ndv = Dv / L;
    const T sc = (T)scale;
    const int32_t *ki = cols, *ok = cols + (long)Wq * n, *rel = cols + 2L * (long)Wq * n;
    const int row_ok = rows[1], row_rel = rows[2];
    for (int pn = p0; pn < p1; pn++) {
        const long b = pn / heads;
        const int h = pn % heads;
        if (dk) /* the plane's rows of dK and dV (vector stores: a memset call per row cost 8% of a k7 call) */
            for (long j = 0; j < Wk; j++) {
                T *dkr = dk + ((b * Wk + j) * heads + h) * D, *dvr = dv + ((b * Wk + j) * heads + h) * Dv;
                for (int d = 0; d < nd; d++) st(dkr + d * L, (vt){0});
                for (int d = 0; d < ndv; d++) st(dvr + d * L, (vt){0});
            }
        const T *tab = table ? table + ((long)h + row_rel) * tw : NULL; /* the bias row: tr = 1 */
        T *dtab = dtable ? dtable + ((long)h + row_rel) * tw : NULL;
#define BWD_PLANE(ND, NDV) \
    bwd_plane(dout, sd, q, k, v, tab, dq, dk, dv, dtab, b, h, heads, Wq, Wk, n, ND, NDV, sc, ki, ok, rel, row_ok, bf)
        if (nd == 2 && ndv == 2) BWD_PLANE(2, 2);
        else if (nd == 1 && ndv == 1) BWD_PLANE(1, 1);
        else if (nd == 4 && ndv == 4) BWD_PLANE(4, 4);
        else BWD_PLANE(nd, ndv);
#undef BWD_PLANE
    }
    nt_fence();
}
