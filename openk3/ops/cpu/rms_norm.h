/* RMSNorm of fp32 rows, out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for norm.c and for the kernels that chain it with
 * other steps in one call (moe.c's openk3_moe_latent_block): the same code, so the same bits wherever it runs. */
#ifndef OPENK3_RMS_NORM_H
#define OPENK3_RMS_NORM_H

#include <math.h>
#include <stdint.h>

static inline void rms_norm_rows(int64_t rows, int64_t width, const float *x, int64_t x_stride, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * width;
        float ss = 0.0f;
        for (int64_t i = 0; i < width; i++) ss += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(ss / (float)width + eps);
        if (w != 0)
            for (int64_t i = 0; i < width; i++) o[i] = xr[i] * scale * w[i];
        else
            for (int64_t i = 0; i < width; i++) o[i] = xr[i] * scale;
    }
}

#endif
