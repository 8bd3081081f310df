/* The panel product of ops/linear.py's packed weights, for linear.c's openk3_linear_panels and for the kernels that chain
 * several projections in one call (moe.c's openk3_moe_latent_block): the same code, so the same bits wherever it runs.
 */
#ifndef OPENK3_PANELS_H
#define OPENK3_PANELS_H

#include <stdint.h>

/* The same product with the weight repacked into panels (ops/linear.py PackedWeight.panels): p[N/16][K][16], the last
 * panel zero-padded, so that one aligned vector load brings 16 outputs' weights at one k and each row's x[k] is
 * broadcast against it. A tile of up to 16 rows keeps one accumulator per row: no sum across lanes at the end (the
 * stored layout's tiles spend about as long on those sums as on the products at K = 256), and each weight value is used
 * for all the step's rows while in a register. Measured on the demo model's projections at 16 rows: 1.4x the stored
 * layout's kernel (benchmarks/results/roofline.md). Sums run along k in order for every output, so the result is the
 * same for any M and any tile split. */
#define PANEL 16
#define PANEL_PREFETCH 1024 /* floats ahead (4 KiB) */

typedef float panel_vf __attribute__((vector_size(PANEL * sizeof(float))));

#define PANEL_TILE(MB)                                                                                                      \
    static inline void panel_tile_##MB(int64_t K, const float *x, int64_t ldx, const float *p, float *y, int64_t ldy, int64_t nb) { \
        panel_vf acc[MB];                                                                                                   \
        for (int i = 0; i < MB; i++) acc[i] = (panel_vf){0};                                                                \
        for (int64_t k = 0; k < K; k++) {                                                                                   \
            const panel_vf wv = *(const panel_vf *)(p + k * PANEL);                                                         \
            __builtin_prefetch(p + k * PANEL + PANEL_PREFETCH, 0, 2);                                                       \
            for (int i = 0; i < MB; i++) acc[i] += x[i * ldx + k] * wv;                                                     \
        }                                                                                                                   \
        for (int i = 0; i < MB; i++)                                                                                        \
            for (int64_t j = 0; j < nb; j++) y[i * ldy + j] = acc[i][j];                                                    \
    }

PANEL_TILE(1)
PANEL_TILE(2)
PANEL_TILE(4)
PANEL_TILE(8)
PANEL_TILE(16)

static void panel_rows(int64_t M, int64_t K, const float *x, int64_t ldx, const float *p, float *y, int64_t ldy, int64_t nb) {
    int64_t m = 0;
    for (; m + 16 <= M; m += 16) panel_tile_16(K, x + m * ldx, ldx, p, y + m * ldy, ldy, nb);
    if (M - m >= 8) panel_tile_8(K, x + m * ldx, ldx, p, y + m * ldy, ldy, nb), m += 8;
    if (M - m >= 4) panel_tile_4(K, x + m * ldx, ldx, p, y + m * ldy, ldy, nb), m += 4;
    if (M - m >= 2) panel_tile_2(K, x + m * ldx, ldx, p, y + m * ldy, ldy, nb), m += 2;
    if (M - m >= 1) panel_tile_1(K, x + m * ldx, ldx, p, y + m * ldy, ldy, nb);
}

/* y [M, N] with row stride ldy = x [M, K] times the panels p of a weight [N, K], the panels split across threads */
static void linear_panels(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *p, float *y, int64_t ldy, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N * K >= (1 << 16))
    for (int64_t t = 0; t < panels; t++) {
        const int64_t n = t * PANEL, nb = N - n < PANEL ? N - n : PANEL;
        panel_rows(M, K, x, ldx, p + n * K, y + n, ldy, nb);
    }
}

#endif
