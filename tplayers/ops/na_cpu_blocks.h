/* Building blocks of na_cpu.c (included by it, once per element type): the vector type and its
 * helpers, the exp, a block's lanes and key addressing, the score / softmax / value loops, the
 * plane transposes and the scratch layout. See na_cpu.c for the layout and the algorithm. */
#ifndef NA_CPU_BLOCKS_H
#define NA_CPU_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* NA_LANES: elements per vector, set by the builder from the host's vector width (na_cpu.py:
 * AVX-512 16 floats / 8 doubles, AVX2 8 / 4, 128-bit ISAs 4 / 2); a vector wider than the ISA's
 * registers splits every op and turns each shuffle into a permute network (measured 2.4-4.8x
 * slower than the torch tile kernel on an AVX2-only EPYC with 16 float lanes) */
#ifdef NA_DOUBLE
typedef double T;
typedef int64_t IT;
#ifndef NA_LANES
#define NA_LANES 8
#endif
#else
typedef float T;
typedef int32_t IT;
#ifndef NA_LANES
#define NA_LANES 16
#endif
#endif
#define L NA_LANES
#ifdef NA_DOUBLE
#define NA_VBYTES (NA_LANES * 8)
#else
#define NA_VBYTES (NA_LANES * 4)
#endif
#if NA_VBYTES >= 64 /* the ISA's vector registers (AVX-512: 32, else 16): the micro-kernels' blocking */
#define NREG 32
#else
#define NREG 16
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
typedef T vt __attribute__((vector_size(L * sizeof(T))));
typedef IT vi __attribute__((vector_size(L * sizeof(IT))));
#define G 8  /* score accumulators per pass (keys at a time) */
#define GV 8 /* output-channel accumulators per pass (8 measured ~10% faster than 4) */
#define INL static inline __attribute__((always_inline))
#ifndef NA_PREFETCH
#define NA_PREFETCH L /* pixels ahead that to_rows prefetches (the next tile; 4 tiles measured the same) */
#endif

typedef T vtu __attribute__((vector_size(L * sizeof(T)), aligned(sizeof(T)), may_alias)); /* unaligned */
INL vt ld(const T *p) { return *(const vtu *)p; }
INL void st(T *p, vt v) { memcpy(p, &v, sizeof v); }
/* st that bypasses the caches (a non-temporal store) where a vector is a whole 64-byte line
 * (AVX-512) and p is aligned to it: the backward's gradients, written once and never read back by
 * the kernel, so its planes keep the L2 (benchmarks/RESULTS.md: AVX-512 backward 1.02-1.19x, a
 * consumer of the gradients included); nt_fence() orders them before the call returns */
INL void st_nt(T *p, vt v) {
#if defined(__AVX512F__) && NA_VBYTES == 64 && !defined(NA_DOUBLE)
    if (!((uintptr_t)p & 63)) { _mm512_stream_ps(p, (__m512)v); return; }
#elif defined(__AVX512F__) && NA_VBYTES == 64
    if (!((uintptr_t)p & 63)) { _mm512_stream_pd(p, (__m512d)v); return; }
#endif
    st(p, v);
}
/* a and b at p and p + L, streamed where the two 32-byte vectors (AVX2) are one line starting on a
 * line, so the line is written whole at once (AVX2 backward 1.01-1.11x; one half at a time measured
 * 0.92-1.04x); else st_nt each */
