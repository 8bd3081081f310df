/* RMSNorm over the last dimension of fp32 rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
 *
 * Why a kernel for something this small: it runs twice per layer on every decode step, where torch's composite rms_norm
 * (cast, square, mean, add, rsqrt, two multiplies) costs ~30 us in a real step for a few rows of 256 values.
 */
#include <math.h>
#include <stdint.h>

void openk3_rms_norm(int64_t rows, int64_t width, const float *x, int64_t x_stride, const float *w, float eps, float *out) {
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
