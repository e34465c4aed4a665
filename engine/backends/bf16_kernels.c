/* lockstep's bfloat16 kernels for a CPU with AVX512-BF16: the weight matmul, the decode attention over the slot KV
 * cache, RMSNorm and SwiGLU, and a whole decode step of a Llama-shaped model in one call (its matmuls shared with a
 * helper thread). Built and loaded by engine/backends/bf16.py (-O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16
 * -pthread), which checks the kernels against float64 before the engine uses them.
 *
 * Every kernel computes a row the same way whatever else the call holds: each output number is the same sums in the
 * same order whatever M is and whichever rows share the call. So a row's result never depends on the batch or on
 * how a prompt is chunked (batch invariance by construction), and decode steps and prompt chunks compute alike.
 *
 * The matmul: out[M, N] = x[M, K] @ W[N, K].T in bfloat16, accumulated in float32. On one core a decode step is
 * bound by reading the weights, and oneDNN's bfloat16 matmul reads them well below what a plain streaming loop
 * reads (docs/benchmarks.md). This loop reads each weight once per call and does nothing else. The weight is
 * packed once (bf16.py, `Bf16Kernels.pack`): [N / 32][K / 2][32 columns][2 k], so one 64-byte load holds 16 output
 * columns' pairs of k, the operand layout of vdpbf16ps. Requires N % 32 == 0, K % 2 == 0. */
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define COLUMNS 32       /* output columns per block: two zmm accumulators per row */
#define ROWS 8           /* rows per pass over a block: 16 accumulators, the block stays in cache for the next */
#define PREFETCH_PAIRS 16 /* k pairs ahead (2 KB) that the weight stream is prefetched */

/* bfloat16 <-> float32. Rounding to bfloat16 is to nearest even, as torch rounds: elementwise ops below compute in
 * float32 and round once per op, as torch does on bfloat16 tensors, so the fused decode step gives the layer-by-layer
 * path's numbers bit for bit. */
static inline __m512 bf16_to_float(const uint16_t *source) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)source)),
                                                 16));
}

static inline __m512 bf16_to_float_masked(__mmask16 mask, const uint16_t *source) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const __m256i *)source)), 16));
}

static inline __m512 round_to_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

static inline void store_bf16(uint16_t *target, __m512 x) {
    _mm256_storeu_si256((__m256i *)target, (__m256i)_mm512_cvtneps_pbh(x));
}

/* `rows` rows of x against one block of COLUMNS columns; `rows` is a compile-time constant in each copy below so
 * that the accumulators live in registers. */
