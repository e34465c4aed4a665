/* lockstep's kernels for the embedded model's own 4-bit weights: a matmul that reads GGUF's Q4_1 and Q8_0 blocks as
 * they are (so a decode step streams ~96 MB instead of 270 MB of bfloat16 or 540 MB of float32), and a whole decode
 * step of a Llama-shaped model in one call over a slot KV cache (float16 keys and values on 8-bit activations,
 * float32 in the exact mode: see "Keys and values" below). Built by engine/backends/q4.py with
 * -O3 -march=native: AVX2 + FMA + F16C intrinsics where the CPU has them (and 16-column AVX-512 tiles with the same
 * bits where it has AVX-512), NEON intrinsics with the same bits on ARM64 (8-bit dot products by sdot where the core
 * has it, 16-bit multiply-adds on ARMv8.0), plain C (which the compiler vectorizes for whatever the host has)
 * elsewhere. q4.py checks them against float64 before the engine uses them.
 *
 * Blocks, as in GGUF: Q4_1 is 20 bytes per 32 weights (fp16 scale d, fp16 minimum m, 16 bytes of nibbles; weight j
 * is d * q_j + m, q_j in the low nibble of byte j for j < 16, the high nibble of byte j - 16 after). Q8_0 is 34
 * bytes (fp16 scale d, 32 int8; weight j is d * q_j). A weight [N, K] is N rows of K / 32 blocks. On AVX2 (and
 * ARM64's NEON tiles) the weights are read interleaved (Q4_1_X8 for the layers, Q8_0_X8 for the lm_head, made by
 * lockstep_q4_interleave): the same bytes regrouped so that one vector holds 4 weights of 8 columns (NEON: of 4).
 * A file's Q4_0 and Q4_K are read there as they are, as Q4_0_X8 and Q4_K_X8 (the file's bytes but Q4_K's unpacked
 * scales: no Q4_1's wider blocks, and gguf-py's numbers), through the Q4_1_X8 tiles (x8_scales, x8_quants); its
 * Q6_K as Q6_K_X8 (the file's bytes, 6.5625 bits a weight instead of Q8_0's 8.5), by its own 8-bit tiles (two
 * integer dot products a block, one per 16 values) and the same float32 ones.
 * On 8-bit activations a block's integer dot products for 8 columns are then vertical maddubs (NEON: sdot, or
 * 16-bit multiply-adds) against broadcast activations instead of 8 horizontal sums; on float32 ones (exact) 8
 * columns' weights are one vector of floats for a float GEMM's broadcast FMAs (what each layout gained:
 * docs/benchmarks.md, "Measurements behind the code's constants").
 *
 * Every row of x is computed the same way whatever else the call holds: each output is one chain of FMAs over K in
 * the same order, then one fixed reduction, whatever M is, whichever tile or thread computes it. So a row's result
 * never depends on the batch or on how a prompt is chunked (batch invariance by construction). Weights are
 * dequantized exactly as gguf-py does (d * q, then + m, in float32), so the float32 dequantized model and these
 * kernels compute with the same numbers and differ only in the order of the sums. */
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCKSTEP_AVX2 1
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define LOCKSTEP_AVX2 0
#if defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif
#endif

/* vpdpbusd: four u8 x s8 products and their sum added to an int32 lane in one instruction (AVX512-VNNI with VL,
 * or Intel's AVX-VNNI), where AVX2 needs maddubs to int16 pairs, then madd to int32. The integer sums are the same,
 * so the outputs are the same bits either way. */
#if LOCKSTEP_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LOCKSTEP_VNNI 1
#define dot4_add(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif LOCKSTEP_AVX2 && defined(__AVXVNNI__)
#define LOCKSTEP_VNNI 1
#define dot4_add(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define LOCKSTEP_VNNI 0
#endif

/* AVX-512: two interleaved groups (16 columns) in one vector, each lane computed by the very operations of the
 * 8-column AVX2 tiles, so the outputs are the same bits and half the instructions (where a 512-bit FMA is one
 * instruction, not two 256-bit halves: Intel's AVX-512 cores; Zen 4 splits them). */
#if LOCKSTEP_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define LOCKSTEP_AVX512 1
#else
#define LOCKSTEP_AVX512 0
#endif

/* ARM64 (little-endian): the interleaved blocks on NEON tiles, lane by lane the AVX2 tiles' operations on both kinds
 * of activations. Their 8-bit dot products are ARMv8.2's sdot where the core has it (Neoverse N1 and later,
 * Cortex-A76 and later, Apple M1: LOCKSTEP_NEON_DOT), else 16-bit multiply-adds that sum the same whole integers
 * (ARMv8.0: Cortex-A72 as in the Raspberry Pi 4 and AWS Graviton 1). */
#if !LOCKSTEP_AVX2 && defined(__aarch64__) && defined(__ARM_NEON) && !defined(__ARM_BIG_ENDIAN)
#define LOCKSTEP_NEON 1
#else
#define LOCKSTEP_NEON 0
#endif
/* read before arm_neon.h: its pragmas define the target's macros again, whatever -U took away */
#if LOCKSTEP_NEON && defined(__ARM_FEATURE_DOTPROD)
#define LOCKSTEP_NEON_DOT 1
#else
#define LOCKSTEP_NEON_DOT 0
#endif
#if LOCKSTEP_NEON
#include <arm_neon.h>
#endif

#define BLOCK 32
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define ROW_TILE 8      /* rows of x per pass over a weight row: the weight row stays in L1 for the next pass */
#define ROW_BLOCK 64    /* rows of x kept in L2 while every weight row streams past them (prompt chunks) */
#define PREFETCH_BYTES 384 /* how far ahead in a weight row the next blocks are fetched */
#define MIN_UNIT_COLUMNS 16 /* a matmul's units of work shared between threads: at least this many columns, */
#define UNITS_PER_THREAD 8  /* about this many units per thread */

#define Q4_0_BYTES 18
#define Q4_K_BYTES 144 /* per super-block of 256 weights */
#define SUPER_BLOCK 256

/* The interleaved formats are 2..5 (X8_KIND: their index in the tables of tiles). Plain Q4_0 and Q4_K are the
 * GGUF's own blocks: only lockstep_q4_interleave and lockstep_q4_dequantize_rows read them (the matmuls read their
 * interleaved copies; a build that interleaves nothing reads a file's Q4_0 and Q4_K as Q4_1, block_repack.py). */
enum {
    FORMAT_Q4_1 = 0, FORMAT_Q8_0 = 1, FORMAT_Q4_1_X8 = 2, FORMAT_Q8_0_X8 = 3, FORMAT_Q4_0_X8 = 4, FORMAT_Q4_K_X8 = 5,
    FORMAT_Q4_0 = 6, FORMAT_Q4_K = 7, FORMAT_Q6_K_X8 = 8, FORMAT_Q6_K = 9
};
/* Q6_K_X8 (8) has its own 8-bit tiles (q6_x8_tile, q6_x8_tile16); BY_4_BIT_FORMAT (the other 8-bit tiles) leaves
 * it out. */
#define X8_KIND(format) ((format) == FORMAT_Q6_K_X8 ? 4 : (format) - FORMAT_Q4_1_X8)
#define X8_KINDS 5
/* CALL(F) with F the constant of an interleaved `format` (of a 4-bit one): the code built for each format, chosen
 * at run time. */
#define BY_4_BIT_FORMAT(format, CALL)                                                                               \
    do {                                                                                                            \
        if ((format) == FORMAT_Q4_0_X8) CALL(FORMAT_Q4_0_X8);                                                       \
        else if ((format) == FORMAT_Q4_K_X8) CALL(FORMAT_Q4_K_X8);                                                  \
        else CALL(FORMAT_Q4_1_X8);                                                                                  \
    } while (0)
#define BY_FORMAT(format, CALL)                                                                                     \
    do {                                                                                                            \
        if ((format) == FORMAT_Q8_0_X8) CALL(FORMAT_Q8_0_X8);                                                       \
        else if ((format) == FORMAT_Q6_K_X8) CALL(FORMAT_Q6_K_X8);                                                  \
        else BY_4_BIT_FORMAT(format, CALL);                                                                         \
    } while (0)

static inline int is_x8(int format) {
    return (format >= FORMAT_Q4_1_X8 && format <= FORMAT_Q4_K_X8) || format == FORMAT_Q6_K_X8;
}

int lockstep_q4_uses_avx2(void) { return LOCKSTEP_AVX2; }
int lockstep_q4_uses_vnni(void) { return LOCKSTEP_VNNI; }
int lockstep_q4_uses_avx512(void) { return LOCKSTEP_AVX512; }
int lockstep_q4_uses_neon(void) { return LOCKSTEP_NEON; }
int lockstep_q4_uses_neon_dot(void) { return LOCKSTEP_NEON_DOT; }
/* Whether this build's matmuls read the interleaved blocks (Q4_1_X8, Q8_0_X8). */
int lockstep_q4_interleaves(void) { return LOCKSTEP_AVX2 || LOCKSTEP_NEON; }

static inline float half_to_float(uint16_t h) {
#if LOCKSTEP_AVX2
    return _cvtsh_ss(h);
#elif defined(__aarch64__) /* one instruction (fcvt), the same exact value */
    __fp16 half;
    memcpy(&half, &h, sizeof half);
    return (float)half;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } bits;
    if (exponent == 0) { /* zero or subnormal: exact in float32 */
        bits.f = (float)mantissa * 0x1p-24f;
        bits.u |= sign;
        return bits.f;
    }
    if (exponent == 31)
        bits.u = sign | 0x7F800000u | (mantissa << 13);
    else
        bits.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    return bits.f;
#endif
}

static inline uint16_t read_half(const uint8_t *block) { return (uint16_t)(block[0] | block[1] << 8); }

/* 32 weights of one block, dequantized. */
static inline void dequantize_block(const uint8_t *block, int format, float *out) {
    float d = half_to_float(read_half(block));
    if (format == FORMAT_Q4_1) {
        float m = half_to_float(read_half(block + 2));
        const uint8_t *q = block + 4;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(q[j] & 0x0F) + m;
            out[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int j = 0; j < BLOCK; j++) out[j] = d * (float)q[j];
    }
}

static inline int64_t block_bytes(int format) {
    return format == FORMAT_Q8_0 || format == FORMAT_Q8_0_X8 ? Q8_0_BYTES : Q4_1_BYTES;
}


/* Q4_1_X8: for each group of 8 rows (N % 8 == 0) and each block b, 160 bytes: the 8 rows' fp16 scales d, their 8
 * fp16 minimums m, then 4 vectors of 32 bytes, vector i holding bytes 4i..4i+3 of each row's 16 nibble bytes
 * (weights 4i..4i+3 in the low nibbles, 16+4i..16+4i+3 in the high ones), row j in bytes 4j..4j+3. Q8_0_X8 alike:
 * 272 bytes, the 8 fp16 scales, then 8 vectors, vector i holding weights 4i..4i+3 of each row. */
#define UNROLLED _Pragma("GCC unroll 32") /* constant indices: the accumulators stay in registers */
#define X8_GROUP_BYTES (8 * Q4_1_BYTES)
#define Q8_X8_GROUP_BYTES (8 * Q8_0_BYTES)
/* Q4_0_X8: Q4_1_X8 without the minimums (144 bytes a block: the 8 fp16 d, then the 4 vectors of nibbles); its m is
 * -8 d, exact in float32 (GGUF's Q4_0 weight is d (q - 8)). */
#define Q4_0_X8_GROUP_BYTES (8 * Q4_0_BYTES)
/* Q4_K_X8: per group of 8 rows and super-block of 256 weights (8 blocks), 1184 bytes: the 8 rows' fp16 d, their 8
 * fp16 dmin, then the 6-bit scales sc and minimums m of Q4_K unpacked to a byte each, sub-block j's 8 rows' sc in
 * bytes 32 + 8j.., their m in 96 + 8j.., then each block's nibbles as Q4_1_X8 lays them out (block j at 160 + 128j).
 * Weight q of sub-block j is (d sc_j) q - dmin m_j, as gguf-py computes it: d sc_j and dmin m_j are exact in float32
 * (11 by 6 bits), so a block's scale and minimum are float32 vectors and the Q4_1_X8 code does the rest. 4.625 bits a
 * weight (Q4_1_X8: 5). */
#define Q4_K_X8_GROUP_BYTES 1184
#define Q4_K_X8_SCALES 32
#define Q4_K_X8_MINIMUMS 96
#define Q4_K_X8_NIBBLES 160
/* Q6_K_X8: per group of 8 rows and super-block of 256 weights, 1680 bytes (the file's 210 a row: 6.5625 bits a
 * weight): the 8 rows' fp16 d; the 16 x 8 int8 scales (16 values each: values 16s.. of row j at 16 + 8s + j); then
 * per block b of 32 values (at 144 + 192b) the low 4 bits of its 6-bit q as Q4_1_X8 lays out its nibbles (vector i:
 * values 4i..4i+3 low, 16+4i..16+4i+3 high, row j at bytes 4j..), then their high 2 bits as two 32-byte planes in
 * the same order: byte 4j + t of the first holds in bits 2i, 2i + 1 those of value 4i + t, the second those of value
 * 16 + 4i + t. A block's halves (its low and high nibbles) are Q6_K's 16-value sub-blocks: weight q of half h is
 * (d sc_h) (q - 32), q in 0..63, as gguf-py computes it (d sc_h exact in float32; one rounding). */
#define Q6_K_BYTES 210
#define Q6_K_X8_GROUP_BYTES 1680
#define Q6_K_X8_SCALES 16
#define Q6_K_X8_BLOCKS 144
#define Q6_K_X8_BLOCK_BYTES 192

/* Bytes of a row of K weights (an interleaved format's group of 8 rows: 8 times as many). */
static inline int64_t row_bytes_of(int format, int64_t k) {
    switch (format) {
    case FORMAT_Q4_0: case FORMAT_Q4_0_X8: return k / BLOCK * Q4_0_BYTES;
    case FORMAT_Q4_K: return k / SUPER_BLOCK * Q4_K_BYTES;
    case FORMAT_Q4_K_X8: return k / SUPER_BLOCK * Q4_K_X8_GROUP_BYTES / 8;
    case FORMAT_Q6_K: case FORMAT_Q6_K_X8: return k / SUPER_BLOCK * Q6_K_BYTES;
    default: return k / BLOCK * block_bytes(format);
    }
}

/* Where the interleaved formats differ: block b of a group of 8 rows (`group`: the group's first block) has its 8
 * columns' scales d and minimums m (Q8_0_X8: zero) and its quantized weights (x8_quants: the 4-bit formats'
 * nibbles, all laid out as Q4_1_X8's; Q8_0_X8's int8 vectors). Every tile reads its blocks through these, so a
 * 4-bit format is its two accessors; its d and m are float32 vectors, exact (see Q4_K_X8, Q4_0_X8). */
static inline __attribute__((always_inline)) const uint8_t *x8_quants(const uint8_t *group, int64_t b,
                                                                      const int FORMAT) {
    switch (FORMAT) {
    case FORMAT_Q4_K_X8: return group + b / 8 * Q4_K_X8_GROUP_BYTES + Q4_K_X8_NIBBLES + 128 * (b % 8);
    case FORMAT_Q6_K_X8: return group + b / 8 * Q6_K_X8_GROUP_BYTES + Q6_K_X8_BLOCKS + Q6_K_X8_BLOCK_BYTES * (b % 8);
    case FORMAT_Q4_0_X8: return group + b * Q4_0_X8_GROUP_BYTES + 16;
    case FORMAT_Q8_0_X8: return group + b * Q8_X8_GROUP_BYTES + 16;
    default: return group + b * X8_GROUP_BYTES + 32;
    }
}

/* Bytes a group's block takes on average (Q4_K_X8: an eighth of its super-block), for fetching ahead. */
static inline int64_t x8_block_bytes(int format) {
    switch (format) {
    case FORMAT_Q4_K_X8: return Q4_K_X8_GROUP_BYTES / 8;
    case FORMAT_Q6_K_X8: return Q6_K_X8_GROUP_BYTES / 8;
    case FORMAT_Q4_0_X8: return Q4_0_X8_GROUP_BYTES;
    case FORMAT_Q8_0_X8: return Q8_X8_GROUP_BYTES;
    default: return X8_GROUP_BYTES;
    }
}

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and minimum. */
static inline void k4_scale_min(int j, const uint8_t *q, int *scale, int *minimum) {
    if (j < 4) {
        *scale = q[j] & 63;
        *minimum = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}


/* Row j's Q4_K super-block (d, dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles) into its place in a
 * Q4_K_X8 group: Q4_K keeps sub-blocks 2c and 2c + 1 in the low and high nibbles of chunk c's 32 bytes, Q4_1_X8's
 * nibbles hold weights i and i + 16 of one block in byte i. */
static void interleave_q4_k(const uint8_t *block, int j, uint8_t *group) {
    memcpy(group + 2 * j, block, 2);
    memcpy(group + 16 + 2 * j, block + 2, 2);
    for (int s = 0; s < 8; s++) {
        int scale, minimum;
        k4_scale_min(s, block + 4, &scale, &minimum);
        group[Q4_K_X8_SCALES + 8 * s + j] = (uint8_t)scale;
        group[Q4_K_X8_MINIMUMS + 8 * s + j] = (uint8_t)minimum;
        const uint8_t *chunk = block + 16 + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        uint8_t nibbles[16];
        for (int i = 0; i < 16; i++)
            nibbles[i] = (uint8_t)(((chunk[i] >> shift) & 0x0F) | (((chunk[i + 16] >> shift) & 0x0F) << 4));
        for (int v = 0; v < 4; v++) memcpy(group + Q4_K_X8_NIBBLES + 128 * s + 32 * v + 4 * j, nibbles + 4 * v, 4);
    }
}

/* The 256 6-bit q (0..63) of a Q6_K super-block (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
 * fp16 d), in order, as ggml's dequantize_row_q6_K reads them. */
static void q6_k_values(const uint8_t *block, uint8_t q[SUPER_BLOCK]) {
    const uint8_t *ql = block, *qh = block + 128;
    for (int half = 0; half < 2; half++)
        for (int l = 0; l < 32; l++) {
            const int at = half * 128 + l;
            const uint8_t low = ql[half * 64 + l], high = ql[half * 64 + l + 32], bits = qh[half * 32 + l];
            q[at] = (uint8_t)((low & 0x0F) | ((bits & 3) << 4));
            q[at + 32] = (uint8_t)((high & 0x0F) | (((bits >> 2) & 3) << 4));
            q[at + 64] = (uint8_t)((low >> 4) | (((bits >> 4) & 3) << 4));
            q[at + 96] = (uint8_t)((high >> 4) | (((bits >> 6) & 3) << 4));
        }
}

/* Row j's Q6_K super-block into its place in a Q6_K_X8 group (see Q6_K_X8). */
static void interleave_q6_k(const uint8_t *block, int j, uint8_t *group) {
    uint8_t q[SUPER_BLOCK];
    q6_k_values(block, q);
    memcpy(group + 2 * j, block + 208, 2);
    for (int s = 0; s < 16; s++) group[Q6_K_X8_SCALES + 8 * s + j] = block[192 + s];
    for (int b = 0; b < 8; b++) {
        uint8_t *target = group + Q6_K_X8_BLOCKS + Q6_K_X8_BLOCK_BYTES * b;
        const uint8_t *v = q + BLOCK * b;
        for (int t = 0; t < 4; t++) {
            uint8_t first = 0, second = 0;
            for (int i = 0; i < 4; i++) {
                target[32 * i + 4 * j + t] = (uint8_t)((v[4 * i + t] & 0x0F) | ((v[16 + 4 * i + t] & 0x0F) << 4));
                first |= (uint8_t)((v[4 * i + t] >> 4) << (2 * i));
                second |= (uint8_t)((v[16 + 4 * i + t] >> 4) << (2 * i));
            }
            target[128 + 4 * j + t] = first;
            target[160 + 4 * j + t] = second;
        }
    }
}

/* `plain` (format Q4_1, Q8_0, Q4_0, Q4_K or Q6_K, N % 8 == 0 rows) regrouped into `out` as Q4_1_X8, Q8_0_X8, Q4_0_X8 or
 * Q4_K_X8 (row_bytes_of: the same bytes but Q4_K_X8's 4 more a super-block, its scales unpacked). */
void lockstep_q4_interleave(const uint8_t *plain, int format, int64_t n, int64_t k, uint8_t *out) {
    const int64_t row_bytes = row_bytes_of(format, k);
    if (format == FORMAT_Q4_K || format == FORMAT_Q6_K) {
        const int64_t supers = k / SUPER_BLOCK, in_bytes = format == FORMAT_Q4_K ? Q4_K_BYTES : Q6_K_BYTES;
        const int64_t out_bytes = format == FORMAT_Q4_K ? Q4_K_X8_GROUP_BYTES : Q6_K_X8_GROUP_BYTES;
        for (int64_t g = 0; g < n / 8; g++)
            for (int64_t sb = 0; sb < supers; sb++)
                for (int j = 0; j < 8; j++) {
                    const uint8_t *block = plain + (g * 8 + j) * row_bytes + sb * in_bytes;
                    uint8_t *group = out + (g * supers + sb) * out_bytes;
                    if (format == FORMAT_Q4_K) interleave_q4_k(block, j, group);
                    else interleave_q6_k(block, j, group);
                }
        return;
    }
    const int64_t blocks = k / BLOCK, bytes = row_bytes / blocks;
    const int header = format == FORMAT_Q4_1 ? 4 : 2, vectors = format == FORMAT_Q8_0 ? 8 : 4;
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *group = out + (g * blocks + b) * 8 * bytes;
            for (int j = 0; j < 8; j++) {
                const uint8_t *block = plain + (g * 8 + j) * row_bytes + b * bytes;
                memcpy(group + 2 * j, block, 2);                                     /* d */
                if (format == FORMAT_Q4_1) memcpy(group + 16 + 2 * j, block + 2, 2); /* m */
                for (int i = 0; i < vectors; i++) memcpy(group + 8 * header + 32 * i + 4 * j, block + header + 4 * i, 4);
            }
        }
}

