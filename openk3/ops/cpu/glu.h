/* The gated MLP activations of ops/activation.py on fp32 values, for the kernels that run an MLP (moe.c's experts) and the
 * standalone activation (glu.c). */
#ifndef OPENK3_GLU_H
#define OPENK3_GLU_H

#include <math.h>
#include <stdint.h>

#include "fastmath.h"

/* tanh from exp_f: odd, saturating, and its Taylor polynomial below 1/4, where 1 - e^-2|x| would cancel (the terms left
 * out are below 1e-9 relative there; above, the cancellation costs at most ~2.5x of e's rounding) */
static inline float tanh_f(float x) {
    const float a = fabsf(x), e = exp_f(-2.0f * a), far = (1.0f - e) / (1.0f + e), z = a * a;
    const float near =
        a * (1.0f + z * (-1.0f / 3.0f + z * (2.0f / 15.0f + z * (-17.0f / 315.0f + z * (62.0f / 2835.0f + z * (-1382.0f / 155925.0f))))));
    const float t = a < 0.25f ? near : far;
    return x < 0.0f ? -t : t;
}

enum { ACT_SILU = 0, ACT_SITU = 1 }; /* ops/activation.py: silu_glu, situ_glu */

/* out[i] = act(gate[i], up[i]) over n values (out may be gate) */
static inline void glu_values(int64_t n, int act, float beta, float linear_beta, const float *gate, const float *up, float *out) {
    if (act == ACT_SITU)
        for (int64_t i = 0; i < n; i++) out[i] = beta * tanh_f(gate[i] / beta) * sigmoid_f(gate[i]) * (linear_beta * tanh_f(up[i] / linear_beta));
    else
        for (int64_t i = 0; i < n; i++) out[i] = gate[i] * sigmoid_f(gate[i]) * up[i];
}

#endif
