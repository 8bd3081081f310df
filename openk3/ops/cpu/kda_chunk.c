/* A KDA chunked prefill on CPU in two calls (ops/kda/chunk_c.py; between them one bmm gives W | U = Tm KV):
 * openk3_kda_chunk_prep: the state-independent part, one pass per (chunk slot, head): everything ops/kda/chunk.py computes
 * before its state loop, read straight from the token-major inputs (no layout copies) and kept in L1/L2 while it is worked on.
 * openk3_kda_chunk_scan: the state loop and the read-out, one pass per (sequence, head) through its chunks (further below).
 *
 * Legend: Q chunk slots, H heads, C chunk size, K key dim, V value dim, SB sub-block rows (16, or C when smaller).
 * Inputs token-major: q, k, g [tokens, H, K], v [tokens, H, V], beta [tokens, H]; slot s covers tokens src[s] .. src[s] +
 * len[s] - 1 (len <= C; the rows past len are zero, as in chunk_layout.to_chunks). Outputs slot-major [Q * H, ...]:
 *   Qd  [C, K]     q scale exp(G)                       (G: the in-chunk cumulative log decay)
 *   KV  [C, K + V] exp(G) k | v                          (one product with Tm gives W | U)
 *   KdT [K, C]     (exp(G_C - G) k)^T                    (the state update's left factor, laid out for the state loop)
 *   dec [K]        exp(G_C)                              (the state's decay over the chunk)
 *   Aqk [C, C]     sum_c q_r k_j exp(G_r - G_j), j <= r, zero above
 *   Tm  [C, C]     (I + diag(beta) Akk)^-1 diag(beta),  Akk[r, j] = sum_c k_r k_j exp(G_r - G_j), j < r
 * Exactness (chunk.py's rules): exp(G_r - G_j) is factored only around points where no factor leaves fp32's normal range.
 * Off-diagonal sub-blocks take the first row p of the row block: exp(G_r - G_p) exp(G_p - G_j), both <= 1. A diagonal
 * sub-block takes the same split, k_j / exp(G_j - G_p), when its decay span is at most SPAN_MAX (then every factor is within
 * e^+-80); a faster-decaying one is summed term by term. Decay exponents are floored at EXP_FLOOR where a factor is <= 1
 * (denormals take x86's slow path; a factor below e^-60 cannot move an fp32 sum of unit-scale terms).
 * Products of two such factors still reach the denormal range (e^-140: a factor <= 1 times a floored one), and every
 * multiply-add with a denormal result costs a microcode assist (measured: the factor products ran 10x slower than their
 * FLOPs), so each thread computes with denormals flushed to zero (x86 MXCSR FTZ | DAZ, restored on return): a change below
 * 1.2e-38 per term. The triangular inverse is a forward substitution, row by row. All fp32; equal to chunk.py's form to
 * fp32 rounding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"
#include "rows_gemm.h"
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define EXP_FLOOR -60.0f
#define SPAN_MAX 80.0f
#define SUB_BLOCK 16

static inline float floored_exp(float x) { return exp_f(x < EXP_FLOOR ? EXP_FLOOR : x); }

/* One slot-head. buf holds 5 C*K + SB*K + C*C floats (the caller's per-thread scratch). */
static void chunk_prep(int64_t C, int64_t K, int64_t V, int64_t H, int64_t h, int64_t src, int64_t len, float scale,
                       const float *q, const float *k, const float *v, const float *g, const float *beta, float *Qd, float *KV,
                       float *KdT, float *dec, float *Aqk, float *Tm, float *buf) {
    const int64_t SB = C < SUB_BLOCK ? C : SUB_BLOCK;
    float *G = buf, *kk = G + C * K, *qs = kk + C * K, *rk = qs + C * K, *rq = rk + C * K, *cols = rq + C * K;
    float *diag = cols + SB * K, *X = diag; /* diag: SB*SB products, then the whole C*C inverse (after the products) */
    float bt[256];
    /* 1. rows in, G = cumsum(g); padding rows: k = q = v = beta = 0 and g = 0 (G stays at the last real row's) */
    for (int64_t r = 0; r < C; r++) {
        float *Gr = G + r * K, *kr = kk + r * K, *qr = qs + r * K;
        const float *Gp = r ? G + (r - 1) * K : NULL;
        if (r < len) {
            const int64_t t = (src + r) * H + h;
            const float *gt = g + t * K, *kt = k + t * K, *qt = q + t * K;
#pragma omp simd
            for (int64_t c = 0; c < K; c++) {
                Gr[c] = (Gp ? Gp[c] : 0.0f) + gt[c];
                kr[c] = kt[c];
                qr[c] = qt[c] * scale;
            }
            memcpy(KV + r * (K + V) + K, v + t * V, (size_t)V * sizeof(float));
            bt[r] = beta[t];
        } else {
            for (int64_t c = 0; c < K; c++) Gr[c] = Gp ? Gp[c] : 0.0f;
            memset(kr, 0, (size_t)K * sizeof(float));
            memset(qr, 0, (size_t)K * sizeof(float));
            memset(KV + r * (K + V) + K, 0, (size_t)V * sizeof(float));
            bt[r] = 0.0f;
        }
    }
    /* 2. the decayed forms: Qd, exp(G) k, (exp(G_C - G) k)^T, exp(G_C) */
    const float *GC = G + (C - 1) * K;
    for (int64_t r = 0; r < C; r++) {
        const float *Gr = G + r * K, *kr = kk + r * K, *qr = qs + r * K;
        float *qd = Qd + r * K, *kv = KV + r * (K + V);
#pragma omp simd
        for (int64_t c = 0; c < K; c++) {
            const float e = floored_exp(Gr[c]);
            qd[c] = qr[c] * e;
            kv[c] = kr[c] * e;
        }
    }
    for (int64_t r = 0; r < C; r++) { /* row by row into rk (free until step 3), then transposed */
        const float *Gr = G + r * K, *kr = kk + r * K;
        float *t = rk + r * K;
#pragma omp simd
        for (int64_t c = 0; c < K; c++) t[c] = kr[c] * floored_exp(GC[c] - Gr[c]);
    }
    for (int64_t c = 0; c < K; c++) {
        dec[c] = floored_exp(GC[c]);
        float *kd = KdT + c * C;
        for (int64_t r = 0; r < C; r++) kd[r] = rk[r * K + c];
    }
    /* 3. Akk (strictly lower, in Tm's storage until step 4) and Aqk, by sub-block rows */
    float *Akk = Tm; /* Tm's storage holds Akk until step 4 reads it */
    for (int64_t p = 0; p < C; p += SB) {
        const float *Gp = G + p * K, *Gl = G + (p + SB - 1) * K;
        float span = 0.0f;
        for (int64_t c = 0; c < K; c++) span = Gp[c] - Gl[c] > span ? Gp[c] - Gl[c] : span;
        /* row factors exp(G_r - G_p) <= 1; not floored when the block's span allows (>= e^-80, a normal number), as the
         * diagonal block multiplies them by column factors up to e^80 */
        const float floor = span <= SPAN_MAX ? -87.0f : EXP_FLOOR;
        for (int64_t r = p; r < p + SB; r++) {
            const float *Gr = G + r * K, *kr = kk + r * K, *qr = qs + r * K;
            float *rkr = rk + r * K, *rqr = rq + r * K;
#pragma omp simd
            for (int64_t c = 0; c < K; c++) {
                const float d = Gr[c] - Gp[c];
                const float a = exp_f(d < floor ? floor : d);
                rkr[c] = kr[c] * a;
                rqr[c] = qr[c] * a;
            }
        }
        if (p > 0) { /* columns j < p: k_j exp(G_p - G_j) <= 1 */
            for (int64_t j = 0; j < p; j++) {
                const float *Gj = G + j * K, *kj = kk + j * K;
                float *cj = rk + j * K; /* rows < p of rk are done with: their sub-blocks were finished */
#pragma omp simd
                for (int64_t c = 0; c < K; c++) cj[c] = kj[c] * floored_exp(Gp[c] - Gj[c]);
            }
            rows_times_weight_t(SB, p, K, rk + p * K, K, rk, K, Akk + p * C, C);
            rows_times_weight_t(SB, p, K, rq + p * K, K, rk, K, Aqk + p * C, C);
        }
        if (span <= SPAN_MAX) { /* diagonal: k_j / exp(G_j - G_p) <= e^80, rows as above (>= e^-80, not floored) */
            for (int64_t j = 0; j < SB; j++) {
                const float *Gj = G + (p + j) * K, *kj = kk + (p + j) * K;
                float *cj = cols + j * K;
#pragma omp simd
                for (int64_t c = 0; c < K; c++) cj[c] = kj[c] * exp_f(Gp[c] - Gj[c]);
            }
            rows_times_weight_t(SB, SB, K, rk + p * K, K, cols, K, diag, SB);
            for (int64_t r = 0; r < SB; r++)
                for (int64_t j = 0; j <= r; j++) Akk[(p + r) * C + p + j] = diag[r * SB + j];
            rows_times_weight_t(SB, SB, K, rq + p * K, K, cols, K, diag, SB);
            for (int64_t r = 0; r < SB; r++)
                for (int64_t j = 0; j <= r; j++) Aqk[(p + r) * C + p + j] = diag[r * SB + j];
        } else { /* strong decay: term by term, every exponent <= 0 */
            for (int64_t r = p; r < p + SB; r++)
                for (int64_t j = p; j <= r; j++) {
                    const float *Gr = G + r * K, *Gj = G + j * K, *kr = kk + r * K, *qr = qs + r * K, *kj = kk + j * K;
                    float skk = 0.0f, sqk = 0.0f;
#pragma omp simd reduction(+ : skk, sqk)
                    for (int64_t c = 0; c < K; c++) {
                        const float e = floored_exp(Gr[c] - Gj[c]) * kj[c];
                        skk += kr[c] * e;
                        sqk += qr[c] * e;
                    }
                    Akk[r * C + j] = skk;
                    Aqk[r * C + j] = sqk;
                }
        }
        for (int64_t r = p; r < p + SB; r++) {
            memset(Aqk + r * C + r + 1, 0, (size_t)(C - r - 1) * sizeof(float));
        }
    }
    /* 4. X = (I + L)^-1, L = diag(beta) Akk strictly lower: X_r = e_r - sum_{j<r} L_rj X_j (X_j is zero past column j);
     * then Tm = X diag(beta) over Akk's storage, once X is complete */
    for (int64_t r = 0; r < C; r++) {
        float *xr = X + r * C;
        memset(xr, 0, (size_t)C * sizeof(float));
        xr[r] = 1.0f;
        for (int64_t j = 0; j < r; j++) {
            const float l = bt[r] * Akk[r * C + j];
            const float *xj = X + j * C;
#pragma omp simd
            for (int64_t c = 0; c <= j; c++) xr[c] -= l * xj[c];
        }
    }
    for (int64_t r = 0; r < C; r++) {
        float *tr = Tm + r * C;
        const float *xr = X + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) tr[c] = c <= r ? xr[c] * bt[c] : 0.0f;
    }
}