INL void st_nt2(T *p, vt a, vt b) {
#if defined(__AVX__) && NA_VBYTES == 32 && !defined(NA_DOUBLE)
    if (!((uintptr_t)p & 63)) { _mm256_stream_ps(p, (__m256)a); _mm256_stream_ps(p + L, (__m256)b); return; }
#elif defined(__AVX__) && NA_VBYTES == 32
    if (!((uintptr_t)p & 63)) { _mm256_stream_pd(p, (__m256d)a); _mm256_stream_pd(p + L, (__m256d)b); return; }
#endif
    st_nt(p, a);
    st_nt(p + L, b);
}
INL void nt_fence(void) {
#if defined(__SSE__)
    _mm_sfence();
#endif
}
INL vt splat(T x) { return x - (vt){0}; } /* x in every lane (x - 0 is x, -0 too: one broadcast, no add) */
INL vt vsel(vi m, vt a, vt b) { return (vt)(((vi)a & m) | ((vi)b & ~m)); }
/* a > b ? a : b lane by lane (b where either is NaN): the ISA's max instruction where there is one
 * (the select compiled to a compare and two masked xors on a loop-carried chain) */
INL vt vmax(vt a, vt b) {
#if defined(__AVX512F__) && NA_VBYTES == 64 && !defined(NA_DOUBLE)
    return (vt)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX512F__) && NA_VBYTES == 64
    return (vt)_mm512_max_pd((__m512d)a, (__m512d)b);
#elif defined(__AVX__) && NA_VBYTES == 32 && !defined(NA_DOUBLE)
    return (vt)_mm256_max_ps((__m256)a, (__m256)b);
#elif defined(__AVX__) && NA_VBYTES == 32
    return (vt)_mm256_max_pd((__m256d)a, (__m256d)b);
#elif defined(__SSE2__) && NA_VBYTES == 16 && !defined(NA_DOUBLE)
    return (vt)_mm_max_ps((__m128)a, (__m128)b);
#elif defined(__SSE2__) && NA_VBYTES == 16
    return (vt)_mm_max_pd((__m128d)a, (__m128d)b);
#else
    return vsel(a > b, a, b);
#endif
}

/* exp on a vector (Cody-Waite reduction, Taylor polynomial on [-ln2/2, ln2/2]); exactly 0 below
 * the underflow threshold (masked keys carry -inf). fp32 on AVX-512: x = (16 n + j) ln2 / 16 + r,
 * 2^(j / 16) from a table held in a register (one permute), a degree-3 polynomial on |r| <= ln2 / 32
 * and the 2^n by vscalefps: 12 operations for the 16 below (max relative error over [-87, 0]
 * 1.7e-7, the one below 2.3e-7) */
INL vt vexp(vt x) {
#if defined(__AVX512F__) && NA_VBYTES == 64 && !defined(NA_DOUBLE)
    const T lo = -87.0f, hi_ln2 = 0.693359375f / 16, lo_ln2 = -2.12194440e-4f / 16, shifter = 12582912.0f;
    const vt tab = {1.0f,        1.04427378f, 1.09050773f, 1.13878863f, 1.18920712f, 1.24185781f,
                    1.29683955f, 1.35425555f, 1.41421356f, 1.47682615f, 1.54221083f, 1.61049033f,
                    1.68179283f, 1.75625216f, 1.83400809f, 1.91520656f}; /* 2^(j / 16) */
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(lo), _CMP_NLT_UQ); /* NaN passes */
    x = vmax(splat(lo), x);
    const vt big = x * (T)(16 * 1.44269504088896340736) + shifter; /* 16 n + j in the low mantissa bits */
    const vt nf = big - shifter;
    const vt r = x - nf * hi_ln2 - nf * lo_ln2;
    const vt t = (vt)_mm512_permutexvar_ps((__m512i)big, (__m512)tab); /* j: the index's low 4 bits */
    const vt p = ((splat((T)(1.0 / 6)) * r + 0.5f) * r + 1.0f) * r + 1.0f;
    return (vt)_mm512_maskz_scalef_ps(keep, (__m512)(t * p), (__m512)(nf * 0.0625f)); /* 2^floor(n + j / 16) */
