/* keyfold's CPU decode kernel: a few query rows over many keys, each key and value read once.
 *
 * It computes the partial state of docs/math.md, (out, lse), for query rows over the keys of a span
 * (a decoding step over a cache, or one split-KV chunk of it), every key or under an additive float32
 * mask (a piece's tile: -inf where a row does not see a key, a bias such as ALiBi's where it does). Work items
 * are (batch entry, key/value head, key chunk); each runs an online softmax over blocks of BK keys
 * and leaves (m, l, acc) = (running max, sum of exp(s - m), sum of exp(s - m) v). The chunks of one
 * head are merged at the end: lse = M + log L, out = sum_c exp(m_c - M) acc_c / L with
 * M = max_c m_c and L = sum_c exp(m_c - M) l_c.
 *
 * Keys and values may be float32, bfloat16 or float16 and are widened in registers, so a 16-bit
 * cache is read at its own size; arithmetic is float32, except where the caller asks for exact scores
 * (exact_scores: sums in double of the exact products, the running max in double; any row count up
 * to MAXR, on item()). The rows of a GQA group come in as rows of one key/value head, so the group
 * reads its keys once.
 *
 * Built by keyfold/kernels/native.py with the system C compiler (-march=native -fopenmp; AVX-512 F, BW
 * and VL are required, else the build fails and keyfold keeps PyTorch's fused op). The work items run on
 * OpenMP threads: inside a process that imported torch, that is torch's own libgomp pool (same
 * soname), so the kernel's threads and torch's never compete for the cores. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_merge.h"

#include "simd.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "keyfold's decode kernel needs AVX-512 F, BW and VL"
#endif

enum { KF_F32 = 0, KF_BF16 = 1, KF_F16 = 2 };
#define BK 32           /* keys per block of the online softmax */
#define PREFETCH 2048   /* bytes ahead of the row being read (about 4 us of one core's stream) */
#define MAXR 64         /* query rows per key/value head */
#define MAXW 16         /* 16-float vectors per row: head sizes up to 256 */
#define FEW_ROWS 5      /* rows from which a call takes the several-rows path (native.FEW_ROWS) */

typedef struct {
    const float *q;               /* (B, H, R, D) float32, contiguous */
    const uint16_t *qbf;          /* the same q in bfloat16 when it is exactly that (else NULL) */
    float scale;
    double dscale;                /* the scale as given, for exact scores */
    int exact;                    /* scores in double (exact_scores) */
    const char *k, *v;            /* key and value bases; rows contiguous, other dims strided */
    int dtype;                    /* of k and v */
    long long skb, skh, skn, svb, svh, svn;  /* strides in elements */
    int B, H, R, D, Dv;
    long long N;                  /* keys */
    int chunks;                   /* key chunks per (b, h) */
    const float *mask;            /* additive, added to the scaled scores, or NULL; keys contiguous */
    long long smb, smh, smr;      /* its strides in elements (0 where broadcast) */
    float *acc, *l;               /* per work item: (R, 16 Wv), (R) */
    double *m;                    /* per work item: (R), a double for exact scores' running max */
    float *out;                   /* (B, H, R, Dv) */
    double *lse;                  /* (B, H, R): decode_merge.h says why double */
} job_t;

/* 16 elements (the lanes of mask k) of a row in the given dtype, as float32 */
static inline __m512 load16(const char *p, int dtype, __mmask16 k) {
    if (dtype == KF_F32) return _mm512_maskz_loadu_ps(k, p);
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    if (dtype == KF_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

#ifdef __AVX512BF16__
/* bfloat16 keys against bfloat16 q: vdpbf16ps multiplies pairs and adds them in float32, 32 elements
 * an instruction, with no widening (lanes past D are zero in q and masked out of k) */
static inline __m512 dot_bf16(const uint16_t *q, const char *k, int D) {
    __m512 x = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = first32(D - d);
        x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_maskz_loadu_epi16(m, k + 2 * d));
    }
    return x;
}
#endif

static inline void prefetch_row(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

/* lanes of 16-float slice i of a row of W slices whose last has lanes `last`: none past the row */
static inline __mmask16 slice(int i, int W, __mmask16 last) { return i < W - 1 ? 0xFFFF : i == W - 1 ? last : 0; }

/* Scores of R (2-4) rows for 16 keys (m of them real) into s (row r at s + r * ldS), for item(): a key's
 * vectors are loaded (and widened) once for every row, where item()'s own loop reloads them per row
 * (0.85-0.95x its time at 2-4 float32 rows; at one row it took 1.05-1.15x, so one row keeps that loop).
 * The same sums in the same order: a mul and an FMA chain over the 16-float slices, then tree16. */
static inline void scores_rows(const job_t *J, const float *q, int ldq, int R, const char *kr, size_t kstep, int m,
                               size_t kpf, size_t krow, int W, __mmask16 tk, size_t es, const float *mk, float *s,
                               int ldS) {
    __m512 t[FEW_ROWS - 1][16];
    for (int j = 0; j < 16; j++, kr += kstep) {
        if (j >= m) {
            for (int r = 0; r < R; r++) t[r][j] = _mm512_setzero_ps();
            continue;
        }
        prefetch_row(kr + kpf, krow);
        __m512 kv[MAXW];
        for (int i = 0; i < W; i++) kv[i] = load16(kr + (size_t)i * 16 * es, J->dtype, i == W - 1 ? tk : 0xFFFF);
        for (int r = 0; r < R; r++) {
            __m512 x = _mm512_mul_ps(_mm512_load_ps(q + r * ldq), kv[0]);
            for (int i = 1; i < W; i++) x = _mm512_fmadd_ps(_mm512_load_ps(q + r * ldq + 16 * i), kv[i], x);
            t[r][j] = x;
        }
    }
    const __m512 scale = _mm512_set1_ps(J->scale);
    for (int r = 0; r < R; r++) {
        __m512 y = _mm512_mul_ps(tree16(t[r]), scale);
        if (mk) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(first(m), mk + r * J->smr));
        _mm512_store_ps(s + r * ldS, y);
    }
}

