/* keyfold's CPU decode kernel: a few query rows over many keys, each key and value read once.
 *
 * It computes the partial state of docs/math.md, (out, lse), for query rows that see every key of
 * the span (no mask, no bias): a decoding step over a cache, or one split-KV chunk of it. Work items
 * are (batch entry, key/value head, key chunk); each runs an online softmax over blocks of BK keys
 * and leaves (m, l, acc) = (running max, sum of exp(s - m), sum of exp(s - m) v). The chunks of one
 * head are merged at the end: lse = M + log L, out = sum_c exp(m_c - M) acc_c / L with
 * M = max_c m_c and L = sum_c exp(m_c - M) l_c.
 *
 * Keys and values may be float32, bfloat16 or float16 and are widened in registers, so a 16-bit
 * cache is read at its own size; arithmetic is float32 throughout. The rows of a GQA group come in
 * as rows of one key/value head, so the group reads its keys once.
 *
 * Built by keyfold/kernels/native.py with the system C compiler (-march=native -fopenmp; AVX-512 F, BW
 * and VL are required, else the build fails and keyfold keeps PyTorch's fused op). The work items run on
 * OpenMP threads: inside a process that imported torch, that is torch's own libgomp pool (same
 * soname), so the kernel's threads and torch's never compete for the cores. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "keyfold's decode kernel needs AVX-512 F, BW and VL"
#endif

enum { KF_F32 = 0, KF_BF16 = 1, KF_F16 = 2 };
#define BK 32           /* keys per block of the online softmax */
#define PREFETCH 2048   /* bytes ahead of the row being read (about 4 us of one core's stream) */
#define MAXR 64         /* query rows per key/value head */
#define MAXW 16         /* 16-float vectors per row: head sizes up to 256 */

typedef struct {
    const float *q;               /* (B, H, R, D) float32, contiguous */
    const uint16_t *qbf;          /* the same q in bfloat16 when it is exactly that (else NULL) */
    float scale;
    const char *k, *v;            /* key and value bases; rows contiguous, other dims strided */
    int dtype;                    /* of k and v */
    long long skb, skh, skn, svb, svh, svn;  /* strides in elements */
    int B, H, R, D, Dv;
    long long N;                  /* keys */
    int chunks;                   /* key chunks per (b, h) */
    float *acc, *m, *l;           /* per work item: (R, 16 Wv), (R), (R) */
    float *out, *lse;             /* (B, H, R, Dv), (B, H, R) */
} job_t;

