/* The reads into the kernel's planes (included by na_cpu.c after na_cpu_blocks.h): to_rows_x
 * transposes a plane's pixel-major rows into (row, channel, column) scratch, widening bf16 inputs
 * of the fp32 build as it loads them; out_block writes a block's outputs back. */
#ifndef NA_CPU_IO_H
#define NA_CPU_IO_H
#include "na_cpu_blocks.h"

/* bf16 inputs (fp32 builds): the upper half of an fp32, widened exactly on load */
#ifndef NA_DOUBLE
typedef uint16_t vh __attribute__((vector_size(L * sizeof(uint16_t))));
INL vt ld_h(const uint16_t *p) {
    vh x;
    memcpy(&x, p, sizeof x);
    return (vt)(__builtin_convertvector(x, vi) << 16);
}
INL T h2f(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    T f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#else
INL vt ld_h(const uint16_t *p) { (void)p; return (vt){0}; } /* never called: bf16 is fp32-only */
INL T h2f(uint16_t x) { (void)x; return 0; }
#endif

/* rows [i0, i1), columns [j_lo, j_lo + n_j) of plane (b, h) of x (element strides xs: batch,
 * pixel, head, channel; T, or bf16 when bf) into dst (i1 - i0, C, pitch), times mul. L x L tiles
 * (pixels x channels) transposed in registers; the rest through a small buffer. */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) /* no memcpy calls per pixel */
static void to_rows_x(const void *x, int bf, const long *xs, int b, int h, int i0, int i1, int W, int j_lo, int n_j,
                      long pitch, int C, T mul, T *dst) {
    const long base = b * xs[0] + h * xs[2];
    const T *src = (const T *)x + base;
    const uint16_t *hsrc = (const uint16_t *)x + base;
    T buf[L * C];
    for (int i = i0; i < i1; i++)
        for (int j0 = 0; j0 < n_j; j0 += L) {
            int n = n_j - j0 < L ? n_j - j0 : L, c0 = 0;
            long px = (long)i * W + j_lo + j0;
            T *d0 = dst + (size_t)(i - i0) * C * pitch + j0;
            if (n == L && xs[3] == 1)
                for (; c0 + L <= C; c0 += L) {
                    vt r[L]; /* in registers: the loads unrolled, bf's branch outside them */
                    const long e0 = px * xs[1] + c0, ahead = NA_PREFETCH * xs[1];
                    if (bf) {
#pragma GCC unroll 16
                        for (int t = 0; t < L; t++) { /* tiles ahead */
                            __builtin_prefetch(hsrc + e0 + t * xs[1] + ahead);
                            r[t] = ld_h(hsrc + e0 + t * xs[1]);
                        }
                    } else {
#pragma GCC unroll 16
                        for (int t = 0; t < L; t++) {
                            __builtin_prefetch(src + e0 + t * xs[1] + ahead);
                            r[t] = ld(src + e0 + t * xs[1]);
                        }
                    }
                    transpose_tile(r);
                    for (int c = 0; c < L; c++) st(d0 + (size_t)(c0 + c) * pitch, r[c] * mul);
                }
            if (c0 == C) continue;
            for (int t = 0; t < n; t++) {
                long e = (px + t) * xs[1];
                for (int c = c0; c < C; c++) buf[t * C + c] = bf ? h2f(hsrc[e + c * xs[3]]) : src[e + c * xs[3]];
            }
            for (int c = c0; c < C; c++)
                for (int t = 0; t < n; t++) d0[(size_t)c * pitch + t] = buf[t * C + c] * mul;
        }
}

static void to_rows(const T *x, const long *xs, int b, int h, int i0, int i1, int W, int j_lo, int n_j, long pitch,
                    int C, T mul, T *dst) {
    to_rows_x(x, 0, xs, b, h, i0, i1, W, j_lo, n_j, pitch, C, mul, dst);
}

/* a block's n outputs of query row i from its per-channel vectors acc[c] * inv (C a multiple of
 * L), transposed in registers and stored at pixels (i, j0 ...) of plane (b, h) of the dense x:
 * no row buffer and no second pass (from_rows). nt: streamed past the caches (st_nt: a whole
 * line per store with AVX-512, no read of the line it overwrites; see output_streamed) */
static void out_block(const vt *acc, vt inv, int n, int b, int h, int heads, int H, int W, int C, int i, long j0,
                      T *x, int nt) {
    T *o = x + (((size_t)b * H + i) * W + j0) * heads * C + (size_t)h * C;
    for (int c0 = 0; c0 < C; c0 += L) {
        vt r[L];
        for (int c = 0; c < L; c++) r[c] = acc[c0 + c] * inv;
        transpose_tile(r);
        if (nt)
            for (int t = 0; t < n; t++) st_nt(o + (size_t)t * heads * C + c0, r[t]);
        else
            for (int t = 0; t < n; t++) st(o + (size_t)t * heads * C + c0, r[t]);
    }
}

#endif