int openk3_kda_chunk_prep(int64_t Q, int64_t H, int64_t C, int64_t K, int64_t V, const int64_t *src, const int64_t *len, float scale,
                          const float *q, const float *k, const float *v, const float *g, const float *beta, float *Qd, float *KV,
                          float *KdT, float *dec, float *Aqk, float *Tm, int num_threads) {
    if (C < 1 || C > 256 || (C & (C - 1)) || K < 1 || V < 1) return 1;
    const int64_t SB = C < SUB_BLOCK ? C : SUB_BLOCK;
    const size_t scratch = (size_t)(5 * C * K + SB * K + C * C);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (Q * H >= 4 && num_threads > 1)
    {
#if defined(__SSE__)
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
#endif
        float *buf = malloc(scratch * sizeof(float));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < Q * H; sh++) {
            if (buf == NULL) continue;
            const int64_t s = sh / H, h = sh % H;
            chunk_prep(C, K, V, H, h, src[s], len[s], scale, q, k, v, g, beta, Qd + sh * C * K, KV + sh * C * (K + V), KdT + sh * K * C,
                       dec + sh * K, Aqk + sh * C * C, Tm + sh * C * C, buf);
        }
        free(buf);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? 2 : 0;
}

/* Y[M, N] = (accumulate ? Y : 0) + alpha A[M, Kd] B[Kd, N], rows at strides lda, ldb, ldy: the state loop's products.
 * A tile of MB rows x NB vectors of B's row keeps MB * NB accumulators; each step along Kd loads NB vectors of B and
 * broadcasts MB values of A. */
