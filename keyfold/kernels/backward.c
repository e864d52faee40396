/* keyfold's float32 attention backward on AVX-512 FMAs: the gradients of one fused call (a piece of a
 * plan: its rows, its keys, a causal flag or a mask tile), from the global out and lse, as PyTorch's
 * fused CPU op gives them, with P recomputed by a polynomial e^x of about 1 ulp.
 *
 * Why keyfold has its own: the op's exponential loses precision (dv 3.5x the naive float32 error at
 * score std 1, 7.8x at 3, 9.6x at 6: every float32 case past the 3x rule of docs/math.md from a
 * score spread of 3 on), where P = exp(s - lse) in float32 with an exact-to-1-ulp e^x keeps the rule.
 *
 * The math (FlashAttention-2's backward, docs/math.md section 2), for a row r and a key c:
 *     P = exp(scale q_r.k_c + m_rc - lse_r)      delta_r = dO_r . O_r  (minus dlse_r: the caller's spare column)
 *     dV_c += P dO_r     dP = dO_r . v_c     dS = P (dP - delta_r)     dQ_r += scale dS k_c     dK_c += scale dS q_r
 *
 * Layout of the work: one key block of BC keys at a time is packed (K and V transposed for the score
 * and dP products, K as rows for dQ) and its dK, dV accumulated in scratch over every row block of
 * every query head of its group; dQ is accumulated in place over the key blocks. A thread takes whole
 * (batch, kv head) items when they divide among the threads (dQ then has one writer); otherwise it
 * takes (item, key block) pairs and adds dQ into a buffer of its own, summed at the end.
 *
 * Products are register tiles of RR rows by one chunk of up to 64 columns (four vectors): RR
 * broadcasts and four loads feed 4 RR FMAs. Hidden keys (the causal flag, a bool mask, padding past
 * the call's keys) get P = 0 exactly; a tile whose P is all 0 does none of the four products after
 * its scores. A NaN or infinite score reaches the gradients as it does in the op. */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define BR 32  /* query rows per tile */
#define BC 64  /* keys per tile: four vectors */
#define RR 4   /* rows of a register tile (scores, dP, dQ) */
#define CK 4   /* keys of a register tile (dK, dV) */

typedef struct {
    const float *q, *k, *v, *o, *dout, *lse;  /* q, o, dout (B, Hq, L, W); k, v (B, Hkv, S, W); lse (B, Hq, L) */
    const unsigned char *mask;                /* NULL, bool (kind 1) or float32 additive (kind 2) */
    int mkind, mhd;                           /* mask head of query head h: h / mhd */
    long long msb, msh, msl;                  /* mask element strides (the key's is 1) */
    int B, Hq, Hkv, W, Wp, causal;            /* Wp: W rounded up to 16 (the stride of dq, dk, dv) */
    long long L, S;
    float scale;
    float *dq, *dk, *dv, *delta;              /* dq (B, Hq, L, Wp); dk, dv (B, Hkv, S, Wp); delta (B, Hq, L) */
} bjob_t;

typedef struct {
    float *kt, *vt, *kn, *qp, *dop, *p, *ds, *dka, *dva;
} scratch_t;

static size_t scratch_floats(const bjob_t *J) {
    return (size_t)J->W * BC * 2 + (size_t)BC * J->Wp * 3 + (size_t)BR * J->Wp * 2 + (size_t)BR * BC * 2 + 64;
}

static scratch_t carve(const bjob_t *J, float *m) {
    scratch_t s;
    m = (float *)(((size_t)m + 63) & ~(size_t)63);
    s.kt = m;  m += (size_t)J->W * BC;
    s.vt = m;  m += (size_t)J->W * BC;
    s.kn = m;  m += (size_t)BC * J->Wp;
    s.dka = m; m += (size_t)BC * J->Wp;
    s.dva = m; m += (size_t)BC * J->Wp;
    s.qp = m;  m += (size_t)BR * J->Wp;
    s.dop = m; m += (size_t)BR * J->Wp;
    s.p = m;   m += (size_t)BR * BC;
    s.ds = m;
    return s;
}

/* the first n lanes of 16, for any n (none below 1) */
static inline __mmask16 upto(long long n) { return n <= 0 ? 0 : first(n >= 16 ? 16 : (int)n); }

