/* keyfold's float32 attention backward on AVX-512 FMAs (bfloat16's products on AMX tiles), or on AVX2 FMAs
 * where the CPU has no AVX-512 (simd.h's 16-lane vectors as two 8-lane halves, the same bits): the gradients
 * of one fused call (a piece of a plan: its rows, its keys, a causal flag or a mask tile), from the global
 * out and lse, as PyTorch's fused CPU op gives them, with P recomputed by an e^x of about 1 ulp.
 *
 * Why keyfold has its own: the op's exponential loses precision (dv 3.5x the naive float32 error at
 * score std 1, 7.8x at 3, 9.6x at 6, past the 3x rule of docs/math.md from a score spread of 3 on).
 *
 * What P is recomputed against matters as much as e^x. The naive softmax normalises with its own
 * scores, so their rounding cancels between a P and its row's sum; a backward takes the forward's lse,
 * and its P is off by the difference between the two computations of a score. Here a score is summed
 * as the prefill kernel and the op's GEMM sum it, one FMA a head dimension in order, so a forward on
 * either gives the same sums bit for bit (summed exactly in float64 instead, gradients broke the rule
 * 4x as often in a 700-case fuzz); on the tile path the prefill kernel's AMX forward and this backward
 * both sum by tdpbf16ps in 32-wide chunks in order, the same bits again. Where the forward summed otherwise (the decode kernel's few rows, a
 * small GEMM), the caller first asks for `sums`: each row's sum of P and of P dP over the call's keys,
 * from the backward's own scores; over all of a row's pieces they give lse + log(sum P) and
 * delta = sum P dP / sum P, which the caller passes back (`lse`, `lse_lo`, `delta`) for the gradients:
 * P and delta as the naive backward takes them. There `wide` sums the scores and dP in float64 (the
 * caller asks for it at wide heads, where a float32 sum over 256 terms is itself too coarse; the
 * sums and the gradients must be asked alike).
 *
 * The math (FlashAttention-2's backward, docs/math.md section 2), for a row r and a key c:
 *     P = exp(scale q_r.k_c + m_rc - lse_r)      delta_r = dO_r . O_r  (minus dlse_r: the caller's spare column)
 *     dV_c += P dO_r     dP = dO_r . v_c     dS = P (dP - delta_r)     dQ_r += scale dS k_c     dK_c += scale dS q_r
 *
 * Layout of the work: one key block of BC keys at a time is packed (K and V transposed for the score
 * and dP products, K as rows for dQ) and its dK, dV accumulated in scratch over every row block of
 * every query head of its group; dQ is accumulated in place over the key blocks, in their order. A
 * thread takes whole (batch, kv head) items; with fewer than SPLIT items the key blocks go in order, each
 * block's rows in two fixed halves that run side by side (their dQ rows apart), the halves' dK and dV
 * summed in order after each block. Which thread runs what never changes a bit: the gradients are the
 * same run to run and at any thread count.
 *
 * bfloat16 and float16 inputs (dt) are read as they are, each value exactly a float32; everything
 * after the load is the float32 path. Where the build has AMX and the OS grants the tile registers,
 * bfloat16 takes the tile path instead (J->amx, not wide; see "The tile path" below): the five products on
 * AMX tiles, everything between them as here; 2.1-2.7x faster at head sizes 64-128 (B=1, H=8, 2k rows,
 * 2 threads, Intel Xeon with AMX).
 *
 * Products are register tiles of RR rows (scores, dP, dQ) or CK keys (dK, dV) by a chunk of up to 64
 * columns (four vectors; one on AVX2, whose 16 registers hold RR x 2 halves). Hidden keys (the causal flag, a bool mask, padding past the call's keys) get
 * P = 0 exactly; a tile whose P is all 0 does none of the four products after its scores. A NaN or
 * infinite score reaches the gradients as it does in the op. */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define BR 48  /* query rows per tile */
#define BC 64  /* keys per tile: four vectors */
#define RR 6   /* rows of a register tile (scores, dP, dQ): 6 x 4 accumulators */
#define CK 4   /* keys of a register tile (dK, dV) */
#define SPLIT 4 /* (batch, kv head) items from which each is one thread's work, its rows not halved */
#define BRA 64  /* AMX: query rows per tile (four 16-row tiles; dK and dV sum them in two steps of 32) */
#define BRM 64  /* the most rows of a tile on either path (the P and dS scratch) */

typedef struct {
    const char *q, *k, *v, *o, *dout;         /* (B, Hq, L, W): q, o, dout; (B, Hkv, S, W): k, v; dtype dt */
    int dt, es;                               /* 0 float32, 1 bfloat16, 2 float16; es: bytes an element */
    const float *lse;                         /* (B, Hq, L) */
    const float *lse_lo;                      /* NULL, or what lse leaves of a float64 lse (lse + lse_lo) */
    const unsigned char *mask;                /* NULL, bool (kind 1) or float32 additive (kind 2) */
    int mkind, mhd;                           /* mask head of query head h: h / mhd */
    long long msb, msh, msl;                  /* mask element strides (the key's is 1) */
    int B, Hq, Hkv, W, Wp, causal;            /* Wp: W rounded up to 16 (the stride of dq, dk, dv) */
    int wide;                                 /* s and dP summed in float64 (else float32, in order) */
    long long L, S;
    float scale;
    float *dq, *dk, *dv;                      /* dq (B, Hq, L, Wp); dk, dv (B, Hkv, S, Wp) */
    float *delta;                             /* (B, Hq, L) */
    const float *delta_lo;                    /* NULL, or what delta leaves of a float64 delta (wide only) */
    int amx, br;                              /* bfloat16 products on AMX tiles; rows per tile (BR or BRA) */
} bjob_t;

typedef struct {
    float *kt, *vt, *kn, *qp, *dop, *p, *ds, *dka, *dva;  /* kt, vt: float64 when wide */
    double *qd, *dod;                                     /* wide: the tile's q and dO rows in float64 */
    uint16_t *kd, *vd, *kr, *qa, *da, *qr, *dr;  /* AMX operands (see "The tile path") */
    uint16_t *pth, *ptl, *dth, *dtl, *dsh, *dsl;
    float *dqs;
} scratch_t;

/* AMX operands: head-dimension chunks of 32 */
static int chunks32(const bjob_t *J) { return (J->W + 31) / 32; }

/* slices of one heap block, each 64-byte aligned: at is the offset from the block's first aligned byte;
 * with no block (base NULL) they only count the bytes */
typedef struct {
    char *base;
    size_t at;
} carver_t;

static void *slice(carver_t *c, size_t floats) {
    c->at = (c->at + 63) & ~(size_t)63;
    void *p = c->base ? c->base + c->at : NULL;
    c->at += sizeof(float) * floats;
    return p;
}

/* One thread's scratch, carved from m (NULL: measured only, the bytes in *bytes). The FMA path's buffers
 * (kt .. dop) are empty on the tile path, which has its own (kd .. dqs, see "The tile path") */