#define SCAN_TILE(MB, NB)                                                                                                     \
    static inline void scan_tile_##MB##_##NB(int64_t Kd, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, \
                                             float *Y, int64_t ldy, int accumulate) {                                         \
        rows_vf acc[MB][NB];                                                                                                  \
        for (int i = 0; i < MB; i++)                                                                                          \
            for (int j = 0; j < NB; j++) acc[i][j] = accumulate ? rows_load(Y + i * ldy + j * ROWS_VW) : (rows_vf){0};        \
        for (int64_t d = 0; d < Kd; d++) {                                                                                    \
            rows_vf bv[NB];                                                                                                   \
            for (int j = 0; j < NB; j++) bv[j] = rows_load(B + d * ldb + j * ROWS_VW);                                        \
            for (int i = 0; i < MB; i++) {                                                                                    \
                const float a = alpha * A[i * lda + d];                                                                       \
                for (int j = 0; j < NB; j++) acc[i][j] += a * bv[j];                                                          \
            }                                                                                                                 \
        }                                                                                                                     \
        for (int i = 0; i < MB; i++)                                                                                          \
            for (int j = 0; j < NB; j++) *(rows_vf *)(Y + i * ldy + j * ROWS_VW) = acc[i][j];                                 \
    }

SCAN_TILE(4, 4)
SCAN_TILE(1, 4)
SCAN_TILE(4, 1)
SCAN_TILE(1, 1)

