/* What keyfold's native kernels (decode.c, prefill.c, backward.c) share: float32 e^x on 16 lanes, a transposing
 * reduction of 16 vectors, lane masks, a 16 x 16 transpose of 32-bit words, and what the AMX kernels share
 * (the tile layout, the pairing of two bfloat16 rows). decode.c is compiled with AVX-512 F, BW and VL
 * (keyfold/kernels/native.py); prefill.c (its float32 path) and backward.c also where the CPU has AVX2 but no
 * AVX-512, through the 16-lane layer at the end of this file ("16 lanes on either ISA"). */
#ifndef KEYFOLD_SIMD_H
#define KEYFOLD_SIMD_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the first n lanes of 16 */
static inline __mmask16 first(int n) { return n >= 16 ? 0xFFFF : (__mmask16)(0xFFFFu >> (16 - n)); }

/* lanes [lo, hi) of 16 (clipped) */
static inline __mmask16 lanes(long long lo, long long hi) {
    if (lo < 0) lo = 0;
    if (hi > 16) hi = 16;
    return hi <= lo ? 0 : (__mmask16)(first((int)hi) & ~first((int)lo));
}

#define TILE 512  /* bfloat16 elements in one 16 x 64-byte AMX tile */

#ifdef __AVX512F__

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

/* the first n lanes of 32 (16-bit elements); none for n <= 0 */
static inline __mmask32 first32(int n) {
    return n <= 0 ? 0 : n >= 32 ? 0xFFFFFFFFu : (__mmask32)(0xFFFFFFFFu >> (32 - n));
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

#endif  /* __AVX512F__ */

/* 16 lanes on either ISA: what backward.c and prefill.c's float32 path compute with, so one source runs on
 * AVX-512 and on AVX2 (two 8-lane halves, lanes 0-7 and 8-15). Each lane does the same arithmetic in the
 * same order on both, so the two builds give the same bits; only how many vectors a register tile holds
 * differs (VF_TILE 16-float and VD_TILE 8-double vectors a row: AVX2 has 16 registers, AVX-512 32 of
 * twice the width).
 *     vf: 16 float32    vd: 8 float64    __mmask16: a lane mask, bit i lane i
 * The AVX-512 layer needs F, BW, VL and DQ; a CPU with AVX-512 F alone (Xeon Phi) takes the AVX2 one. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
typedef __m512 vf;
typedef __m512d vd;
#define VF_TILE 4
#define VD_TILE 8
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_load_ps(p); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm512_store_ps(p, x); }
static inline void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_maskz_loadu(__mmask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline vf vf_maskz(__mmask16 m, vf x) { return _mm512_maskz_mov_ps(m, x); }
/* the lanes that are not 0 (NaN counts as not 0) */
static inline __mmask16 vf_nonzero(vf x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ); }
static inline vf vf_exp(vf x) { return exp16(x); }
/* the lanes m of 16 bfloat16 (bf 1) or float16 (bf 0) values at p, as the float32 values they are */
static inline vf vf_load16(const uint16_t *p, __mmask16 m, int bf) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}
/* the lanes of m whose byte at p is not 0 (bytes outside m are not read) */
static inline __mmask16 bytes_set(__mmask16 m, const unsigned char *p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    return m & _mm512_test_epi32_mask(b, b);
}
/* x[r] lane c becomes x[c] lane r */
static inline __attribute__((always_inline)) void vf_transpose(vf *x) {
    transpose16((__m512i *)x);  /* both vector types may alias */
}
static inline vd vd_zero(void) { return _mm512_setzero_pd(); }
static inline vd vd_set1(double x) { return _mm512_set1_pd(x); }
static inline vd vd_load(const double *p) { return _mm512_load_pd(p); }
static inline void vd_store(double *p, vd x) { _mm512_store_pd(p, x); }
static inline vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
static inline vd vd_sub(vd a, vd b) { return _mm512_sub_pd(a, b); }
static inline vd vd_fmadd(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
static inline double vd_sum(vd x) { return _mm512_reduce_add_pd(x); }
/* lanes 0-7 (half 0) or 8-15 (half 1) of x in float64 */
static inline vd vf_half(vf x, int h) {
    return _mm512_cvtps_pd(h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))
                             : _mm512_castps512_ps256(x));
}
/* 16 float32 lanes from two float64 vectors (lanes 0-7, 8-15), each rounded once */
static inline vf vd_narrow(vd lo, vd hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
                                               _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
}

/* x stays in registers: the AVX2 layer's vectors are pairs that GCC would rather reload in every FMA that
 * reads them (a memory operand each), which made the products load-bound; a no-op on AVX-512 */