/* Block b (32 weights) of row `id` of a weight of any format, dequantized as gguf-py does: d q + m, where d q is
 * exact in float32 (Q4_0: m = -8 d, so d (q - 8); Q4_K: d = d sc, m = -(dmin m), both exact); Q8_0: d q. */
static void dequantize_row_block(const uint8_t *weight, int format, int64_t id, int64_t b, int64_t k, float *out) {
    const int64_t row_bytes = row_bytes_of(format, k);
    if (format == FORMAT_Q4_1 || format == FORMAT_Q8_0) {
        dequantize_block(weight + id * row_bytes + b * block_bytes(format), format, out);
        return;
    }
    const uint8_t *row = weight + id * row_bytes, *group = weight + id / 8 * 8 * row_bytes;
    const int j = (int)(id % 8), s = (int)(b % 8);
    uint8_t nibbles[16];
    float d, m;
    if (format == FORMAT_Q6_K || format == FORMAT_Q6_K_X8) { /* (d sc) (q - 32), as gguf-py */
        uint8_t q[BLOCK];
        float scales[2];
        if (format == FORMAT_Q6_K) {
            const uint8_t *block = row + b / 8 * Q6_K_BYTES;
            uint8_t all[SUPER_BLOCK];
            q6_k_values(block, all);
            memcpy(q, all + BLOCK * s, BLOCK);
            d = half_to_float(read_half(block + 208));
            for (int h = 0; h < 2; h++) scales[h] = d * (float)(int8_t)block[192 + 2 * s + h];
        } else {
            const uint8_t *g = group + b / 8 * Q6_K_X8_GROUP_BYTES, *v = x8_quants(group, b, FORMAT_Q6_K_X8);
            d = half_to_float(read_half(g + 2 * j));
            for (int h = 0; h < 2; h++) scales[h] = d * (float)(int8_t)g[Q6_K_X8_SCALES + 8 * (2 * s + h) + j];
            for (int i = 0; i < 16; i++) {
                const int at = 32 * (i / 4) + 4 * j + i % 4, shift = 2 * (i / 4);
                q[i] = (uint8_t)((v[at] & 0x0F) | (((v[128 + 4 * j + i % 4] >> shift) & 3) << 4));
                q[i + 16] = (uint8_t)((v[at] >> 4) | (((v[160 + 4 * j + i % 4] >> shift) & 3) << 4));
            }
        }
        for (int i = 0; i < BLOCK; i++) out[i] = scales[i / 16] * (float)((int)q[i] - 32);
        return;
    }
    if (format == FORMAT_Q8_0_X8) {
        const uint8_t *g = group + b * Q8_X8_GROUP_BYTES;
        d = half_to_float(read_half(g + 2 * j));
        for (int i = 0; i < BLOCK; i++) out[i] = d * (float)(int8_t)g[16 + 32 * (i / 4) + 4 * j + i % 4];
        return;
    }
    if (format == FORMAT_Q4_0) {
        d = half_to_float(read_half(row + b * Q4_0_BYTES)), m = -8.0f * d;
        memcpy(nibbles, row + b * Q4_0_BYTES + 2, 16);
    } else if (format == FORMAT_Q4_K) {
        const uint8_t *block = row + b / 8 * Q4_K_BYTES, *chunk = block + 16 + 32 * (s / 2);
        int scale, minimum;
        k4_scale_min(s, block + 4, &scale, &minimum);
        d = half_to_float(read_half(block)) * (float)scale, m = -(half_to_float(read_half(block + 2)) * (float)minimum);
        for (int i = 0; i < 16; i++)
            nibbles[i] = (uint8_t)(((chunk[i] >> 4 * (s % 2)) & 0x0F) | (((chunk[i + 16] >> 4 * (s % 2)) & 0x0F) << 4));
    } else {
        const uint8_t *q;
        if (format == FORMAT_Q4_K_X8) {
            const uint8_t *g = group + b / 8 * Q4_K_X8_GROUP_BYTES;
            d = half_to_float(read_half(g + 2 * j)) * (float)g[Q4_K_X8_SCALES + 8 * s + j];
            m = -(half_to_float(read_half(g + 16 + 2 * j)) * (float)g[Q4_K_X8_MINIMUMS + 8 * s + j]);
            q = g + Q4_K_X8_NIBBLES + 128 * s;
        } else if (format == FORMAT_Q4_0_X8) {
            const uint8_t *g = group + b * Q4_0_X8_GROUP_BYTES;
            d = half_to_float(read_half(g + 2 * j)), m = -8.0f * d, q = g + 16;
        } else { /* Q4_1_X8 */
            const uint8_t *g = group + b * X8_GROUP_BYTES;
            d = half_to_float(read_half(g + 2 * j)), m = half_to_float(read_half(g + 16 + 2 * j)), q = g + 32;
        }
        for (int i = 0; i < 16; i++) nibbles[i] = q[32 * (i / 4) + 4 * j + i % 4];
    }
    for (int i = 0; i < 16; i++) {
        out[i] = d * (float)(nibbles[i] & 0x0F) + m;
        out[i + 16] = d * (float)(nibbles[i] >> 4) + m;
    }
}

/* ---- The matmul. As llama.cpp does, x is quantized per row to 8 bits in blocks of 32 (a float scale dx, and
 * sx = dx * the sum of the block's values, for Q4_1's minimum), and each block's dot product is one of integers:
 * for Q4_1, dw * dx * sum(q_w * q_x) + mw * sx; for Q8_0, dw * dx * sum(q_w * q_x). */
struct quantized_x {
    const float *xf; /* [M, K]: x as given, which `exact` matmuls read */
    int exact;       /* 1: float32 activations (the weights' own numbers); 0: 8-bit activations */
    int8_t *q;    /* [M, K] */
    float *scale; /* [M, K / 32] */
    float *sum;   /* [K / 32, M8]: block-major, zero-padded to M8 = M rounded up to 8 rows */
    int32_t *half_sum; /* [M, K / 16]: each 16 quantized activations' integer sum (Q6_K_X8's q - 32) */
    int64_t m, m8, k;
};

/* 32 activations rounded to 8 bits: the scale d = max |x| / 127, each x / d to the nearest integer (ties to even),
 * and d * their sum (for Q4_1's minimum). AVX2 takes 8 lanes at a time with the same numbers (a maximum in any
 * order, the same rounding, an integer total). */
static inline void quantize_block(const float *xs, int8_t *q, float *scale, float *sum) {
#if LOCKSTEP_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xs + 8 * i)));
    float lanes[8], top = 0;
    _mm256_storeu_ps(lanes, amax);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    const float d = top / 127.0f, inverse = d ? 1.0f / d : 0.0f;
    __m256i n[4];
    for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    /* packs work within 128-bit lanes: each permute puts the 64-bit quarters back in order */
    __m256i low = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8);
    __m256i high = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xD8);
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi16(low, high), 0xD8));
    int32_t parts[8];
    _mm256_storeu_si256((__m256i *)parts, total);
    int all = 0;
    for (int i = 0; i < 8; i++) all += parts[i];
#else
    float top = 0;
    for (int j = 0; j < BLOCK; j++) top = fabsf(xs[j]) > top ? fabsf(xs[j]) : top;
    const float d = top / 127.0f, inverse = d ? 1.0f / d : 0.0f;
    int all = 0;
    for (int j = 0; j < BLOCK; j++) all += q[j] = (int8_t)nearbyintf(xs[j] * inverse);
#endif
    *scale = d;
    *sum = d * (float)all;
}

/* `*memory` holding at least `bytes` (64-byte aligned), reallocated only to grow; NULL where it cannot be had. */
static float *grown(float **memory, int64_t *held, int64_t bytes) {
    if (bytes > *held) {
        free(*memory);
        *memory = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        *held = *memory ? bytes : 0;
    }
    return *memory;
}

/* This thread's scratch memory (a matmul's panel, or the attention's keys and values in float32: never both at
 * once), grown as needed and kept (the helper threads live as long as the process); NULL where it cannot be had. */
static float *thread_panel(int64_t bytes) {
    static __thread float *memory;
    static __thread int64_t held;
    return grown(&memory, &held, bytes);
}

/* This thread's attention scores: one unit's queries x the longest slot's positions, grown as needed and kept (a
 * step's scores for every row and head at once took 137 MB for a 512-token chunk at 7,400 positions). */
static float *thread_scores(int64_t bytes) {
    static __thread float *memory;
    static __thread int64_t held;
    return grown(&memory, &held, bytes);
}

static void quantize_rows(const float *x, struct quantized_x *out) {
    const int64_t blocks = out->k / BLOCK;
    memset(out->sum, 0, blocks * out->m8 * sizeof(float));
    out->xf = x;
    if (out->exact) { /* only each block's sum, for Q4_1's minimum: m * sum(x) */
        for (int64_t r = 0; r < out->m; r++)
            for (int64_t b = 0; b < blocks; b++) {
                float total = 0;
                for (int j = 0; j < BLOCK; j++) total += x[r * out->k + b * BLOCK + j];
                out->sum[b * out->m8 + r] = total;
            }
        return;
    }
    for (int64_t r = 0; r < out->m; r++)
        for (int64_t b = 0; b < blocks; b++)
            quantize_block(x + r * out->k + b * BLOCK, out->q + r * out->k + b * BLOCK, &out->scale[r * blocks + b],
                           &out->sum[b * out->m8 + r]);
    for (int64_t r = 0; r < out->m; r++)
        for (int64_t h = 0; h < 2 * blocks; h++) {
            int32_t total = 0;
            for (int j = 0; j < 16; j++) total += out->q[r * out->k + 16 * h + j];
            out->half_sum[r * 2 * blocks + h] = total;
        }
}

#if LOCKSTEP_AVX2
static inline float sum_lanes(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

/* sum(q_w * q_x) of one block, as 8 int32 lanes turned float: w unsigned (Q4_1's nibbles) or signed (Q8_0). */
static inline __m256 block_dot(__m256i w, __m256i x, const int FORMAT) {
    if (FORMAT == FORMAT_Q8_0) { /* maddubs takes one unsigned operand: |w| and x with w's sign (as llama.cpp) */
        x = _mm256_sign_epi8(x, w);
        w = _mm256_sign_epi8(w, w);
    }
    __m256i pairs = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __m256i load_weights(const uint8_t *block, const int FORMAT) {
    if (FORMAT == FORMAT_Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4));
    __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F)); /* weights 0..15 low, 16..31 high, as GGUF orders them */
}

/* The block's fp16 scale (lane 0) and Q4_1's minimum (lane 1) as floats. */
static inline __m128 block_scales(const uint8_t *block) {
    int32_t halves;
    memcpy(&halves, block, sizeof(halves));
    return _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
}

/* A block's 32 weights q_j (Q4_1's nibbles or Q8_0's int8) as four vectors of floats, in GGUF's order. */
static inline void load_weights_float(const uint8_t *block, const int FORMAT, __m256 q[4]) {
    __m128i first, second;
    if (FORMAT == FORMAT_Q8_0) {
        first = _mm_loadu_si128((const __m128i *)(block + 2));
        second = _mm_loadu_si128((const __m128i *)(block + 18));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
        return;
    }
    __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 4)), nibble = _mm_set1_epi8(0x0F);
    first = _mm_and_si128(bytes, nibble);
    second = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
}

/* One block of one column for ROWS rows, added to acc[0..ROWS): on 8-bit activations dw * dx * sum(q_w * q_x), an
 * integer dot product; on float32 ones (EXACT) d * sum(q_j * x_j), four FMAs per row: the weights' own numbers,
 * so only the order of the sums differs from the dequantized float32 matmul. */
static inline __attribute__((always_inline)) void add_block(const struct quantized_x *x, int64_t row, int64_t b,
                                                            const uint8_t *block, __m128 scales, __m256 *acc,
                                                            const int FORMAT, const int ROWS, const int EXACT) {
    const int64_t blocks = x->k / BLOCK;
    if (EXACT) {
        __m256 q[4];
        load_weights_float(block, FORMAT, q);
        __m256 scale = _mm256_broadcastss_ps(scales);
        for (int r = 0; r < ROWS; r++) {
            const float *xs = x->xf + (row + r) * x->k + b * BLOCK;
            __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xs));
            dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xs + 8), dot);
            dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xs + 16), dot);
            dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xs + 24), dot);
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
        return;
    }
    __m256i w = load_weights(block, FORMAT);
    for (int r = 0; r < ROWS; r++) {
        __m256i xs = _mm256_loadu_si256((const __m256i *)(x->q + (row + r) * x->k + b * BLOCK));
        __m256 scale = _mm256_broadcastss_ps(_mm_mul_ss(scales, _mm_load_ss(x->scale + (row + r) * blocks + b)));
        acc[r] = _mm256_fmadd_ps(block_dot(w, xs, FORMAT), scale, acc[r]);
    }
}

/* COLUMNS columns x ROWS rows (COLUMNS > 1 only with one row): per (column, row) one float accumulator that each
 * block adds to in order, and one for Q4_1's minimum term (lane r of a vector for several rows, one float for one:
 * the same fused multiply-add), so every output is computed by the same operations whatever the tile. */
static inline __attribute__((always_inline)) void tile(const struct quantized_x *x, int64_t row, const uint8_t *weight,
                                                       int64_t row_bytes, float *out, int64_t n, const int FORMAT,
                                                       const int COLUMNS, const int ROWS, const int EXACT) {
    const int64_t blocks = x->k / BLOCK, bytes = FORMAT == FORMAT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    const float *x_sum = x->sum + row;
    __m256 acc[4][8], minimum_rows[4];
    __m128 minimum_one[4];
    for (int c = 0; c < COLUMNS; c++) {
        minimum_rows[c] = _mm256_setzero_ps();
        minimum_one[c] = _mm_setzero_ps();
        for (int r = 0; r < ROWS; r++) acc[c][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++) {
        for (int c = 0; c < COLUMNS; c++) {
            const uint8_t *block = weight + c * row_bytes + b * bytes;
            _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
            __m128 scales = block_scales(block);
            add_block(x, row, b, block, scales, acc[c], FORMAT, ROWS, EXACT);
            if (FORMAT == FORMAT_Q4_1) {
                __m128 minimum = _mm_movehdup_ps(scales);
                if (ROWS == 1)
                    minimum_one[c] = _mm_fmadd_ss(minimum, _mm_load_ss(x_sum + b * x->m8), minimum_one[c]);
                else /* rows past the tile read other rows' (or padding) sums, never used */
                    minimum_rows[c] = _mm256_fmadd_ps(_mm256_broadcastss_ps(minimum),
                                                      _mm256_loadu_ps(x_sum + b * x->m8), minimum_rows[c]);
            }
        }
    }
    for (int c = 0; c < COLUMNS; c++) {
        float minimum[8];
        if (ROWS == 1)
            _mm_store_ss(minimum, minimum_one[c]);
        else
            _mm256_storeu_ps(minimum, minimum_rows[c]);
        for (int r = 0; r < ROWS; r++) out[r * n + c] = sum_lanes(acc[c][r]) + minimum[r];
    }
}

typedef void (*tile_fn)(const struct quantized_x *, int64_t, const uint8_t *, int64_t, float *, int64_t);
/* Tile functions by (activations: 1 float32, 0 8-bit; format; columns; rows). */
#define TILE(E, F, C, R)                                                                                            \
    static void tile_##E##_##F##_##C##_##R(const struct quantized_x *x, int64_t row, const uint8_t *w, int64_t rb, \
                                           float *o, int64_t n) {                                                   \
        tile(x, row, w, rb, o, n, F, C, R, E);                                                                      \
    }
#define TILES(E, F)                                                                                                 \
    TILE(E, F, 4, 1) TILE(E, F, 1, 1) TILE(E, F, 1, 2) TILE(E, F, 1, 3) TILE(E, F, 1, 4) TILE(E, F, 1, 5)          \
    TILE(E, F, 1, 6) TILE(E, F, 1, 7) TILE(E, F, 1, 8)                                                              \
    static const tile_fn ONE_COLUMN_##E##_##F[ROW_TILE + 1] = {0,                 tile_##E##_##F##_1_1,            \
                                                               tile_##E##_##F##_1_2, tile_##E##_##F##_1_3,          \
                                                               tile_##E##_##F##_1_4, tile_##E##_##F##_1_5,          \
                                                               tile_##E##_##F##_1_6, tile_##E##_##F##_1_7,          \
                                                               tile_##E##_##F##_1_8};
TILES(0, 0) /* 8-bit activations, FORMAT_Q4_1 */
TILES(0, 1) /* 8-bit activations, FORMAT_Q8_0 */
TILES(1, 0) /* float32 activations */
TILES(1, 1)

/* 8 bytes at p as 8 floats (Q4_K_X8's unpacked scales or minimums). */
static inline __m256 bytes_as_floats(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 halves_as_floats(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 8 int8 at p as 8 floats (Q6_K_X8's scales). */
static inline __m256 signed_bytes_as_floats(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Block b's d and m (Q6_K_X8: d[h] = d sc_h and m[h] = -32 d sc_h for each half h, exact in float32). */
static inline __attribute__((always_inline)) void x8_scales(const uint8_t *group, int64_t b, __m256 *d, __m256 *m,
                                                            const int FORMAT) {
    if (FORMAT == FORMAT_Q6_K_X8) {
        const uint8_t *g = group + b / 8 * Q6_K_X8_GROUP_BYTES;
        const __m256 whole = halves_as_floats(g);
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_mul_ps(whole, signed_bytes_as_floats(g + Q6_K_X8_SCALES + 8 * (2 * (b % 8) + h)));
            m[h] = _mm256_mul_ps(d[h], _mm256_set1_ps(-32.0f));
        }
    } else if (FORMAT == FORMAT_Q4_K_X8) {
        const uint8_t *g = group + b / 8 * Q4_K_X8_GROUP_BYTES;
        *d = _mm256_mul_ps(halves_as_floats(g), bytes_as_floats(g + Q4_K_X8_SCALES + 8 * (b % 8)));
        *m = _mm256_xor_ps(_mm256_mul_ps(halves_as_floats(g + 16), bytes_as_floats(g + Q4_K_X8_MINIMUMS + 8 * (b % 8))),
                           _mm256_set1_ps(-0.0f));
    } else if (FORMAT == FORMAT_Q4_0_X8) {
        *d = halves_as_floats(group + b * Q4_0_X8_GROUP_BYTES);
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
    } else if (FORMAT == FORMAT_Q8_0_X8) {
        *d = halves_as_floats(group + b * Q8_X8_GROUP_BYTES);
        *m = _mm256_setzero_ps();
    } else {
        *d = halves_as_floats(group + b * X8_GROUP_BYTES);
        *m = halves_as_floats(group + b * X8_GROUP_BYTES + 16);
    }
}

/* 8 columns (one group of a 4-bit format: Q4_1_X8, Q4_0_X8, Q4_K_X8) x ROWS rows on 8-bit activations: per block,
 * each column's integer dot product sum(q_w * q_x) whole (at most 8 * 3810 in an int16 lane: no overflow), then
 * acc += dot * (dw * dx) and, apart, the minimum's m * sx: the same operations for every row, whatever ROWS. */
static inline __attribute__((always_inline)) void x8_tile(const struct quantized_x *x, int64_t row, const uint8_t *group,
                                                          float *out, int64_t n, const int FORMAT, const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4], minimum[4];
    for (int r = 0; r < ROWS; r++) acc[r] = minimum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) { /* no software prefetch: it made this loop slower */
        const uint8_t *q = x8_quants(group, b, FORMAT);
        __m256 d[2], m[2];
        x8_scales(group, b, d, m, FORMAT);
        __m256i dots[4];
        for (int i = 0; i < 4; i++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            __m256i low = _mm256_and_si256(packed, nibble), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            for (int r = 0; r < ROWS; r++) {
                int32_t first, second; /* activations 4i..4i+3 and 16+4i..16+4i+3 of this block */
                memcpy(&first, x->q + (row + r) * x->k + b * BLOCK + 4 * i, 4);
                memcpy(&second, x->q + (row + r) * x->k + b * BLOCK + 16 + 4 * i, 4);
#if LOCKSTEP_VNNI
                __m256i sums = dot4_add(i ? dots[r] : _mm256_setzero_si256(), low, _mm256_set1_epi32(first));
                dots[r] = dot4_add(sums, high, _mm256_set1_epi32(second));
#else
                __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(first)),
                                                 _mm256_maddubs_epi16(high, _mm256_set1_epi32(second)));
                dots[r] = i ? _mm256_add_epi16(dots[r], pairs) : pairs;
#endif
            }
        }
        for (int r = 0; r < ROWS; r++) {
#if LOCKSTEP_VNNI
            __m256 dot = _mm256_cvtepi32_ps(dots[r]);
#else
            __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r], ones));
#endif
            const __m256 dx = _mm256_set1_ps(x->scale[(row + r) * blocks + b]);
            acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d[0], dx), acc[r]);
            minimum[r] = _mm256_fmadd_ps(m[0], _mm256_set1_ps(x->sum[b * x->m8 + row + r]), minimum[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(out + r * n, _mm256_add_ps(acc[r], minimum[r]));
}

/* Vector i's high 2 bits of a Q6_K_X8 plane (bits 2i, 2i + 1 of each byte) moved to bits 4, 5. The 16-bit shifts
 * carry bits across bytes only into bits the mask clears. */
static inline __attribute__((always_inline)) __m256i q6_high_bits(__m256i plane, int i) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    if (i == 0) return _mm256_and_si256(_mm256_slli_epi16(plane, 4), mask);
    if (i == 1) return _mm256_and_si256(_mm256_slli_epi16(plane, 2), mask);
    if (i == 2) return _mm256_and_si256(plane, mask);
    return _mm256_and_si256(_mm256_srli_epi16(plane, 2), mask);
}

/* 8 columns (one Q6_K_X8 group) x ROWS rows on 8-bit activations: per block and half h (the low nibbles' 16 values,
 * then the high ones'), each column's integer dot product over the unsigned 6-bit q, less 32 times the half's sum
 * of activations (x->half_sum): sum((q - 32) q_x) exactly (|.| <= 16 * 95 * 127 in int32; maddubs's int16 lanes
 * hold two of its pairs, 2 * 2 * 63 * 127 <= 32004, before widening), then acc += that * (d sc_h * dx). */
