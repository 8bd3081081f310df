/* One KDA decode token per sequence, from the input projections to the gated, normalised output, in one pass per head.
 *
 * Legend: N sequences, H heads, D head dim (q, k and v alike), P = H * D, W short-conv width, S slots in the pools.
 * Per sequence n and head h, the same steps as the torch path of model/kda.py (each step's reference named):
 *   1. short conv + SiLU of q | k | v, the window advanced in place      (ops/short_conv/update_inplace.py)
 *   2. q, k L2-normalised over D (eps 1e-6), q scaled by `scale`          (ops/norm.py l2_norm)
 *   3. forget gate g from f + dt_bias, beta = sigmoid(b)                  (ops/kda/gate.py)
 *   4. the delta-rule step on the state, read once, updated in place      (ops/kda/decode_inplace.py)
 *   5. RMSNorm of o over D times sigmoid(output gate)                     (model/kda.py)
 * Slots are addressed through `slots`, so non-consecutive slots need no gather or scatter; a sequence flagged in `fresh`
 * starts from a zero window and state. All math in fp32; results agree with the torch path to fp32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "panels.h"

#define MAX_D 512

int openk3_kda_decode_step(
    int64_t N, int64_t H, int64_t D, int64_t W,
    const float *x, int64_t x_stride,          /* [N, 3P] pre-conv q | k | v */
    const float *conv_w,                       /* [3P, W] */
    float *conv_pool,                          /* [S, 3P, W-1] */
    const int64_t *slots, const uint8_t *fresh, /* [N]; fresh may be NULL */
    const float *f, int64_t f_stride,          /* [N, P] gate pre-activation (f_b output) */
    const float *A_log, const float *dt_bias,  /* [H], [P] */
    const float *b, int64_t b_stride,          /* [N, H] beta logits */
    float *state_pool,                         /* [S, H, D, D] */
    int gate_kind, float lower_bound, float scale,
    const float *norm_w, float norm_eps,       /* [D] */
    const float *gate, int64_t gate_stride,    /* [N, P] output gate pre-sigmoid */
    float *out,                                /* [N, P] */
    int num_threads)
{
    if (D > MAX_D || W < 1) return 1;
    const int64_t P = H * D, C = 3 * P, Wm = W - 1;
    /* (sequence, head) pairs are independent: split over torch's OpenMP threads when built with -fopenmp (build.py) and
     * there are enough of them; each pair's state is 4 D^2 bytes, mostly a read from memory */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * H >= 16 && num_threads > 1)
    for (int64_t nh = 0; nh < N * H; nh++) {
        const int64_t n = nh / H, h = nh % H;
        float q[MAX_D], k[MAX_D], v[MAX_D], decay[MAX_D], rk[MAX_D], rq[MAX_D], delta[MAX_D];
        const int64_t slot = slots[n];
        const int is_fresh = fresh != NULL && fresh[n];
        {
            /* 1. conv: channel c = group * P + h * D + i; window oldest first, the new input meets conv_w[c, W-1] */
            float *dst[3] = {q, k, v};
            for (int g = 0; g < 3; g++) {
                float *y = dst[g];
                const int64_t c0 = g * P + h * D;
                float *win = conv_pool + (slot * C + c0) * Wm; /* this head's D windows, Wm values each */
                const float *w = conv_w + c0 * W, *xin = x + n * x_stride + c0;
                if (is_fresh) memset(win, 0, (size_t)(D * Wm) * sizeof(float));
                if (W == 4) { /* Kimi's width, spelled out so the loop over channels vectorises */
                    for (int64_t i = 0; i < D; i++) {
                        float *wi = win + 3 * i;
                        const float *ww = w + 4 * i;
                        const float w0 = wi[0], w1 = wi[1], w2 = wi[2], xi = xin[i];
                        y[i] = w0 * ww[0] + w1 * ww[1] + w2 * ww[2] + xi * ww[3];
                        wi[0] = w1;
                        wi[1] = w2;
                        wi[2] = xi;
                    }
                } else
                for (int64_t i = 0; i < D; i++) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < Wm; j++) acc += win[i * Wm + j] * w[i * W + j];
                    y[i] = acc + xin[i] * w[i * W + Wm];
                    for (int64_t j = 0; j + 1 < Wm; j++) win[i * Wm + j] = win[i * Wm + j + 1];
                    if (Wm > 0) win[i * Wm + Wm - 1] = xin[i];
                }
                for (int64_t i = 0; i < D; i++) y[i] = y[i] * sigmoid_f(y[i]);
            }
            /* 2. L2 norms */
            float sq = 0.0f, sk = 0.0f;
            for (int64_t i = 0; i < D; i++) { sq += q[i] * q[i]; sk += k[i] * k[i]; }
            const float rq_norm = 1.0f / sqrtf(sq + 1e-6f), rk_norm = 1.0f / sqrtf(sk + 1e-6f);
            float kq = 0.0f;
            for (int64_t i = 0; i < D; i++) {
                k[i] *= rk_norm;
                q[i] = q[i] * rq_norm * scale;
                kq += k[i] * q[i];
            }
            /* 3. gates */
            const float rate = expf(A_log[h]);
            const float *fh = f + n * f_stride + h * D, *bias = dt_bias + h * D;
            if (gate_kind == 0)
                for (int64_t i = 0; i < D; i++) decay[i] = exp_f(-rate * softplus_f(fh[i] + bias[i]));
            else
                for (int64_t i = 0; i < D; i++) decay[i] = exp_f(lower_bound * sigmoid_f(rate * (fh[i] + bias[i])));
            const float beta = sigmoid_f(b[n * b_stride + h]);
            /* 4. S [D(k), D(v)]: reads S^T (decay k) and S^T (decay q), then S = decay S + k delta^T */
            float *S = state_pool + (slot * H + h) * D * D;
            if (is_fresh) memset(S, 0, (size_t)(D * D) * sizeof(float));
            for (int64_t j = 0; j < D; j++) { rk[j] = 0.0f; rq[j] = 0.0f; }
            for (int64_t i = 0; i < D; i++) {
                const float a = decay[i] * k[i], c2 = decay[i] * q[i];
                const float *row = S + i * D;
                for (int64_t j = 0; j < D; j++) { rk[j] += a * row[j]; rq[j] += c2 * row[j]; }
            }
            float so = 0.0f;
            for (int64_t j = 0; j < D; j++) {
                delta[j] = beta * (v[j] - rk[j]);
                rq[j] += kq * delta[j]; /* o = S'^T q~ */
                so += rq[j] * rq[j];
            }
            for (int64_t i = 0; i < D; i++) {
                float *row = S + i * D;
                const float d = decay[i], ki = k[i];
                for (int64_t j = 0; j < D; j++) row[j] = d * row[j] + ki * delta[j];
            }
            /* 5. RMSNorm over D, times sigmoid(gate) */
            const float r = 1.0f / sqrtf(so / (float)D + norm_eps);
            const float *gh = gate + n * gate_stride + h * D;
            float *oh = out + n * P + h * D;
            for (int64_t j = 0; j < D; j++) oh[j] = rq[j] * r * norm_w[j] * sigmoid_f(gh[j]);
        }
    }
    return 0;
}

