/* A gated MLP's activation over fp32 rows, out = act(gate, up) (ops/activation.py is the definition; glu.h the loop).
 *
 * Why: the shared experts and the dense MLP run it once per layer per step; torch's SiTU-GLU is ~8 elementwise ops (casts,
 * two tanh, sigmoid, multiplies), ~90 us per call at 16 rows of 256-768, almost all dispatch (issue 42's profile). Gate and
 * up may be strided rows (the two pieces of one fused projection's output).
 */
#include <stdint.h>

#include "glu.h"

void openk3_glu(int64_t rows, int64_t width, const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int act, float beta,
                float linear_beta, float *out) {
    for (int64_t r = 0; r < rows; r++) glu_values(width, act, beta, linear_beta, gate + r * gate_stride, up + r * up_stride, out + r * width);
}