static inline __attribute__((always_inline)) void vf_keep(vf *x) { (void)x; }
static inline __attribute__((always_inline)) void vd_keep(vd *x) { (void)x; }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }  /* b where either is NaN */
static inline vf vf_fmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
/* a rounded to nearest whatever MXCSR says */
static inline vf vf_mul_rn(vf a, vf b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* |a| with b's sign bit or'ed in */
static inline vf vf_or_sign(vf a, vf b) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a),
                                               _mm512_and_si512(_mm512_castps_si512(b), _mm512_set1_epi32((int)0x80000000u))));
}
static inline __mmask16 vf_ne(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ); }
static inline __mmask16 vf_eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline __mmask16 vf_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline __mmask16 vf_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
/* b on the lanes of m, a elsewhere */
static inline vf vf_blend(__mmask16 m, vf a, vf b) { return _mm512_mask_blend_ps(m, a, b); }
/* max(a, b) on the lanes of m, src elsewhere */
static inline vf vf_mask_max(vf src, __mmask16 m, vf a, vf b) { return _mm512_mask_max_ps(src, m, a, b); }
/* p (64-byte aligned) on the lanes of m, src elsewhere */
static inline vf vf_mask_load(vf src, __mmask16 m, const float *p) { return _mm512_mask_load_ps(src, m, p); }
static inline void vf_mask_storeu(float *p, __mmask16 m, vf x) { _mm512_mask_storeu_ps(p, m, x); }
static inline float vf_reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vf_reduce_add(vf x) { return _mm512_reduce_add_ps(x); }
/* x - floor(x) (vreduceps: 0 at +-inf), and p 2^floor(x) on the lanes of keep, 0 elsewhere (vscalefps:
 * 0 at x = -inf and, with MXCSR's flush to zero, below 2^-126; inf past 2^128; NaN in p or x gives NaN) */
