/* y[M, N] = x[M, K] w[N, K]^T for a few rows M, with w as packed MXFP4 (codes [N, K/2], even element in the low nibble;
 * E8M0 scales [N, K/32]) decoded in registers: rows_gemm.h's product for the routed experts of a packed bank (moe.c).
 *
 * Why: decoding a picked expert into an fp32 buffer and then multiplying writes and reads 8x the packed bytes (at K3's
 * widths one expert is 132 MiB in fp32, against 17.6 MiB packed); at decode sizes that traffic, not the arithmetic, was the
 * routed experts' time. Here each vector of weights is decoded where it is used: per 32-weight block the 16 code values are
 * multiplied by the block's scale once (exact), and 16 codes become 16 floats by one permute of that table (AVX-512).
 *
 * Same sums as rows_gemm.h over the decoded weights, in the same order (vector lanes along K, one horizontal sum at the
 * end), and every decoded weight equals ops/mxfp4.py's dequantize bit for bit (code x scale is exact in fp32): the
 * result equals rows_times_weight_t on the dequantized weight bit for bit. K must be a multiple of 32.
 */
#ifndef OPENK3_MXFP4_ROWS_H
#define OPENK3_MXFP4_ROWS_H

#include <stdint.h>
#include <string.h>

#include "rows_gemm.h"

/* The E2M1 values of the 16 codes (code 8 + c is -value(c)); ops/mxfp4.py is the definition. */
static const float MX_E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* An E8M0 scale byte as fp32: 2^(b - 127) is the float whose exponent field is b, except b = 0 (2^-127, a subnormal) and
 * 0xFF (NaN). */
static inline float mx_scale(uint8_t b) {
    const uint32_t bits = b == 0xFF ? 0x7FC00000u : b == 0 ? 0x00400000u : (uint32_t)b << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 16 code values times a block's scale (exact products): one table per block, so that decoding a vector is a lookup. */
#if defined(__AVX512F__)
typedef __m512 mx_table;
static inline mx_table mx_scaled_table(float s) { return _mm512_mul_ps(_mm512_loadu_ps(MX_E2M1), _mm512_set1_ps(s)); }
#else
typedef struct {
    float v[16];
} mx_table;
static inline mx_table mx_scaled_table(float s) {
    mx_table t;
    for (int c = 0; c < 16; c++) t.v[c] = MX_E2M1[c] * s;
    return t;
}
#endif

/* ROWS_VW weights from ROWS_VW / 2 code bytes. AVX-512: each byte widened into two lanes, the odd lane shifted down by a
 * nibble, and the table permuted by them (vpermps reads only an index's low 4 bits, so the even lane needs no mask). */
static inline rows_vf mx_decode(const uint8_t *p, mx_table t) {
#if defined(__AVX512F__)
    uint64_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m128i v = _mm_cvtsi64_si128((long long)bytes);
    const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i codes = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v)), shift);
    return (rows_vf)_mm512_permutexvar_ps(codes, t);
#else
    rows_vf w;
    for (int j = 0; j < ROWS_VW / 2; j++) {
        w[2 * j] = t.v[p[j] & 15];
        w[2 * j + 1] = t.v[p[j] >> 4];
    }
    return w;
#endif
}

#define MX_PREFETCH 512 /* code bytes ahead: the same 1024 weights ahead as ROWS_PREFETCH's 2048 floats is 8 KiB of fp32 */