#define BLOCK_KERNEL(rows)                                                                                         \
    static void block_##rows(const uint16_t *x, int64_t x_stride, const uint16_t *block, uint16_t *out,           \
                             int64_t out_stride, int64_t k_pairs) {                                               \
        __m512 low[rows], high[rows];                                                                             \
        const int32_t *x_pairs[rows];                                                                             \
        for (int r = 0; r < rows; r++) {                                                                          \
            low[r] = _mm512_setzero_ps();                                                                         \
            high[r] = _mm512_setzero_ps();                                                                        \
            x_pairs[r] = (const int32_t *)(x + r * x_stride);                                                     \
        }                                                                                                         \
        for (int64_t pair = 0; pair < k_pairs; pair++) {                                                          \
            const uint16_t *weights = block + pair * COLUMNS * 2;                                                 \
            _mm_prefetch((const char *)(weights + PREFETCH_PAIRS * COLUMNS * 2), _MM_HINT_T0);                    \
            _mm_prefetch((const char *)(weights + PREFETCH_PAIRS * COLUMNS * 2 + 32), _MM_HINT_T0);               \
            __m512bh weights_low = (__m512bh)_mm512_loadu_si512(weights);                                         \
            __m512bh weights_high = (__m512bh)_mm512_loadu_si512(weights + 32);                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {                                              \
                __m512bh x_pair = (__m512bh)_mm512_set1_epi32(x_pairs[r][pair]);                                  \
                low[r] = _mm512_dpbf16_ps(low[r], x_pair, weights_low);                                           \
                high[r] = _mm512_dpbf16_ps(high[r], x_pair, weights_high);                                        \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < rows; r++) {                                                                          \
            store_bf16(out + r * out_stride, low[r]);                                                             \
            store_bf16(out + r * out_stride + 16, high[r]);                                                       \
        }                                                                                                         \
    }

BLOCK_KERNEL(1)
BLOCK_KERNEL(2)
BLOCK_KERNEL(3)
BLOCK_KERNEL(4)
BLOCK_KERNEL(5)
BLOCK_KERNEL(6)
BLOCK_KERNEL(7)
BLOCK_KERNEL(8)

typedef void (*block_kernel)(const uint16_t *, int64_t, const uint16_t *, uint16_t *, int64_t, int64_t);
static const block_kernel BLOCK_KERNELS[ROWS + 1] = {0,       block_1, block_2, block_3, block_4,
                                                     block_5, block_6, block_7, block_8};

int lockstep_bf16_columns_per_block(void) { return COLUMNS; }

/* Output columns [first, last) of the matmul below. */
static void linear_columns(const uint16_t *x, const uint16_t *packed, uint16_t *out, int64_t m, int64_t n, int64_t k,
                           int64_t first, int64_t last) {
    for (int64_t column = first; column < last; column += COLUMNS) {
        const uint16_t *block = packed + column * k;
        for (int64_t row = 0; row < m; row += ROWS) {
            int64_t rows = m - row < ROWS ? m - row : ROWS;
            BLOCK_KERNELS[rows](x + row * k, k, block, out + row * n + column, n, k / 2);
        }
    }
}

/* x: [M, K] contiguous; packed: the packed weight; out: [M, N] contiguous. */
void lockstep_bf16_linear(const uint16_t *x, const uint16_t *packed, uint16_t *out, int64_t m, int64_t n,
                          int64_t k) {
    linear_columns(x, packed, out, m, n, k, 0, n);
}

/* Decode attention: one query token per row over the row's own slot of the KV cache, grouped-query (each KV head
 * serves `group` query heads, in transformers' order), softmax in float32. The torch path it replaces spent most of
 * its time in per-call overhead of small batched matmuls (docs/benchmarks.md, "Measurements behind the code's
 * constants").
 *
 * query: [rows, kv_heads * group, head_dim]; keys, values: [slots, kv_heads, capacity, head_dim] (row r reads slot
 * r); lengths[r]: positions 0..lengths[r]-1 are attended; out: [rows, kv_heads * group, head_dim];
 * scratch: capacity + group * (capacity / 2 + 1) floats. head_dim % 32 == 0, head_dim <= 256, group <= 8.
 * Scores are float32 dot products (vdpbf16ps over bfloat16 queries and keys), scaled, then softmax in float32; the
 * weights are rounded to bfloat16 (as the torch path rounds them) and the weighted sum of values accumulates in
 * float32, rounded to bfloat16 once at the end. */
#define MAX_HEAD_VECTORS 16 /* head_dim / 16 */
#define MAX_GROUP 8

static inline __m512 exp_any(__m512 x) {
    /* e^x (softmax, SiLU): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2]; relative error about 2e-7, below
     * float32's rounding of the sums it feeds. Below -87 it gives e^-87 (~1.6e-38, where float32 turns subnormal),
     * above ~88.7 inf, as expf. */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(100.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Sixteen vectors -> one: lane t holds the sum of vector t's lanes (a transpose-and-add tree, ~3 instructions a
 * vector where one horizontal sum each takes ~9). */
static inline __m512 sum_each_of_16(const __m512 v[16]) {
    __m512 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* 128-bit chunks 0-1 sum to v[2i], chunks 2-3 to v[2i+1] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* chunk c sums to v[4i + c] */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int i = 0; i < 2; i++)
        eighths[i] = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2 * i], quarters[2 * i + 1]),
                                   _mm512_unpackhi_ps(quarters[2 * i], quarters[2 * i + 1]));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* element 4c + j of `sums` is vector 4j + c */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
}

