/* out[M, N] = x[M, K] @ W[N, K].T in bfloat16, accumulated in float32, on one core with AVX512-BF16.
 *
 * Why: on one core a decode step is bound by reading the weights, and oneDNN's bfloat16 matmul reads them at
 * about 10 GB/s here, where a plain streaming loop reads about 16 (measured: bench.decode_profile, and
 * docs/benchmarks.md). This loop reads each weight once per call and does nothing else.
 *
 * Every output number is the same sum in the same order whatever M is and whichever rows share the call: out[m, n]
 * depends on x[m, :] and W[n, :] only. So a row's result never depends on the batch or on how a prompt is
 * chunked (batch invariance by construction), and decode steps and prompt chunks compute alike.
 *
 * The weight is packed once (native.py, `pack_weight`): [N / 32][K / 2][32 columns][2 k], so one 64-byte load
 * holds 16 output columns' pairs of k, the operand layout of vdpbf16ps. Requires N % 32 == 0 and K % 2 == 0.
 * Built by engine/backends/native.py with: -O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16. */
#include <immintrin.h>
#include <stdint.h>

#define COLUMNS 32       /* output columns per block: two zmm accumulators per row */
#define ROWS 8           /* rows per pass over a block: 16 accumulators, the block stays in cache for the next */
#define PREFETCH_PAIRS 16 /* k pairs ahead (2 KB) that the weight stream is prefetched */

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
            _mm256_storeu_si256((__m256i *)(out + r * out_stride), (__m256i)_mm512_cvtneps_pbh(low[r]));          \
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16), (__m256i)_mm512_cvtneps_pbh(high[r]));    \
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

/* x: [M, K] contiguous; packed: the packed weight; out: [M, N] contiguous. */
void lockstep_bf16_linear(const uint16_t *x, const uint16_t *packed, uint16_t *out, int64_t m, int64_t n,
                          int64_t k) {
    for (int64_t column = 0; column < n; column += COLUMNS) {
        const uint16_t *block = packed + column * k;
        for (int64_t row = 0; row < m; row += ROWS) {
            int64_t rows = m - row < ROWS ? m - row : ROWS;
            BLOCK_KERNELS[rows](x + row * k, k, block, out + row * n + column, n, k / 2);
        }
    }
}