#define MX_TILE(MB, NB)                                                                                                       \
    static inline void mx_tile_##MB##_##NB(int prefetch, int64_t K, const float *x, int64_t ldx, const uint8_t *p,           \
                                           const uint8_t *s, float *y, int64_t ldy) {                                         \
        const int64_t ldp = K / 2, lds = K / 32;                                                                              \
        rows_vf acc[MB][NB];                                                                                                  \
        for (int i = 0; i < MB; i++)                                                                                          \
            for (int j = 0; j < NB; j++) acc[i][j] = (rows_vf){0};                                                            \
        for (int64_t b = 0; b < lds; b++) {                                                                                   \
            mx_table tv[NB];                                                                                                  \
            for (int j = 0; j < NB; j++) tv[j] = mx_scaled_table(mx_scale(s[j * lds + b]));                                   \
            if (prefetch && (b & 3) == 0)                                                                                     \
                for (int j = 0; j < NB; j++) __builtin_prefetch(p + j * ldp + b * 16 + MX_PREFETCH, 0, 2);                     \
            for (int64_t k = b * 32; k < b * 32 + 32; k += ROWS_VW) {                                                         \
                rows_vf wv[NB];                                                                                               \
                for (int j = 0; j < NB; j++) wv[j] = mx_decode(p + j * ldp + k / 2, tv[j]);                                   \
                for (int i = 0; i < MB; i++) {                                                                                \
                    const rows_vf xv = rows_load(x + i * ldx + k);                                                            \
                    for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];                                                     \
                }                                                                                                             \
            }                                                                                                                 \
        }                                                                                                                     \
        if (NB == 4) {                                                                                                        \
            for (int i = 0; i < MB; i++) rows_hsum4(acc[i][0], acc[i][NB > 1 ? 1 : 0], acc[i][NB > 2 ? 2 : 0], acc[i][NB > 3 ? 3 : 0], y + i * ldy); \
        } else if (NB == 2) {                                                                                                 \
            int i = 0;                                                                                                        \
            for (; i + 1 < MB; i += 2) {                                                                                      \
                float s4[4];                                                                                                  \
                rows_hsum4(acc[i][0], acc[i][NB - 1], acc[i + 1][0], acc[i + 1][NB - 1], s4);                                 \
                y[i * ldy] = s4[0], y[i * ldy + 1] = s4[1], y[(i + 1) * ldy] = s4[2], y[(i + 1) * ldy + 1] = s4[3];           \
            }                                                                                                                 \
            for (; i < MB; i++) y[i * ldy] = rows_hsum(acc[i][0]), y[i * ldy + 1] = rows_hsum(acc[i][NB - 1]);                \
        } else {                                                                                                              \
            for (int i = 0; i < MB; i++)                                                                                      \
                for (int j = 0; j < NB; j++) y[i * ldy + j] = rows_hsum(acc[i][j]);                                           \
        }                                                                                                                     \
    }

MX_TILE(1, 4)
MX_TILE(2, 4)
MX_TILE(3, 4)
MX_TILE(4, 4)
MX_TILE(1, 1)
MX_TILE(2, 1)
MX_TILE(3, 1)
MX_TILE(4, 1)
/* More than 4 rows (an expert that several tokens of a step picked): two outputs at a time over blocks of up to 8 rows,
 * so that each weight vector is decoded once per 8 rows rather than once per 4 (the decode, not the products, bounds
 * these tiles). */
MX_TILE(1, 2)
MX_TILE(2, 2)
MX_TILE(3, 2)
MX_TILE(4, 2)
MX_TILE(5, 2)
MX_TILE(6, 2)
MX_TILE(7, 2)
MX_TILE(8, 2)

typedef void (*mx_tile_fn)(int, int64_t, const float *, int64_t, const uint8_t *, const uint8_t *, float *, int64_t);

/* y[M, N] (row stride ldy) = x[M, K] (ldx) w[N, K]^T, w as codes [N, K/2] and scales [N, K/32]; serial, as
 * rows_times_weight_t. */
static void mx_rows_times_weight_t(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const uint8_t *packed,
                                   const uint8_t *scales, float *y, int64_t ldy) {
    static const mx_tile_fn four[5] = {0, mx_tile_1_4, mx_tile_2_4, mx_tile_3_4, mx_tile_4_4};
    static const mx_tile_fn one[5] = {0, mx_tile_1_1, mx_tile_2_1, mx_tile_3_1, mx_tile_4_1};
    static const mx_tile_fn two[9] = {0, mx_tile_1_2, mx_tile_2_2, mx_tile_3_2, mx_tile_4_2, mx_tile_5_2, mx_tile_6_2, mx_tile_7_2, mx_tile_8_2};
    const int64_t ldp = K / 2, lds = K / 32;
    if (M > 4 && N % 2 == 0) { /* the same sums per output as the tiles below, so the same bits */
        for (int64_t n = 0; n < N; n += 2)
            for (int64_t m = 0; m < M; m += 8) {
                const int64_t mb = M - m < 8 ? M - m : 8;
                two[mb](m == 0, K, x + m * ldx, ldx, packed + n * ldp, scales + n * lds, y + m * ldy + n, ldy);
            }
        return;
    }
    for (int64_t n = 0; n < N; n += 4) {
        const int64_t nb = N - n < 4 ? N - n : 4;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t mb = M - m < 4 ? M - m : 4;
            if (nb == 4)
                four[mb](m == 0, K, x + m * ldx, ldx, packed + n * ldp, scales + n * lds, y + m * ldy + n, ldy);
            else
                for (int64_t j = 0; j < nb; j++)
                    one[mb](m == 0, K, x + m * ldx, ldx, packed + (n + j) * ldp, scales + (n + j) * lds, y + m * ldy + n + j, ldy);
        }
    }
}

#endif
