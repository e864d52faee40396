/* keyfold's CPU decode kernel for CPUs with AVX2 and no AVX-512 (AMD Zen 1-3, Intel before Skylake-SP and
 * its client cores): decode.c's contract on 8-float vectors. Same entry point (kf_decode), same state
 * (out, lse) of a few query rows over a span of keys, every key or under an additive float32 mask, same
 * results to rounding; docs/math.md and decode.c's header say what is computed.
 *
 * Why it exists: PyTorch's fused CPU op reads a 16-bit cache at a quarter of the memory bandwidth on
 * these CPUs (bfloat16 6 GB/s and float16 7 GB/s against a 23-26 GB/s stream copy, AMD EPYC Zen 3,
 * 2 threads), and with 2 to 16 float32 rows a head its multi-threaded sums can break the correctness
 * rule (cpu.NATIVE_F32_ROWS). Decoding reads each key and value once for a few rows, so the limit is the
 * bandwidth: this kernel widens 16-bit keys and values in registers and reads each byte once.
 *
 * One path for every dtype and row count: a block of BK keys and its values are widened into float32
 * rows padded to a multiple of 8 (zeros past the head size, in L1), then each row's scores are dot
 * products in two 8-lane FMA chains (even and odd 8-float slices, so a chain is D/16 terms, as decode.c's
 * 16-lane one), eight keys reduced by one transpose-and-add tree; an online softmax per row over the
 * block; P @ V in blocks of four 8-float slices. Work items are (batch entry, key/value head, key chunk),
 * merged at the end as in decode.c. Exact scores (decode.c's exact_scores) on 4 double lanes: a key widened
 * once for four rows, four keys' sums by one transpose (exact_block); timed only through the AVX2 build
 * on an AVX-512 machine, no AVX2 one was at hand.
 *
 * Built by keyfold/kernels/native.py (-march=native -fopenmp) where the CPU has AVX2, FMA and F16C but
 * not AVX-512 F/BW/VL, into one library with prefill.c (its float32 path) and backward.c, which compute
 * there through simd.h's 16-lane layer (two 8-lane halves). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_merge.h"
#include "simd.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "keyfold's AVX2 decode kernel needs AVX2, FMA and F16C"
#endif

enum { KF_F32 = 0, KF_BF16 = 1, KF_F16 = 2 };
#define BK 32           /* keys per block of the online softmax */
#define PREFETCH 4096   /* bytes ahead of the row being read (2048 left bfloat16 rows 5-20% slower) */
#define MAXR 64         /* query rows per key/value head (native.MAX_ROWS) */
#define MAXD 256        /* head sizes up to this (native.MAX_HEAD) */

typedef struct {
    const float *q;               /* (B, H, R, D) float32, contiguous */
    float scale;
    double dscale;                /* the scale as given, for exact scores */
    int exact;                    /* scores in double (decode.c's exact_scores) */
    const char *k, *v;            /* key and value bases; rows contiguous, other dims strided */
    int dtype;                    /* of k and v */
    long long skb, skh, skn, svb, svh, svn;  /* strides in elements */
    int B, H, R, D, Dv;
    long long N;                  /* keys */
    int chunks;                   /* key chunks per (b, h) */
    const float *mask;            /* additive, added to the scaled scores, or NULL; keys contiguous */
    long long smb, smh, smr;      /* its strides in elements (0 where broadcast) */
    int Dp, Dvp;                  /* D and Dv rounded up to a multiple of 8 */
    float *acc, *l;               /* per work item: (R, Dvp), (R) */
    double *m;                    /* per work item: (R), double for exact scores' running max */
    float *out;                   /* (B, H, R, Dv) */
    double *lse;                  /* (B, H, R): decode_merge.h says why double */
} job_t;