#else
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
    vi keep = ~(x < lo); /* NaN passes through (and comes out NaN, as torch's exp) */
    x = vmax(splat(lo), x);
    /* n = round(x / ln2) by the shifter trick: adding 1.5 * 2^mant leaves n in the low mantissa
     * bits (no float <-> int conversions: AVX2 has none for 64-bit integers) */
    const T shifter = (T)1.5 * (T)((IT)1 << mant);
    vt big = x * (T)1.44269504088896340736 + shifter;
    vt nf = big - shifter;
    vi n = (vi)big - (vi)splat(shifter);
    vt r = x - nf * hi_ln2 - nf * lo_ln2;
    vt p = splat(c[0]);
    for (int i = 1; i < nc; i++) p = p * r + c[i];
    vi scale = (n + bias) << mant;
    return (vt)((vi)(p * (vt)scale) & keep);
#endif
}

/* One block: n consecutive queries of a row in L lanes (spare lanes repeat the last query).
 * Lane t of slot b reads key column base_b + perm[t]; mode 0: perm is 0..L-1 (a plain load),
 * mode 1: a shuffle of the L columns from base_b, mode 3: a shuffle within 16-byte groups (sh). */
typedef struct {
    int mode, n, layers; /* layers: scatter-add rounds (modes 1, 3): lanes sharing a key add in turn */
    int sh;              /* mode 3: a shuffle that moves no key across a 16-byte group once the load
                          * starts sh columns earlier (windows clamped at an image border: lanes
                          * repeat a neighbour's key); the score and P.V kernels then load from
                          * base_b - sh and permute within the groups (ilx): a cross-group permute
                          * (vpermps) halved the score kernel's rate on Zen 3 (AVX2 3 rows x 3
                          * slots alone: 32-49 GFLOP/s against 52-63 in-group) */
    int masked;          /* some lane's column slot is invalid (causal): block_add cannot skip it */
    int one;             /* mode 1 with every slot's keys in the L columns from base[0] (rows of at most
                          * L keys, as 3-D's 16-wide rows with AVX-512): the score and P.V kernels
                          * load that vector once per channel and shuffle each slot out of it
                          * (mode 1's shifted loads split cache lines: 16^3 k5 forward 1.11-1.17x).
                          * 32-register ISAs only: the slots' shuffle masks held in registers spill
                          * with 16 (AVX2 8^3 k5 forward 0.92-0.95x; AVX-512 fp64 1.08-1.11x) */
    vi perm, live, ilx;  /* live: -1 on the n real lanes; ilx: lane's perm[t] + sh, as permil reads it */
    vi *inv;             /* modes 1, 3 (else NULL): 2 * layers vectors, round r: key lane u takes
                          * lane inv[r][u] where inv[layers + r][u] is -1; small blocks (a row of 4096
                          * keys has 256), touched on every call: no per-block 2 KiB tables */
} Lanes;

/* x[m[t]] lane by lane */
INL vt shuffle1(vt x, vi m) {
#ifdef __clang__
    vt r;
    for (int u = 0; u < L; u++) r[u] = x[m[u]];
    return r;
#else
    return __builtin_shuffle(x, m);
#endif
}

/* x[m[t]] lane by lane where every m[t] lies in t's 16-byte group (m as lane_tables encodes it): the
 * in-group permute (vpermilps / vpermilpd) where AVX has one */
INL vt permil(vt x, vi m) {
#if defined(__AVX__) && NA_VBYTES == 32 && !defined(NA_DOUBLE)
    return (vt)_mm256_permutevar_ps((__m256)x, (__m256i)m);
#elif defined(__AVX__) && NA_VBYTES == 32
    return (vt)_mm256_permutevar_pd((__m256d)x, (__m256i)m);
#else
    return shuffle1(x, m);
#endif
}

/* the key vector of a block's slot whose first column is at p: mode 0 a plain load, mode 1 a
 * shuffle, mode 3 an in-group permute of the load from sh columns earlier */
INL vt kload(const T *p, int mode, const Lanes *ln) {
    if (mode == 0) return ld(p);
    if (mode == 3) return permil(ld(p - ln->sh), ln->ilx);
    return shuffle1(ld(p), ln->perm);
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
        acc += (vt)((vi)y & ln->inv[ln->layers + r]);
    }
    st(p, acc);
}

