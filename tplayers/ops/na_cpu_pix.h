/* The pixel routes (included by na_cpu.c after na_cpu_keys.h, and by na_cpu_pix.c, which holds their
 * kernels). The backward's dK / dV on the user's layout: for each key pixel a tile's block reaches,
 * its channel vectors summed in registers over the (query, slot) pairs that read it, a broadcast
 * weight (dS or P, one lane of the block's slot vectors) times the query's Q or dO channels, read
 * where they lie (pixel-major, heads adjacent), then added into a ring of pixel-major key rows (the
 * key planes' ring, ring_rows), each row streamed out to dK / dV when it leaves. No shifts of lanes
 * (sl_rows spends two shuffles and two adds per slot and channel vector on them) and no transposes
 * out. Used where the channels are whole vectors, q and dO have unit channel stride (bf16 q: its
 * rows widened first) and the rows run as one column chunk (pix_ok); the transposed route
 * otherwise. The forward's P V on the values' layout: see pxf_ok. */
#ifndef NA_CPU_PIX_H
#define NA_CPU_PIX_H
#include "na_cpu_plan.h"

#define PIXMAX 8 /* channel vectors of dK (and of dV) per key at most (accumulators in registers) */
#define PIXR (MR > 4 ? MR : 4)
/* key columns per group (pix_pairs): two where 32 vector registers hold both columns' sums (AVX-512:
 * 2-D 96^2 d16 backward 1.07x, 64^2 d32 1.03x over one), else one (AVX2 64^2 d32: two spill, 0.96x) */
#define PIXK (NREG == 32 ? 2 : 1)
#define HIDDEN __attribute__((visibility("hidden"))) /* shared by the units, not exported */
/* queries per group of pxa_kern (the forward's route on whole blocks), and the channel vectors per
 * pass of a group: all with 32 registers; with 16, two at a time (8 sums, 4 weights and a value vector
 * in registers; alone on AVX2 (Zen 3) 1.25x / 1.3x over groups of 2 with every channel, kernel 5 / 7;
 * with every pattern below, fp32 3-D 16^3 d32 k5 forward 1.06-1.10x, backward (its dQ) 1.04-1.05x,
 * 2-D 64^2 d32 k7 forward 1.02-1.12x, bit-identical) */
#define PXQ (L < 4 ? L : 4)
#define PXSTEP ((1 << (PXQ - 1)) - 1) /* the pattern of consecutive starts (below) */
#define PXN(nd) (NREG == 32 ? (nd) : 2)
/* the starts of a group's windows: lane c + 1's one column after lane c's or the same (bit c of the
 * group's pattern), every pattern with 16 registers (AVX2, where measured; windows clamped at a
 * border: 0001, 0012, 0111, 0122), else consecutive (all bits) or equal (none) only */
#define PXALL (NREG == 16)

/* lists [0, nl) of a block's pairs, list x's items its[2 k] (the match: a lane, or a key column) and
 * its[2 k + 1] (the pair's weight index b * L + t in the block's slot vectors) for k in [st[x],
 * st[x + 1]), matches ascending; in groups of PIXK consecutive lists (the last may have fewer), each
 * as 4 offsets into the entries e (gp: both, first, second, end), an entry 3 ints (match, the first
 * list's index, the second's): first the matches in both lists (each item matched once), then the
 * first list's other items, then the second's (groups of one: all first). */
