/* MLA decode attention over the paged latent cache: one query token per sequence, all heads of a sequence together, the
 * cached rows read where they lie through the page table (ops/mla/absorbed.py mla_decode_paged is the torch reference).
 *
 * Legend: N sequences, H heads, R = Lr + Dr latent row width ([c_kv | k_pe]), Lr kv_lora_rank, NP pages in the pool,
 * PS rows per page, P page-table width.
 * Per sequence n and head h, over its first kv_lens[n] rows r_s:  u[n, h] = softmax_s(q[n, h] . r_s) r_s[:Lr]
 * (q is the absorbed, scaled query [q~ | q_pe]). The softmax is computed online, a page at a time: the page's H x PS
 * scores in one small product (rows_gemm.h), then the running max, sum and weighted row sum of each head, rescaled when
 * the max grows. Each row is read once and nothing is gathered. A sequence may be cut into parts that threads take
 * separately (when there are fewer sequences than threads); the parts' (max, sum, row sum) are merged at the end, as
 * split-K decoding kernels do.
 *
 * Why: the torch path gathers every page of every sequence into a new tensor and runs four batched ops over it; at 2k
 * tokens of context that copy and the padded scores are most of an MLA layer's decode time.
 *
 * A bf16 pool (openk3_mla_decode_latent_bf16, a bf16 model's cache) is read the same way: each page's rows are widened to
 * fp32 into a per-task buffer (a bf16 value is the top half of the fp32 one, so the widening is exact) and everything after
 * is the fp32 code, so the bf16 kernel equals the fp32 kernel run on the pool cast to fp32, bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panels.h"
#include "rms_norm.h"
#include "fastmath.h"
#include "rows_gemm.h"

#define MAX_HEADS 128
#define MAX_PAGE 64 /* PS; the engine's default is 16 */
#define MIN_PAGES_PER_PART 4

/* The pool as the kernel reads it: fp32 rows where they lie, or bf16 rows widened into `wide` (PS x R floats) a page at a time. */
typedef struct {
    const float *f32;
    const uint16_t *bf16;
    float *wide;
} pool_view;

static const float *page_rows(pool_view pool, int64_t first_row, int64_t rows, int64_t R) {
    if (pool.f32 != NULL) return pool.f32 + first_row * R;
    const uint16_t *src = pool.bf16 + first_row * R;
#pragma omp simd
    for (int64_t i = 0; i < rows * R; i++) {
        const uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(pool.wide + i, &bits, sizeof bits);
    }
    return pool.wide;
}

static void prefetch_page(pool_view pool, int64_t first_row, int64_t rows, int64_t R) {
    const size_t elem = pool.f32 != NULL ? sizeof(float) : sizeof(uint16_t);
    const char *base = pool.f32 != NULL ? (const char *)(pool.f32 + first_row * R) : (const char *)(pool.bf16 + first_row * R);
    for (size_t o = 0; o < (size_t)(rows * R) * elem; o += 64) __builtin_prefetch(base + o, 0, 2);
}