/* Exact scores (J->exact): scores of R rows for the nb keys of a block into sd (row r at sd + r * BK),
 * in double: a float32 product of float32 elements is exact in double and the sum of D of them rounds at
 * 2^-53, so a score carries no rounding of float32's, where the naive attention's carry its GEMM's. Past
 * a few units of score spread that rounding is what the 2x rule measures (an error of |s| 2^-24 a score
 * moves a row's weights by as much), and two float32 sums in different orders (this kernel's, torch's
 * GEMM over a cascade's folded rows, the naive's GEMV over one row) each go past twice the other's in some
 * calls: a cascade of 4 requests over 1,000 keys at score std 30 broke the rule in 47 of 200 calls on this
 * kernel's float32 scores, in 0 of 200 on exact ones. qd: the rows' q in double, zero past D. */
/* Lane j of the result = the sum of t[j]'s lanes, for 8 double vectors: pairs within 128-bit blocks, then
 * blocks, in three shuffle-and-add rounds */
static inline __m512d tree8d(const __m512d *t) {
    __m512d a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_add_pd(_mm512_unpacklo_pd(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_pd(t[2 * i], t[2 * i + 1]));
    const __m512d b0 = _mm512_add_pd(_mm512_shuffle_f64x2(a[0], a[1], 0x88), _mm512_shuffle_f64x2(a[0], a[1], 0xDD));
    const __m512d b1 = _mm512_add_pd(_mm512_shuffle_f64x2(a[2], a[3], 0x88), _mm512_shuffle_f64x2(a[2], a[3], 0xDD));
    return _mm512_add_pd(_mm512_shuffle_f64x2(b0, b1, 0x88), _mm512_shuffle_f64x2(b0, b1, 0xDD));
}

/* One key's partial sums against RR (1-8, a constant where this is inlined) rows of qd from row r0: the
 * key's slices widened once, each row's two chains (low and high halves of the slices) in registers;
 * row r's sum vector into t[8 r] */
static inline __attribute__((always_inline)) void exact_key(const job_t *J, const double *qd, int W, const char *kr,
                                                            __mmask16 tk, const int RR, __m512d *t) {
    __m512d a[8], b[8];
    for (int r = 0; r < RR; r++) a[r] = b[r] = _mm512_setzero_pd();
    for (int i = 0; i < W; i++) {
        const __mmask16 m = i == W - 1 ? tk : 0xFFFF;
        __m512d lo, hi;
        if (J->dtype == KF_F32) {  /* each half widened from memory: no shuffle to split the vector */
            const float *x = (const float *)kr + 16 * i;
            lo = _mm512_cvtps_pd(_mm256_maskz_loadu_ps((__mmask8)m, x));
            hi = _mm512_cvtps_pd(_mm256_maskz_loadu_ps((__mmask8)(m >> 8), x + 8));
        } else {
            const __m512 x = load16(kr + (size_t)i * 32, J->dtype, m);
            lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
            hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        }
        for (int r = 0; r < RR; r++) {
            a[r] = _mm512_fmadd_pd(_mm512_load_pd(qd + (size_t)r * 16 * W + 16 * i), lo, a[r]);
            b[r] = _mm512_fmadd_pd(_mm512_load_pd(qd + (size_t)r * 16 * W + 16 * i + 8), hi, b[r]);
        }
    }
    for (int r = 0; r < RR; r++) t[8 * r] = _mm512_add_pd(a[r], b[r]);
}

static inline void exact_scores(const job_t *J, const double *qd, int R, const char *kr, size_t kstep, int nb,
                                size_t kpf, size_t krow, int W, __mmask16 tk, const float *mk, __m512d *tt,
                                double *sd) {
    const __m512d scale = _mm512_set1_pd(J->dscale);
    for (int j0 = 0; j0 < nb; j0 += 8) {
        /* eight keys: each row's partial vector a key into tt (row r, key j at tt[8 r + j]), eight rows
         * at a time, a key widened once for them (16 accumulators and a slice's two halves: 18 of the
         * 32 vector registers) */
        for (int j = 0; j < 8; j++, kr += kstep) {
            if (j0 + j >= nb) {
                for (int r = 0; r < R; r++) tt[8 * r + j] = _mm512_setzero_pd();
                continue;
            }
            prefetch_row(kr + kpf, krow);
            for (int r0 = 0; r0 < R; r0 += 8) {
                const double *q = qd + (size_t)r0 * 16 * W;
                __m512d *t = tt + 8 * r0 + j;
                switch (R - r0 < 8 ? R - r0 : 8) {
                case 1: exact_key(J, q, W, kr, tk, 1, t); break;
                case 2: exact_key(J, q, W, kr, tk, 2, t); break;
                case 3: exact_key(J, q, W, kr, tk, 3, t); break;
                case 4: exact_key(J, q, W, kr, tk, 4, t); break;
                case 5: exact_key(J, q, W, kr, tk, 5, t); break;
                case 6: exact_key(J, q, W, kr, tk, 6, t); break;
                case 7: exact_key(J, q, W, kr, tk, 7, t); break;
                default: exact_key(J, q, W, kr, tk, 8, t); break;
                }
            }
        }
        const __mmask8 in = (__mmask8)first(nb - j0);
        for (int r = 0; r < R; r++) {  /* the eight keys' sums by one transpose, scaled, the mask added */
            __m512d y = _mm512_mul_pd(tree8d(tt + 8 * r), scale);
            if (mk) y = _mm512_add_pd(y, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, mk + r * J->smr + j0)));
            _mm512_store_pd(sd + (size_t)r * BK + j0, y);
        }
    }
}

/* The online softmax of an exact-scores block (sd, nb keys) for row r: the running max mm in double, each
 * weight exp(s - m) from s - m rounded to float32 (exact where s is near m, and a weight far below 1 carries
 * its rounding in proportion), into p; returns the factor for what came before. NaN and -inf as item()'s. */