static inline __attribute__((always_inline)) void q6_x8_tile(const struct quantized_x *x, int64_t row,
                                                             const uint8_t *group, float *out, int64_t n,
                                                             const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[4];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT_Q6_K_X8);
        __m256 d[2], m[2];
        x8_scales(group, b, d, m, FORMAT_Q6_K_X8);
        const __m256i planes[2] = {_mm256_loadu_si256((const __m256i *)(q + 128)),
                                   _mm256_loadu_si256((const __m256i *)(q + 160))};
        __m256i dots[4][2];
#if !LOCKSTEP_VNNI
        __m256i pairs[4][2];
#endif
        UNROLLED
        for (int i = 0; i < 4; i++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            __m256i w[2] = {_mm256_or_si256(_mm256_and_si256(packed, nibble), q6_high_bits(planes[0], i)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                                            q6_high_bits(planes[1], i))};
            for (int r = 0; r < ROWS; r++)
                for (int h = 0; h < 2; h++) {
                    int32_t four; /* activations 16h+4i..16h+4i+3 of this block */
                    memcpy(&four, x->q + (row + r) * x->k + b * BLOCK + 16 * h + 4 * i, 4);
#if LOCKSTEP_VNNI
                    dots[r][h] = dot4_add(i ? dots[r][h] : _mm256_setzero_si256(), w[h], _mm256_set1_epi32(four));
#else
                    __m256i two = _mm256_maddubs_epi16(w[h], _mm256_set1_epi32(four));
                    if (i % 2 == 0) {
                        pairs[r][h] = two;
                    } else {
                        __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(pairs[r][h], two), _mm256_set1_epi16(1));
                        dots[r][h] = i == 1 ? sums : _mm256_add_epi32(dots[r][h], sums);
                    }
#endif
                }
        }
        for (int r = 0; r < ROWS; r++) {
            const __m256 dx = _mm256_set1_ps(x->scale[(row + r) * blocks + b]);
            for (int h = 0; h < 2; h++) {
                const int32_t sum = 32 * x->half_sum[(row + r) * 2 * blocks + 2 * b + h];
                __m256i whole = _mm256_sub_epi32(dots[r][h], _mm256_set1_epi32(sum));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole), _mm256_mul_ps(d[h], dx), acc[r]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(out + r * n, acc[r]);
}

/* 8 columns (one Q8_0_X8 group) x ROWS rows: per block each column's integer dot product whole (int32 lanes; as
 * llama.cpp, maddubs takes |w| and x with w's sign), then acc += dot * (dw * dx). */
static inline __attribute__((always_inline)) void q8_x8_tile(const struct quantized_x *x, int64_t row,
                                                             const uint8_t *group, float *out, int64_t n, const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *g = group + b * Q8_X8_GROUP_BYTES;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256i dots[4];
        for (int i = 0; i < 8; i++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * i)), magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < ROWS; r++) {
                int32_t four; /* activations 4i..4i+3 of this block */
                memcpy(&four, x->q + (row + r) * x->k + b * BLOCK + 4 * i, 4);
#if LOCKSTEP_VNNI
                dots[r] = dot4_add(i ? dots[r] : _mm256_setzero_si256(), magnitude,
                                   _mm256_sign_epi8(_mm256_set1_epi32(four), w));
#else
                __m256i sums = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(four), w)), ones);
                dots[r] = i ? _mm256_add_epi32(dots[r], sums) : sums;
#endif
            }
        }
        for (int r = 0; r < ROWS; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]),
                                     _mm256_mul_ps(d, _mm256_set1_ps(x->scale[(row + r) * blocks + b])), acc[r]);
    }
    for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(out + r * n, acc[r]);
}

#if LOCKSTEP_AVX512
/* 32 bytes at `first` (group g) and at `second` (group g + 1) as one vector: 16 columns' bytes. */
static inline __m512i two_groups(const uint8_t *first, const uint8_t *second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)first)),
                              _mm256_loadu_si256((const __m256i *)second), 1);
}

/* 8 fp16 at `first` and 8 at `second` as 16 floats (two groups' scales or minimums). */
static inline __m512 two_groups_half(const uint8_t *first, const uint8_t *second) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)first)),
                                                   _mm_loadu_si128((const __m128i *)second), 1));
}

/* 8 bytes at `first` and 8 at `second` as 16 floats (two groups' Q4_K_X8 scales or minimums). */
static inline __m512 two_groups_bytes(const uint8_t *first, const uint8_t *second) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)first), _mm_loadl_epi64((const __m128i *)second))));
}

/* x8_scales of block b of two adjacent groups (`group` and `group` + group_bytes): lane by lane the same floats. */
static inline __attribute__((always_inline)) void x16_scales(const uint8_t *group, int64_t group_bytes, int64_t b,
                                                             __m512 *d, __m512 *m, const int FORMAT) {
    const uint8_t *g, *h;
    if (FORMAT == FORMAT_Q6_K_X8) { /* d[v], m[v] for each 16 values v, as x8_scales */
        g = group + b / 8 * Q6_K_X8_GROUP_BYTES, h = g + group_bytes;
        const __m512 whole = two_groups_half(g, h);
        for (int v = 0; v < 2; v++) {
            const int64_t at = Q6_K_X8_SCALES + 8 * (2 * (b % 8) + v);
            const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(g + at)),
                                                     _mm_loadl_epi64((const __m128i *)(h + at)));
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
            d[v] = _mm512_mul_ps(whole, sc);
            m[v] = _mm512_mul_ps(d[v], _mm512_set1_ps(-32.0f));
        }
        return;
    }
    if (FORMAT == FORMAT_Q4_K_X8) {
        g = group + b / 8 * Q4_K_X8_GROUP_BYTES, h = g + group_bytes;
        const int64_t scales = Q4_K_X8_SCALES + 8 * (b % 8), minimums = Q4_K_X8_MINIMUMS + 8 * (b % 8);
        *d = _mm512_mul_ps(two_groups_half(g, h), two_groups_bytes(g + scales, h + scales));
        const __m512 dmin = two_groups_half(g + 16, h + 16), m_bytes = two_groups_bytes(g + minimums, h + minimums);
        *m = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, m_bytes)), _mm512_set1_epi32((int)0x80000000u)));
        return;
    }
    g = group + b * x8_block_bytes(FORMAT), h = g + group_bytes;
    *d = two_groups_half(g, h);
    if (FORMAT == FORMAT_Q4_0_X8) *m = _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f));
    else if (FORMAT == FORMAT_Q8_0_X8) *m = _mm512_setzero_ps();
    else *m = two_groups_half(g + 16, h + 16);
}

#define X8_ROWS16 8 /* rows of an 8-bit 16-column tile: 32 registers hold 8 rows' sums and accumulators */
/* From this many rows on, the 8-bit matmuls take the 16-column tiles; fewer take the 8-column ones, the same bits
 * (on Zen 5 a step's 8-bit matmuls at 1 / 4 rows 9-25% / 3-20% faster over several A/B runs; on Sapphire Rapids
 * the 16-column tiles had gained 2% at one row). */
#define X8_WIDE_ROWS 5
/* How far ahead (bytes) of its block an 8-bit 16-column tile fetches its two groups' blocks: its two streams,
 * unlike the 8-column tile's one, left the hardware prefetcher behind (Zen 5, Q4_1: 8 / 16 rows 8-14% / 8-10%
 * faster, half as far ahead a little slower; Q8_0, the lm_head: 5 to 8 rows 3-6% faster; not inlined, the
 * fetches cost more than they saved). */
#define X8_PREFETCH_BYTES 2560
static inline __attribute__((always_inline)) void prefetch_two_groups(const uint8_t *g, const uint8_t *h,
                                                                      const int BYTES) {
    for (int line = 0; line < BYTES; line += 64) {
        _mm_prefetch((const char *)g + X8_PREFETCH_BYTES + line, _MM_HINT_T0);
        _mm_prefetch((const char *)h + X8_PREFETCH_BYTES + line, _MM_HINT_T0);
    }
}
/* x8_tile on two adjacent groups (16 columns) at once: per lane the same integer dot product and the same float
 * operations in the same order, so each output is x8_tile's bits. */
static inline __attribute__((always_inline)) void x8_tile16(const struct quantized_x *x, int64_t row,
                                                            const uint8_t *group, int64_t group_bytes, float *out,
                                                            int64_t n, const int FORMAT, const int ROWS) {
    const int64_t blocks = x->k / BLOCK, stride = x8_block_bytes(FORMAT);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[X8_ROWS16], minimum[X8_ROWS16];
    for (int r = 0; r < ROWS; r++) acc[r] = minimum[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT);
        prefetch_two_groups(group + b * stride, group + group_bytes + b * stride, X8_GROUP_BYTES);
        __m512 d[2], m[2];
        x16_scales(group, group_bytes, b, d, m, FORMAT);
        __m512i dots[X8_ROWS16];
        for (int i = 0; i < 4; i++) {
            __m512i packed = two_groups(q + 32 * i, q + group_bytes + 32 * i);
            __m512i low = _mm512_and_si512(packed, nibble);
            __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            for (int r = 0; r < ROWS; r++) {
                int32_t first, second; /* activations 4i..4i+3 and 16+4i..16+4i+3 of this block */
                memcpy(&first, x->q + (row + r) * x->k + b * BLOCK + 4 * i, 4);
                memcpy(&second, x->q + (row + r) * x->k + b * BLOCK + 16 + 4 * i, 4);
#if defined(__AVX512VNNI__)
                __m512i sums = _mm512_dpbusd_epi32(i ? dots[r] : _mm512_setzero_si512(), low, _mm512_set1_epi32(first));
                dots[r] = _mm512_dpbusd_epi32(sums, high, _mm512_set1_epi32(second));
#else
                __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(low, _mm512_set1_epi32(first)),
                                                 _mm512_maddubs_epi16(high, _mm512_set1_epi32(second)));
                dots[r] = i ? _mm512_add_epi16(dots[r], pairs) : pairs;
#endif
            }
        }
        for (int r = 0; r < ROWS; r++) {
#if defined(__AVX512VNNI__)
            __m512 dot = _mm512_cvtepi32_ps(dots[r]);
#else
            __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(dots[r], _mm512_set1_epi16(1)));
#endif
            const __m512 dx = _mm512_set1_ps(x->scale[(row + r) * blocks + b]);
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d[0], dx), acc[r]);
            minimum[r] = _mm512_fmadd_ps(m[0], _mm512_set1_ps(x->sum[b * x->m8 + row + r]), minimum[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out + r * n, _mm512_add_ps(acc[r], minimum[r]));
}

/* q6_x8_tile on two adjacent groups (16 columns) at once, lane by lane its integers and float operations: its
 * bits. */
static inline __attribute__((always_inline)) void q6_x8_tile16(const struct quantized_x *x, int64_t row,
                                                               const uint8_t *group, int64_t group_bytes, float *out,
                                                               int64_t n, const int ROWS) {
    const int64_t blocks = x->k / BLOCK, stride = x8_block_bytes(FORMAT_Q6_K_X8);
    const __m512i nibble = _mm512_set1_epi8(0x0F), mask = _mm512_set1_epi8(0x30);
    __m512 acc[X8_ROWS16];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT_Q6_K_X8);
        prefetch_two_groups(group + b * stride, group + group_bytes + b * stride, Q6_K_X8_BLOCK_BYTES);
        __m512 d[2], m[2];
        x16_scales(group, group_bytes, b, d, m, FORMAT_Q6_K_X8);
        const __m512i planes[2] = {two_groups(q + 128, q + group_bytes + 128),
                                   two_groups(q + 160, q + group_bytes + 160)};
        __m512i dots[X8_ROWS16][2];
#if !defined(__AVX512VNNI__)
        __m512i pairs[X8_ROWS16][2];
#endif
        UNROLLED
        for (int i = 0; i < 4; i++) {
            __m512i packed = two_groups(q + 32 * i, q + group_bytes + 32 * i), w[2];
            for (int v = 0; v < 2; v++) { /* q6_high_bits, 16 columns */
                __m512i high = i == 0 ? _mm512_slli_epi16(planes[v], 4) : i == 1 ? _mm512_slli_epi16(planes[v], 2)
                             : i == 2 ? planes[v] : _mm512_srli_epi16(planes[v], 2);
                __m512i low = _mm512_and_si512(v ? _mm512_srli_epi16(packed, 4) : packed, nibble);
                w[v] = _mm512_or_si512(low, _mm512_and_si512(high, mask));
            }
            for (int r = 0; r < ROWS; r++)
                for (int v = 0; v < 2; v++) {
                    int32_t four;
                    memcpy(&four, x->q + (row + r) * x->k + b * BLOCK + 16 * v + 4 * i, 4);
#if defined(__AVX512VNNI__)
                    dots[r][v] = _mm512_dpbusd_epi32(i ? dots[r][v] : _mm512_setzero_si512(), w[v],
                                                     _mm512_set1_epi32(four));
#else
                    __m512i two = _mm512_maddubs_epi16(w[v], _mm512_set1_epi32(four));
                    if (i % 2 == 0) {
                        pairs[r][v] = two;
                    } else {
                        __m512i sums = _mm512_madd_epi16(_mm512_add_epi16(pairs[r][v], two), _mm512_set1_epi16(1));
                        dots[r][v] = i == 1 ? sums : _mm512_add_epi32(dots[r][v], sums);
                    }
#endif
                }
        }
        for (int r = 0; r < ROWS; r++) {
            const __m512 dx = _mm512_set1_ps(x->scale[(row + r) * blocks + b]);
            for (int v = 0; v < 2; v++) {
                const int32_t sum = 32 * x->half_sum[(row + r) * 2 * blocks + 2 * b + v];
                __m512i whole = _mm512_sub_epi32(dots[r][v], _mm512_set1_epi32(sum));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole), _mm512_mul_ps(d[v], dx), acc[r]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

/* q8_x8_tile on two adjacent groups (16 columns) at once, lane by lane its operations: its bits. */
static inline __attribute__((always_inline)) void q8_x8_tile16(const struct quantized_x *x, int64_t row,
                                                               const uint8_t *group, int64_t group_bytes, float *out,
                                                               int64_t n, const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    __m512 acc[4];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *g = group + b * Q8_X8_GROUP_BYTES, *h = g + group_bytes;
        prefetch_two_groups(g, h, Q8_X8_GROUP_BYTES);
        __m512 d = two_groups_half(g, h);
        __m512i dots[4];
        for (int i = 0; i < 8; i++) {
            __m512i w = two_groups(g + 16 + 32 * i, h + 16 + 32 * i);
            __mmask64 negative = _mm512_movepi8_mask(w);
            __m512i magnitude = _mm512_abs_epi8(w);
            for (int r = 0; r < ROWS; r++) {
                int32_t four; /* activations 4i..4i+3 of this block, negated where w is negative (as sign_epi8;
                               * where w is zero, |w| is) */
                memcpy(&four, x->q + (row + r) * x->k + b * BLOCK + 4 * i, 4);
                __m512i xs = _mm512_set1_epi32(four);
                xs = _mm512_mask_sub_epi8(xs, negative, _mm512_setzero_si512(), xs);
#if defined(__AVX512VNNI__)
                dots[r] = _mm512_dpbusd_epi32(i ? dots[r] : _mm512_setzero_si512(), magnitude, xs);
#else
                __m512i sums = _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, xs), _mm512_set1_epi16(1));
                dots[r] = i ? _mm512_add_epi32(dots[r], sums) : sums;
#endif
            }
        }
        for (int r = 0; r < ROWS; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(x->scale[(row + r) * blocks + b])), acc[r]);
    }
    for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}
#endif

/* From this many rows on, a call dequantizes its columns once into a panel, a slice of K at a time. AVX-512 took
 * 9 before the slices; with them, on Zen 5, a panel beat its 4-row tiles straight from the blocks from 3 rows on
 * (4 rows -9%, 8 rows -30%). */
#define EXACT_PANEL_ROWS 3
/* Blocks of K a panel holds (AVX-512's 32 columns: 16 KB, AVX2's 16: 8 KB; it stays in L1 between its row tiles,
 * where a whole K's panel, 37-196 KB, was written to L2 and read back per tile). 2 and 8 were no faster. */
#define SLICE_BLOCKS 4
#define EXACT_ROW_TILE 6 /* rows of a float32-activation tile: 12 accumulators, as a float GEMM's 6 x 16 */

/* Position p's weights of 8 columns from a group's block whose quantized weights are at `quants` (x8_quants), as
 * gguf-py dequantizes them (d * q + m in one FMA: d * q is exact in float32, so it rounds as gguf-py's multiply,
 * then add). 4-bit formats: vector (p % 16) / 4, byte p % 4 of each column, its high nibble for p >= 16; Q8_0:
 * vector p / 4, byte p % 4. */
static inline __attribute__((always_inline)) __m256 x8_weights(const uint8_t *quants, int position, const __m256 *ds,
                                                               const __m256 *ms, const int FORMAT) {
    const int half = FORMAT == FORMAT_Q6_K_X8 ? position / 16 : 0; /* Q6_K_X8: its 16 values' d and m */
    const __m256 d = ds[half], m = ms[half];
    if (FORMAT == FORMAT_Q6_K_X8) { /* the nibble as below, then the high bits from the plane of its half */
        __m256i packed = _mm256_loadu_si256((const __m256i *)(quants + 32 * (position % 16 / 4)));
        __m256i plane = _mm256_loadu_si256((const __m256i *)(quants + 128 + 32 * (position / 16)));
        __m256i low = _mm256_and_si256(_mm256_srli_epi32(packed, 8 * (position % 4) + 4 * (position / 16)),
                                       _mm256_set1_epi32(0x0F));
        __m256i high = _mm256_and_si256(_mm256_srli_epi32(plane, 8 * (position % 4) + 2 * (position % 16 / 4)),
                                        _mm256_set1_epi32(3));
        __m256i q = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
        return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    }
    if (FORMAT != FORMAT_Q8_0_X8) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(quants + 32 * (position % 16 / 4)));
        __m256i q = _mm256_and_si256(_mm256_srli_epi32(packed, 8 * (position % 4) + 4 * (position / 16)),
                                     _mm256_set1_epi32(0x0F));
        return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    }
    __m256i packed = _mm256_loadu_si256((const __m256i *)(quants + 32 * (position / 4)));
    __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(packed, 24 - 8 * (position % 4)), 24);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
}

/* Blocks [from, to) of GROUPS groups of 8 columns of an interleaved weight dequantized into `panel`
 * [to - from][BLOCK][GROUPS][8] floats. */
static inline __attribute__((always_inline)) void dequantize_panel(const uint8_t *group, int64_t group_bytes,
                                                                   int64_t from, int64_t to, float *panel,
                                                                   const int FORMAT, const int GROUPS) {
    for (int64_t b = from; b < to; b++)
        for (int g = 0; g < GROUPS; g++) {
            __m256 d[2], m[2];
            x8_scales(group + g * group_bytes, b, d, m, FORMAT);
            const uint8_t *q = x8_quants(group + g * group_bytes, b, FORMAT);
            UNROLLED
            for (int position = 0; position < BLOCK; position++)
                _mm256_store_ps(panel + (((b - from) * BLOCK + position) * GROUPS + g) * 8,
                                x8_weights(q, position, d, m, FORMAT));
        }
}

/* ROWS rows x GROUPS groups of 8 columns over blocks [from, to) of a dequantized panel, going on from the sums
 * `out` holds (from > 0): per position, each group's 8 weights, then per row one broadcast activation and one FMA
 * per group into that output's accumulator. Each output is one chain of FMAs over K in order whatever ROWS, GROUPS
 * and slices: the float32 dequantized matmul, summed in order. */
static inline __attribute__((always_inline)) void exact_panel_tile(const struct quantized_x *x, int64_t row,
                                                                   const float *panel, int64_t from, int64_t to,
                                                                   float *out, int64_t n, const int ROWS,
                                                                   const int GROUPS) {
    __m256 acc[2][EXACT_ROW_TILE]; /* fixed sizes: constant indices keep them in registers */
    UNROLLED
    for (int g = 0; g < GROUPS; g++)
        UNROLLED
        for (int r = 0; r < ROWS; r++) acc[g][r] = from ? _mm256_loadu_ps(out + r * n + 8 * g) : _mm256_setzero_ps();
    for (int64_t b = from; b < to; b++) {
        const float *xs = x->xf + row * x->k + b * BLOCK, *ws = panel + (b - from) * BLOCK * GROUPS * 8;
        _Pragma("GCC unroll 4") /* positions index only memory: fully unrolled, the code is slower to build */
        for (int position = 0; position < BLOCK; position++) {
            __m256 w[2];
            UNROLLED
            for (int g = 0; g < GROUPS; g++) w[g] = _mm256_load_ps(ws + (position * GROUPS + g) * 8);
            UNROLLED
            for (int r = 0; r < ROWS; r++) {
                __m256 activation = _mm256_broadcast_ss(xs + r * x->k + position);
                UNROLLED
                for (int g = 0; g < GROUPS; g++) acc[g][r] = _mm256_fmadd_ps(w[g], activation, acc[g][r]);
            }
        }
    }
    UNROLLED
    for (int g = 0; g < GROUPS; g++)
        UNROLLED
        for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(out + r * n + 8 * g, acc[g][r]);
}

/* A lone row x GROUPS groups of 8 columns straight from the blocks (a panel would cost more than it saves): the
 * same weights (x8_weights, as dequantize_panel) and the same chain of FMAs per output as exact_panel_tile. */
static inline __attribute__((always_inline)) void exact_row_tile(const struct quantized_x *x, int64_t row,
                                                                 const uint8_t *group, int64_t group_bytes,
                                                                 float *out, const int FORMAT, const int GROUPS) {
    __m256 acc[4];
    UNROLLED
    for (int g = 0; g < GROUPS; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x->k / BLOCK; b++) {
        const float *xs = x->xf + row * x->k + b * BLOCK;
        __m256 d[4][2], m[4][2];
        const uint8_t *q[4];
        UNROLLED
        for (int g = 0; g < GROUPS; g++) {
            x8_scales(group + g * group_bytes, b, d[g], m[g], FORMAT);
            q[g] = x8_quants(group + g * group_bytes, b, FORMAT);
        }
        UNROLLED
        for (int position = 0; position < BLOCK; position++) {
            __m256 activation = _mm256_broadcast_ss(xs + position);
            UNROLLED
            for (int g = 0; g < GROUPS; g++)
                acc[g] = _mm256_fmadd_ps(x8_weights(q[g], position, d[g], m[g], FORMAT), activation, acc[g]);
        }
    }
    UNROLLED
    for (int g = 0; g < GROUPS; g++) _mm256_storeu_ps(out + 8 * g, acc[g]);
}