static scratch_t carve(const bjob_t *J, char *m, size_t *bytes) {
    scratch_t s;
    memset(&s, 0, sizeof(s));
    carver_t c = {m ? (char *)(((size_t)m + 63) & ~(size_t)63) : NULL, 0};
    const size_t fma = !J->amx;
    s.kt = (float *)slice(&c, fma * J->W * BC * 2);
    s.vt = (float *)slice(&c, fma * J->W * BC * 2);
    s.qd = (double *)slice(&c, fma * BR * J->W * 2);
    s.dod = (double *)slice(&c, fma * BR * J->W * 2);
    s.kn = (float *)slice(&c, fma * BC * J->Wp);
    s.qp = (float *)slice(&c, fma * BR * J->Wp);
    s.dop = (float *)slice(&c, fma * BR * J->Wp);
    s.dka = (float *)slice(&c, (size_t)BC * J->Wp);
    s.dva = (float *)slice(&c, (size_t)BC * J->Wp);
    s.p = (float *)slice(&c, (size_t)BRM * BC);
    s.ds = (float *)slice(&c, (size_t)BRM * BC);
    if (J->amx) {  /* tile operands, each a whole number of 16 x 64-byte tiles */
        const size_t Wc = (size_t)chunks32(J), Wt = (size_t)J->Wp / 16, T2 = TILE / 2;  /* floats a tile */
        s.kd = (uint16_t *)slice(&c, Wc * 4 * T2);
        s.vd = (uint16_t *)slice(&c, Wc * 4 * T2);
        s.kr = (uint16_t *)slice(&c, 2 * Wt * T2);
        s.qr = (uint16_t *)slice(&c, 2 * Wt * T2);
        s.dr = (uint16_t *)slice(&c, 2 * Wt * T2);
        s.qa = (uint16_t *)slice(&c, (size_t)BRA * Wc * 16);
        s.da = (uint16_t *)slice(&c, (size_t)BRA * Wc * 16);
        uint16_t **a[6] = {&s.pth, &s.ptl, &s.dth, &s.dtl, &s.dsh, &s.dsl};
        for (int i = 0; i < 6; i++) *a[i] = (uint16_t *)slice(&c, 8 * T2);
        s.dqs = (float *)slice(&c, (size_t)BRA * J->Wp);
    }
    if (bytes)
        *bytes = c.at + 63;  /* and the block's first aligned byte */
    return s;
}

/* the lanes m of x[i..i+16) as float32, x of dtype dt (0 float32, 1 bfloat16, 2 float16): 16-bit
 * inputs are read as they are, each value exactly a float32 */
static inline vf ld(const char *x, size_t i, __mmask16 m, int dt) {
    if (dt == 0)
        return vf_maskz_loadu(m, (const float *)x + i);
    return vf_load16((const uint16_t *)x + i, m, dt == 1);
}

/* rows [0, n) of x (dtype dt, row stride W) into dst (float32, row stride Wp), zero past W and past n
 * up to `rows`; and into dd (row stride W, float64) unless it is NULL */
static void pack_rows(float *dst, double *dd, const char *x, int dt, long long n, int rows, int W, int Wp) {
    for (int r = 0; r < rows; r++) {
        float *d = dst + (size_t)r * Wp;
        if (r < n) {
            for (int w = 0; w < Wp; w += 16) vf_store(d + w, ld(x, (size_t)r * W + w, lanes(0, W - w), dt));
        } else {
            memset(d, 0, sizeof(float) * Wp);
        }
        if (dd)
            for (int w = 0; w < W; w++) dd[(size_t)r * W + w] = d[w];
    }
}

/* keys [0, n) of x (dtype dt, row stride W) transposed into dst (W x BC; float64 when wide), zero past
 * n, in 16 x 16 blocks (element by element it was most of the time of calls of few rows) */
static void pack_t(float *dst, const char *x, int dt, long long n, int W, int wide) {
    for (int c = 0; c < BC; c += 16)
        for (int w = 0; w < W; w += 16) {
            if (c >= n) {  /* keys past the call's: zeros, nothing to load */
                for (int i = 0; i < 16 && w + i < W; i++)
                    memset(wide ? (void *)((double *)dst + (size_t)(w + i) * BC + c) : (void *)(dst + (size_t)(w + i) * BC + c),
                           0, wide ? 128 : 64);
                continue;
            }
            const __mmask16 cols = lanes(0, W - w);
            vf r[16];
            for (int i = 0; i < 16; i++) r[i] = c + i < n ? ld(x, (size_t)(c + i) * W + w, cols, dt) : vf_zero();
            vf_transpose(r);
            for (int i = 0; i < 16 && w + i < W; i++) {
                const size_t at = (size_t)(w + i) * BC + c;
                if (wide) {
                    vd_store((double *)dst + at, vf_half(r[i], 0));
                    vd_store((double *)dst + at + 8, vf_half(r[i], 1));
                } else {
                    vf_store(dst + at, r[i]);
                }
            }
        }
}

/* t[r][0..nx) = sum over w < W of a[r][w] * bt[w][0..16 nx), one FMA a term in order of w (as the
 * prefill kernel's and the GEMM's scores), for nr rows (row stride lda) */
static inline __attribute__((always_inline)) void dot_part(const int nr, const int nx, const float *a, int lda,
                                                          const float *bt, int W, vf t[RR][VF_TILE]) {
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nx; x++) t[r][x] = vf_zero();
    for (int w = 0; w < W; w++) {
        const float *b = bt + (size_t)w * BC;
        vf bx[VF_TILE];
        for (int x = 0; x < nx; x++) {
            bx[x] = vf_load(b + 16 * x);
            vf_keep(&bx[x]);
        }
        for (int r = 0; r < nr; r++) {
            const vf s = vf_set1(a[(size_t)r * lda + w]);
            for (int x = 0; x < nx; x++) t[r][x] = vf_fmadd(s, bx[x], t[r][x]);
        }
    }
}

/* acc[r][0..nk) as dot_part, VF_TILE key vectors at a time (a register tile of AVX2 holds one) */
static inline __attribute__((always_inline)) void dot(const int nr, const int nk, const float *a, int lda,
                                                     const float *bt, int W, vf acc[RR][4]) {
#if VF_TILE == 4
    dot_part(nr, nk, a, lda, bt, W, acc);
#else
    for (int x0 = 0; x0 < nk; x0 += VF_TILE) {
        vf t[RR][VF_TILE];
        dot_part(nr, VF_TILE, a, lda, bt + 16 * x0, W, t);
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < VF_TILE; x++) acc[r][x0 + x] = t[r][x];
    }
#endif
}

/* t[r][0..VD_TILE) = sum over w < W of a[r][w] * bt[w][0..8 VD_TILE) in float64, for nr <= 3 rows (row stride W) */
static inline __attribute__((always_inline)) void dot64_part(const int nr, const double *a, const double *bt, int W,
                                                            vd t[3][VD_TILE]) {
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < VD_TILE; x++) t[r][x] = vd_zero();
    for (int w = 0; w < W; w++) {
        const double *b = bt + (size_t)w * BC;
        vd s[3];
        for (int r = 0; r < nr; r++) s[r] = vd_set1(a[(size_t)r * W + w]);
        for (int x = 0; x < VD_TILE; x++) {
            vd bx = vd_load(b + 8 * x);
            vd_keep(&bx);
            for (int r = 0; r < nr; r++) t[r][x] = vd_fmadd(s[r], bx, t[r][x]);
        }
    }
}