typedef struct {
    int B, heads, Hq, Wq, Hk, Wk, D, Dv, kh, kw, nk, nkp, tw, tr; /* bias table: tr rows of tw (2kW-1) */
    long kp; /* row pitch of the key planes (see key_pitch) */
    const int32_t *rows, *cols; /* (3, Hq, kh), (3, Wq, kw) */
    const T *table;             /* (heads, 2kH-1, 2kW-1) or NULL */
    T scale;
} Geo;

/* mode 3 for a block of mode 1 (AVX2: where measured; with AVX-512 the 3-D rows take Lanes.one)
 * where a shift sh keeps every lane's key perm[t] + sh in t's 16-byte group (GRP lanes) and within
 * the vector: the first such sh, and ilx encoded for permil (vpermilpd reads an index's bit 1) */
static void lane_tables(Lanes *ln) {
    enum { GRP = 16 / (int)sizeof(T) };
    int mx = 0;
    ln->sh = 0;
    ln->ilx = (vi){0};
    for (int t = 0; t < L; t++) mx = ln->perm[t] > mx ? ln->perm[t] : mx;
    if (ln->mode != 1 || NA_VBYTES != 32) return;
    for (int sh = 0; sh + mx < L && ln->mode == 1; sh++) {
        int ok = 1;
        for (int t = 0; t < L; t++) ok &= (ln->perm[t] + sh) / GRP == t / GRP;
        if (!ok) continue;
        ln->mode = 3;
        ln->sh = sh;
        for (int t = 0; t < L; t++) {
            const int u = ln->perm[t] + sh;
            ln->ilx[t] = sizeof(T) == 8 ? (u % 2) * 2 : u;
        }
    }
}

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
    ln->one = 0;
    if (!ident && NREG == 32) { /* every slot's columns base[b] + perm[t] within [base[0], base[0] + L): the keys mode 1
                   * reads, a masked slot's included; slots in column order (the score kernel's
                   * passes of slots b0.. shuffle from base[b0]) */
        int mx = 0;
        for (int t = 0; t < L; t++) mx = ln->perm[t] > mx ? ln->perm[t] : mx;
        ln->one = 1;
        for (int b = 1; b < g->kw; b++) ln->one &= base[b] >= base[b - 1] && base[b] - base[0] + mx < L;
    }
    lane_tables(ln);
    ln->layers = 0;
    ln->inv = NULL;
    ln->masked = 0;
    for (int t = 0; t < n; t++)
        for (int b = 0; b < g->kw; b++) ln->masked |= !g->cols[g->Wq * g->kw + (j0 + t) * g->kw + b];
    if (!ident) { /* round r takes the r-th live lane of each key lane u */
        int count[L] = {0}, layers = 0;
        for (int t = 0; t < n; t++) layers = ++count[ln->perm[t]] > layers ? count[ln->perm[t]] : layers;
        ln->inv = aligned_alloc(_Alignof(vi), sizeof(vi) * 2 * layers);
        for (int r = 0; r < 2 * layers; r++) ln->inv[r] = (vi){0};
        for (int u = 0; u < L; u++) count[u] = 0;
        for (int t = 0; t < n; t++) {
            int u = ln->perm[t], r = count[u]++;
            ln->inv[r][u] = t;
            ln->inv[layers + r][u] = -1;
        }
        ln->layers = layers;
    }
}

