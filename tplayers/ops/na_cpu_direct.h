/* The 1-D forward and backward on the user's layout (issue 35; included by na_cpu.c after
 * na_cpu_io.h): q, k, v read where they lie, (B, L, heads, D) (D, Dv multiples of the lanes), the output written where
 * it goes; no planes, no transposes. Per query (all heads in turn: the pixel's heads are adjacent
 * in memory) the window's keys are rows of heads*D elements, one vector per L channels:
 *   scores: per slot a vector of channel products (q times the key, summed over the channel
 *   vectors), then L such vectors summed across their lanes at once (hsum_tree: log2(L) rounds of
 *   two shuffles and an add, transpose_tile's masks), giving one vector of L slots' scores;
 *   softmax over the window's slots (vexp on whole vectors, -inf on invalid slots and spare lanes);
 *   output: sum over slots of the weight (a broadcast) times the value vectors, times 1 / sum.
 * Same window tables (cols), scale (multiplies q) and bias indexing as na_forward.
 * Backward (na_backward_1d), per (batch, head) plane and query: the scores and dP = dO . V again
 * as one vector of slots each (two trees), the softmax, delta = sum P dP (= dO . O), dS = P (dP -
 * delta); dQ = scale sum dS K (broadcast weights) stored where it goes; dK += dS scale q and dV +=
 * P dO added into the key rows in place (a plane's keys stay in cache while its queries pass). */
#ifndef NA_CPU_DIRECT_H
#define NA_CPU_DIRECT_H
#include "na_cpu_io.h"

#define DMAX 16 /* channel vectors per row at most (D <= 16 L); the caller checks */
#define MAX_DIRECT_SLOTS 256 /* window slots at most (the kernel's MAX_KERNEL is 255) */

/* p[0..L): lane t of the result is the sum of p[t]'s lanes (p is overwritten; p[live..L) are
 * zero): round s adds p[j] and p[j + s] (j < s) lane-pairwise, the lanes with bit s set carrying
 * p[j + s]'s sums; L - 1 pair sums at most, fewer where inputs are zero */
INL vt hsum_tree(vt *p, int live) {
#if defined(__clang__) || !defined(NROUNDS)
    vt r;
    for (int t = 0; t < L; t++) {
        T s = 0;
        for (int u = 0; u < L; u++) s += p[t][u];
        r[t] = s;
    }
    (void)live;
    return r;
#else
#pragma GCC unroll 8
    for (int k = 0; k < NROUNDS; k++) {
        const int s = (L / 2) >> k;
        vi ma = TMASK_A[k], mb = TMASK_B[k];
#pragma GCC unroll 16
        for (int j = 0; j < s; j++)
            if (j < live) p[j] = __builtin_shuffle(p[j], p[j + s], ma) + __builtin_shuffle(p[j], p[j + s], mb);
        live = live < s ? live : s;
    }
    return p[0];
#endif
}

INL vt ldx(const void *x, int bf, long e) { return bf ? ld_h((const uint16_t *)x + e) : ld((const T *)x + e); }

/* lane j ^ s: the partner lanes of the segmented max / sum rounds */
#define TMX(j, s) ((j) ^ (s))
#ifdef NROUNDS
static const vi XMASK[NROUNDS] = TROUNDS(TMX);
#endif
/* every lane: the max (op 0) or sum (op 1) over its aligned segment of P lanes (P a power of 2) */
INL vt seg_reduce(vt x, int P, int op) {
#if defined(__clang__) || !defined(NROUNDS)
    vt r;
    for (int t = 0; t < L; t++) {
        int s0 = t / P * P;
        T a = x[s0];
        for (int u = s0 + 1; u < s0 + P; u++) a = op ? a + x[u] : (x[u] > a ? x[u] : a);
        r[t] = a;
    }
    return r;
#else
    for (int k = 0; k < NROUNDS; k++) {
        if (((L / 2) >> k) >= P) continue;
        vt y = __builtin_shuffle(x, XMASK[k]);
        x = op ? x + y : vmax(x, y);
    }
    return x;
#endif
}

