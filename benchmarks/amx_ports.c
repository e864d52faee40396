/* Which AVX-512 instructions run beside the tile unit's products (tdpbf16ps) and which wait for them:
 * the question behind bfloat16 prefill's softmax (keyfold/kernels/prefill.c). One core, timestamp
 * counter cycles (compare rows with each other, not with a datasheet). Linux only.
 *
 *   gcc -O2 -march=native benchmarks/amx_ports.c -o /tmp/amx_ports && /tmp/amx_ports
 *
 * Part 1, per instruction: 96 independent instructions (12 chains of 8) alone, and after 4 products
 * of 4 independent accumulators; "hidden" is the share of the shorter of the two that overlapped
 * (100%: the pair took the longer one's time, 0%: the sum of both).
 * Part 2, the kernel's shape: the softmax of a 32 x 32 block of scores (64 vectors: y - m, 2^x of
 * degree 3, the row sums, P to bfloat16 and stored) with 16 products spread through it (a block's
 * Q K^T and P V at head size 64), for x = S a - b as the kernel takes it (one FMA) and as x = S - b
 * (a subtraction: q pre-scaled by scale log2 e, which the kernel does not do; see README). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

#define N_ITER 20000
#define TDP4() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)

/* ---------------------------------------------------------------- part 1: one instruction kind */

#define EACH(OP) OP(v0) OP(v1) OP(v2) OP(v3) OP(v4) OP(v5) OP(v6) OP(v7) OP(v8) OP(v9) OP(v10) OP(v11)
#define KEEP __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5), "+v"(v6), "+v"(v7), \
                              "+v"(v8), "+v"(v9), "+v"(v10), "+v"(v11))
#define OP_FMA(X) X = _mm512_fmadd_ps(X, a, b);
#define OP_MUL(X) X = _mm512_mul_ps(X, a);
#define OP_ADD(X) X = _mm512_add_ps(X, a);
#define OP_MAX(X) X = _mm512_max_ps(X, a);
#define OP_REDUCE(X) X = _mm512_reduce_ps(X, 0x09);
#define OP_SCALEF(X) X = _mm512_scalef_ps(X, z);
#define OP_ADDI(X) X = (__m512)_mm512_add_epi32((__m512i)X, (__m512i)a);
#define OP_LOGIC(X) X = (__m512)_mm512_ternarylogic_epi32((__m512i)X, (__m512i)a, (__m512i)b, 0x96);
#define OP_PERM(X) X = _mm512_permutexvar_ps(idx, X);
#define OP_FMA256(X) X = _mm512_castps256_ps512(_mm256_fmadd_ps(_mm512_castps512_ps256(X), a8, b8));

#define PROBE(NAME, OP) do { \
        unsigned long long t = __rdtsc(); \
        for (int i = 0; i < N_ITER; i++) { for (int j = 0; j < 8; j++) { EACH(OP) } KEEP; } \
        const double alone = (double)(__rdtsc() - t) / N_ITER; \
        t = __rdtsc(); \
        for (int i = 0; i < N_ITER; i++) { TDP4(); for (int j = 0; j < 8; j++) { EACH(OP) } KEEP; } \
        _tile_stored(0, sink, 64); \
        const double both = (double)(__rdtsc() - t) / N_ITER, lo = alone < tdp ? alone : tdp; \
        printf("  %-24s %6.1f   %6.1f   %4.0f%%\n", NAME, alone, both, 100.0 * (alone + tdp - both) / lo); \
    } while (0)

