/* The work plan of one na_cpu.c call (included by it after na_cpu_rows.h): the column blocks
 * of a row, their column chunks (sized from the L2 cache), the tiles of query rows with the key
 * rows each reads, and the backward's per-block shuffle tables. */
#ifndef NA_CPU_PLAN_H
#define NA_CPU_PLAN_H
#include <unistd.h>

/* The work plan of a call: the column blocks of a row (the same for every row), cut into column
 * chunks whose keys stay in cache (see make_plan), and the tiles of MR query rows with their
 * key rows (row_order, plan_tiles below; the micro-kernels in na_cpu_rows.h). */
/* the pixel routes' pair tables of a plan (pix_pairs in na_cpu_pix.h; a NULL where none): per block
 * bk, n[bk] lists from its first column a[bk] (the backward's: key columns) or lane (the forward's),
 * in groups from g[4 s[bk]], entries e; the forward's f[bk]: nonzero where pxa_kern takes the block (every
 * lane its own query, slot b of lane t at key column st[t] + b, and in each group of PXQ lanes each start
 * one column after the one before or the same: the group's pattern, pxa_block), j[bk] its first query
 * column */
typedef struct {
    int *a, *n, *s, *g, *e, *f, *j;
} PixPairs;

typedef struct {
    int nb, nc, nt;
    Lanes *blocks;
    long *bases;
    int *cb;       /* chunk c: blocks [cb[c], cb[c+1]) */
    long *cx0, *cx1; /* chunk c: key columns [cx0, cx1) transposed */
    int *order, *ustart;
    long *jb; /* first query column of each block, nb + 1 */
    Urow *ur;
    long qw; /* widest chunk in query columns (row buffers' pitch) */
    long kp; /* the key planes' pitch (Geo.kp of the calls on this plan) */
    int backward; /* 0 forward, 1 backward with dK / dV, 2 without */
    /* backward: the fuse tables (see fuse_tables) */
    vi *shifts, *folds;
    int *shix, *fused, *fstart;
    /* backward, key-centric dK / dV (unfused blocks, see key_sums in na_cpu.c): keyc[bk] when
     * block bk's slot b reads key column jb[bk] + relpat[b] + lane (one pattern for the row);
     * kpad: zero columns on each side of the row buffers those sums read (0: no such block) */
    int *keyc;
    long *relpat, kpad;
    /* the pixel routes' pair tables: px the backward's dK / dV (per key column) or the forward's P V
     * (per lane), pq the backward's dQ (per lane); a NULL where the plan's shape takes no such route */
    PixPairs px, pq;
    /* na_plan's plans: the key planes (and the backward's dK / dV planes) hold a ring of `ring`
     * rows (key row r in slot r % ring; the Urows' rows are slots) and the rows up to upto[t] are
     * in it before tile t (see ring_rows); make_plan alone leaves ring Hk and upto NULL */
    int ring, *upto;
} Plan;

/* query rows in tile order: greedily, each tile's first row is the first row not yet placed and
 * each next row the unplaced one that adds the fewest new key rows to the tile's union (ties:
 * the lowest index), so a tile's rows share key rows (3-D, flattened (x, y) rows: a 2 x 2 square
 * shares more than 4 consecutive rows of one x; 16^3 k5: 2125 key rows over the tiles, not 2240);
 * candidates are the rows reading a key row of the first. order[Hq] */