/* rows [0, n) of x (row stride W) into dst (row stride Wp), zero past W and past n up to `rows` */
static void pack_rows(float *dst, const float *x, long long n, int rows, int W, int Wp) {
    for (int r = 0; r < rows; r++) {
        float *d = dst + (size_t)r * Wp;
        if (r < n) {
            memcpy(d, x + (size_t)r * W, sizeof(float) * W);
            memset(d + W, 0, sizeof(float) * (Wp - W));
        } else {
            memset(d, 0, sizeof(float) * Wp);
        }
    }
}

/* keys [0, n) of x (row stride W) transposed into dst (W x BC), zero past n */
static void pack_t(float *dst, const float *x, long long n, int W) {
    for (int c = 0; c < BC; c++)
        for (int w = 0; w < W; w++)
            dst[(size_t)w * BC + c] = c < n ? x[(size_t)c * W + w] : 0.0f;
}

/* acc[r][0..3] = sum over w < W of a[r][w] * bt[w][0..63] for nr rows (row stride lda) */
static inline __attribute__((always_inline)) void dot_tile(const int nr, const float *a, int lda, const float *bt,
                                                          int W, __m512 acc[RR][4]) {
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < 4; x++) acc[r][x] = _mm512_setzero_ps();
    for (int w = 0; w < W; w++) {
        const float *b = bt + (size_t)w * BC;
        const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16), b2 = _mm512_load_ps(b + 32),
                     b3 = _mm512_load_ps(b + 48);
        for (int r = 0; r < nr; r++) {
            const __m512 s = _mm512_set1_ps(a[(size_t)r * lda + w]);
            acc[r][0] = _mm512_fmadd_ps(s, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(s, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(s, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(s, b3, acc[r][3]);
        }
    }
}

/* the key lanes of vector x in a row r of the tile that the call shows it: inside the call's keys, at
 * or left of the diagonal under the causal flag, true in a bool mask */
static inline __mmask16 seen(const bjob_t *J, const unsigned char *mrow, long long gr, long long c0, int x, long long nc) {
    __mmask16 k = upto(nc - 16 * x);
    if (J->causal)
        k &= upto(gr - (c0 + 16 * x) + 1);
    if (J->mkind == 1) {
        const __m128i b = _mm_maskz_loadu_epi8(k, mrow + c0 + 16 * x);
        k &= _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(b), _mm512_cvtepu8_epi32(b));
    }
    return k;
}

/* scores, P and dS of nr rows (tile rows r0.. of the row block at global row i0; key block at c0 of nc keys).
 * Returns whether any P is not 0. */
static inline __attribute__((always_inline)) int rows_p(const int nr, const bjob_t *J, const scratch_t *T, int r0,
                                                       long long i0, long long c0, long long nc, const float *lse,
                                                       const float *delta, const unsigned char *mrow0) {
    __m512 acc[RR][4];
    int any = 0;
    dot_tile(nr, T->qp + (size_t)r0 * J->Wp, J->Wp, T->kt, J->W, acc);
    const __m512 sc = _mm512_set1_ps(J->scale);
    for (int r = 0; r < nr; r++) {
        const long long gr = i0 + r0 + r;
        const unsigned char *mrow = J->mask ? mrow0 + (size_t)gr * J->msl * (J->mkind == 2 ? 4 : 1) : NULL;
        const __m512 nl = _mm512_set1_ps(-lse[gr]);
        for (int x = 0; x < 4; x++) {
            const __mmask16 k = seen(J, mrow, gr, c0, x, nc);
            __m512 t;
            if (J->mkind == 2) {
                const __m512 m = _mm512_maskz_loadu_ps(k, (const float *)mrow + c0 + 16 * x);
                t = _mm512_add_ps(_mm512_fmadd_ps(acc[r][x], sc, m), nl);
            } else {
                t = _mm512_fmadd_ps(acc[r][x], sc, nl);
            }
            const __m512 p = _mm512_maskz_mov_ps(k, exp16(t));
            any |= _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _MM_CMPINT_NE) != 0;
            _mm512_store_ps(T->p + (size_t)(r0 + r) * BC + 16 * x, p);
        }
    }
    return any;
}

