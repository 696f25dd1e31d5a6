/* Row-blocked micro-kernels of na_cpu.c (included by it after na_cpu_blocks.h): a tile is up to
 * MR query rows x one block of L query columns. The rows' windows overlap in their key rows (in the
 * interior of a 2-D image with kernel 7, 4 consecutive rows read 10 key rows, not 28), so each
 * key vector loaded from a key row (the shifted load of slot b) is multiplied into the scores of
 * every row of the tile that reads that key row: register-blocked FMAs, nm rows x gb slots of
 * accumulators per pass over the channels, the same for P.V (nm rows x GV channels; the dK / dV
 * sums of the backward, nm rows summed per key vector, are in na_cpu_kv.h). Only the
 * scores a query needs are computed (no union waste): a tile's key rows are listed with, per row,
 * the (query row, slot) pairs that read it (Urow), built once per call from the window tables.
 * The register blocks follow the vector registers of the ISA (32 with AVX-512, else 16). */
#ifndef NA_CPU_ROWS_H
#define NA_CPU_ROWS_H

#ifndef NA_ROWS
#if NREG == 32
#define NA_ROWS 4
#else
#define NA_ROWS 3
#endif
#endif
#define MR NA_ROWS /* query rows per tile */
#define GBMAX 8    /* score slots per register block at most */
#define NFMAX 3    /* border folds held in registers by the dK / dV kernel (more: from memory) */

/* slots per score pass for nm rows: nm * gb accumulators + nm query vectors + a key vector */
static int gb_max(int nm) {
    int g = (NREG - 2 - nm) / nm;
    return g > GBMAX ? GBMAX : g < 1 ? 1 : g;
}
/* channels per P.V pass and per dK / dV pass for nm rows (compile-time after inlining; with 16
 * registers, 3 rows x 4 channels left no register for the value vector: measured alone 85 -> 99
 * GFLOP/s with 3 channels, AVX2) */
#define GV_OF(nm) ((nm) <= 2 && NREG == 32 ? 8 : (nm) == 1 ? 8 : NREG == 32 || (nm) == 2 ? 4 : 3)
#define CB_OF(nm) (NREG == 32 ? ((nm) <= 2 ? 4 : 3) : ((nm) == 1 ? 3 : 2))

/* one key row of a tile: the n (query row m[j], slot row a[j]) pairs that read it */
typedef struct {
    int row, n, mask; /* mask: bit m set for each query row m[j] */
    int m[MR], a[MR];
} Urow;

/* x, kept in a register: GCC otherwise folds a loaded weight into each FMA that uses it as a
 * memory operand (one load per FMA: P.V ran at half the speed of the scores in 3-D) */
INL vt in_reg(vt x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__("" : "+v"(x));
#endif
    return x;
}

/* *p, kept in one register: GCC otherwise hoists a register (or a stack slot) per constant offset
 * from it out of the loop, one for each of the up to 40 loads of pxa_pass, and reloads them */
INL void in_reg_ptr(const T **p) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__("" : "+r"(*p));
#endif
}

/* s_j[b] = sum_c q_j[c] * key[c][bo[b] (+ shuffle)] for nm query rows j and gb slots: one load
 * of each key vector per channel serves nm rows, one load of each query vector gb slots (both in
 * registers: GCC otherwise folds one operand's loads into every FMA, nm x gb loads per channel;
 * measured alone on 4 rows x 4 slots, 164 -> 253 GFLOP/s, AVX-512) */
INL void sc_kern(const int mode, const int nm, const int gb, const Lanes *ln, int C, const T *const *qp, long qs,
                 const T *kr, const long *bo, long ks, vt *const *sp) {
    vt acc[MR][GBMAX];
#pragma GCC unroll 8
    for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) acc[j][b] = (vt){0};
    const T *k0[GBMAX];
#pragma GCC unroll 8
    for (int b = 0; b < gb; b++) k0[b] = kr + bo[b];
    for (int c = 0; c < C; c++) {
        vt qv[MR];
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++) qv[j] = in_reg(ld(qp[j] + c * qs));
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) {
            vt kv = in_reg(kload(k0[b] + c * ks, mode, ln));
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) acc[j][b] += qv[j] * kv;
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) sp[j][b] = acc[j][b];
}