/* Scores of one query head against positions 0..length-1, scaled; returns their maximum. The first head of a
 * group also prefetches the keys a block ahead and the values it will weigh: a slot's keys and values come from
 * memory in short streams that the hardware prefetcher alone reads at about half speed (measured). */
static inline __attribute__((always_inline)) float score_positions(
    const __m512bh *q, const uint16_t *keys, const uint16_t *values, int prefetch, int64_t length, int64_t head_dim,
    int64_t pairs_vectors, float scaling, float *scores) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < length; t0 += 16) {
        int64_t count = length - t0 < 16 ? length - t0 : 16;
        if (prefetch) {
            const char *ahead = (const char *)(keys + (t0 + 16) * head_dim);
            const char *weighed = (const char *)(values + t0 * head_dim);
            int64_t ahead_bytes = (length - t0 - 16 < 16 ? length - t0 - 16 : 16) * head_dim * 2;
            for (int64_t b = 0; b < ahead_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
            for (int64_t b = 0; b < count * head_dim * 2; b += 64) _mm_prefetch(weighed + b, _MM_HINT_T1);
        }
        __m512 dots[16];
        for (int64_t i = 0; i < 16; i++) {
            dots[i] = _mm512_setzero_ps();
            if (i < count) {
                const uint16_t *key = keys + (t0 + i) * head_dim;
                for (int64_t v = 0; v < pairs_vectors; v++)
                    dots[i] = _mm512_dpbf16_ps(dots[i], q[v], (__m512bh)_mm512_loadu_si512(key + v * 32));
            }
        }
        __mmask16 valid = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
        __m512 block = _mm512_mul_ps(sum_each_of_16(dots), _mm512_set1_ps(scaling));
        _mm512_mask_storeu_ps(scores + t0, valid, block);
        top = _mm512_mask_max_ps(top, valid, top, block);
    }
    return _mm512_reduce_max_ps(top);
}

/* scores[0..length-1] -> softmax weights, rounded to bfloat16 (as the torch path rounds them before the values'
 * matmul) and packed in pairs of positions (t, t+1) for vdpbf16ps; an odd last position pairs with a 0. */
static void softmax_to_pairs(float *scores, int64_t length, float maximum, uint32_t *pairs) {
    __m512 top = _mm512_set1_ps(maximum), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        __mmask16 valid = length - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (length - t)) - 1);
        __m512 e = exp_any(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + t), top));
        e = _mm512_maskz_mov_ps(valid, e);
        _mm512_mask_storeu_ps(scores + t, valid, e);
        total = _mm512_add_ps(total, e);
    }
    __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    uint16_t *halves = (uint16_t *)pairs;
    for (int64_t t = 0; t < length; t += 16) {
        __mmask16 valid = length - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (length - t)) - 1);
        __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, scores + t), inverse));
        _mm256_mask_storeu_epi16((__m256i *)(halves + t), valid, (__m256i)rounded);
    }
    if (length % 2) halves[length] = 0;
}