/* acc[r][0..7]: the block's 64 keys as dot64_part, VD_TILE vectors of 8 at a time */
static inline __attribute__((always_inline)) void dot64(const int nr, const double *a, const double *bt, int W,
                                                       vd acc[3][8]) {
#if VD_TILE == 8
    dot64_part(nr, a, bt, W, acc);
#else
    for (int x0 = 0; x0 < 8; x0 += VD_TILE) {
        vd t[3][VD_TILE];
        dot64_part(nr, a, bt + 8 * x0, W, t);
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < VD_TILE; x++) acc[r][x0 + x] = t[r][x];
    }
#endif
}

/* the key lanes of vector x in row gr that the call shows it: inside the call's keys, at or left of
 * the diagonal under the causal flag, true in a bool mask */
static inline __mmask16 seen(const bjob_t *J, const unsigned char *mrow, long long gr, long long c0, int x,
                             long long nc) {
    __mmask16 k = lanes(0, nc - 16 * x);
    if (J->causal)
        k &= lanes(0, gr - (c0 + 16 * x) + 1);
    if (J->mkind == 1)
        k = bytes_set(k, mrow + c0 + 16 * x);
    return k;
}

/* P = e^t on the lanes of k (0 elsewhere) stored at dst; whether any is not 0 */
static inline int put_p(float *dst, __mmask16 k, vf t) {
    const vf p = vf_maskz(k, vf_exp(t));
    vf_store(dst, p);
    return vf_nonzero(p) != 0;
}

/* P of nr rows (tile rows r0.. of the row block at global row i0; key block at c0 of nc keys) into
 * T->p; whether any P is not 0 */
static inline __attribute__((always_inline)) int rows_p(const int nr, const int nk, const bjob_t *J,
                                                       const scratch_t *T, int r0,
                                                       long long i0, long long c0, long long nc, const float *lse,
                                                       const float *lo, const unsigned char *mrow0) {
    vf acc[RR][4];
    int any = 0;
    if (J->amx)
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < nk; x++) acc[r][x] = vf_load(T->p + (size_t)(r0 + r) * BC + 16 * x);
    else
        dot(nr, nk, T->qp + (size_t)r0 * J->Wp, J->Wp, T->kt, J->W, acc);
    const vf sc = vf_set1(J->scale);
    for (int r = 0; r < nr; r++) {
        const long long gr = i0 + r0 + r;
        const unsigned char *mrow = J->mask ? mrow0 + (size_t)gr * J->msl * (J->mkind == 2 ? 4 : 1) : NULL;
        const vf nl = vf_set1(-lse[gr]);
        for (int x = 0; x < nk; x++) {
            const __mmask16 k = seen(J, mrow, gr, c0, x, nc);
            vf t;
            if (J->mkind == 2)
                t = vf_add(vf_fmadd(acc[r][x], sc, vf_maskz_loadu(k, (const float *)mrow + c0 + 16 * x)), nl);
            else
                t = vf_fmadd(acc[r][x], sc, nl);
            if (lo)  /* the exponent is near 0 where P matters: the low part keeps its bits there */
                t = vf_sub(t, vf_set1(lo[gr]));
            any |= put_p(T->p + (size_t)(r0 + r) * BC + 16 * x, k, t);
        }
    }
    return any;
}

/* sigma += sum P, tau += sum P dP of one row over its first 16 nk keys (float64), dP in float64 as two
 * vectors a 16 keys */
static inline __attribute__((always_inline)) void add_sums(const int nk, const float *pr, const vd *dp,
                                                           double *sigma, double *tau) {
    vd s = vd_zero(), t = vd_zero();
    for (int x = 0; x < nk; x++) {
        const vf p = vf_load(pr + 16 * x);
        s = vd_add(s, vd_add(vf_half(p, 0), vf_half(p, 1)));
        t = vd_fmadd(vf_half(p, 0), dp[2 * x], t);
        t = vd_fmadd(vf_half(p, 1), dp[2 * x + 1], t);
    }
    *sigma += vd_sum(s);
    *tau += vd_sum(t);
}

/* dS = scale P (dP - delta) of nr rows into T->ds; with `sigma`, instead the row sums (add_sums) */
static inline __attribute__((always_inline)) void rows_ds(const int nr, const int nk, const bjob_t *J,
                                                         const scratch_t *T, int r0,
                                                         long long i0, const float *delta, double *sigma,
                                                         double *tau) {
    vf acc[RR][4];
    if (J->amx)
        for (int r = 0; r < nr; r++)
            for (int x = 0; x < nk; x++) acc[r][x] = vf_load(T->ds + (size_t)(r0 + r) * BC + 16 * x);
    else
        dot(nr, nk, T->dop + (size_t)r0 * J->Wp, J->Wp, T->vt, J->W, acc);
    const vf sc = vf_set1(J->scale);
    for (int r = 0; r < nr; r++) {
        const float *pr = T->p + (size_t)(r0 + r) * BC;
        if (sigma) {
            vd dp[8];
            for (int x = 0; x < nk; x++) {
                dp[2 * x] = vf_half(acc[r][x], 0);
                dp[2 * x + 1] = vf_half(acc[r][x], 1);
            }
            add_sums(nk, pr, dp, sigma + i0 + r0 + r, tau + i0 + r0 + r);
            continue;
        }
        const vf dl = vf_set1(delta[i0 + r0 + r]);
        for (int x = 0; x < nk; x++)
            vf_store(T->ds + (size_t)(r0 + r) * BC + 16 * x,
                     vf_mul(vf_mul(vf_load(pr + 16 * x), sc), vf_sub(acc[r][x], dl)));
    }
}

/* rows_p with s summed in float64 and the exponent scale s + m - (lse + lo) taken in float64, rounded once */
static inline __attribute__((always_inline)) int rows_p64(const int nr, const bjob_t *J, const scratch_t *T, int r0,
                                                         long long i0, long long c0, long long nc, const float *lse,
                                                         const float *lo, const unsigned char *mrow0) {
    vd acc[3][8];
    int any = 0;
    dot64(nr, T->qd + (size_t)r0 * J->W, (const double *)T->kt, J->W, acc);
    const vd sc = vd_set1(J->scale);
    for (int r = 0; r < nr; r++) {
        const long long gr = i0 + r0 + r;
        const unsigned char *mrow = J->mask ? mrow0 + (size_t)gr * J->msl * (J->mkind == 2 ? 4 : 1) : NULL;
        const vd nl = vd_set1(-((double)lse[gr] + (lo ? (double)lo[gr] : 0.0)));
        for (int x = 0; x < 4; x++) {
            const __mmask16 k = seen(J, mrow, gr, c0, x, nc);
            vd a = nl, b = nl;
            if (J->mkind == 2) {
                const vf m = vf_maskz_loadu(k, (const float *)mrow + c0 + 16 * x);
                a = vd_add(nl, vf_half(m, 0));
                b = vd_add(nl, vf_half(m, 1));
            }
            const vf t = vd_narrow(vd_fmadd(acc[r][2 * x], sc, a), vd_fmadd(acc[r][2 * x + 1], sc, b));
            any |= put_p(T->p + (size_t)(r0 + r) * BC + 16 * x, k, t);
        }
    }
    return any;
}

/* rows_ds with dP summed in float64 and dP - delta taken in float64 (delta + dlo, dlo NULL or its low part),
 * rounded once: a row one key dominates has dP of that key and delta equal to their last bits, so dS there
 * is 0, as the naive backward's; delta rounded to float32 alone left dS an ulp of delta (dq 2.5-5x the naive
 * float32 error, 7 rows at head size 80, scale 1, score std 6: 3 of 40 seeds) */
