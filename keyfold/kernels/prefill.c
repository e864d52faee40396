/* keyfold's bfloat16 prefill kernel for CPUs with AMX: the partial state (out, lse) of docs/math.md of a
 * whole plan at once. A plan is a list of pieces (planner.py): rows [q0, q1) see keys [k0, k1), every
 * pair, or under the causal flag (row q0 + t sees keys k0 .. k0 + t), or under an additive float mask
 * tile (-inf hides a pair), with an optional per-row shift (a separable bias's row term); a softcap may
 * apply to every score. Pieces never share a (row, key) pair.
 *
 * It is FlashAttention's forward on AMX tiles. A work item is 32 query rows of one (batch, head); it
 * runs one online softmax over the keys of every piece its rows are in, KB keys a step:
 *   S = Q K^T     AMX (tdpbf16ps), bfloat16 products summed in float32, K packed to the tile's pairs;
 *   softmax       AVX-512 in float32: scale, softcap, mask, running max m, sum l, P = 2^(y - m) in
 *                 base 2 (y = s log2 e);
 *   O += P V      AMX, P rounded to bfloat16 (as PyTorch's and oneDNN's CPU kernels do), V packed;
 * with O rescaled by 2^(m_old - m_new) in float32 between steps. So the pieces of one row are merged
 * inside the softmax, with no partial state in memory: a sliding window's sink keys and its band are
 * one softmax. A 32 x 32 sub-block that the mask hides, or that lies past a causal piece's diagonal,
 * runs no tile instruction. Rows that see no key get out = 0, lse = -inf; a NaN or infinite score makes
 * its row NaN (out and lse), as in PyTorch's op.
 *
 * Keys and values are packed once per call: K^T into the layout of the tile B operand (pairs of head
 * dimensions of 16 keys per 64-byte row), V into pairs of keys per row. The packing runs on the same
 * OpenMP threads (torch's libgomp pool, as in decode.c) before the work items.
 *
 * Without AMX-BF16 in the build (-march=native on a CPU without it), kf_prefill returns -3 and keyfold
 * keeps PyTorch's fused op. Linux lets a process use the tile registers once it has asked
 * (kf_prefill_init). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KF_AMX 1
#endif

#define QB 32          /* query rows per work item */
#define SB 32          /* keys per sub-block: one tile step, the unit packed and skipped */
#define NS 8           /* sub-blocks per block of the online softmax */
#define KB (SB * NS)   /* keys per block */
#define MAXD 256       /* largest head size (q, k and v) */
#define TILE 512       /* bfloat16 elements in one 16 x 64-byte tile */

