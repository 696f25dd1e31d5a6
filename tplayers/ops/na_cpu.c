/* Neighborhood attention (NATTEN semantics) on one CPU core: the compiled kernel behind
 * tplayers.na2d for fp32 / fp64 CPU tensors (see tplayers/ops/na_cpu.py, which builds this file
 * with the system C compiler, once, into a cache directory, and calls it through ctypes).
 *
 * Compiled once per element type: -DNA_DOUBLE selects double (8 lanes), else float (16 lanes).
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef NA_DOUBLE
typedef double T;
typedef int64_t IT;
#define L 8
#else
typedef float T;
typedef int32_t IT;
#define L 16
#endif
typedef T vt __attribute__((vector_size(L * sizeof(T))));
typedef IT vi __attribute__((vector_size(L * sizeof(IT))));
#define G 8  /* score accumulators per pass (keys at a time) */
#define GV 8 /* output-channel accumulators per pass (8 measured ~10% faster than 4) */
#define INL static inline __attribute__((always_inline))

INL vt ld(const T *p) { vt v; memcpy(&v, p, sizeof v); return v; }
INL void st(T *p, vt v) { memcpy(p, &v, sizeof v); }
INL vt splat(T x) { return (vt){0} + x; }
INL vt vsel(vi m, vt a, vt b) { return (vt)(((vi)a & m) | ((vi)b & ~m)); }
INL vt vmax(vt a, vt b) { return vsel(a > b, a, b); }

/* exp on a vector (Cody-Waite reduction, Taylor polynomial on [-ln2/2, ln2/2]); exactly 0 below
 * the underflow threshold (masked keys carry -inf). */
INL vt vexp(vt x) {
#ifdef NA_DOUBLE
    const T lo = -708.0, hi_ln2 = 6.93147180369123816490e-01, lo_ln2 = 1.90821492927058770002e-10;
    static const T c[] = {1.0 / 6227020800, 1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880,
                          1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};
    const int nc = 14, bias = 1023, mant = 52;
#else
    const T lo = -87.0f, hi_ln2 = 0.693359375f, lo_ln2 = -2.12194440e-4f;
    static const T c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}; /* |err| < 1.2e-7 */
    const int nc = 7, bias = 127, mant = 23;
#endif
    vi keep = x >= lo;
    x = vsel(keep, x, splat(lo));
    vt t = x * (T)1.44269504088896340736 - (T)0.5;
    vi n = __builtin_convertvector(t, vi); /* truncation of t - 0.5 (t <= ~0): round to nearest */
    vt nf = __builtin_convertvector(n, vt);
    vt r = x - nf * hi_ln2 - nf * lo_ln2;
    vt p = splat(c[0]);
    for (int i = 1; i < nc; i++) p = p * r + c[i];
    vi scale = (n + bias) << mant;
    return (vt)((vi)(p * (vt)scale) & keep);
}

/* One block: n consecutive queries of a row in L lanes (spare lanes repeat the last query).
 * Lane t of slot b reads key column base_b + perm[t]; mode 0: perm is 0..L-1 (a plain load),
 * mode 1: a shuffle of the L columns from base_b. */
typedef struct {
    int mode, n, layers; /* layers: scatter-add rounds (mode 1): lanes sharing a key add in turn */
    vi perm, live;       /* live: -1 on the n real lanes */
    vi inv[L], has[L];   /* round r: key lane u takes lane inv[r][u] where has[r][u] is -1 */
} Lanes;

INL vt kload(const T *p, int mode, const Lanes *ln) {
    if (mode == 0) return ld(p);
#ifdef __clang__
    vt v = ld(p), r;
    for (int t = 0; t < L; t++) r[t] = v[ln->perm[t]];
    return r;
#else
    return __builtin_shuffle(ld(p), ln->perm);
#endif
}

/* lanes of x moved by a two-register shuffle mask m (entries >= L give 0) */
INL vt shift2(vt x, vi m) {
#ifdef __clang__
    vt r;
    for (int u = 0; u < L; u++) r[u] = m[u] < L ? x[m[u]] : 0;
    return r;
#else
    return __builtin_shuffle(x, (vt){0}, m);
#endif
}

/* p[key column of lane t] += x[t] for the live lanes (x is 0 on the others) */
INL void kadd(T *p, vt x, int mode, const Lanes *ln) {
    vt acc = ld(p);
    if (mode == 0) { st(p, acc + x); return; }
    for (int r = 0; r < ln->layers; r++) {
#ifdef __clang__
        vt y; for (int u = 0; u < L; u++) y[u] = x[ln->inv[r][u]];
#else
        vt y = __builtin_shuffle(x, ln->inv[r]);
#endif
        acc += (vt)((vi)y & ln->has[r]);
    }
    st(p, acc);
}