/* additive window mask (-inf: causal) and bias of a block, add[ab] over lanes; 0 when all zero */
static int block_add(const Geo *g, int i, int j0, int h, const Lanes *ln, vt *add) {
    const int32_t *vr = g->rows + g->Hq * g->kh, *rr = g->rows + 2 * g->Hq * g->kh;
    const int32_t *vc = g->cols + g->Wq * g->kw, *rc = g->cols + 2 * g->Wq * g->kw;
    int any = g->table != NULL || ln->masked;
    for (int a = 0; a < g->kh && !any; a++) any = !vr[i * g->kh + a];
    if (!any) return 0;
    const T *tab = g->table ? g->table + (size_t)h * g->tr * g->tw : NULL;
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

/* dtable[h] += dS of query row i's block at j0 (its n live lanes) */
static void table_grad(const Geo *g, const Lanes *ln, int i, long j0, int h, const vt *ds, T *dtable) {
    const int32_t *rr = g->rows + 2 * g->Hq * g->kh, *rc = g->cols + 2 * g->Wq * g->kw;
    T *tab = dtable + (size_t)h * g->tr * g->tw;
    for (int ab = 0; ab < g->nk; ab++) {
        int ra = rr[i * g->kh + ab / g->kw] * g->tw, b = ab % g->kw;
        for (int t = 0; t < ln->n; t++) tab[ra + rc[(j0 + t) * g->kw + b]] += ds[ab][t];
    }
}

/* exp(s - rowmax) in place, over the nk scores of each lane; returns 1 / rowsum */
INL vt softmax(int nk, vt *s, const vt *add) {
    if (add)
        for (int ab = 0; ab < nk; ab++) s[ab] += add[ab];
    vt m = s[0], m1 = s[0], m2 = s[0], m3 = s[0], l = {0}; /* 4 chains (max is exact in any order) */
    int ab = 1;
    for (; ab + 4 <= nk; ab += 4) {
        m = vmax(m, s[ab]);
        m1 = vmax(m1, s[ab + 1]);
        m2 = vmax(m2, s[ab + 2]);
        m3 = vmax(m3, s[ab + 3]);
    }
    for (; ab < nk; ab++) m = vmax(m, s[ab]);
    m = vmax(vmax(m, m1), vmax(m2, m3));
    for (int ab = 0; ab < nk; ab++) { s[ab] = vexp(s[ab] - m); l += s[ab]; }
    return 1 / l;
}

/* p[ab] *= inv (the softmax normalised) and returns delta = sum_ab p[ab] dp[ab] per lane: the
 * backward's rowsum(dO * O) from the window's P and dP = dO . V it has in hand (O = P V), so the
 * output is never read (two chains: the adds are the latency) */
INL vt softmax_delta(int nk, vt *p, vt inv, const vt *dp) {
    vt d0 = {0}, d1 = {0};
    int ab = 0;
    for (; ab + 2 <= nk; ab += 2) {
        p[ab] *= inv;
        p[ab + 1] *= inv;
        d0 += p[ab] * dp[ab];
        d1 += p[ab + 1] * dp[ab + 1];
    }
    if (ab < nk) { p[ab] *= inv; d0 += p[ab] * dp[ab]; }
    return d0 + d1;
}

/* r[0..L) as an L x L tile, transposed in place: log2(L) rounds swapping off-diagonal blocks */
/* the two-register shuffle masks of transpose_tile's rounds (s = L/2, L/4, ..., 1), as
 * constants: built at run time they cost more than the shuffles */
#define TMA(j, s) ((j) & (s) ? L + (j) - (s) : (j))
#define TMB(j, s) ((j) & (s) ? L + (j) : (j) + (s))
#define TR2(F, s) F(0, s), F(1, s)
#define TR4(F, s) TR2(F, s), F(2, s), F(3, s)
#define TR8(F, s) TR4(F, s), F(4, s), F(5, s), F(6, s), F(7, s)
#define TR16(F, s) TR8(F, s), F(8, s), F(9, s), F(10, s), F(11, s), F(12, s), F(13, s), F(14, s), F(15, s)
#if L == 16
#define TROW(F, s) {TR16(F, s)}
#define TROUNDS(F) {TROW(F, 8), TROW(F, 4), TROW(F, 2), TROW(F, 1)}
#define NROUNDS 4
#elif L == 8
#define TROW(F, s) {TR8(F, s)}
#define TROUNDS(F) {TROW(F, 4), TROW(F, 2), TROW(F, 1)}
#define NROUNDS 3
#elif L == 4
#define TROW(F, s) {TR4(F, s)}
#define TROUNDS(F) {TROW(F, 2), TROW(F, 1)}
#define NROUNDS 2
#elif L == 2
#define TROW(F, s) {TR2(F, s)}
#define TROUNDS(F) {TROW(F, 1)}
#define NROUNDS 1
#endif
#ifdef NROUNDS
static const vi TMASK_A[NROUNDS] = TROUNDS(TMA), TMASK_B[NROUNDS] = TROUNDS(TMB);
#endif

INL void transpose_tile(vt *r) {
#if defined(__clang__) || !defined(NROUNDS)
    T m[L][L];
    for (int i = 0; i < L; i++) for (int j = 0; j < L; j++) m[j][i] = r[i][j];
    for (int i = 0; i < L; i++) memcpy(&r[i], m[i], sizeof(vt));
#else
#pragma GCC unroll 8
    for (int k = 0; k < NROUNDS; k++) {
        const int s = (L / 2) >> k;
        vi ma = TMASK_A[k], mb = TMASK_B[k];
#pragma GCC unroll 16
        for (int i = 0; i < L; i++)
            if (!(i & s)) {
                vt x = r[i], y = r[i + s];
                r[i] = __builtin_shuffle(x, y, ma);
                r[i + s] = __builtin_shuffle(x, y, mb);
            }
    }
#endif
}

/* rows [i0, i1), columns [j_lo, j_lo + n_j) of plane (b, h) of contiguous x (B, H*W, heads*C) from
 * src (i1 - i0, C, pitch); add: 1 x += src, 0 x = src, 2 x = src with st_nt (the backward's
 * gradients; the caller nt_fence()s). L x L tiles transposed in registers; the rest through a
 * small buffer. */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) /* no memcpy calls per pixel */