int kf_prefill_init(void) {
#ifdef KF_AMX
    /* Linux: a process asks once for the AMX tile data state (ARCH_REQ_XCOMP_PERM, XTILEDATA = 18) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1;
#else
    return -3;
#endif
}

/* One piece, as cpu.py lays it out (12 int64). Mask element (b, h, i, j) of the piece's rows and keys:
 * mask[mb b + mh h + ml (i - q0) + (j - k0)], keys contiguous; shift element: shift[sb b + sh h + (i - q0)]. */
typedef struct {
    long long q0, q1, k0, k1, causal;
    long long mask, mb, mh, ml;     /* address of the float32 additive mask, or 0 */
    long long shift, sb, sh;        /* address of the float32 row shift, or 0 */
} piece_t;

#ifdef KF_AMX
typedef struct {
    const uint16_t *q, *k, *v;
    long long sqb, sqh, sqn, skb, skh, skn, svb, svh, svn;  /* strides in elements; rows contiguous */
    int B, Hq, Hkv, D, Dv, Dp, Dvp, nc, nj;                 /* Dp, Dvp: D, Dv rounded up to 32 */
    long long L, S, nqb, nkb;
    float scale, cap;                                       /* cap 0: no softcap */
    const piece_t *pieces;
    int np, out_bf16;
    void *out;                                              /* (B, Hq, L, Dv) bfloat16 or float32 */
    float *lse;                                             /* (B, Hq, L) */
    uint16_t *kp, *vp;                                      /* packed keys and values */
} job_t;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static size_t kpack_size(const job_t *J) { return (size_t)J->nc * 2 * TILE; }  /* per key block */
static size_t vpack_size(const job_t *J) { return (size_t)J->nj * TILE; }

/* Key block t = ((b * Hkv + h) * nkb + kb), packed. K: tile (c, n) holds head dims [32c, 32c + 32) of
 * keys [16n, 16n + 16) of the block, row r = the pair of dims (32c + 2r, 32c + 2r + 1) of each key: a
 * 16 x 16 transpose of 32-bit pairs, one gather per row. V: tile jc holds value dims [16 jc, 16 jc + 16),
 * row r = keys 2r and 2r + 1 interleaved. Past S, D or Dv: zeros. */
static void pack(const job_t *J, long long t) {
    const long long kb = t % J->nkb, bh = t / J->nkb;
    const int b = (int)(bh / J->Hkv), h = (int)(bh % J->Hkv);
    const long long j0 = kb * SB, nk = J->S - j0 < SB ? J->S - j0 : SB;
    const uint16_t *k = J->k + b * J->skb + h * J->skh + j0 * J->skn;
    const uint16_t *v = J->v + b * J->svb + h * J->svh + j0 * J->svn;
    uint16_t *kp = J->kp + (size_t)t * kpack_size(J), *vp = J->vp + (size_t)t * vpack_size(J);
    const int pairs = J->D / 2;  /* D is even */
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)(J->skn * 2)));
    for (int c = 0; c < J->nc; c++)
        for (int n = 0; n < 2; n++) {
            const long long keys = nk - 16 * n;
            const __mmask16 km = keys <= 0 ? 0 : first((int)keys);
            const char *base = (const char *)(k + 16 * n * J->skn);
            uint16_t *tile = kp + (size_t)(c * 2 + n) * TILE;
            for (int r = 0; r < 16; r++) {
                const int d = 16 * c + r;  /* index of the pair */
                __m512i x = _mm512_setzero_si512();
                if (d < pairs && km)
                    x = _mm512_mask_i32gather_epi32(x, km, idx, base + 4 * d, 1);
                _mm512_store_si512(tile + 32 * r, x);
            }
        }
    /* word 2x of a row is key 2r's dim x, word 2x + 1 key 2r + 1's (index 32 + x: the second vector) */
    static const uint16_t order[32] __attribute__((aligned(64))) = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45,
        14, 46, 15, 47};
    const __m512i mix = _mm512_load_si512(order);
    for (int jc = 0; jc < J->nj; jc++) {
        const int d0 = 16 * jc, nd = J->Dv - d0;
        const __mmask16 dm = nd <= 0 ? 0 : first(nd);
        uint16_t *tile = vp + (size_t)jc * TILE;
        for (int r = 0; r < 16; r++) {
            const __m256i a = 2 * r < nk ? _mm256_maskz_loadu_epi16(dm, v + 2 * r * J->svn + d0) : _mm256_setzero_si256();
            const __m256i b2 = 2 * r + 1 < nk ? _mm256_maskz_loadu_epi16(dm, v + (2 * r + 1) * J->svn + d0)
                                              : _mm256_setzero_si256();
            _mm512_store_si512(tile + 32 * r, _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), mix,
                                                                        _mm512_castsi256_si512(b2)));
        }
    }
}

/* cap * tanh(s / cap). For |y| = |s / cap| >= 1/4, tanh |y| = (1 - e^-2|y|) / (1 + e^-2|y|), where 1 - e^-2|y|
 * >= 0.39 loses no more than a few ulp; below 1/4 its odd Taylor polynomial to y^9 (the next term is
 * under 1e-8 relative there), so the error stays relative to the score for any cap (the quotient alone
 * would leave an absolute error of about cap * 2^-24: 0.06 for a cap of 1e6). */
