/* What the bfloat16 prefill kernel (keyfold/kernels/prefill.c) can overlap on a CPU with AMX: the tile
 * unit's products (tdpbf16ps) beside the AVX-512 softmax, and a Q K^T block's tile loads from L1 or L2.
 * One core, timestamp counter cycles (not core cycles: compare rows with each other, not with a
 * datasheet). Linux only (the tile registers are asked for with arch_prctl).
 *
 *   gcc -O2 -march=native benchmarks/amx_overlap.c -o /tmp/amx_overlap && /tmp/amx_overlap
 *
 * Rows:
 *   tdp                 one tdpbf16ps (16 x 16 x 32) of four independent accumulators, operands in tiles
 *   softmax row         16 vectors of scores from L1: y - m as one FMA, 2^x (degree 3, vreduceps and
 *                       vscalefps), the row's sum, P rounded to bfloat16 and stored: the kernel's loop
 *   row + k tdp         the row with k products issued before it: additive where both need the ports
 *   chains + 4 tdp      64 FMAs in 4 dependent chains (latency-bound, ports idle) beside 4 products
 *   Q K^T block         a 32 x 32 score block at head size 64 as scores_amx does it (8 tile loads, 8
 *                       products, 4 tile stores) with K's 4 KiB in L1, or swept over 1 MiB (in L2), or
 *                       swept with the next block's K prefetched a step ahead; and with K in L1, the
 *                       scores' rows stored 1088 bytes apart instead of the kernel's 1024, or not
 *                       stored at all (what the four tile stores cost)
 *   ports               96 independent instructions of one kind alone and after 4 products: which
 *                       wait for the tile unit (the multiplier's: FMA, mul, vreduceps, vscalefps,
 *                       max) and which run beside it (adds, integer adds, logic); "hidden" is the
 *                       share of the shorter of the two that overlapped
 *   a 32 x 32 block     its softmax (64 vectors) with its 16 products spread through it, y - m as
 *                       the kernel's FMA or as a subtraction (q pre-scaled; the kernel does not), and
 *                       2^x from a table of 32 steps instead of the polynomial (exp2_table: adds, two
 *                       permutes, one FMA and vscalefps; tried in the kernel 2026-12-07, not kept) */
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

static float scores[32 * 256] __attribute__((aligned(64)));
static uint16_t probs[32 * 256] __attribute__((aligned(64)));

static inline __m512 exp2_bf(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, 0x09);
    __m512 p = _mm512_set1_ps(7.706519961357117e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2764700651168823e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.951163411140442e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

/* 2^x as 2^floor(xr) 2^(j/32) (1 + r ln 2): xr = x rounded to 1/32 by adding and subtracting 1.5 * 2^18
 * (the sum's low 5 bits index the table), r = x - xr in [-1/64, 1/64]; relative error below 6e-5 (the
 * polynomial's 9e-5). Three multiplier instructions a vector where exp2_bf has six (its vreduceps and
 * FMAs); the adds run beside the products, the permutes (port 5) partly. */
static float tab_t[32] __attribute__((aligned(64))), tab_c[32] __attribute__((aligned(64)));

static inline __m512 exp2_table(__m512 x) {
    const __m512 mg = _mm512_set1_ps(393216.0f);
    const __m512 y = _mm512_add_ps(x, mg), xr = _mm512_sub_ps(y, mg), r = _mm512_sub_ps(x, xr);
    const __m512i j = _mm512_castps_si512(y);
    const __m512 t = _mm512_permutex2var_ps(_mm512_load_ps(tab_t), j, _mm512_load_ps(tab_t + 16));
    const __m512 c = _mm512_permutex2var_ps(_mm512_load_ps(tab_c), j, _mm512_load_ps(tab_c + 16));
    return _mm512_scalef_ps(_mm512_fmadd_ps(c, r, t), xr);
}

static inline __m512 softmax_row(int r, __m512 a, __m512 b) {
    const float *s = scores + (r & 31) * 256;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int u = 0; u < 8; u++) {
        const __m512 p0 = exp2_bf(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * u), a, b));
        const __m512 p1 = exp2_bf(_mm512_fmsub_ps(_mm512_load_ps(s + 32 * u + 16), a, b));
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        _mm512_store_si512(probs + (r & 31) * 256 + 32 * u, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return _mm512_add_ps(s0, s1);
}

#define TDP4() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)

/* ---------------------------------------------------------------------- ports and the block */

#define N_PORTS 20000
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
        for (int i = 0; i < N_PORTS; i++) { for (int j = 0; j < 8; j++) { EACH(OP) } KEEP; } \
        const double alone = (double)(__rdtsc() - t) / N_PORTS; \
        t = __rdtsc(); \
        for (int i = 0; i < N_PORTS; i++) { TDP4(); for (int j = 0; j < 8; j++) { EACH(OP) } KEEP; } \
        _tile_stored(0, sink, 64); \
        const double both = (double)(__rdtsc() - t) / N_PORTS, lo = alone < tdp ? alone : tdp; \
        printf("  %-24s %6.1f   %6.1f   %4.0f%%\n", NAME, alone, both, 100.0 * (alone + tdp - both) / lo); \
    } while (0)

