/* exp, log, sigmoid and softplus for the kernels' vectorised loops. */
#ifndef OPENK3_FASTMATH_H
#define OPENK3_FASTMATH_H

#include <math.h>
#include <stdint.h>

/* exp and log as branch-free polynomials (Cephes' single-precision ones, about 1 ulp), so that loops over a head's
 * channels vectorise: the C library's expf/log1pf are scalar calls and made the KDA decode kernel ~1.7x slower. */
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float log_f(float x) { /* x normal and positive */
    union { float f; int32_t i; } u = {.f = x};
    float e = (float)(((u.i >> 23) & 0xff) - 127);
    u.i = (u.i & 0x007fffff) | 0x3f800000; /* mantissa in [1, 2) */
    float m = u.f;
    const int big = m > 1.41421356f;       /* bring it to [sqrt(1/2), sqrt(2)) */
    m = big ? 0.5f * m : m;
    e = big ? e + 1.0f : e;
    const float t = m - 1.0f, z = t * t;
    float y = 7.0376836292e-2f;
    y = fmaf(y, t, -1.1514610310e-1f);
    y = fmaf(y, t, 1.1676998740e-1f);
    y = fmaf(y, t, -1.2420140846e-1f);
    y = fmaf(y, t, 1.4249322787e-1f);
    y = fmaf(y, t, -1.6668057665e-1f);
    y = fmaf(y, t, 2.0000714765e-1f);
    y = fmaf(y, t, -2.4999993993e-1f);
    y = fmaf(y, t, 3.3333331174e-1f);
    y = y * t * z;
    y = fmaf(e, -2.12194440e-4f, y);
    y = fmaf(-0.5f, z, y);
    return fmaf(e, 0.693359375f, t + y);
}

static inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }
/* softplus(x) = max(x, 0) + log(1 + exp(-|x|)): equal to torch's (which returns x above 20) to fp32 rounding */
static inline float softplus_f(float x) { return (x > 0.0f ? x : 0.0f) + log_f(1.0f + exp_f(-fabsf(x))); }

#endif
