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

/* scratch elements the kernels need (dims as below; the caller allocates them); backward:
 * 0 forward, 1 backward with dk and dv, 2 backward without */
long na_scratch(const int64_t *dims, int backward) {
    long pk = dims[4] * key_pitch(dims[5]), D = dims[6], Dv = dims[7], W = dims[3];
    long fwd = D * W + PAD + D * pk + PAD + Dv * pk + PAD + Dv * W + PAD;
    if (!backward) return fwd;
    return fwd + W + PAD + D * W + PAD + Dv * W + PAD + (backward == 1 ? D * pk + Dv * pk + 2 * PAD : 0);
}

static T *carve(T **next, long n) { T *p = *next; memset(p + n, 0, PAD * sizeof(T)); *next = p + n + PAD; return p; }

/* dims: B, heads, Hq, Wq, Hk, Wk, D, Dv, kH, kW, bias table rows. Planes [p0, p1) of the B*heads (batch-major). */
void na_forward(const T *q, const T *k, const T *v, const T *table, T *out, const int64_t *dims,
                const int32_t *rows, const int32_t *cols, double scale, T *scratch, int p0, int p1) {
    Geo g = make_geo(dims, rows, cols, table, scale);
    long pk = (long)g.Hk * g.kp, sq[4], sk[4], sv[4];
    dense_strides(g.Hq, g.Wq, g.heads, g.D, sq);
    dense_strides(g.Hk, g.Wk, g.heads, g.D, sk);
    dense_strides(g.Hk, g.Wk, g.heads, g.Dv, sv);
    T *next = scratch;
    T *qrows = carve(&next, g.D * g.Wq), *kt = carve(&next, g.D * pk), *vtp = carve(&next, g.Dv * pk);
    T *orow = carve(&next, g.Dv * g.Wq); /* one query row, one output row */
    vt s[g.nkp], add[g.nkp];
    long off[g.nkp], voff[g.nkp];
    int nb;
    long *bases;
    Lanes *blocks = row_blocks(&g, &nb, &bases);
    for (int pl = p0; pl < p1; pl++) {
        int b = pl / g.heads, h = pl % g.heads;
        to_rows(k, sk, b, h, 0, g.Hk, g.Wk, g.kp, g.D, 1, kt);
        to_rows(v, sv, b, h, 0, g.Hk, g.Wk, g.kp, g.Dv, 1, vtp);
        for (int i = 0; i < g.Hq; i++) {
            to_rows(q, sq, b, h, i, i + 1, g.Wq, g.Wq, g.D, g.scale, qrows);
            for (int bk = 0, j0 = 0; bk < nb; j0 += blocks[bk].n, bk++) {
                const Lanes *ln = blocks + bk;
                key_offsets(&g, i, bases + (long)bk * g.kw, g.D, off);
                key_offsets(&g, i, bases + (long)bk * g.kw, g.Dv, voff);
                const T *qrow = qrows + j0;
                vt *a = block_add(&g, i, j0, h, ln, add) ? add : NULL;
                if (ln->mode == 0) {
                    scores(0, ln, g.nkp, g.D, qrow, g.Wq, kt, g.kp, off, s);
                    vt inv = softmax(g.nk, s, a);
                    apply(0, ln, g.nk, g.Dv, s, vtp, g.kp, voff, orow + j0, g.Wq, inv);
                } else {
                    scores(1, ln, g.nkp, g.D, qrow, g.Wq, kt, g.kp, off, s);
                    vt inv = softmax(g.nk, s, a);
                    apply(1, ln, g.nk, g.Dv, s, vtp, g.kp, voff, orow + j0, g.Wq, inv);
                }
            }
            from_rows(orow, g.Wq, b, h, g.heads, g.Hq, g.Wq, g.Dv, i, i + 1, out);
        }
    }
    free(blocks);
    free(bases);
}


/* key row a of one block's dK (or dV): for each of n channels, the kW slot vectors w[a, b] * row[c]
 * summed in two registers (each moved in by its two-register shuffle sh: the first lane of each key)
 * and added to the 2L key columns from d (plus the channel's plane offset) with one write */