#define SC_CASE(F, MODE, NM, GB) \
    case (MODE) * 256 + (NM) * 16 + (GB): F(MODE, NM, GB, ln, C, qp, qs, kr, bo, ks, sp); return;
#define SC_GB_OF(F, MODE, NM) \
    SC_CASE(F, MODE, NM, 1) SC_CASE(F, MODE, NM, 2) SC_CASE(F, MODE, NM, 3) SC_CASE(F, MODE, NM, 4) \
    SC_CASE(F, MODE, NM, 5) SC_CASE(F, MODE, NM, 6) SC_CASE(F, MODE, NM, 7) SC_CASE(F, MODE, NM, 8)
#define SC_GB(MODE, NM) SC_GB_OF(sc_kern, MODE, NM)

static void sc_rows(int mode, int nm, int gb, const Lanes *ln, int C, const T *const *qp, long qs, const T *kr,
                    const long *bo, long ks, vt *const *sp) {
    switch (mode * 256 + nm * 16 + gb) {
        SC_GB(0, 1) SC_GB(1, 1) SC_GB(3, 1)
#if MR >= 2
        SC_GB(0, 2) SC_GB(1, 2) SC_GB(3, 2)
#endif
#if MR >= 3
        SC_GB(0, 3) SC_GB(1, 3) SC_GB(3, 3)
#endif
#if MR >= 4
        SC_GB(0, 4) SC_GB(1, 4) SC_GB(3, 4)
#endif
#if MR >= 5
        SC_GB(0, 5) SC_GB(1, 5) SC_GB(3, 5)
#endif
#if MR >= 6
        SC_GB(0, 6) SC_GB(1, 6) SC_GB(3, 6)
#endif
        default: abort();
    }
}


/* o_j[c] += sum over nu Urows (the same query rows: u[0].m) and kw slots b of p_j[a kW + b] *
 * val[row][c][bo[b] (+ shuffle)], C channels: the accumulators stay in registers across the Urows
 * (one read-modify-write of the o_j per GV_OF channels and group, not per key row) */