/* e^x: simd.h's exp8 (decode.c's exp16 on 8 lanes) */

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* Lane j of the result = the sum of t[j]'s lanes: three rounds of horizontal adds and one of lane swaps */
static inline __m256 tree8(const __m256 *t) {
    const __m256 a0 = _mm256_hadd_ps(t[0], t[1]), a1 = _mm256_hadd_ps(t[2], t[3]);
    const __m256 a2 = _mm256_hadd_ps(t[4], t[5]), a3 = _mm256_hadd_ps(t[6], t[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* 8 elements of a row in the given dtype (a constant where this is inlined), as float32 */
static inline __attribute__((always_inline)) __m256 load8(const char *p, const int dtype) {
    if (dtype == KF_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dtype == KF_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static inline float widen1(const char *p, int dtype) {
    if (dtype == KF_F32) { float x; memcpy(&x, p, 4); return x; }
    uint16_t h;
    memcpy(&h, p, 2);
    if (dtype == KF_F16) return _cvtsh_ss(h);
    const uint32_t b = (uint32_t)h << 16;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* A row of n elements as float32 into dst, zeros up to np (a multiple of 8) */
static inline __attribute__((always_inline)) void widen_row(float *dst, const char *src, const int dtype, int n, int np) {
    const size_t es = dtype == KF_F32 ? 4 : 2;
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_store_ps(dst + i, load8(src + (size_t)i * es, dtype));
    for (; i < n; i++) dst[i] = widen1(src + (size_t)i * es, dtype);
    for (; i < np; i++) dst[i] = 0.0f;
}

static inline void prefetch_row(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

/* Floats of one thread's scratch: the block's keys and values widened (BK rows each), the rows' q
 * (padded), their block scores, and with exact scores those in double; every part a multiple of 8
 * floats (32-byte aligned). */
static size_t scratch_floats(const job_t *J) {
    return (size_t)BK * J->Dp + (size_t)BK * J->Dvp + (size_t)J->R * J->Dp + (size_t)J->R * BK
           + (J->exact ? 2 * (size_t)J->R * (BK + J->Dp + 16) : 0);  /* doubles: sd, qd, tt */
}

/* Lane j of the result = the sum of t[j]'s lanes, for 4 double vectors */
static inline __m256d tree4d(const __m256d *t) {
    const __m256d a0 = _mm256_hadd_pd(t[0], t[1]), a1 = _mm256_hadd_pd(t[2], t[3]);
    return _mm256_add_pd(_mm256_permute2f128_pd(a0, a1, 0x20), _mm256_permute2f128_pd(a0, a1, 0x31));
}

/* One key's exact partial sums (decode.c's exact_scores says why) against RR (1-4, a constant where this
 * is inlined) rows of qd (double, Dp a row): the key's Dp float32 elements widened once for the rows,
 * two chains a row (the low and high halves of each 8-float slice); row r's sum vector into t[4 r] */
static inline __attribute__((always_inline)) void exact_key(const double *qd, int Dp, const float *k, const int RR,
                                                            __m256d *t) {
    __m256d a[4], b[4];
    for (int r = 0; r < RR; r++) a[r] = b[r] = _mm256_setzero_pd();
    for (int i = 0; i < Dp; i += 8) {
        const __m256 x = _mm256_loadu_ps(k + i);
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        for (int r = 0; r < RR; r++) {
            a[r] = _mm256_fmadd_pd(_mm256_load_pd(qd + (size_t)r * Dp + i), lo, a[r]);
            b[r] = _mm256_fmadd_pd(_mm256_load_pd(qd + (size_t)r * Dp + i + 4), hi, b[r]);
        }
    }
    for (int r = 0; r < RR; r++) t[4 * r] = _mm256_add_pd(a[r], b[r]);
}

/* Exact scores of the R rows for a block's nb keys (float32 rows `ks` floats apart, Dp each, zero past
 * the head size) into sd (row r at sd + r * BK; -inf past nb up to a multiple of 8), scaled, the
 * additive mask added (row 0's at mk, rows smr apart): four keys at a time, four rows a widened key */
static inline void exact_block(const job_t *J, const double *qd, int R, const float *k, size_t ks, int nb, int Dp,
                               const float *mk, __m256d *tt, double *sd) {
    const __m256d scale = _mm256_set1_pd(J->dscale);
    for (int j0 = 0; j0 < nb; j0 += 4) {
        for (int j = 0; j < 4; j++) {
            if (j0 + j >= nb) {
                for (int r = 0; r < R; r++) tt[4 * r + j] = _mm256_setzero_pd();
                continue;
            }
            const float *kj = k + (size_t)(j0 + j) * ks;
            for (int r0 = 0; r0 < R; r0 += 4) {
                const double *q = qd + (size_t)r0 * Dp;
                __m256d *t = tt + 4 * r0 + j;
                switch (R - r0 < 4 ? R - r0 : 4) {
                case 1: exact_key(q, Dp, kj, 1, t); break;
                case 2: exact_key(q, Dp, kj, 2, t); break;
                case 3: exact_key(q, Dp, kj, 3, t); break;
                default: exact_key(q, Dp, kj, 4, t); break;
                }
            }
        }
        for (int r = 0; r < R; r++) {
            double y[4];
            _mm256_storeu_pd(y, _mm256_mul_pd(tree4d(tt + 4 * r), scale));
            for (int j = 0; j < 4 && j0 + j < nb; j++)
                sd[(size_t)r * BK + j0 + j] = mk ? y[j] + (double)mk[r * J->smr + j0 + j] : y[j];
        }
    }
    const int nb8 = (nb + 7) / 8 * 8;
    for (int r = 0; r < R; r++)
        for (int j = nb; j < nb8; j++) sd[(size_t)r * BK + j] = -INFINITY;  /* past the block's end */
}

/* The online softmax of a float32-scores block (s, nb8 keys, -inf past the block's end; weights in
 * place) for a row whose running max and sum are *mm, *ll: the block's max (NaN wins); returns the
 * factor for what came before. A row that has seen no key yet (a mask's -inf, or scores of -inf from an
 * infinite k, which PyTorch's op also takes as hidden keys) keeps m = -inf and subtracts 0: every p and
 * corr is 0. Without a mask it subtracted -inf, and a first block or chunk of -inf scores made the row
 * NaN where a later one did not (a review, 2026-12-07). */
static inline float float_softmax(float *s, int nb8, double *mm, float *ll) {
    __m256 bm = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (int j = 0; j < nb8; j += 8) {
        const __m256 x = _mm256_load_ps(s + j);
        bm = _mm256_max_ps(bm, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    const float mo = (float)*mm, mx = _mm256_movemask_ps(nan) ? NAN : hmax8(bm);
    const float mn = (isnan(mx) || mx > mo) ? mx : mo;
    const float base = mn == -INFINITY ? 0.0f : mn;
    const float corr = _mm256_cvtss_f32(exp8(_mm256_set1_ps(mo - base)));  /* 0 on the first block */
    const __m256 bv = _mm256_set1_ps(base);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nb8; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s + j), bv));
        _mm256_store_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    *ll = *ll * corr + hsum8(sum);
    *mm = mn;
    return corr;
}

/* decode.c's exact_softmax on 8 lanes: sd's nb doubles (a multiple of 8 readable, -inf past nb) to weights
 * exp(s - m) in p, the running max in double; returns the factor for what came before */
static inline float exact_softmax(const double *sd, int nb8, double *mm, float *ll, float *p) {
    double mx = -INFINITY;
    int nan = 0;
    for (int j = 0; j < nb8; j++) {
        nan |= isnan(sd[j]);
        mx = sd[j] > mx ? sd[j] : mx;
    }
    if (nan) mx = NAN;
    const double mn = (isnan(mx) || mx > *mm) ? mx : *mm;
    const double base = mn == -INFINITY ? 0.0 : mn;
    const float corr = (float)exp(*mm - base);  /* 0 on the first block */
    const __m256d bv = _mm256_set1_pd(base);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nb8; j += 8) {
        const __m128 d0 = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(sd + j), bv));
        const __m128 d1 = _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_loadu_pd(sd + j + 4), bv));
        const __m256 x = exp8(_mm256_insertf128_ps(_mm256_castps128_ps256(d0), d1, 1));
        _mm256_store_ps(p + j, x);
        sum = _mm256_add_ps(sum, x);
    }
    *ll = *ll * corr + hsum8(sum);
    *mm = mn;
    return corr;
}

/* Scores of one row (q padded to W 8-float slices) for keys j0 .. j0 + 7 of a block at `k` (rows `ks`
 * bytes apart, dtype `dt`, W slices each; zero rows past the block): two FMA chains a key (even and
 * odd slices, so a chain is D/16 terms as decode.c's 16-lane one), one transpose-and-add tree */
static inline __attribute__((always_inline)) __m256 scores8(const float *qr, const char *k, size_t ks, int W,
                                                            const int dt) {
    const size_t es = dt == KF_F32 ? 4 : 2;
    __m256 t[8];
    for (int j = 0; j < 8; j++, k += ks) {
        __m256 x0 = _mm256_mul_ps(_mm256_load_ps(qr), load8(k, dt)), x1 = _mm256_setzero_ps();
        int i = 1;
        for (; i + 1 < W; i += 2) {
            x1 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * i), load8(k + 8 * es * i, dt), x1);
            x0 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * i + 8), load8(k + 8 * es * (i + 1), dt), x0);
        }
        if (i < W) x1 = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * i), load8(k + 8 * es * i, dt), x1);
        t[j] = _mm256_add_ps(x0, x1);
    }
    return tree8(t);
}