static void row_order(const Geo *g, int *order) {
    const int Hq = g->Hq, kh = g->kh, Hk = g->Hk;
    int *cnt = calloc(Hk + 1, sizeof(int)), *rdr = malloc(sizeof(int) * (size_t)Hq * kh);
    int *mark = calloc(Hk, sizeof(int)), *cand = malloc(sizeof(int) * (size_t)kh * kh);
    char *done = calloc(Hq, 1);
    int *seen = calloc(Hq, sizeof(int));
    for (int i = 0; i < Hq; i++)
        for (int a = 0; a < kh; a++) cnt[g->rows[i * kh + a] + 1]++;
    for (int r = 0; r < Hk; r++) cnt[r + 1] += cnt[r];
    int *fill = malloc(sizeof(int) * (Hk + 1));
    memcpy(fill, cnt, sizeof(int) * (Hk + 1));
    for (int i = 0; i < Hq; i++)
        for (int a = 0; a < kh; a++) {
            int r = g->rows[i * kh + a];
            if (!(fill[r] > cnt[r] && rdr[fill[r] - 1] == i)) rdr[fill[r]++] = i;
        }
    int n = 0, first = 0, stamp = 0;
    while (n < Hq) {
        while (done[first]) first++;
        stamp++;
        int seed = first, nc = 0;
        order[n++] = seed;
        done[seed] = 1;
        for (int a = 0; a < kh; a++) mark[g->rows[seed * kh + a]] = stamp;
        for (int a = 0; a < kh; a++) {
            int r = g->rows[seed * kh + a];
            for (int e = cnt[r]; e < fill[r]; e++)
                if (!done[rdr[e]] && seen[rdr[e]] != stamp && nc < kh * kh) {
                    seen[rdr[e]] = stamp;
                    cand[nc++] = rdr[e];
                }
        }
        for (int m = 1; m < MR && n < Hq; m++) {
            int best = -1, bnew = 1 << 30;
            for (int x = 0; x < nc; x++) {
                int c = cand[x];
                if (done[c]) continue;
                int add = 0; /* new key rows; counting stops once it is worse than the best */
                for (int a = 0; a < kh && add <= bnew; a++) add += mark[g->rows[c * kh + a]] != stamp;
                if (add < bnew || (add == bnew && c < best)) best = c, bnew = add;
            }
            if (best < 0) { /* no row shares a key row: the next unplaced one */
                for (best = first; done[best]; best++) {}
            }
            order[n++] = best;
            done[best] = 1;
            for (int a = 0; a < kh; a++) mark[g->rows[best * kh + a]] = stamp;
        }
    }
    free(cnt); free(rdr); free(mark); free(cand); free(done); free(fill); free(seen);
}

/* the Urows of every tile: tiles of MR rows of order; tile t's rows order[t*MR ...], its Urows
 * ur[start[t] .. start[t+1]). ur: Hq * kh entries at most. */
static int cmp_long(const void *x, const void *y) {
    long a = *(const long *)x, b = *(const long *)y;
    return (a > b) - (a < b);
}

static void plan_tiles(const Geo *g, const int *order, Urow *ur, int *start) {
    int nt = (g->Hq + MR - 1) / MR, ne = 0;
    long *pairs = malloc(sizeof(long) * MR * g->kh); /* key row << 32 | (m kh + a), sorted */
    for (int t = 0; t < nt; t++) {
        start[t] = ne;
        int m0 = t * MR, nm = g->Hq - m0 < MR ? g->Hq - m0 : MR, np = 0;
        for (int m = 0; m < nm; m++)
            for (int a = 0; a < g->kh; a++)
                pairs[np++] = (long)g->rows[order[m0 + m] * g->kh + a] << 32 | (long)(m * g->kh + a);
        if (np > 256) qsort(pairs, np, sizeof(long), cmp_long);
        else /* a tile's few pairs: insertion sort (qsort's calls cost more) */
            for (int p = 1; p < np; p++) {
                long x = pairs[p];
                int q = p;
                for (; q > 0 && pairs[q - 1] > x; q--) pairs[q] = pairs[q - 1];
                pairs[q] = x;
            }
        for (int p = 0; p < np; p++) {
            int r = (int)(pairs[p] >> 32), low = (int)(pairs[p] & 0xffffffff);
            /* a new Urow also where the row's query row is in it already: a window holding one key
             * row at two slots (a masked slot clamped onto a valid row: fewer key rows than the
             * kernel) would give two Urows of one mask different query rows, and the runs by mask
             * (tile_apply) take the first Urow's rows for the run */
            if (p == 0 || r != ur[ne - 1].row || ur[ne - 1].n == MR || ur[ne - 1].mask >> (low / g->kh) & 1) {
                ur[ne].row = r;
                ur[ne].n = 0;
                ne++;
            }
            Urow *u = ur + ne - 1;
            u->m[u->n] = low / g->kh;
            u->a[u->n] = low % g->kh;
            u->mask = (u->n ? u->mask : 0) | 1 << u->m[u->n];
            u->n++;
        }
        /* runs of Urows reading the same query rows (tile_apply sums a run in registers): stable
         * insertion sort by mask, key rows ascending within a run */
        for (int x = start[t] + 1; x < ne; x++) {
            Urow v = ur[x];
            int y = x;
            for (; y > start[t] && ur[y - 1].mask > v.mask; y--) ur[y] = ur[y - 1];
            ur[y] = v;
        }
    }
    start[nt] = ne;
    free(pairs);
}

