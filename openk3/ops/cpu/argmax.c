/* The index of each row's largest value, with torch.argmax's rules (ops/argmax_c.py argmax_rows is the definition): the
 * first index among equal maxima, and a NaN counts as larger than any number (the first NaN wins).
 *
 * Why: the sampler takes a greedy row's token as the argmax over the vocabulary; torch's CPU argmax over [16, 4096] fp32
 * took ~100 us in this torch build (its max reduction ~7 us), about 1% of the demo model's batch-16 decode step.
 */
#include <math.h>
#include <stdint.h>

typedef float argmax_vf __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t argmax_vi __attribute__((vector_size(16 * sizeof(int32_t))));

/* The row's largest value in 16 lanes (a NaN compares false, so it never replaces a lane; it is noted apart), then the
 * first index holding it; a row with a NaN takes its first NaN instead. */
static int64_t row_argmax(int64_t V, const float *row) {
    argmax_vf lane = (argmax_vf){0} - INFINITY;
    argmax_vi nan = (argmax_vi){0};
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        argmax_vf value;
        __builtin_memcpy(&value, row + v, sizeof value);
        const argmax_vi bigger = value > lane;
        lane = (argmax_vf)((bigger & (argmax_vi)value) | (~bigger & (argmax_vi)lane));
        nan |= value != value;
    }
    float top = -INFINITY;
    int any_nan = 0;
    for (int j = 0; j < 16; j++) {
        top = lane[j] > top ? lane[j] : top;
        any_nan |= nan[j] != 0;
    }
    for (; v < V; v++) {
        top = row[v] > top ? row[v] : top;
        any_nan |= row[v] != row[v];
    }
    for (v = 0; v < V; v++)
        if (any_nan ? isnan(row[v]) : row[v] == top) return v;
    return 0; /* not reached: some value equals the largest */
}

void openk3_argmax_rows(int64_t M, int64_t V, const float *x, int64_t ldx, int64_t *out) {
    for (int64_t m = 0; m < M; m++) out[m] = row_argmax(V, x + m * ldx);
}
