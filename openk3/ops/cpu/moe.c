/* MoE bookkeeping at decode sizes: the router's sigmoid top-k, and moving (token, expert) pairs into and out of the
 * padded per-expert block of the batched expert path (ops/moe/batched.py).
 *
 * Legend: T tokens, E experts, k experts per token, P = T * k pairs (token-major: pair p is token p / k, choice p % k),
 * D row width, C rows per expert in the block (the most pairs any expert got).
 * Each function is the loop its torch counterpart spells with ~5-20 small ops (sort, bincount, cumsum, index_put, ...);
 * at decode sizes those ops' dispatch is the cost, not the few hundred rows they move.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* scores [T, E]: router logits in, sigmoid scores out. idx/weight [T, k]: the k largest scores + bias, largest first
 * (an equal value does not displace an earlier expert), weights from the unbiased scores, renormalised and scaled. */
void openk3_moe_route(int64_t T, int64_t E, int64_t k, float *scores, const float *bias, int renormalize, float scaling, int64_t *idx,
                      float *weight) {
    for (int64_t t = 0; t < T; t++) {
        float *s = scores + t * E;
        int64_t *ti = idx + t * k;
        float *tw = weight + t * k;
        for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e]));
        int64_t filled = 0;
        float sel[64]; /* selection values of the kept experts, descending; k <= 64 is checked by the caller */
        for (int64_t e = 0; e < E; e++) {
            const float v = bias ? s[e] + bias[e] : s[e];
            if (filled == k && !(v > sel[k - 1])) continue;
            int64_t pos = filled < k ? filled++ : k - 1;
            while (pos > 0 && v > sel[pos - 1]) {
                sel[pos] = sel[pos - 1];
                ti[pos] = ti[pos - 1];
                pos--;
            }
            sel[pos] = v;
            ti[pos] = e;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            tw[j] = s[ti[j]];
            sum += tw[j];
        }
        const float norm = renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
        for (int64_t j = 0; j < k; j++) tw[j] = tw[j] * norm * scaling;
    }
}

/* slot_P[p]: the pair's row in its expert's block (pairs keep token order within an expert). Returns C, or -1 when an
 * expert id is outside 0..E-1 (nothing else is then trusted). */
int64_t openk3_moe_plan(int64_t P, int64_t E, const int64_t *idx, int64_t *counts, int64_t *slot_P) {
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    int64_t most = 0;
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = idx[p];
        if (e < 0 || e >= E) return -1;
        slot_P[p] = counts[e]++;
        if (counts[e] > most) most = counts[e];
    }
    return most;
}

/* block [E, C, D] (zeroed by the caller): row (idx[p], slot_P[p]) = x[p / k] */
void openk3_moe_gather(int64_t P, int64_t k, int64_t D, int64_t C, const int64_t *idx, const int64_t *slot_P, const float *x, int64_t x_stride,
                       float *block) {
    for (int64_t p = 0; p < P; p++) memcpy(block + (idx[p] * C + slot_P[p]) * D, x + (p / k) * x_stride, (size_t)D * sizeof(float));
}

/* y [T, D] = sum over each token's k pairs of weight * block row, accumulated in fp32 in choice order */
void openk3_moe_combine(int64_t T, int64_t k, int64_t D, int64_t C, const int64_t *idx, const int64_t *slot_P, const float *weight,
                        const float *block, float *y) {
    for (int64_t t = 0; t < T; t++) {
        float *yt = y + t * D;
        for (int64_t d = 0; d < D; d++) yt[d] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int64_t p = t * k + j;
            const float w = weight[p], *row = block + (idx[p] * C + slot_P[p]) * D;
            for (int64_t d = 0; d < D; d++) yt[d] += w * row[d];
        }
    }
}