/* the L2 cache (bytes) the plans budget for: the host's, or TPLAYERS_NA_L2's (tests run the plans of
 * another host's cache; na_cpu_plans.l2_override checks the value before any plan is built) */
static long l2_bytes(void) {
    const char *e = getenv("TPLAYERS_NA_L2");
    long n = e && *e ? strtol(e, NULL, 10) : sysconf(_SC_LEVEL2_CACHE_SIZE);
    return n > 0 ? n : 1L << 20;
}

/* whether na_forward streams its output past the caches (out_block): where the output takes half
 * the L2 or more, it cannot stay there beside the key planes and the inputs passing through, and
 * each store of a cached line first reads it (1x64x64, 4 heads, d32, a 2 MiB output with a 2 MiB
 * L2: forward 1.04-1.09x, 1.03x with a consumer reading the output; 16^3 k5: 1.05x, 1.00x with a
 * consumer; benchmarks/RESULTS.md) */
static int output_streamed(const Geo *g) {
    return 2 * (long)g->B * g->Hq * g->Wq * g->heads * g->Dv * (long)sizeof(T) >= l2_bytes();
}

/* Chunks: all columns at once where the key rows a tile reads and its query rows ((MR + kH - 1) +
 * MR rows of D + Dv channels, twice that in backward with dK / dV) fit half the L2 cache over the
 * whole row; else runs of column blocks whose key span fits a quarter of it, shared by the heads
 * (long 1-D rows: a row of 4096 keys at d32 is 1 MiB, and its transposed planes fell out of L2
 * before they were read). Half, not the quarter the chunks get: with a 512 KiB L2 (Zen 3) a
 * quarter cut 2-D 64^2 d32 k7's forward rows (196 KiB) into chunks, which also keeps them off the
 * forward's pixel route: whole rows 1.17-1.21x there. Sets g->kp, the key planes' pitch, to the
 * widest span. */