static void pair_groups(int nl, const int *st, const int *its, int *gp, int *e, int *ne) {
    for (int gi = 0; gi < (nl + PIXK - 1) / PIXK; gi++, gp += 4) {
        const int x0 = PIXK * gi, two = PIXK == 2 && x0 + 1 < nl; /* a second list */
        const int *c0 = its + 2 * st[x0], *c1 = its + 2 * st[x0 + 1];
        const int n0 = st[x0 + 1] - st[x0], n1 = two ? st[x0 + 2] - st[x0 + 1] : 0;
        int i0 = 0, i1 = 0, *used0 = calloc(n0 + 1, sizeof(int)), *used1 = calloc(n1 + 1, sizeof(int));
        gp[0] = *ne;
        while (i0 < n0 && i1 < n1) {
            if (c0[2 * i0] == c1[2 * i1]) {
                int *x = e + 3 * (*ne)++;
                x[0] = c0[2 * i0]; x[1] = c0[2 * i0 + 1]; x[2] = c1[2 * i1 + 1];
                used0[i0++] = used1[i1++] = 1;
            } else if (c0[2 * i0] < c1[2 * i1]) i0++;
            else i1++;
        }
        gp[1] = *ne;
        for (int c = 0; c < 2; c++) {
            const int *cl = c ? c1 : c0, *used = c ? used1 : used0;
            for (int i = 0; i < (c ? n1 : n0); i++)
                if (!used[i]) {
                    int *x = e + 3 * (*ne)++;
                    x[0] = cl[2 * i]; x[1] = cl[2 * i + 1]; x[2] = 0;
                }
            gp[2 + c] = *ne;
        }
        free(used0);
        free(used1);
    }
}

/* PixPairs.f of the block of n queries from column j0 (0: pxa_kern does not take it): every lane's slots
 * consecutive key columns from its start, 1 then the pattern of each group of PXQ lanes (3 bits from
 * bit 3 x + 1 for group x) */
static int pxa_block(const Geo *g, int j0, int n) {
    const int kw = g->kw;
    if (n != L || L % PXQ) return 0;
    int f = 1;
    for (int t = 0; t < n; t++)
        for (int b = 1; b < kw; b++)
            if (g->cols[(j0 + t) * kw + b] != g->cols[(j0 + t) * kw] + b) return 0;
    for (int t0 = 0; t0 < L; t0 += PXQ) {
        int pat = 0;
        for (int c = 0; c + 1 < PXQ; c++) {
            const int step = g->cols[(j0 + t0 + c + 1) * kw] - g->cols[(j0 + t0 + c) * kw];
            if (step != 0 && step != 1) return 0;
            pat |= step << c;
        }
        if (!PXALL && pat != 0 && pat != PXSTEP) return 0;
        f |= pat << (1 + 3 * (t0 / PXQ));
    }
    return f;
}

/* whether pxa_kern is compiled for C channels and the call's window width (pxf_rows' dispatch) */
static int pxa_dims(const Geo *g, int C) {
    return (C == 2 * L || C == 4 * L) && (g->kw == 3 || g->kw == 5 || g->kw == 7);
}

/* the pair tables pp of a plan: per block bk, pp->n[bk] lists in groups from pp->g[4 pp->s[bk]]
 * (pair_groups). The backward's lists (backward 1) are the key columns its live lanes read,
 * [pp->a[bk], pp->a[bk] + pp->n[bk]), their items the lanes reading them (a query reads both columns
 * of a group at adjacent slots in the interior: its q and dO are loaded once for the two); the
 * forward's (backward 0: P V, and the backward's dQ) are its lanes, their items the key columns
 * they read (a key's values are loaded once for the two queries of a group), and pp->f[bk] says
 * whether pxa_kern takes the block (pxa_block). */