#if LOCKSTEP_AVX512
/* Block b of two adjacent groups (16 columns) as x8_weights reads it: d, m (zero for Q8_0; Q6_K_X8: per 16 values)
 * and the packed vectors (4-bit formats: 4, Q8_0: 8, Q6_K_X8: 4 and its 2 planes), each lane the column's bytes of
 * x8_weights' vector. */
static inline __attribute__((always_inline)) void x16_block(const uint8_t *group, int64_t group_bytes, int64_t b,
                                                            __m512i packed[8], __m512 *d, __m512 *m, const int FORMAT) {
    const uint8_t *q = x8_quants(group, b, FORMAT);
    x16_scales(group, group_bytes, b, d, m, FORMAT);
    if (FORMAT == FORMAT_Q8_0_X8) {
        UNROLLED
        for (int i = 0; i < 8; i++) packed[i] = two_groups(q + 32 * i, q + group_bytes + 32 * i);
    } else if (FORMAT == FORMAT_Q6_K_X8) { /* 4 vectors of nibbles, then the 2 planes of high bits */
        UNROLLED
        for (int i = 0; i < 6; i++) packed[i] = two_groups(q + 32 * i, q + group_bytes + 32 * i);
    } else {
        UNROLLED
        for (int i = 0; i < 4; i++) packed[i] = two_groups(q + 32 * i, q + group_bytes + 32 * i);
    }
}

/* Position p's weights of those 16 columns: x8_weights' operations lane by lane (d * q + m in one FMA for the 4-bit
 * formats, d * q for Q8_0), so the same floats. */
static inline __attribute__((always_inline)) __m512 x16_weights(const __m512i packed[8], int position, const __m512 *ds,
                                                                const __m512 *ms, const int FORMAT) {
    const int half = FORMAT == FORMAT_Q6_K_X8 ? position / 16 : 0;
    const __m512 d = ds[half], m = ms[half];
    if (FORMAT == FORMAT_Q6_K_X8) {
        const int shift = 8 * (position % 4) + 4 * (position / 16), high = 8 * (position % 4) + 2 * (position % 16 / 4);
        __m512i low = _mm512_and_si512(_mm512_srli_epi32(packed[position % 16 / 4], shift), _mm512_set1_epi32(0x0F));
        __m512i bits = _mm512_and_si512(_mm512_srli_epi32(packed[4 + position / 16], high), _mm512_set1_epi32(3));
        __m512i q = _mm512_or_si512(low, _mm512_slli_epi32(bits, 4));
        return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
    }
    if (FORMAT != FORMAT_Q8_0_X8) {
        const int shift = 8 * (position % 4) + 4 * (position / 16);
        __m512i q = _mm512_and_si512(_mm512_srli_epi32(packed[position % 16 / 4], shift), _mm512_set1_epi32(0x0F));
        return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
    }
    __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(packed[position / 4], 24 - 8 * (position % 4)), 24);
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
}

/* ROWS rows (1 to 4) x PAIRS pairs of groups (16 or 32 columns) straight from the blocks, positions fully
 * unrolled: per output the same weights and the same chain of FMAs over K in order as exact_row_tile, so its
 * bits; the rows share each position's weights. */
static inline __attribute__((always_inline)) void exact_row_tile16(const struct quantized_x *x, int64_t row,
                                                                   const uint8_t *group, int64_t group_bytes,
                                                                   float *out, int64_t n, const int FORMAT,
                                                                   const int ROWS, const int PAIRS) {
    __m512 acc[4][2];
    UNROLLED
    for (int r = 0; r < ROWS; r++)
        UNROLLED
        for (int p = 0; p < PAIRS; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x->k / BLOCK; b++) {
        const float *xs = x->xf + row * x->k + b * BLOCK;
        __m512i packed[2][8];
        __m512 d[2][2], m[2][2];
        UNROLLED
        for (int p = 0; p < PAIRS; p++)
            x16_block(group + 2 * p * group_bytes, group_bytes, b, packed[p], d[p], m[p], FORMAT);
        UNROLLED
        for (int position = 0; position < BLOCK; position++)
            UNROLLED
            for (int p = 0; p < PAIRS; p++) {
                __m512 w = x16_weights(packed[p], position, d[p], m[p], FORMAT);
                UNROLLED
                for (int r = 0; r < ROWS; r++)
                    acc[r][p] = _mm512_fmadd_ps(w, _mm512_set1_ps(xs[r * x->k + position]), acc[r][p]);
            }
    }
    UNROLLED
    for (int r = 0; r < ROWS; r++)
        UNROLLED
        for (int p = 0; p < PAIRS; p++) _mm512_storeu_ps(out + r * n + 16 * p, acc[r][p]);
}

/* dequantize_panel of PAIRS pairs of groups: the same floats, laid out [K][PAIRS][16]. */
static inline __attribute__((always_inline)) void dequantize_panel16(const uint8_t *group, int64_t group_bytes,
                                                                     int64_t from, int64_t to, float *panel,
                                                                     const int FORMAT, const int PAIRS) {
    for (int64_t b = from; b < to; b++)
        UNROLLED
        for (int p = 0; p < PAIRS; p++) {
            __m512i packed[8];
            __m512 d[2], m[2];
            x16_block(group + 2 * p * group_bytes, group_bytes, b, packed, d, m, FORMAT);
            UNROLLED
            for (int position = 0; position < BLOCK; position++)
                _mm512_store_ps(panel + (((b - from) * BLOCK + position) * PAIRS + p) * 16,
                                x16_weights(packed, position, d, m, FORMAT));
        }
}

/* Rows of a tile over a 32-column panel: 16 accumulators of AVX-512's 32 registers, each broadcast feeding two
 * FMAs (a 16-column panel's 6-row tiles took one load per FMA; on Zen 5 a step's exact matmuls at 16 rows took
 * -18%, at 64 rows -20%; 12-row tiles were slower at 160 rows). */
#define EXACT_ROW_TILE16 8
/* exact_panel_tile over a panel of PAIRS pairs of groups: per position one load per pair, then per row one
 * broadcast and one FMA per pair into that output's accumulator; the same chain per output. */
static inline __attribute__((always_inline)) void exact_panel_tile16(const struct quantized_x *x, int64_t row,
                                                                     const float *panel, int64_t from, int64_t to,
                                                                     float *out, int64_t n, const int ROWS,
                                                                     const int PAIRS) {
    __m512 acc[EXACT_ROW_TILE16][2];
    UNROLLED
    for (int r = 0; r < ROWS; r++)
        UNROLLED
        for (int p = 0; p < PAIRS; p++)
            acc[r][p] = from ? _mm512_loadu_ps(out + r * n + 16 * p) : _mm512_setzero_ps();
    for (int64_t b = from; b < to; b++) {
        const float *xs = x->xf + row * x->k + b * BLOCK, *ws = panel + (b - from) * BLOCK * PAIRS * 16;
        _Pragma("GCC unroll 4")
        for (int position = 0; position < BLOCK; position++) {
            __m512 w[2];
            UNROLLED
            for (int p = 0; p < PAIRS; p++) w[p] = _mm512_load_ps(ws + (position * PAIRS + p) * 16);
            UNROLLED
            for (int r = 0; r < ROWS; r++) {
                const __m512 activation = _mm512_set1_ps(xs[r * x->k + position]);
                UNROLLED
                for (int p = 0; p < PAIRS; p++) acc[r][p] = _mm512_fmadd_ps(w[p], activation, acc[r][p]);
            }
        }
    }
    UNROLLED
    for (int r = 0; r < ROWS; r++)
        UNROLLED
        for (int p = 0; p < PAIRS; p++) _mm512_storeu_ps(out + r * n + 16 * p, acc[r][p]);
}

typedef void (*rows16_fn)(const struct quantized_x *, int64_t, const uint8_t *, int64_t, float *, int64_t);
#define ROW_TILE16_FN(F, R, P)                                                                                      \
    static void row_tile16_##F##_##R##_##P(const struct quantized_x *x, int64_t row, const uint8_t *group,         \
                                           int64_t group_bytes, float *out, int64_t n) {                            \
        exact_row_tile16(x, row, group, group_bytes, out, n, F, R, P);                                              \
    }
#define ROW_TILES16_FN(F) ROW_TILE16_FN(F, 1, 1) ROW_TILE16_FN(F, 1, 2) ROW_TILE16_FN(F, 2, 1) ROW_TILE16_FN(F, 2, 2) \
    ROW_TILE16_FN(F, 3, 1) ROW_TILE16_FN(F, 3, 2) ROW_TILE16_FN(F, 4, 1) ROW_TILE16_FN(F, 4, 2)
ROW_TILES16_FN(FORMAT_Q4_1_X8) ROW_TILES16_FN(FORMAT_Q8_0_X8) ROW_TILES16_FN(FORMAT_Q4_0_X8)
ROW_TILES16_FN(FORMAT_Q4_K_X8) ROW_TILES16_FN(FORMAT_Q6_K_X8)
#define ROW_TILES16_OF(F)                                                                                           \
    {{0}, {0, row_tile16_##F##_1_1, row_tile16_##F##_1_2}, {0, row_tile16_##F##_2_1, row_tile16_##F##_2_2},         \
     {0, row_tile16_##F##_3_1, row_tile16_##F##_3_2}, {0, row_tile16_##F##_4_1, row_tile16_##F##_4_2}}
/* By format (X8_KIND), rows (1 to EXACT_ROWS16) and pairs of groups (1, 2). */
#define EXACT_ROWS16 4
static const rows16_fn ROW_TILES16[X8_KINDS][EXACT_ROWS16 + 1][3] = {
    ROW_TILES16_OF(FORMAT_Q4_1_X8), ROW_TILES16_OF(FORMAT_Q8_0_X8), ROW_TILES16_OF(FORMAT_Q4_0_X8),
    ROW_TILES16_OF(FORMAT_Q4_K_X8), ROW_TILES16_OF(FORMAT_Q6_K_X8)};
#define PANEL_TILE16(R, P)                                                                                          \
    static void panel_tile16_##R##_##P(const struct quantized_x *x, int64_t row, const float *panel, int64_t from, \
                                       int64_t to, float *out, int64_t n) {                                         \
        exact_panel_tile16(x, row, panel, from, to, out, n, R, P);                                                  \
    }
PANEL_TILE16(3, 1) PANEL_TILE16(4, 1) PANEL_TILE16(5, 1) PANEL_TILE16(6, 1) PANEL_TILE16(7, 1) PANEL_TILE16(8, 1)
PANEL_TILE16(3, 2) PANEL_TILE16(4, 2) PANEL_TILE16(5, 2) PANEL_TILE16(6, 2) PANEL_TILE16(7, 2) PANEL_TILE16(8, 2)
#endif

typedef void (*row_fn)(const struct quantized_x *, int64_t, const uint8_t *, int64_t, float *);
#define ROW_TILE_FN(F, G)                                                                                           \
    static void row_tile_##F##_##G(const struct quantized_x *x, int64_t row, const uint8_t *group,                 \
                                   int64_t group_bytes, float *out) {                                               \
        exact_row_tile(x, row, group, group_bytes, out, F, G);                                                      \
    }
#define ROW_TILES_FN(F) ROW_TILE_FN(F, 1) ROW_TILE_FN(F, 2) ROW_TILE_FN(F, 4)
ROW_TILES_FN(FORMAT_Q4_1_X8) ROW_TILES_FN(FORMAT_Q8_0_X8) ROW_TILES_FN(FORMAT_Q4_0_X8) ROW_TILES_FN(FORMAT_Q4_K_X8)
ROW_TILES_FN(FORMAT_Q6_K_X8)
#define ROW_TILES_OF(F) {0, row_tile_##F##_1, row_tile_##F##_2, 0, row_tile_##F##_4}
/* By format (X8_KIND) and groups (1, 2, 4). */
static const row_fn ROW_TILES[X8_KINDS][5] = {ROW_TILES_OF(FORMAT_Q4_1_X8), ROW_TILES_OF(FORMAT_Q8_0_X8),
                                              ROW_TILES_OF(FORMAT_Q4_0_X8), ROW_TILES_OF(FORMAT_Q4_K_X8),
                                              ROW_TILES_OF(FORMAT_Q6_K_X8)};

typedef void (*panel_fn)(const struct quantized_x *, int64_t, const float *, int64_t, int64_t, float *, int64_t);
#define PANEL_TILE(R, G)                                                                                            \
    static void panel_tile_##R##_##G(const struct quantized_x *x, int64_t row, const float *panel, int64_t from,   \
                                     int64_t to, float *out, int64_t n) {                                           \
        exact_panel_tile(x, row, panel, from, to, out, n, R, G);                                                    \
    }
PANEL_TILE(3, 1) PANEL_TILE(4, 1) PANEL_TILE(5, 1) PANEL_TILE(6, 1)
#if !LOCKSTEP_AVX512 /* AVX-512 computes a two-group panel 16 lanes at a time (panel_tile16) */
PANEL_TILE(3, 2) PANEL_TILE(4, 2) PANEL_TILE(5, 2) PANEL_TILE(6, 2)
#endif
#if LOCKSTEP_AVX512
/* A lone group (a unit's last 8 columns) by rows; wider panels go by PANEL_TILES16. */
static const panel_fn PANEL_TILES[2][EXACT_ROW_TILE + 1] = {
    {0}, {0, 0, 0, panel_tile_3_1, panel_tile_4_1, panel_tile_5_1, panel_tile_6_1}};
/* By pairs of groups (16 or 32 columns) and rows (a tile has EXACT_PANEL_ROWS to EXACT_ROW_TILE16). */
static const panel_fn PANEL_TILES16[3][EXACT_ROW_TILE16 + 1] = {
    {0},
    {0, 0, 0, panel_tile16_3_1, panel_tile16_4_1, panel_tile16_5_1, panel_tile16_6_1, panel_tile16_7_1,
     panel_tile16_8_1},
    {0, 0, 0, panel_tile16_3_2, panel_tile16_4_2, panel_tile16_5_2, panel_tile16_6_2, panel_tile16_7_2,
     panel_tile16_8_2}};
#else
/* By groups of 8 columns (two, or one at a unit's end) and rows (a tile has EXACT_PANEL_ROWS to EXACT_ROW_TILE). */
static const panel_fn PANEL_TILES[3][EXACT_ROW_TILE + 1] = {
    {0},
    {0, 0, 0, panel_tile_3_1, panel_tile_4_1, panel_tile_5_1, panel_tile_6_1},
    {0, 0, 0, panel_tile_3_2, panel_tile_4_2, panel_tile_5_2, panel_tile_6_2}};
#endif

/* Blocks [from, to) of `groups` adjacent groups (1 or 2; on AVX-512 also 4) into `panel`, in the layout their
 * tiles read (PANEL_TILES; on AVX-512, pairs of groups: PANEL_TILES16). */
static void dequantize_slice(const uint8_t *group, int64_t group_bytes, int64_t from, int64_t to, float *panel,
                             int format, int groups) {
#if LOCKSTEP_AVX512
#define PANEL16(F)                                                                                                  \
    do {                                                                                                            \
        if (groups == 4) dequantize_panel16(group, group_bytes, from, to, panel, F, 2);                             \
        else dequantize_panel16(group, group_bytes, from, to, panel, F, 1);                                         \
    } while (0)
    if (groups > 1) {
        BY_FORMAT(format, PANEL16);
        return;
    }
#endif
#define PANEL(F)                                                                                                    \
    do {                                                                                                            \
        if (groups == 2) dequantize_panel(group, group_bytes, from, to, panel, F, 2);                               \
        else dequantize_panel(group, group_bytes, from, to, panel, F, 1);                                           \
    } while (0)
    BY_FORMAT(format, PANEL);
}

/* Blocks [from, to) of `groups` adjacent groups into L1: the slice after the one the tiles compute on. */
static void prefetch_slice(const uint8_t *group, int64_t group_bytes, int64_t from, int64_t to, int format,
                           int groups) {
    const int64_t bytes = x8_block_bytes(format);
    for (int g = 0; g < groups; g++)
        for (int64_t offset = from * bytes; offset < to * bytes; offset += 64)
            _mm_prefetch((const char *)group + g * group_bytes + offset, _MM_HINT_T0);
}

/* Columns [c, c + 8 * groups) over every row, K a slice of SLICE_BLOCKS at a time: the slice dequantized into an
 * L1 panel, then every row tile goes on from the sums the last slice left in `out`, so each output is still one
 * chain of FMAs over K in order. The next slice's blocks (or the next columns' first) are fetched while the tiles
 * compute (faster than whole-K panels on AVX-512 and AVX2 alike: docs/benchmarks.md). */
static void exact_panel_columns(const struct quantized_x *x, const uint8_t *weight, int format, int64_t group_bytes,
                                float *panel, float *out, int64_t n, int64_t c, int groups, int64_t last) {
    const int64_t blocks = x->k / BLOCK;
    const uint8_t *group = weight + c / 8 * group_bytes;
#if LOCKSTEP_AVX512
    const int64_t row_tile = groups > 1 ? EXACT_ROW_TILE16 : EXACT_ROW_TILE;
    const panel_fn *tiles = groups > 1 ? PANEL_TILES16[groups / 2] : PANEL_TILES[groups];
#else
    const int64_t row_tile = EXACT_ROW_TILE;
    const panel_fn *tiles = PANEL_TILES[groups];
#endif
    for (int64_t from = 0; from < blocks; from += SLICE_BLOCKS) {
        const int64_t to = from + SLICE_BLOCKS < blocks ? from + SLICE_BLOCKS : blocks;
        dequantize_slice(group, group_bytes, from, to, panel, format, groups);
        if (to < blocks)
            prefetch_slice(group, group_bytes, to, to + SLICE_BLOCKS < blocks ? to + SLICE_BLOCKS : blocks, format,
                           groups);
        else if (c + 8 * groups < last) /* the next columns' first slice */
            prefetch_slice(group + groups * group_bytes, group_bytes, 0, SLICE_BLOCKS < blocks ? SLICE_BLOCKS : blocks,
                           format, (last - c) / 8 - groups < groups ? (int)((last - c) / 8 - groups) : groups);
        for (int64_t r = 0, rows; r < x->m; r += rows) { /* the rows in tiles as even as they come: 8 = 4 + 4 */
            const int64_t tiles_left = (x->m - r + row_tile - 1) / row_tile;
            rows = (x->m - r + tiles_left - 1) / tiles_left;
            tiles[rows](x, r, panel, from, to, out + r * n + c, n);
        }
    }
}

/* Columns [first, last) on float32 activations: from EXACT_PANEL_ROWS rows on, 16 columns at a time (32 on
 * AVX-512) dequantized a slice of K at a time into a panel, then every row over it in tiles; fewer rows (or no
 * memory for a panel) straight from the blocks (on AVX-512 up to 4 rows a tile), with the same bits. */
static void x8_exact_columns(const struct quantized_x *x, const uint8_t *weight, int format, int64_t group_bytes,
                             float *out, int64_t n, int64_t first, int64_t last) {
    const int64_t slice = x->k / BLOCK < SLICE_BLOCKS ? x->k / BLOCK : SLICE_BLOCKS;
    const int max_groups = LOCKSTEP_AVX512 ? 4 : 2;
    float *panel = x->m < EXACT_PANEL_ROWS ? NULL
                                           : thread_panel(slice * BLOCK * max_groups * 8 * (int64_t)sizeof(float));
    if (!panel) {
#if LOCKSTEP_AVX512
        for (int64_t r = 0, rows; r < x->m; r += rows) {
            rows = x->m - r >= EXACT_ROWS16 ? EXACT_ROWS16 : x->m - r;
            int64_t c = first;
            for (int pairs; last - c >= 16; c += 16 * pairs) {
                pairs = last - c >= 32 ? 2 : 1;
                ROW_TILES16[X8_KIND(format)][rows][pairs](x, r, weight + c / 8 * group_bytes, group_bytes,
                                                          out + r * n + c, n);
            }
            for (int64_t row = r; c < last && row < r + rows; row++) /* the last 8 columns */
                ROW_TILES[X8_KIND(format)][1](x, row, weight + c / 8 * group_bytes, group_bytes, out + row * n + c);
        }
        return;
#endif
        for (int64_t r = 0; r < x->m; r++)
            for (int64_t c = first; c < last;) {
                int groups = 4;
                while (8 * groups > last - c) groups /= 2;
                ROW_TILES[X8_KIND(format)][groups](x, r, weight + c / 8 * group_bytes, group_bytes, out + r * n + c);
                c += 8 * groups;
            }
        return;
    }
    for (int64_t c = first, groups; c < last; c += 8 * groups) {
        groups = last - c >= 8 * max_groups ? max_groups : last - c >= 16 ? 2 : 1;
        exact_panel_columns(x, weight, format, group_bytes, panel, out, n, c, (int)groups, last);
    }
}

/* Columns [first, last) for rows row..row+rows-1 (rows <= ROW_TILE); a lone row takes four columns at a time, so
 * that four chains of FMAs hide each other's latency. */
static void columns_for_rows(const struct quantized_x *x, int64_t row, int64_t rows, const uint8_t *weight,
                             int64_t row_bytes, int format, float *out, int64_t n, int64_t first, int64_t last) {
    static const tile_fn *const ONE_COLUMN[2][2] = {{ONE_COLUMN_0_0, ONE_COLUMN_0_1}, {ONE_COLUMN_1_0, ONE_COLUMN_1_1}};
    static const tile_fn FOUR_COLUMNS[2][2] = {{tile_0_0_4_1, tile_0_1_4_1}, {tile_1_0_4_1, tile_1_1_4_1}};
    const tile_fn *one_column = ONE_COLUMN[x->exact][format];
    const tile_fn four_columns = FOUR_COLUMNS[x->exact][format];
    int64_t c = first;
    if (rows == 1)
        for (; c + 4 <= last; c += 4) four_columns(x, row, weight + c * row_bytes, row_bytes, out + c, n);
    for (; c < last; c++) one_column[rows](x, row, weight + c * row_bytes, row_bytes, out + c, n);
}
#else
typedef uint8_t bytes16 __attribute__((vector_size(16))); /* the compiler's vectors: NEON's, or SSE's */

