/* What a call's plan chose, for the tests (included by na_cpu.c after na_cpu_pix.h): its column
 * chunks, the blocks within one vector or permuting within groups, the rows of its ring of key
 * planes, its tile order and its pixel routes. */
#ifndef NA_CPU_PROBES_H
#define NA_CPU_PROBES_H
#include "na_cpu_plan.h"
#include "na_cpu_pix.h"

/* a call's geometry and plan (backward as in na_scratch; free_plan after) */
static Plan probe_plan(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward, Geo *g) {
    Plan pl;
    *g = make_geo(dims, rows, cols, NULL, 1.0);
    make_plan(g, backward, &pl);
    return pl;
}

/* column chunks of a call's plan (backward as in na_scratch): more than 1 where the rows' keys
 * do not fit the cache budget (tests check that path is taken) */
int na_chunks(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    Geo g;
    Plan pl = probe_plan(dims, rows, cols, backward, &g);
    int n = pl.nc;
    free_plan(&pl);
    return n;
}

/* the row pitch of a call's key planes (which 0) or query planes (1) in its plan (backward as in
 * na_scratch; key_pitch: a cache line more for rows of whole KiB) */
int na_pitch(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward, int which) {
    Geo g;
    Plan pl = probe_plan(dims, rows, cols, backward, &g);
    int n = (int)(which ? pl.qw : pl.kp);
    free_plan(&pl);
    return n;
}

/* the blocks of a call's row whose forward P V runs pxa_kern (pix_pairs' f: interior blocks, and border
 * blocks whose groups of lanes share one window; 0 where the forward's route or pxa_kern's
 * instantiations do not apply to the call's shape) */
int na_pixel_affine(const int64_t *dims, const int32_t *rows, const int32_t *cols) {
    Geo g;
    Plan pl = probe_plan(dims, rows, cols, 0, &g);
    int n = 0;
    if (pxf_shape(&g, &pl) && pxa_dims(&g, g.Dv)) {
        pix_pairs(&g, &pl, 0, &pl.px);
        for (int bk = 0; bk < pl.nb; bk++) n += pl.px.f[bk] != 0;
    }
    free_plan(&pl);
    return n;
}

/* the blocks of a call's row whose keys lie in one vector (which 0, Lanes.one: the score and P.V
 * kernels shuffle the slots out of one load) or that permute within 16-byte groups (which 1,
 * mode 3); tests check where each path is taken */
int na_block_kinds(const int64_t *dims, const int32_t *rows, const int32_t *cols, int which) {
    Geo g;
    Plan pl = probe_plan(dims, rows, cols, 0, &g);
    int n = 0;
    for (int bk = 0; bk < pl.nb; bk++) n += which ? pl.blocks[bk].mode == 3 : pl.blocks[bk].one;
    free_plan(&pl);
    return n;
}

/* whether the forward of a call streams its output past the caches (output_streamed; tests check
 * that path is taken) */
int na_output_streamed(const int64_t *dims) {
    Geo g = make_geo(dims, NULL, NULL, NULL, 1.0);
    return output_streamed(&g);
}

/* the rows of the ring of key planes of a call's plan (backward as in na_scratch; ring_rows:
 * tests check it is below Hk) */
int na_ring_rows(const int64_t *dims, const int32_t *rows, const int32_t *cols, int backward) {
    void *pl = na_plan(dims, rows, cols, backward);
    int n = ((Plan *)pl)->ring;
    na_plan_free(pl);
    return n;
}

/* the query rows of a call in tile order (order: Hq ints; tile t is order[t MR ...]) and the rows
 * per tile, MR (tests check which rows share a tile) */
int na_row_order(const int64_t *dims, const int32_t *rows, const int32_t *cols, int32_t *order) {
    Geo g = make_geo(dims, rows, cols, NULL, 1.0);
    int *o = malloc(sizeof(int) * g.Hq);
    row_order(&g, o);
    for (int i = 0; i < g.Hq; i++) order[i] = o[i];
    free(o);
    return MR;
}

/* the pixel routes of a call on dense inputs (na_cpu_pix.h; tests check where each is taken and
 * where not): 1 when its backward adds dK / dV on the user's layout (pix_ok), + 4 when it sums dQ
 * there (pq_shape), + 2 when its forward
 * sums P V on the values' layout (pxf_ok) */
int na_pixel_route(const int64_t *dims, const int32_t *rows, const int32_t *cols) {
    const long unit[4] = {0, 0, 0, 1};
    int yes = 0;
    for (int backward = 0; backward < 2; backward++) { /* each route on its own plan (their chunks differ) */
        Geo g = make_geo(dims, rows, cols, NULL, 1.0);
        Plan pl;
        make_plan(&g, backward, &pl);
        yes |= backward ? pix_ok(&g, &pl, unit, unit) | pq_shape(&g, &pl) << 2 : pxf_ok(&g, &pl, unit) << 1;
        free_plan(&pl);
    }
    return yes;
}

#endif