static void make_plan(Geo *g, int backward, Plan *pl) {
    pl->blocks = row_blocks(g, &pl->nb, &pl->bases);
    int nb = pl->nb, kw = g->kw;
    pl->cb = malloc(sizeof(int) * (nb + 1));
    pl->cx0 = malloc(sizeof(long) * nb);
    pl->cx1 = malloc(sizeof(long) * nb);
    long nq = g->Hq < MR ? g->Hq : MR, rows = nq + g->kh - 1;
    long col = (rows + nq) * (g->D + g->Dv) * (long)sizeof(T) * (backward ? 2 : 1), budget = l2_bytes() / 4;
    /* chunked rows: the calls run a chunk's heads in turn, so a chunk's columns of every head
     * (whole cache lines of the pixel-major tensors) share the budget */
    long most = budget / (col * (backward ? 1 : g->heads)), *jb = pl->jb = malloc(sizeof(long) * (nb + 1));
    if (most < 4 * L) most = 4 * L;
    for (int bk = 0, j = 0; bk <= nb; bk++) { jb[bk] = j; if (bk < nb) j += pl->blocks[bk].n; }
    int nc = 0;
    if ((long)g->Wk * col <= 2 * budget) {
        pl->cb[0] = 0; pl->cx0[0] = 0; pl->cx1[0] = g->Wk; nc = 1;
    } else
        for (int bk = 0; bk < nb;) {
            long lo = pl->bases[(long)bk * kw], hi = pl->bases[(long)bk * kw + kw - 1] + L;
            int e = bk + 1;
            for (; e < nb; e++) {
                long l2 = pl->bases[(long)e * kw], h2 = pl->bases[(long)e * kw + kw - 1] + L;
                long nlo = l2 < lo ? l2 : lo, nhi = h2 > hi ? h2 : hi;
                if (nhi - nlo > most) break;
                lo = nlo; hi = nhi;
            }
            pl->cb[nc] = bk; pl->cx0[nc] = lo; pl->cx1[nc] = hi < g->Wk ? hi : g->Wk; nc++;
            bk = e;
        }
    pl->cb[nc] = nb;
    pl->nc = nc;
    long sw = 0, qw = 0;
    for (int c = 0; c < nc; c++) {
        sw = pl->cx1[c] - pl->cx0[c] > sw ? pl->cx1[c] - pl->cx0[c] : sw;
        qw = jb[pl->cb[c + 1]] - jb[pl->cb[c]] > qw ? jb[pl->cb[c + 1]] - jb[pl->cb[c]] : qw;
    }
    g->kp = pl->kp = key_pitch(sw);
    pl->qw = key_pitch(qw);
    pl->backward = backward;
    pl->shifts = pl->folds = NULL;
    pl->shix = pl->fused = pl->fstart = pl->keyc = NULL;
    pl->relpat = NULL;
    pl->kpad = 0;
    pl->px = pl->pq = (PixPairs){0};
    pl->nt = (g->Hq + MR - 1) / MR;
    pl->order = malloc(sizeof(int) * g->Hq);
    pl->ustart = malloc(sizeof(int) * (pl->nt + 1));
    pl->ur = malloc(sizeof(Urow) * (size_t)g->Hq * g->kh);
    row_order(g, pl->order);
    plan_tiles(g, pl->order, pl->ur, pl->ustart);
    pl->ring = g->Hk;
    pl->upto = NULL;
}

/* The key planes as a ring of rows: the rows enter in order, before tile t those up to upto[t]
 * (the most any tile up to t reads), so a ring of the most rows from a tile's lowest key row to
 * its upto holds every row each tile reads, and a row leaving it is read by no later tile (the
 * backward writes its dK / dV out then). The planes stay in L2 across the heads and their scratch
 * does not grow with the height (2-D 96^2 k7: 9 of 96 rows; 3-D 16^3 k5: 93 of 256). Slots not yet
 * filled in a call may be read into lanes a block then drops (never into a live lane). */
static void ring_rows(const Geo *g, Plan *pl) {
    int M = -1, R = 1;
    pl->upto = malloc(sizeof(int) * pl->nt);
    for (int t = 0; t < pl->nt; t++) {
        int lo = g->Hk;
        for (int x = pl->ustart[t]; x < pl->ustart[t + 1]; x++) {
            lo = pl->ur[x].row < lo ? pl->ur[x].row : lo;
            M = pl->ur[x].row > M ? pl->ur[x].row : M;
        }
        pl->upto[t] = M;
        R = M - lo + 1 > R ? M - lo + 1 : R;
    }
    pl->ring = R;
    for (int x = 0; x < pl->ustart[pl->nt]; x++) pl->ur[x].row %= R;
}

/* the start of a call on a plan: its geometry (the key planes' pitch from the plan) and the element
 * strides (batch, pixel, head, channel) of q, k and v: sx's 12 (q's four, k's, v's; channel strides
 * 1, e.g. q, k and v as views of one qkv tensor, pixels 3 heads * D apart) or, sx NULL, the dense
 * ones; returns the plan */
static Plan open_call(Geo *g, const int64_t *dims, const int32_t *rows, const int32_t *cols, const T *table,
                      double scale, const void *plan, const int64_t *sx, long *sq, long *sk, long *sv) {
    const Plan pl = *(const Plan *)plan;
    *g = make_geo(dims, rows, cols, table, scale);
    g->kp = pl.kp;
    if (sx)
        for (int i = 0; i < 4; i++) { sq[i] = sx[i]; sk[i] = sx[4 + i]; sv[i] = sx[8 + i]; }
    else {
        dense_strides(g->Hq, g->Wq, g->heads, g->D, sq);
        dense_strides(g->Hk, g->Wk, g->heads, g->D, sk);
        dense_strides(g->Hk, g->Wk, g->heads, g->Dv, sv);
    }
    return pl;
}

