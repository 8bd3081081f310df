/* Attention Residuals' one-shot mix over depth for fp32 rows (ops/attn_res/naive.py is the definition): per token n,
 * logit_s = (V_s[n] / sqrt(mean(V_s[n]^2) + eps)) . (gamma * w), p = softmax over the S sources, out[n] = sum_s p_s V_s[n].
 *
 * Why: every sublayer of a decode step reads its input through this mix; in torch it is a stack of the sources and ~10 small
 * ops (cast, pow, mean, rsqrt, multiply, matmul, softmax, multiply, sum) over a few thousand values, whose dispatch is the
 * cost. Here the sources are read where they lie (no stack) in one pass per token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* sources: S addresses of [N, D] fp32 row blocks with row strides `strides`; w, gamma [D]; out [N, D] contiguous.
 * Returns 1 when S is outside 1..64 (nothing written). */
int openk3_attn_res_mix(int64_t S, int64_t N, int64_t D, const int64_t *sources, const int64_t *strides, const float *w, const float *gamma,
                        float eps, float *out, int num_threads) {
    if (S < 1 || S > 64) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && S * N * D >= (1 << 18))
    for (int64_t n = 0; n < N; n++) {
        float p[64];
        float top = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            const float *v = (const float *)(intptr_t)sources[s] + n * strides[s];
            float ss = 0.0f, dot = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) ss += v[d] * v[d];
            const float r = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += (v[d] * r) * (gamma[d] * w[d]);
            p[s] = dot;
            top = dot > top ? dot : top;
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            p[s] = expf(p[s] - top);
            sum += p[s];
        }
        float *o = out + n * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            const float ps = p[s] / sum, *v = (const float *)(intptr_t)sources[s] + n * strides[s];
            for (int64_t d = 0; d < D; d++) o[d] += ps * v[d];
        }
    }
    return 0;
}