typedef struct {
    int B, heads, Hq, Wq, Hk, Wk, D, Dv, kh, kw, nk, nkp, tw; /* tw: bias table width (2kW-1) */
    long kp; /* row pitch of the key planes (see key_pitch) */
    const int32_t *rows, *cols; /* (3, Hq, kh), (3, Wq, kw) */
    const T *table;             /* (heads, 2kH-1, 2kW-1) or NULL */
    T scale;
} Geo;

/* the block of queries starting at column j0: as many (<= L) as share one shuffle pattern;
 * base[b]: slot b's first key column */
static void block_lanes(const Geo *g, int j0, Lanes *ln, long *base) {
    const int32_t *kc = g->cols;
    int n = g->Wq - j0 < L ? g->Wq - j0 : L, mn = 0;
    for (; n > 1; n--) { /* the shifts must not depend on the slot and must span < L columns */
        int ok = 1, mx = 0;
        mn = 0;
        for (int t = 1; t < n && ok; t++) {
            int d = kc[(j0 + t) * g->kw] - kc[j0 * g->kw];
            for (int b = 1; b < g->kw; b++) ok &= kc[(j0 + t) * g->kw + b] - kc[j0 * g->kw + b] == d;
            mn = d < mn ? d : mn;
            mx = d > mx ? d : mx;
        }
        if (ok && mx - mn < L) break;
    }
    if (n == 1) mn = 0;
    ln->n = n;
    int ident = n == L;
    for (int t = 0; t < L; t++) {
        int j = j0 + (t < n ? t : n - 1);
        ln->perm[t] = kc[j * g->kw] - kc[j0 * g->kw] - mn;
        ln->live[t] = t < n ? -1 : 0;
        ident &= ln->perm[t] == t;
    }
    for (int b = 0; b < g->kw; b++) base[b] = kc[j0 * g->kw + b] + mn;
    ln->mode = ident ? 0 : 1;
    ln->layers = 0;
    if (!ident) { /* round r takes the r-th live lane of each key lane u */
        int count[L] = {0};
        for (int r = 0; r < L; r++) { ln->inv[r] = (vi){0}; ln->has[r] = (vi){0}; }
        for (int t = 0; t < n; t++) {
            int u = ln->perm[t], r = count[u]++;
            ln->inv[r][u] = t;
            ln->has[r][u] = -1;
            if (r + 1 > ln->layers) ln->layers = r + 1;
        }
    }
}

/* additive window mask (-inf: causal) and bias of a block, add[ab] over lanes; 0 when all zero */
static int block_add(const Geo *g, int i, int j0, int h, const Lanes *ln, vt *add) {
    const int32_t *vr = g->rows + g->Hq * g->kh, *rr = g->rows + 2 * g->Hq * g->kh;
    const int32_t *vc = g->cols + g->Wq * g->kw, *rc = g->cols + 2 * g->Wq * g->kw;
    int any = g->table != NULL;
    for (int a = 0; a < g->kh && !any; a++) any = !vr[i * g->kh + a];
    for (int t = 0; t < ln->n && !any; t++)
        for (int b = 0; b < g->kw; b++) any |= !vc[(j0 + t) * g->kw + b];
    if (!any) return 0;
    const T *tab = g->table ? g->table + (size_t)h * (2 * g->kh - 1) * g->tw : NULL;
    for (int a = 0; a < g->kh; a++)
        for (int b = 0; b < g->kw; b++) {
            vt x;
            for (int t = 0; t < L; t++) {
                int j = j0 + (t < ln->n ? t : ln->n - 1);
                int ok = vr[i * g->kh + a] && vc[j * g->kw + b];
                x[t] = !ok ? -INFINITY : tab ? tab[rr[i * g->kh + a] * g->tw + rc[j * g->kw + b]] : 0;
            }
            add[a * g->kw + b] = x;
        }
    return 1;
}

/* s[ab] = sum_c x[c] * y[c][key ab] over C channels; x rows at stride xs, y rows at stride ys */
INL void scores(int mode, const Lanes *ln, int nkp, int C, const T *x, long xs, const T *y, long ys,
                const long *off, vt *s) {
    for (int ab = 0; ab < nkp; ab += G) {
        vt acc[G] = {0};
        for (int c = 0; c < C; c++) {
            vt xv = ld(x + c * xs);
            for (int q = 0; q < G; q++) acc[q] += xv * kload(y + off[ab + q] + c * ys, mode, ln);
        }
        for (int q = 0; q < G; q++) s[ab + q] = acc[q];
    }
}