static void pix_pairs(const Geo *g, const Plan *pl, int backward, PixPairs *pp) {
    const int nb = pl->nb, kw = g->kw;
    int groups = 0, pairs = 0;
    pp->a = malloc(sizeof(int) * 5 * nb);
    pp->n = pp->a + nb;
    pp->s = pp->a + 2 * nb;
    pp->f = pp->a + 3 * nb;
    pp->j = pp->a + 4 * nb;
    for (int bk = 0; bk < nb; bk++) {
        const int j0 = (int)pl->jb[bk], n = pl->blocks[bk].n;
        int lo = g->Wk, hi = -1;
        for (int t = 0; t < n; t++)
            for (int b = 0; b < kw; b++) {
                int x = g->cols[(j0 + t) * kw + b];
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
        pp->a[bk] = lo;
        pp->n[bk] = backward ? hi - lo + 1 : n;
        pp->j[bk] = j0;
        pp->f[bk] = backward ? 0 : pxa_block(g, j0, n);
        pp->s[bk] = groups;
        groups += (pp->n[bk] + PIXK - 1) / PIXK;
        pairs += n * kw;
    }
    pp->g = malloc(sizeof(int) * 4 * (groups > 0 ? groups : 1));
    pp->e = malloc(sizeof(int) * 3 * (pairs > 0 ? pairs : 1));
    int ne = 0;
    for (int bk = 0; bk < nb; bk++) {
        const int j0 = (int)pl->jb[bk], n = pl->blocks[bk].n, nl = pp->n[bk];
        int *st = calloc(nl + 2, sizeof(int)), *its = malloc(sizeof(int) * 2 * n * kw);
        if (backward) { /* by key column (counting sort), lanes ascending within one */
            for (int t = 0; t < n; t++)
                for (int b = 0; b < kw; b++) st[g->cols[(j0 + t) * kw + b] - pp->a[bk] + 1]++;
            for (int x = 1; x <= nl + 1; x++) st[x] += st[x - 1];
            int *fill = malloc(sizeof(int) * (nl + 1));
            memcpy(fill, st, sizeof(int) * (nl + 1));
            for (int t = 0; t < n; t++)
                for (int b = 0; b < kw; b++) {
                    int k = fill[g->cols[(j0 + t) * kw + b] - pp->a[bk]]++;
                    its[2 * k] = t;
                    its[2 * k + 1] = b * L + t;
                }
            free(fill);
        } else /* by lane, key columns ascending within one (insertion sort of its kW slots) */
            for (int t = 0; t < n; t++) {
                st[t + 1] = st[t] + kw;
                int *it = its + 2 * st[t];
                for (int b = 0; b < kw; b++) {
                    int x = g->cols[(j0 + t) * kw + b], k = b;
                    for (; k > 0 && it[2 * (k - 1)] > x; k--) { it[2 * k] = it[2 * k - 2]; it[2 * k + 1] = it[2 * k - 1]; }
                    it[2 * k] = x;
                    it[2 * k + 1] = b * L + t;
                }
            }
        pair_groups(nl, st, its, pp->g + 4 * pp->s[bk], pp->e, &ne);
        free(st);
        free(its);
    }
}

/* the kernels of the pixel routes (na_cpu_pix.c, a unit of its own: it compiles beside na_cpu.c); pxl_rows:
 * the 1-D backward's dK / dV of a super-block of affine blocks (na_cpu_line_bwd.c) */
HIDDEN void pix_rows(int nd, int ndv, const Plan *pl, int bk, int kw, const Urow *u, vt *const *ds, vt *const *p,
                     const T *const *qrow, const T *const *grow, const long *toff, T *dk, T *dv, const long *px,
                     T scale);
HIDDEN void pxl_rows(int nd, int ndv, int nr, int n, long nkp, const T *ds, const T *p, const T *q0, long qst,
                     const T *g0, long gst, long J, long rel, T *dk, T *dv, const long *px, T scale);
HIDDEN void pxf_rows(const Geo *g, const PixPairs *pp, int bk, const vt *sw, vt inv, const T *const *vr, int C, T *o,
                     long ost, int nt);

/* the backward's pixel route serves this plan's shape: whole channel vectors (na_plan builds its pair
 * tables only then). Rows in one column chunk sum into the pixel ring; rows cut into column chunks
 * (1-D 4096 k33) add into dK / dV in place (pix_zero clears each key column before a chunk first
 * reaches it: a chunk's keys are summed for every plane before the next chunk's) */
static int pix_shape(const Geo *g, const Plan *pl) {
    (void)pl;
    return g->D % L == 0 && g->Dv % L == 0 && g->D / L <= PIXMAX && g->Dv / L <= PIXMAX;
}

/* ... and this call: q and dO with unit channel stride (bf16 q: its rows widened first, pix_widen) */
static int pix_ok(const Geo *g, const Plan *pl, const long *sq, const long *sd) {
    return pix_shape(g, pl) && sq[3] == 1 && sd[3] == 1;
}

/* query row i, columns [j_lo, j_lo + n_j) of plane (b, h) of the bf16 q (element strides sq, channels
 * contiguous) widened into dst (n_j, C): the pixel route's q where bf16 (fp32: read in place) */
static void pix_widen(const void *q, const long *sq, int b, int h, int i, int W, long j_lo, long n_j, int C, T *dst) {
    const uint16_t *src = (const uint16_t *)q + b * sq[0] + h * sq[2];
    for (long j = 0; j < n_j; j++)
        for (int d = 0; d < C; d += L) st(dst + j * C + d, ld_h(src + ((long)i * W + j_lo + j) * sq[1] + d));
}

/* a key row of dK / dV (C channels, Wk pixels) from x, or zeros (x NULL), streamed to plane (b, h) of
 * the dense, pixel-major y: each row leaves once, final */
static void pix_row_out(const Geo *g, int b, int h, int r, int C, const T *x, T *y) {
    T *y0 = y + (((long)b * g->Hk + r) * g->Wk * g->heads + h) * (long)C;
    const long st_ = (long)g->heads * C;
    for (long j = 0; j < g->Wk; j++)
        for (int d = 0; d < C; d += L) st_nt(y0 + j * st_ + d, x ? ld(x + j * C + d) : (vt){0});
}

/* key columns [x0, x1) of every key row of plane (b, h) of dK and of dV zeroed: the in-place route's
 * columns before the first chunk that reaches them (pix_shape) */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) /* no memset call per pixel */