/* acc (Wv 8-float slices) += sum_j p[j] v_j over nb value rows at `v` (`vs` bytes apart, dtype dt), four
 * slices (four FMA chains) at a time; each block's sum starts afresh and is added to acc, so a chain
 * is BK keys long (decode.c's blocking) */
static inline __attribute__((always_inline)) void values(float *a, const float *p, const char *v, size_t vs,
                                                         int nb, int Wv, const int dt) {
    const size_t o = 8 * (dt == KF_F32 ? 4 : 2);
    int i = 0;
    for (; i + 4 <= Wv; i += 4) {
        __m256 y0 = _mm256_setzero_ps(), y1 = _mm256_setzero_ps(), y2 = _mm256_setzero_ps(), y3 = _mm256_setzero_ps();
        const char *x = v + o * i;
        for (int j = 0; j < nb; j++, x += vs) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            y0 = _mm256_fmadd_ps(pj, load8(x, dt), y0);
            y1 = _mm256_fmadd_ps(pj, load8(x + o, dt), y1);
            y2 = _mm256_fmadd_ps(pj, load8(x + 2 * o, dt), y2);
            y3 = _mm256_fmadd_ps(pj, load8(x + 3 * o, dt), y3);
        }
        _mm256_store_ps(a + 8 * i, _mm256_add_ps(_mm256_load_ps(a + 8 * i), y0));
        _mm256_store_ps(a + 8 * i + 8, _mm256_add_ps(_mm256_load_ps(a + 8 * i + 8), y1));
        _mm256_store_ps(a + 8 * i + 16, _mm256_add_ps(_mm256_load_ps(a + 8 * i + 16), y2));
        _mm256_store_ps(a + 8 * i + 24, _mm256_add_ps(_mm256_load_ps(a + 8 * i + 24), y3));
    }
    for (; i < Wv; i++) {
        __m256 y = _mm256_setzero_ps();
        const char *x = v + o * i;
        for (int j = 0; j < nb; j++, x += vs) y = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), load8(x, dt), y);
        _mm256_store_ps(a + 8 * i, _mm256_add_ps(_mm256_load_ps(a + 8 * i), y));
    }
}

