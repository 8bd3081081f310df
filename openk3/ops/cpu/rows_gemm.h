/* y[M, N] = x[M, K] w[N, K]^T for a few rows M, with w in its stored (nn.Linear) layout: the decode-sized projections of
 * linear.c, the experts of moe.c (each multiplies a handful of rows by its own weights) and the page scores of
 * mla_decode.c.
 *
 * Why not a BLAS call: at these sizes (a few rows, a weight of 10^4-10^6 values) a GEMM call's set-up and weight packing
 * cost more than the arithmetic, and torch's batched product over experts still packs each one. Here the weight is read
 * once, straight from where it lies, and each of its cache lines is used for every row while it is in L1.
 *
 * Form: a tile of MB rows x NB outputs keeps MB*NB vector accumulators; each step along K loads NB weight vectors and MB
 * input vectors and does MB*NB fused multiply-adds; the accumulators are summed across lanes once at the end of K. The
 * first row block of each tile also prefetches the weight 8 KiB ahead into L2 (weights come from memory at decode time;
 * prefetching at all made the experts 1.2x faster, into L2 rather than with the non-temporal hint 1.8x, close to what a
 * plain read of the same bytes takes: a 16-expert layer's 6 MiB in ~160 us, 38 GB/s on the dev box).
 * Vector width follows the target (16 floats with AVX-512, else 8); a K that is not a multiple of it ends in scalar code.
 */
#ifndef OPENK3_ROWS_GEMM_H
#define OPENK3_ROWS_GEMM_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define ROWS_VW 16
#else
#define ROWS_VW 8
#endif

typedef float rows_vf __attribute__((vector_size(ROWS_VW * sizeof(float)), aligned(4))); /* aligned(4): unaligned loads */

static inline rows_vf rows_load(const float *p) { return *(const rows_vf *)p; }

static inline float rows_hsum(rows_vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < ROWS_VW; i++) s += v[i];
    return s;
#endif
}

/* out[0..3] = rows_hsum(a0) .. rows_hsum(a3), the same additions in the same order (so the same bits), done for the four
 * at once: the tiles below keep four outputs per row, and at K = 128 or 256 four separate sums across lanes cost about as
 * much as the products before them (issue 42). Each level adds the lane pairs _mm512_reduce_add_ps adds (i and i + 8,
 * then i and i + 4, i and i + 2, i and i + 1), two or four vectors' worth per instruction. */
static inline void rows_hsum4(rows_vf a0, rows_vf a1, rows_vf a2, rows_vf a3, float *out) {
#if defined(__AVX512F__)
    const __m512 v0 = (__m512)a0, v1 = (__m512)a1, v2 = (__m512)a2, v3 = (__m512)a3;
    /* halves: [v0 lanes 0-7 | v1 lanes 0-7] + [v0 lanes 8-15 | v1 lanes 8-15] */
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
    /* quarters: quarter j holds vector j's lanes (i) + (i + 4), i < 4 */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
    const __m512 r = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));         /* lanes (0 + 2), (1 + 3) of each quarter */
    const __m512 t = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1));         /* lane 0 of quarter j: vector j's sum */
    const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, t)));
#else
    out[0] = rows_hsum(a0);
    out[1] = rows_hsum(a1);
    out[2] = rows_hsum(a2);
    out[3] = rows_hsum(a3);
#endif
}

#define ROWS_PREFETCH 2048 /* floats ahead (8 KiB); 1024 measured ~10% slower, 4096 the same */

#define ROWS_TILE(MB, NB)                                                                                                      \
    static inline void rows_tile_##MB##_##NB(int prefetch, int64_t K, const float *x, int64_t ldx, const float *w, int64_t ldw, \
                                             float *y, int64_t ldy) {                                                          \
        rows_vf acc[MB][NB];                                                                                                   \
        for (int i = 0; i < MB; i++)                                                                                           \
            for (int j = 0; j < NB; j++) acc[i][j] = (rows_vf){0};                                                             \
        int64_t k = 0;                                                                                                         \
        for (; k + ROWS_VW <= K; k += ROWS_VW) {                                                                               \
            rows_vf wv[NB];                                                                                                    \
            for (int j = 0; j < NB; j++) wv[j] = rows_load(w + j * ldw + k);                                                   \
            if (prefetch)                                                                                                      \
                for (int j = 0; j < NB; j++) __builtin_prefetch(w + j * ldw + k + ROWS_PREFETCH, 0, 2);                        \
            for (int i = 0; i < MB; i++) {                                                                                     \
                const rows_vf xv = rows_load(x + i * ldx + k);                                                                 \
                for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];                                                          \
            }                                                                                                                  \
        }                                                                                                                      \
        if (NB == 4 && k == K) {                                                                                               \
            for (int i = 0; i < MB; i++) rows_hsum4(acc[i][0], acc[i][NB > 1 ? 1 : 0], acc[i][NB > 2 ? 2 : 0], acc[i][NB > 3 ? 3 : 0], y + i * ldy);  \
            return;                                                                                                            \
        }                                                                                                                      \
        for (int i = 0; i < MB; i++)                                                                                           \
            for (int j = 0; j < NB; j++) {                                                                                     \
                float s = rows_hsum(acc[i][j]);                                                                                \
                for (int64_t kk = k; kk < K; kk++) s += x[i * ldx + kk] * w[j * ldw + kk];                                     \
                y[i * ldy + j] = s;                                                                                            \
            }                                                                                                                  \
    }

ROWS_TILE(1, 4)
ROWS_TILE(2, 4)
ROWS_TILE(3, 4)
ROWS_TILE(4, 4)
ROWS_TILE(1, 1)
ROWS_TILE(2, 1)
ROWS_TILE(3, 1)
ROWS_TILE(4, 1)

typedef void (*rows_tile_fn)(int, int64_t, const float *, int64_t, const float *, int64_t, float *, int64_t);

/* y[M, N] (row stride ldy) = x[M, K] (ldx) w[N, K]^T (ldw), serial: callers split the work across threads. */
static void rows_times_weight_t(int64_t M, int64_t N, int64_t K, const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,
                                int64_t ldy) {
    static const rows_tile_fn four[5] = {0, rows_tile_1_4, rows_tile_2_4, rows_tile_3_4, rows_tile_4_4};
    static const rows_tile_fn one[5] = {0, rows_tile_1_1, rows_tile_2_1, rows_tile_3_1, rows_tile_4_1};
    for (int64_t n = 0; n < N; n += 4) {
        const int64_t nb = N - n < 4 ? N - n : 4;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t mb = M - m < 4 ? M - m : 4;
            if (nb == 4)
                four[mb](m == 0, K, x + m * ldx, ldx, w + n * ldw, ldw, y + m * ldy + n, ldy);
            else
                for (int64_t j = 0; j < nb; j++) one[mb](m == 0, K, x + m * ldx, ldx, w + (n + j) * ldw, ldw, y + m * ldy + n + j, ldy);
        }
    }
}

#endif