static inline float exact_softmax(const double *sd, int nb, double *mm, float *ll, float *p) {
    __m512d bm = _mm512_set1_pd(-INFINITY);
    for (int j = 0; j < nb; j += 8)
        bm = _mm512_mask_max_pd(bm, (__mmask8)first(nb - j), bm, _mm512_load_pd(sd + j));
    const double mx = _mm512_reduce_max_pd(bm), mn = (isnan(mx) || mx > *mm) ? mx : *mm;
    const double base = mn == -INFINITY ? 0.0 : mn;
    const float corr = _mm512_cvtss_f32(exp16(_mm512_set1_ps((float)(*mm - base))));  /* 0 on the first block */
    const __m512d bv = _mm512_set1_pd(base);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nb; j += 16) {
        const __m256 d0 = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_load_pd(sd + j), bv));
        const __m256 d1 = _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_load_pd(sd + j + 8), bv));
        const __m512 d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(d0)),
                                                             _mm256_castps_pd(d1), 1));
        const __m512 x = _mm512_maskz_mov_ps(first(nb - j), exp16(d));
        _mm512_store_ps(p + j, x);
        sum = _mm512_add_ps(sum, x);
    }
    *ll = *ll * corr + _mm512_reduce_add_ps(sum);
    *mm = mn;
    return corr;
}

/* Float32 scores of R rows (q at qs, 16 W floats a row; bfloat16 q at qh, 32 Wb a row, or NULL) for
 * the nb keys of a block at kp into s (row r at s + r * BK), 16 keys at a time: a partial vector per
 * key, the 16 summed by one transpose, scaled, the mask (row 0's at mk, rows smr apart) added */
static inline void float_scores(const job_t *J, const float *qs, const uint16_t *qh, int R, const char *kp,
                                size_t kstep, int nb, size_t kpf, size_t krow, int W, __mmask16 tk, const float *mk,
                                float *s) {
    const int dt = J->dtype, D = J->D;
    const size_t es = dt == KF_F32 ? 4 : 2;
    const __m512 scale = _mm512_set1_ps(J->scale);
    for (int j0 = 0; j0 < nb; j0 += 16) {
        const int m = nb - j0 < 16 ? nb - j0 : 16;
        if (R > 1 && !qh) {  /* several rows: scores_rows loads (and widens) each key once for them all */
            scores_rows(J, qs, 16 * W, R, kp + (size_t)j0 * kstep, kstep, m, kpf, krow, W, tk, es,
                        mk ? mk + j0 : NULL, s + j0, BK);
            continue;
        }
        for (int r = 0; r < R; r++) {
            const float *qr = qs + (size_t)r * 16 * W;
            __m512 t[16];
            const char *kr = kp + (size_t)j0 * kstep;
            for (int j = 0; j < 16; j++, kr += kstep) {
                if (j >= m) { t[j] = _mm512_setzero_ps(); continue; }
                if (r == 0) prefetch_row(kr + kpf, krow);
#ifdef __AVX512BF16__
                if (qh) { t[j] = dot_bf16(qh + (size_t)r * 32 * ((D + 31) / 32), kr, D); continue; }
#endif
                __m512 x = _mm512_mul_ps(_mm512_load_ps(qr), load16(kr, dt, W == 1 ? tk : 0xFFFF));
                for (int i = 1; i < W; i++)
                    x = _mm512_fmadd_ps(_mm512_load_ps(qr + 16 * i), load16(kr + (size_t)i * 16 * es, dt, i == W - 1 ? tk : 0xFFFF), x);
                t[j] = x;
            }
            __m512 y = _mm512_mul_ps(tree16(t), scale);
            if (mk) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(first(m), mk + r * J->smr + j0));
            _mm512_store_ps(s + (size_t)r * BK + j0, y);
        }
    }
}

/* The online softmax of a float32-scores block (s, nb keys, turned into weights in place) for a row whose
 * running max and sum are *mm, *ll; returns the factor for what came before. A row that has seen no key
 * yet (a mask's -inf, or scores of -inf from an infinite k, which PyTorch's op also takes as hidden keys)
 * keeps m = -inf and subtracts 0: every p and corr is 0. Without a mask it subtracted -inf, and a first
 * block or chunk of -inf scores made the row NaN where a later one did not (found in decode_avx2.c's
 * review, 2026-12-07). */
static inline float float_softmax(float *s, int nb, double *mm, float *ll) {
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < nb; j += 16) bm = _mm512_mask_max_ps(bm, first(nb - j), bm, _mm512_load_ps(s + j));
    const float mo = (float)*mm, mx = _mm512_reduce_max_ps(bm), mn = (isnan(mx) || mx > mo) ? mx : mo;
    const float base = mn == -INFINITY ? 0.0f : mn;
    const float corr = _mm512_cvtss_f32(exp16(_mm512_set1_ps(mo - base)));  /* 0 on the first block */
    const __m512 mnv = _mm512_set1_ps(base);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nb; j += 16) {
        const __m512 p = _mm512_maskz_mov_ps(first(nb - j), exp16(_mm512_sub_ps(_mm512_load_ps(s + j), mnv)));
        _mm512_store_ps(s + j, p);
        sum = _mm512_add_ps(sum, p);
    }
    *ll = *ll * corr + _mm512_reduce_add_ps(sum);
    *mm = mn;
    return corr;
}

/* acc of RR rows (1-4, a constant where this is inlined; row r's at a + r Wv 16) += sum_j p_r[j] v_j over
 * the nb value rows at `x` (vs bytes apart, elements of ves bytes in dtype vdt), four 16-float slices
 * of v at a time: each value slice is loaded once for the RR rows. Each block's sum starts afresh and
 * is then added to acc: one chain over every key of a chunk put float32 at 2.5-3.1x the naive error in
 * 1 of 24 calls over 12k keys in one chunk (2-4 rows, head size 64; a review); blocked, the chain is
 * BK keys plus one add a block. p: row r's weights at p + r ldp. */