static inline __m512 softcap16(__m512 s, float cap) {
    const __m512 y = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / cap));
    const __m512 a = _mm512_abs_ps(y);
    const __m512 t = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 th = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
    th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th),
                                             _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u))));
    const __m512 y2 = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(62.0f / 2835.0f);
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-17.0f / 315.0f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(2.0f / 15.0f));
    p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(-1.0f / 3.0f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, y2), y, y);
    th = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ), th, p);
    return _mm512_mul_ps(th, _mm512_set1_ps(cap));
}

/* 2^x for x <= 0 on the lanes of `keep` (0 elsewhere): x = n + f, |f| <= 1/2, 2^f by its Taylor
 * polynomial of degree 5 (relative error below 3e-6, under a bfloat16 P's rounding of 2^-9), 2^n by
 * vscalefps. Below -126 it gives 2^-126 (a pair that far below its row's largest adds nothing a float
 * can hold to the row's sum). The scores are kept in base 2 (scaled by log2 e) so that no multiply by
 * log2 e and no split of ln 2 are needed here. */
static inline __m512 exp2_16(__mmask16 keep, __m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* lanes [lo, hi) of 16 (clipped) */
static inline __mmask16 lanes(long long lo, long long hi) {
    if (lo < 0) lo = 0;
    if (hi > 16) hi = 16;
    return hi <= lo ? 0 : (__mmask16)(first((int)hi) & ~first((int)lo));
}

/* whether the mask rows [r0, r1) (of the piece) show any of the 32 keys from j (of the piece) on the
 * lanes [lo, hi) of those 32: -inf hides, any other value (NaN included, so that it reaches the
 * output) shows */
static int block_seen(const float *m, long long ml, long long r0, long long r1, long long j, long long lo,
                      long long hi) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __mmask16 a = lanes(lo, hi), b = lanes(lo - 16, hi - 16);
    if (ml == 0) r1 = r0 + 1;
    for (long long r = r0; r < r1; r++) {
        const float *x = m + r * ml + j;
        if (_mm512_mask_cmp_ps_mask(a, _mm512_maskz_loadu_ps(a, x), ninf, _CMP_NEQ_UQ)
            | _mm512_mask_cmp_ps_mask(b, _mm512_maskz_loadu_ps(b, x + 16), ninf, _CMP_NEQ_UQ))
            return 1;
    }
    return 0;
}

/* One work item: 32 rows of (b, h) over the keys of every piece they are in, KB keys (NS sub-blocks
 * of SB) a step of one online softmax. */
