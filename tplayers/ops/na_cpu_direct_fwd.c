/* The 1-D forward on the user's layout, na_forward_1d: a unit of the kernel's build (see
 * na_cpu_direct.h for the algorithm). */
#include "na_cpu_direct.h"

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
