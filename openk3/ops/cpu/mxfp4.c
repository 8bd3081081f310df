/* MXFP4 decode to fp32 (ops/mxfp4.py's dequantize, same tables, so the same bits): each byte's two elements are one 8-byte
 * load from the byte-pair table, times the block's E8M0 scale value.
 *
 * Why: at decode steps a packed MoE layer decodes every expert its tokens picked (ops/moe/packed_bank.py); the torch decode
 * is an int64 gather per byte plus a scale gather and a multiply, ~0.2 G elements/s on the dev box, and at K3's widths it
 * was 90% of a batch-1 step of the K3-shaped slice (benchmarks/results/roofline.md). No flush-to-zero here: scale 0 decodes
 * to denormals, as in torch.
 */
#include <stdint.h>
#include <string.h>

/* packed [R, B] bytes, scales [R, B * 2 / block] E8M0 bytes, out [R, 2 B] fp32; pairs [256][2], scale_values [256]. */
void openk3_mxfp4_decode(int64_t R, int64_t B, int64_t block, const uint8_t *packed, const uint8_t *scales, const float *pairs,
                         const float *scale_values, float *out, int num_threads) {
    const int64_t per_scale = block / 2, groups = B / per_scale;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && R * B >= (1 << 20))
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *p = packed + r * B, *s = scales + r * groups;
        float *o = out + r * 2 * B;
        for (int64_t gi = 0; gi < groups; gi++) {
            const float sv = scale_values[s[gi]];
            const uint8_t *pg = p + gi * per_scale;
            float *og = o + gi * 2 * per_scale;
            for (int64_t b = 0; b < per_scale; b++) {
                const float *pv = pairs + 2 * (int64_t)pg[b];
                og[2 * b] = pv[0] * sv;
                og[2 * b + 1] = pv[1] * sv;
            }
        }
    }
}