INL void ap_kern(const int mode, const int nm, const Lanes *ln, int kw, int C, const Urow *u, int nu,
                 vt *const *p, const T *y, long x0, const long *bo, long vs, vt *const *o) {
    const int GVN = GV_OF(nm);
    for (int c0 = 0; c0 < C; c0 += GVN) {
        vt acc[MR][8];
        long cs[8];
#pragma GCC unroll 8
        for (int q = 0; q < GVN; q++) cs[q] = (c0 + q < C ? c0 + q : C - 1) * vs;
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
            for (int q = 0; q < GVN; q++) acc[j][q] = (vt){0};
        for (int iu = 0; iu < nu; iu++) {
            const T *vr = y + (long)u[iu].row * C * vs - x0;
            const vt *pp[MR];
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) pp[j] = p[u[iu].m[j]] + u[iu].a[j] * kw;
#pragma GCC unroll 8
            for (int b = 0; b < kw; b++) {
                vt pv[MR];
                const T *v0 = vr + bo[b];
#pragma GCC unroll 8
                for (int j = 0; j < nm; j++) pv[j] = in_reg(pp[j][b]);
#pragma GCC unroll 8
                for (int q = 0; q < GVN; q++) {
                    vt vv = kload(v0 + cs[q], mode, ln);
#pragma GCC unroll 8
                    for (int j = 0; j < nm; j++) acc[j][q] += pv[j] * vv;
                }
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
            for (int q = 0; q < GVN; q++)
                if (c0 + q < C) o[u->m[j]][c0 + q] += acc[j][q];
    }
}

/* kW 3, 5 and 7 as constants (the slot loop unrolled: a loop of kW trips per key row exited every
 * few FMAs; 16^3 k5 forward 1.04-1.06x, 64^2 k7 1.04x, AVX2 1.04x, bit-identical) */
#define AP_CASE_OF(F, MODE, NM) \
    case (MODE) * 16 + (NM):                                                        \
        if (kw == 5) F(MODE, NM, ln, 5, C, u, nu, p, y, x0, bo, vs, o);             \
        else if (kw == 7) F(MODE, NM, ln, 7, C, u, nu, p, y, x0, bo, vs, o);        \
        else if (kw == 3) F(MODE, NM, ln, 3, C, u, nu, p, y, x0, bo, vs, o);        \
        else F(MODE, NM, ln, kw, C, u, nu, p, y, x0, bo, vs, o);                    \
        return;
#define AP_CASE(MODE, NM) AP_CASE_OF(ap_kern, MODE, NM)

static void ap_rows(int mode, int nm, const Lanes *ln, int kw, int C, const Urow *u, int nu, vt *const *p, const T *y,
                    long x0, const long *bo, long vs, vt *const *o) {
    switch (mode * 16 + nm) {
        AP_CASE(0, 1) AP_CASE(1, 1) AP_CASE(3, 1)
#if MR >= 2
        AP_CASE(0, 2) AP_CASE(1, 2) AP_CASE(3, 2)
#endif
#if MR >= 3
        AP_CASE(0, 3) AP_CASE(1, 3) AP_CASE(3, 3)
#endif
#if MR >= 4
        AP_CASE(0, 4) AP_CASE(1, 4) AP_CASE(3, 4)
#endif
#if MR >= 5
        AP_CASE(0, 5) AP_CASE(1, 5) AP_CASE(3, 5)
#endif
#if MR >= 6
        AP_CASE(0, 6) AP_CASE(1, 6) AP_CASE(3, 6)
#endif
        default: abort();
    }
}

/* sc_kern and ap_kern for the blocks whose keys lie in one vector (Lanes.one): one load per
 * channel (and key row), each slot's lanes shuffled out of it; mode 1's per-slot shifted loads
 * split cache lines (16^3 k5 forward 1.11-1.17x, AVX-512). Functions of their own: with a mode 2
 * in sc_kern / ap_kern GCC compiled the other modes' code differently (2-D k7 0.93-0.97x) */
INL void sc_kern_one(const int mode, const int nm, const int gb, const Lanes *ln, int C, const T *const *qp, long qs,
                     const T *kr, const long *bo, long ks, vt *const *sp) {
    vt acc[MR][GBMAX];
    vi pb[GBMAX];
    (void)mode; /* 2: the dispatch macros pass it */
#pragma GCC unroll 8
    for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) acc[j][b] = (vt){0};
#pragma GCC unroll 8
    for (int b = 0; b < gb; b++) pb[b] = ln->perm + (int)(bo[b] - bo[0]);
    const T *k0 = kr + bo[0];
    for (int c = 0; c < C; c++) {
        vt qv[MR], kb = ld(k0 + c * ks);
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++) qv[j] = in_reg(ld(qp[j] + c * qs));
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) {
            vt kv = in_reg(shuffle1(kb, pb[b]));
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) acc[j][b] += qv[j] * kv;
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
        for (int b = 0; b < gb; b++) sp[j][b] = acc[j][b];
}

#define SCO_GB(NM) SC_GB_OF(sc_kern_one, 2, NM)

static void sc_rows_one(int nm, int gb, const Lanes *ln, int C, const T *const *qp, long qs, const T *kr,
                        const long *bo, long ks, vt *const *sp) {
    switch (2 * 256 + nm * 16 + gb) {
        SCO_GB(1)
#if MR >= 2
        SCO_GB(2)
#endif
#if MR >= 3
        SCO_GB(3)
#endif
#if MR >= 4
        SCO_GB(4)
#endif
#if MR >= 5
        SCO_GB(5)
#endif
#if MR >= 6
        SCO_GB(6)
#endif
        default: abort();
    }
}

