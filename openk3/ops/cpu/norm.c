/* RMSNorm over the last dimension of fp32 rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (the loop: rms_norm.h).
 *
 * Why a kernel for something this small: it runs twice per layer on every decode step, where torch's composite rms_norm
 * (cast, square, mean, add, rsqrt, two multiplies) costs ~30 us in a real step for a few rows of 256 values.
 */
#include <stdint.h>

#include "rms_norm.h"

void openk3_rms_norm(int64_t rows, int64_t width, const float *x, int64_t x_stride, const float *w, float eps, float *out) {
    rms_norm_rows(rows, width, x, x_stride, w, eps, out);
}