static inline __attribute__((always_inline)) void rows_ds(const int nr, const bjob_t *J, const scratch_t *T, int r0,
                                                         long long i0, const float *delta) {
    __m512 acc[RR][4];
    dot_tile(nr, T->dop + (size_t)r0 * J->Wp, J->Wp, T->vt, J->W, acc);
    const __m512 sc = _mm512_set1_ps(J->scale);
    for (int r = 0; r < nr; r++) {
        const __m512 dl = _mm512_set1_ps(delta[i0 + r0 + r]);
        for (int x = 0; x < 4; x++) {
            const __m512 p = _mm512_load_ps(T->p + (size_t)(r0 + r) * BC + 16 * x);
            _mm512_store_ps(T->ds + (size_t)(r0 + r) * BC + 16 * x,
                            _mm512_mul_ps(_mm512_mul_ps(p, sc), _mm512_sub_ps(acc[r][x], dl)));
        }
    }
}

/* acc (BC keys x Wp, row stride Wp) += pt^T a: keys [0, nc) (in groups of CK), rows [0, nr) of a (row
 * stride Wp) and of pt (BR x BC), one column chunk of nv vectors at column w0 */
static inline __attribute__((always_inline)) void outer_chunk(const int nv, float *dacc, const float *pt,
                                                             const float *a, int nr, long long nc, int Wp, int w0) {
    for (int c0 = 0; c0 < nc; c0 += CK) {
        __m512 acc[CK][4];
        for (int c = 0; c < CK; c++)
            for (int x = 0; x < nv; x++) acc[c][x] = _mm512_setzero_ps();
        for (int r = 0; r < nr; r++) {
            __m512 av[4];
            for (int x = 0; x < nv; x++) av[x] = _mm512_load_ps(a + (size_t)r * Wp + w0 + 16 * x);
            for (int c = 0; c < CK; c++) {
                const __m512 s = _mm512_set1_ps(pt[(size_t)r * BC + c0 + c]);
                for (int x = 0; x < nv; x++) acc[c][x] = _mm512_fmadd_ps(s, av[x], acc[c][x]);
            }
        }
        for (int c = 0; c < CK; c++)
            for (int x = 0; x < nv; x++) {
                float *d = dacc + (size_t)(c0 + c) * Wp + w0 + 16 * x;
                _mm512_store_ps(d, _mm512_add_ps(_mm512_load_ps(d), acc[c][x]));
            }
    }
}

static void outer(float *dacc, const float *pt, const float *a, int nr, long long nc, int Wp) {
    for (int w0 = 0; w0 < Wp; w0 += 64) {
        switch ((Wp - w0) >= 64 ? 4 : (Wp - w0) / 16) {
        case 4: outer_chunk(4, dacc, pt, a, nr, nc, Wp, w0); break;
        case 3: outer_chunk(3, dacc, pt, a, nr, nc, Wp, w0); break;
        case 2: outer_chunk(2, dacc, pt, a, nr, nc, Wp, w0); break;
        default: outer_chunk(1, dacc, pt, a, nr, nc, Wp, w0); break;
        }
    }
}

/* dq rows (row stride Wp) += ds kn: nr rows (r0.. of the tile), keys [0, nc), one column chunk */
static inline __attribute__((always_inline)) void dq_chunk(const int nv, const int nr, float *dq, const float *ds,
                                                          const float *kn, long long nc, int Wp, int w0) {
    __m512 acc[RR][4];
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) acc[r][x] = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++) {
        __m512 kv[4];
        for (int x = 0; x < nv; x++) kv[x] = _mm512_load_ps(kn + (size_t)c * Wp + w0 + 16 * x);
        for (int r = 0; r < nr; r++) {
            const __m512 s = _mm512_set1_ps(ds[(size_t)r * BC + c]);
            for (int x = 0; x < nv; x++) acc[r][x] = _mm512_fmadd_ps(s, kv[x], acc[r][x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) {
            float *d = dq + (size_t)r * Wp + w0 + 16 * x;
            _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[r][x]));
        }
}

