/* MoE at decode sizes: the router's sigmoid top-k, moving (token, expert) pairs into and out of the padded per-expert
 * block of the batched expert path (ops/moe/batched.py), and that block's expert MLPs.
 *
 * Legend: T tokens, E experts, k experts per token, P = T * k pairs (token-major: pair p is token p / k, choice p % k),
 * D row width, C rows per expert in the block (the most pairs any expert got).
 * Each bookkeeping function is the loop its torch counterpart spells with ~5-20 small ops (sort, bincount, cumsum,
 * index_put, ...); at decode sizes those ops' dispatch is the cost, not the few hundred rows they move.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "glu.h"
#include "mxfp4_rows.h"
#include "panels.h"
#include "rms_norm.h"
#include "rows_gemm.h"

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

/* One expert on its c rows: out_e = w2 act(w1 x_e, w3 x_e), x_e and out_e [c, D], w1 and w3 [I, D], w2 [D, I]; gate and
 * up are the caller's scratch rows, [c, I] each. */
static void expert_glu(int64_t c, int64_t D, int64_t I, const float *xe, const float *w1, const float *w3, const float *w2, int act, float beta,
                       float linear_beta, float *gate, float *up, float *oute) {
    rows_times_weight_t(c, I, D, xe, D, w1, D, gate, I);
    rows_times_weight_t(c, I, D, xe, D, w3, D, up, I);
    glu_values(c * I, act, beta, linear_beta, gate, up, gate);
    rows_times_weight_t(c, D, I, gate, I, w2, I, oute, D);
}

/* out[e, :c_e] = w2_e act(w1_e x, w3_e x) for the first c_e = counts[e] rows of each expert's block; other rows are
 * neither read nor written. x, out [E, C, D]; w1, w3 [E, I, D]; w2 [E, D, I], all contiguous.
 * Experts are split over threads (each reads only its own weights); a thread keeps its expert's gate and up rows,
 * [c_e, I] each, in a scratch buffer. Returns 1 when the scratch cannot be allocated (nothing is then trusted). */
int openk3_moe_experts_glu(int64_t E, int64_t C, int64_t D, int64_t I, const int64_t *counts, const float *x, const float *w1,
                           const float *w3, const float *w2, int act, float beta, float linear_beta, float *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && E > 1)
    {
        float *gate = malloc(sizeof(float) * (size_t)(2 * C * I));
        float *up = gate ? gate + C * I : NULL;
        if (gate == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            const int64_t c = counts[e];
            if (c == 0 || gate == NULL) continue;
            expert_glu(c, D, I, x + e * C * D, w1 + e * I * D, w3 + e * I * D, w2 + e * D * I, act, beta, linear_beta, gate, up, out + e * C * D);
        }
        free(gate);
    }
    return failed;
}

/* openk3_moe_experts_glu over packed MXFP4 experts (ops/moe/packed_bank.py's layout: w1, w3 codes [E, I, D/2] and scales
 * [E, I, D/32], w2 [E, D, I/2] and [E, D, I/32]): the products decode the weights in registers (mxfp4_rows.h), so no
 * expert is ever written out in fp32 and idle experts are never read; the result equals openk3_moe_experts_glu on the
 * dequantized bank bit for bit. D and I must be multiples of 32. Returns 1 when the scratch cannot be allocated. */
int openk3_moe_experts_glu_mxfp4(int64_t E, int64_t C, int64_t D, int64_t I, const int64_t *counts, const float *x, const uint8_t *w1p,
                                 const uint8_t *w1s, const uint8_t *w3p, const uint8_t *w3s, const uint8_t *w2p, const uint8_t *w2s, int act,
                                 float beta, float linear_beta, float *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && E > 1)
    {
        float *gate = malloc(sizeof(float) * (size_t)(2 * C * I));
        float *up = gate ? gate + C * I : NULL;
        if (gate == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            const int64_t c = counts[e];
            if (c == 0 || gate == NULL) continue;
            const float *xe = x + e * C * D;
            mx_rows_times_weight_t(c, I, D, xe, D, w1p + e * I * (D / 2), w1s + e * I * (D / 32), gate, I);
            mx_rows_times_weight_t(c, I, D, xe, D, w3p + e * I * (D / 2), w3s + e * I * (D / 32), up, I);
            glu_values(c * I, act, beta, linear_beta, gate, up, gate);
            mx_rows_times_weight_t(c, D, I, gate, I, w2p + e * D * (I / 2), w2s + e * D * (I / 32), out + e * C * D, D);
        }
        free(gate);
    }
    return failed;
}

/* The whole routed-expert step of a packed MXFP4 bank in one call (ops/moe/packed_c.py): plan the pairs, gather each
 * token's row into its experts' blocks, openk3_moe_experts_glu_mxfp4, combine into y [T, D] -- the same functions in the
 * same order as the four calls it replaces, so the same bits, without their four torch allocations and host round trips
 * per layer and step. idx, weight [T, k] contiguous; x rows with stride x_stride. Returns 0, -1 when an expert id is
 * outside 0..E-1, or 1 when scratch memory cannot be had (y is then not trusted). */