static inline vf vf_frac(vf x) { return _mm512_reduce_ps(x, 0x09); }
static inline vf vf_scale2(__mmask16 keep, vf p, vf x) { return _mm512_maskz_scalef_ps(keep, p, x); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256d lo, hi; } vd;
#define VF_TILE 1
#define VD_TILE 2
static inline vf vf_two(__m256 lo, __m256 hi) { vf r = {lo, hi}; return r; }
static inline vd vd_two(__m256d lo, __m256d hi) { vd r = {lo, hi}; return r; }
/* all ones in the lanes whose bit of m (8 bits) is set */
static inline __m256i bits8(unsigned m) {
    const __m256i b = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), b), b);
}
static inline vf vf_zero(void) { return vf_two(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float x) { return vf_two(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf vf_load(const float *p) { return vf_two(_mm256_load_ps(p), _mm256_load_ps(p + 8)); }
static inline vf vf_loadu(const float *p) { return vf_two(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf x) { _mm256_store_ps(p, x.lo); _mm256_store_ps(p + 8, x.hi); }
static inline void vf_storeu(float *p, vf x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
static inline vf vf_add(vf a, vf b) { return vf_two(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return vf_two(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return vf_two(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return vf_two(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_maskz_loadu(__mmask16 m, const float *p) {  /* lanes outside m are not read */
    if (m == 0xFFFF)
        return vf_loadu(p);
    return vf_two(_mm256_maskload_ps(p, bits8(m & 255)), _mm256_maskload_ps(p + 8, bits8(m >> 8)));
}
static inline vf vf_maskz(__mmask16 m, vf x) {
    return vf_two(_mm256_and_ps(x.lo, _mm256_castsi256_ps(bits8(m & 255))),
                  _mm256_and_ps(x.hi, _mm256_castsi256_ps(bits8(m >> 8))));
}
static inline __mmask16 vf_nonzero(vf x) {
    const __m256 z = _mm256_setzero_ps();
    return (__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, z, _CMP_NEQ_UQ)) |
                       _mm256_movemask_ps(_mm256_cmp_ps(x.hi, z, _CMP_NEQ_UQ)) << 8);
}
/* exp16 on 8 lanes, 2^n built in the exponent bits instead of vscalefps: the same bits at every x. Where
 * x >= -87, n >= -126 and 2^n is normal, so p 2^n is rounded once either way; n = 128 (x from 88.38 to
 * 88.72) takes p 2^127 (exact) times 2, finite while p < 1 as vscalefps's is (2^128 built in the bits
 * would be inf: a review found it), n > 128 times inf. Below -87 (and at -inf) 0, NaN gives NaN (the
 * compare keeps it; min_ps returns 127 for a NaN n, but p is NaN). */
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(127.0f))), _mm256_set1_epi32(127)), 23);
    __m256 two = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f),
                                  _mm256_cmp_ps(n, _mm256_set1_ps(127.0f), _CMP_GT_OQ));
    two = _mm256_blendv_ps(two, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(n, _mm256_set1_ps(128.0f), _CMP_GT_OQ));
    return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), two), keep);
}
static inline vf vf_exp(vf x) { return vf_two(exp8(x.lo), exp8(x.hi)); }
static inline vf vf_load16(const uint16_t *p, __mmask16 m, int bf) {
    __m256i h;
    if (m == 0xFFFF) {
        h = _mm256_loadu_si256((const __m256i *)p);
    } else {
        uint16_t t[16] = {0};
        for (int i = 0; i < 16; i++)
            if (m >> i & 1) t[i] = p[i];
        h = _mm256_loadu_si256((const __m256i *)t);
    }
    const __m128i a = _mm256_castsi256_si128(h), b = _mm256_extracti128_si256(h, 1);
    if (bf)
        return vf_two(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
                      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
    return vf_two(_mm256_cvtph_ps(a), _mm256_cvtph_ps(b));
}
static inline __mmask16 bytes_set(__mmask16 m, const unsigned char *p) {
    if (m == 0xFFFF)
        return (__mmask16)~_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)p), _mm_setzero_si128()));
    __mmask16 r = 0;
    for (int i = 0; i < 16; i++)
        if ((m >> i & 1) && p[i]) r |= (__mmask16)(1u << i);
    return r;
}
/* an 8 x 8 transpose: unpacks, then shuffles within 128-bit lanes, then the lanes swapped */
static inline __attribute__((always_inline)) void transpose8(__m256 *r) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* s[4i + k]: rows 4i .. 4i + 3 of columns k and k + 4 */
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x31);
    }
}
/* x[r] lane c becomes x[c] lane r: four 8 x 8 transposes of the halves */
static inline __attribute__((always_inline)) void vf_transpose(vf *x) {
    __m256 a[8], b[8], c[8], d[8];
    for (int i = 0; i < 8; i++) { a[i] = x[i].lo; b[i] = x[i].hi; c[i] = x[8 + i].lo; d[i] = x[8 + i].hi; }
    transpose8(a);
    transpose8(b);
    transpose8(c);
    transpose8(d);
    for (int i = 0; i < 8; i++) { x[i] = vf_two(a[i], c[i]); x[8 + i] = vf_two(b[i], d[i]); }
}
static inline vd vd_zero(void) { return vd_two(_mm256_setzero_pd(), _mm256_setzero_pd()); }
static inline vd vd_set1(double x) { return vd_two(_mm256_set1_pd(x), _mm256_set1_pd(x)); }
static inline vd vd_load(const double *p) { return vd_two(_mm256_load_pd(p), _mm256_load_pd(p + 4)); }
static inline void vd_store(double *p, vd x) { _mm256_store_pd(p, x.lo); _mm256_store_pd(p + 4, x.hi); }
static inline vd vd_add(vd a, vd b) { return vd_two(_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)); }
static inline vd vd_sub(vd a, vd b) { return vd_two(_mm256_sub_pd(a.lo, b.lo), _mm256_sub_pd(a.hi, b.hi)); }
static inline vd vd_fmadd(vd a, vd b, vd c) {
    return vd_two(_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi));
}
/* in _mm512_reduce_add_pd's order: the halves, then the 128-bit halves, then the pair */
static inline double vd_sum(vd x) {
    const __m256d s = _mm256_add_pd(x.lo, x.hi);
    const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(t) + _mm_cvtsd_f64(_mm_unpackhi_pd(t, t));
}
static inline vd vf_half(vf x, int h) {
    const __m256 y = h ? x.hi : x.lo;
    return vd_two(_mm256_cvtps_pd(_mm256_castps256_ps128(y)), _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
}
static inline vf vd_narrow(vd lo, vd hi) {
    return vf_two(_mm256_set_m128(_mm256_cvtpd_ps(lo.hi), _mm256_cvtpd_ps(lo.lo)),
                  _mm256_set_m128(_mm256_cvtpd_ps(hi.hi), _mm256_cvtpd_ps(hi.lo)));
}
static inline __attribute__((always_inline)) void vf_keep(vf *x) { __asm__("" : "+x"(x->lo), "+x"(x->hi)); }
static inline __attribute__((always_inline)) void vd_keep(vd *x) { __asm__("" : "+x"(x->lo), "+x"(x->hi)); }
static inline vf vf_max(vf a, vf b) { return vf_two(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vf vf_fmsub(vf a, vf b, vf c) {
    return vf_two(_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_abs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return vf_two(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
static inline vf vf_div(vf a, vf b) { return vf_two(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
/* MXCSR's rounding (keyfold leaves it to nearest), the product fenced so -ffp-contract never fuses it
 * into a later add, as vmulps with embedded rounding never is on AVX-512 */
static inline vf vf_mul_rn(vf a, vf b) {
    vf r = vf_mul(a, b);
    __asm__("" : "+x"(r.lo), "+x"(r.hi));
    return r;
}
static inline vf vf_or_sign(vf a, vf b) {
    const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    return vf_two(_mm256_or_ps(a.lo, _mm256_and_ps(b.lo, s)), _mm256_or_ps(a.hi, _mm256_and_ps(b.hi, s)));
}
#define KF_CMP16(a, b, p) ((__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, p)) | \
                                      _mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, p)) << 8))
static inline __mmask16 vf_ne(vf a, vf b) { return KF_CMP16(a, b, _CMP_NEQ_UQ); }
static inline __mmask16 vf_eq(vf a, vf b) { return KF_CMP16(a, b, _CMP_EQ_OQ); }
static inline __mmask16 vf_lt(vf a, vf b) { return KF_CMP16(a, b, _CMP_LT_OQ); }
static inline __mmask16 vf_gt(vf a, vf b) { return KF_CMP16(a, b, _CMP_GT_OQ); }
#undef KF_CMP16
static inline vf vf_blend(__mmask16 m, vf a, vf b) {
    return vf_two(_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(bits8(m & 255))),
                  _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(bits8(m >> 8))));
}
static inline vf vf_mask_max(vf src, __mmask16 m, vf a, vf b) { return vf_blend(m, src, vf_max(a, b)); }
static inline vf vf_mask_load(vf src, __mmask16 m, const float *p) { return vf_blend(m, src, vf_maskz_loadu(m, p)); }
static inline void vf_mask_storeu(float *p, __mmask16 m, vf x) {
    _mm256_maskstore_ps(p, bits8(m & 255), x.lo);
    _mm256_maskstore_ps(p + 8, bits8(m >> 8), x.hi);
}
/* in _mm512_reduce_max_ps's and _mm512_reduce_add_ps's order (GCC's: the halves, the 128-bit halves, then
 * pairs), so a NaN lane goes where it goes there */
static inline float vf_reduce_max(vf x) {
    const __m256 t3 = _mm256_max_ps(x.hi, x.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(t10);
}
static inline float vf_reduce_add(vf x) {
    const __m256 t3 = _mm256_add_ps(x.hi, x.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}
/* x clamped to [-151, 129] (NaN stays NaN: min and max return their second operand for it), where
 * vreduceps and vscalefps give what they give at the ends */
static inline __m256 clamp8(__m256 x) {
    return _mm256_max_ps(_mm256_set1_ps(-151.0f), _mm256_min_ps(_mm256_set1_ps(129.0f), x));
}
/* x - floor(x) as vreduceps gives it: its subtraction rounds down, so where x - n rounded up (only
 * -1 < x < 0, where 1 + x is inexact; f + n is then exact) it is one ulp less (x = -1e-8: 0.99999994,
 * not 1; a review found every x in (-0.5, 0) could differ, 1 ulp of P) */
static inline __m256 frac8(__m256 x) {
    const __m256 c = clamp8(x);
    const __m256 n = _mm256_round_ps(c, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(c, n);
    const __m256 up = _mm256_cmp_ps(_mm256_add_ps(f, n), c, _CMP_GT_OQ);  /* all ones: -1 as an integer */
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(f), _mm256_castps_si256(up)));
}
/* p 2^n, n = floor(x), built in the exponent bits: 0 below 2^-126 (n < -126, as vscalefps under flush to
 * zero, which keyfold's kernels set), inf from n = 128; a NaN x keeps its lane (the compare is true for
 * NaN) and p, NaN there, gives NaN */
static inline __m256 scale8(__m256 p, __m256 x) {
    const __m256 n = _mm256_round_ps(clamp8(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 ok = _mm256_cmp_ps(n, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(128.0f))), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), ok);
}
/* vf_frac and vf_scale2 are vreduceps's and vscalefps's twins as exp2 pairs them (scale2(keep, p(frac(x)),
 * x)): the same bits at every x (outside [-151, 129] the product is 0 or inf either way, and p is NaN
 * where x is), not for every operand alone */
static inline vf vf_frac(vf x) { return vf_two(frac8(x.lo), frac8(x.hi)); }
static inline vf vf_scale2(__mmask16 keep, vf p, vf x) { return vf_maskz(keep, vf_two(scale8(p.lo, x.lo), scale8(p.hi, x.hi))); }
#endif

#endif