/* One work item: rows of (b, h) over the keys of chunk c, keys and values of dtype dt (a constant: one
 * copy of this per dtype). Keys and values are read where they lie when their rows are whole 8-float
 * slices and there is one row (or they are float32): each byte meets one row, so widening it first
 * would only add a store and a load. Otherwise a block of them is widened once into float32 rows
 * padded with zeros (odd head sizes, a block's last keys), which every row then reads from L1. */
static inline __attribute__((always_inline)) void item_of(const job_t *J, int w, float *mem, const int dt) {
    const int c = w % J->chunks, bh = w / J->chunks, b = bh / J->H, h = bh % J->H;
    const int R = J->R, D = J->D, Dv = J->Dv, Dp = J->Dp, Dvp = J->Dvp;
    const int W = Dp / 8, Wv = Dvp / 8;
    const int direct = (R == 1 || dt == KF_F32) && D == Dp && Dv == Dvp;
    const long long n0 = J->N * c / J->chunks, n1 = J->N * (c + 1) / J->chunks;
    const size_t es = dt == KF_F32 ? 4 : 2;
    const size_t kstep = (size_t)J->skn * es, vstep = (size_t)J->svn * es;
    const size_t krow = (size_t)D * es, vrow = (size_t)Dv * es;
    const size_t kpf = (PREFETCH / krow + 1) * kstep, vpf = (PREFETCH / vrow + 1) * vstep;
    const char *kp = J->k + (size_t)(b * J->skb + h * J->skh) * es + (size_t)n0 * kstep;
    const char *vp = J->v + (size_t)(b * J->svb + h * J->svh) * es + (size_t)n0 * vstep;
    float *kb = mem, *vb = kb + (size_t)BK * Dp, *qs = vb + (size_t)BK * Dvp, *s = qs + (size_t)R * Dp;
    /* exact scores (J->exact): the block's scores, the rows' q, eight keys' partial sums, in double */
    double *sd = (double *)(s + (size_t)R * BK), *qd = sd + (size_t)R * BK;
    __m256d *tt = (__m256d *)(qd + (size_t)R * Dp);
    float *acc = J->acc + (size_t)w * R * Dvp, *ll = J->l + (size_t)w * R;
    double *mm = J->m + (size_t)w * R;
    const float *mk = J->mask ? J->mask + b * J->smb + h * J->smh + n0 : NULL;  /* row 0's mask at key n0 */
    const __m256 scale = _mm256_set1_ps(J->scale);
    for (int r = 0; r < R; r++) {
        memset(qs + (size_t)r * Dp, 0, sizeof(float) * Dp);
        memcpy(qs + (size_t)r * Dp, J->q + ((size_t)bh * R + r) * D, sizeof(float) * D);
        if (J->exact)
            for (int d = 0; d < Dp; d++) qd[(size_t)r * Dp + d] = qs[(size_t)r * Dp + d];
        mm[r] = -INFINITY;
        ll[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)R * Dvp);
    memset(kb, 0, sizeof(float) * (size_t)BK * Dp);  /* rows past a short block stay zero */
    for (long long n = n0; n < n1; n += BK) {
        const int nb = (int)(n1 - n < BK ? n1 - n : BK), nb8 = (nb + 7) / 8 * 8;
        for (int j = 0; j < nb; j++) {
            prefetch_row(kp + (size_t)j * kstep + kpf, krow);
            prefetch_row(vp + (size_t)j * vstep + vpf, vrow);
        }
        /* the block's keys widened (a short block's padded; 16-bit ones for exact scores, which read floats) */
        const int wide = !direct || nb < nb8 || (J->exact && dt != KF_F32);
        if (wide) {
            for (int j = 0; j < nb; j++) widen_row(kb + (size_t)j * Dp, kp + (size_t)j * kstep, dt, D, Dp);
            for (int j = nb; j < nb8; j++) memset(kb + (size_t)j * Dp, 0, sizeof(float) * Dp);
        }
        if (!direct)
            for (int j = 0; j < nb; j++) widen_row(vb + (size_t)j * Dvp, vp + (size_t)j * vstep, dt, Dv, Dvp);
        if (J->exact)  /* every row's scores for the block, each key widened once for four rows */
            exact_block(J, qd, R, wide ? kb : (const float *)kp, wide ? (size_t)Dp : kstep / sizeof(float), nb, Dp,
                        mk ? mk + (n - n0) : NULL, tt, sd);
        for (int r = 0; r < R; r++) {
            const float *qr = qs + (size_t)r * Dp;
            float *sr = s + (size_t)r * BK;
            float *a = acc + (size_t)r * Dvp;
            float corr;
            if (J->exact) corr = exact_softmax(sd + (size_t)r * BK, nb8, &mm[r], &ll[r], sr);  /* scores above */
            else {
                for (int j0 = 0; j0 < nb8; j0 += 8) {
                    const __m256 x = wide ? scores8(qr, (const char *)(kb + (size_t)j0 * Dp), sizeof(float) * Dp, W, KF_F32)
                                          : scores8(qr, kp + (size_t)j0 * kstep, kstep, W, dt);
                    _mm256_store_ps(sr + j0, _mm256_mul_ps(x, scale));
                }
                if (mk) {
                    const float *mr = mk + r * J->smr + (n - n0);
                    for (int j = 0; j < nb; j++) sr[j] += mr[j];
                }
                for (int j = nb; j < nb8; j++) sr[j] = -INFINITY;  /* past the block's end */
                corr = float_softmax(sr, nb8, &mm[r], &ll[r]);
            }
            if (corr != 1.0f) {  /* what came before, rescaled to the new max */
                const __m256 cv = _mm256_set1_ps(corr);
                for (int i = 0; i < Wv; i++) _mm256_store_ps(a + 8 * i, _mm256_mul_ps(cv, _mm256_load_ps(a + 8 * i)));
            }
            if (direct) values(a, sr, vp, vstep, nb, Wv, dt);
            else values(a, sr, (const char *)vb, sizeof(float) * Dvp, nb, Wv, KF_F32);
        }
        kp += (size_t)nb * kstep;
        vp += (size_t)nb * vstep;
    }
}