static void free_plan(Plan *pl) {
    free(pl->shifts); free(pl->folds); free(pl->shix); free(pl->fused); free(pl->fstart);
    free(pl->keyc); free(pl->relpat);
    free(pl->px.a); free(pl->px.g); free(pl->px.e); free(pl->pq.a); free(pl->pq.g); free(pl->pq.e);
    for (int bk = 0; bk < pl->nb; bk++) free(pl->blocks[bk].inv);
    free(pl->blocks); free(pl->bases); free(pl->cb); free(pl->cx0); free(pl->cx1);
    free(pl->order); free(pl->ustart); free(pl->ur); free(pl->jb); free(pl->upto);
}


/* per block: fused[bk] when its kW slots' keys lie within 2L columns of slot 0's base (2), or
 * within L of it (1: the second register's shuffles and sums are skipped), then per
 * slot the two shuffle masks that move each key's first lane into place, each with the lanes it
 * fills (shifts, 4 kW per block: index, keep, index, keep),
 * and the folds that first add into that lane the lanes sharing its key (borders: windows shifted
 * inside the image): block bk's rounds are folds[2 fstart[bk] ...) as (shuffle, mask) pairs,
 * fstart[nb] in all (the caller frees *folds) */
static int same_shifts(const Geo *g, const Plan *pl, int x, int y) {
    const Lanes *a = pl->blocks + x, *b = pl->blocks + y;
    if (a->mode || b->mode || a->n != b->n) return 0;
    const long *ba = pl->bases + (long)x * g->kw, *bb = pl->bases + (long)y * g->kw;
    for (int s = 1; s < g->kw; s++)
        if (ba[s] - ba[0] != bb[s] - bb[0]) return 0;
    return 1;
}

/* shix[bk]: the block whose shift tables block bk uses (the interior blocks of a row share one;
 * only the tables of distinct blocks are written: a long 1-D row has 256 blocks) */
static void fuse_tables(const Geo *g, const Plan *pl, vi *shifts, int *shix, int *fused, int *fstart, vi **folds) {
    int total = 0, cap = pl->nb + L;
    vi *pool = aligned_alloc(_Alignof(vi), sizeof(vi) * 2 * cap);
    for (int bk = 0; bk < pl->nb; bk++) {
        const long *base = pl->bases + (long)bk * g->kw;
        const Lanes *ln = pl->blocks + bk;
        int first[L], count[L], maxp = 0, rounds = 0;
        for (int u = 0; u < L; u++) first[u] = -1, count[u] = 0;
        fstart[bk] = total;
        shix[bk] = bk;
        if (bk > 0 && same_shifts(g, pl, shix[bk - 1], bk)) { /* mode 0: no folds either */
            shix[bk] = shix[bk - 1];
            fused[bk] = fused[bk - 1];
            continue;
        }
        for (int t = 0; t < ln->n; t++) {
            int u = ln->perm[t];
            maxp = u > maxp ? u : maxp;
            if (first[u] < 0) first[u] = t;
            count[u]++;
            rounds = count[u] - 1 > rounds ? count[u] - 1 : rounds;
        }
        if (total + rounds > cap) {
            cap = 2 * (total + rounds);
            vi *grown = aligned_alloc(_Alignof(vi), sizeof(vi) * 2 * cap);
            memcpy(grown, pool, sizeof(vi) * 2 * total);
            free(pool);
            pool = grown;
        }
        for (int r = 0; r < rounds; r++) { /* round r: lane first[u] takes the (r + 1)-th lane of key u */
            vi dup = {0}, mask = {0};
            for (int u = 0; u < L; u++) {
                int seen = 0;
                for (int t = 0; t < ln->n && first[u] >= 0; t++)
                    if (ln->perm[t] == u && seen++ == r + 1) { dup[first[u]] = t; mask[first[u]] = -1; }
            }
            pool[2 * (total + r)] = dup;
            pool[2 * (total + r) + 1] = mask;
        }
        total += rounds;
        fused[bk] = 1;
        for (int b = 0; b < g->kw; b++) {
            long r = base[b] - base[0];
            if (r < 0 || r + maxp >= 2 * L) { fused[bk] = 0; break; }
            if (r + maxp >= L) fused[bk] = 2; /* some key past the first L columns: both registers */
            for (int u = 0; u < L; u++) {
                long lo = u - r, hi = u + L - r;
                vi *sh = shifts + 4 * ((long)bk * g->kw + b);
                sh[0][u] = lo >= 0 && lo < L && first[lo] >= 0 ? first[lo] : L;
                sh[2][u] = hi >= 0 && hi < L && first[hi] >= 0 ? first[hi] : L;
                sh[1][u] = sh[0][u] < L ? -1 : 0; /* the lanes a one-register shuffle keeps */
                sh[3][u] = sh[2][u] < L ? -1 : 0;
#if NREG != 32 /* one-register permutes (sl_kern): a slot's keys span < L columns, so columns u and
                * u + L never both take a lane; index 0 is masked off */
                sh[0][u] = sh[0][u] < L ? sh[0][u] : sh[2][u] < L ? sh[2][u] : 0;
#endif
            }
        }
    }
    fstart[pl->nb] = total;
    *folds = pool;
}