/* Online softmax over the rows [first, last) of sequence n: best/total [H], acc [H, Lr] (overwritten). */
static void attend_rows(int64_t H, int64_t R, int64_t Lr, int64_t PS, const float *q, pool_view pool, const int64_t *pages, int64_t first,
                        int64_t last, float *best, float *total, float *acc) {
    float score[MAX_HEADS * MAX_PAGE];
    for (int64_t h = 0; h < H; h++) {
        best[h] = -INFINITY;
        total[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(H * Lr) * sizeof(float));
    for (int64_t start = first; start < last; start += PS - start % PS) {
        const int64_t p = start / PS, off = start % PS, rows = (last - start < PS - off) ? last - start : PS - off;
        const float *page = page_rows(pool, pages[p] * PS + off, rows, R);
        if (start + rows < last) prefetch_page(pool, pages[p + 1] * PS, PS, R); /* the next page, usually elsewhere in the pool, into L2 */
        rows_times_weight_t(H, rows, R, q, R, page, R, score, rows); /* score[h, j] = q_h . row_j */
        for (int64_t h = 0; h < H; h++) {
            float *s = score + h * rows, *uh = acc + h * Lr;
            float top = best[h];
            for (int64_t j = 0; j < rows; j++) top = s[j] > top ? s[j] : top;
            if (top > best[h]) { /* a new maximum: rescale what was summed so far (exp(-inf) is 0 on the first page) */
                const float shrink = best[h] == -INFINITY ? 0.0f : exp_f(best[h] - top);
                total[h] *= shrink;
                for (int64_t i = 0; i < Lr; i++) uh[i] *= shrink;
                best[h] = top;
            }
            for (int64_t j = 0; j < rows; j++) {
                s[j] = exp_f(s[j] - top);
                total[h] += s[j];
            }
            for (int64_t j = 0; j < rows; j++) {
                const float w = s[j], *row = page + j * R;
#pragma omp simd
                for (int64_t i = 0; i < Lr; i++) uh[i] += w * row[i];
            }
        }
    }
}

/* Returns 0, or 1 when a sequence's length or page ids are out of range, the sizes exceed what the kernel holds, or the
 * scratch cannot be allocated (nothing is then trusted). Exactly one of pool_f32 and pool_bf16 is given. */
static int decode_latent(int64_t N, int64_t H, int64_t R, int64_t Lr, int64_t NP, int64_t PS, int64_t P, const float *q, const float *pool_f32,
                         const uint16_t *pool_bf16, const int64_t *page_table, int64_t table_stride, const int64_t *kv_lens, float *u,
                         int num_threads) {
    if (H < 1 || H > MAX_HEADS || PS < 1 || PS > MAX_PAGE || Lr > R || Lr < 1) return 1;
    if (N <= 0) return 0;
    int64_t longest = 0;
    for (int64_t n = 0; n < N; n++) {
        const int64_t len = kv_lens[n];
        if (len < 1 || len > P * PS) return 1;
        for (int64_t p = 0; p < (len + PS - 1) / PS; p++) {
            const int64_t page = page_table[n * table_stride + p];
            if (page < 0 || page >= NP) return 1;
        }
        longest = len > longest ? len : longest;
    }
    /* parts per sequence: enough for every thread when sequences are few, each at least MIN_PAGES_PER_PART pages */
    int64_t parts = N >= num_threads ? 1 : (num_threads + N - 1) / N;
    const int64_t most = (longest + PS * MIN_PAGES_PER_PART - 1) / (PS * MIN_PAGES_PER_PART);
    parts = parts < most ? parts : most;
    parts = parts < 1 ? 1 : parts;
    /* per (sequence, part): H maxima, H sums, H x Lr row sums */
    float *scratch = parts > 1 ? malloc(sizeof(float) * (size_t)(N * parts * H * (Lr + 2))) : NULL;
    if (parts > 1 && scratch == NULL) return 1;
    /* bf16: one widened page per task, PS x R floats each */
    float *wide = pool_bf16 != NULL ? malloc(sizeof(float) * (size_t)(N * parts * PS * R)) : NULL;
    if (pool_bf16 != NULL && wide == NULL) {
        free(scratch);
        return 1;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (N * parts > 1 && num_threads > 1)
    for (int64_t task = 0; task < N * parts; task++) {
        const pool_view pool = {pool_f32, pool_bf16, wide != NULL ? wide + task * PS * R : NULL};
        const int64_t n = task / parts, part = task % parts, len = kv_lens[n];
        const int64_t span = (len + parts - 1) / parts, first = part * span, last = first + span < len ? first + span : len;
        float best[MAX_HEADS], total[MAX_HEADS];
        float *acc = parts > 1 ? scratch + task * H * (Lr + 2) + 2 * H : u + n * H * Lr;
        if (first < last)
            attend_rows(H, R, Lr, PS, q + n * H * R, pool, page_table + n * table_stride, first, last, best, total, acc);
        else
            for (int64_t h = 0; h < H; h++) best[h] = -INFINITY, total[h] = 0.0f;
        if (parts > 1) {
            memcpy(scratch + task * H * (Lr + 2), best, (size_t)H * sizeof(float));
            memcpy(scratch + task * H * (Lr + 2) + H, total, (size_t)H * sizeof(float));
        } else {
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < Lr; i++) acc[h * Lr + i] /= total[h];
        }
    }
    if (parts > 1) { /* merge the parts: each scaled by exp(its max - the overall max) */
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = 0; h < H; h++) {
                float top = -INFINITY, sum = 0.0f;
                for (int64_t part = 0; part < parts; part++) {
                    const float b = scratch[(n * parts + part) * H * (Lr + 2) + h];
                    top = b > top ? b : top;
                }
                float *uh = u + (n * H + h) * Lr;
                memset(uh, 0, (size_t)Lr * sizeof(float));
                for (int64_t part = 0; part < parts; part++) {
                    const float *base = scratch + (n * parts + part) * H * (Lr + 2);
                    if (base[h] == -INFINITY) continue; /* an empty part */
                    const float w = exp_f(base[h] - top), *acc = base + 2 * H + h * Lr;
                    sum += w * base[H + h];
                    for (int64_t i = 0; i < Lr; i++) uh[i] += w * acc[i];
                }
                for (int64_t i = 0; i < Lr; i++) uh[i] /= sum;
            }
        free(scratch);
    }
    free(wide);
    return 0;
}