static void pix_zero(const Geo *g, int b, int h, long x0, long x1, T *dk, T *dv) {
    for (int r = 0; r < g->Hk; r++)
        for (long j = x0; j < x1; j++) {
            const long px = ((long)b * g->Hk + r) * g->Wk + j; /* whole vectors (pix_shape) */
            for (int d = 0; d < g->D; d += L) st(dk + (px * g->heads + h) * g->D + d, (vt){0});
            for (int d = 0; d < g->Dv; d += L) st(dv + (px * g->heads + h) * g->Dv + d, (vt){0});
        }
}

/* key rows [*done, upto] into the pixel ring (R rows of dK and of dV, (Wk, C) each, row r in slot
 * r % R: the key planes' ring, ring_rows): the row leaving each slot streamed out first (no later
 * tile adds to it), the slot zeroed; *done = upto + 1 */
static void pix_in(const Geo *g, int R, int b, int h, int *done, int upto, T *rk, T *rv, T *dk, T *dv) {
    const long kr = (long)g->Wk * g->D, vr = (long)g->Wk * g->Dv;
    for (; *done <= upto; (*done)++) {
        int r = *done, slot = r % R;
        if (r >= R) {
            pix_row_out(g, b, h, r - R, g->D, rk + slot * kr, dk);
            pix_row_out(g, b, h, r - R, g->Dv, rv + slot * vr, dv);
        }
        memset(rk + slot * kr, 0, sizeof(T) * kr);
        memset(rv + slot * vr, 0, sizeof(T) * vr);
    }
}

/* the end of a plane: the rows still in the ring out, then zeros for the rows no tile read */
static void pix_end(const Geo *g, int R, int b, int h, int done, const T *rk, const T *rv, T *dk, T *dv) {
    const long kr = (long)g->Wk * g->D, vr = (long)g->Wk * g->Dv;
    for (int r = done > R ? done - R : 0; r < done; r++) {
        pix_row_out(g, b, h, r, g->D, rk + (r % R) * kr, dk);
        pix_row_out(g, b, h, r, g->Dv, rv + (r % R) * vr, dv);
    }
    for (int r = done; r < g->Hk; r++) {
        pix_row_out(g, b, h, r, g->D, NULL, dk);
        pix_row_out(g, b, h, r, g->Dv, NULL, dv);
    }
}