static inline __attribute__((always_inline)) void values_rows(float *a, const float *p, int ldp, const char *x,
                                                              size_t vs, size_t ves, int vdt, int nb, int Wv,
                                                              __mmask16 tv, const int RR) {
    const size_t o = 16 * ves;
    for (int i = 0; i < Wv; i += 4) {
        const __mmask16 m0 = slice(i, Wv, tv), m1 = slice(i + 1, Wv, tv), m2 = slice(i + 2, Wv, tv),
                        m3 = slice(i + 3, Wv, tv);
        __m512 y[4][4];
        for (int r = 0; r < RR; r++)
            for (int t = 0; t < 4; t++) y[r][t] = _mm512_setzero_ps();
        const char *xv = x + (size_t)i * o;
        for (int j = 0; j < nb; j++, xv += vs) {
            const __m512 v0 = load16(xv, vdt, m0), v1 = load16(xv + o, vdt, m1), v2 = load16(xv + 2 * o, vdt, m2),
                         v3 = load16(xv + 3 * o, vdt, m3);
            for (int r = 0; r < RR; r++) {
                const __m512 pj = _mm512_set1_ps(p[r * ldp + j]);
                y[r][0] = _mm512_fmadd_ps(pj, v0, y[r][0]);
                y[r][1] = _mm512_fmadd_ps(pj, v1, y[r][1]);
                y[r][2] = _mm512_fmadd_ps(pj, v2, y[r][2]);
                y[r][3] = _mm512_fmadd_ps(pj, v3, y[r][3]);
            }
        }
        for (int r = 0; r < RR; r++) {
            float *ar = a + (size_t)r * Wv * 16 + 16 * i;
            _mm512_mask_storeu_ps(ar, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, ar), y[r][0]));
            _mm512_mask_storeu_ps(ar + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, ar + 16), y[r][1]));
            _mm512_mask_storeu_ps(ar + 32, m2, _mm512_add_ps(_mm512_maskz_loadu_ps(m2, ar + 32), y[r][2]));
            _mm512_mask_storeu_ps(ar + 48, m3, _mm512_add_ps(_mm512_maskz_loadu_ps(m3, ar + 48), y[r][3]));
        }
    }
}

/* One work item: rows of (b, h) over the keys of chunk c. `mem`: exact scores' scratch (exact_parts bytes,
 * 64-byte aligned), from the heap (64 rows of head size 256 in double are 128 KiB). */