static void item(const job_t *J, long long w) {
    const long long qb = w % J->nqb, bh = w / J->nqb;
    const int b = (int)(bh / J->Hq), h = (int)(bh % J->Hq), hk = h / (J->Hq / J->Hkv);
    const long long i0 = qb * QB;
    const int nr = (int)(J->L - i0 < QB ? J->L - i0 : QB);
    const int Dp = J->Dp, Dvp = J->Dvp, nc = J->nc, nj = J->nj;
    uint16_t qbuf[QB * MAXD] __attribute__((aligned(64)));
    float sbuf[QB * KB] __attribute__((aligned(64)));
    uint16_t pbuf[QB * KB] __attribute__((aligned(64)));
    float obuf[QB * MAXD] __attribute__((aligned(64)));
    float acc[QB * MAXD] __attribute__((aligned(64)));
    float m[QB], l[QB], alpha[QB];
    const uint16_t *q = J->q + b * J->sqb + h * J->sqh + i0 * J->sqn;
    for (int r = 0; r < QB; r++) {
        memset(qbuf + r * Dp, 0, sizeof(uint16_t) * Dp);
        if (r < nr) memcpy(qbuf + r * Dp, q + r * J->sqn, sizeof(uint16_t) * J->D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(pbuf, 0, sizeof(pbuf));
    memset(acc, 0, sizeof(float) * QB * Dvp);
    const size_t kstride = kpack_size(J), vstride = vpack_size(J);
    const uint16_t *kp = J->kp + (size_t)(b * J->Hkv + hk) * J->nkb * kstride;
    const uint16_t *vp = J->vp + (size_t)(b * J->Hkv + hk) * J->nkb * vstride;
    const __m512 ninf = _mm512_set1_ps(-INFINITY), log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 scale = _mm512_set1_ps(J->scale), scale2 = _mm512_set1_ps(J->scale * 1.44269504088896341f);
    for (int pi = 0; pi < J->np; pi++) {
        const piece_t *P = J->pieces + pi;
        const long long ra = P->q0 > i0 ? P->q0 : i0, rb = P->q1 < i0 + nr ? P->q1 : i0 + nr;
        if (ra >= rb) continue;
        const long long ka = P->k0;
        long long kz = P->k1;  /* past the last key any row of this item sees in the piece */
        if (P->causal && P->k0 + (rb - P->q0) < kz) kz = P->k0 + (rb - P->q0);
        if (ka >= kz) continue;
        const float *pm = P->mask ? (const float *)(intptr_t)P->mask + b * P->mb + h * P->mh : NULL;
        const float *ps = P->shift ? (const float *)(intptr_t)P->shift + b * P->sb + h * P->sh : NULL;
        const long long uend = (kz + SB - 1) / SB;
        for (long long u0 = ka / SB; u0 < uend; u0 += NS) {
            const int ns = (int)(uend - u0 < NS ? uend - u0 : NS);
            const long long j0 = u0 * SB;
            int seen[NS], nseen = 0;
            /* S = Q K^T for each sub-block a row may see: tiles 0-3 the 2 x 2 blocks of 16 rows x 16 keys,
             * 4-5 Q, 6-7 K */
            for (int u = 0; u < NS; u++) {
                const long long js = j0 + u * SB;
                seen[u] = u < ns && (!pm || block_seen(pm, P->ml, ra - P->q0, rb - P->q0, js - P->k0, ka - js, kz - js));
                if (!seen[u]) continue;
                nseen++;
                const uint16_t *kt = kp + (size_t)(u0 + u) * kstride;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int c = 0; c < nc; c++) {
                    _tile_loadd(4, qbuf + 32 * c, Dp * 2);
                    _tile_loadd(5, qbuf + 16 * Dp + 32 * c, Dp * 2);
                    _tile_loadd(6, kt + (size_t)(2 * c) * TILE, 64);
                    _tile_loadd(7, kt + (size_t)(2 * c + 1) * TILE, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, sbuf + SB * u, KB * 4);
                _tile_stored(1, sbuf + SB * u + 16, KB * 4);
                _tile_stored(2, sbuf + 16 * KB + SB * u, KB * 4);
                _tile_stored(3, sbuf + 16 * KB + SB * u + 16, KB * 4);
            }
            if (!nseen) continue;
            /* the online softmax, row by row, over the step's seen sub-blocks (16 keys a vector), in base
             * 2: y = s log2 e, m the running max of y, l = sum 2^(y - m); a NaN score (or +inf) makes the
             * row NaN */
            int any = 0;
            for (int r = 0; r < nr; r++) {
                const long long i = i0 + r;
                if (i < ra || i >= rb) {  /* not a row of this piece: no P, nothing to rescale */
                    alpha[r] = 1.0f;
                    for (int u = 0; u < ns; u++)
                        if (seen[u]) _mm512_store_si512(pbuf + r * KB + SB * u, _mm512_setzero_si512());
                    continue;
                }
                long long kr = kz;  /* past the row's last key */
                if (P->causal && P->k0 + (i - P->q0) + 1 < kr) kr = P->k0 + (i - P->q0) + 1;
                const float *mr = pm ? pm + (i - P->q0) * P->ml - P->k0 : NULL;  /* at key j: mr[j] */
                const __m512 shift = ps ? _mm512_set1_ps(ps[i - P->q0] * 1.44269504088896341f) : _mm512_setzero_ps();
                __m512 y[2 * NS];
                __mmask16 vis[2 * NS], bad = 0;
                __m512 mx = ninf;
                for (int x = 0; x < 2 * ns; x++) {
                    vis[x] = 0;
                    if (!seen[x / 2]) continue;
                    const long long jx = j0 + 16 * x;
                    vis[x] = lanes(ka - jx, kr - jx);
                    __m512 t = _mm512_load_ps(sbuf + r * KB + 16 * x);
                    t = J->cap > 0.0f ? _mm512_mul_ps(softcap16(_mm512_mul_ps(t, scale), J->cap), log2e)
                                      : _mm512_mul_ps(t, scale2);
                    if (mr) t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(vis[x], mr + jx), log2e, t);
                    if (ps) t = _mm512_add_ps(t, shift);
                    bad |= _mm512_mask_cmp_ps_mask(vis[x], t, t, _CMP_UNORD_Q);
                    y[x] = _mm512_mask_blend_ps(vis[x], ninf, t);
                    mx = _mm512_max_ps(mx, y[x]);
                }
                const float bm = _mm512_reduce_max_ps(mx);
                if (bad || bm == INFINITY || isnan(m[r])) {  /* the row is NaN from here on (out and lse) */
                    m[r] = l[r] = alpha[r] = NAN;
                    any = 1;
                    for (int u = 0; u < ns; u++)
                        if (seen[u]) _mm512_store_si512(pbuf + r * KB + SB * u, _mm512_setzero_si512());
                    continue;
                }
                const float mn = bm > m[r] ? bm : m[r];
                if (mn == -INFINITY) {  /* nothing seen yet: no P, nothing to rescale */
                    alpha[r] = 1.0f;
                    for (int u = 0; u < ns; u++)
                        if (seen[u]) _mm512_store_si512(pbuf + r * KB + SB * u, _mm512_setzero_si512());
                    continue;
                }
                any = 1;
                const float a = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mn);
                const __m512 mv = _mm512_set1_ps(mn);
                __m512 sum = _mm512_setzero_ps();
                for (int u = 0; u < ns; u++) {
                    if (!seen[u]) continue;
                    const __m512 p0 = exp2_16(vis[2 * u], _mm512_sub_ps(y[2 * u], mv));
                    const __m512 p1 = exp2_16(vis[2 * u + 1], _mm512_sub_ps(y[2 * u + 1], mv));
                    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                    _mm512_store_si512(pbuf + r * KB + SB * u, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                }
                l[r] = l[r] * a + _mm512_reduce_add_ps(sum);
                m[r] = mn;
                alpha[r] = a;
            }
            if (!any) continue;
            /* O = O alpha + P V: tiles 4-5 P, 6-7 V, 0-3 two 16-column slices of the 32 rows, summed over
             * the seen sub-blocks inside the tiles */
            for (int jc = 0; jc < nj; jc += 2) {
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int u = 0; u < ns; u++) {
                    if (!seen[u]) continue;
                    const uint16_t *vt = vp + (size_t)(u0 + u) * vstride;
                    _tile_loadd(4, pbuf + SB * u, KB * 2);
                    _tile_loadd(5, pbuf + 16 * KB + SB * u, KB * 2);
                    _tile_loadd(6, vt + (size_t)jc * TILE, 64);
                    _tile_loadd(7, vt + (size_t)(jc + 1) * TILE, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, obuf + 16 * jc, Dvp * 4);
                _tile_stored(1, obuf + 16 * jc + 16, Dvp * 4);
                _tile_stored(2, obuf + 16 * Dvp + 16 * jc, Dvp * 4);
                _tile_stored(3, obuf + 16 * Dvp + 16 * jc + 16, Dvp * 4);
            }
            for (int r = 0; r < nr; r++) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                float *o = acc + r * Dvp;
                const float *x = obuf + r * Dvp;
                for (int d = 0; d < Dvp; d += 16)
                    _mm512_store_ps(o + d, _mm512_fmadd_ps(_mm512_load_ps(o + d), a, _mm512_load_ps(x + d)));
            }
        }
    }
    /* out = O / l, lse = m + log l; a row that saw no key: 0 and -inf */
    const int Dv = J->Dv;
    for (int r = 0; r < nr; r++) {
        const size_t row = (size_t)(bh * J->L + i0 + r);
        const int empty = m[r] == -INFINITY && l[r] == 0.0f;
        const __m512 inv = _mm512_set1_ps(empty ? 0.0f : 1.0f / l[r]);
        J->lse[row] = empty ? -INFINITY : (m[r] + log2f(l[r])) * 0.69314718055994531f;
        for (int d = 0; d < Dv; d += 16) {
            const __mmask16 k = first(Dv - d);
            const __m512 y = _mm512_mul_ps(_mm512_load_ps(acc + r * Dvp + d), inv);
            if (J->out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)J->out + row * Dv + d, k, (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_mask_storeu_ps((float *)J->out + row * Dv + d, k, y);
        }
    }
}
#endif

/* The entry point (keyfold/kernels/native.py). q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)
 * bfloat16 with contiguous rows, D even; `pieces` the plan's np pieces. out (B, Hq, L, Dv) bfloat16
 * (out_bf16) or float32, lse (B, Hq, L), both contiguous. Returns 0; -1 for arguments out of range;
 * -2 when scratch memory cannot be had; -3 without AMX. */
int kf_prefill(const uint16_t *q, const uint16_t *k, const uint16_t *v,
               long long sqb, long long sqh, long long sqn, long long skb, long long skh, long long skn,
               long long svb, long long svh, long long svn, int B, int Hq, int Hkv, long long L, long long S,
               int D, int Dv, float scale, float cap, const piece_t *pieces, int np, int out_bf16, void *out,
               float *lse, int threads) {
#ifndef KF_AMX
    (void)q; (void)k; (void)v; (void)sqb; (void)sqh; (void)sqn; (void)skb; (void)skh; (void)skn; (void)svb;
    (void)svh; (void)svn; (void)B; (void)Hq; (void)Hkv; (void)L; (void)S; (void)D; (void)Dv; (void)scale;
    (void)cap; (void)pieces; (void)np; (void)out_bf16; (void)out; (void)lse; (void)threads;
    return -3;
#else
    if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || L < 1 || S < 1 || D < 2 || D % 2 || D > MAXD || Dv < 1
        || Dv > MAXD || skn < 1 || skn > (1LL << 26) || !(cap >= 0.0f) || np < 0)
        return -1;
    for (int i = 0; i < np; i++)
        if (pieces[i].q0 < 0 || pieces[i].q1 > L || pieces[i].k0 < 0 || pieces[i].k1 > S) return -1;
    job_t J = {q, k, v, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, B, Hq, Hkv, D, Dv,
               (D + 31) / 32 * 32, (Dv + 31) / 32 * 32, (D + 31) / 32, (Dv + 31) / 32 * 2,
               L, S, (L + QB - 1) / QB, (S + SB - 1) / SB, scale, cap, pieces, np, out_bf16, out, lse, NULL, NULL};
    const long long blocks = (long long)B * Hkv * J.nkb;
    J.kp = aligned_alloc(64, sizeof(uint16_t) * (size_t)blocks * kpack_size(&J));
    J.vp = aligned_alloc(64, sizeof(uint16_t) * (size_t)blocks * vpack_size(&J));
    if (!J.kp || !J.vp) { free(J.kp); free(J.vp); return -2; }
    const long long items = (long long)B * Hq * J.nqb;
    if (threads < 1) threads = 1;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long long t = 0; t < blocks; t++) pack(&J, t);
        _tile_loadconfig(&cfg);
        #pragma omp for schedule(dynamic, 1)
        for (long long w = 0; w < items; w++) item(&J, w);
        _tile_release();
    }
    free(J.kp);
    free(J.vp);
    return 0;
#endif
}