/* out[c] = mul * sum_ab p[ab] * y[c][key ab] for C channels, out rows at stride os; n lanes stored */
INL void apply(int mode, const Lanes *ln, int nk, int C, const vt *p, const T *y, long ys, const long *off,
               T *out, long os, vt mul) {
    for (int c0 = 0; c0 < C; c0 += GV) {
        vt acc[GV] = {0};
        long cs[GV];
        for (int q = 0; q < GV; q++) cs[q] = (c0 + q < C ? c0 + q : C - 1) * ys;
        for (int ab = 0; ab < nk; ab++)
            for (int q = 0; q < GV; q++) acc[q] += p[ab] * kload(y + off[ab] + cs[q], mode, ln);
        for (int q = 0; q < GV && c0 + q < C; q++) {
            vt r = acc[q] * mul;
            if (ln->n == L) st(out + (c0 + q) * os, r);
            else memcpy(out + (c0 + q) * os, &r, ln->n * sizeof(T));
        }
    }
}

/* exp(s - rowmax) in place, over the nk scores of each lane; returns 1 / rowsum */
INL vt softmax(int nk, vt *s, const vt *add) {
    if (add)
        for (int ab = 0; ab < nk; ab++) s[ab] += add[ab];
    vt m = s[0], l = {0};
    for (int ab = 1; ab < nk; ab++) m = vmax(m, s[ab]);
    for (int ab = 0; ab < nk; ab++) { s[ab] = vexp(s[ab] - m); l += s[ab]; }
    return 1 / l;
}

/* r[0..L) as an L x L tile, transposed in place: log2(L) rounds swapping off-diagonal blocks */
INL void transpose_tile(vt *r) {
#ifdef __clang__
    T m[L][L];
    for (int i = 0; i < L; i++) for (int j = 0; j < L; j++) m[j][i] = r[i][j];
    for (int i = 0; i < L; i++) memcpy(&r[i], m[i], sizeof(vt));
#else
    for (int s = L / 2; s >= 1; s /= 2) {
        vi ma, mb;
        for (int j = 0; j < L; j++) { ma[j] = (j & s) ? L + j - s : j; mb[j] = (j & s) ? L + j : j + s; }
        for (int i = 0; i < L; i++)
            if (!(i & s)) {
                vt x = r[i], y = r[i + s];
                r[i] = __builtin_shuffle(x, y, ma);
                r[i + s] = __builtin_shuffle(x, y, mb);
            }
    }
#endif
}

/* rows [i0, i1) of plane (b, h) of x into dst (i1 - i0, C, pitch), times mul; x has element strides
 * xs = (batch, pixel, head, channel). L x L tiles (pixels x channels) transposed in registers;
 * the rest through a small buffer. */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) /* no memcpy calls per pixel */
static void to_rows(const T *x, const long *xs, int b, int h, int i0, int i1, int W, long pitch, int C, T mul,
                    T *dst) {
    const T *src = x + b * xs[0] + h * xs[2];
    T buf[L * C];
    for (int i = i0; i < i1; i++)
        for (int j0 = 0; j0 < W; j0 += L) {
            int n = W - j0 < L ? W - j0 : L, c0 = 0;
            T *d0 = dst + (size_t)(i - i0) * C * pitch + j0;
            if (n == L && xs[3] == 1)
                for (; c0 + L <= C; c0 += L) {
                    vt r[L];
                    for (int t = 0; t < L; t++) {
                        __builtin_prefetch(src + ((long)i * W + j0 + t + L) * xs[1] + c0); /* next tile */
                        r[t] = ld(src + ((long)i * W + j0 + t) * xs[1] + c0);
                    }
                    transpose_tile(r);
                    for (int c = 0; c < L; c++) st(d0 + (size_t)(c0 + c) * pitch, r[c] * mul);
                }
            if (c0 == C) continue;
            for (int t = 0; t < n; t++) {
                const T *p = src + ((long)i * W + j0 + t) * xs[1];
                for (int c = c0; c < C; c++) buf[t * C + c] = p[c * xs[3]];
            }
            for (int c = c0; c < C; c++)
                for (int t = 0; t < n; t++) d0[(size_t)c * pitch + t] = buf[t * C + c] * mul;
        }
}

/* rows [i0, i1) of plane (b, h) of contiguous x (B, H*W, heads*C) from src (i1 - i0, C, pitch) */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static void from_rows(const T *src, long pitch, int b, int h, int heads, int H, int W, int C, int i0, int i1, T *x) {
    T *dst = x + (size_t)b * H * W * heads * C + (size_t)h * C;
    T buf[L * C];
    for (int i = i0; i < i1; i++)
        for (int j0 = 0; j0 < W; j0 += L) {
            int n = W - j0 < L ? W - j0 : L, c0 = 0;
            const T *s0 = src + (size_t)(i - i0) * C * pitch + j0;
            if (n == L)
                for (; c0 + L <= C; c0 += L) {
                    vt r[L];
                    for (int c = 0; c < L; c++) r[c] = ld(s0 + (size_t)(c0 + c) * pitch);
                    transpose_tile(r);
                    for (int t = 0; t < L; t++) st(dst + ((size_t)i * W + j0 + t) * heads * C + c0, r[t]);
                }
            if (c0 == C) continue;
            for (int c = c0; c < C; c++)
                for (int t = 0; t < n; t++) buf[t * C + c] = s0[(size_t)c * pitch + t];
            for (int t = 0; t < n; t++) {
                T *p = dst + ((size_t)i * W + j0 + t) * heads * C;
                for (int c = c0; c < C; c++) p[c] = buf[t * C + c];
            }
        }
}