static void item(const job_t *J, int w, char *mem) {
    const int c = w % J->chunks, bh = w / J->chunks, b = bh / J->H, h = bh % J->H;
    const int R = J->R, D = J->D, Dv = J->Dv, dt = J->dtype;
    const int W = (D + 15) / 16, Wv = (Dv + 15) / 16;
    const __mmask16 tk = first(D - 16 * (W - 1)), tv = first(Dv - 16 * (Wv - 1));  /* last vector's lanes */
    const long long n0 = J->N * c / J->chunks, n1 = J->N * (c + 1) / J->chunks;
    const size_t es = dt == KF_F32 ? 4 : 2;
    const size_t kstep = (size_t)J->skn * es, vstep = (size_t)J->svn * es;
    const size_t krow = (size_t)D * es, vrow = (size_t)Dv * es;
    const size_t kpf = (PREFETCH / krow + 1) * kstep, vpf = (PREFETCH / vrow + 1) * vstep;
    const char *kp = J->k + (size_t)(b * J->skb + h * J->skh) * es + (size_t)n0 * kstep;
    const char *vp = J->v + (size_t)(b * J->svb + h * J->svh) * es + (size_t)n0 * vstep;
    /* stack scratch sized by the call (about 10 KB for 4 rows of 64): the rows' q (zero past D), the
     * block's scores (then exp(s - m)), the block's values in float32 (several rows over 16-bit values) */
    const int ex = J->exact;
    float qs[ex ? 1 : R][16 * W] __attribute__((aligned(64)));
    float s[R][BK] __attribute__((aligned(64)));
    /* exact scores: the rows' q, the block's scores, eight keys' partial sums a row, in double */
    double *const qd = (double *)mem, *const sd = qd + (ex ? (size_t)R * 16 * W : 0);
    __m512d *const tt = (__m512d *)(sd + (ex ? (size_t)R * BK : 0));
    float vb[dt != KF_F32 && R > 1 ? BK : 1][16 * Wv] __attribute__((aligned(64)));
    float *acc = J->acc + (size_t)w * R * Wv * 16, *ll = J->l + (size_t)w * R;
    double *mm = J->m + (size_t)w * R;
    const float *mk = J->mask ? J->mask + b * J->smb + h * J->smh + n0 : NULL;  /* row 0's mask at key n0 */
    const int Wb = (D + 31) / 32;                             /* 32-element bfloat16 vectors per row */
    uint16_t (*qh)[32 * Wb] = NULL;                           /* the rows' bfloat16 q, zero past D */
#ifdef __AVX512BF16__
    uint16_t qhb[J->qbf && dt == KF_BF16 && !ex ? R : 1][32 * Wb] __attribute__((aligned(64)));
    if (J->qbf && dt == KF_BF16 && !ex) {
        qh = qhb;
        for (int r = 0; r < R; r++) {
            memset(qh[r], 0, sizeof(uint16_t) * 32 * Wb);
            memcpy(qh[r], J->qbf + ((size_t)bh * R + r) * D, sizeof(uint16_t) * D);
        }
    }
#endif
    for (int r = 0; r < R; r++) {
        const float *qr = J->q + ((size_t)bh * R + r) * D;
        if (ex)
            for (int d = 0; d < 16 * W; d++) qd[(size_t)r * 16 * W + d] = d < D ? (double)qr[d] : 0.0;
        else {
            memset(qs[r], 0, sizeof(float) * 16 * W);
            memcpy(qs[r], qr, sizeof(float) * D);
        }
        mm[r] = -INFINITY;
        ll[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * R * Wv * 16);
    for (long long n = n0; n < n1; n += BK) {
        const int nb = (int)(n1 - n < BK ? n1 - n : BK);
        if (ex) exact_scores(J, qd, R, kp, kstep, nb, kpf, krow, W, tk, mk ? mk + (n - n0) : NULL, tt, sd);
        else float_scores(J, qs[0], qh ? qh[0] : NULL, R, kp, kstep, nb, kpf, krow, W, tk, mk ? mk + (n - n0) : NULL,
                          s[0]);
        kp += (size_t)nb * kstep;
        /* online softmax per row: the block's max; what came before rescaled to the new max */
        for (int r = 0; r < R; r++) {
            const float corr = ex ? exact_softmax(sd + (size_t)r * BK, nb, &mm[r], &ll[r], s[r])
                                  : float_softmax(s[r], nb, &mm[r], &ll[r]);
            if (corr != 1.0f) {
                const __m512 cv = _mm512_set1_ps(corr);
                float *a = acc + (size_t)r * Wv * 16;
                for (int i = 0; i < Wv; i++) _mm512_storeu_ps(a + 16 * i, _mm512_mul_ps(cv, _mm512_loadu_ps(a + 16 * i)));
            }
        }
        /* values (values_rows): float32 rows, or a single query row, are read where they lie (16-bit
         * widened in the loop); several rows over 16-bit values read them widened once into vb. */
        const char *vsrc = vp;
        size_t vs = vstep, ves = es;
        int vdt = dt;
        const char *vr = vp;
        for (int j = 0; j < nb; j++, vr += vstep) {
            prefetch_row(vr + vpf, vrow);
            if (dt != KF_F32 && R > 1)
                for (int i = 0; i < Wv; i++)
                    _mm512_store_ps(vb[j] + 16 * i, load16(vr + (size_t)i * 16 * es, dt, i == Wv - 1 ? tv : 0xFFFF));
        }
        if (dt != KF_F32 && R > 1) { vsrc = (const char *)vb[0]; vs = sizeof(vb[0]); ves = 4; vdt = KF_F32; }
        for (int r0 = 0; r0 < R; r0 += 4) {  /* four rows at a time read each value once */
            float *a = acc + (size_t)r0 * Wv * 16;
            switch (R - r0 < 4 ? R - r0 : 4) {
            case 1: values_rows(a, s[r0], BK, vsrc, vs, ves, vdt, nb, Wv, tv, 1); break;
            case 2: values_rows(a, s[r0], BK, vsrc, vs, ves, vdt, nb, Wv, tv, 2); break;
            case 3: values_rows(a, s[r0], BK, vsrc, vs, ves, vdt, nb, Wv, tv, 3); break;
            default: values_rows(a, s[r0], BK, vsrc, vs, ves, vdt, nb, Wv, tv, 4); break;
            }
        }
        vp += (size_t)nb * vstep;
    }
}

/* ---------------------------------------------------------------- several rows: groups of eight
 *
 * With more rows than a handful, the per-row dot products above cost more than reading the keys
 * (8 rows took 1.3-1.5x the op's time). Here a key's D elements meet all eight rows of a group in
 * D/2 FMAs: lane 2i + t of a vector holds row i at elements of parity t, so the multiplier is one
 * 64-bit broadcast of the key's elements (2e, 2e+1) (a load, no shuffle) against q laid out once
 * as qt[e] = (q[0][2e], q[0][2e+1], q[1][2e], ...). Sixteen keys are held in sixteen accumulators;
 * each lane pair is summed at the end, which leaves a vector per two keys with the eight rows' scores
 * of the first key in lanes 0-7 and of the second in 8-15. The softmax runs in that layout (a row's
 * max and sum come from its two lanes) and P is stored in it, key-major, which is what P·V
 * broadcasts from: acc[r] += P[j][r] v[j], eight rows by two 16-float slices of v per pass.
 * bfloat16 keys dotted with a bfloat16 q use vdpbf16ps on the same layout (a lane pair holds four
 * elements: the broadcast is the key's elements 4e..4e+3). Keys of other dtypes, an odd head size or
 * a block's last few keys are widened into float32 rows first. */
#define FB 64           /* keys per block of the online softmax */
#define FG 8            /* rows per group */

/* out[m] for m < 8: the group's scores (times scale) of keys 2m (lanes 0-7) and 2m+1 (lanes 8-15),
 * from sixteen pair-lane accumulators */
static inline void fold_pairs(const __m512 *a, float scale, float *out) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i od = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < 8; m++) {
        const __m512 x = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * m], ev, a[2 * m + 1]),
                                       _mm512_permutex2var_ps(a[2 * m], od, a[2 * m + 1]));
        _mm512_store_ps(out + 16 * m, _mm512_mul_ps(x, sc));
    }
}

static inline __m512 bcast64(const char *p) {
    double x;
    memcpy(&x, p, sizeof x);
    return _mm512_castpd_ps(_mm512_set1_pd(x));
}

/* Pairs (float32) or quads (bfloat16) of a score's head dimensions summed in a chain of their own
 * before the chain is added to the score's running sum: a blocked sum, whose rounding grows with
 * SUM_BLOCK plus D / (2 SUM_BLOCK) terms, not D / 2. One chain per lane over every pair put the
 * float32 error at 2-5x the naive attention's (torch's matmul sums a few rows' dot products in
 * vector lanes) at head size 128 and 256 with 5-8 rows a head: 20 of 50 calls past the rule at head
 * size 256, 5 rows, scores of std 6 (`test_several_rows_sum_a_long_head_in_blocks`). */
#define SUM_BLOCK 8

/* sixteen keys (rows kstep bytes apart) against a group's qt: float32 keys and qt (n pairs of elements;
 * bf 0), or bfloat16 keys and qt (n quads; bf 1, vdpbf16ps) */