/* the blocks whose dK / dV run as key-centric sums (unfused and unshuffled, all with the slot
 * offsets of one interior block; the others keep kv_slots) and the row buffers' padding */
static void key_blocks(const Geo *g, Plan *pl) {
    int nb = pl->nb, kw = g->kw, ref = -1;
    pl->keyc = calloc(nb, sizeof(int));
    pl->relpat = malloc(sizeof(long) * kw);
    for (int bk = nb / 2; bk < nb && ref < 0; bk++)
        if (!pl->fused[bk] && pl->blocks[bk].mode == 0) ref = bk;
    for (int bk = 0; bk < nb / 2 && ref < 0; bk++)
        if (!pl->fused[bk] && pl->blocks[bk].mode == 0) ref = bk;
    if (ref < 0) return;
    long lo = 0, hi = 0;
    for (int b = 0; b < kw; b++) pl->relpat[b] = pl->bases[(long)ref * kw + b] - pl->jb[ref];
    for (int bk = 0; bk < nb; bk++) {
        int same = !pl->fused[bk] && pl->blocks[bk].mode == 0;
        for (int b = 0; b < kw; b++) {
            long rel = pl->bases[(long)bk * kw + b] - pl->jb[bk];
            same &= rel == pl->relpat[b];
            lo = rel < lo ? rel : lo;
            hi = rel > hi ? rel : hi;
        }
        pl->keyc[bk] = same;
    }
    pl->kpad = (hi - lo + 3 * L - 1) / L * L; /* >= the offsets' span + 2L (see key_sums) */
}

/* the plan of a call, built once per shape and freed by na_plan_free (defined in na_cpu.c) */
void *na_plan(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward);
void na_plan_free(void *pl);

/* where a call's carving of its scratch starts: PAD elements in (kload's mode 3 reads up to L - 1
 * elements before its plane, the first carved; scratch_of counts them) */
static T *scratch_start(T *scratch) { return scratch + PAD; }

/* scratch: n elements carved from *next, then PAD zeros (shifted loads may run past them) */
static T *carve(T **next, long n) { T *p = *next; memset(p + n, 0, PAD * sizeof(T)); *next = p + n + PAD; return p; }

/* n zeroed vectors, aligned (freed by the caller) */
static vt *vec_alloc(long n) {
    vt *p = aligned_alloc(_Alignof(vt), sizeof(vt) * (n > 0 ? n : 1));
    memset(p, 0, sizeof(vt) * (n > 0 ? n : 1));
    return p;
}

#endif