/* Portable C: the compiler vectorizes each block's loops (NEON on ARM64, SSE/AVX on x86 without AVX2), so they
 * take the format as a constant and hold no branch. A block's 32 weights as integers, low nibbles first (Q8_0:
 * the block's own bytes; Q4_1: unpacked into `unpacked`). */
static inline __attribute__((always_inline)) const int8_t *block_integers(const uint8_t *block, const int FORMAT,
                                                                        int8_t *unpacked) {
    if (FORMAT == FORMAT_Q8_0) return (const int8_t *)(block + 2);
    bytes16 packed, low, high;
    memcpy(&packed, block + 4, sizeof packed);
    low = packed & 0x0F, high = packed >> 4;
    memcpy(unpacked, &low, sizeof low);
    memcpy(unpacked + 16, &high, sizeof high);
    return unpacked;
}

/* Four float lanes in the compiler's vector extension (GCC and Clang: NEON, or SSE): what the loop vectorizer
 * leaves as scalar code here. */
typedef float float4 __attribute__((vector_size(16)));

static inline float4 load4(const float *p) {
    float4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The outputs of one column for a tile's rows (up to ROW_TILE): each block's weights unpacked once for all of
 * them, each row summing its blocks in order, as it does alone. On float32 activations: per block
 * d * sum(q_j * x_j) in eight lanes, as the AVX2 tile sums. */
static inline __attribute__((always_inline)) void exact_outputs(const struct quantized_x *x, int64_t row, int64_t rows,
                                                                const uint8_t *weight_row, const int FORMAT,
                                                                float *out, int64_t n) {
    const int64_t blocks = x->k / BLOCK, bytes = block_bytes(FORMAT);
    float4 lanes[ROW_TILE][2] = {{{0}}};
    float minimum_term[ROW_TILE] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = weight_row + b * bytes;
        int8_t unpacked[BLOCK];
        const int8_t *w = block_integers(block, FORMAT, unpacked);
        float q[BLOCK];
        for (int j = 0; j < BLOCK; j++) q[j] = (float)w[j];
        const float d = half_to_float(read_half(block));
        const float m = FORMAT == FORMAT_Q4_1 ? half_to_float(read_half(block + 2)) : 0;
        for (int64_t r = 0; r < rows; r++) {
            const float *xs = x->xf + (row + r) * x->k + b * BLOCK;
            if (FORMAT == FORMAT_Q4_1) minimum_term[r] += m * x->sum[b * x->m8 + row + r];
            for (int half = 0; half < 2; half++) {
                float4 dot = load4(q + 4 * half) * load4(xs + 4 * half);
                for (int part = 1; part < 4; part++)
                    dot += load4(q + 8 * part + 4 * half) * load4(xs + 8 * part + 4 * half);
                lanes[r][half] += d * dot;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float4 *l = lanes[r];
        out[r * n] = ((l[0][0] + l[1][0]) + (l[0][1] + l[1][1])) + ((l[0][2] + l[1][2]) + (l[0][3] + l[1][3])) +
                     minimum_term[r];
    }
}

/* On 8-bit activations: per block the integer dot product of int8 weights and activations (nibbles fit in int8:
 * the compiler's 8-bit dot products, ARM's sdot), times both scales. */
static inline __attribute__((always_inline)) void quantized_outputs(const struct quantized_x *x, int64_t row,
                                                                    int64_t rows, const uint8_t *weight_row,
                                                                    const int FORMAT, float *out, int64_t n) {
    const int64_t blocks = x->k / BLOCK, bytes = block_bytes(FORMAT);
    float total[ROW_TILE] = {0}, minimum_term[ROW_TILE] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = weight_row + b * bytes;
        int8_t unpacked[BLOCK];
        const int8_t *w = block_integers(block, FORMAT, unpacked);
        const float d = half_to_float(read_half(block));
        const float m = FORMAT == FORMAT_Q4_1 ? half_to_float(read_half(block + 2)) : 0;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *xq = x->q + (row + r) * x->k + b * BLOCK;
            int dot = 0;
            for (int j = 0; j < BLOCK; j++) dot += w[j] * xq[j];
            if (FORMAT == FORMAT_Q4_1) minimum_term[r] += m * x->sum[b * x->m8 + row + r];
            total[r] += (float)dot * (d * x->scale[(row + r) * blocks + b]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r * n] = total[r] + minimum_term[r];
}

typedef void (*outputs_fn)(const struct quantized_x *, int64_t, int64_t, const uint8_t *, float *, int64_t);
/* Each kind and format for any rows, and for one row (a decode step of one sequence: its loops over rows gone). */
#define OUTPUTS_OF(KIND, FORMAT)                                                                                      \
    static void KIND##_##FORMAT(const struct quantized_x *x, int64_t row, int64_t rows, const uint8_t *weight_row,  \
                                float *out, int64_t n) {                                                              \
        if (rows == 1)                                                                                                \
            KIND##_outputs(x, row, 1, weight_row, FORMAT, out, n);                                                    \
        else                                                                                                          \
            KIND##_outputs(x, row, rows, weight_row, FORMAT, out, n);                                                 \
    }
OUTPUTS_OF(exact, FORMAT_Q4_1)
OUTPUTS_OF(exact, FORMAT_Q8_0)
OUTPUTS_OF(quantized, FORMAT_Q4_1)
OUTPUTS_OF(quantized, FORMAT_Q8_0)

/* Portable: a column at a time for the tile's rows, specialized for its activations and block format. */
static void columns_for_rows(const struct quantized_x *x, int64_t row, int64_t rows, const uint8_t *weight,
                             int64_t row_bytes, int format, float *out, int64_t n, int64_t first, int64_t last) {
    static const outputs_fn OUTPUTS[2][2] = {{quantized_FORMAT_Q4_1, quantized_FORMAT_Q8_0},
                                             {exact_FORMAT_Q4_1, exact_FORMAT_Q8_0}};
    const outputs_fn outputs = OUTPUTS[x->exact][format];
    for (int64_t c = first; c < last; c++) outputs(x, row, rows, weight + c * row_bytes, out + c, n);
}
#endif

#if LOCKSTEP_AVX2 || LOCKSTEP_NEON
#define X8_TILE(FN, ROWS_LEFT, ...)                                                                                 \
    do {                                                                                                            \
        if ((ROWS_LEFT) == 1) FN(__VA_ARGS__, 1);                                                                   \
        else if ((ROWS_LEFT) == 2) FN(__VA_ARGS__, 2);                                                              \
        else if ((ROWS_LEFT) == 3) FN(__VA_ARGS__, 3);                                                              \
        else FN(__VA_ARGS__, 4);                                                                                    \
    } while (0)

#define X8_TILE8(FN, ROWS_LEFT, ...)                                                                                \
    do {                                                                                                            \
        switch (ROWS_LEFT) {                                                                                        \
        case 1: FN(__VA_ARGS__, 1); break;                                                                          \
        case 2: FN(__VA_ARGS__, 2); break;                                                                          \
        case 3: FN(__VA_ARGS__, 3); break;                                                                          \
        case 4: FN(__VA_ARGS__, 4); break;                                                                          \
        case 5: FN(__VA_ARGS__, 5); break;                                                                          \
        case 6: FN(__VA_ARGS__, 6); break;                                                                          \
        case 7: FN(__VA_ARGS__, 7); break;                                                                          \
        default: FN(__VA_ARGS__, 8);                                                                                \
        }                                                                                                           \
    } while (0)
#endif

#if LOCKSTEP_NEON
/* The NEON tiles: 8 columns in two int32x4 / float32x4 halves, column j in lane j % 4 of half j / 4. The interleaved
 * layout puts 4 weights of 4 columns in 16 bytes, so each lane's sdot multiplies its column's 4 weights by 4
 * activations taken from a lane of the row's block (sdot by element: no broadcast). Per block the integer dot
 * products are whole, then, as in x8_tile on AVX2, acc += dot * (dw * dx) and minimum += mw * sx by fused
 * multiply-adds and out = acc + minimum: the same operations per output, so the same bits as on x86. */
static inline __attribute__((always_inline)) float32x4_t half_scales(const uint8_t *halves, int h) {
    const float16x8_t eight = vld1q_f16((const __fp16 *)halves);
    return h ? vcvt_high_f32_f16(eight) : vcvt_f32_f16(vget_low_f16(eight));
}

/* 8 bytes at p, half h's 4 of them as floats (Q4_K_X8's unpacked scales or minimums). */
static inline __attribute__((always_inline)) float32x4_t byte_scales(const uint8_t *p, int h) {
    const uint16x8_t eight = vmovl_u8(vld1_u8(p));
    return vcvtq_f32_u32(h ? vmovl_high_u16(eight) : vmovl_u16(vget_low_u16(eight)));
}

/* The AVX2 x8_scales' floats for half h (columns 4h..4h+3) of block b of a group (Q6_K_X8: d[v], m[v] for each
 * 16 values v, as there). */
static inline __attribute__((always_inline)) void neon_scales(const uint8_t *group, int64_t b, int h, float32x4_t *d,
                                                              float32x4_t *m, const int FORMAT) {
    if (FORMAT == FORMAT_Q6_K_X8) {
        const uint8_t *g = group + b / 8 * Q6_K_X8_GROUP_BYTES;
        for (int v = 0; v < 2; v++) {
            const int16x8_t eight = vmovl_s8(vld1_s8((const int8_t *)g + Q6_K_X8_SCALES + 8 * (2 * (b % 8) + v)));
            const float32x4_t sc = vcvtq_f32_s32(h ? vmovl_high_s16(eight) : vmovl_s16(vget_low_s16(eight)));
            d[v] = vmulq_f32(half_scales(g, h), sc);
            m[v] = vmulq_n_f32(d[v], -32.0f);
        }
    } else if (FORMAT == FORMAT_Q4_K_X8) {
        const uint8_t *g = group + b / 8 * Q4_K_X8_GROUP_BYTES;
        *d = vmulq_f32(half_scales(g, h), byte_scales(g + Q4_K_X8_SCALES + 8 * (b % 8), h));
        *m = vnegq_f32(vmulq_f32(half_scales(g + 16, h), byte_scales(g + Q4_K_X8_MINIMUMS + 8 * (b % 8), h)));
    } else if (FORMAT == FORMAT_Q4_0_X8) {
        *d = half_scales(group + b * Q4_0_X8_GROUP_BYTES, h);
        *m = vmulq_n_f32(*d, -8.0f);
    } else if (FORMAT == FORMAT_Q8_0_X8) {
        *d = half_scales(group + b * Q8_X8_GROUP_BYTES, h);
        *m = vdupq_n_f32(0);
    } else {
        *d = half_scales(group + b * X8_GROUP_BYTES, h);
        *m = half_scales(group + b * X8_GROUP_BYTES + 16, h);
    }
}

/* The rows' 8-bit activations of block b: bytes 0-15 and 16-31, as lanes of 4 for sdot by element. */
static inline __attribute__((always_inline)) void block_activations(const struct quantized_x *x, int64_t row,
                                                                    int64_t b, int8x16_t xs[4][2], const int ROWS) {
    for (int r = 0; r < ROWS; r++) {
        xs[r][0] = vld1q_s8(x->q + (row + r) * x->k + b * BLOCK);
        xs[r][1] = vld1q_s8(x->q + (row + r) * x->k + b * BLOCK + 16);
    }
}

/* Per 16 bytes of a 4-bit format's nibbles (4 columns): the low nibbles are weights 4i..4i+3, the high ones
 * 16+4i..16+4i+3. */
#define Q4_1_WEIGHTS(I, H)                                                                                          \
    const uint8x16_t packed = vld1q_u8(q + 32 * (I) + 16 * (H));                                                   \
    const int8x16_t low = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F)));                                  \
    const int8x16_t high = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4))
/* Q8_0_X8: vector i holds weights 4i..4i+3 of each column (bytes 0-15: columns 0-3). */
#define Q8_0_WEIGHTS(I, H) const int8x16_t w = vld1q_s8((const int8_t *)q + 32 * (I) + 16 * (H))

#if LOCKSTEP_NEON_DOT
/* lane LANE's 4 activations of XS times each column's 4 weights of W, added to row R's half H: sdot by element */
#define DOT_LANE(R, H, W, XS, LANE) (dots[R][H] = vdotq_laneq_s32(dots[R][H], W, XS, LANE))
#define WIDEN() ((void)0)
#else
/* Without sdot (ARMv8.0), the same whole integers by 16-bit multiply-adds: a half's 4 columns in two int16x8 sums,
 * sums[0] lanes 0-3 column 0's 4 products and 4-7 column 1's, sums[1] columns 2 and 3's; then pairwise into int32
 * (WIDEN) and once more across the two, lane j column j's dot product. A 16-bit lane holds at most 8 Q4_1 products
 * (8 x 15 x 127 = 15,240) or 2 Q8_0 ones (2 x 128 x 127 = 32,512): quantize_block keeps |q| <= 127. A step's matmuls
 * at one row as Cortex-A72 code: 55.5 M instructions, where the portable C took 151.2 M (with sdot: 34.0 M). */
#define DOT_LANE(R, H, W, XS, LANE)                                                                                 \
    do {                                                                                                            \
        const int8x16_t lane = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(XS), LANE));               \
        sums[R][H][0] = vmlal_s8(sums[R][H][0], vget_low_s8(W), vget_low_s8(lane));                                 \
        sums[R][H][1] = vmlal_high_s8(sums[R][H][1], W, lane);                                                      \
    } while (0)
/* The 16-bit sums pairwise into the 32-bit ones, and the 16-bit ones from zero again. */
#define WIDEN()                                                                                                     \
    do {                                                                                                            \
        for (int r = 0; r < ROWS; r++)                                                                              \
            for (int h = 0; h < 2; h++)                                                                             \
                for (int k = 0; k < 2; k++) {                                                                       \
                    pairs[r][h][k] = vpadalq_s16(pairs[r][h][k], sums[r][h][k]);                                    \
                    sums[r][h][k] = vdupq_n_s16(0);                                                                 \
                }                                                                                                   \
    } while (0)
#endif

#define Q4_1_DOTS(I)                                                                                                \
    do {                                                                                                            \
        for (int h = 0; h < 2; h++) {                                                                               \
            Q4_1_WEIGHTS(I, h);                                                                                     \
            for (int r = 0; r < ROWS; r++) {                                                                        \
                DOT_LANE(r, h, low, xs[r][0], I);                                                                   \
                DOT_LANE(r, h, high, xs[r][1], I);                                                                  \
            }                                                                                                       \
        }                                                                                                           \
    } while (0)

#define Q8_0_DOTS(I)                                                                                                \
    do {                                                                                                            \
        for (int h = 0; h < 2; h++) {                                                                               \
            Q8_0_WEIGHTS(I, h);                                                                                     \
            for (int r = 0; r < ROWS; r++) DOT_LANE(r, h, w, xs[r][(I) / 4], (I) % 4);                             \
        }                                                                                                           \
    } while (0)

/* One block's integer dot products of ROWS rows and 8 columns (its weights at q, x8_quants): dots[r][h] lane j is
 * column 4h + j's. */
static inline __attribute__((always_inline)) void block_dots(const uint8_t *q, int8x16_t xs[4][2],
                                                             int32x4_t dots[4][2], const int FORMAT, const int ROWS) {
#if LOCKSTEP_NEON_DOT
    for (int r = 0; r < ROWS; r++) dots[r][0] = dots[r][1] = vdupq_n_s32(0);
#else /* dots are the pairs' sums, at the end */
    int16x8_t sums[4][2][2];
    int32x4_t pairs[4][2][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 2; k++) sums[r][h][k] = vdupq_n_s16(0), pairs[r][h][k] = vdupq_n_s32(0);
#endif
    if (FORMAT != FORMAT_Q8_0_X8) {
        Q4_1_DOTS(0); Q4_1_DOTS(1); Q4_1_DOTS(2); Q4_1_DOTS(3);
        WIDEN();
    } else { /* a 16-bit lane takes two Q8_0 products */
        Q8_0_DOTS(0); Q8_0_DOTS(1); WIDEN();
        Q8_0_DOTS(2); Q8_0_DOTS(3); WIDEN();
        Q8_0_DOTS(4); Q8_0_DOTS(5); WIDEN();
        Q8_0_DOTS(6); Q8_0_DOTS(7); WIDEN();
    }
#if !LOCKSTEP_NEON_DOT
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) dots[r][h] = vpaddq_s32(pairs[r][h][0], pairs[r][h][1]);
#endif
}

/* ROWS rows x 8 columns of an interleaved weight on 8-bit activations. */
static inline __attribute__((always_inline)) void neon_x8_tile(const struct quantized_x *x, int64_t row,
                                                               const uint8_t *group, float *out, int64_t n,
                                                               const int FORMAT, const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    float32x4_t acc[4][2], minimum[4][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = minimum[r][h] = vdupq_n_f32(0);
    for (int64_t b = 0; b < blocks; b++) {
        int8x16_t xs[4][2];
        int32x4_t dots[4][2];
        block_activations(x, row, b, xs, ROWS);
        block_dots(x8_quants(group, b, FORMAT), xs, dots, FORMAT, ROWS);
        for (int h = 0; h < 2; h++) {
            float32x4_t d, m;
            neon_scales(group, b, h, &d, &m, FORMAT);
            for (int r = 0; r < ROWS; r++) {
                const float dx = x->scale[(row + r) * blocks + b];
                acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(dots[r][h]), vmulq_n_f32(d, dx));
                const float sx = x->sum[b * x->m8 + row + r];
                if (FORMAT != FORMAT_Q8_0_X8) minimum[r][h] = vfmaq_n_f32(minimum[r][h], m, sx);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++)
            vst1q_f32(out + r * n + 4 * h, FORMAT != FORMAT_Q8_0_X8 ? vaddq_f32(acc[r][h], minimum[r][h]) : acc[r][h]);
}

/* Vector i's high 2 bits of a Q6_K_X8 plane (bits 2i, 2i + 1 of each byte) as bits 4, 5. */
static inline __attribute__((always_inline)) uint8x16_t q6_high_bits(uint8x16_t plane, const int I) {
    switch (I) {
    case 0: return vandq_u8(vshlq_n_u8(plane, 4), vdupq_n_u8(0x30));
    case 1: return vandq_u8(vshlq_n_u8(plane, 2), vdupq_n_u8(0x30));
    case 2: return vandq_u8(plane, vdupq_n_u8(0x30));
    default: return vandq_u8(vshrq_n_u8(plane, 2), vdupq_n_u8(0x30));
    }
}

/* Block I's 6-bit weights of columns 4h..4h+3 (w[0]: values 4I..4I+3, w[1]: 16+4I..), each half's own dot products
 * (dots index 2h + v; ARMv8.0: at most 4 products of 63 x 127 in a 16-bit lane, then widened). */
#define Q6_DOTS(I)                                                                                                  \
    do {                                                                                                            \
        for (int h = 0; h < 2; h++) {                                                                               \
            const uint8x16_t packed = vld1q_u8(q + 32 * (I) + 16 * h);                                             \
            const int8x16_t w0 = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(packed, vdupq_n_u8(0x0F)),                   \
                                                              q6_high_bits(vld1q_u8(q + 128 + 16 * h), I)));        \
            const int8x16_t w1 = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(packed, 4),                                \
                                                              q6_high_bits(vld1q_u8(q + 160 + 16 * h), I)));        \
            for (int r = 0; r < ROWS; r++) {                                                                        \
                DOT_LANE(r, 2 * h, w0, xs[r][0], I);                                                                \
                DOT_LANE(r, 2 * h + 1, w1, xs[r][1], I);                                                            \
            }                                                                                                       \
        }                                                                                                           \
    } while (0)

/* ROWS rows x 8 columns of a Q6_K_X8 weight on 8-bit activations, as q6_x8_tile on AVX2: per block and 16 values
 * v, the whole sum((q - 32) q_x), then acc += it * (d sc_v * dx), v = 0 then 1: the same bits. */
static inline __attribute__((always_inline)) void q6_x8_tile(const struct quantized_x *x, int64_t row,
                                                             const uint8_t *group, float *out, int64_t n,
                                                             const int ROWS) {
    const int64_t blocks = x->k / BLOCK;
    float32x4_t acc[4][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = vdupq_n_f32(0);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT_Q6_K_X8);
        int8x16_t xs[4][2];
        int32x4_t dots[4][4];
        block_activations(x, row, b, xs, ROWS);
#if LOCKSTEP_NEON_DOT
        for (int r = 0; r < ROWS; r++)
            for (int h = 0; h < 4; h++) dots[r][h] = vdupq_n_s32(0);
        Q6_DOTS(0); Q6_DOTS(1); Q6_DOTS(2); Q6_DOTS(3);
#else
        int16x8_t sums[4][4][2];
        for (int r = 0; r < ROWS; r++)
            for (int h = 0; h < 4; h++) sums[r][h][0] = sums[r][h][1] = vdupq_n_s16(0);
        Q6_DOTS(0); Q6_DOTS(1); Q6_DOTS(2); Q6_DOTS(3);
        for (int r = 0; r < ROWS; r++)
            for (int h = 0; h < 4; h++)
                dots[r][h] = vpaddq_s32(vpaddlq_s16(sums[r][h][0]), vpaddlq_s16(sums[r][h][1]));
#endif
        for (int h = 0; h < 2; h++) {
            float32x4_t d[2], m[2];
            neon_scales(group, b, h, d, m, FORMAT_Q6_K_X8);
            for (int r = 0; r < ROWS; r++) {
                const float dx = x->scale[(row + r) * blocks + b];
                for (int v = 0; v < 2; v++) {
                    const int32_t sum = 32 * x->half_sum[(row + r) * 2 * blocks + 2 * b + v];
                    const int32x4_t whole = vsubq_s32(dots[r][2 * h + v], vdupq_n_s32(sum));
                    acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(whole), vmulq_n_f32(d[v], dx));
                }
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) vst1q_f32(out + r * n + 4 * h, acc[r][h]);
}