static inline __attribute__((always_inline)) void scores16(const void *qt, int n, const char *k, size_t kstep,
                                                           float scale, float *out, const int bf) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
    const char *k8 = k + 8 * kstep;
    for (int e0 = 0; e0 < n; e0 += SUM_BLOCK) {
        const int e1 = e0 + SUM_BLOCK < n ? e0 + SUM_BLOCK : n;
        __m512 t[16];
        for (int j = 0; j < 16; j++) t[j] = _mm512_setzero_ps();
        for (int e = e0; e < e1; e++) {
            const __m512 q = _mm512_load_ps((const float *)qt + 16 * e);
            for (int j = 0; j < 8; j++) {
                const __m512 x = bcast64(k + j * kstep + 8 * e), y = bcast64(k8 + j * kstep + 8 * e);
#ifdef __AVX512BF16__
                if (bf) {
                    t[j] = _mm512_dpbf16_ps(t[j], (__m512bh)q, (__m512bh)x);
                    t[8 + j] = _mm512_dpbf16_ps(t[8 + j], (__m512bh)q, (__m512bh)y);
                    continue;
                }
#endif
                t[j] = _mm512_fmadd_ps(x, q, t[j]);
                t[8 + j] = _mm512_fmadd_ps(y, q, t[8 + j]);
            }
        }
        for (int j = 0; j < 16; j++) a[j] = _mm512_add_ps(a[j], t[j]);
    }
    fold_pairs(a, scale, out);
}

/* The additive mask into eight score vectors of a group (scores16's layout: vector m holds key 2m of
 * rows r0..r0+7 in lanes 0-7, key 2m+1 in lanes 8-15): `mk` is row 0's mask at the first of the 16
 * keys, rows `smr` apart; rows from R (a group's padding) and keys from `nk` are not read. */
static inline void add_mask16(float *s, const float *mk, long long smr, int r0, int R, int nk) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i row = _mm512_add_epi32(_mm512_set1_epi32(r0), _mm512_and_si512(lane, _mm512_set1_epi32(7)));
    const __m512i key = _mm512_srli_epi32(lane, 3);  /* 0 in lanes 0-7, 1 in 8-15 */
    const __mmask16 rows = _mm512_cmplt_epi32_mask(row, _mm512_set1_epi32(R));
    /* offsets from mk in elements; a row stride that would overflow 32 bits is read row by row instead */
    if (smr * (long long)(R > 0 ? R - 1 : 0) + 16 < (1LL << 31)) {
        const __m512i off = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32((int)smr)), key);
        for (int m = 0; 2 * m < nk; m++) {
            const __mmask16 keys = rows & (2 * m + 1 < nk ? 0xFFFF : 0x00FF);
            const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keys,
                                                      _mm512_add_epi32(off, _mm512_set1_epi32(2 * m)), mk, 4);
            _mm512_store_ps(s + 16 * m, _mm512_add_ps(_mm512_load_ps(s + 16 * m), x));
        }
        return;
    }
    for (int m = 0; 2 * m < nk; m++)
        for (int i = 0; i < 16; i++) {
            const int r = r0 + (i & 7), j = 2 * m + (i >> 3);
            if (r < R && j < nk) s[16 * m + i] += mk[(long long)r * smr + j];
        }
}

/* The 64-byte units of a several-rows item's scratch, in few_item's order: q in the pair layout
 * (float32, and bfloat16 pairs when keys are dotted in bfloat16), the block's scores then P, the rows'
 * accumulators, a 16-key group of keys widened, the block's values widened. */
static size_t few_parts(const job_t *J, size_t part[6]) {
    const size_t G = (J->R + FG - 1) / FG, E = (J->D + 1) / 2, Wv = (J->Dv + 15) / 16;
    part[0] = G * E;
    part[1] = G * (J->D / 4);
    part[2] = G * (FB / 2);
    part[3] = G * FG * Wv;
    part[4] = (16 * 2 * E * sizeof(float) + 63) / 64;
    part[5] = J->dtype != KF_F32 ? FB * Wv : 0;
    return (part[0] + part[1] + part[2] + part[3] + part[4] + part[5]) * 64;
}

/* One work item of the several-rows path: rows of (b, h) over the keys of chunk c. `mem`: the thread's
 * scratch (few_parts bytes, 64-byte aligned), from the heap: up to 256 KiB at 64 rows of head size 256,
 * more than a small thread stack holds (a first version kept it on the stack and crashed on a 128 KiB
 * one, musl's default; found in review). */
