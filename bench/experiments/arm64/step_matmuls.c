/* One decode step's weight matmuls of the embedded model (30 layers' qkv, o, gate_up and down in Q4_1, the lm_head
 * in Q8_0), on random blocks, through a q4_kernels build's lockstep_q4_linear on one thread, regrouped by 8 rows
 * (Q4_1_X8, Q8_0_X8) where the build reads them so, as the forward does:
 *     step_matmuls LIBRARY ROWS EXACT STEPS
 * prints a hash of the last step's outputs (the same bits from two builds: the same numbers). Run under qemu-user
 * with insn_count.c, the difference of two STEPS counts is the instructions of a step (bench/experiments/arm64/count). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*linear_fn)(const float *, const uint8_t *, int, float *, int64_t, int64_t, int64_t, int, int);
typedef void (*interleave_fn)(const uint8_t *, int, int64_t, int64_t, uint8_t *);
typedef int (*interleaves_fn)(void);
enum { FORMAT_Q4_1 = 0, FORMAT_Q8_0 = 1, FORMAT_X8 = 2 /* FORMAT_Q4_1_X8 - FORMAT_Q4_1 */, LAYERS = 30 };
static const struct { int format; int64_t n, k; } SHAPES[] = {
    {FORMAT_Q4_1, 960, 576}, {FORMAT_Q4_1, 576, 576}, {FORMAT_Q4_1, 3072, 576}, {FORMAT_Q4_1, 576, 1536},
    {FORMAT_Q8_0, 49152, 576}};
#define SHAPE_COUNT (sizeof SHAPES / sizeof SHAPES[0])

static uint64_t random_state = 88172645463325252ull;
static uint64_t next_random(void) {
    random_state ^= random_state << 13, random_state ^= random_state >> 7, random_state ^= random_state << 17;
    return random_state;
}

static int64_t block_bytes(int format) { return format == FORMAT_Q4_1 ? 20 : 34; }

/* Random blocks with float16 scales of about 0.02 and minimums of about -0.02, as the model's. */
static uint8_t *random_blocks(int format, int64_t n, int64_t k) {
    const int64_t bytes = block_bytes(format), count = n * (k / 32);
    uint8_t *blocks = malloc(count * bytes);
    for (int64_t i = 0; i < count * bytes; i++) blocks[i] = (uint8_t)next_random();
    for (int64_t b = 0; b < count; b++) {
        uint8_t *block = blocks + b * bytes;
        const uint16_t scale = 0x2000 | (next_random() & 0x3FF), minimum = 0xA000 | (next_random() & 0x3FF);
        block[0] = (uint8_t)scale, block[1] = (uint8_t)(scale >> 8);
        if (format == FORMAT_Q4_1) block[2] = (uint8_t)minimum, block[3] = (uint8_t)(minimum >> 8);
    }
    return blocks;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s LIBRARY ROWS EXACT STEPS\n", argv[0]);
        return 2;
    }
    void *library = dlopen(argv[1], RTLD_NOW);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    linear_fn linear = (linear_fn)dlsym(library, "lockstep_q4_linear");
    interleave_fn interleave = (interleave_fn)dlsym(library, "lockstep_q4_interleave");
    interleaves_fn interleaves = (interleaves_fn)dlsym(library, "lockstep_q4_interleaves"); /* absent: plain */
    const int64_t rows = atoll(argv[2]);
    const int exact = atoi(argv[3]), steps = atoi(argv[4]);
    const int regrouped = interleaves && interleaves();
    uint8_t *weights[SHAPE_COUNT];
    int formats[SHAPE_COUNT];
    float *x = malloc(rows * 1536 * sizeof(float)), *out[SHAPE_COUNT];
    for (size_t s = 0; s < SHAPE_COUNT; s++) {
        weights[s] = random_blocks(SHAPES[s].format, SHAPES[s].n, SHAPES[s].k);
        formats[s] = SHAPES[s].format;
        if (regrouped) {
            const int64_t bytes = SHAPES[s].n * (SHAPES[s].k / 32) * block_bytes(SHAPES[s].format);
            uint8_t *grouped = malloc(bytes);
            interleave(weights[s], SHAPES[s].format, SHAPES[s].n, SHAPES[s].k, grouped);
            free(weights[s]);
            weights[s] = grouped, formats[s] += FORMAT_X8;
        }
        out[s] = malloc(rows * SHAPES[s].n * sizeof(float));
    }
    for (int64_t i = 0; i < rows * 1536; i++) x[i] = (float)((int64_t)(next_random() % 2001) - 1000) / 500.0f;
    for (int step = 0; step < steps; step++)
        for (size_t s = 0; s < SHAPE_COUNT; s++)
            for (int layer = 0; layer < (SHAPES[s].format == FORMAT_Q8_0 ? 1 : LAYERS); layer++)
                if (linear(x, weights[s], formats[s], out[s], rows, SHAPES[s].n, SHAPES[s].k, 0, exact)) {
                    fprintf(stderr, "lockstep_q4_linear refused shape %zu\n", s);
                    return 1;
                }
    uint64_t hash = 1469598103934665603ull; /* FNV-1a of every output's bytes */
    for (size_t s = 0; s < SHAPE_COUNT; s++)
        for (int64_t i = 0; i < (int64_t)(rows * SHAPES[s].n * sizeof(float)); i++)
            hash = (hash ^ ((const uint8_t *)out[s])[i]) * 1099511628211ull;
    printf("%016llx\n", (unsigned long long)hash);
    return 0;
}