#define AS 4 /* partial sums of P V per channel vector */
#define NG 4 /* head groups in flight at once (of one query or of consecutive ones): chains overlap */

/* one group: U = L / P heads [h, h + nh) of one query; qe: the element offset of head h's query,
 * koff[s]: slot s's key pixel times heads, add[c]: mask / bias of chunk c, o: head h's output */
typedef struct {
    long qe;
    const long *koff;
    const vt *add;
    T *o;
    int h, nh;
} Grp;

/* ng <= NG groups: with P = L / 2 two heads' windows share one vector of scores (segments of P
 * lanes), with P = L one head's window spans nch vectors. The three phases (scores, softmax, P V)
 * each run over all the groups, so that their dependency chains overlap. */
INL void run_groups(const void *q, const void *k, const void *v, int bf, T sc_, int nd, int ndv, int n, int P,
                    int D, int Dv, const Grp *gr, int ng, int nch) {
    vt S[NG * ((MAX_DIRECT_SLOTS + L - 1) / L)];
    T w[NG][MAX_DIRECT_SLOTS + L], inv[NG][L];
    for (int g = 0; g < ng; g++) {
        const int hg = gr[g].h, nh = gr[g].nh;
        const long *koff = gr[g].koff;
        for (int c = 0; c < nch; c++) {
            vt p[L];
            int lim = n - c * L < P ? n - c * L : P;
#pragma GCC unroll 16
            for (int u = 0; u < L / P; u++) {
                vt qv[DMAX];
                for (int d = 0; d < nd; d++)
                    qv[d] = u < nh ? ldx(q, bf, gr[g].qe + (long)u * D + (long)d * L) * sc_ : (vt){0};
#pragma GCC unroll 16
                for (int t = 0; t < P; t++) { /* P constant: p stays in registers */
                    vt a = {0};
                    if (t < lim && u < nh) {
                        long e = (koff[c * L + t] + hg + u) * D;
                        a = qv[0] * ldx(k, bf, e);
                        for (int d = 1; d < nd; d++) a += qv[d] * ldx(k, bf, e + (long)d * L);
                    }
                    p[u * P + t] = a;
                }
            }
            S[g * nch + c] = hsum_tree(p, P == L ? lim : L) + gr[g].add[c];
        }
    }
    for (int g = 0; g < ng; g++) {
        vt mx = S[g * nch];
        for (int c = 1; c < nch; c++) mx = vmax(mx, S[g * nch + c]);
        mx = seg_reduce(mx, P, 0);
        vt tot = {0};
        for (int c = 0; c < nch; c++) {
            vt e = vexp(S[g * nch + c] - mx);
            tot += e;
            st(w[g] + c * L, e);
        }
        st(inv[g], 1 / seg_reduce(tot, P, 1));
    }
    for (int g = 0; g < ng; g++) {
        const int hg = gr[g].h, nh = gr[g].nh;
        const long *koff = gr[g].koff;
        for (int u = 0; u < nh; u++) {
            vt acc[AS][DMAX]; /* AS sums over the slots: FMA chains AS times shorter */
            for (int a = 0; a < AS; a++)
                for (int d = 0; d < ndv; d++) acc[a][d] = (vt){0};
            int s = 0;
            for (; s + AS <= n; s += AS)
#pragma GCC unroll 4
                for (int a = 0; a < AS; a++) {
                    vt ws = splat(w[g][u * P + s + a]);
                    long e = (koff[s + a] + hg + u) * Dv;
                    for (int d = 0; d < ndv; d++) acc[a][d] += ws * ldx(v, bf, e + (long)d * L);
                }
            for (; s < n; s++) {
                vt ws = splat(w[g][u * P + s]);
                long e = (koff[s] + hg + u) * Dv;
                for (int d = 0; d < ndv; d++) acc[0][d] += ws * ldx(v, bf, e + (long)d * L);
            }
            for (int d = 0; d < ndv; d++) {
                vt r = acc[0][d];
                for (int a = 1; a < AS; a++) r += acc[a][d];
                st(gr[g].o + (long)u * Dv + d * L, r * inv[g][u * P]);
            }
        }
    }
}