static void few_item(const job_t *J, int w, char *mem) {
    const int c = w % J->chunks, bh = w / J->chunks, b = bh / J->H, h = bh % J->H;
    const int R = J->R, D = J->D, Dv = J->Dv, dt = J->dtype, G = (R + FG - 1) / FG;
    const int E = (D + 1) / 2, Wv = (Dv + 15) / 16;
    const __mmask16 tv = first(Dv - 16 * (Wv - 1));
    const long long n0 = J->N * c / J->chunks, n1 = J->N * (c + 1) / J->chunks;
    const size_t es = dt == KF_F32 ? 4 : 2;
    const size_t kstep = (size_t)J->skn * es, vstep = (size_t)J->svn * es;
    const char *kp = J->k + (size_t)(b * J->skb + h * J->skh) * es + (size_t)n0 * kstep;
    const char *vp = J->v + (size_t)(b * J->svb + h * J->svh) * es + (size_t)n0 * vstep;
    int bf = 0;                                  /* keys dotted in bfloat16 where they lie */
#ifdef __AVX512BF16__
    bf = J->qbf && dt == KF_BF16 && D % 4 == 0;
#endif
    const int direct = bf || (dt == KF_F32 && D % 2 == 0);  /* keys read where they lie */
    const float *mk = J->mask ? J->mask + b * J->smb + h * J->smh + n0 : NULL;  /* row 0's mask at key n0 */
    /* scratch (few_parts): kb, a 16-key group of keys widened (odd D, 16-bit keys, a block's tail);
     * vb, the block's values widened (16-bit values) */
    size_t part[6];
    few_parts(J, part);
    float (*const qt)[E][16] = (float (*)[E][16])mem;
    uint32_t (*const qtb)[D / 4 > 0 ? D / 4 : 1][16] = (uint32_t (*)[D / 4 > 0 ? D / 4 : 1][16])(mem += part[0] * 64);
    float (*const sp)[FB / 2][16] = (float (*)[FB / 2][16])(mem += part[1] * 64);
    float (*const oa)[16 * Wv] = (float (*)[16 * Wv])(mem += part[2] * 64);
    float (*const kb)[2 * E] = (float (*)[2 * E])(mem += part[3] * 64);
    float (*const vb)[16 * Wv] = (float (*)[16 * Wv])(mem += part[4] * 64);
    __m512 mv[G], lv[G];
    for (int g = 0; g < G; g++) {
        for (int e = 0; e < E; e++)
            for (int i = 0; i < FG; i++)
                for (int t = 0; t < 2; t++) {
                    const int r = g * FG + i, d = 2 * e + t;
                    qt[g][e][2 * i + t] = r < R && d < D ? J->q[((size_t)bh * R + r) * D + d] : 0.0f;
                }
#ifdef __AVX512BF16__
        if (bf)
            for (int e = 0; e < D / 4; e++)
                for (int i = 0; i < FG; i++)
                    for (int t = 0; t < 2; t++) {
                        const int r = g * FG + i;
                        uint32_t x = 0;
                        if (r < R) memcpy(&x, J->qbf + ((size_t)bh * R + r) * D + 4 * e + 2 * t, 4);
                        qtb[g][e][2 * i + t] = x;
                    }
#endif
        mv[g] = _mm512_set1_ps(-INFINITY);
        lv[g] = _mm512_setzero_ps();
    }
    memset(oa, 0, part[3] * 64);
    memset(kb, 0, sizeof(float) * 16 * 2 * E);
    for (long long n = n0; n < n1; n += FB) {
        const int nb = (int)(n1 - n < FB ? n1 - n : FB);
        /* scores, sixteen keys at a time */
        for (int j0 = 0; j0 < nb; j0 += 16) {
            const char *kr = kp + (size_t)j0 * kstep;
            const int m = nb - j0 < 16 ? nb - j0 : 16;
            /* the next block's keys and values, sixteen rows of each (the hardware prefetcher
             * alone left a float32 stream at 0.77x this rate; 16-bit keys, where the arithmetic
             * is the limit, ran 1.08-1.14x slower with it) */
            if (dt == KF_F32)
                for (int j = 0; j < 16 && n + FB + j0 + j < n1; j++) {
                    prefetch_row(kr + (size_t)(FB + j) * kstep, (size_t)D * es);
                    prefetch_row(vp + (size_t)(FB + j0 + j) * vstep, (size_t)Dv * es);
                }
            const char *src = kr;
            size_t step = kstep;
            if (!direct || m < 16) {  /* widen (and zero-pad) into kb */
                const int W = (D + 15) / 16;
                for (int j = 0; j < 16; j++)
                    for (int i = 0; i < W; i++) {
                        const __mmask16 lanes = j < m ? first(D - 16 * i) : 0;
                        _mm512_mask_storeu_ps(kb[j] + 16 * i, first(2 * E - 16 * i),
                                              load16(kr + (size_t)j * kstep + (size_t)i * 16 * es, dt, lanes));
                    }
                src = (const char *)kb[0];
                step = sizeof(float) * 2 * E;
            }
            for (int g = 0; g < G; g++) {
                if (bf && src == kr) scores16(qtb[g][0], D / 4, src, step, J->scale, sp[g][j0 / 2], 1);
                else scores16(qt[g][0], E, src, step, J->scale, sp[g][j0 / 2], 0);
                if (mk) add_mask16(sp[g][j0 / 2], mk + (n - n0) + j0, J->smr, g * FG, R, m);
            }
        }
        kp += (size_t)nb * kstep;
        /* values widened once for all rows */
        const char *vsrc = vp;
        size_t vs = vstep;
        if (dt != KF_F32) {
            const char *vr = vp;
            for (int j = 0; j < nb; j++, vr += vstep)
                for (int i = 0; i < Wv; i++)
                    _mm512_store_ps(vb[j] + 16 * i, load16(vr + (size_t)i * 16 * es, dt, i == Wv - 1 ? tv : 0xFFFF));
            vsrc = (const char *)vb[0];
            vs = sizeof(float) * 16 * Wv;
        }
        vp += (size_t)nb * vstep;
        const int M = (nb + 1) / 2;  /* score vectors of the block */
        for (int g = 0; g < G; g++) {
            /* online softmax: a key past the block's end (odd nb) is -inf */
            if (nb % 2) _mm512_mask_storeu_ps(sp[g][M - 1], 0xFF00, _mm512_set1_ps(-INFINITY));
            __m512 bm = _mm512_set1_ps(-INFINITY);
            for (int m = 0; m < M; m++) bm = _mm512_max_ps(bm, _mm512_load_ps(sp[g][m]));
            bm = _mm512_max_ps(bm, _mm512_shuffle_f32x4(bm, bm, 0x4E));  /* a row's two lanes */
            const __m512 mn = _mm512_max_ps(mv[g], bm);                 /* NaN in bm wins */
            /* rows that have seen no key yet keep m = -inf and subtract 0: p and corr are 0 (as in item()) */
            const __m512 base = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                                   _mm512_setzero_ps());
            const __m512 corr = exp16(_mm512_sub_ps(mv[g], base));       /* 0 on the first block */
            __m512 sum = _mm512_setzero_ps();
            for (int m = 0; m < M; m++) {
                const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(sp[g][m]), base));
                _mm512_store_ps(sp[g][m], p);
                sum = _mm512_add_ps(sum, p);
            }
            lv[g] = _mm512_fmadd_ps(lv[g], corr, sum);
            mv[g] = mn;
            if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & 0xFF) {
                float cr[16] __attribute__((aligned(64)));
                _mm512_store_ps(cr, corr);
                for (int i = 0; i < FG; i++) {
                    const __m512 cv = _mm512_set1_ps(cr[i]);
                    for (int x = 0; x < Wv; x++)
                        _mm512_store_ps(oa[g * FG + i] + 16 * x, _mm512_mul_ps(cv, _mm512_load_ps(oa[g * FG + i] + 16 * x)));
                }
            }
            /* values: eight rows by two 16-float slices of v per pass */
            const float *P = sp[g][0];
            for (int x = 0; x < Wv; x += 2) {
                const __mmask16 m0 = slice(x, Wv, tv), m1 = slice(x + 1, Wv, tv);
                __m512 o0[FG], o1[FG];
                for (int i = 0; i < FG; i++) {
                    o0[i] = _mm512_load_ps(oa[g * FG + i] + 16 * x);
                    o1[i] = x + 1 < Wv ? _mm512_load_ps(oa[g * FG + i] + 16 * x + 16) : _mm512_setzero_ps();
                }
                const char *vr = vsrc + (size_t)x * 64;  /* float32 rows, as read or widened */
                for (int j = 0; j < nb; j++, vr += vs) {
                    const __m512 v0 = _mm512_maskz_loadu_ps(m0, vr), v1 = _mm512_maskz_loadu_ps(m1, vr + 64);
                    for (int i = 0; i < FG; i++) {
                        const __m512 p = _mm512_set1_ps(P[8 * j + i]);
                        o0[i] = _mm512_fmadd_ps(p, v0, o0[i]);
                        o1[i] = _mm512_fmadd_ps(p, v1, o1[i]);
                    }
                }
                for (int i = 0; i < FG; i++) {
                    _mm512_store_ps(oa[g * FG + i] + 16 * x, o0[i]);
                    if (x + 1 < Wv) _mm512_store_ps(oa[g * FG + i] + 16 * x + 16, o1[i]);
                }
            }
        }
    }
    /* the item's state in the layout finish() reads */
    float *acc = J->acc + (size_t)w * R * Wv * 16, *ll = J->l + (size_t)w * R;
    double *mm = J->m + (size_t)w * R;
    for (int g = 0; g < G; g++) {
        float mx[16], lx[16];
        _mm512_storeu_ps(mx, mv[g]);
        _mm512_storeu_ps(lx, lv[g]);
        for (int i = 0; i < FG && g * FG + i < R; i++) {
            const int r = g * FG + i;
            mm[r] = mx[i];
            ll[r] = lx[i] + lx[i + 8];
            memcpy(acc + (size_t)r * Wv * 16, oa[r], sizeof(float) * 16 * Wv);
        }
    }
}