/* The AVX2 tiles' names, for x8_columns. */
static inline __attribute__((always_inline)) void x8_tile(const struct quantized_x *x, int64_t row,
                                                          const uint8_t *group, float *out, int64_t n, const int FORMAT,
                                                          const int ROWS) {
    neon_x8_tile(x, row, group, out, n, FORMAT, ROWS);
}

static inline __attribute__((always_inline)) void q8_x8_tile(const struct quantized_x *x, int64_t row,
                                                             const uint8_t *group, float *out, int64_t n,
                                                             const int ROWS) {
    neon_x8_tile(x, row, group, out, n, FORMAT_Q8_0_X8, ROWS);
}

/* Float32 activations (exact): position p's weights of columns 4h..4h+3 from a block's weights at `quants`
 * (x8_quants), as x8_weights dequantizes them on AVX2 (d * q + m in one FMA; Q8_0: d * q). */
static inline __attribute__((always_inline)) float32x4_t position_weights(const uint8_t *quants, int position, int h,
                                                                          const float32x4_t *ds, const float32x4_t *ms,
                                                                          const int FORMAT) {
    const float32x4_t d = ds[FORMAT == FORMAT_Q6_K_X8 ? position / 16 : 0];
    const float32x4_t m = ms[FORMAT == FORMAT_Q6_K_X8 ? position / 16 : 0];
    if (FORMAT == FORMAT_Q6_K_X8) { /* the nibble, then the high bits from the plane of its 16 values */
        const uint32x4_t packed = vreinterpretq_u32_u8(vld1q_u8(quants + 32 * (position % 16 / 4) + 16 * h));
        const uint32x4_t plane = vreinterpretq_u32_u8(vld1q_u8(quants + 128 + 32 * (position / 16) + 16 * h));
        const uint32x4_t low = (packed >> (8 * (position % 4) + 4 * (position / 16))) & 0x0F;
        const uint32x4_t high = (plane >> (8 * (position % 4) + 2 * (position % 16 / 4))) & 3;
        return vfmaq_f32(m, d, vcvtq_f32_u32(low | (high << 4)));
    }
    if (FORMAT != FORMAT_Q8_0_X8) {
        const uint32x4_t packed = vreinterpretq_u32_u8(vld1q_u8(quants + 32 * (position % 16 / 4) + 16 * h));
        return vfmaq_f32(m, d, vcvtq_f32_u32((packed >> (8 * (position % 4) + 4 * (position / 16))) & 0x0F));
    }
    const uint32x4_t packed = vreinterpretq_u32_u8(vld1q_u8(quants + 32 * (position / 4) + 16 * h));
    /* the byte to the top unsigned, then down with its sign */
    return vmulq_f32(d, vcvtq_f32_s32(vreinterpretq_s32_u32(packed << (24 - 8 * (position % 4))) >> 24));
}

/* Position 4 * quad + LANE: each row's activation in lane LANE of xs[r] (a lane index must be a constant, whatever
 * the compiler unrolls: Clang's and an unoptimized build's too). */
#define BLOCK_LANE(LANE)                                                                                            \
    do {                                                                                                            \
        for (int h = 0; h < 2; h++) {                                                                               \
            const float32x4_t w = position_weights(q, 4 * quad + (LANE), h, d[h], m[h], FORMAT);                    \
            for (int r = 0; r < ROWS; r++) acc[r][h] = vfmaq_laneq_f32(acc[r][h], w, xs[r], LANE);                 \
        }                                                                                                           \
    } while (0)

/* ROWS rows x 8 columns on float32 activations, straight from the blocks: each output one chain of FMAs over K
 * in order, as the AVX2 tiles and panels compute it (the float32 dequantized matmul, summed in order): their
 * bits. */
static inline __attribute__((always_inline)) void x8_exact_tile(const struct quantized_x *x, int64_t row,
                                                                const uint8_t *group, float *out, int64_t n,
                                                                const int FORMAT, const int ROWS) {
    float32x4_t acc[4][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = vdupq_n_f32(0);
    for (int64_t b = 0; b < x->k / BLOCK; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT);
        float32x4_t d[2][2], m[2][2]; /* [columns 4h..][Q6_K_X8: 16 values] */
        for (int h = 0; h < 2; h++) neon_scales(group, b, h, d[h], m[h], FORMAT);
        UNROLLED /* constant shifts */
        for (int quad = 0; quad < BLOCK / 4; quad++) { /* positions 4 * quad .. 4 * quad + 3 */
            float32x4_t xs[4];
            for (int r = 0; r < ROWS; r++) xs[r] = vld1q_f32(x->xf + (row + r) * x->k + b * BLOCK + 4 * quad);
            BLOCK_LANE(0); BLOCK_LANE(1); BLOCK_LANE(2); BLOCK_LANE(3);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) vst1q_f32(out + r * n + 4 * h, acc[r][h]);
}

/* From NEON_PANEL_ROWS rows on, float32 activations read a group's weights dequantized once into a panel of
 * NEON_SLICE_BLOCKS blocks of K (4 KB: it stays in L1), for every row tile in turn, each going on from the sums the
 * last slice left in `out`: the same chain of FMAs per output, and the same bits. A step's matmuls as N1 code, in
 * instructions: 3 rows +11%, 4 rows -7%, 16 rows -42% against x8_exact_tile's. */
#define NEON_PANEL_ROWS 4
#define NEON_SLICE_BLOCKS 4
#define NEON_PANEL_TILE 8 /* rows: 16 accumulators, 8 registers of activations */

/* Blocks [from, to) of one group's 8 columns into panel [to - from][BLOCK][8], as position_weights gives them. */
static inline __attribute__((always_inline)) void dequantize_group(const uint8_t *group, int64_t from, int64_t to,
                                                                   float *panel, const int FORMAT) {
    for (int64_t b = from; b < to; b++) {
        const uint8_t *q = x8_quants(group, b, FORMAT);
        UNROLLED
        for (int h = 0; h < 2; h++) {
            float32x4_t d[2], m[2];
            neon_scales(group, b, h, d, m, FORMAT);
            UNROLLED
            for (int position = 0; position < BLOCK; position++)
                vst1q_f32(panel + ((b - from) * BLOCK + position) * 8 + 4 * h,
                          position_weights(q, position, h, d, m, FORMAT));
        }
    }
}

/* Position 4 * quad + LANE of the panel, as BLOCK_LANE. */
#define PANEL_LANE(LANE)                                                                                            \
    do {                                                                                                            \
        const float *position = ws + (4 * quad + (LANE)) * 8;                                                       \
        const float32x4_t w0 = vld1q_f32(position), w1 = vld1q_f32(position + 4);                                   \
        for (int r = 0; r < ROWS; r++) {                                                                            \
            acc[r][0] = vfmaq_laneq_f32(acc[r][0], w0, xs[r], LANE);                                                \
            acc[r][1] = vfmaq_laneq_f32(acc[r][1], w1, xs[r], LANE);                                                \
        }                                                                                                           \
    } while (0)

static inline __attribute__((always_inline)) void panel_tile(const struct quantized_x *x, int64_t row,
                                                             const float *panel, int64_t from, int64_t to,
                                                             float *out, int64_t n, const int ROWS) {
    float32x4_t acc[NEON_PANEL_TILE][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = from ? vld1q_f32(out + r * n + 4 * h) : vdupq_n_f32(0);
    for (int64_t b = from; b < to; b++) {
        const float *ws = panel + (b - from) * BLOCK * 8;
        for (int quad = 0; quad < BLOCK / 4; quad++) {
            float32x4_t xs[NEON_PANEL_TILE];
            for (int r = 0; r < ROWS; r++) xs[r] = vld1q_f32(x->xf + (row + r) * x->k + b * BLOCK + 4 * quad);
            PANEL_LANE(0); PANEL_LANE(1); PANEL_LANE(2); PANEL_LANE(3);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++) vst1q_f32(out + r * n + 4 * h, acc[r][h]);
}

/* Columns [first, last) on float32 activations, as AVX2's x8_exact_columns: fewer than NEON_PANEL_ROWS rows
 * straight from the blocks, more from a panel a slice of K at a time. */
static void x8_exact_columns(const struct quantized_x *x, const uint8_t *weight, int format, int64_t group_bytes,
                             float *out, int64_t n, int64_t first, int64_t last) {
    const int64_t blocks = x->k / BLOCK;
    float panel[NEON_SLICE_BLOCKS * BLOCK * 8] __attribute__((aligned(64)));
    for (int64_t c = first; c < last; c += 8) {
        const uint8_t *group = weight + c / 8 * group_bytes;
        if (x->m < NEON_PANEL_ROWS) {
#define EXACT_TILE(F) X8_TILE(x8_exact_tile, x->m, x, 0, group, out + c, n, F)
            BY_FORMAT(format, EXACT_TILE);
            continue;
        }
        for (int64_t from = 0; from < blocks; from += NEON_SLICE_BLOCKS) {
            const int64_t to = from + NEON_SLICE_BLOCKS < blocks ? from + NEON_SLICE_BLOCKS : blocks;
#define GROUP_PANEL(F) dequantize_group(group, from, to, panel, F)
            BY_FORMAT(format, GROUP_PANEL);
            for (int64_t r = 0; r < x->m; r += NEON_PANEL_TILE)
                X8_TILE8(panel_tile, x->m - r, x, r, panel, from, to, out + r * n + c, n);
        }
    }
}
#endif

#if LOCKSTEP_AVX2 || LOCKSTEP_NEON
#if LOCKSTEP_NEON && !LOCKSTEP_NEON_DOT
#define X8_TILE_ROWS 2 /* 8 rows as Cortex-A72 code: 2-row tiles 412 M instructions, 3-row 439, 4-row 507 (spills) */
#else
#define X8_TILE_ROWS 4 /* rows of an 8-bit 8-column tile */
#endif
/* Columns [first, last) (multiples of 8) of a Q4_1_X8 or Q8_0_X8 weight, X8_TILE_ROWS rows at a time (Q4_1 on
 * AVX-512 from X8_WIDE_ROWS rows: 8, which unpacks each block's nibbles half as often: 8- and 16-row steps
 * 1.03-1.08x); a unit's groups stay in L2. */
static void x8_columns(const struct quantized_x *x, const uint8_t *weight, int format, float *out, int64_t n,
                       int64_t first, int64_t last) {
    const int64_t group_bytes = 8 * row_bytes_of(format, x->k);
    if (x->exact) {
        x8_exact_columns(x, weight, format, group_bytes, out, n, first, last);
        return;
    }
#if LOCKSTEP_AVX512
    if (format != FORMAT_Q8_0_X8 && x->m >= X8_WIDE_ROWS) {
        const int is_q6_k = format == FORMAT_Q6_K_X8;
        for (int64_t r = 0; r < x->m; r += X8_ROWS16) {
            int64_t rows = x->m - r < X8_ROWS16 ? x->m - r : X8_ROWS16, c = first;
#define WIDE(F) X8_TILE8(x8_tile16, rows, x, r, weight + c / 8 * group_bytes, group_bytes, out + r * n + c, n, F)
            for (; last - c >= 16; c += 16) {
                if (is_q6_k)
                    X8_TILE8(q6_x8_tile16, rows, x, r, weight + c / 8 * group_bytes, group_bytes, out + r * n + c, n);
                else BY_4_BIT_FORMAT(format, WIDE);
            }
#define LAST(F) X8_TILE(x8_tile, r + rows - row, x, row, weight + c / 8 * group_bytes, out + row * n + c, n, F)
            for (int64_t row = r; c < last && row < r + rows; row += 4) { /* the last 8 columns */
                if (is_q6_k)
                    X8_TILE(q6_x8_tile, r + rows - row, x, row, weight + c / 8 * group_bytes, out + row * n + c, n);
                else BY_4_BIT_FORMAT(format, LAST);
            }
        }
        return;
    }
#endif
    for (int64_t r = 0; r < x->m; r += X8_TILE_ROWS) {
        int64_t rows = x->m - r < X8_TILE_ROWS ? x->m - r : X8_TILE_ROWS;
        for (int64_t c = first; c < last; c += 8) {
            const uint8_t *group = weight + c / 8 * group_bytes;
#if LOCKSTEP_AVX512
            if (format == FORMAT_Q8_0_X8 && x->m >= X8_WIDE_ROWS && last - c >= 16) {
                X8_TILE(q8_x8_tile16, rows, x, r, group, group_bytes, out + r * n + c, n);
                c += 8;
                continue;
            }
#endif
#define NARROW(F) X8_TILE(x8_tile, rows, x, r, group, out + r * n + c, n, F)
            if (format == FORMAT_Q8_0_X8) X8_TILE(q8_x8_tile, rows, x, r, group, out + r * n + c, n);
            else if (format == FORMAT_Q6_K_X8) X8_TILE(q6_x8_tile, rows, x, r, group, out + r * n + c, n);
            else BY_4_BIT_FORMAT(format, NARROW);
        }
    }
}
#endif

/* out[M, N] columns [first, last) = x @ W.T: rows in L2-sized blocks, each weight row reused from L1 for ROW_TILE
 * rows at a time. */
static void linear_columns(const struct quantized_x *x, const uint8_t *weight, int format, float *out, int64_t n,
                           int64_t first, int64_t last) {
#if LOCKSTEP_AVX2 || LOCKSTEP_NEON
    if (is_x8(format)) { /* where the build reads them (see x8_runs) */
        x8_columns(x, weight, format, out, n, first, last);
        return;
    }
#endif
    const int64_t row_bytes = x->k / BLOCK * block_bytes(format);
    for (int64_t block_start = 0; block_start < x->m; block_start += ROW_BLOCK) {
        int64_t block_end = block_start + ROW_BLOCK < x->m ? block_start + ROW_BLOCK : x->m;
        for (int64_t r = block_start; r < block_end; r += ROW_TILE) {
            int64_t rows = block_end - r < ROW_TILE ? block_end - r : ROW_TILE;
            columns_for_rows(x, r, rows, weight, row_bytes, format, out + r * n, n, first, last);
        }
    }
}

/* ---- A pool of helper threads. The worker process has the machine's cores while the server mostly waits for its
 * tokens, so a call's units of work (column chunks of a matmul, rows of the attention) are shared with helpers that
 * spin while a decode step runs and sleep on a futex between calls. Units are taken from one counter, so a helper
 * the kernel takes off its core slows a call but never stops it (the caller takes what is left), and every unit is
 * computed by the same code whichever thread takes it: the numbers do not depend on the helpers. A call that waited
 * for a helper's last unit STALL_S longer than two units take (another process had the core) makes the next
 * STEPS_ALONE calls run without them. Helpers are made on first use, and again in a forked child (which has the memory, not threads). */
#define MAX_HELPERS 63
#define STALL_S 0.002
#define STEPS_ALONE 8
#define SHARED_ATTENTION_MACS (1 << 17)

typedef void (*unit_fn)(const void *job, int64_t unit);

static struct {
    pid_t owner;
    int count;
    int64_t steps_alone;
    double longest_wait_s;
    const void *job;
    unit_fn run;
    _Alignas(64) atomic_int awake;          /* 1 while a call wants the helpers (the futex word) */
    _Alignas(64) atomic_uint_fast64_t next; /* job number << 32 | next unit */
    _Alignas(64) atomic_int_fast64_t units_done;
    int64_t units;
} pool;

static atomic_flag pool_taken = ATOMIC_FLAG_INIT; /* one caller at a time uses the helpers */

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Take units of job number `job` until none is left; returns how many this thread did. */
static int64_t take_units(uint64_t job, unit_fn run, const void *context, int64_t units) {
    int64_t done = 0;
    uint64_t ticket = atomic_load(&pool.next);
    for (;;) {
        if ((ticket >> 32) != job || (int64_t)(ticket & 0xFFFFFFFFu) >= units) return done;
        if (!atomic_compare_exchange_weak(&pool.next, &ticket, ticket + 1)) continue;
        run(context, (int64_t)(ticket & 0xFFFFFFFFu));
        done++;
        ticket = atomic_load(&pool.next);
    }
}

static void *helper_loop(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        while (!atomic_load(&pool.awake))
            syscall(SYS_futex, (int *)&pool.awake, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        uint64_t job = atomic_load(&pool.next) >> 32;
        if (job == seen) {
            cpu_relax();
            continue;
        }
        seen = job;
        unit_fn run = pool.run;
        const void *context = pool.job;
        int64_t units = pool.units;
        int64_t done = take_units(job, run, context, units);
        if (done) atomic_fetch_add(&pool.units_done, done);
    }
    return NULL;
}

/* `count` helpers in this process (made if missing); returns how many there are. */
static int helpers_ready(int count) {
    if (pool.owner != getpid()) {
        pool.owner = getpid();
        pool.count = 0;
        atomic_store(&pool.awake, 0);
    }
    while (pool.count < count && pool.count < MAX_HELPERS) {
        pthread_attr_t attributes;
        pthread_t thread;
        if (pthread_attr_init(&attributes)) break;
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, helper_loop, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) break;
        pool.count++;
    }
    return pool.count;
}

static void helpers_awake(int on) {
    atomic_store(&pool.awake, on);
    if (on) syscall(SYS_futex, (int *)&pool.awake, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
}

/* Starts a call that may use `helpers` helpers; returns whether it has them (then `end_shared` must follow). */
static int begin_shared(int helpers) {
    if (helpers <= 0 || atomic_flag_test_and_set(&pool_taken)) return 0;
    if (pool.steps_alone > 0 || helpers_ready(helpers) == 0) {
        pool.steps_alone -= pool.steps_alone > 0;
        atomic_flag_clear(&pool_taken);
        return 0;
    }
    pool.longest_wait_s = 0;
    helpers_awake(1);
    return 1;
}

static void end_shared(void) {
    helpers_awake(0);
    if (pool.longest_wait_s > STALL_S) pool.steps_alone = STEPS_ALONE;
    atomic_flag_clear(&pool_taken);
}

/* Runs units 0..units-1 of `run`: with the helpers if `shared`, else on this thread. */
static void run_units(int shared, unit_fn run, const void *context, int64_t units) {
    if (!shared || units < 2 || units > 0xFFFFFFFFll) {
        for (int64_t u = 0; u < units; u++) run(context, u);
        return;
    }
    uint64_t job = ((atomic_load(&pool.next) >> 32) + 1) & 0xFFFFFFFFu;
    pool.run = run, pool.job = context, pool.units = units;
    atomic_store(&pool.units_done, 0);
    atomic_store(&pool.next, job << 32); /* publishes the job (sequentially consistent) */
    double started = seconds_now();
    int64_t done = take_units(job, run, context, units);
    if (done) atomic_fetch_add(&pool.units_done, done);
    if (atomic_load(&pool.units_done) < units) { /* a helper is still on its last unit */
        double waiting = seconds_now();
        while (atomic_load(&pool.units_done) < units) cpu_relax();
        /* beyond two units' worth of this thread's own pace: the helper was off its core */
        double unit_s = done ? (waiting - started) / (double)done : 0;
        double late = seconds_now() - waiting - 2 * unit_s;
        if (late > pool.longest_wait_s) pool.longest_wait_s = late;
    }
}

/* ---- The matmul's column chunks as units; x is quantized once per call, by the caller. */
struct linear_job {
    const struct quantized_x *x;
    const uint8_t *weight;
    float *out;
    int64_t n, columns; /* columns per unit */
    int format;
};

static void linear_unit(const void *context, int64_t unit) {
    const struct linear_job *job = context;
    int64_t first = unit * job->columns, last = first + job->columns < job->n ? first + job->columns : job->n;
    linear_columns(job->x, job->weight, job->format, job->out, job->n, first, last);
}

/* Scratch for x quantized: M x K bytes, two floats per block and row, an int32 per 16 values and row. */
static int64_t quantized_x_bytes(int64_t m, int64_t k) {
    int64_t m8 = (m + 7) / 8 * 8;
    return m * k + m * (k / BLOCK) * 4 + (k / BLOCK) * m8 * 4 + 32 * 4 + 64 + m * (k / 16) * 4;
}

static struct quantized_x quantized_x_in(void *scratch, int64_t m, int64_t k) {
    struct quantized_x x;
    x.m = m, x.m8 = (m + 7) / 8 * 8, x.k = k;
    x.scale = scratch;
    x.sum = x.scale + m * (k / BLOCK);
    x.half_sum = (int32_t *)(x.sum + (k / BLOCK) * x.m8 + 8); /* 8 floats of slack: a tile reads 8 rows' sums */
    x.q = (int8_t *)(x.half_sum + m * (k / 16));
    return x;
}

static void matmul(int shared, const float *x, void *scratch, const uint8_t *weight, int format, float *out,
                   int64_t m, int64_t n, int64_t k, int exact) {
    struct quantized_x quantized = quantized_x_in(scratch, m, k);
    quantized.exact = exact != 0;
    quantize_rows(x, &quantized);
    /* About UNITS_PER_THREAD units per thread: units of few columns make the threads fight over the counter's
     * cache line (16-column units made a one-row step 30% slower than 64-column ones) */
    int64_t threads = shared ? pool.count + 1 : 1, wanted = (n + threads * UNITS_PER_THREAD - 1) / (threads * UNITS_PER_THREAD);
    int64_t columns = (wanted + MIN_UNIT_COLUMNS - 1) / MIN_UNIT_COLUMNS * MIN_UNIT_COLUMNS;
    struct linear_job job = {&quantized, weight, out, n, columns, format};
    run_units(shared, linear_unit, &job, (n + columns - 1) / columns);
}

/* Whether the matmuls read `format` here: plain Q4_1 and Q8_0 everywhere, the interleaved formats where the build
 * reads them (N % 8 == 0), plain Q4_0 and Q4_K nowhere (their interleaved copies are read). */
static int x8_runs(int format, int64_t n, int64_t k) {
    if (format == FORMAT_Q4_1 || format == FORMAT_Q8_0) return 1;
    const int super_blocks = format == FORMAT_Q4_K_X8 || format == FORMAT_Q6_K_X8;
    return is_x8(format) && lockstep_q4_interleaves() && n % 8 == 0 && (!super_blocks || k % SUPER_BLOCK == 0);
}

/* x: [M, K] float32; weight: [N] rows of K / 32 blocks of `format`; out: [M, N] float32. K % 32 == 0; `exact`:
 * x as it is (1) or rounded to 8 bits per 32 (0). Returns 0, -1 if scratch memory could not be had, or -2 for
 * a format it does not read (an interleaved one in a build that reads none, N % 8, Q4_K_X8's and Q6_K_X8's
 * K % 256; plain Q4_0, Q4_K or Q6_K). */
int lockstep_q4_linear(const float *x, const uint8_t *weight, int format, float *out, int64_t m, int64_t n,
                       int64_t k, int helpers, int exact) {
    if (!x8_runs(format, n, k)) return -2;
    void *scratch = malloc(quantized_x_bytes(m, k));
    if (!scratch) return -1;
    int shared = begin_shared(helpers);
    matmul(shared, x, scratch, weight, format, out, m, n, k, exact);
    if (shared) end_shared();
    free(scratch);
    return 0;
}

/* Rows of a weight of any format, plain or interleaved, dequantized (the embedding lookup): out[i] = row ids[i]
 * of `weight`. */
void lockstep_q4_dequantize_rows(const uint8_t *weight, int format, const int64_t *ids, int64_t count, int64_t k,
                                 float *out) {
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < k / BLOCK; b++) dequantize_row_block(weight, format, ids[i], b, k, out + i * k + b * BLOCK);
}

/* ---- K-quant blocks repacked as the kernels' (block_repack.py's numpy, in C: a 7 B file's 4 GB in seconds, not
 * minutes). Bit for bit the numpy's: float32 products in the same order, float16 rounded to nearest even, Q8_0's
 * steps rounded half away from zero (ggml's roundf, gguf-py's np_roundf). */

/* float32 -> float16, rounded to nearest even, overflow to infinity (ggml's portable fp32_to_fp16). */
static uint16_t float_to_half(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    const uint32_t doubled = w + w, sign = w & 0x80000000u;
    uint32_t bias = doubled & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float rounder;
    memcpy(&rounder, &bias_bits, 4);
    base = rounder + base;
    memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (doubled > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void write_half(uint8_t *out, uint16_t h) { out[0] = (uint8_t)(h & 0xFF); out[1] = (uint8_t)(h >> 8); }

/* Each 256-value Q4_K block (d, dmin, 12 bytes of scales, 128 of nibbles) as 8 Q4_1 blocks: d sc and -dmin m in
 * float16, value i of a sub-block in byte i's low nibble, value i + 16 in its high one. Returns 0, or -1 where a
 * scale does not fit float16 (the caller then rounds the tensor to Q8_0). */
int lockstep_q4_k_as_q4_1(const uint8_t *in, int64_t blocks, uint8_t *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = in + b * 144, *qs = block + 16;
        const float d = half_to_float(read_half(block)), dmin = half_to_float(read_half(block + 2));
        for (int j = 0; j < 8; j++) {
            int scale, minimum;
            k4_scale_min(j, block + 4, &scale, &minimum);
            const uint16_t hd = float_to_half(d * (float)scale), hm = float_to_half(-(dmin * (float)minimum));
            if ((hd & 0x7C00) == 0x7C00 || (hm & 0x7C00) == 0x7C00) return -1;
            uint8_t *target = out + (b * 8 + j) * Q4_1_BYTES;
            write_half(target, hd);
            write_half(target + 2, hm);
            const uint8_t *chunk = qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int i = 0; i < 16; i++)
                target[4 + i] = (uint8_t)(((chunk[i] >> shift) & 0x0F) | (((chunk[i + 16] >> shift) & 0x0F) << 4));
        }
    }
    return 0;
}

/* 32 values as a Q8_0 block, as gguf-py (and ggml's reference) quantizes. */
static void q8_0_block(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax; /* no NaN in a block's values */
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    write_half(out, float_to_half(d));
    int8_t q[BLOCK];
    for (int i = 0; i < BLOCK; i++) { /* roundf (half away from zero) as np_roundf computes it, vectorized */
        const float v = x[i] * inverse, a = fabsf(v), whole = floorf(a), step = whole + floorf(2.0f * (a - whole));
        q[i] = (int8_t)copysignf(step, v);
    }
    memcpy(out + 2, q, BLOCK);
}

/* Q4_1 blocks dequantized and rounded to Q8_0 (a fused weight whose parts came in both formats). */
void lockstep_q4_1_as_q8_0(const uint8_t *in, int64_t blocks, uint8_t *out) {
    float y[BLOCK];
    for (int64_t b = 0; b < blocks; b++) {
        dequantize_block(in + b * Q4_1_BYTES, FORMAT_Q4_1, y);
        q8_0_block(y, out + b * Q8_0_BYTES);
    }
}

/* Each 256-value Q6_K block (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d) dequantized as
 * ggml's dequantize_row_q6_K computes it, then rounded to 8 Q8_0 blocks. */
void lockstep_q6_k_as_q8_0(const uint8_t *in, int64_t blocks, uint8_t *out) {
    float y[256];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *ql = in + b * 210, *qh = ql + 128;
        const int8_t *scales = (const int8_t *)(ql + 192);
        const float d = half_to_float(read_half(ql + 208));
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 32; l++) {
                const int at = half * 128 + l, s = half * 8 + l / 16;
                const uint8_t low = ql[half * 64 + l], high = ql[half * 64 + l + 32], bits = qh[half * 32 + l];
                y[at] = (d * (float)scales[s]) * (float)((int)((low & 0x0F) | ((bits & 3) << 4)) - 32);
                y[at + 32] = (d * (float)scales[s + 2]) * (float)((int)((high & 0x0F) | (((bits >> 2) & 3) << 4)) - 32);
                y[at + 64] = (d * (float)scales[s + 4]) * (float)((int)((low >> 4) | (((bits >> 4) & 3) << 4)) - 32);
                y[at + 96] = (d * (float)scales[s + 6]) * (float)((int)((high >> 4) | (((bits >> 6) & 3) << 4)) - 32);
            }
        for (int g = 0; g < 8; g++) q8_0_block(y + g * BLOCK, out + (b * 8 + g) * Q8_0_BYTES);
    }
}

