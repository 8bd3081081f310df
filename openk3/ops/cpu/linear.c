/* x W^T for a few rows (ops/linear.py): y[M, N] = x[M, K] w[N, K]^T, the weight in its stored layout, rows_gemm.h's tiles.
 *
 * Why: at decode step sizes a projection reads its whole weight for a handful of rows. MKL's and oneDNN's GEMMs pack the
 * weight (or reorder it) on every call and read it with no prefetch, which at these sizes costs more than the
 * arithmetic; here each weight line is read once, prefetched into L2 ahead of use, and used for every row while in L1.
 * Outputs are split across threads in blocks of 16.
 */
#include <stdint.h>

#include "panels.h"
#include "rows_gemm.h"

#define OUTPUTS_PER_TASK 16

void openk3_linear_rows(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w, float *y, int num_threads) {
    const int64_t tasks = (N + OUTPUTS_PER_TASK - 1) / OUTPUTS_PER_TASK;
    /* below ~64k multiply-adds a second thread's wake-up costs more than it saves */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * N * K >= (1 << 16))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n = t * OUTPUTS_PER_TASK, count = N - n < OUTPUTS_PER_TASK ? N - n : OUTPUTS_PER_TASK;
        rows_times_weight_t(M, count, K, x, ldx, w + n * K, K, y + n, N);
    }
}

void openk3_pack_panels(int64_t N, int64_t K, const float *w, float *p) {
    for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
        float *panel = p + n0 * K;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PANEL; j++) panel[k * PANEL + j] = n0 + j < N ? w[(n0 + j) * K + k] : 0.0f;
    }
}

void openk3_linear_panels(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *p, float *y, int num_threads) {
    linear_panels(M, N, K, x, ldx, p, y, N, num_threads);
}