static inline __attribute__((always_inline)) void dq_rows(const int nr, float *dq, const float *ds, const float *kn,
                                                         long long nc, int Wp) {
    for (int w0 = 0; w0 < Wp; w0 += 64) {
        switch ((Wp - w0) >= 64 ? 4 : (Wp - w0) / 16) {
        case 4: dq_chunk(4, nr, dq, ds, kn, nc, Wp, w0); break;
        case 3: dq_chunk(3, nr, dq, ds, kn, nc, Wp, w0); break;
        case 2: dq_chunk(2, nr, dq, ds, kn, nc, Wp, w0); break;
        default: dq_chunk(1, nr, dq, ds, kn, nc, Wp, w0); break;
        }
    }
}

/* one tile: the row block at i0 (nr rows) of query head h against the packed key block at c0 (nc keys) */
static void tile(const bjob_t *J, const scratch_t *T, int b, int h, long long i0, int nr, long long c0,
                 long long nc, float *dq) {
    const size_t bh = (size_t)b * J->Hq + h;
    const float *lse = J->lse + bh * J->L, *delta = J->delta + bh * J->L;
    const unsigned char *mrow0 = NULL;
    if (J->mask)
        mrow0 = J->mask + ((size_t)b * J->msb + (size_t)(h / J->mhd) * J->msh) * (J->mkind == 2 ? 4 : 1);
    pack_rows(T->qp, J->q + (bh * J->L + i0) * J->W, nr, BR, J->W, J->Wp);
    int any = 0, r0 = 0;
    for (; r0 + RR <= nr; r0 += RR) any |= rows_p(RR, J, T, r0, i0, c0, nc, lse, delta, mrow0);
    switch (nr - r0) {
    case 3: any |= rows_p(3, J, T, r0, i0, c0, nc, lse, delta, mrow0); break;
    case 2: any |= rows_p(2, J, T, r0, i0, c0, nc, lse, delta, mrow0); break;
    case 1: any |= rows_p(1, J, T, r0, i0, c0, nc, lse, delta, mrow0); break;
    }
    if (!any)
        return;
    pack_rows(T->dop, J->dout + (bh * J->L + i0) * J->W, nr, BR, J->W, J->Wp);
    for (r0 = 0; r0 + RR <= nr; r0 += RR) rows_ds(RR, J, T, r0, i0, delta);
    switch (nr - r0) {
    case 3: rows_ds(3, J, T, r0, i0, delta); break;
    case 2: rows_ds(2, J, T, r0, i0, delta); break;
    case 1: rows_ds(1, J, T, r0, i0, delta); break;
    }
    outer(T->dva, T->p, T->dop, nr, nc, J->Wp);
    outer(T->dka, T->ds, T->qp, nr, nc, J->Wp);
    float *dqr = dq + (bh * J->L + i0) * J->Wp;
    for (r0 = 0; r0 + RR <= nr; r0 += RR)
        dq_rows(RR, dqr + (size_t)r0 * J->Wp, T->ds + (size_t)r0 * BC, T->kn, nc, J->Wp);
    switch (nr - r0) {
    case 3: dq_rows(3, dqr + (size_t)r0 * J->Wp, T->ds + (size_t)r0 * BC, T->kn, nc, J->Wp); break;
    case 2: dq_rows(2, dqr + (size_t)r0 * J->Wp, T->ds + (size_t)r0 * BC, T->kn, nc, J->Wp); break;
    case 1: dq_rows(1, dqr + (size_t)r0 * J->Wp, T->ds + (size_t)r0 * BC, T->kn, nc, J->Wp); break;
    }
}

/* the key block at c0 of (b, kv head hk) against every row of its group's query heads; dQ into dq */
static void key_block(const bjob_t *J, const scratch_t *T, int b, int hk, long long c0, float *dq) {
    const long long nc = J->S - c0 < BC ? J->S - c0 : BC;
    const size_t bk = ((size_t)b * J->Hkv + hk) * J->S + c0;
    pack_t(T->kt, J->k + bk * J->W, nc, J->W);
    pack_t(T->vt, J->v + bk * J->W, nc, J->W);
    pack_rows(T->kn, J->k + bk * J->W, nc, BC, J->W, J->Wp);
    memset(T->dka, 0, sizeof(float) * BC * J->Wp);
    memset(T->dva, 0, sizeof(float) * BC * J->Wp);
    const int g = J->Hq / J->Hkv;
    const long long first = J->causal ? c0 / BR * BR : 0;
    for (int h = hk * g; h < (hk + 1) * g; h++)
        for (long long i0 = first; i0 < J->L; i0 += BR)
            tile(J, T, b, h, i0, J->L - i0 < BR ? (int)(J->L - i0) : BR, c0, nc, dq);
    memcpy(J->dk + bk * J->Wp, T->dka, sizeof(float) * nc * J->Wp);
    memcpy(J->dv + bk * J->Wp, T->dva, sizeof(float) * nc * J->Wp);
}