static void dense_strides(int H, int W, int heads, int C, long *st) {
    st[0] = (long)H * W * heads * C; st[1] = (long)heads * C; st[2] = C; st[3] = 1;
}

/* the blocks of a row (the same for every row): at most Wq of them, malloc'd */
static Lanes *row_blocks(const void *g, int *count, long **bases);

/* offset of key (a, b) of query row i in a (Hk, C, Wk) plane, for the block's base columns */
static void key_offsets(const Geo *g, int i, const long *base, int C, long *off) {
    for (int a = 0; a < g->kh; a++)
        for (int b = 0; b < g->kw; b++)
            off[a * g->kw + b] = (long)g->rows[i * g->kh + a] * C * g->kp + base[b];
    for (int ab = g->nk; ab < g->nkp; ab++) off[ab] = off[0];
}

/* key planes' row pitch (padding the rows measured no faster) */
static long key_pitch(long wk) {
    return wk;
}

static Geo make_geo(const int64_t *dims, const int32_t *rows, const int32_t *cols, const T *table, double scale) {
    Geo g = {(int)dims[0], (int)dims[1], (int)dims[2], (int)dims[3], (int)dims[4], (int)dims[5], (int)dims[6],
             (int)dims[7], (int)dims[8], (int)dims[9], 0, 0, 0, 0, rows, cols, table, (T)scale};
    g.nk = g.kh * g.kw;
    g.nkp = (g.nk + G - 1) / G * G;
    g.tw = 2 * g.kw - 1;
    g.kp = key_pitch(g.Wk);
    return g;
}

#define PAD (2 * L) /* zeroed elements after each plane buffer: shifted loads may run past a row */

/* scratch elements the kernels need (dims as below; the caller allocates them); backward:
 * 0 forward, 1 backward with dk and dv, 2 backward without */
long na_scratch(const int64_t *dims, int backward) {
    long pk = dims[4] * key_pitch(dims[5]), D = dims[6], Dv = dims[7], W = dims[3];
    long fwd = D * W + PAD + D * pk + PAD + Dv * pk + PAD + Dv * W + PAD;
    if (!backward) return fwd;
    return fwd + W + PAD + D * W + PAD + Dv * W + PAD + (backward == 1 ? D * pk + Dv * pk + 2 * PAD : 0);
}

static T *carve(T **next, long n) { T *p = *next; memset(p + n, 0, PAD * sizeof(T)); *next = p + n + PAD; return p; }

/* dims: B, heads, Hq, Wq, Hk, Wk, D, Dv, kH, kW. Planes [p0, p1) of the B*heads (batch-major). */
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

static Lanes *row_blocks(const void *gp, int *count, long **bases) {
    const Geo *g = gp;
    Lanes *blocks = aligned_alloc(_Alignof(Lanes), sizeof(Lanes) * g->Wq); /* vector members */
    *bases = malloc(sizeof(long) * g->Wq * g->kw);
    int nb = 0;
    for (int j0 = 0; j0 < g->Wq; j0 += blocks[nb].n, nb++) block_lanes(g, j0, blocks + nb, *bases + (long)nb * g->kw);
    *count = nb;
    return blocks;
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
            for (int c = 0; c < g->D; c++) {
                vt qv = ld(qrow + (long)c * g->Wq), lo = {0}, hi = {0};
                for (int b = 0; b < g->kw; b++) {
                    vt x = ds[a * g->kw + b] * qv;
                    lo += shift2(x, sh[2 * b]);
                    hi += shift2(x, sh[2 * b + 1]);
                }
                T *d = dkt + off[a * g->kw] + (long)c * g->kp;
                st(d, ld(d) + lo);
                st(d + L, ld(d + L) + hi);
            }
            for (int c = 0; c < g->Dv; c++) {
                vt gv = ld(grow + (long)c * g->Wq), lo = {0}, hi = {0};
                for (int b = 0; b < g->kw; b++) {
                    vt x = p[a * g->kw + b] * gv;
                    lo += shift2(x, sh[2 * b]);
                    hi += shift2(x, sh[2 * b + 1]);
                }
                T *d = dvt + voff[a * g->kw] + (long)c * g->kp;
                st(d, ld(d) + lo);
                st(d + L, ld(d + L) + hi);
            }
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
        T *tab = dtable + (size_t)h * (2 * g->kh - 1) * g->tw;
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