int openk3_mla_decode_latent(int64_t N, int64_t H, int64_t R, int64_t Lr, int64_t NP, int64_t PS, int64_t P, const float *q,
                             const float *pool, const int64_t *page_table, int64_t table_stride, const int64_t *kv_lens, float *u,
                             int num_threads) {
    return decode_latent(N, H, R, Lr, NP, PS, P, q, pool, NULL, page_table, table_stride, kv_lens, u, num_threads);
}

/* The same over a bf16 pool (its raw 16-bit values); q and u stay fp32. */
int openk3_mla_decode_latent_bf16(int64_t N, int64_t H, int64_t R, int64_t Lr, int64_t NP, int64_t PS, int64_t P, const float *q,
                                  const uint16_t *pool, const int64_t *page_table, int64_t table_stride, const int64_t *kv_lens, float *u,
                                  int num_threads) {
    return decode_latent(N, H, R, Lr, NP, PS, P, q, NULL, pool, page_table, table_stride, kv_lens, u, num_threads);
}

/* An MLA layer's decode inputs with a query LoRA (ops/mla/inputs_c.py), in one call: the fused input projection
 * q_a | kv_a | g from its panel copy into proj [T, W] (W = Qa + Lr + Dr + G), q = q_b(norm(q_a)) into q [T, Q], and each
 * token's latent [norm(c_kv) | k_pe] written into row rows[t] of the pool seen as [pool_rows, Lr + Dr] -- the code of the
 * separate calls (panels.h, rms_norm.h, a row copy), so the same bits. Returns -1 (nothing written) when a row id lies
 * outside 0..pool_rows-1, 1 when scratch memory cannot be had. */
int openk3_mla_decode_inputs(int64_t T, int64_t Dm, const float *x, int64_t x_stride, const float *in_p, int64_t Qa, int64_t Lr, int64_t Dr,
                             int64_t G, const float *qa_norm_w, float qa_eps, const float *qb_p, int64_t Q, const float *kv_norm_w, float kv_eps,
                             float *pool, int64_t pool_rows, const int64_t *rows, float *proj, float *q, int num_threads) {
    const int64_t W = Qa + Lr + Dr + G, R = Lr + Dr;
    for (int64_t t = 0; t < T; t++)
        if (rows[t] < 0 || rows[t] >= pool_rows) return -1;
    float *qa = malloc(sizeof(float) * (size_t)(T * Qa));
    if (qa == NULL) return 1;
    linear_panels(T, W, Dm, x, x_stride, in_p, proj, W, num_threads);
    rms_norm_rows(T, Qa, proj, W, qa_norm_w, qa_eps, qa);
    linear_panels(T, Q, Qa, qa, Qa, qb_p, q, Q, num_threads);
    for (int64_t t = 0; t < T; t++) {
        float *row = pool + rows[t] * R;
        rms_norm_rows(1, Lr, proj + t * W + Qa, W, kv_norm_w, kv_eps, row);
        memcpy(row + Lr, proj + t * W + Qa + Lr, sizeof(float) * (size_t)Dr);
    }
    free(qa);
    return 0;
}