static inline __attribute__((always_inline)) void rows_ds64(const int nr, const bjob_t *J, const scratch_t *T, int r0,
                                                           long long i0, const float *delta, const float *dlo,
                                                           double *sigma, double *tau) {
    vd acc[3][8];
    dot64(nr, T->dod + (size_t)r0 * J->W, (const double *)T->vt, J->W, acc);
    const vf sc = vf_set1(J->scale);
    for (int r = 0; r < nr; r++) {
        const float *pr = T->p + (size_t)(r0 + r) * BC;
        if (sigma) {
            add_sums(4, pr, acc[r], sigma + i0 + r0 + r, tau + i0 + r0 + r);
            continue;
        }
        const vd dl = vd_set1((double)delta[i0 + r0 + r] + (dlo ? (double)dlo[i0 + r0 + r] : 0.0));
        for (int x = 0; x < 4; x++) {
            const vf d = vd_narrow(vd_sub(acc[r][2 * x], dl), vd_sub(acc[r][2 * x + 1], dl));
            vf_store(T->ds + (size_t)(r0 + r) * BC + 16 * x, vf_mul(vf_mul(vf_load(pr + 16 * x), sc), d));
        }
    }
}

/* rows_p over the tile's nr rows in register tiles of RR, nk key vectors (2 where the block has at most
 * 32 keys: a call of few keys computes no padding) */
static inline __attribute__((always_inline)) int p32(const int nk, const bjob_t *J, const scratch_t *T, int nr,
                                                    long long i0, long long c0, long long nc, const float *lse,
                                                    const float *lo, const unsigned char *mrow0) {
    int any = 0, r0 = 0;
    for (; r0 + RR <= nr; r0 += RR) any |= rows_p(RR, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0);
    switch (nr - r0) {
    case 5: any |= rows_p(5, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0); break;
    case 4: any |= rows_p(4, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0); break;
    case 3: any |= rows_p(3, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0); break;
    case 2: any |= rows_p(2, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0); break;
    case 1: any |= rows_p(1, nk, J, T, r0, i0, c0, nc, lse, lo, mrow0); break;
    }
    return any;
}

/* rows_ds over the tile's nr rows, as p32 */
static inline __attribute__((always_inline)) void ds32(const int nk, const bjob_t *J, const scratch_t *T, int nr,
                                                      long long i0, const float *delta, double *sigma, double *tau) {
    int r0 = 0;
    for (; r0 + RR <= nr; r0 += RR) rows_ds(RR, nk, J, T, r0, i0, delta, sigma, tau);
    switch (nr - r0) {
    case 5: rows_ds(5, nk, J, T, r0, i0, delta, sigma, tau); break;
    case 4: rows_ds(4, nk, J, T, r0, i0, delta, sigma, tau); break;
    case 3: rows_ds(3, nk, J, T, r0, i0, delta, sigma, tau); break;
    case 2: rows_ds(2, nk, J, T, r0, i0, delta, sigma, tau); break;
    case 1: rows_ds(1, nk, J, T, r0, i0, delta, sigma, tau); break;
    }
}

#ifdef KF_AMX
/* 16 bfloat16 values as the float32 values they are */
static inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* The tile path (J->amx), for bfloat16: the five products of a tile on AMX (tdpbf16ps: bfloat16 pairs, exact
 * products, summed in float32), everything between them as on the float32 path (P, dS and the sums from
 * the scores and dP the tiles leave in p and ds). The scores and dP multiply the 16-bit inputs as they are.
 * dV, dK and dQ multiply by P and dS, float32 values: each is carried as two bfloat16 terms, hi (rounded)
 * and lo (what hi leaves, rounded), whose sum is the value to 16 bits (a relative 2^-17; P rounded once to
 * bfloat16, as the naive backward rounds it, would be 2^-9), and each product is taken for both terms. */

/* c (float32, row stride ldc) += the sum over steps st < ns of A_st B_st on the 2 x 2 block of 16 x 16 tiles
 * at c (the second row tile 16 rows down where rows2, the second column tile 16 columns right where cols2).
 * A_st: the tile at a + st as (rows lda bytes apart; the second row tile at + a2), and where alo is not
 * NULL the tile at the same place of alo too (the second term of the same values); B_st: the tile at
 * b + st bs (the second column tile at + TILE). fresh: c starts at 0, not at its values. */
