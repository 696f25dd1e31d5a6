/* The backward's dK / dV micro-kernel of na_cpu.c (included by it after na_cpu_rows.h): a tile's
 * rows summed per key vector, the lanes sharing a key folded together, then shuffled into the key
 * columns (na_backward's fused blocks; the other blocks run kv_slots or key_sums in na_cpu.c). */
#ifndef NA_CPU_KV_H
#define NA_CPU_KV_H
#include "na_cpu_rows.h"

/* dK (or dV) of one key row: for each channel c, x_b = sum_j w_j[b] * row_j[c] (the nm query rows
 * reading this key row), the lanes sharing a key folded into its first lane (nf rounds of fold:
 * shuffle, mask), the kW slot vectors moved into two registers by their two-register shuffles sh
 * (the first lane of each key) and added to the 2L key columns from d with one write */

/* shuffle1(x, m) & keep (keep: -1 / 0 per lane): one zero-masked permute with AVX-512 (GCC emits a
 * permute and an and for the vector form) */
INL vt shuffle_keep(vt x, vi m, vi keep) {
#if defined(__AVX512F__) && NA_VBYTES == 64 && !defined(NA_DOUBLE) && !defined(__clang__)
    return (vt)_mm512_maskz_permutexvar_ps(_mm512_test_epi32_mask((__m512i)keep, (__m512i)keep), (__m512i)m, (__m512)x);
#elif defined(__AVX512F__) && NA_VBYTES == 64 && !defined(__clang__)
    return (vt)_mm512_maskz_permutexvar_pd(_mm512_test_epi64_mask((__m512i)keep, (__m512i)keep), (__m512i)m, (__m512d)x);
#else
    return (vt)((vi)shuffle1(x, m) & keep);
#endif
}

INL void sl_kern(const int nm, int kw, int C, const vt *const *wp, const T *const *rp, long rs, const vi *sh, T *d,
                 long ds, const int nf, const vi *fold, const int two) {
    const int CBN = CB_OF(nm);
    vi fs[NFMAX], fm[NFMAX]; /* the folds in registers (nf is a constant here, see sl_rows) */
#pragma GCC unroll 4
    for (int f = 0; f < nf && f < NFMAX; f++) { fs[f] = fold[2 * f]; fm[f] = fold[2 * f + 1]; }
    for (int c0 = 0; c0 < C; c0 += CBN) {
        vt rv[MR][4], lo[4], hi[4];
#pragma GCC unroll 4
        for (int q = 0; q < CBN; q++) {
            long c = c0 + q < C ? c0 + q : C - 1;
            lo[q] = hi[q] = (vt){0};
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) rv[j][q] = ld(rp[j] + c * rs);
        }
        for (int b = 0; b < kw; b++) {
            vt wv[MR];
            vi s0 = sh[4 * b], s1 = sh[4 * b + 2];
#pragma GCC unroll 8
            for (int j = 0; j < nm; j++) wv[j] = in_reg(wp[j][b]);
#pragma GCC unroll 4
            for (int q = 0; q < CBN; q++) {
                vt x = wv[0] * rv[0][q];
#pragma GCC unroll 8
                for (int j = 1; j < nm; j++) x += wv[j] * rv[j][q];
#pragma GCC unroll 4
                for (int f = 0; f < nf && f < NFMAX; f++) /* lanes sharing a key: into its first lane */
                    x += shuffle_keep(x, fs[f], fm[f]);
                for (int f = NFMAX; f < nf; f++) /* more (windows far inside the image): from memory */
                    x += shuffle_keep(x, fold[2 * f], fold[2 * f + 1]);
#if NREG == 32 /* one two-register permute with a zero register */
                lo[q] += shift2(x, s0);
                if (two) hi[q] += shift2(x, s1);
#else /* no two-register permute (AVX2 emulates it in ~5 ops): one permute serves both registers
       * (fuse_tables: s0 holds both sources), then a mask per register */
                (void)s1;
                vi y = (vi)shuffle1(x, s0);
                lo[q] += (vt)(y & sh[4 * b + 1]);
                if (two) hi[q] += (vt)(y & sh[4 * b + 3]);
#endif
            }
        }
#pragma GCC unroll 4
        for (int q = 0; q < CBN; q++)
            if (c0 + q < C) {
                T *dc = d + (c0 + q) * ds;
                st(dc, ld(dc) + lo[q]);
                if (two) st(dc + L, ld(dc + L) + hi[q]);
            }
    }
}

#define SL_CASE(NM, NF) \
    case (NM) * 8 + (NF): sl_kern(NM, kw, C, wp, rp, rs, sh, d, ds, NF, fold, 1); return; \
    case 64 + (NM) * 8 + (NF): sl_kern(NM, kw, C, wp, rp, rs, sh, d, ds, NF, fold, 0); return;

/* two: 0 when the keys of every slot lie within L columns of slot 0's (rows of at most L keys: the
 * second register stays zero) */
static void sl_rows(int nm, int kw, int C, const vt *const *wp, const T *const *rp, long rs, const vi *sh, T *d,
                    long ds, int nf, const vi *fold, int two) {
    /* nm rows, nf folds and two as constants (0-2 folds: the interior and 2-D / 3-D borders; more
     * run the generic loop) */
    int key = (two ? 0 : 64) + nm * 8 + (nf < NFMAX ? nf : 7);
    switch (key) {
        SL_CASE(1, 0) SL_CASE(1, 1) SL_CASE(1, 2)
#if MR >= 2
        SL_CASE(2, 0) SL_CASE(2, 1) SL_CASE(2, 2)
#endif
#if MR >= 3
        SL_CASE(3, 0) SL_CASE(3, 1) SL_CASE(3, 2)
#endif
#if MR >= 4
        SL_CASE(4, 0) SL_CASE(4, 1) SL_CASE(4, 2)
#endif
        default: break;
    }
    switch (nm) {
        case 1: sl_kern(1, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#if MR >= 2
        case 2: sl_kern(2, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#endif
#if MR >= 3
        case 3: sl_kern(3, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#endif
#if MR >= 4
        case 4: sl_kern(4, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#endif
#if MR >= 5
        case 5: sl_kern(5, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#endif
#if MR >= 6
        case 6: sl_kern(6, kw, C, wp, rp, rs, sh, d, ds, nf, fold, 1); return;
#endif
        default: abort();
    }
}

#endif