static void item_f32(const job_t *J, int w, float *mem) { item_of(J, w, mem, KF_F32); }
static void item_bf16(const job_t *J, int w, float *mem) { item_of(J, w, mem, KF_BF16); }
static void item_f16(const job_t *J, int w, float *mem) { item_of(J, w, mem, KF_F16); }

/* Merge every head's chunks into out and lse (decode_merge.h) */
static void finish(const job_t *J) {
    merge_chunks(J->B * J->H, J->R, J->chunks, J->Dv, J->Dvp, J->m, J->l, J->acc, J->out, J->lse);
}

/* decode.c's feature bits: bit 2, the prefill kernel's float32 path (prefill.c, linked beside this file
 * in the AVX2 build and computing on simd.h's AVX2 lanes); no vdpbf16ps, no AMX; bit 3 says this is the
 * AVX2 build (native.isa()) */
int kf_features(void) { return 8 | 4; }

/* The entry point, decode.c's signature (native.py declares it once for both builds); qbf, a bfloat16
 * copy of q, is not read here: keys are widened and dotted in float32. Returns 0, or -1 for arguments
 * out of range, -2 when the scratch memory cannot be had. */
int kf_decode(const float *q, const uint16_t *qbf, double scale, const void *k, const void *v, int dtype,
              long long skb, long long skh, long long skn, long long svb, long long svh, long long svn,
              const float *mask, long long smb, long long smh, long long smr,
              int B, int H, int R, int D, int Dv, long long N, int chunks, int threads,
              float *out, double *lse, int exact) {
    (void)qbf;
    if (B < 1 || H < 1 || R < 1 || R > MAXR || D < 1 || D > MAXD || Dv < 1 || Dv > MAXD || N < 1
        || chunks < 1 || dtype < KF_F32 || dtype > KF_F16)
        return -1;
    job_t J = {q, (float)scale, scale, exact != 0, (const char *)k, (const char *)v, dtype, skb, skh, skn, svb, svh, svn,
               B, H, R, D, Dv, N, chunks, mask, smb, smh, smr, (D + 7) / 8 * 8, (Dv + 7) / 8 * 8,
               NULL, NULL, NULL, out, lse};
    const long long items = (long long)B * H * chunks;
    J.acc = aligned_alloc(64, (sizeof(float) * (size_t)items * R * J.Dvp + 63) / 64 * 64);  /* vector loads */
    J.m = malloc(sizeof(double) * (size_t)items * R);
    J.l = malloc(sizeof(float) * (size_t)items * R);
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    /* per-thread scratch from the heap: up to 120 KiB at 64 rows of head size 256, more than a small
     * thread stack holds (decode.c's few-rows path learnt that on musl's 128 KiB) */
    const size_t per = (scratch_floats(&J) * sizeof(float) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, per * (size_t)threads);
    if (!J.acc || !J.m || !J.l || !scratch) { free(J.acc); free(J.m); free(J.l); free(scratch); return -2; }
    void (*const item)(const job_t *, int, float *) = dtype == KF_F32 ? item_f32 : dtype == KF_BF16 ? item_bf16 : item_f16;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long long w = 0; w < items; w++) item(&J, (int)w, (float *)(scratch + per * (size_t)omp_get_thread_num()));
    finish(&J);
    free(scratch); free(J.acc); free(J.m); free(J.l);
    return 0;
}