static inline __attribute__((always_inline)) void attend_one_head_group(
    const uint16_t *query, const uint16_t *keys, const uint16_t *values, uint16_t *out, int64_t length,
    int64_t head_dim, int64_t group, float scaling, float *scores, uint32_t *pairs) {
    const int64_t pairs_vectors = head_dim / 32; /* zmm of bfloat16 per head */
    const int64_t pair_count = (length + 1) / 2;
    for (int64_t g = 0; g < group; g++) {
        __m512bh q[MAX_HEAD_VECTORS / 2];
        for (int64_t v = 0; v < pairs_vectors; v++)
            q[v] = (__m512bh)_mm512_loadu_si512(query + g * head_dim + v * 32);
        float maximum = score_positions(q, keys, values, g == 0, length, head_dim, pairs_vectors, scaling, scores);
        softmax_to_pairs(scores, length, maximum, pairs + g * pair_count);
    }
    /* Values of positions t and t+1 interleaved (per 128-bit lane: low half d 0-3, high half d 4-7 of that lane's
     * eight), so vdpbf16ps adds both weighted positions into each float32 lane. */
    __m512 low[MAX_GROUP][MAX_HEAD_VECTORS / 2], high[MAX_GROUP][MAX_HEAD_VECTORS / 2];
    for (int64_t g = 0; g < group; g++)
        for (int64_t v = 0; v < pairs_vectors; v++) low[g][v] = high[g][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pair_count; p++) {
        const uint16_t *first = values + 2 * p * head_dim;
        int has_second = 2 * p + 1 < length;
        for (int64_t v = 0; v < pairs_vectors; v++) {
            __m512i a = _mm512_loadu_si512(first + v * 32);
            __m512i b = has_second ? _mm512_loadu_si512(first + head_dim + v * 32) : _mm512_setzero_si512();
            __m512bh interleaved_low = (__m512bh)_mm512_unpacklo_epi16(a, b);
            __m512bh interleaved_high = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int64_t g = 0; g < group; g++) {
                __m512bh weight = (__m512bh)_mm512_set1_epi32((int)pairs[g * pair_count + p]);
                low[g][v] = _mm512_dpbf16_ps(low[g][v], interleaved_low, weight);
                high[g][v] = _mm512_dpbf16_ps(high[g][v], interleaved_high, weight);
            }
        }
    }
    /* back to d order: lane L of `low` holds d 8L..8L+3, of `high` d 8L+4..8L+7 */
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < group; g++)
        for (int64_t v = 0; v < pairs_vectors; v++) {
            uint16_t *target = out + g * head_dim + v * 32;
            __m512 d0 = _mm512_permutex2var_ps(low[g][v], first_half, high[g][v]);
            __m512 d1 = _mm512_permutex2var_ps(low[g][v], second_half, high[g][v]);
            store_bf16(target, d0);
            store_bf16(target + 16, d1);
        }
}

/* One copy per (head_dim, group) the models use, so that the accumulators live in registers; `attend_any` for
 * the rest. */
typedef void (*attend_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                          int64_t, float, float *, uint32_t *);
#define ATTEND(HEAD_DIM, GROUP)                                                                                    \
    static void attend_##HEAD_DIM##_##GROUP(const uint16_t *query, const uint16_t *keys, const uint16_t *values,  \
                                            uint16_t *out, int64_t length, int64_t head_dim, int64_t group,        \
                                            float scaling, float *scores, uint32_t *pairs) {                       \
        (void)head_dim;                                                                                            \
        (void)group;                                                                                               \
        attend_one_head_group(query, keys, values, out, length, HEAD_DIM, GROUP, scaling, scores, pairs);          \
    }
ATTEND(64, 1) ATTEND(64, 2) ATTEND(64, 3) ATTEND(64, 4) ATTEND(64, 5) ATTEND(64, 6) ATTEND(64, 7) ATTEND(64, 8)
ATTEND(128, 1) ATTEND(128, 2) ATTEND(128, 3) ATTEND(128, 4) ATTEND(128, 5) ATTEND(128, 6) ATTEND(128, 7)
ATTEND(128, 8)
static const attend_fn ATTEND_64[MAX_GROUP + 1] = {0,          attend_64_1, attend_64_2, attend_64_3, attend_64_4,
                                                   attend_64_5, attend_64_6, attend_64_7, attend_64_8};
static const attend_fn ATTEND_128[MAX_GROUP + 1] = {0,           attend_128_1, attend_128_2, attend_128_3,
                                                    attend_128_4, attend_128_5, attend_128_6, attend_128_7,
                                                    attend_128_8};

static void attend_any(const uint16_t *query, const uint16_t *keys, const uint16_t *values, uint16_t *out,
                       int64_t length, int64_t head_dim, int64_t group, float scaling, float *scores,
                       uint32_t *pairs) {
    attend_one_head_group(query, keys, values, out, length, head_dim, group, scaling, scores, pairs);
}

/* query row r starts at query + r * query_stride (the fused layers read the queries where the q/k/v matmul wrote
 * them); out: [rows, kv_heads * group * head_dim]. */