INL void add_slots(const Geo *g, int a, int n, const T *row, const vt *w, const vi *sh, T *d) {
    for (int c = 0; c < n; c++) {
        vt rv = ld(row + (long)c * g->Wq), lo = {0}, hi = {0};
        for (int b = 0; b < g->kw; b++) {
            vt x = w[a * g->kw + b] * rv;
            lo += shift2(x, sh[2 * b]);
            hi += shift2(x, sh[2 * b + 1]);
        }
        T *dc = d + (long)c * g->kp;
        st(dc, ld(dc) + lo);
        st(dc + L, ld(dc + L) + hi);
    }
}


/* one block's backward (mode constant after inlining) */
INL void back_block(int mode, const Geo *g, const Lanes *ln, int i, int j0, int h, const vt *a, const T *qt,
                    const T *kt, const T *vtp, const T *got, const T *delta, T *dqt, T *dkt, T *dvt,
                    T *dtable, const long *off, const long *voff, vt *p, vt *ds, const vi *sh,
                    const int *ex, const long *rb) {
    const T *qrow = qt + j0, *grow = got + j0; /* row buffers of query row i */
    scores(mode, ln, g->nkp, g->D, qrow, g->Wq, kt, g->kp, off, p);
    vt inv = softmax(g->nk, p, a);
    inv = (vt)((vi)inv & ln->live); /* spare lanes: P = 0, so they add nothing below */
    scores(mode, ln, g->nkp, g->Dv, grow, g->Wq, vtp, g->kp, voff, ds); /* dP = dO . V */
    vt dl = ld(delta + j0);
    for (int ab = 0; ab < g->nk; ab++) {
        p[ab] *= inv;
        ds[ab] = p[ab] * (ds[ab] - dl);
    }
    apply(mode, ln, g->nk, g->D, ds, kt, g->kp, off, dqt + j0, g->Wq, splat(g->scale)); /* dqt: one row */
    if (!dkt) {
    } else if (sh) {
        /* dK, dV: slot b's keys are columns base_0 + r_b + perm[t], so the kW slots of one key
         * row add into 2L columns from base_0: sum them in two registers (each slot's vector
         * moved in by a two-register shuffle: the first lane of each key) and write once; lanes
         * that share a key with an earlier lane (borders) add theirs one by one below */
        for (int a = 0; a < g->kh; a++) {
            add_slots(g, a, g->D, qrow, ds, sh, dkt + off[a * g->kw]);  /* dK += dS^T Q */
            add_slots(g, a, g->Dv, grow, p, sh, dvt + voff[a * g->kw]); /* dV += P^T dO */
        }
        int dense = g->kw <= L;
        for (int b = 0; b < g->kw; b++) dense &= rb[b] == b;
        for (int e = 0; e < ex[0]; e++) { /* ex: count, then (lane, key lane) pairs */
            int t = ex[1 + 2 * e], u = ex[2 + 2 * e];
            for (int a = 0; a < g->kh; a++) {
                const T *dsa = (const T *)(ds + a * g->kw), *pa = (const T *)(p + a * g->kw);
                if (dense) { /* slots at consecutive columns: one vector over the slots */
                    vt dsx = {0}, px = {0};
                    for (int b = 0; b < g->kw; b++) { dsx[b] = dsa[b * L + t]; px[b] = pa[b * L + t]; }
                    for (int c = 0; c < g->D; c++) {
                        T *d = dkt + off[a * g->kw] + (long)c * g->kp + u;
                        st(d, ld(d) + dsx * qrow[(long)c * g->Wq + t]);
                    }
                    for (int c = 0; c < g->Dv; c++) {
                        T *d = dvt + voff[a * g->kw] + (long)c * g->kp + u;
                        st(d, ld(d) + px * grow[(long)c * g->Wq + t]);
                    }
                    continue;
                }
                for (int c = 0; c < g->D; c++) {
                    T x = qrow[(long)c * g->Wq + t], *d = dkt + off[a * g->kw] + (long)c * g->kp + u;
                    for (int b = 0; b < g->kw; b++) d[rb[b]] += dsa[b * L + t] * x;
                }
                for (int c = 0; c < g->Dv; c++) {
                    T x = grow[(long)c * g->Wq + t], *d = dvt + voff[a * g->kw] + (long)c * g->kp + u;
                    for (int b = 0; b < g->kw; b++) d[rb[b]] += pa[b * L + t] * x;
                }
            }
        }
    } else {
        /* read-modify-writes of shifted (and, near borders, shuffled) vectors. Slots b and b + 1
         * overlap, so b is the outer loop: an overlapping load comes kH * (D + Dv) stores after
         * the store it overlaps, not right after it (a partial store-to-load forward stalls) */
        for (int b = 0; b < g->kw; b++)
            for (int ab = b; ab < g->nk; ab += g->kw) {
                for (int c = 0; c < g->D; c++)
                    kadd(dkt + off[ab] + (long)c * g->kp, ds[ab] * ld(qrow + (long)c * g->Wq), mode, ln);
                for (int c = 0; c < g->Dv; c++)
                    kadd(dvt + voff[ab] + (long)c * g->kp, p[ab] * ld(grow + (long)c * g->Wq), mode, ln);
            }
    }
    if (dtable) {
        const int32_t *rr = g->rows + 2 * g->Hq * g->kh, *rc = g->cols + 2 * g->Wq * g->kw;
        T *tab = dtable + (size_t)h * g->tr * g->tw;
        for (int ab = 0; ab < g->nk; ab++) {
            int ra = rr[i * g->kh + ab / g->kw] * g->tw, b = ab % g->kw;
            for (int t = 0; t < ln->n; t++) tab[ra + rc[(j0 + t) * g->kw + b]] += ds[ab][t];
        }
    }
}