/* ports: one instruction kind at a time, beside the products or not */

static void ports(float *sink) {
    const __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(1.0f), z = _mm512_setzero_ps();
    const __m256 a8 = _mm256_set1_ps(0.5f), b8 = _mm256_set1_ps(1.0f);
    const __m512i idx = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v0 = a, v1 = b, v2 = a, v3 = b, v4 = a, v5 = b, v6 = a, v7 = b, v8 = a, v9 = b, v10 = a, v11 = b;
    unsigned long long t = __rdtsc();
    for (int i = 0; i < N_PORTS; i++) TDP4();
    _tile_stored(0, sink, 64);
    const double tdp = (double)(__rdtsc() - t) / N_PORTS;
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

/* a block: its softmax with its products */

static inline __m512 block_row(int r, __m512 a, __m512 b, const int sub) {
    const float *s = scores + r * 32;
    const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);
    const __m512 x0 = sub == 1 ? _mm512_sub_ps(s0, b) : _mm512_fmsub_ps(s0, a, b);
    const __m512 x1 = sub == 1 ? _mm512_sub_ps(s1, b) : _mm512_fmsub_ps(s1, a, b);
    const __m512 p0 = sub == 2 ? exp2_table(x0) : exp2_bf(x0), p1 = sub == 2 ? exp2_table(x1) : exp2_bf(x1);
    _mm512_store_si512(probs + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    return _mm512_add_ps(p0, p1);
}

static void block_softmax(float *sink) {
    const __m512 a = _mm512_set1_ps(1.1f), b = _mm512_set1_ps(3.0f);
    __m512 acc = _mm512_setzero_ps();
    unsigned long long t = __rdtsc();
    for (int i = 0; i < N_PORTS; i++) { TDP4(); TDP4(); TDP4(); TDP4(); }
    _tile_stored(0, sink, 64);
    printf("\na 32 x 32 block: 16 products alone %.0f\n  softmax                  alone   +16 tdp\n",
           (double)(__rdtsc() - t) / N_PORTS);
    static const char *how[3] = {"x = S a - b (vfmsub)", "x = S - b (vsubps)", "vfmsub, 2^x by table"};
    for (int sub = 0; sub < 3; sub++) {
        t = __rdtsc();
        for (int i = 0; i < N_PORTS; i++)
            for (int r = 0; r < 32; r++) acc = _mm512_add_ps(acc, block_row(r, a, b, sub));
        const double alone = (double)(__rdtsc() - t) / N_PORTS;
        t = __rdtsc();
        for (int i = 0; i < N_PORTS; i++)
            for (int r = 0; r < 32; r++) {
                if (r % 8 == 0) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); }
                if (r % 8 == 4) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
                acc = _mm512_add_ps(acc, block_row(r, a, b, sub));
            }
        _tile_stored(0, sink, 64);
        printf("  %-24s %6.0f   %6.0f\n", how[sub], alone,
               (double)(__rdtsc() - t) / N_PORTS);
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
    double step = 1.0;  /* 2^(j/32) in double, no libm: 2^(1/32) multiplied up */
    for (int j = 0; j < 32; j++, step *= 1.0218971486541166) {
        tab_t[j] = (float)step;
        tab_c[j] = (float)(step * 0.69314718055994531);
    }
    const size_t nk = (size_t)1 << 19;  /* 1 MiB of bfloat16 keys: 256 blocks of 4 KiB */
    uint16_t *K = aligned_alloc(64, nk * 2), *Q = aligned_alloc(64, 32 * 64 * 2);
    float *S = aligned_alloc(64, 32 * 256 * 4);
    for (size_t i = 0; i < nk; i++) K[i] = 0x3c00;
    for (int i = 0; i < 32 * 64; i++) Q[i] = 0x3c00;
    for (int i = 0; i < 32 * 256; i++) scores[i] = (float)(i % 97) * 0.01f;
    _tile_loadd(4, Q, 128); _tile_loadd(5, Q, 128); _tile_loadd(6, K, 64); _tile_loadd(7, K, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int N = 20000;
    const __m512 a = _mm512_set1_ps(1.1f), b = _mm512_set1_ps(3.0f);
    const __m512 ca = _mm512_set1_ps(0.5f), cb = _mm512_set1_ps(1.0f);  /* chains x = x/2 + 1: toward 2 */
    __m512 acc = _mm512_setzero_ps(), x0 = a, x1 = b, x2 = a, x3 = b;
    unsigned long long t = __rdtsc();
    for (int i = 0; i < N; i++) TDP4();
    _tile_stored(0, S, 64);
    const double tdp = (double)(__rdtsc() - t) / (4.0 * N);
    printf("tdp                      %7.1f\n", tdp);
    t = __rdtsc();
    for (int i = 0; i < N; i++) acc = _mm512_add_ps(acc, softmax_row(i, a, b));
    const double row = (double)(__rdtsc() - t) / N;
    printf("softmax row (16 vectors) %7.1f\n", row);
    for (int k = 1; k <= 8; k *= 2) {
        t = __rdtsc();
        for (int i = 0; i < N; i++) {
            _tile_dpbf16ps(0, 4, 6);
            if (k >= 2) _tile_dpbf16ps(1, 4, 7);
            if (k >= 4) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
            if (k >= 8) TDP4();
            acc = _mm512_add_ps(acc, softmax_row(i, a, b));
        }
        _tile_stored(0, S, 64);
        printf("row + %d tdp              %7.1f   (in turn %.1f, the longer alone %.1f)\n", k,
               (double)(__rdtsc() - t) / N, row + k * tdp, row > k * tdp ? row : k * tdp);
    }
    t = __rdtsc();
    for (int i = 0; i < N; i++)
        for (int j = 0; j < 16; j++) {
            x0 = _mm512_fmadd_ps(x0, ca, cb); x1 = _mm512_fmadd_ps(x1, ca, cb);
            x2 = _mm512_fmadd_ps(x2, ca, cb); x3 = _mm512_fmadd_ps(x3, ca, cb);
        }
    const double chains = (double)(__rdtsc() - t) / N;
    t = __rdtsc();
    for (int i = 0; i < N; i++) {
        TDP4();
        for (int j = 0; j < 16; j++) {
            x0 = _mm512_fmadd_ps(x0, ca, cb); x1 = _mm512_fmadd_ps(x1, ca, cb);
            x2 = _mm512_fmadd_ps(x2, ca, cb); x3 = _mm512_fmadd_ps(x3, ca, cb);
        }
    }
    _tile_stored(0, S, 64);
    printf("chains + 4 tdp           %7.1f   (in turn %.1f, the longer alone %.1f)\n", (double)(__rdtsc() - t) / N,
           chains + 4 * tdp, chains > 4 * tdp ? chains : 4 * tdp);
    static const char *where[5] = {"K in L1", "K swept over 1 MiB (L2)", "swept, next K prefetched",
                                   "K in L1, rows 1088 B apart", "K in L1, scores not stored"};
    float *S2 = aligned_alloc(64, 32 * 272 * 4);
    for (int pass = 0; pass < 5; pass++) {
        t = __rdtsc();
        for (int i = 0; i < N; i++) {
            const uint16_t *k = K + (pass == 1 || pass == 2 ? (size_t)(i % 256) * 2048 : 0);
            if (pass == 2) {
                const char *next = (const char *)(K + (size_t)((i + 1) % 256) * 2048);
                for (int x = 0; x < 4096; x += 64) _mm_prefetch(next + x, _MM_HINT_T0);
            }
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int c = 0; c < 2; c++) {
                _tile_loadd(4, Q + 32 * c, 128);
                _tile_loadd(5, Q + 16 * 64 + 32 * c, 128);
                _tile_loadd(6, k + 2 * c * 512, 64);
                _tile_loadd(7, k + (2 * c + 1) * 512, 64);
                TDP4();
            }
            if (pass == 4) continue;
            if (pass == 3) {
                float *s = S2 + (i % 8) * 32;
                _tile_stored(0, s, 1088); _tile_stored(1, s + 16, 1088);
                _tile_stored(2, s + 16 * 272, 1088); _tile_stored(3, s + 16 * 272 + 16, 1088);
                continue;
            }
            float *s = S + (i % 8) * 32;
            _tile_stored(0, s, 1024); _tile_stored(1, s + 16, 1024);
            _tile_stored(2, s + 16 * 256, 1024); _tile_stored(3, s + 16 * 256 + 16, 1024);
        }
        printf("Q K^T block, %-30s %7.1f\n", where[pass], (double)(__rdtsc() - t) / N);
    }
    _tile_stored(0, S2, 64);
    puts("");
    ports(S2);
    block_softmax(S2);
    _tile_release();
    float sink[16];
    _mm512_storeu_ps(sink, _mm512_add_ps(_mm512_add_ps(x0, x1), _mm512_add_ps(_mm512_add_ps(x2, x3), acc)));
    printf("(checksum %g)\n", (double)sink[0] + S[5] + S2[7] + probs[3]);
    free(K); free(Q); free(S); free(S2);
    return 0;
}
#else
int main(void) {
    puts("needs AMX-BF16 and AVX-512-BF16 on Linux, built with -march=native on such a CPU");
    return 0;
}
#endif