INL void ap_kern_one(const int mode, const int nm, const Lanes *ln, int kw, int C, const Urow *u, int nu,
                     vt *const *p, const T *y, long x0, const long *bo, long vs, vt *const *o) {
    const int GVN = GV_OF(nm);
    (void)mode;
    for (int c0 = 0; c0 < C; c0 += GVN) {
        vt acc[MR][8];
        long cs[8];
#pragma GCC unroll 8
        for (int q = 0; q < GVN; q++) cs[q] = (c0 + q < C ? c0 + q : C - 1) * vs;
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
            for (int q = 0; q < GVN; q++) acc[j][q] = (vt){0};
        for (int iu = 0; iu < nu; iu++) {
            const T *vr = y + (long)u[iu].row * C * vs - x0 + bo[0];
            const vt *pp[MR];
            vt vb[8];
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) pp[j] = p[u[iu].m[j]] + u[iu].a[j] * kw;
#pragma GCC unroll 8
            for (int q = 0; q < GVN; q++) vb[q] = ld(vr + cs[q]);
#pragma GCC unroll 8
            for (int b = 0; b < kw; b++) {
                vi pbb = ln->perm + (int)(bo[b] - bo[0]);
                vt pv[MR];
#pragma GCC unroll 8
                for (int j = 0; j < nm; j++) pv[j] = in_reg(pp[j][b]);
#pragma GCC unroll 8
                for (int q = 0; q < GVN; q++) {
                    vt vv = shuffle1(vb[q], pbb);
#pragma GCC unroll 8
                    for (int j = 0; j < nm; j++) acc[j][q] += pv[j] * vv;
                }
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < nm; j++)
#pragma GCC unroll 8
            for (int q = 0; q < GVN; q++)
                if (c0 + q < C) o[u->m[j]][c0 + q] += acc[j][q];
    }
}

#define APO_CASE(NM) AP_CASE_OF(ap_kern_one, 2, NM)

static void ap_rows_one(int nm, const Lanes *ln, int kw, int C, const Urow *u, int nu, vt *const *p, const T *y,
                        long x0, const long *bo, long vs, vt *const *o) {
    switch (2 * 16 + nm) {
        APO_CASE(1)
#if MR >= 2
        APO_CASE(2)
#endif
#if MR >= 3
        APO_CASE(3)
#endif
#if MR >= 4
        APO_CASE(4)
#endif
#if MR >= 5
        APO_CASE(5)
#endif
#if MR >= 6
        APO_CASE(6)
#endif
        default: abort();
    }
}

/* scores of one tile: s[m] (nkp vectors per row) = x_m . y over C channels for every Urow */
static void tile_scores(const Geo *g, int mode, const Lanes *ln, const Urow *u0, const Urow *u1, int C,
                        const T *const *xrow, long xs, const T *y, long x0, const long *base, vt *const *s) {
    for (const Urow *u = u0; u < u1; u++) {
        const T *kr = y + (long)u->row * C * g->kp - x0;
        const T *qp[MR];
        for (int j = 0; j < u->n; j++) qp[j] = xrow[u->m[j]];
        int gm = gb_max(u->n), ng = (g->kw + gm - 1) / gm;
        for (int k = 0, b0 = 0; k < ng; k++) {
            int gb = (g->kw - b0) / (ng - k);
            vt *sp[MR];
            for (int j = 0; j < u->n; j++) sp[j] = s[u->m[j]] + u->a[j] * g->kw + b0;
            if (ln->one) sc_rows_one(u->n, gb, ln, C, qp, xs, kr, base + b0, g->kp, sp);
            else sc_rows(mode, u->n, gb, ln, C, qp, xs, kr, base + b0, g->kp, sp);
            b0 += gb;
        }
    }
}

/* o[m][c] += sum over the tile's keys of p[m] * y (C channels): the Urows in runs reading the same
 * query rows (plan_tiles puts them together), one run per call of the micro-kernel */
static void tile_apply(const Geo *g, int mode, const Lanes *ln, const Urow *u0, const Urow *u1, int C,
                       vt *const *p, const T *y, long x0, const long *base, vt *const *o) {
    for (const Urow *u = u0, *e; u < u1; u = e) {
        for (e = u + 1; e < u1 && e->mask == u->mask; e++) {}
        if (ln->one) ap_rows_one(u->n, ln, g->kw, C, u, (int)(e - u), p, y, x0, base, g->kp, o);
        else ap_rows(mode, u->n, ln, g->kw, C, u, (int)(e - u), p, y, x0, base, g->kp, o);
    }
}

#endif
