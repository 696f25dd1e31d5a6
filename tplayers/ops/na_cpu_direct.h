/* The 1-D forward and backward on the user's layout (issue 35): na_cpu_direct_fwd.c and
 * na_cpu_direct_bwd.c, two units of the kernel's build (compiled side by side: na_cpu.py); this
 * header holds what they share (the sums across lanes). q, k, v are read where they lie,
 * (B, L, heads, D) (D, Dv multiples of the lanes), the output written where it goes; no planes,
 * no transposes. Per query (all heads in turn: the pixel's heads are adjacent in memory) the
 * window's keys are rows of heads*D elements, one vector per L channels:
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

#endif