/* 16 elements (the lanes of mask k) of a row in the given dtype, as float32 */
static inline __m512 load16(const char *p, int dtype, __mmask16 k) {
    if (dtype == KF_F32) return _mm512_maskz_loadu_ps(k, p);
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    if (dtype == KF_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* lane j of the result = the sum of t[j]'s lanes: a transpose-and-add tree, 15 shuffle-add steps
 * for 16 dot products instead of 16 horizontal reductions */
static inline __m512 hsum16(const __m512 *t) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

#ifdef __AVX512BF16__
/* bfloat16 keys against bfloat16 q: vdpbf16ps multiplies pairs and adds them in float32, 32 elements
 * an instruction, with no widening (lanes past D are zero in q and masked out of k) */
static inline __m512 dot_bf16(const uint16_t *q, const char *k, int D) {
    __m512 x = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : (__mmask32)(0xFFFFFFFFu >> (32 - (D - d)));
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

/* One work item: rows of (b, h) over the keys of chunk c. */
static void item(const job_t *J, int w) {
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
    float qs[R][16 * W] __attribute__((aligned(64)));
    float s[R][BK] __attribute__((aligned(64)));
    float vb[dt != KF_F32 && R > 1 ? BK : 1][16 * Wv] __attribute__((aligned(64)));
    float *acc = J->acc + (size_t)w * R * Wv * 16, *mm = J->m + (size_t)w * R, *ll = J->l + (size_t)w * R;
    const __m512 scale = _mm512_set1_ps(J->scale);
    const int Wb = (D + 31) / 32;                             /* 32-element bfloat16 vectors per row */
    uint16_t (*qh)[32 * Wb] = NULL;                           /* the rows' bfloat16 q, zero past D */
#ifdef __AVX512BF16__
    uint16_t qhb[J->qbf && dt == KF_BF16 ? R : 1][32 * Wb] __attribute__((aligned(64)));
    if (J->qbf && dt == KF_BF16) {
        qh = qhb;
        for (int r = 0; r < R; r++) {
            memset(qh[r], 0, sizeof(uint16_t) * 32 * Wb);
            memcpy(qh[r], J->qbf + ((size_t)bh * R + r) * D, sizeof(uint16_t) * D);
        }
    }
#endif
    for (int r = 0; r < R; r++) {
        memset(qs[r], 0, sizeof(float) * 16 * W);
        memcpy(qs[r], J->q + ((size_t)bh * R + r) * D, sizeof(float) * D);
        mm[r] = -INFINITY;
        ll[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * R * Wv * 16);
    for (long long n = n0; n < n1; n += BK) {
        const int nb = (int)(n1 - n < BK ? n1 - n : BK);
        /* scores, 16 keys at a time: a partial vector per key, the 16 summed by one transpose */
        for (int j0 = 0; j0 < nb; j0 += 16) {
            const int m = nb - j0 < 16 ? nb - j0 : 16;
            for (int r = 0; r < R; r++) {
                __m512 t[16];
                const char *kr = kp + (size_t)j0 * kstep;
                for (int j = 0; j < 16; j++, kr += kstep) {
                    if (j >= m) { t[j] = _mm512_setzero_ps(); continue; }
                    if (r == 0) prefetch_row(kr + kpf, krow);
#ifdef __AVX512BF16__
                    if (qh) { t[j] = dot_bf16(qh[r], kr, D); continue; }
#endif
                    __m512 x = _mm512_mul_ps(_mm512_load_ps(qs[r]), load16(kr, dt, W == 1 ? tk : 0xFFFF));
                    for (int i = 1; i < W; i++)
                        x = _mm512_fmadd_ps(_mm512_load_ps(qs[r] + 16 * i),
                                            load16(kr + (size_t)i * 16 * es, dt, i == W - 1 ? tk : 0xFFFF), x);
                    t[j] = x;
                }
                _mm512_store_ps(&s[r][j0], _mm512_mul_ps(hsum16(t), scale));
            }
        }
        kp += (size_t)nb * kstep;
        /* online softmax per row: the block's max; what came before rescaled to the new max */
        for (int r = 0; r < R; r++) {
            __m512 bm = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < nb; j += 16) bm = _mm512_mask_max_ps(bm, first(nb - j), bm, _mm512_load_ps(&s[r][j]));
            const float mx = _mm512_reduce_max_ps(bm), mn = (isnan(mx) || mx > mm[r]) ? mx : mm[r];
            const float corr = _mm512_cvtss_f32(exp16(_mm512_set1_ps(mm[r] - mn)));  /* 0 on the first block */
            const __m512 mnv = _mm512_set1_ps(mn);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < nb; j += 16) {
                __m512 p = _mm512_maskz_mov_ps(first(nb - j), exp16(_mm512_sub_ps(_mm512_load_ps(&s[r][j]), mnv)));
                _mm512_store_ps(&s[r][j], p);
                sum = _mm512_add_ps(sum, p);
            }
            if (corr != 1.0f) {
                const __m512 cv = _mm512_set1_ps(corr);
                float *a = acc + (size_t)r * Wv * 16;
                for (int i = 0; i < Wv; i++) _mm512_storeu_ps(a + 16 * i, _mm512_mul_ps(cv, _mm512_loadu_ps(a + 16 * i)));
            }
            ll[r] = ll[r] * corr + _mm512_reduce_add_ps(sum);
            mm[r] = mn;
        }
        /* values: acc_r += sum_j p_j v_j per 16-wide slice of Dv, four slices (four FMA chains) at a
         * time. Float32 rows, or a single query row, are read where they lie (16-bit widened in the
         * loop); several rows over 16-bit values read them widened once into vb. */
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
        for (int r = 0; r < R; r++) {
            float *a = acc + (size_t)r * Wv * 16;
            for (int i = 0; i < Wv; i += 4) {
                const __mmask16 m0 = slice(i, Wv, tv), m1 = slice(i + 1, Wv, tv), m2 = slice(i + 2, Wv, tv),
                                m3 = slice(i + 3, Wv, tv);
                __m512 y0 = _mm512_maskz_loadu_ps(m0, a + 16 * i), y1 = _mm512_maskz_loadu_ps(m1, a + 16 * i + 16),
                       y2 = _mm512_maskz_loadu_ps(m2, a + 16 * i + 32), y3 = _mm512_maskz_loadu_ps(m3, a + 16 * i + 48);
                const char *x = vsrc + (size_t)i * 16 * ves;
                const size_t o = 16 * ves;
                for (int j = 0; j < nb; j++, x += vs) {
                    const __m512 p = _mm512_set1_ps(s[r][j]);
                    y0 = _mm512_fmadd_ps(p, load16(x, vdt, m0), y0);
                    y1 = _mm512_fmadd_ps(p, load16(x + o, vdt, m1), y1);
                    y2 = _mm512_fmadd_ps(p, load16(x + 2 * o, vdt, m2), y2);
                    y3 = _mm512_fmadd_ps(p, load16(x + 3 * o, vdt, m3), y3);
                }
                _mm512_mask_storeu_ps(a + 16 * i, m0, y0);
                _mm512_mask_storeu_ps(a + 16 * i + 16, m1, y1);
                _mm512_mask_storeu_ps(a + 16 * i + 32, m2, y2);
                _mm512_mask_storeu_ps(a + 16 * i + 48, m3, y3);
            }
        }
        vp += (size_t)nb * vstep;
    }
}

/* Merge every head's chunks into out and lse. A chunk of no keys (m = -inf, l = 0) is skipped; any
 * other, NaN included, takes part, so a NaN or infinite score reaches out and lse as NaN. */
static void finish(const job_t *J) {
    const int R = J->R, Dv = J->Dv, C = J->chunks, P = (Dv + 15) / 16 * 16;
    for (int bh = 0; bh < J->B * J->H; bh++)
        for (int r = 0; r < R; r++) {
            float M = -INFINITY, L = 0.0f;
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)(bh * C + c) * R + r;
                if (J->l[i] == 0.0f && J->m[i] == -INFINITY) continue;
                if (isnan(J->m[i]) || isnan(J->l[i])) M = NAN;
                else if (J->m[i] > M) M = J->m[i];
            }
            float *o = J->out + ((size_t)bh * R + r) * Dv;
            memset(o, 0, sizeof(float) * Dv);
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)(bh * C + c) * R + r;
                if (J->l[i] == 0.0f && J->m[i] == -INFINITY) continue;
                const float f = expf(J->m[i] - M);
                const float *a = J->acc + i * P;
                L += f * J->l[i];
                for (int d = 0; d < Dv; d++) o[d] += f * a[d];
            }
            const float inv = 1.0f / L;
            for (int d = 0; d < Dv; d++) o[d] *= inv;
            J->lse[(size_t)bh * R + r] = M + logf(L);
        }
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
int kf_decode(const float *q, const uint16_t *qbf, float scale, const void *k, const void *v, int dtype,
              long long skb, long long skh, long long skn, long long svb, long long svh, long long svn,
              int B, int H, int R, int D, int Dv, long long N, int chunks, int threads,
              float *out, float *lse) {
    if (B < 1 || H < 1 || R < 1 || R > MAXR || D < 1 || D > 16 * MAXW || Dv < 1 || Dv > 16 * MAXW || N < 1
        || chunks < 1 || dtype < KF_F32 || dtype > KF_F16)
        return -1;
    job_t J = {q, qbf, scale, (const char *)k, (const char *)v, dtype, skb, skh, skn, svb, svh, svn,
               B, H, R, D, Dv, N, chunks, NULL, NULL, NULL, out, lse};
    const long long items = (long long)B * H * chunks;
    J.acc = malloc(sizeof(float) * (size_t)items * R * ((Dv + 15) / 16 * 16));
    J.m = malloc(sizeof(float) * (size_t)items * R);
    J.l = malloc(sizeof(float) * (size_t)items * R);
    if (!J.acc || !J.m || !J.l) { free(J.acc); free(J.m); free(J.l); return -2; }
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long long w = 0; w < items; w++) item(&J, (int)w);
    finish(&J);
    free(J.acc); free(J.m); free(J.l);
    return 0;
}