static void attend_rows(const uint16_t *query, int64_t query_stride, const uint16_t *keys, const uint16_t *values,
                        uint16_t *out, const int64_t *lengths, int64_t rows, int64_t kv_heads, int64_t group,
                        int64_t capacity, int64_t head_dim, float scaling, float *scratch) {
    attend_fn attend = head_dim == 64 ? ATTEND_64[group] : head_dim == 128 ? ATTEND_128[group] : attend_any;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t head = h * group * head_dim;
            int64_t slot = (r * kv_heads + h) * capacity * head_dim;
            attend(query + r * query_stride + head, keys + slot, values + slot,
                   out + r * kv_heads * group * head_dim + head, lengths[r], head_dim, group, scaling, scratch,
                   (uint32_t *)(scratch + capacity));
        }
    }
}

void lockstep_bf16_decode_attention(const uint16_t *query, const uint16_t *keys, const uint16_t *values,
                                    uint16_t *out, const int64_t *lengths, int64_t rows, int64_t kv_heads,
                                    int64_t group, int64_t capacity, int64_t head_dim, float scaling,
                                    float *scratch) {
    attend_rows(query, kv_heads * group * head_dim, keys, values, out, lengths, rows, kv_heads, group, capacity,
                head_dim, scaling, scratch);
}

/* RMSNorm as transformers' LlamaRMSNorm computes it: in float32, x * rsqrt(mean(x^2) + eps) rounded to bfloat16,
 * then times the weight, rounded again (only the order of the sum of squares differs). One row at a time: a row's
 * result never depends on the others. x, out: [rows, hidden]; weight: [hidden]. */
void lockstep_bf16_rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t hidden,
                            float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * hidden;
        uint16_t *row_out = out + r * hidden;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            __mmask16 mask = hidden - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hidden - i)) - 1);
            __m512 v = bf16_to_float_masked(mask, row + i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        for (int64_t i = 0; i < hidden; i += 16) {
            __mmask16 mask = hidden - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (hidden - i)) - 1);
            __m512 normed = round_to_bf16(_mm512_mul_ps(bf16_to_float_masked(mask, row + i), scale));
            __m512 scaled = _mm512_mul_ps(normed, bf16_to_float_masked(mask, weight + i));
            _mm256_mask_storeu_epi16((__m256i *)(row_out + i), mask, (__m256i)_mm512_cvtneps_pbh(scaled));
        }
    }
}

/* SwiGLU's product, silu(gate) * up, as torch's `silu(gate) * up` on bfloat16 (silu rounded, then the product):
 * gate_up: [rows, 2 * intermediate] (gate, then up, as the fused gate/up matmul writes them); out: [rows,
 * intermediate]. intermediate % 16 == 0. */
void lockstep_bf16_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t intermediate) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * intermediate, *up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; i += 16) {
            __m512 g = bf16_to_float(gate + i);
            __m512 e = exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 silu = round_to_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store_bf16(out + r * intermediate + i, _mm512_mul_ps(silu, bf16_to_float(up + i)));
        }
    }
}

/* target += addend, rounded ([count], count % 16 == 0): the residual adds. */
static void add_in_place(uint16_t *target, const uint16_t *addend, int64_t count) {
    for (int64_t i = 0; i < count; i += 16)
        store_bf16(target + i, _mm512_add_ps(bf16_to_float(target + i), bf16_to_float(addend + i)));
}

/* The rotary embedding of `heads` heads of one token in place, as transformers' apply_rotary_pos_emb on bfloat16:
 * x * cos + rotate_half(x) * sin, each product rounded, then the sum. cos, sin: [head_dim]. */
static void rotate_heads(uint16_t *heads_of_token, int64_t heads, int64_t head_dim, const uint16_t *cos,
                         const uint16_t *sin) {
    int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *x = heads_of_token + h * head_dim;
        for (int64_t i = 0; i < half; i += 16) {
            __m512 first = bf16_to_float(x + i), second = bf16_to_float(x + half + i);
            __m512 first_out = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(first, bf16_to_float(cos + i))),
                                             round_to_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), second),
                                                                         bf16_to_float(sin + i))));
            __m512 second_out = _mm512_add_ps(round_to_bf16(_mm512_mul_ps(second, bf16_to_float(cos + half + i))),
                                              round_to_bf16(_mm512_mul_ps(first, bf16_to_float(sin + half + i))));
            store_bf16(x + i, first_out);
            store_bf16(x + half + i, second_out);
        }
    }
}

