/* What keyfold's native kernels (decode.c, prefill.c, backward.c) share: float32 e^x on 16 lanes, a transposing
 * reduction of 16 vectors, lane masks, a 16 x 16 transpose of 32-bit words, and what the AMX kernels share
 * (the tile layout, the pairing of two bfloat16 rows). Each kernel is compiled with AVX-512 F, BW and VL
 * (keyfold/kernels/native.py). */
#ifndef KEYFOLD_SIMD_H
#define KEYFOLD_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* AMX-BF16 in the build (-march=native on a CPU with it): the bfloat16 products of prefill.c and backward.c
 * on tiles; Linux lets a process use the tile registers once it has asked (kf_prefill_init) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KF_AMX 1
#endif

/* e^x for x <= 0 (a score minus its row's running max): x = n ln2 + r, |r| <= ln2/2, with ln2 in two
 * parts so r is exact; e^r by Cephes' degree-6 polynomial (about 1 ulp); 2^n by vscalefps. Below -87
 * (and at -inf) it gives 0: e^-87 is at the bottom of float32's normal range. NaN gives NaN (a NaN or
 * infinite input must reach the output, as in PyTorch's op, never vanish as 0): one compare, true
 * for NaN, keeps the lanes. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* Lane j of the result = the sum of t[j]'s lanes: a transpose-and-add tree, 15 shuffle-and-add steps
 * for 16 vectors instead of 16 horizontal sums. */
static inline __m512 tree16(const __m512 *t) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* the first n lanes of 16 */
static inline __mmask16 first(int n) { return n >= 16 ? 0xFFFF : (__mmask16)(0xFFFFu >> (16 - n)); }
/* the first n lanes of 32 (16-bit elements); none for n <= 0 */
static inline __mmask32 first32(int n) {
    return n <= 0 ? 0 : n >= 32 ? 0xFFFFFFFFu : (__mmask32)(0xFFFFFFFFu >> (32 - n));
}

/* lanes [lo, hi) of 16 (clipped) */
static inline __mmask16 lanes(long long lo, long long hi) {
    if (lo < 0) lo = 0;
    if (hi > 16) hi = 16;
    return hi <= lo ? 0 : (__mmask16)(first((int)hi) & ~first((int)lo));
}

/* x[r] lane c becomes x[c] lane r: a 16 x 16 transpose of 32-bit words in four rounds of shuffles
 * (unpacks within 128-bit lanes, then the 4 x 4 transpose of the lanes), in place of a gather per row */
static inline __attribute__((always_inline)) void transpose16(__m512i *x) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u[4i + k], lane L: rows 4i .. 4i + 3 of column 4L + k */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {  /* column 4L + k: lane g from u[4g + k], lane L */
        const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        x[k] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        x[4 + k] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        x[8 + k] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        x[12 + k] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}

/* word 2x of the result is a's element x, word 2x + 1 b's (16 bfloat16 each): two rows as the pairs of a
 * tile operand whose products run over rows (a V tile, a row-paired Q or dO) */
static inline __m512i pair_rows(__m256i a, __m256i b) {
    static const uint16_t order[32] __attribute__((aligned(64))) = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45,
        14, 46, 15, 47};
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), _mm512_load_si512(order), _mm512_castsi256_si512(b));
}

#define TILE 512  /* bfloat16 elements in one 16 x 64-byte AMX tile */

#ifdef KF_AMX

/* the AMX tile configuration: palette 1, all eight tiles 16 rows x 64 bytes */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static inline tilecfg_t tiles16x64(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    return cfg;
}
#endif

#endif