/* ---- The rest of a decode step, in float32 as transformers computes a float32 Llama. */

/* LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight. */
static void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * width;
        float sum = 0;
        for (int64_t i = 0; i < width; i++) sum += row[i] * row[i];
        float scale = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t i = 0; i < width; i++) out[r * width + i] = weight[i] * (row[i] * scale);
    }
}

/* apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, for `heads` heads of one token in place. */
static void rotate_heads(float *token, int64_t heads, int64_t head_dim, const float *cos, const float *sin) {
    int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = token + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            float first = x[i], second = x[i + half];
            x[i] = first * cos[i] - second * sin[i];
            x[i + half] = second * cos[i + half] + first * sin[i + half];
        }
    }
}

/* ---- Attention. A unit is one KV head of a chunk of tiles; a tile holds the query heads (at most TILE_QUERIES) of
 * rows that attend to the same slot (one decode row's group, or neighbouring tokens of a prompt chunk) and a chunk
 * the tiles of one slot. Keys and values are read POSITION_BLOCK positions at a time for the whole chunk, so a long
 * prompt reads the cache from L2 a few times instead of from memory once per head and token. Keys are kept in
 * blocks of KEY_BLOCK positions with positions in lanes (dimension d of position p at key_offset(p, d)), so a
 * vector of scores is a chain of FMAs over the head's dimensions with no horizontal sum. Every score is that chain in
 * order, and every output lane the same chain over positions in order (kept in memory between blocks), whatever the
 * tiles and the vector width: a prompt chunked, whole or decoded computes the same bits, on AVX2 as on AVX-512. */
#define KEY_BLOCK 16
#define TILE_QUERIES 6
#define CHUNK_TILES 8
#define POSITION_BLOCK 128

struct query {
    const float *q;  /* [head_dim] */
    float *scores;   /* [length rounded up to KEY_BLOCK], then the softmax weights */
    float *out;      /* [head_dim] */
    int64_t length;  /* it attends to positions 0..length-1 */
};

int64_t lockstep_q4_key_block(void) { return KEY_BLOCK; }

static inline int64_t key_offset(int64_t position, int64_t d, int64_t head_dim) {
    return (position / KEY_BLOCK * head_dim + d) * KEY_BLOCK + position % KEY_BLOCK;
}

/* Keys and values are float16 (HALF: on 8-bit activations, half the bytes a decode step reads per position) or
 * float32 (exact); index in elements. float16 rounds to nearest even, as F16C does. */
static inline float load_kv(const void *kv, int64_t index, const int HALF) {
    return HALF ? half_to_float(((const uint16_t *)kv)[index]) : ((const float *)kv)[index];
}

static inline void store_kv(void *kv, int64_t index, float x, const int HALF) {
    if (!HALF) {
        ((float *)kv)[index] = x;
        return;
    }
#if LOCKSTEP_AVX2
    ((uint16_t *)kv)[index] = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    union { _Float16 h; uint16_t u; } bits = {(_Float16)x};
    ((uint16_t *)kv)[index] = bits.u;
#endif
}

#if LOCKSTEP_AVX2
/* expf for 8 lanes (Cephes' polynomial by FMAs, ~1 ulp); exactly 0 below -87.3 (and for -inf). */
static const float EXP_TERMS[] = {1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f, 1.6666665459E-1f,
                                  5.0000001201E-1f};

static inline __m256 exp_avx2(__m256 x) {
    __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    for (int i = 0; i < 5; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_TERMS[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(below, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

/* The largest of scores[0..padded) (padded % 8 == 0), four vectors at a time: a maximum is the same in any order. */
static inline float maximum8(const float *scores, int64_t padded) {
    __m256 maxima[4];
    for (int i = 0; i < 4; i++) maxima[i] = _mm256_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 32 <= padded; p += 32)
        for (int i = 0; i < 4; i++) maxima[i] = _mm256_max_ps(maxima[i], _mm256_loadu_ps(scores + p + 8 * i));
    for (; p < padded; p += 8) maxima[0] = _mm256_max_ps(maxima[0], _mm256_loadu_ps(scores + p));
    __m256 all = _mm256_max_ps(_mm256_max_ps(maxima[0], maxima[1]), _mm256_max_ps(maxima[2], maxima[3]));
    float lanes[8], maximum = -INFINITY;
    _mm256_storeu_ps(lanes, all);
    for (int i = 0; i < 8; i++) maximum = lanes[i] > maximum ? lanes[i] : maximum;
    return maximum;
}

/* scores[0..length) -> exp(score - max), padded with zeros to a multiple of 8; returns their sum. */
static inline float exponentiate8(float *scores, int64_t length) {
    int64_t padded = (length + 7) / 8 * 8;
    for (int64_t p = length; p < padded; p++) scores[p] = -INFINITY;
    const float maximum = maximum8(scores, padded);
    __m256 top = _mm256_set1_ps(maximum), total = _mm256_setzero_ps();
    for (int64_t p = 0; p < padded; p += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + p), top));
        _mm256_storeu_ps(scores + p, e);
        total = _mm256_add_ps(total, e);
    }
    return sum_lanes(total);
}

static inline __m256 load_kv8(const void *kv, int64_t index, const int HALF) {
    return HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)kv + index)))
                : _mm256_loadu_ps((const float *)kv + index);
}

/* Scores of Q queries at the positions of G key blocks from block `first` on (every lane of a block: past a query's
 * length they are computed and not read), two vectors a block. */
static inline __attribute__((always_inline)) void block_scores8(const struct query *queries, const void *keys,
                                                                int64_t first, int64_t head_dim, float scaling,
                                                                const int Q, const int G, const int HALF) {
    __m256 acc[TILE_QUERIES][4];
    for (int q = 0; q < Q; q++)
        for (int h = 0; h < 2 * G; h++) acc[q][h] = _mm256_setzero_ps();
    const int64_t block = first * KEY_BLOCK * head_dim;
    for (int64_t d = 0; d < head_dim; d++) {
        __m256 k[4];
        for (int h = 0; h < 2 * G; h++) k[h] = load_kv8(keys, block + ((h / 2) * head_dim + d) * KEY_BLOCK + 8 * (h % 2), HALF);
        for (int q = 0; q < Q; q++) {
            __m256 x = _mm256_broadcast_ss(queries[q].q + d);
            for (int h = 0; h < 2 * G; h++) acc[q][h] = _mm256_fmadd_ps(x, k[h], acc[q][h]);
        }
    }
    for (int q = 0; q < Q; q++)
        for (int h = 0; h < 2 * G; h++)
            _mm256_storeu_ps(queries[q].scores + first * KEY_BLOCK + 8 * h, _mm256_mul_ps(acc[q][h], _mm256_set1_ps(scaling)));
}

/* Blocks from..to-1, G at a time (2 for few queries, whose accumulators leave registers for a second block). */
static inline __attribute__((always_inline)) void scores_of_tile(const struct query *queries, const void *keys,
                                                                 int64_t from, int64_t to, int64_t head_dim,
                                                                 float scaling, const int Q, const int HALF) {
    int64_t block = from;
    if (Q <= 2)
        for (; block + 2 <= to; block += 2) block_scores8(queries, keys, block, head_dim, scaling, Q, 2, HALF);
    for (; block < to; block++) block_scores8(queries, keys, block, head_dim, scaling, Q, 1, HALF);
}

/* Adds positions from..to-1 (clipped to each query's length) to dimensions i..i+8*WIDTH of each query's sum of
 * weights[p] * values[p], started at 0 when from is 0, else continued from `out`: the positions all queries have
 * at once (each value read once), then each query's own. */
static inline __attribute__((always_inline)) void sums_of_tile(const struct query *queries, int64_t from,
                                                               int64_t to, int64_t common, const void *values,
                                                               int64_t head_dim, int64_t i, const int Q,
                                                               const int WIDTH, const int HALF) {
    const int64_t shared_to = common < from ? from : common < to ? common : to;
    __m256 acc[TILE_QUERIES][4];
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < WIDTH; w++)
            acc[q][w] = from ? _mm256_loadu_ps(queries[q].out + i + 8 * w) : _mm256_setzero_ps();
    for (int64_t p = from; p < shared_to; p++) {
        __m256 v[4];
        for (int w = 0; w < WIDTH; w++) v[w] = load_kv8(values, p * head_dim + i + 8 * w, HALF);
        for (int q = 0; q < Q; q++) {
            __m256 weight = _mm256_broadcast_ss(queries[q].scores + p);
            for (int w = 0; w < WIDTH; w++) acc[q][w] = _mm256_fmadd_ps(weight, v[w], acc[q][w]);
        }
    }
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < WIDTH; w++) _mm256_storeu_ps(queries[q].out + i + 8 * w, acc[q][w]);
    for (int q = 0; q < Q; q++) { /* the same chains, continued in memory (the registers stay the shared loop's) */
        const int64_t own_to = queries[q].length < to ? queries[q].length : to;
        float *out = queries[q].out + i;
        for (int64_t p = shared_to; p < own_to; p++) {
            __m256 weight = _mm256_broadcast_ss(queries[q].scores + p);
            for (int w = 0; w < WIDTH; w++)
                _mm256_storeu_ps(out + 8 * w, _mm256_fmadd_ps(weight, load_kv8(values, p * head_dim + i + 8 * w, HALF),
                                                              _mm256_loadu_ps(out + 8 * w)));
        }
    }
}

#define SCORES_CASE(Q, H) case Q: scores_of_tile(queries, keys, from, to, head_dim, scaling, Q, H); break;
#define SCORES_SWITCH(H) switch (count) { SCORES_CASE(1, H) SCORES_CASE(2, H) SCORES_CASE(3, H) SCORES_CASE(4, H) \
                                          SCORES_CASE(5, H) SCORES_CASE(6, H) }
#define SUMS_CASE(Q, W, H) case 8 * Q + W: sums_of_tile(queries, from, to, common, values, head_dim, i, Q, W, H); break;
#define SUMS_CASES(Q, H) SUMS_CASE(Q, 1, H) SUMS_CASE(Q, 2, H) SUMS_CASE(Q, 4, H)
#define SUMS_SWITCH(H) switch (8 * count + width) { SUMS_CASES(1, H) SUMS_CASES(2, H) SUMS_CASES(3, H) SUMS_CASES(4, H) \
                                                    SUMS_CASES(5, H) SUMS_CASES(6, H) }

/* Scores at positions from..to-1 (from a multiple of KEY_BLOCK), up to the end of to's block. */
static inline void scores8(const struct query *queries, int count, const void *keys, int64_t from_position,
                           int64_t to_position, int64_t head_dim, float scaling, int half) {
    const int64_t from = from_position / KEY_BLOCK, to = (to_position + KEY_BLOCK - 1) / KEY_BLOCK;
    if (half) SCORES_SWITCH(1) else SCORES_SWITCH(0)
}

/* Positions from..to-1 of each query's attended values (head_dim % 8 == 0). Few queries take 32 dimensions a
 * pass, more take 16 (their accumulators fill the registers either way). */
static void weighted_sums8(const struct query *queries, int count, const void *values, int64_t from, int64_t to,
                           int64_t common, int64_t head_dim, int half) {
    for (int64_t i = 0; i < head_dim;) {
        int64_t left = (head_dim - i) / 8;
        int width = count <= 3 && left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (half) SUMS_SWITCH(1) else SUMS_SWITCH(0)
        i += 8 * width;
    }
}

#if LOCKSTEP_AVX512
/* The same attention on 16 lanes: a key block's lanes in one vector for the scores; lane i is dimension (or
 * position) i for the sums and the exponential, whose total is added 8 lanes at a time in order. */
static inline __m512 load_kv16(const void *kv, int64_t index, const int HALF) {
    return HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + index)))
                : _mm512_loadu_ps((const float *)kv + index);
}

static inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

static inline __m512 exp_avx512(__m512 x) {
    __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    for (int i = 0; i < 5; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_TERMS[i]));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~below, _mm512_mul_ps(y, _mm512_castsi512_ps(exponent)));
}

static float exponentiate(float *scores, int64_t length) {
    int64_t padded = (length + 7) / 8 * 8;
    for (int64_t p = length; p < padded; p++) scores[p] = -INFINITY;
    const float maximum = maximum8(scores, padded);
    __m256 total = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= padded; p += 16) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + p), _mm512_set1_ps(maximum)));
        _mm512_storeu_ps(scores + p, e);
        total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(e)), high_half(e));
    }
    if (p < padded) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + p), _mm256_set1_ps(maximum)));
        _mm256_storeu_ps(scores + p, e);
        total = _mm256_add_ps(total, e);
    }
    return sum_lanes(total);
}

/* block_scores8 with a key block in one vector. */
static inline __attribute__((always_inline)) void block_scores16(const struct query *queries, const void *keys,
                                                                 int64_t first, int64_t head_dim, float scaling,
                                                                 const int Q, const int G, const int HALF) {
    __m512 acc[TILE_QUERIES][8];
    for (int q = 0; q < Q; q++)
        for (int g = 0; g < G; g++) acc[q][g] = _mm512_setzero_ps();
    const int64_t block = first * KEY_BLOCK * head_dim;
    for (int64_t d = 0; d < head_dim; d++) {
        __m512 k[8];
        for (int g = 0; g < G; g++) k[g] = load_kv16(keys, block + (g * head_dim + d) * KEY_BLOCK, HALF);
        for (int q = 0; q < Q; q++) {
            __m512 x = _mm512_set1_ps(queries[q].q[d]);
            for (int g = 0; g < G; g++) acc[q][g] = _mm512_fmadd_ps(x, k[g], acc[q][g]);
        }
    }
    for (int q = 0; q < Q; q++)
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(queries[q].scores + (first + g) * KEY_BLOCK, _mm512_mul_ps(acc[q][g], _mm512_set1_ps(scaling)));
}

/* Blocks from..to-1, G at a time: 8 for up to two queries, 4 for more (at most 24 accumulators). */
static inline __attribute__((always_inline)) void scores_of_tile16(const struct query *queries, const void *keys,
                                                                   int64_t from, int64_t to, int64_t head_dim,
                                                                   float scaling, const int Q, const int HALF) {
    const int G = Q <= 2 ? 8 : 4;
    int64_t block = from;
    for (; block + G <= to; block += G) block_scores16(queries, keys, block, head_dim, scaling, Q, G, HALF);
    for (; block < to; block++) block_scores16(queries, keys, block, head_dim, scaling, Q, 1, HALF);
}

/* sums_of_tile on 16 dimensions a vector. */
static inline __attribute__((always_inline)) void sums_of_tile16(const struct query *queries, int64_t from,
                                                                 int64_t to, int64_t common, const void *values,
                                                                 int64_t head_dim, int64_t i, const int Q,
                                                                 const int WIDTH, const int HALF) {
    const int64_t shared_to = common < from ? from : common < to ? common : to;
    __m512 acc[TILE_QUERIES][4];
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < WIDTH; w++)
            acc[q][w] = from ? _mm512_loadu_ps(queries[q].out + i + 16 * w) : _mm512_setzero_ps();
    for (int64_t p = from; p < shared_to; p++) {
        __m512 v[4];
        for (int w = 0; w < WIDTH; w++) v[w] = load_kv16(values, p * head_dim + i + 16 * w, HALF);
        for (int q = 0; q < Q; q++) {
            __m512 weight = _mm512_set1_ps(queries[q].scores[p]);
            for (int w = 0; w < WIDTH; w++) acc[q][w] = _mm512_fmadd_ps(weight, v[w], acc[q][w]);
        }
    }
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < WIDTH; w++) _mm512_storeu_ps(queries[q].out + i + 16 * w, acc[q][w]);
    for (int q = 0; q < Q; q++) {
        const int64_t own_to = queries[q].length < to ? queries[q].length : to;
        float *out = queries[q].out + i;
        for (int64_t p = shared_to; p < own_to; p++) {
            __m512 weight = _mm512_set1_ps(queries[q].scores[p]);
            for (int w = 0; w < WIDTH; w++)
                _mm512_storeu_ps(out + 16 * w, _mm512_fmadd_ps(weight, load_kv16(values, p * head_dim + i + 16 * w, HALF),
                                                               _mm512_loadu_ps(out + 16 * w)));
        }
    }
}

#define SCORES16_CASE(Q, H) case Q: scores_of_tile16(queries, keys, from, to, head_dim, scaling, Q, H); break;
#define SCORES16_SWITCH(H) switch (count) { SCORES16_CASE(1, H) SCORES16_CASE(2, H) SCORES16_CASE(3, H) \
                                            SCORES16_CASE(4, H) SCORES16_CASE(5, H) SCORES16_CASE(6, H) }