/* A helper thread for the weight matmuls of a decode step. The model worker computes on one core while the server
 * process on the other mostly waits for its next token, so a step's matmuls are shared with a helper on that core
 * (a step of many rows gains most; one row is bound by memory, which the second core adds little to: measured in
 * docs/benchmarks.md). The helper sleeps between steps
 * (on a futex) and spins during one (a matmul every ~40 us: waking it for each would cost more than its share).
 *
 * The two threads take chunks of a matmul's column blocks from one counter, the caller from the front and the
 * helper from the back (each streams one contiguous part of the weight). So a helper that the kernel deschedules
 * slows the step but never stops it, and each column is computed by the same code whichever thread takes it: the
 * numbers do not depend on the helper. The counter (`ticket`) holds the job's number in its high 32 bits and the
 * front and back chunks in 16 bits each: a helper still finishing an old job can never take a chunk of the next
 * (its compare-and-swap fails). The helper is made on first use, and again in a forked child (which has the memory
 * but not the thread).
 *
 * A helper that the kernel takes off its core in the middle of a chunk stalls the step until it is back (a chunk
 * takes microseconds; another process's time slice, milliseconds): with a busy process beside it, sharing made
 * steps ~30% slower (measured). So a step that waited longer than STALL_S for one chunk makes the next STEPS_ALONE
 * steps run without the helper (measured with a busy loop beside it: as fast as without a helper; served, the
 * server's own bursts trip it now and then at 16 clients: 547 tok/s against 572 with no such rule). */
#define CHUNK_COLUMNS (2 * COLUMNS)
#define STALL_S 0.002
#define STEPS_ALONE 8

static struct {
    /* the job, written before its ticket is published */
    const uint16_t *x, *packed;
    uint16_t *out;
    int64_t m, n, k;
    pid_t owner; /* the process whose helper runs; 0: none yet */
    double longest_wait_s; /* this step: the longest the caller waited for the helper's last chunk */
    int64_t steps_alone;   /* steps left to run without the helper (it was stalling them) */
    /* each on a cache line of its own: the threads write them while they stream */
    _Alignas(64) atomic_int spinning; /* 1 while a step wants the helper (the futex word) */
    _Alignas(64) atomic_uint_fast64_t ticket;
    _Alignas(64) atomic_int_fast64_t chunks_done;
} helper;

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