/* dO . O of every row (the caller's spare column, if any, makes it dO . O - dlse) */
static void deltas(const bjob_t *J, long long row) {
    const float *a = J->dout + row * J->W, *o = J->o + row * J->W;
    __m512 s = _mm512_setzero_ps();
    int w = 0;
    for (; w + 16 <= J->W; w += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + w), _mm512_loadu_ps(o + w), s);
    const __mmask16 t = first(J->W - w);
    if (t && w < J->W)
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(t, a + w), _mm512_maskz_loadu_ps(t, o + w), s);
    J->delta[row] = _mm512_reduce_add_ps(s);
}

int kf_backward(const float *q, const float *k, const float *v, const float *o, const float *dout,
                const float *lse, const void *mask, int mkind, int mhd, long long msb, long long msh, long long msl,
                int B, int Hq, int Hkv, long long L, long long S, int W, int causal, float scale,
                float *dq, float *dk, float *dv, int threads) {
    if (W < 1 || W > 256 || Hkv < 1 || Hq % Hkv || (mask && mhd < 1))
        return 1;
    bjob_t J = {q, k, v, o, dout, lse, (const unsigned char *)mask, mask ? mkind : 0, mhd > 0 ? mhd : 1,
                msb, msh, msl, B, Hq, Hkv, W, (W + 15) / 16 * 16, causal, L, S, scale, dq, dk, dv, NULL};
    const long long rows = (long long)B * Hq * L, items = (long long)B * Hkv, blocks = (S + BC - 1) / BC;
    J.delta = (float *)malloc(sizeof(float) * (rows > 0 ? rows : 1));
    if (!J.delta)
        return 2;
    if (threads < 1)
        threads = 1;
    /* whole items per thread where they divide evenly (or are many); else (item, key block) pairs with a
     * dq buffer for each thread but the first */
    const int whole = items % threads == 0 || items >= 4LL * threads || threads == 1;
    const size_t dqn = (size_t)rows * J.Wp;
    float **bufs = (float **)calloc((size_t)threads, sizeof(float *));
    int err = bufs == NULL;
    const size_t sf = scratch_floats(&J);
    #pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        #pragma omp for schedule(static)
        for (long long r = 0; r < rows; r++) deltas(&J, r);
        float *mem = (float *)malloc(sizeof(float) * sf);
        float *mine = dq;
        if (!whole && me > 0 && bufs) {
            mine = bufs[me] = (float *)calloc(dqn ? dqn : 1, sizeof(float));
        }
        if (!mem || !mine || !bufs) {
            #pragma omp atomic write
            err = 1;
        }
        #pragma omp barrier
        if (!err) {
            const scratch_t T = carve(&J, mem);
            if (whole) {
                #pragma omp for schedule(static)
                for (long long it = 0; it < items; it++)
                    for (long long c0 = 0; c0 < S; c0 += BC) key_block(&J, &T, (int)(it / Hkv), (int)(it % Hkv), c0, dq);
            } else {
                #pragma omp for schedule(dynamic, 1)
                for (long long w = 0; w < items * blocks; w++) {
                    const long long it = w % items, c0 = w / items * BC;
                    key_block(&J, &T, (int)(it / Hkv), (int)(it % Hkv), c0, mine);
                }
                #pragma omp for schedule(static)
                for (long long i = 0; i < (long long)dqn; i++)
                    for (int t = 1; t < nt; t++) dq[i] += bufs[t][i];
            }
        }
        free(mem);
        #pragma omp barrier
        if (mine != dq)
            free(mine);
    }
    free(bufs);
    free(J.delta);
    return err ? 2 : 0;
}