static void scan_gemm(int64_t M, int64_t N, int64_t Kd, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, float *Y,
                      int64_t ldy, int accumulate) {
    int64_t n = 0;
    for (; n + 4 * ROWS_VW <= N; n += 4 * ROWS_VW) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) scan_tile_4_4(Kd, alpha, A + m * lda, lda, B + n, ldb, Y + m * ldy + n, ldy, accumulate);
        for (; m < M; m++) scan_tile_1_4(Kd, alpha, A + m * lda, lda, B + n, ldb, Y + m * ldy + n, ldy, accumulate);
    }
    for (; n + ROWS_VW <= N; n += ROWS_VW) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) scan_tile_4_1(Kd, alpha, A + m * lda, lda, B + n, ldb, Y + m * ldy + n, ldy, accumulate);
        for (; m < M; m++) scan_tile_1_1(Kd, alpha, A + m * lda, lda, B + n, ldb, Y + m * ldy + n, ldy, accumulate);
    }
    for (; n < N; n++) /* columns past the last whole vector */
        for (int64_t m = 0; m < M; m++) {
            float s = accumulate ? Y[m * ldy + n] : 0.0f;
            for (int64_t d = 0; d < Kd; d++) s += alpha * A[m * lda + d] * B[d * ldb + n];
            Y[m * ldy + n] = s;
        }
}

/* The state loop and read-out of every (sequence rank, head), each carried through its chunk slots in order with its
 * state in this thread's cache: V' = U - W S; o = Qd S + Aqk V' (written to the token-major output); S <- dec S + KdT V'.
 * Slots of rank r: offsets[j] + r for every chunk step j with active[j] > r (chunk_layout.py). WU [Q * H, C, K + V] holds
 * W | U; init [N * H, K, V] rank order (NULL: zero states); final [N * H, K, V] rank order; o [tokens, H, V]. */
int openk3_kda_chunk_scan(int64_t N, int64_t steps, int64_t H, int64_t C, int64_t K, int64_t V, const int64_t *active, const int64_t *offsets,
                          const int64_t *src, const int64_t *len, const float *WU, const float *Qd, const float *KdT, const float *dec,
                          const float *Aqk, const float *init, float *final, float *o, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * H >= 2 && num_threads > 1)
    {
#if defined(__SSE__)
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ, as in openk3_kda_chunk_prep */
#endif
        float *Vp = malloc((size_t)(C * V) * sizeof(float));
        if (Vp == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t nh = 0; nh < N * H; nh++) {
            if (Vp == NULL) continue;
            const int64_t r = nh / H, h = nh % H;
            float *S = final + nh * K * V; /* the state lives in its output row throughout */
            if (init != NULL)
                memcpy(S, init + nh * K * V, (size_t)(K * V) * sizeof(float));
            else
                memset(S, 0, (size_t)(K * V) * sizeof(float));
            for (int64_t j = 0; j < steps && active[j] > r; j++) {
                const int64_t s = offsets[j] + r, sh = s * H + h;
                const float *wu = WU + sh * C * (K + V);
                for (int64_t i = 0; i < C; i++) memcpy(Vp + i * V, wu + i * (K + V) + K, (size_t)V * sizeof(float));
                scan_gemm(C, V, K, -1.0f, wu, K + V, S, V, Vp, V, 1);
                if (len[s] > 0) {
                    float *out = o + (src[s] * H + h) * V;
                    scan_gemm(len[s], V, K, 1.0f, Qd + sh * C * K, K, S, V, out, H * V, 0);
                    scan_gemm(len[s], V, C, 1.0f, Aqk + sh * C * C, C, Vp, V, out, H * V, 1);
                }
                const float *d = dec + sh * K;
                for (int64_t c = 0; c < K; c++) {
                    float *Sc = S + c * V;
                    const float dc = d[c];
#pragma omp simd
                    for (int64_t x = 0; x < V; x++) Sc[x] *= dc;
                }
                scan_gemm(K, V, C, 1.0f, KdT + sh * K * C, C, Vp, V, S, V, 1);
            }
        }
        free(Vp);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? 2 : 0;
}