static void futex_wait(atomic_int *word, int value) {
    syscall(SYS_futex, (int *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake(atomic_int *word) { syscall(SYS_futex, (int *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }

/* Take chunks of job `job` until none is left (or the job is no longer current); returns how many were done. The
 * caller of the job takes them from the front, the helper from the back. */
static int64_t take_chunks(uint64_t job, int from_back, const uint16_t *x, const uint16_t *packed, uint16_t *out,
                           int64_t m, int64_t n, int64_t k) {
    int64_t done = 0;
    uint64_t ticket = atomic_load(&helper.ticket);
    for (;;) {
        uint64_t front = (ticket >> 16) & 0xFFFF, back = ticket & 0xFFFF;
        if ((ticket >> 32) != job || front >= back) return done;
        uint64_t claimed = from_back ? ticket - 1 : ticket + (1 << 16);
        if (!atomic_compare_exchange_weak(&helper.ticket, &ticket, claimed)) continue;
        int64_t first = (int64_t)(from_back ? back - 1 : front) * CHUNK_COLUMNS;
        linear_columns(x, packed, out, m, n, k, first, first + CHUNK_COLUMNS < n ? first + CHUNK_COLUMNS : n);
        done++;
        ticket = atomic_load(&helper.ticket);
    }
}

static void *helper_loop(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        while (!atomic_load(&helper.spinning)) futex_wait(&helper.spinning, 0);
        uint64_t job = atomic_load(&helper.ticket) >> 32;
        if (job == seen) {
            _mm_pause();
            continue;
        }
        seen = job;
        const uint16_t *x = helper.x, *packed = helper.packed;
        uint16_t *out = helper.out;
        int64_t m = helper.m, n = helper.n, k = helper.k;
        int64_t done = take_chunks(job, 1, x, packed, out, m, n, k);
        if (done) atomic_fetch_add(&helper.chunks_done, done);
    }
    return NULL;
}

/* Starts the helper in this process if it has none; 0 if it could not. */
static int helper_ready(void) {
    if (helper.owner == getpid()) return 1;
    pthread_attr_t attributes;
    pthread_t thread;
    atomic_store(&helper.spinning, 0);
    if (pthread_attr_init(&attributes)) return 0;
    pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attributes, helper_loop, NULL);
    pthread_attr_destroy(&attributes);
    if (failed) return 0;
    helper.owner = getpid();
    return 1;
}

static void helper_spin(int on) {
    atomic_store(&helper.spinning, on);
    if (on) futex_wake(&helper.spinning);
}

/* lockstep_bf16_linear, its column chunks shared with the spinning helper. */
static void linear_shared(const uint16_t *x, const uint16_t *packed, uint16_t *out, int64_t m, int64_t n,
                          int64_t k) {
    int64_t chunks = (n + CHUNK_COLUMNS - 1) / CHUNK_COLUMNS;
    if (chunks > 0xFFFF) { /* more than the ticket counts */
        linear_columns(x, packed, out, m, n, k, 0, n);
        return;
    }
    uint64_t job = ((atomic_load(&helper.ticket) >> 32) + 1) & 0xFFFFFFFFu;
    helper.x = x, helper.packed = packed, helper.out = out, helper.m = m, helper.n = n, helper.k = k;
    atomic_store(&helper.chunks_done, 0);
    atomic_store(&helper.ticket, job << 32 | (uint64_t)chunks); /* publishes the job (sequentially consistent) */
    int64_t done = take_chunks(job, 0, x, packed, out, m, n, k);
    if (done) atomic_fetch_add(&helper.chunks_done, done);
    if (atomic_load(&helper.chunks_done) < chunks) { /* the helper is still on its last chunk */
        double started = seconds_now();
        while (atomic_load(&helper.chunks_done) < chunks) _mm_pause();
        double waited = seconds_now() - started;
        if (waited > helper.longest_wait_s) helper.longest_wait_s = waited;
    }
}

static atomic_flag helper_taken = ATOMIC_FLAG_INIT; /* one step at a time uses the helper (ctypes drops the GIL) */

static void matmul(int shared, const uint16_t *x, const uint16_t *packed, uint16_t *out, int64_t m, int64_t n,
                   int64_t k) {
    if (shared)
        linear_shared(x, packed, out, m, n, k);
    else
        linear_columns(x, packed, out, m, n, k, 0, n);
}

/* A decode step of a Llama-shaped model in one call: every decoder layer, the final norm and the lm_head. It does
 * what fast_forward.py's per-layer Python does with the kernels above (RMSNorm, q/k/v matmul, rotary embedding, the
 * new keys and values stored in each row's slot, attention, output matmul and residual, RMSNorm, gate/up matmul,
 * SwiGLU, down matmul and residual), with the same roundings, without its ~20 torch calls per layer (a third of a
 * one-row step), and with `helper` set it shares the matmuls with the helper thread.
 *
 * dims: hidden, heads, kv_heads, head_dim, intermediate, capacity, vocabulary. weights: 6 per layer (input norm,
 * packed q/k/v, packed output, post-attention norm, packed gate/up, packed down), then the final norm and the
 * packed lm_head; eps: 2 per layer, then the final norm's; keys, values: one slot cache per layer [>= rows slots,
 * kv_heads, capacity, head_dim]. hidden: [rows, hidden], updated in place; logits: [rows, vocabulary]. Row r feeds
 * position positions[r] (0 <= it < capacity) of slot r, rotated by cos, sin [rows, head_dim]. Returns 0, or -1 if
 * the scratch memory could not be allocated. Requires hidden, heads * head_dim, 2 * intermediate and vocabulary
 * % 32 == 0, head_dim % 32 == 0, heads % kv_heads == 0, heads / kv_heads <= 8. */
int lockstep_bf16_decode_step(const int64_t *dims, int64_t layers, const uint16_t *const *weights, const float *eps,
                              uint16_t *const *keys, uint16_t *const *values, uint16_t *hidden, int64_t rows,
                              const int64_t *positions, const uint16_t *cos, const uint16_t *sin, float scaling,
                              uint16_t *logits, int use_helper) {
    const int64_t width = dims[0], heads = dims[1], kv_heads = dims[2], head_dim = dims[3], intermediate = dims[4],
                  capacity = dims[5], vocabulary = dims[6];
    const int64_t group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * head_dim;
    const int64_t attended_width = heads * head_dim;
    const int64_t halves = rows * (width + qkv_width + attended_width + width + 2 * intermediate + intermediate);
    uint16_t *normed = malloc(halves * sizeof(uint16_t) + 64);
    float *scratch = malloc((capacity + group * (capacity / 2 + 1)) * sizeof(float) + 64);
    int64_t *lengths = malloc(rows * sizeof(int64_t) + 8);
    if (!normed || !scratch || !lengths) {
        free(normed);
        free(scratch);
        free(lengths);
        return -1;
    }
    uint16_t *qkv = normed + rows * width, *attended = qkv + rows * qkv_width;
    uint16_t *projected = attended + rows * attended_width, *gate_up = projected + rows * width;
    uint16_t *activated = gate_up + rows * 2 * intermediate;
    for (int64_t r = 0; r < rows; r++) lengths[r] = positions[r] + 1;
    int shared = use_helper && !atomic_flag_test_and_set(&helper_taken);
    if (shared && (helper.steps_alone > 0 || !helper_ready())) {
        helper.steps_alone -= helper.steps_alone > 0;
        atomic_flag_clear(&helper_taken);
        shared = 0;
    }
    if (shared) {
        helper.longest_wait_s = 0;
        helper_spin(1);
    }
    for (int64_t layer = 0; layer < layers; layer++) {
        const uint16_t *const *w = weights + 6 * layer;
        lockstep_bf16_rms_norm(hidden, w[0], normed, rows, width, eps[2 * layer]);
        matmul(shared, normed, w[1], qkv, rows, qkv_width, width);
        for (int64_t r = 0; r < rows; r++) {
            uint16_t *token = qkv + r * qkv_width;
            rotate_heads(token, heads + kv_heads, head_dim, cos + r * head_dim, sin + r * head_dim);
            for (int64_t h = 0; h < kv_heads; h++) {
                int64_t at = ((r * kv_heads + h) * capacity + positions[r]) * head_dim;
                memcpy(keys[layer] + at, token + (heads + h) * head_dim, head_dim * sizeof(uint16_t));
                memcpy(values[layer] + at, token + (heads + kv_heads + h) * head_dim, head_dim * sizeof(uint16_t));
            }
        }
        attend_rows(qkv, qkv_width, keys[layer], values[layer], attended, lengths, rows, kv_heads, group, capacity,
                    head_dim, scaling, scratch);
        matmul(shared, attended, w[2], projected, rows, width, attended_width);
        add_in_place(hidden, projected, rows * width);
        lockstep_bf16_rms_norm(hidden, w[3], normed, rows, width, eps[2 * layer + 1]);
        matmul(shared, normed, w[4], gate_up, rows, 2 * intermediate, width);
        lockstep_bf16_silu_mul(gate_up, activated, rows, intermediate);
        matmul(shared, activated, w[5], projected, rows, width, intermediate);
        add_in_place(hidden, projected, rows * width);
    }
    lockstep_bf16_rms_norm(hidden, weights[6 * layers], normed, rows, width, eps[2 * layers]);
    matmul(shared, normed, weights[6 * layers + 1], logits, rows, vocabulary, width);
    if (shared) {
        helper_spin(0);
        if (helper.longest_wait_s > STALL_S) helper.steps_alone = STEPS_ALONE;
        atomic_flag_clear(&helper_taken);
    }
    free(normed);
    free(scratch);
    free(lengths);
    return 0;
}