int openk3_moe_packed_pairs(int64_t T, int64_t k, int64_t E, int64_t D, int64_t I, const float *x, int64_t x_stride, const int64_t *idx,
                            const float *weight, const uint8_t *w1p, const uint8_t *w1s, const uint8_t *w3p, const uint8_t *w3s,
                            const uint8_t *w2p, const uint8_t *w2s, int act, float beta, float linear_beta, float *y, int num_threads) {
    const int64_t P = T * k;
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(E + P));
    if (counts == NULL) return 1;
    int64_t *slot_P = counts + E;
    const int64_t C = openk3_moe_plan(P, E, idx, counts, slot_P);
    if (C < 0) {
        free(counts);
        return -1;
    }
    float *block = malloc(sizeof(float) * (size_t)(2 * E * C * D));
    if (block == NULL) {
        free(counts);
        return 1;
    }
    float *out = block + E * C * D;
    openk3_moe_gather(P, k, D, C, idx, slot_P, x, x_stride, block);
    int failed = openk3_moe_experts_glu_mxfp4(E, C, D, I, counts, block, w1p, w1s, w3p, w3s, w2p, w2s, act, beta, linear_beta, out, num_threads);
    if (!failed) openk3_moe_combine(T, k, D, C, idx, slot_P, weight, out, y);
    free(block);
    free(counts);
    return failed;
}

/* A latent MoE block's decode step after its router (ops/moe/block_c.py), in one call: y [T, D] =
 * up(norm(experts(down(x)))) + shared_down(glu(gate_up(x))), every projection from its panel copy (panels.h), the routed
 * experts by openk3_moe_packed_pairs, the norm by rms_norm.h and the activation by glu.h -- the code the separate calls
 * run, in the same order per value, so the same bits, without their dozen torch allocations and Python calls per layer.
 * L latent width, I expert width, S shared-expert width (gate | up side by side in gate_up_p); norm_w NULL: no latent
 * norm. Returns openk3_moe_packed_pairs's status (0, -1 for an expert id outside 0..E-1, 1 when memory cannot be had). */
int openk3_moe_latent_block(int64_t T, int64_t D, int64_t L, int64_t I, int64_t S, int64_t E, int64_t k, const float *x, int64_t x_stride,
                            const int64_t *idx, const float *weight, const float *down_p, const uint8_t *w1p, const uint8_t *w1s,
                            const uint8_t *w3p, const uint8_t *w3s, const uint8_t *w2p, const uint8_t *w2s, int act, float beta,
                            float linear_beta, const float *norm_w, float eps, const float *up_p, const float *gate_up_p, int shared_act,
                            float shared_beta, float shared_linear_beta, const float *shared_down_p, float *y, int num_threads) {
    float *scratch = malloc(sizeof(float) * (size_t)(T * (3 * L + 3 * S + D)));
    if (scratch == NULL) return 1;
    float *z = scratch, *routed = z + T * L, *normed = routed + T * L, *gate_up = normed + T * L, *h = gate_up + T * 2 * S;
    float *shared = h + T * S;
    linear_panels(T, L, D, x, x_stride, down_p, z, L, num_threads);
    const int status = openk3_moe_packed_pairs(T, k, E, L, I, z, L, idx, weight, w1p, w1s, w3p, w3s, w2p, w2s, act, beta, linear_beta, routed,
                                               num_threads);
    if (status) {
        free(scratch);
        return status;
    }
    if (norm_w != NULL) rms_norm_rows(T, L, routed, L, norm_w, eps, normed);
    linear_panels(T, D, L, norm_w != NULL ? normed : routed, L, up_p, y, D, num_threads);
    linear_panels(T, 2 * S, D, x, x_stride, gate_up_p, gate_up, 2 * S, num_threads);
    for (int64_t t = 0; t < T; t++)
        glu_values(S, shared_act, shared_beta, shared_linear_beta, gate_up + t * 2 * S, gate_up + t * 2 * S + S, h + t * S);
    linear_panels(T, D, S, h, S, shared_down_p, shared, D, num_threads);
    for (int64_t i = 0; i < T * D; i++) y[i] += shared[i];
    free(scratch);
    return 0;
}

/* The router's top-k after its logits (openk3_moe_route, the logits [T, E] turned into scores in place), then the block
 * (openk3_moe_latent_block) on the ids and weights it chose: one call for the MoE layer after the router's product
 * (ops/moe/block_c.py moe_routed_latent_block_c). Returns openk3_moe_latent_block's status; 1 also when the ids and weights
 * cannot be allocated. k <= 64 is checked by the caller. */
int openk3_moe_routed_latent_block(int64_t T, int64_t D, int64_t L, int64_t I, int64_t S, int64_t E, int64_t k, const float *x,
                                   int64_t x_stride, float *logits, const float *bias, int renormalize, float scaling, const float *down_p,
                                   const uint8_t *w1p, const uint8_t *w1s, const uint8_t *w3p, const uint8_t *w3s, const uint8_t *w2p,
                                   const uint8_t *w2s, int act, float beta, float linear_beta, const float *norm_w, float eps,
                                   const float *up_p, const float *gate_up_p, int shared_act, float shared_beta, float shared_linear_beta,
                                   const float *shared_down_p, float *y, int num_threads) {
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(T * k));
    float *weight = malloc(sizeof(float) * (size_t)(T * k));
    int status = 1;
    if (idx != NULL && weight != NULL) {
        openk3_moe_route(T, E, k, logits, bias, renormalize, scaling, idx, weight);
        status = openk3_moe_latent_block(T, D, L, I, S, E, k, x, x_stride, idx, weight, down_p, w1p, w1s, w3p, w3s, w2p, w2s, act, beta,
                                         linear_beta, norm_w, eps, up_p, gate_up_p, shared_act, shared_beta, shared_linear_beta,
                                         shared_down_p, y, num_threads);
    }
    free(idx);
    free(weight);
    return status;
}