/* A KDA layer's decode token with a full-rank output gate, from the layer's input to its output projection, in one call
 * (ops/kda/layer_c.py): the input projections q | k | v | f_a | g | b from their fused panel copy (panels.h), f_b, the step
 * above, o_proj -- the code and order of the separate calls, so the same bits, without their Python and torch dispatch.
 * Dm model width; in_p the panels of the fused [3P + D + P + H, Dm] weight, fb_p of f_b [P, D], o_p of o_proj [Dm, P].
 * Returns openk3_kda_decode_step's status, or 2 when scratch memory cannot be had. */
int openk3_kda_layer_decode(int64_t N, int64_t Dm, int64_t H, int64_t D, int64_t W, const float *x, int64_t x_stride, const float *in_p,
                            const float *fb_p, const float *conv_w, float *conv_pool, const int64_t *slots, const uint8_t *fresh,
                            const float *A_log, const float *dt_bias, float *state_pool, int gate_kind, float lower_bound, float scale,
                            const float *norm_w, float norm_eps, const float *o_p, float *y, int num_threads) {
    const int64_t P = H * D, width = 3 * P + D + P + H;
    float *proj = malloc(sizeof(float) * (size_t)(N * (width + 2 * P)));
    if (proj == NULL) return 2;
    float *f = proj + N * width, *o = f + N * P;
    linear_panels(N, width, Dm, x, x_stride, in_p, proj, width, num_threads);
    linear_panels(N, P, D, proj + 3 * P, width, fb_p, f, P, num_threads);
    const int status = openk3_kda_decode_step(N, H, D, W, proj, width, conv_w, conv_pool, slots, fresh, f, P, A_log, dt_bias,
                                              proj + 3 * P + D + P, width, state_pool, gate_kind, lower_bound, scale, norm_w, norm_eps,
                                              proj + 3 * P + D, width, o, num_threads);
    if (status == 0) linear_panels(N, Dm, P, o, P, o_p, y, Dm, num_threads);
    free(proj);
    return status;
}