/* gradients of na_forward: dq (overwritten), dk and dv (overwritten; both NULL: not wanted) and
 * dtable (accumulated; NULL without a bias). dout has element strides sd (batch, pixel, head, channel). */
void na_backward(const T *dout, const int64_t *sd, const T *q, const T *k, const T *v, const T *table, const T *out,
                 T *dq, T *dk, T *dv, T *dtable, const int64_t *dims, const int32_t *rows, const int32_t *cols,
                 double scale, T *scratch, int p0, int p1) {
    Geo g = make_geo(dims, rows, cols, table, scale);
    long pk = (long)g.Hk * g.kp, sq[4], sk[4], sv[4], so[4], sdo[4] = {sd[0], sd[1], sd[2], sd[3]};
    dense_strides(g.Hq, g.Wq, g.heads, g.D, sq);
    dense_strides(g.Hk, g.Wk, g.heads, g.D, sk);
    dense_strides(g.Hk, g.Wk, g.heads, g.Dv, sv);
    dense_strides(g.Hq, g.Wq, g.heads, g.Dv, so);
    int kv = dk != NULL;
    T *next = scratch;
    T *qt = carve(&next, g.D * g.Wq), *kt = carve(&next, g.D * pk), *vtp = carve(&next, g.Dv * pk);
    T *got = carve(&next, g.Dv * g.Wq), *delta = carve(&next, g.Wq), *dqrow = carve(&next, g.D * g.Wq);
    T *orow = carve(&next, g.Dv * g.Wq);
    T *dkt = kv ? carve(&next, g.D * pk) : NULL, *dvt = kv ? carve(&next, g.Dv * pk) : NULL;
    vt p[g.nkp], ds[g.nkp], add[g.nkp];
    long off[g.nkp], voff[g.nkp];
    int nb;
    long *bases;
    Lanes *blocks = row_blocks(&g, &nb, &bases);
    /* blocks whose kW slots' keys lie within 2L columns of slot 0's base: per slot the shuffle
     * masks (first lane of each key) and the lanes sharing a key with an earlier one */
    vi *shifts = aligned_alloc(_Alignof(vi), sizeof(vi) * 2 * g.kw * nb);
    int *fused = malloc(sizeof(int) * nb), *extra = malloc(sizeof(int) * (2 * L + 1) * nb);
    long *rshift = malloc(sizeof(long) * g.kw * nb);
    for (int bk = 0; bk < nb; bk++) {
        const long *base = bases + (long)bk * g.kw;
        const Lanes *ln = blocks + bk;
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
        for (int b = 0; b < g.kw; b++) {
            long r = base[b] - base[0];
            rshift[(long)bk * g.kw + b] = r;
            if (r < 0 || r + maxp >= 2 * L) { fused[bk] = 0; break; }
            for (int u = 0; u < L; u++) {
                long lo = u - r, hi = u + L - r;
                shifts[2 * (long)bk * g.kw + 2 * b][u] = lo >= 0 && lo < L && first[lo] >= 0 ? first[lo] : L;
                shifts[2 * (long)bk * g.kw + 2 * b + 1][u] = hi >= 0 && hi < L && first[hi] >= 0 ? first[hi] : L;
            }
        }
    }
    for (int pl = p0; pl < p1; pl++) {
        int b = pl / g.heads, h = pl % g.heads;
        to_rows(k, sk, b, h, 0, g.Hk, g.Wk, g.kp, g.D, 1, kt);
        to_rows(v, sv, b, h, 0, g.Hk, g.Wk, g.kp, g.Dv, 1, vtp);
        if (kv) {
            memset(dkt, 0, g.D * pk * sizeof(T));
            memset(dvt, 0, g.Dv * pk * sizeof(T));
        }
        for (int i = 0; i < g.Hq; i++) {
            to_rows(q, sq, b, h, i, i + 1, g.Wq, g.Wq, g.D, g.scale, qt); /* this query row only */
            to_rows(dout, sdo, b, h, i, i + 1, g.Wq, g.Wq, g.Dv, 1, got);
            to_rows(out, so, b, h, i, i + 1, g.Wq, g.Wq, g.Dv, 1, orow);
            for (int j = 0; j < g.Wq; j++) delta[j] = 0; /* rowsum(dO * O) */
            for (int c = 0; c < g.Dv; c++)
                for (int j = 0; j < g.Wq; j++) delta[j] += got[(long)c * g.Wq + j] * orow[(long)c * g.Wq + j];
            for (int bk = 0, j0 = 0; bk < nb; j0 += blocks[bk].n, bk++) {
                const Lanes *ln = blocks + bk;
                key_offsets(&g, i, bases + (long)bk * g.kw, g.D, off);
                key_offsets(&g, i, bases + (long)bk * g.kw, g.Dv, voff);
                vt *a = block_add(&g, i, j0, h, ln, add) ? add : NULL;
                if (ln->mode == 0)
                    back_block(0, &g, ln, i, j0, h, a, qt, kt, vtp, got, delta, dqrow, dkt, dvt, dtable, off, voff, p, ds,
                               fused[bk] ? shifts + 2 * g.kw * (long)bk : NULL, extra + (2 * L + 1) * bk,
                               rshift + (long)bk * g.kw);
                else
                    back_block(1, &g, ln, i, j0, h, a, qt, kt, vtp, got, delta, dqrow, dkt, dvt, dtable, off, voff, p, ds,
                               fused[bk] ? shifts + 2 * g.kw * (long)bk : NULL, extra + (2 * L + 1) * bk,
                               rshift + (long)bk * g.kw);
            }
            from_rows(dqrow, g.Wq, b, h, g.heads, g.Hq, g.Wq, g.D, i, i + 1, dq);
        }
        if (kv) {
            from_rows(dkt, g.kp, b, h, g.heads, g.Hk, g.Wk, g.D, 0, g.Hk, dk);
            from_rows(dvt, g.kp, b, h, g.heads, g.Hk, g.Wk, g.Dv, 0, g.Hk, dv);
        }
    }
    free(blocks);
    free(bases);
    free(shifts);
    free(fused);
    free(extra);
    free(rshift);
}