static void from_rows(const T *src, long pitch, int b, int h, int heads, int H, int W, int C, int i0, int i1,
                      int j_lo, int n_j, int add, T *x) {
    const long hc = (long)heads * C;
    T *dst = x + (size_t)b * H * W * hc + (size_t)h * C;
    T buf[L * C];
    for (int i = i0; i < i1; i++)
        for (int j0 = 0; j0 < n_j; j0 += L) {
            int n = n_j - j0 < L ? n_j - j0 : L, c0 = 0;
            size_t px = (size_t)i * W + j_lo + j0;
            const T *s0 = src + (size_t)(i - i0) * C * pitch + j0;
#if NA_VBYTES == 32
            if (n == L && add == 2) /* two channel tiles at a time: each pixel's line whole (st_nt2) */
                for (; c0 + 2 * L <= C; c0 += 2 * L) {
                    vt lo[L], hi[L];
                    for (int c = 0; c < L; c++) lo[c] = ld(s0 + (size_t)(c0 + c) * pitch);
                    transpose_tile(lo);
                    for (int c = 0; c < L; c++) hi[c] = ld(s0 + (size_t)(c0 + L + c) * pitch);
                    transpose_tile(hi);
                    T *d = dst + px * hc + c0;
                    for (int t = 0; t < L; t++, d += hc) st_nt2(d, lo[t], hi[t]);
                }
#endif
            if (n == L)
                for (; c0 + L <= C; c0 += L) {
                    vt r[L];
                    for (int c = 0; c < L; c++) r[c] = ld(s0 + (size_t)(c0 + c) * pitch);
                    transpose_tile(r);
                    T *d = dst + px * hc + c0;
                    if (add == 1)
                        for (int t = 0; t < L; t++, d += hc) st(d, ld(d) + r[t]);
                    else if (add == 2)
                        for (int t = 0; t < L; t++, d += hc) st_nt(d, r[t]);
                    else
                        for (int t = 0; t < L; t++, d += hc) st(d, r[t]);
                }
            if (c0 == C) continue;
            for (int c = c0; c < C; c++)
                for (int t = 0; t < n; t++) buf[t * C + c] = s0[(size_t)c * pitch + t];
            for (int t = 0; t < n; t++) {
                T *p = dst + (px + t) * hc;
                for (int c = c0; c < C; c++) p[c] = add == 1 ? p[c] + buf[t * C + c] : buf[t * C + c];
            }
        }
}