static void mm(float *c, int ldc, int fresh, int rows2, int cols2, const uint16_t *a, const uint16_t *alo, size_t as,
               size_t a2, int lda, const uint16_t *b, size_t bs, int ns) {
    if (fresh) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, c, ldc * 4);
        if (cols2) _tile_loadd(1, c + 16, ldc * 4);
        if (rows2) _tile_loadd(2, c + (size_t)16 * ldc, ldc * 4);
        if (rows2 && cols2) _tile_loadd(3, c + (size_t)16 * ldc + 16, ldc * 4);
    }
    for (int st = 0; st < ns; st++) {
        _tile_loadd(6, b + st * bs, 64);
        if (cols2) _tile_loadd(7, b + st * bs + TILE, 64);
        for (int part = 0; part < (alo ? 2 : 1); part++) {
            const uint16_t *x = (part ? alo : a) + st * as;
            _tile_loadd(4, x, lda);
            _tile_dpbf16ps(0, 4, 6);
            if (cols2) _tile_dpbf16ps(1, 4, 7);
            if (rows2) {
                _tile_loadd(5, x + a2, lda);
                _tile_dpbf16ps(2, 5, 6);
                if (cols2) _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, c, ldc * 4);
    if (cols2) _tile_stored(1, c + 16, ldc * 4);
    if (rows2) _tile_stored(2, c + (size_t)16 * ldc, ldc * 4);
    if (rows2 && cols2) _tile_stored(3, c + (size_t)16 * ldc + 16, ldc * 4);
}

/* keys [0, n) of x (bfloat16, row stride W) as the operand of a product over the head dimension (Q K^T,
 * dO V^T): tile (cw, t), at (4 cw + t) TILE, holds dims [32cw, 32cw + 32) of keys [16t, 16t + 16), its row i
 * the dims 32cw + 2i and 32cw + 2i + 1 of each key (a 16 x 16 transpose of dim pairs); zeros past n and W */
static void pack_dims(uint16_t *dst, const uint16_t *x, long long n, int W) {
    for (int cw = 0; cw < (W + 31) / 32; cw++) {
        const __mmask32 m = first32(W - 32 * cw);
        for (int t = 0; t < BC / 16; t++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = 16 * t + i < n ? _mm512_maskz_loadu_epi16(m, x + (size_t)(16 * t + i) * W + 32 * cw)
                                      : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *d = dst + (size_t)(4 * cw + t) * TILE;
            for (int i = 0; i < 16; i++) _mm512_store_si512(d + 32 * i, r[i]);
        }
    }
}

/* rows [0, n) of x (bfloat16, row stride W) as the operand of a product over those rows (dS K, P^T dO,
 * dS^T Q): tile (rc, j), at (rc Wt + j) TILE, holds columns [16j, 16j + 16) of rows [32rc, 32rc + 32), its
 * row i rows 32rc + 2i and 32rc + 2i + 1 paired; zeros past n and W */
static void pack_rowpairs(uint16_t *dst, const uint16_t *x, long long n, int chunks, int W, int Wt) {
    for (int rc = 0; rc < chunks; rc++)
        for (int j = 0; j < Wt; j++) {
            const __mmask16 m = lanes(0, W - 16 * j);
            uint16_t *d = dst + (size_t)(rc * Wt + j) * TILE;
            for (int i = 0; i < 16; i++) {
                const long long r = 32 * rc + 2 * i;
                const __m256i z = _mm256_setzero_si256();
                const __m256i a = r < n ? _mm256_maskz_loadu_epi16(m, x + r * W + 16 * j) : z;
                const __m256i b = r + 1 < n ? _mm256_maskz_loadu_epi16(m, x + (r + 1) * W + 16 * j) : z;
                _mm512_store_si512(d + 32 * i, pair_rows(a, b));
            }
        }
}

/* y (row stride BC, float32) = the scores (x: q rows, kd: the packed keys) or dP (x: dO rows, vd: the packed
 * values) of the tile's nr rows against the key block's nc keys; x's rows copied into pad first where
 * they are fewer than BRA or W is not a multiple of 32 (zeros past them) */
static void head_product(const bjob_t *J, uint16_t *pad, const char *x, const uint16_t *kd, int nr, long long nc,
                         float *y) {
    const int Wc = chunks32(J);
    const uint16_t *a = (const uint16_t *)x;
    int ld = J->W;  /* a's row stride in elements */
    if (nr < BRA || J->W % 32) {
        for (int r = 0; r < BRA; r++)
            for (int c = 0; c < Wc; c++) {
                const __m512i y = r < nr ? _mm512_maskz_loadu_epi16(first32(J->W - 32 * c), a + (size_t)r * J->W + 32 * c)
                                         : _mm512_setzero_si512();
                _mm512_store_si512(pad + (size_t)r * Wc * 32 + 32 * c, y);
            }
        a = pad;
        ld = Wc * 32;
    }
    for (int r = 0; r < nr; r += 32)  /* every key tile of a pair: keys past nc give 0, never stale values */
        for (int t = 0; t < (nc > 32 ? 4 : 2); t += 2)
            mm(y + (size_t)r * BC + 16 * t, BC, 1, 1, 1, a + (size_t)r * ld, NULL, 32, (size_t)16 * ld, ld * 2,
               kd + (size_t)t * TILE, 4 * TILE, Wc);
}

/* hi: 16 float32 values of a, then b's, rounded to bfloat16; lo: what hi leaves of each (exact in float32),
 * rounded; 0 where hi is infinite (inf - inf would make an infinite dS a NaN gradient, where the FMA
 * path's is infinite) */
static inline void split2(__m512 a, __m512 b, __m512i *hi, __m512i *lo) {
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    const __m512 ah = widen_bf16(_mm512_castsi512_si256(h)), bh = widen_bf16(_mm512_extracti64x4_epi64(h, 1));
    const __mmask16 fa = ~_mm512_fpclass_ps_mask(ah, 0x18), fb = ~_mm512_fpclass_ps_mask(bh, 0x18);  /* not +-inf */
    *hi = h;
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_sub_ps(fb, b, bh), _mm512_maskz_sub_ps(fa, a, ah));
}

/* x (P or dS, row stride BC) as the operand of a product over its rows (P^T dO, dS^T Q), in two terms: tile
 * (t, rc) of hi and of lo, at (2t + rc) TILE, holds keys [16t, 16t + 16) by rows [32rc, 32rc + 32), its row c
 * key 16t + c: pair i (i < 16) of that row holds rows 32rc + 2i and 32rc + 2i + 1 */
static void split_cols(uint16_t *hi, uint16_t *lo, const float *x, int nrc, int nkt) {
    static const uint16_t order[32] __attribute__((aligned(64))) = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
        14, 30, 15, 31};
    const __m512i mix = _mm512_load_si512(order);
    for (int rc = 0; rc < nrc; rc++)
        for (int t = 0; t < nkt; t++) {
            __m512i h[16], l[16];
            for (int i = 0; i < 16; i++) {
                const float *r = x + (size_t)(32 * rc + 2 * i) * BC + 16 * t;
                split2(_mm512_load_ps(r), _mm512_load_ps(r + BC), &h[i], &l[i]);
                h[i] = _mm512_permutexvar_epi16(mix, h[i]);
                l[i] = _mm512_permutexvar_epi16(mix, l[i]);
            }
            transpose16(h);
            transpose16(l);
            const size_t at = (size_t)(2 * t + rc) * TILE;
            for (int c = 0; c < 16; c++) {
                _mm512_store_si512(hi + at + 32 * c, h[c]);
                _mm512_store_si512(lo + at + 32 * c, l[c]);
            }
        }
}

/* x (dS, row stride BC) as the operand of a product over its keys (dS K), in two terms: tile (a, kc) of hi
 * and of lo, at (2a + kc) TILE, holds rows [16a, 16a + 16) by keys [32kc, 32kc + 32) */
static void split_rows(uint16_t *hi, uint16_t *lo, const float *x, int nrt, int nkc) {
    for (int a = 0; a < nrt; a++)
        for (int kc = 0; kc < nkc; kc++)
            for (int i = 0; i < 16; i++) {
                const float *r = x + (size_t)(16 * a + i) * BC + 32 * kc;
                __m512i h, l;
                split2(_mm512_load_ps(r), _mm512_load_ps(r + 16), &h, &l);
                _mm512_store_si512(hi + (size_t)(2 * a + kc) * TILE + 32 * i, h);
                _mm512_store_si512(lo + (size_t)(2 * a + kc) * TILE + 32 * i, l);
            }
}

/* dV += P^T dO, dK += dS^T q (the key block's, in T->dva, T->dka) and dQ += dS k (dq: the tile's rows of
 * query head bh) of the tile's nr rows at i0 over the key block's nc keys, P and dS in T->p, T->ds */