/* the forward on the values' layout: V rows copied into a pixel ring (no transposes), the output of
 * each query summed in registers over its window, PIXK queries at a time (pix_pairs' forward
 * groups), and stored where it goes. Used where the value channels are whole vectors with unit
 * stride, at least 128 bytes a pixel, and the rows run as one column chunk: where it measured faster
 * than the transposed P V (tile_apply), which shares each value load among a tile's query rows
 * (fp32 2-D 64^2 d32 k7 1.12x on AVX-512, 1.05x on AVX2; dilated causal 40x37 d32 1.14x / 1.13x;
 * not 96^2 d16: 0.93x / 0.95x). A window of more rows than columns (3-D 16^3 d32 k5: the tiles'
 * flattened rows share more) takes it on AVX2 only: 0.82x / 0.92x before pxa_kern, on AVX2
 * (Zen 3) 1.05-1.07x with it and 1.08-1.17x with pxf_ring_rows; AVX-512 not measured since.
 * pxf_shape: the plan's shape (na_plan builds its pair tables only then); pxf_ok: the call's too. */
static int pxf_shape_of(const Geo *g, const Plan *pl, int C) {
    return pl->nc == 1 && C % L == 0 && C / L <= PIXMAX && C * (long)sizeof(T) >= 128 &&
           (g->kh <= g->kw || NA_VBYTES == 32);
}

static int pxf_shape(const Geo *g, const Plan *pl) { return pxf_shape_of(g, pl, g->Dv); }

static int pxf_ok(const Geo *g, const Plan *pl, const long *sv) { return pxf_shape(g, pl) && sv[3] == 1; }

/* The backward's dQ = scale dS K the same way (where the head dim takes the forward's route: 2-D
 * 64^2 d32), the key rows copied into a pixel ring and dQ stored in place: pq_shape the plan's shape
 * (na_plan builds its per-lane tables, pl->pq, only then), pq_ok the call's too */
static int pq_shape(const Geo *g, const Plan *pl) { return pxf_shape_of(g, pl, g->D); }

static int pq_ok(const Geo *g, const Plan *pl, const long *sk) { return pl->pq.a && sk[3] == 1; }

/* the pixel ring's rows that tile rows rowi[m < nm] read: vr[m kh + a] is slot row a's (pxf_rows' vr;
 * the ring slot's division done once per tile row, not per block and query group) */
static void pxf_ring_rows(const Geo *g, int ring, const int *rowi, int nm, const T *xn, int C, const T **vr) {
    for (int m = 0; m < nm; m++)
        for (int a = 0; a < g->kh; a++) vr[m * g->kh + a] = xn + (long)(g->rows[rowi[m] * g->kh + a] % ring) * g->Wk * C;
}

/* key rows [*done, upto] of plane (b, h) of x (C channels, element strides xs; bf16 widened) into the
 * pixel ring xn (R rows of (Wk, C), row r in slot r % R); *done = upto + 1 */
static void pxf_in(const Geo *g, int R, int b, int h, int *done, int upto, const void *x, int bf, const long *xs,
                   int C, T *xn) {
    for (; *done <= upto; (*done)++) {
        const int r = *done;
        T *dst = xn + (long)(r % R) * g->Wk * C;
        for (long j = 0; j < g->Wk; j++) {
            const long e = b * xs[0] + ((long)r * g->Wk + j) * xs[1] + h * xs[2];
            for (int d = 0; d < C; d += L)
                st(dst + j * C + d, bf ? ld_h((const uint16_t *)x + e + d) : ld((const T *)x + e + d));
        }
    }
}

#endif