/* Merge every head's chunks into out and lse (decode_merge.h) */
static void finish(const job_t *J) {
    merge_chunks(J->B * J->H, J->R, J->chunks, J->Dv, (J->Dv + 15) / 16 * 16, J->m, J->l, J->acc, J->out, J->lse);
}

/* What this build compiled in: bit 0, bfloat16 keys dotted by vdpbf16ps (AVX-512-BF16); bit 1, the
 * prefill kernel's bfloat16 path on AMX tiles, bit 2 its float32 path on AVX-512 FMAs (prefill.c,
 * built under the same conditions). */
int kf_features(void) {
    int f = 0;
#ifdef __AVX512BF16__
    f |= 1;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    f |= 2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    f |= 4;  /* prefill.c's float32 path */
#endif
    return f;
}

/* The entry point (keyfold/kernels/native.py). Returns 0, or -1 for arguments out of range, -2 when
 * the scratch memory cannot be had. */
int kf_decode(const float *q, const uint16_t *qbf, double scale, const void *k, const void *v, int dtype,
              long long skb, long long skh, long long skn, long long svb, long long svh, long long svn,
              const float *mask, long long smb, long long smh, long long smr,
              int B, int H, int R, int D, int Dv, long long N, int chunks, int threads,
              float *out, double *lse, int exact) {
    if (B < 1 || H < 1 || R < 1 || R > MAXR || D < 1 || D > 16 * MAXW || Dv < 1 || Dv > 16 * MAXW || N < 1
        || chunks < 1 || dtype < KF_F32 || dtype > KF_F16)
        return -1;
    job_t J = {q, qbf, (float)scale, scale, exact != 0, (const char *)k, (const char *)v, dtype, skb, skh, skn,
               svb, svh, svn, B, H, R, D, Dv, N, chunks, mask, smb, smh, smr, NULL, NULL, NULL, out, lse};
    const long long items = (long long)B * H * chunks;
    J.acc = malloc(sizeof(float) * (size_t)items * R * ((Dv + 15) / 16 * 16));
    J.m = malloc(sizeof(double) * (size_t)items * R);
    J.l = malloc(sizeof(float) * (size_t)items * R);
    if (!J.acc || !J.m || !J.l) { free(J.acc); free(J.m); free(J.l); return -2; }
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    /* exact scores run item() at any row count (few_item's pair layout is float32's); their scratch is the
     * rows' q and a block's scores in double */
    const int few = R >= FEW_ROWS && !J.exact;
    size_t part[6];
    const size_t per = few ? few_parts(&J, part)
                     : J.exact ? (size_t)R * (16 * ((D + 15) / 16) + BK + 64) * sizeof(double) : 0;
    char *scratch = per ? aligned_alloc(64, per * (size_t)threads) : NULL;
    if (per && !scratch) { free(J.acc); free(J.m); free(J.l); return -2; }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long long w = 0; w < items; w++) {
        char *mem = per ? scratch + per * (size_t)omp_get_thread_num() : NULL;
        if (few) few_item(&J, (int)w, mem);
        else item(&J, (int)w, mem);
    }
    finish(&J);
    free(scratch); free(J.acc); free(J.m); free(J.l);
    return 0;
}