static void grads_amx(const bjob_t *J, const scratch_t *T, size_t bh, long long i0, int nr, long long nc, float *dq) {
    const int Wp = J->Wp, Wt = Wp / 16, nrc = (nr + 31) / 32, nrt = (nr + 15) / 16, nkt = (int)(nc + 15) / 16,
              nkc = (int)(nc + 31) / 32;
    for (int r = nr; r < 32 * nrc; r++) {  /* rows past nr: no P, no dS (their zero q or dO times an infinite key gave NaN) */
        memset(T->p + (size_t)r * BC, 0, sizeof(float) * BC);
        memset(T->ds + (size_t)r * BC, 0, sizeof(float) * BC);
    }
    split_cols(T->pth, T->ptl, T->p, nrc, nkt);
    split_cols(T->dth, T->dtl, T->ds, nrc, nkt);
    split_rows(T->dsh, T->dsl, T->ds, nrt, nkc);
    const size_t at = (bh * J->L + i0) * J->W;
    pack_rowpairs(T->dr, (const uint16_t *)J->dout + at, nr, nrc, J->W, Wt);
    pack_rowpairs(T->qr, (const uint16_t *)J->q + at, nr, nrc, J->W, Wt);
    for (int t = 0; t < nkt; t += 2)
        for (int j = 0; j < Wt; j += 2) {
            const size_t c = (size_t)16 * t * Wp + 16 * j, a = (size_t)2 * t * TILE;
            mm(T->dva + c, Wp, 0, t + 1 < nkt, j + 1 < Wt, T->pth + a, T->ptl + a, TILE, 2 * TILE, 64,
               T->dr + (size_t)j * TILE, (size_t)Wt * TILE, nrc);
            mm(T->dka + c, Wp, 0, t + 1 < nkt, j + 1 < Wt, T->dth + a, T->dtl + a, TILE, 2 * TILE, 64,
               T->qr + (size_t)j * TILE, (size_t)Wt * TILE, nrc);
        }
    float *d = dq + (bh * J->L + i0) * Wp;
    if (nr < BRA)  /* a partial row block: its dQ rows through scratch, the tiles' 16 rows never past them */
        memcpy(T->dqs, d, sizeof(float) * nr * Wp);
    for (int a = 0; a < nrt; a += 2)
        for (int j = 0; j < Wt; j += 2)
            mm((nr < BRA ? T->dqs : d) + (size_t)16 * a * Wp + 16 * j, Wp, 0, a + 1 < nrt, j + 1 < Wt,
               T->dsh + (size_t)2 * a * TILE, T->dsl + (size_t)2 * a * TILE, TILE, 2 * TILE, 64,
               T->kr + (size_t)j * TILE, (size_t)Wt * TILE, nkc);
    if (nr < BRA)
        memcpy(d, T->dqs, sizeof(float) * nr * Wp);
}
#endif

/* the tile's nr rows of q (dp 0) or dO (dp 1) at x into their product with the key block's nc keys or
 * values: on the tile path the product itself (the scores into T->p, dP into T->ds), on the FMA path the
 * rows packed in float32 (and float64 where wide) for it */
static void rows_in(const bjob_t *J, const scratch_t *T, const char *x, int nr, long long nc, int dp) {
#ifdef KF_AMX
    if (J->amx) {
        head_product(J, dp ? T->da : T->qa, x, dp ? T->vd : T->kd, nr, nc, dp ? T->ds : T->p);
        return;
    }
#else
    (void)nc;
#endif
    pack_rows(dp ? T->dop : T->qp, J->wide ? (dp ? T->dod : T->qd) : NULL, x, J->dt, nr, BR, J->W, J->Wp);
}

/* P, then dS (or the renormalisation's sums) of the tile's nr rows; whether any P is not 0 */
static int scores(const bjob_t *J, const scratch_t *T, int nr, long long i0, long long c0, long long nc,
                  const float *lse, const float *lo, const float *delta, const unsigned char *mrow0, const char *dout,
                  double *sigma, double *tau) {
    int any = 0, r0 = 0;
    if (J->wide) {
        for (; r0 + 3 <= nr; r0 += 3) any |= rows_p64(3, J, T, r0, i0, c0, nc, lse, lo, mrow0);
        if (nr - r0 == 2)
            any |= rows_p64(2, J, T, r0, i0, c0, nc, lse, lo, mrow0);
        else if (nr - r0 == 1)
            any |= rows_p64(1, J, T, r0, i0, c0, nc, lse, lo, mrow0);
    } else if (nc <= 32) {
        any = p32(2, J, T, nr, i0, c0, nc, lse, lo, mrow0);
    } else {
        any = p32(4, J, T, nr, i0, c0, nc, lse, lo, mrow0);
    }
    if (!any)
        return 0;
    rows_in(J, T, dout, nr, nc, 1);
    r0 = 0;
    if (J->wide) {
        const float *dlo = J->delta_lo && delta ? J->delta_lo + (delta - J->delta) : NULL;
        for (; r0 + 3 <= nr; r0 += 3) rows_ds64(3, J, T, r0, i0, delta, dlo, sigma, tau);
        if (nr - r0 == 2)
            rows_ds64(2, J, T, r0, i0, delta, dlo, sigma, tau);
        else if (nr - r0 == 1)
            rows_ds64(1, J, T, r0, i0, delta, dlo, sigma, tau);
    } else if (nc <= 32) {
        ds32(2, J, T, nr, i0, delta, sigma, tau);
    } else {
        ds32(4, J, T, nr, i0, delta, sigma, tau);
    }
    return 1;
}

/* acc (BC keys x Wp, row stride Wp) += pt^T a: keys [0, nc) (in groups of CK), rows [0, nr) of a (row
 * stride Wp) and of pt (row stride BC), one column chunk of nv vectors at column w0 */
static inline __attribute__((always_inline)) void outer_chunk(const int nv, float *dacc, const float *pt,
                                                             const float *a, int nr, long long nc, int Wp, int w0) {
    for (int c0 = 0; c0 < nc; c0 += CK) {
        vf acc[CK][VF_TILE];
        for (int c = 0; c < CK; c++)
            for (int x = 0; x < nv; x++) acc[c][x] = vf_zero();
        for (int r = 0; r < nr; r++) {
            vf av[VF_TILE];
            for (int x = 0; x < nv; x++) {
                av[x] = vf_load(a + (size_t)r * Wp + w0 + 16 * x);
                vf_keep(&av[x]);
            }
            for (int c = 0; c < CK; c++) {
                const vf s = vf_set1(pt[(size_t)r * BC + c0 + c]);
                for (int x = 0; x < nv; x++) acc[c][x] = vf_fmadd(s, av[x], acc[c][x]);
            }
        }
        for (int c = 0; c < CK; c++)
            for (int x = 0; x < nv; x++) {
                float *d = dacc + (size_t)(c0 + c) * Wp + w0 + 16 * x;
                vf_store(d, vf_add(vf_load(d), acc[c][x]));
            }
    }
}

/* column chunks of VF_TILE vectors (the last one narrower) */
static inline int chunk_vectors(int Wp, int w0) { return (Wp - w0) / 16 >= VF_TILE ? VF_TILE : (Wp - w0) / 16; }

static void outer(float *dacc, const float *pt, const float *a, int nr, long long nc, int Wp) {
    for (int w0 = 0; w0 < Wp; w0 += 16 * VF_TILE) {
        switch (chunk_vectors(Wp, w0)) {
#if VF_TILE == 4
        case 4: outer_chunk(4, dacc, pt, a, nr, nc, Wp, w0); break;
        case 3: outer_chunk(3, dacc, pt, a, nr, nc, Wp, w0); break;
        case 2: outer_chunk(2, dacc, pt, a, nr, nc, Wp, w0); break;
#endif
        default: outer_chunk(1, dacc, pt, a, nr, nc, Wp, w0); break;
        }
    }
}