static void part1(float *sink) {
    const __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(1.0f), z = _mm512_setzero_ps();
    const __m256 a8 = _mm256_set1_ps(0.5f), b8 = _mm256_set1_ps(1.0f);
    const __m512i idx = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v0 = a, v1 = b, v2 = a, v3 = b, v4 = a, v5 = b, v6 = a, v7 = b, v8 = a, v9 = b, v10 = a, v11 = b;
    unsigned long long t = __rdtsc();
    for (int i = 0; i < N_ITER; i++) TDP4();
    _tile_stored(0, sink, 64);
    const double tdp = (double)(__rdtsc() - t) / N_ITER;
    printf("4 products alone: %.1f\n  96 instructions          alone   +4 tdp   hidden\n", tdp);
    PROBE("vfmadd (zmm)", OP_FMA);
    PROBE("vmulps (zmm)", OP_MUL);
    PROBE("vreduceps (zmm)", OP_REDUCE);
    PROBE("vscalefps (zmm)", OP_SCALEF);
    PROBE("vmaxps (zmm)", OP_MAX);
    PROBE("vaddps (zmm)", OP_ADD);
    PROBE("vpaddd (zmm)", OP_ADDI);
    PROBE("vpternlogd (zmm)", OP_LOGIC);
    PROBE("vpermps (zmm)", OP_PERM);
    PROBE("vfmadd (ymm)", OP_FMA256);
    float keep[16];
    _mm512_storeu_ps(keep, _mm512_add_ps(_mm512_add_ps(v0, v5), v11));
    sink[0] += keep[0];
}

/* ------------------------------------------------------------- part 2: a block's softmax */

static float scores[32 * 32] __attribute__((aligned(64)));
static uint16_t probs[32 * 32] __attribute__((aligned(64)));

static inline __m512 exp2_bf(__m512 x) {  /* prefill.c's exp2_16_bf */
    const __m512 f = _mm512_reduce_ps(x, 0x09);
    __m512 p = _mm512_set1_ps(7.706519961357117e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2764700651168823e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.951163411140442e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

static inline __m512 row(int r, __m512 a, __m512 b, const int sub) {
    const float *s = scores + r * 32;
    const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);
    const __m512 p0 = exp2_bf(sub ? _mm512_sub_ps(s0, b) : _mm512_fmsub_ps(s0, a, b));
    const __m512 p1 = exp2_bf(sub ? _mm512_sub_ps(s1, b) : _mm512_fmsub_ps(s1, a, b));
    _mm512_store_si512(probs + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return _mm512_add_ps(p0, p1);
}

static void part2(float *sink) {
    for (int i = 0; i < 32 * 32; i++) scores[i] = (float)(i % 97) * 0.01f;
    const __m512 a = _mm512_set1_ps(1.1f), b = _mm512_set1_ps(3.0f);
    __m512 acc = _mm512_setzero_ps();
    unsigned long long t = __rdtsc();
    for (int i = 0; i < N_ITER; i++) { TDP4(); TDP4(); TDP4(); TDP4(); }
    _tile_stored(0, sink, 64);
    printf("\na 32 x 32 block: 16 products alone %.0f\n  softmax                  alone   +16 tdp\n",
           (double)(__rdtsc() - t) / N_ITER);
    for (int sub = 0; sub < 2; sub++) {
        t = __rdtsc();
        for (int i = 0; i < N_ITER; i++)
            for (int r = 0; r < 32; r++) acc = _mm512_add_ps(acc, row(r, a, b, sub));
        const double alone = (double)(__rdtsc() - t) / N_ITER;
        t = __rdtsc();
        for (int i = 0; i < N_ITER; i++)
            for (int r = 0; r < 32; r++) {
                if (r % 8 == 0) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); }
                if (r % 8 == 4) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
                acc = _mm512_add_ps(acc, row(r, a, b, sub));
            }
        _tile_stored(0, sink, 64);
        printf("  %-24s %6.0f   %6.0f\n", sub ? "x = S - b (vsubps)" : "x = S a - b (vfmsub)", alone,
               (double)(__rdtsc() - t) / N_ITER);
    }
    float keep[16];
    _mm512_storeu_ps(keep, acc);
    sink[1] += keep[0] + probs[5];
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        puts("the OS did not grant the tile registers");
        return 1;
    }
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    uint16_t *ones = aligned_alloc(64, 32 * 64 * 2);
    float *sink = aligned_alloc(64, 16 * 16 * 4);
    for (int i = 0; i < 32 * 64; i++) ones[i] = 0x3c00;
    _tile_loadd(4, ones, 128); _tile_loadd(5, ones, 128); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    part1(sink);
    part2(sink);
    _tile_release();
    printf("(checksum %g)\n", (double)sink[0] + sink[1]);
    free(ones);
    free(sink);
    return 0;
}
#else
int main(void) {
    puts("needs AMX-BF16 and AVX-512-BF16 on Linux, built with -march=native on such a CPU");
    return 0;
}
#endif