/* P, nd, ndv as constants for the common head sizes (the loops unrolled, p in registers) */
#define RUN_GROUPS(PP, ND, NDV) run_groups(q, k, v, bf, sc, ND, NDV, n, PP, D, Dv, gr, ng, nch)

#define NCH ((MAX_DIRECT_SLOTS + L - 1) / L)

/* queries [i0, i1) of the flattened (batch, query column) range, every head; dims and tables as
 * na_forward (1-D: one query row, one key row, kh 1). Groups of consecutive queries run together
 * (up to NG groups) where one query has fewer. */
void na_forward_1d(const void *q, const void *k, const void *v, const T *table, T *out, const int64_t *dims,
                   const int32_t *rows, const int32_t *cols, double scale, long i0, long i1, int bf) {
    const int heads = (int)dims[1], Wq = (int)dims[3], Wk = (int)dims[5], D = (int)dims[6], Dv = (int)dims[7];
    const int n = (int)dims[9], tw = 2 * n - 1, nd = D / L, ndv = Dv / L;
    const int P = 2 * n <= L ? L / 2 : L; /* two heads per vector of scores, else one over nch vectors */
    const int U = L / P, nch = (n + L - 1) / L, gq = (heads + U - 1) / U; /* groups per query */
    const T sc = (T)scale;
    const int32_t *ki = cols, *ok = cols + (long)Wq * n, *rel = cols + 2L * (long)Wq * n;
    const int row_ok = rows[1], row_rel = rows[2]; /* rows (3, 1, 1) */
    long koff[NG][MAX_DIRECT_SLOTS];
    vt base[NG][NCH], add[NG][NCH];
    Grp gr[NG];
    int ng = 0, nq = 0; /* groups pending; the next query's slot of koff / base */
    for (long iq = i0; iq < i1; iq++) {
        long b = iq / Wq;
        int i = (int)(iq % Wq);
        if (nq == NG) nq = 0; /* circular: the pending queries (< NG, each with a pending group) are the
                               * slots before nq, so slot nq is free */
        long *ko = koff[nq];
        vt *bs = base[nq];
        nq++;
        for (int s = 0; s < n; s++) ko[s] = (b * Wk + ki[i * n + s]) * heads;
        for (int c = 0; c < nch; c++)
            for (int t = 0; t < L; t++) {
                int s = U > 1 ? t % P : c * L + t;
                bs[c][t] = s < n && row_ok && ok[i * n + s] ? 0 : -INFINITY;
            }
        for (int h0 = 0; h0 < heads; h0 += U) {
            Grp *g = gr + ng;
            g->h = h0;
            g->nh = heads - h0 < U ? heads - h0 : U;
            g->qe = ((b * Wq + i) * heads + h0) * D;
            g->o = out + ((b * Wq + i) * heads + h0) * Dv;
            g->koff = ko;
            g->add = bs;
            if (table) {
                for (int c = 0; c < nch; c++) {
                    vt x = bs[c];
                    for (int t = 0; t < L; t++) {
                        int h = h0 + (U > 1 ? t / P : 0), s = U > 1 ? t % P : c * L + t;
                        if (s < n && h < heads) x[t] += table[((long)h * (2 * 1 - 1) + row_rel) * tw + rel[i * n + s]];
                    }
                    add[ng][c] = x;
                }
                g->add = add[ng];
            }
            ng++;
            /* run when full, at the last query, or when the next query's groups would not fit */
            int last = iq + 1 == i1 && h0 + U >= heads;
            if (ng == NG || last || (h0 + U >= heads && ng + gq > NG)) {
                if (P == L / 2 && nd == 2 && ndv == 2) RUN_GROUPS(L / 2, 2, 2);
                else if (P == L / 2 && nd == 4 && ndv == 4) RUN_GROUPS(L / 2, 4, 4);
                else if (P == L / 2) RUN_GROUPS(L / 2, nd, ndv);
                else if (nd == 2 && ndv == 2) RUN_GROUPS(L, 2, 2);
                else if (nd == 4 && ndv == 4) RUN_GROUPS(L, 4, 4);
                else RUN_GROUPS(L, nd, ndv);
                ng = 0;
            }
        }
    }
}

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

#endif