/* dq rows (row stride Wp) += ds kn: nr rows, keys [0, nc), one column chunk of nv vectors at w0 */
static inline __attribute__((always_inline)) void dq_chunk(const int nv, const int nr, float *dq, const float *ds,
                                                          const float *kn, long long nc, int Wp, int w0) {
    vf acc[RR][VF_TILE];
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) acc[r][x] = vf_zero();
    for (int c = 0; c < nc; c++) {
        vf kv[VF_TILE];
        for (int x = 0; x < nv; x++) {
            kv[x] = vf_load(kn + (size_t)c * Wp + w0 + 16 * x);
            vf_keep(&kv[x]);
        }
        for (int r = 0; r < nr; r++) {
            const vf s = vf_set1(ds[(size_t)r * BC + c]);
            for (int x = 0; x < nv; x++) acc[r][x] = vf_fmadd(s, kv[x], acc[r][x]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int x = 0; x < nv; x++) {
            float *d = dq + (size_t)r * Wp + w0 + 16 * x;
            vf_storeu(d, vf_add(vf_loadu(d), acc[r][x]));
        }
}

static inline __attribute__((always_inline)) void dq_rows(const int nr, float *dq, const float *ds, const float *kn,
                                                         long long nc, int Wp) {
    for (int w0 = 0; w0 < Wp; w0 += 16 * VF_TILE) {
        switch (chunk_vectors(Wp, w0)) {
#if VF_TILE == 4
        case 4: dq_chunk(4, nr, dq, ds, kn, nc, Wp, w0); break;
        case 3: dq_chunk(3, nr, dq, ds, kn, nc, Wp, w0); break;
        case 2: dq_chunk(2, nr, dq, ds, kn, nc, Wp, w0); break;
#endif
        default: dq_chunk(1, nr, dq, ds, kn, nc, Wp, w0); break;
        }
    }
}

/* one tile: the row block at i0 (nr rows) of query head h against the packed key block at c0 (nc
 * keys); with sigma, only the renormalisation's sums of its rows */
static void tile(const bjob_t *J, const scratch_t *T, int b, int h, long long i0, int nr, long long c0,
                 long long nc, float *dq, double *sigma, double *tau) {
    const size_t bh = (size_t)b * J->Hq + h;
    const unsigned char *mrow0 = NULL;
    if (J->mask)
        mrow0 = J->mask + ((size_t)b * J->msb + (size_t)(h / J->mhd) * J->msh) * (J->mkind == 2 ? 4 : 1);
    rows_in(J, T, J->q + (bh * J->L + i0) * J->W * J->es, nr, nc, 0);
    if (!scores(J, T, nr, i0, c0, nc, J->lse + bh * J->L, J->lse_lo ? J->lse_lo + bh * J->L : NULL,
                J->delta ? J->delta + bh * J->L : NULL, mrow0,
                J->dout + (bh * J->L + i0) * J->W * J->es, sigma ? sigma + bh * J->L : NULL, tau ? tau + bh * J->L : NULL) ||
        sigma)
        return;
#ifdef KF_AMX
    if (J->amx) {
        grads_amx(J, T, bh, i0, nr, nc, dq);
        return;
    }
#endif
    outer(T->dva, T->p, T->dop, nr, nc, J->Wp);
    outer(T->dka, T->ds, T->qp, nr, nc, J->Wp);
    float *dqr = dq + (bh * J->L + i0) * J->Wp;
    int r0 = 0;
    for (; r0 + RR <= nr; r0 += RR)
        dq_rows(RR, dqr + (size_t)r0 * J->Wp, T->ds + (size_t)r0 * BC, T->kn, nc, J->Wp);
    float *d = dqr + (size_t)r0 * J->Wp;
    const float *s = T->ds + (size_t)r0 * BC;
    switch (nr - r0) {
    case 5: dq_rows(5, d, s, T->kn, nc, J->Wp); break;
    case 4: dq_rows(4, d, s, T->kn, nc, J->Wp); break;
    case 3: dq_rows(3, d, s, T->kn, nc, J->Wp); break;
    case 2: dq_rows(2, d, s, T->kn, nc, J->Wp); break;
    case 1: dq_rows(1, d, s, T->kn, nc, J->Wp); break;
    }
}

static void pack_keys(const bjob_t *J, const scratch_t *T, size_t bk, long long nc) {
#ifdef KF_AMX
    if (J->amx) {
        pack_dims(T->kd, (const uint16_t *)J->k + bk * J->W, nc, J->W);
        pack_dims(T->vd, (const uint16_t *)J->v + bk * J->W, nc, J->W);
        return;
    }
#endif
    pack_t(T->kt, J->k + bk * J->W * J->es, J->dt, nc, J->W, J->wide);
    pack_t(T->vt, J->v + bk * J->W * J->es, J->dt, nc, J->W, J->wide);
}

/* the first row that sees the key block at c0 (a multiple of the rows of a tile, br), and where its rows' two
 * fixed halves meet (a multiple of br after it, or L) */
static long long first_row(const bjob_t *J, long long c0) { return J->causal ? c0 / J->br * J->br : 0; }
static long long middle_row(const bjob_t *J, long long c0) {
    const long long br = J->br, a = first_row(J, c0), n = a < J->L ? (J->L - a + br - 1) / br : 0, m = a + (n + 1) / 2 * br;
    return m < J->L ? m : J->L;
}

/* rows [r0, r1) (r0 a multiple of br) of every query head of (b, kv head hk) against the key block at c0:
 * its dK and dV into T->dka, T->dva (zeroed first), dQ into dq */
static void key_block_rows(const bjob_t *J, const scratch_t *T, int b, int hk, long long c0, long long r0,
                           long long r1, float *dq) {
    const long long nc = J->S - c0 < BC ? J->S - c0 : BC;
    const size_t bk = ((size_t)b * J->Hkv + hk) * J->S + c0;
    memset(T->dka, 0, sizeof(float) * BC * J->Wp);
    memset(T->dva, 0, sizeof(float) * BC * J->Wp);
    if (r0 >= r1)
        return;
    pack_keys(J, T, bk, nc);
#ifdef KF_AMX
    if (J->amx)
        pack_rowpairs(T->kr, (const uint16_t *)J->k + bk * J->W, nc, 2, J->W, J->Wp / 16);
    else
#endif
        pack_rows(T->kn, NULL, J->k + bk * J->W * J->es, J->dt, nc, BC, J->W, J->Wp);
    const int g = J->Hq / J->Hkv;
    for (int h = hk * g; h < (hk + 1) * g; h++)
        for (long long i0 = r0; i0 < r1; i0 += J->br)
            tile(J, T, b, h, i0, r1 - i0 < J->br ? (int)(r1 - i0) : J->br, c0, nc, dq, NULL, NULL);
}

/* the key block at c0 of (b, kv head hk) against every row of its group's query heads; dQ into dq */
static void key_block(const bjob_t *J, const scratch_t *T, int b, int hk, long long c0, float *dq) {
    const long long nc = J->S - c0 < BC ? J->S - c0 : BC;
    const size_t bk = ((size_t)b * J->Hkv + hk) * J->S + c0;
    key_block_rows(J, T, b, hk, c0, first_row(J, c0), J->L, dq);
    memcpy(J->dk + bk * J->Wp, T->dka, sizeof(float) * nc * J->Wp);
    memcpy(J->dv + bk * J->Wp, T->dva, sizeof(float) * nc * J->Wp);
}

/* the renormalisation's sums of rows [i0, i1) (i0 a multiple of br) of every query head of (b, kv head hk)
 * over every key, each key block packed once */
static void row_sums(const bjob_t *J, const scratch_t *T, int b, int hk, long long i0, long long i1, double *sigma,
                     double *tau) {
    const int g = J->Hq / J->Hkv;
    const long long last = J->causal ? (i1 < J->S ? i1 : J->S) : J->S;  /* keys the rows can see */
    for (long long c0 = 0; c0 < last; c0 += BC) {
        const long long nc = J->S - c0 < BC ? J->S - c0 : BC;
        pack_keys(J, T, ((size_t)b * J->Hkv + hk) * J->S + c0, nc);
        const long long r0 = J->causal && c0 / J->br * J->br > i0 ? c0 / J->br * J->br : i0;
        for (int h = hk * g; h < (hk + 1) * g; h++)
            for (long long r = r0; r < i1; r += J->br)
                tile(J, T, b, h, r, i1 - r < J->br ? (int)(i1 - r) : J->br, c0, nc, NULL, sigma, tau);
    }
}

/* dO . O of a row in float64, rounded once (the caller's spare column, if any, makes it dO . O - dlse) */
static double dot_row(const char *a, const char *o, int W, int dt) {
    vd s = vd_zero();
    for (int w = 0; w < W; w += 16) {
        const __mmask16 m = lanes(0, W - w);
        const vf x = ld(a, w, m, dt), y = ld(o, w, m, dt);
        s = vd_fmadd(vf_half(x, 0), vf_half(y, 0), s);
        s = vd_fmadd(vf_half(x, 1), vf_half(y, 1), s);
    }
    return vd_sum(s);
}

/* The gradients into dq (zeros), dk, dv (row stride Wp); delta_in: each row's delta (NULL: dO . O), delta_lo:
 * NULL or its low part (delta_in + delta_lo, read where wide); lse_lo: NULL, or the low part of a float64 lse
 * (lse + lse_lo); wide: s and dP in float64; amx: bfloat16
 * inputs take the tile path (a build with AMX, the tile registers granted: kf_prefill_init; not wide).
 * With sums (2 x B x Hq x L float64): instead each row's sum of P, then of P dP, over these keys. */
int kf_backward(const void *q, const void *k, const void *v, const void *o, const void *dout,
                const float *lse, const float *lse_lo, const float *delta_in, const float *delta_lo, const void *mask,
                int mkind, int mhd,
                long long msb, long long msh, long long msl, int B, int Hq, int Hkv, long long L, long long S,
                int W, int causal, float scale, int wide, int dt, int amx, double *sums, float *dq, float *dk,
                float *dv, int threads) {
    if (W < 1 || W > 4096 || Hkv < 1 || Hq % Hkv || (mask && mhd < 1) || dt < 0 || dt > 2)
        return 1;
#ifndef KF_AMX
    if (amx)
        return 3;
#endif
    const long long rows = (long long)B * Hq * L, items = (long long)B * Hkv, blocks = (S + BC - 1) / BC;
    const int Wp = (W + 15) / 16 * 16;
    if (sums)
        memset(sums, 0, sizeof(double) * 2 * rows);
    if (rows == 0 || S == 0) {  /* no pair: dq (the caller's zeros) stays 0, dk and dv are 0 */
        if (items > 0 && S > 0 && !sums && dk && dv) {
            memset(dk, 0, sizeof(float) * items * S * Wp);
            memset(dv, 0, sizeof(float) * items * S * Wp);
        }
        return 0;
    }
    bjob_t J = {(const char *)q, (const char *)k, (const char *)v, (const char *)o, (const char *)dout, dt,
                dt ? 2 : 4, lse, lse_lo, (const unsigned char *)mask, mask ? mkind : 0, mhd > 0 ? mhd : 1,
                msb, msh, msl, B, Hq, Hkv, W, Wp, causal, wide != 0, L, S, scale, dq, dk, dv, NULL,
                delta_in ? delta_lo : NULL, amx && dt == 1 && !wide, BR};
    if (J.amx)
        J.br = BRA;
    float *own = delta_in || sums ? NULL : (float *)malloc(sizeof(float) * rows);  /* delta = dO . O */
    if (!delta_in && !sums && !own)
        return 2;
    J.delta = delta_in ? (float *)delta_in : own;
    if (threads < 1)
        threads = 1;
    const long long row_blocks = (L + J.br - 1) / J.br;
    const int whole = items >= SPLIT || sums;
    /* fewer items: each key block's dK and dV in two halves (its rows' two fixed halves), 2 x BC x Wp a half */
    float *halves = NULL;  /* 64-byte aligned, as every scratch the products store to */
    if (!whole && posix_memalign((void **)&halves, 64, sizeof(float) * (size_t)items * 4 * BC * Wp))
        halves = NULL;
    int err = !whole && !halves;
    size_t sb;
    carve(&J, NULL, &sb);
    #pragma omp parallel num_threads(threads)
    {
        char *mem = (char *)malloc(sb);
        if (!mem) {
            #pragma omp atomic write
            err = 1;
        }
        #pragma omp barrier
#ifdef KF_AMX
        const tilecfg_t cfg = tiles16x64();
        if (J.amx)
            _tile_loadconfig(&cfg);
#endif
        if (!err) {
            const scratch_t T = carve(&J, mem, NULL);
            if (sums) {
                #pragma omp for schedule(dynamic, 1)
                for (long long u = 0; u < items * row_blocks; u++) {
                    const long long i0 = u % row_blocks * J.br;
                    row_sums(&J, &T, (int)(u / row_blocks / Hkv), (int)(u / row_blocks % Hkv), i0,
                             i0 + J.br < L ? i0 + J.br : L, sums, sums + rows);
                }
            } else {
                if (own) {
                    #pragma omp for schedule(static)
                    for (long long r = 0; r < rows; r++)
                        own[r] = (float)dot_row(J.dout + r * W * J.es, J.o + r * W * J.es, W, dt);
                }
                if (whole) {
                    #pragma omp for schedule(dynamic, 1)
                    for (long long it = 0; it < items; it++)
                        for (long long j = 0; j < blocks; j++) key_block(&J, &T, (int)(it / Hkv), (int)(it % Hkv), j * BC, dq);
                } else {
                    /* key blocks in order; each block's rows in two fixed halves, side by side (their dQ rows
                     * apart), the halves' dK and dV then summed in order: no dQ buffer beside dq (the key
                     * blocks cut in two halves instead held one, 1.16-1.26x SDPA's peak memory at one head) */
                    for (long long j = 0; j < blocks; j++) {
                        const long long c0 = j * BC, nc = S - c0 < BC ? S - c0 : BC, mid = middle_row(&J, c0);
                        #pragma omp for schedule(static, 1)
                        for (long long u = 0; u < items * 2; u++) {
                            scratch_t U = T;
                            U.dka = halves + (size_t)u * 2 * BC * Wp;
                            U.dva = U.dka + (size_t)BC * Wp;
                            key_block_rows(&J, &U, (int)(u / 2 / Hkv), (int)(u / 2 % Hkv), c0,
                                           u % 2 ? mid : first_row(&J, c0), u % 2 ? L : mid, dq);
                        }
                        #pragma omp for schedule(static)
                        for (long long it = 0; it < items; it++) {
                            const float *a = halves + (size_t)it * 4 * BC * Wp, *b = a + (size_t)2 * BC * Wp;
                            const size_t at = ((size_t)it * S + c0) * Wp, n = (size_t)nc * Wp;
                            for (size_t i = 0; i < n; i++) {
                                dk[at + i] = a[i] + b[i];
                                dv[at + i] = a[BC * Wp + i] + b[BC * Wp + i];
                            }
                        }
                    }
                }
            }
        }
#ifdef KF_AMX
        if (J.amx)
            _tile_release();
#endif
        free(mem);
    }
    free(halves);
    free(own);
    return err ? 2 : 0;
}