#define SUMS16_CASE(Q, W, H) case 8 * Q + W: sums_of_tile16(queries, from, to, common, values, head_dim, i, Q, W, H); break;
#define SUMS16_CASES(Q, H) SUMS16_CASE(Q, 1, H) SUMS16_CASE(Q, 2, H) SUMS16_CASE(Q, 4, H)
#define SUMS16_SWITCH(H) switch (8 * count + width) { SUMS16_CASES(1, H) SUMS16_CASES(2, H) SUMS16_CASES(3, H) \
                                                      SUMS16_CASES(4, H) SUMS16_CASES(5, H) SUMS16_CASES(6, H) }

static void scores(const struct query *queries, int count, const void *keys, int64_t from_position,
                   int64_t to_position, int64_t head_dim, float scaling, int half) {
    const int64_t from = from_position / KEY_BLOCK, to = (to_position + KEY_BLOCK - 1) / KEY_BLOCK;
    if (half) SCORES16_SWITCH(1) else SCORES16_SWITCH(0)
}

static void weighted_sums(const struct query *queries, int count, const void *values, int64_t from, int64_t to,
                          int64_t common, int64_t head_dim, int half) {
    if (head_dim % 16) {
        weighted_sums8(queries, count, values, from, to, common, head_dim, half);
        return;
    }
    for (int64_t i = 0; i < head_dim;) {
        int64_t left = (head_dim - i) / 16;
        int width = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (half) SUMS16_SWITCH(1) else SUMS16_SWITCH(0)
        i += 16 * width;
    }
}
#else
static float exponentiate(float *scores, int64_t length) { return exponentiate8(scores, length); }

static void scores(const struct query *queries, int count, const void *keys, int64_t from, int64_t to,
                   int64_t head_dim, float scaling, int half) {
    scores8(queries, count, keys, from, to, head_dim, scaling, half);
}

static void weighted_sums(const struct query *queries, int count, const void *values, int64_t from, int64_t to,
                          int64_t common, int64_t head_dim, int half) {
    weighted_sums8(queries, count, values, from, to, common, head_dim, half);
}
#endif
#else
static float exponentiate(float *scores, int64_t length) {
    float maximum = -INFINITY, total = 0;
    for (int64_t p = 0; p < length; p++) maximum = scores[p] > maximum ? scores[p] : maximum;
    for (int64_t p = 0; p < length; p++) total += scores[p] = expf(scores[p] - maximum);
    return total;
}

static inline void add_key_lanes(float *sums, float x, const void *keys, int64_t index, const int HALF) {
    for (int lane = 0; lane < KEY_BLOCK; lane++) sums[lane] += x * load_kv(keys, index + lane, HALF);
}

/* A key block's positions in lanes (the compiler's vectors), each summed over d in order, as one position alone. */
static void scores(const struct query *queries, int count, const void *keys, int64_t from, int64_t to,
                   int64_t head_dim, float scaling, int half) {
    for (int q = 0; q < count; q++) {
        const int64_t end = to < queries[q].length ? to : queries[q].length;
        for (int64_t first = from / KEY_BLOCK * KEY_BLOCK; first < end; first += KEY_BLOCK) {
            const int64_t block = first * head_dim;
            float sums[KEY_BLOCK] = {0};
            for (int64_t d = 0; d < head_dim; d++)
                if (half)
                    add_key_lanes(sums, queries[q].q[d], keys, block + d * KEY_BLOCK, 1);
                else
                    add_key_lanes(sums, queries[q].q[d], keys, block + d * KEY_BLOCK, 0);
            for (int64_t p = first > from ? first : from; p < first + KEY_BLOCK && p < end; p++)
                queries[q].scores[p] = sums[p - first] * scaling;
        }
    }
}

static void weighted_sums(const struct query *queries, int count, const void *values, int64_t from, int64_t to,
                          int64_t common, int64_t head_dim, int half) {
    (void)common;
    for (int q = 0; q < count; q++) {
        float *out = queries[q].out;
        if (!from)
            for (int64_t i = 0; i < head_dim; i++) out[i] = 0;
        for (int64_t p = from; p < to && p < queries[q].length; p++)
            for (int64_t i = 0; i < head_dim; i++) out[i] += queries[q].scores[p] * load_kv(values, p * head_dim + i, half);
    }
}
#endif

struct attention_job {
    const float *qkv; /* [rows, (heads + 2 kv_heads) * head_dim]: queries first */
    const void *const *keys, *const *values; /* one layer's slots: slot s at keys[s], [kv_heads, capacities[s], head_dim] */
    float *out;                 /* [rows, heads * head_dim] */
    const int64_t *slots, *lengths, *capacities;
    const int64_t *tiles, *chunks; /* tile t: rows tiles[t]..tiles[t + 1]-1; chunk c: tiles chunks[c].. */
    int64_t kv_heads, group, capacity, head_dim, qkv_width; /* capacity: the largest slot's */
    float scaling;
    int64_t window; /* a sliding-window layer's: each query sees its last `window` positions (0: all) */
    int half;       /* keys and values in float16 (else float32) */
    atomic_int *out_of_memory; /* set by a unit that could not have its scores' memory */
};

struct query_set {
    struct query queries[TILE_QUERIES];
    int count;
    int64_t longest, common;
};

#define MAX_SETS (CHUNK_TILES * 2) /* a tile's heads fill at most two sets (group <= 8 heads, or <= 6 rows' heads) */

/* The chunk's query heads for one KV head, TILE_QUERIES at a time; returns how many sets. */
static int query_sets(const struct attention_job *job, int64_t chunk, int64_t kv_head, struct query_set *sets,
                      float *unit_scores) {
    const int64_t heads = job->kv_heads * job->group, stride = job->capacity + KEY_BLOCK, head_dim = job->head_dim;
    int count = 0;
    int64_t index = 0; /* the query's scores in this unit's */
    for (int64_t tile = job->chunks[chunk]; tile < job->chunks[chunk + 1]; tile++) {
        sets[count].count = 0;
        for (int64_t row = job->tiles[tile]; row < job->tiles[tile + 1]; row++)
            for (int64_t head = kv_head * job->group; head < (kv_head + 1) * job->group; head++) {
                struct query_set *set = &sets[count];
                if (set->count == TILE_QUERIES) (set = &sets[++count])->count = 0;
                set->queries[set->count++] = (struct query){job->qkv + row * job->qkv_width + head * head_dim,
                                                            unit_scores + index++ * stride,
                                                            job->out + (row * heads + head) * head_dim,
                                                            job->lengths[row]};
            }
        count++;
    }
    for (int s = 0; s < count; s++) {
        sets[s].longest = 0, sets[s].common = INT64_MAX;
        for (int q = 0; q < sets[s].count; q++) {
            int64_t length = sets[s].queries[q].length;
            sets[s].longest = length > sets[s].longest ? length : sets[s].longest;
            sets[s].common = length < sets[s].common ? length : sets[s].common;
        }
    }
    return count;
}

/* Positions from..to-1 of a float16 cache (keys or values: head_dim elements a position, contiguous) into
 * `floats` at the same indices, exactly. */
static void as_floats(const void *kv, int64_t from, int64_t to, int64_t head_dim, float *floats) {
    int64_t i = from * head_dim;
#if LOCKSTEP_AVX2
    for (; i + 8 <= to * head_dim; i += 8) _mm256_storeu_ps(floats + i, load_kv8(kv, i, 1));
#endif
    for (; i < to * head_dim; i++) floats[i] = load_kv(kv, i, 1);
}

/* One (chunk, KV head) unit: softmax(q . k * scaling) . v for each query head of the chunk's rows. */
static void attention_unit(const void *context, int64_t unit) {
    const struct attention_job *job = context;
    const int64_t chunk = unit / job->kv_heads, kv_head = unit % job->kv_heads, head_dim = job->head_dim;
    const int64_t slot = job->slots[job->tiles[job->chunks[chunk]]], at = kv_head * job->capacities[slot] * head_dim;
    const int64_t bytes = job->half ? 2 : 4;
    const void *keys = (const char *)job->keys[slot] + at * bytes, *values = (const char *)job->values[slot] + at * bytes;
    const int64_t rows = job->tiles[job->chunks[chunk + 1]] - job->tiles[job->chunks[chunk]];
    float *unit_scores = thread_scores(rows * job->group * (job->capacity + KEY_BLOCK) * (int64_t)sizeof(float));
    if (!unit_scores) {
        atomic_store(job->out_of_memory, 1);
        return;
    }
    struct query_set sets[MAX_SETS];
    const int count = query_sets(job, chunk, kv_head, sets, unit_scores);
    int64_t longest = 0;
    for (int s = 0; s < count; s++) longest = sets[s].longest > longest ? sets[s].longest : longest;
    /* float16 read by several sets: each position block converted once (exactly) for all of them */
    const int64_t blocked = (longest + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    float *floats = job->half && count > 1 ? thread_panel(blocked * head_dim * (int64_t)sizeof(float)) : NULL;
    const int half = job->half && !floats; /* what the kernels below read: the cache, or its floats */
    for (int64_t from = 0; from < longest; from += POSITION_BLOCK) {
        int64_t end = from + POSITION_BLOCK < blocked ? from + POSITION_BLOCK : blocked;
        if (floats) as_floats(keys, from, end, head_dim, floats);
        const void *block_keys = floats ? floats : keys;
        for (int s = 0; s < count; s++)
            if (from < sets[s].longest) {
                int64_t to = from + POSITION_BLOCK < sets[s].longest ? from + POSITION_BLOCK : sets[s].longest;
                scores(sets[s].queries, sets[s].count, block_keys, from, to, head_dim, job->scaling, half);
            }
    }
    for (int s = 0; s < count; s++)
        for (int q = 0; q < sets[s].count; q++) {
            float *weights = sets[s].queries[q].scores;
            int64_t length = sets[s].queries[q].length;
            /* a sliding window: the positions before it weigh nothing (scored, then dropped: simple, and exact) */
            for (int64_t p = 0; job->window && p < length - job->window; p++) weights[p] = -INFINITY;
            float inverse = 1.0f / exponentiate(weights, length);
            for (int64_t p = 0; p < length; p++) weights[p] *= inverse;
        }
    for (int64_t from = 0; from < longest; from += POSITION_BLOCK) {
        int64_t end = from + POSITION_BLOCK < longest ? from + POSITION_BLOCK : longest;
        if (floats) as_floats(values, from, end, head_dim, floats);
        const void *block_values = floats ? floats : values;
        for (int s = 0; s < count; s++)
            if (from < sets[s].longest)
                weighted_sums(sets[s].queries, sets[s].count, block_values, from, from + POSITION_BLOCK, sets[s].common,
                              head_dim, half);
    }
}

/* Tiles of the rows (neighbouring positions of one slot, up to TILE_QUERIES query heads each) and chunks of the
 * tiles (up to CHUNK_TILES of one slot); returns how many chunks. tiles: rows + 1 entries, chunks: rows + 1. */
static int64_t attention_chunks(const int64_t *slots, const int64_t *positions, int64_t rows, int64_t group,
                                int64_t *tiles, int64_t *chunks) {
    const int64_t rows_per_tile = group < TILE_QUERIES ? TILE_QUERIES / group : 1;
    int64_t tile_count = 0, chunk_count = 0;
    for (int64_t r = 0; r < rows; r++) {
        int next_to = r > 0 && slots[r] == slots[r - 1] && positions[r] == positions[r - 1] + 1;
        if (!next_to || r - tiles[tile_count - 1] == rows_per_tile) {
            if (!next_to || tile_count - chunks[chunk_count - 1] == CHUNK_TILES) chunks[chunk_count++] = tile_count;
            tiles[tile_count++] = r;
        }
    }
    tiles[tile_count] = rows, chunks[chunk_count] = tile_count;
    return chunk_count;
}

/* SwiGLU's product, silu(gate) * up (gate first in each row of gate_up). */
static void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t intermediate) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * intermediate, *up = gate + intermediate;
        int64_t i = 0;
#if LOCKSTEP_AVX2
        for (; i + 8 <= intermediate; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 sigmoid = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                           _mm256_add_ps(_mm256_set1_ps(1.0f), exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(out + r * intermediate + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < intermediate; i++) out[r * intermediate + i] = gate[i] * (1.0f / (1.0f + expf(-gate[i]))) * up[i];
    }
}

/* GeGLU's product (Gemma), gelu(gate) * up with the tanh approximation, as torch's gelu(approximate="tanh"). */
static void gelu_mul(const float *gate_up, float *out, int64_t rows, int64_t intermediate) {
    const float root_two_over_pi = 0.7978845608028654f;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * intermediate, *up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; i++) {
            const float x = gate[i];
            out[r * intermediate + i] = 0.5f * x * (1.0f + tanhf(root_two_over_pi * (x + 0.044715f * x * x * x))) * up[i];
        }
    }
}

enum { WEIGHTS_PER_LAYER = 11 };
enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1 };

/* Gemma's norms of a sublayer's output, before it joins the residual: hidden += norm(projected) (else +=). */
static void add_output(float *hidden, float *projected, const float *output_norm, int64_t rows, int64_t width,
                       float eps) {
    if (output_norm) rms_norm(projected, output_norm, projected, rows, width, eps);
    for (int64_t i = 0; i < rows * width; i++) hidden[i] += projected[i];
}

/* Rows through every layer of a Llama-shaped model (Qwen2 and Qwen3 too), then the final norm and lm_head for the
 * rows logit_rows lists: a decode step (row r: the next token of slot r), a prompt chunk (every row in the prompt's one slot, at
 * consecutive positions) or chunks of several prompts (one slot each), computed alike, so a chunked prompt gives
 * what decoding it token by token gives, alone or beside others.
 * dims: hidden, heads, kv_heads, head_dim, intermediate, slots, vocabulary, lm_head format, activation (SwiGLU's
 * silu or Gemma's GeGLU).
 * weights: WEIGHTS_PER_LAYER per layer (input norm f32, q/k/v, output, pre-FFN norm f32, gate/up, down, then
 * f32 or NULL: the q/k/v bias (Qwen2), the query and the key heads' norms (Qwen3, Gemma 3), normed with the layer's
 * first eps, the attention's and the FFN's output norms (Gemma 3), with its first eps), then the final norm and the
 * lm_head; windows: per layer, 0 or a sliding window (Gemma 3's local layers, rotated by cos_local and sin_local);
 * NULL: no window anywhere; formats: 4 per layer, the formats of q/k/v, output, gate/up and down (Q4_1 or Q8_0, plain or
 * regrouped by 8 rows, or Q4_0_X8, Q4_K_X8: a GGUF's block types mix, engine/backends/block_repack.py); eps: 2 per layer, then the final norm's; keys, values: per layer, per slot
 * s, that slot's cache [kv_heads, capacities[s], head_dim] (keys[layer * slots + s]; keys in blocks, key_offset),
 * float32 with exact, float16 without. hidden: [rows,
 * hidden] float32, updated in place; row r writes and attends in slot slots[r], at position positions[r] (it sees
 * positions 0..positions[r]), rotated by cos, sin [rows, head_dim]; logits: [logit_count, vocabulary]; exact: as
 * for lockstep_q4_linear. Returns 0, -1 if scratch memory could not be had, -2 for an interleaved format where it
 * cannot run. Rows of one slot must be in order of position. */
int lockstep_q4_forward(const int64_t *dims, int64_t layers, const void *const *weights, const int64_t *formats,
                        const float *eps, const int64_t *windows, const float *cos_local, const float *sin_local,
                        void *const *keys, void *const *values, const int64_t *capacities, float *hidden,
                        int64_t rows, const int64_t *slots, const int64_t *positions, const float *cos,
                        const float *sin, float scaling, float *logits, const int64_t *logit_rows,
                        int64_t logit_count, int helpers, int exact) {
    const int64_t width = dims[0], heads = dims[1], kv_heads = dims[2], head_dim = dims[3], intermediate = dims[4],
                  slot_count = dims[5], vocabulary = dims[6];
    int64_t capacity = 0; /* the largest slot's: the scores' stride */
    for (int64_t s = 0; s < slot_count; s++) capacity = capacities[s] > capacity ? capacities[s] : capacity;
    const int lm_head_format = (int)dims[7], activation = (int)dims[8];
    const int64_t group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * head_dim, kv_bytes = exact ? 4 : 2;
    for (int64_t layer = 0; layer < layers; layer++) {
        const int64_t *f = formats + 4 * layer;
        if (!x8_runs((int)f[0], qkv_width, width) || !x8_runs((int)f[1], width, heads * head_dim) ||
            !x8_runs((int)f[2], 2 * intermediate, width) || !x8_runs((int)f[3], width, intermediate))
            return -2;
    }
    if (!x8_runs(lm_head_format, vocabulary, width)) return -2;
    const int64_t attended_width = heads * head_dim;
    const int64_t floats = rows * (width + qkv_width + attended_width + width + 3 * intermediate);
    const int64_t widest = width > intermediate ? width : intermediate;
    float *normed = malloc(floats * sizeof(float) + 64);
    int64_t *lengths = malloc((3 * rows + 2) * sizeof(int64_t) + 8), *tiles = lengths + rows, *chunks = tiles + rows + 1;
    void *quantized = malloc(quantized_x_bytes(rows, widest > attended_width ? widest : attended_width));
    if (!normed || !lengths || !quantized) {
        free(normed), free(lengths), free(quantized);
        return -1;
    }
    atomic_int out_of_memory = 0;
    float *qkv = normed + rows * width, *attended = qkv + rows * qkv_width;
    float *projected = attended + rows * attended_width, *gate_up = projected + rows * width;
    float *activated = gate_up + rows * 2 * intermediate;
    int64_t attended_positions = 0;
    for (int64_t r = 0; r < rows; r++) attended_positions += lengths[r] = positions[r] + 1;
    const int64_t chunk_count = attention_chunks(slots, positions, rows, group, tiles, chunks);
    int shared = begin_shared(helpers);
    /* attention over few positions takes less time than handing it out (a wait for the helpers' last unit) */
    int share_attention = shared && attended_positions * heads * head_dim >= SHARED_ATTENTION_MACS;
    for (int64_t layer = 0; layer < layers; layer++) {
        const void *const *w = weights + WEIGHTS_PER_LAYER * layer;
        const int64_t *f = formats + 4 * layer; /* qkv, out, gate_up, down: each its own (a file's types mix) */
        const float *qkv_bias = w[6], *q_norm = w[7], *k_norm = w[8];
        const int64_t window = windows ? windows[layer] : 0;
        const float *layer_cos = window && cos_local ? cos_local : cos, *layer_sin = window && sin_local ? sin_local : sin;
        rms_norm(hidden, w[0], normed, rows, width, eps[2 * layer]);
        matmul(shared, normed, quantized, w[1], (int)f[0], qkv, rows, qkv_width, width, exact);
        for (int64_t r = 0; r < rows; r++) {
            float *token = qkv + r * qkv_width;
            if (qkv_bias)
                for (int64_t i = 0; i < qkv_width; i++) token[i] += qkv_bias[i];
            if (q_norm) /* Qwen3, Gemma 3: each head's query and key normed before the rotation */
                for (int64_t h = 0; h < heads + kv_heads; h++)
                    rms_norm(token + h * head_dim, h < heads ? q_norm : k_norm, token + h * head_dim, 1, head_dim,
                             eps[2 * layer]);
            rotate_heads(token, heads + kv_heads, head_dim, layer_cos + r * head_dim, layer_sin + r * head_dim);
            const int64_t slot = layer * slot_count + slots[r];
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t head = h * capacities[slots[r]] * head_dim, at = head + positions[r] * head_dim;
                /* a new key block: the scores read all its lanes, so those not written yet must hold numbers (what
                 * memory held may be subnormal, which is slow, or NaN) */
                if (positions[r] % KEY_BLOCK == 0) memset((char *)keys[slot] + at * kv_bytes, 0, KEY_BLOCK * head_dim * kv_bytes);
                for (int64_t d = 0; d < head_dim; d++) {
                    store_kv(keys[slot], head + key_offset(positions[r], d, head_dim), token[(heads + h) * head_dim + d],
                             !exact);
                    store_kv(values[slot], at + d, token[(heads + kv_heads + h) * head_dim + d], !exact);
                }
            }
        }
        struct attention_job attention = {qkv,      (const void *const *)keys + layer * slot_count,
                                          (const void *const *)values + layer * slot_count,
                                          attended, slots,     lengths,   capacities, tiles,    chunks,
                                          kv_heads, group,     capacity,  head_dim,   qkv_width, scaling, window,
                                          !exact,   &out_of_memory};
        run_units(share_attention, attention_unit, &attention, chunk_count * kv_heads);
        if (atomic_load(&out_of_memory)) break;
        matmul(shared, attended, quantized, w[2], (int)f[1], projected, rows, width, attended_width, exact);
        add_output(hidden, projected, w[9], rows, width, eps[2 * layer]);
        rms_norm(hidden, w[3], normed, rows, width, eps[2 * layer + 1]);
        matmul(shared, normed, quantized, w[4], (int)f[2], gate_up, rows, 2 * intermediate, width, exact);
        if (activation == ACTIVATION_GELU_TANH)
            gelu_mul(gate_up, activated, rows, intermediate);
        else
            silu_mul(gate_up, activated, rows, intermediate);
        matmul(shared, activated, quantized, w[5], (int)f[3], projected, rows, width, intermediate, exact);
        add_output(hidden, projected, w[10], rows, width, eps[2 * layer]);
    }
    if (atomic_load(&out_of_memory)) {
        if (shared) end_shared();
        free(normed), free(lengths), free(quantized);
        return -1;
    }
    for (int64_t i = 0; i < logit_count; i++) /* each row normed alone, as rms_norm does row by row */
        rms_norm(hidden + logit_rows[i] * width, weights[WEIGHTS_PER_LAYER * layers], normed + i * width, 1, width,
                 eps[2 * layers]);
    matmul(shared, normed, quantized, weights[WEIGHTS_PER_LAYER * layers + 1], lm_head_format, logits, logit_count,
           vocabulary, width, exact);
    if (shared) end_shared();
    free(normed), free(lengths), free(quantized);
    return 0;
}