/* column j of every row of plane (b, h) of contiguous x (B, Hk*Wk, heads*C), set to 0 */
static void zero_cols(T *x, int b, int h, const Geo *g, int C, long j, int r0, int r1) {
    for (int i = r0; i < r1; i++)
        memset(x + (((size_t)b * g->Hk + i) * g->Wk + j) * g->heads * C + (size_t)h * C, 0, C * sizeof(T));
}

static void dense_strides(int H, int W, int heads, int C, long *st) {
    st[0] = (long)H * W * heads * C; st[1] = (long)heads * C; st[2] = C; st[3] = 1;
}

/* the blocks of a row (the same for every row): at most Wq of them, malloc'd */
static Lanes *row_blocks(const void *gp, int *count, long **bases) {
    const Geo *g = gp;
    int cap = g->Wq / L + 8, nb = 0; /* grown by need: a row of Wq columns has about Wq / L blocks */
    Lanes *blocks = aligned_alloc(_Alignof(Lanes), sizeof(Lanes) * cap); /* vector members */
    *bases = malloc(sizeof(long) * cap * g->kw);
    for (int j0 = 0; j0 < g->Wq; j0 += blocks[nb].n, nb++) {
        if (nb == cap) {
            Lanes *grown = aligned_alloc(_Alignof(Lanes), sizeof(Lanes) * 2 * cap);
            memcpy(grown, blocks, sizeof(Lanes) * cap);
            free(blocks);
            blocks = grown;
            cap *= 2;
            *bases = realloc(*bases, sizeof(long) * cap * g->kw);
        }
        block_lanes(g, j0, blocks + nb, *bases + (long)nb * g->kw);
    }
    *count = nb;
    return blocks;
}

/* offset of key (a, b) of query row i in a (ring, C, kp) plane holding key columns from x0 (key
 * row r in row r % ring), for the block's base columns */
static void key_offsets(const Geo *g, int i, const long *base, long x0, int C, int ring, long *off) {
    for (int a = 0; a < g->kh; a++)
        for (int b = 0; b < g->kw; b++)
            off[a * g->kw + b] = (long)(g->rows[i * g->kh + a] % ring) * C * g->kp + base[b] - x0;
    for (int ab = g->nk; ab < g->nkp; ab++) off[ab] = off[0];
}

/* a plane's row pitch for rows of n elements: n, one cache line more where n elements are a whole
 * number of KiB (the channel rows, read one after the other at one column, would otherwise fall in
 * a few of the L1's sets and evict each other: the 1-D backward's chunks of 512 keys, fp32, read
 * their 32 key rows from 2 of the 64 sets; padding other pitches measured no faster) */
static long key_pitch(long n) {
    const long line = 64 / (long)sizeof(T);
    return (n * (long)sizeof(T)) % 1024 ? n : n + line;
}

static Geo make_geo(const int64_t *dims, const int32_t *rows, const int32_t *cols, const T *table, double scale) {
    Geo g = {(int)dims[0], (int)dims[1], (int)dims[2], (int)dims[3], (int)dims[4], (int)dims[5], (int)dims[6],
             (int)dims[7], (int)dims[8], (int)dims[9], 0, 0, 0, (int)dims[10], 0, rows, cols, table, (T)scale};
    g.nk = g.kh * g.kw;
    g.nkp = (g.nk + G - 1) / G * G;
    g.tw = 2 * g.kw - 1;
    g.kp = key_pitch(g.Wk);
    return g;
}

#define PAD (2 * L) /* zeroed elements after each plane buffer: shifted loads may run past a row */
#define DMAX 16     /* channel vectors per row at most in the 1-D kernels (D <= 16 L); the caller checks */

#endif
