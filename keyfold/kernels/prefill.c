/* keyfold's prefill kernel: the partial state (out, lse) of docs/math.md of a whole plan at once, in
 * bfloat16 on CPUs with AMX or in float32 on any CPU with AVX-512 or AVX2 (simd.h's 16-lane layer, two 8-lane
 * halves there; register tiles of 4 x 16 scores and 4 x 16 columns of O instead). A plan is a list of pieces
 * (planner.py): rows [q0, q1) see keys [k0, k1), every pair, or under the causal flag (row q0 + t sees
 * keys k0 .. k0 + t), or under an additive float mask tile (-inf hides a pair), with an optional
 * per-row shift (a separable bias's row term); a softcap may apply to every score. Pieces never share
 * a (row, key) pair.
 *
 * It is FlashAttention's forward. A work item is G blocks of 32 query rows of one (batch, head); each
 * block runs one online softmax over the keys of every piece its rows are in, KB keys a step, the G
 * blocks one after another on each step (so the step's keys are read once for G x 32 rows):
 *   S = Q K^T     bfloat16: AMX (tdpbf16ps), products summed in float32, K packed to the tile's pairs;
 *                 float32: FMAs on 8 x 32 register tiles (AVX2: 4 x 16), K packed transposed, q pre-scaled
 *                 where the scale is a power of two (exact), else y = S scale rounded once;
 *   softmax       16 lanes in float32: scale, softcap, mask, running max m, sum l, P = e^(y - m) as
 *                 2^((y - m) log2 e) (scores stay in base e: a mask of -3e38, HF's finfo.min,
 *                 would overflow to -inf in base 2); bfloat16's 2^x is a degree-3 polynomial, as P
 *                 is rounded to bfloat16 next (as FlashAttention-4 computes part of its 2^x). In
 *                 both dtypes, where no mask tile, shift or softcap applies and a block's rows all
 *                 see the step from its first key, P is taken against the running max as it stands
 *                 until a P would pass 2^8 (FlashAttention-4's rescaling threshold: one pass over
 *                 S, O rescaled only when the max moves), a row's first step against the max of
 *                 its first 32 keys;
 *   O += P V      bfloat16: AMX, P rounded to bfloat16 (as PyTorch's and oneDNN's CPU kernels do), V
 *                 packed; float32: FMAs on 4 x 64 register tiles of O (AVX2: 4 x 16), P in float32;
 * with O rescaled by e^(m_old - m_new) in float32 between steps. So the pieces of one row are merged
 * inside the softmax, with no partial state in memory: a sliding window's sink keys and its band are
 * one softmax. A 32 x 32 sub-block that the mask hides, or that lies past a causal piece's diagonal,
 * is not computed. Rows that see no key get out = 0, lse = -inf; a NaN or infinite score makes its
 * row NaN (out and lse), as in PyTorch's op.
 *
 * Keys and values are packed once per call (bfloat16: K^T into the layout of the tile B operand, pairs
 * of head dimensions of 16 keys per 64-byte row, V into pairs of keys per row; float32: K^T as 32-key
 * rows per head dimension, V padded to 16 columns). The packing runs on the same OpenMP threads as
 * the work items (torch's libgomp pool, as in decode.c): each thread packs a (batch, kv head) of its
 * run just before the head's first item, or, with fewer kv heads than threads, all of them are packed
 * before the work items (see kf_prefill).
 *
 * bfloat16 needs AMX-BF16 in the build (-march=native on a CPU with it; else kf_prefill returns -3 for
 * it and keyfold keeps PyTorch's fused op). Linux lets a process use the tile registers once it has
 * asked (kf_prefill_init). */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define KF_F32 1  /* float32 on AVX-512, or on AVX2 through simd.h's 16-lane layer */
#endif

#define QB 32          /* query rows per block (two 16-row tiles) */
#define SB 32          /* keys per sub-block: one tile step, the unit packed and skipped */
#define NS 8           /* sub-blocks per block of the online softmax */
#define KB (SB * NS)   /* keys per step of the online softmax */
#define GMAX 16        /* most blocks of QB rows per work item (job_t.G) */
#define MAXD 256       /* largest head size (q, k and v) */
#if VF_TILE == 4
#define QR 8           /* float32: query rows of one Q K^T register tile (8 x 32 scores) */
#define QK 2           /* float32: 16-key vectors of that tile */
#else
#define QR 4           /* AVX2, 16 registers: 4 x 16 scores a tile, the sub-block's two halves in turn */
#define QK 1
#endif
#define PR 4           /* float32: query rows of one P V register tile (4 x 16 VF_TILE columns) */
#define LOG2E 1.44269504088896341f

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

#ifdef KF_F32
typedef struct {
    const void *q, *k, *v;                                  /* bfloat16 (f32 = 0) or float32 (f32 = 1) */
    long long sqb, sqh, sqn, skb, skh, skn, svb, svh, svn;  /* strides in elements; rows contiguous */
    int B, Hq, Hkv, D, Dv, Dp, Dvp, nc, nj;                 /* Dp, Dvp: q's and O's row lengths */
    long long L, S, nqb, nkb;
    float scale, cap;                                       /* cap 0: no softcap */
    const piece_t *pieces;
    int np, out_bf16, f32;
    int qs;  /* float32 with a power-of-two scale: q is multiplied by it as it is copied (exact), and S
              * is y. Otherwise S is taken unscaled and y = S scale rounded once, as the naive
              * implementation does: a q rounded after its product with a scale such as 80^-0.5 added
              * an error of its own to every score (2.1x the naive error in 1 of 800 random float32
              * cases; a naive attention over that q showed the same) */
    void *out;                                              /* (B, Hq, L, Dv) bfloat16 or float32 */
    float *lse;                                             /* (B, Hq, L) */
    int G;  /* blocks of QB rows per work item: bfloat16 16 where that leaves 4 items a thread (keys
             * and values read once for 512 rows: 0.95-0.96x the time of 8 at 16k dense and causal,
             * 0.99-1.01x at 1k-4k), else 8 (0.86-1.01x the time of 4 at 4k-16k; float32 16 took
             * 0.98-1.04x the time of 8, no gain) */
    float *lse_lo;  /* (B, Hq, L) or NULL: m + log l summed in double, less lse (a caller merging the state
                     * with others' weighs it by lse, which float32 rounds at 2^-24 |lse|) */
} job_t;

/* bytes of one packed block of SB keys */
static size_t kpack_size(const job_t *J) {
    return J->f32 ? (size_t)J->D * SB * sizeof(float) : (size_t)J->nc * 2 * TILE * sizeof(uint16_t);
}
static size_t vpack_size(const job_t *J) {
    return J->f32 ? (size_t)SB * J->Dvp * sizeof(float) : (size_t)J->nj * TILE * sizeof(uint16_t);
}

/* Key block t = ((b * Hkv + h) * nkb + kb): its first key and value (elements of esize bytes), and
 * how many of its SB keys exist (the last block's run past S). */
typedef struct {
    const char *k, *v;
    long long nk;
} block_t;

static block_t block_at(const job_t *J, long long t, size_t esize) {
    const long long kb = t % J->nkb, bh = t / J->nkb;
    const int b = (int)(bh / J->Hkv), h = (int)(bh % J->Hkv);
    const long long j0 = kb * SB;
    const block_t X = {(const char *)J->k + (b * J->skb + h * J->skh + j0 * J->skn) * (long long)esize,
                       (const char *)J->v + (b * J->svb + h * J->svh + j0 * J->svn) * (long long)esize,
                       J->S - j0 < SB ? J->S - j0 : SB};
    return X;
}

#ifdef KF_AMX
/* The rows of key block t + 1 (when the head has one) on their way to L1 while block t is packed. A
 * contiguous bfloat16 head's block at head size 64 is one 4 KiB page of keys and one of values, where
 * the hardware's prefetcher starts afresh: packing 4k keys read from memory, 119-130 us a head with
 * this against 137-151 without (hot in L2: 52-58 us either way); a 4k bfloat16 call 0.98x the time
 * causal, 0.99x dense (benchmarks/kernel_ab.py, 40-60 rounds). float32, whose blocks are two pages,
 * gained nothing (1.00x causal) and packs without it. */
static void prefetch_block(const job_t *J, long long t, size_t esize) {
    if ((t + 1) % J->nkb == 0) return;
    const block_t Y = block_at(J, t + 1, esize);
    const int per = 64 / (int)esize;  /* elements a cache line */
    for (long long j = 0; j < Y.nk; j++) {
        for (int d = 0; d < J->D; d += per) _mm_prefetch(Y.k + (j * J->skn + d) * (long long)esize, _MM_HINT_T0);
        for (int d = 0; d < J->Dv; d += per) _mm_prefetch(Y.v + (j * J->svn + d) * (long long)esize, _MM_HINT_T0);
    }
}
#endif

/* Key block t = ((b * Hkv + h) * nkb + kb) in float32, into kp and vp: K^T, row d = dim d of the
 * block's 32 keys (the vector operand of Q K^T), and V, row j = key j's values, Dvp long. Past S or
 * Dv: zeros. */
static void pack_f32(const job_t *J, long long t, char *kpb, char *vpb) {
    const block_t X = block_at(J, t, sizeof(float));
    const long long nk = X.nk;
    const float *k = (const float *)X.k, *v = (const float *)X.v;
    float *kp = (float *)kpb, *vp = (float *)vpb;
    for (int j = 0; j < SB; j++)
        for (int d = 0; d < J->D; d++) kp[d * SB + j] = j < nk ? k[j * J->skn + d] : 0.0f;
    for (int j = 0; j < SB; j++)
        for (int d = 0; d < J->Dvp; d += 16) {
            const __mmask16 m = j < nk && d < J->Dv ? first(J->Dv - d) : 0;
            vf_store(vp + j * J->Dvp + d, vf_maskz_loadu(m, v + j * J->svn + d));
        }
}

/* Key block t = ((b * Hkv + h) * nkb + kb), packed into kp and vp. K: tile (c, n) holds head dims [32c, 32c + 32) of
 * keys [16n, 16n + 16) of the block, row r = the pair of dims (32c + 2r, 32c + 2r + 1) of each key: a
 * 16 x 16 transpose of 32-bit pairs (transpose16; a gather per row took 1.27x the packing time at 4k).
 * V: tile jc holds value dims [16 jc, 16 jc + 16), row r = keys 2r and 2r + 1 interleaved. Past S, D or
 * Dv: zeros. */
#ifdef KF_AMX
static void pack_bf16(const job_t *J, long long t, char *kpb, char *vpb) {
    const block_t X = block_at(J, t, sizeof(uint16_t));
    const long long nk = X.nk;
    const uint16_t *k = (const uint16_t *)X.k, *v = (const uint16_t *)X.v;
    uint16_t *kp = (uint16_t *)kpb, *vp = (uint16_t *)vpb;
    const int pairs = J->D / 2;  /* D is even */
    for (int c = 0; c < J->nc; c++) {
        const __mmask16 dm = first(pairs - 16 * c);  /* pairs 16c .. 16c + 15 that exist */
        for (int n = 0; n < 2; n++) {
            __m512i x[16];
            for (int j = 0; j < 16; j++)
                x[j] = 16 * n + j < nk ? _mm512_maskz_loadu_epi32(dm, k + (16 * n + j) * J->skn + 32 * c)
                                       : _mm512_setzero_si512();
            transpose16(x);
            uint16_t *tile = kp + (size_t)(c * 2 + n) * TILE;
            for (int r = 0; r < 16; r++) _mm512_store_si512(tile + 32 * r, x[r]);
        }
    }
    /* word 2x of a row is key 2r's dim x, word 2x + 1 key 2r + 1's */
    for (int jc = 0; jc < J->nj; jc++) {
        const int d0 = 16 * jc, nd = J->Dv - d0;
        const __mmask16 dm = nd <= 0 ? 0 : first(nd);
        uint16_t *tile = vp + (size_t)jc * TILE;
        for (int r = 0; r < 16; r++) {
            const __m256i a = 2 * r < nk ? _mm256_maskz_loadu_epi16(dm, v + 2 * r * J->svn + d0) : _mm256_setzero_si256();
            const __m256i b2 = 2 * r + 1 < nk ? _mm256_maskz_loadu_epi16(dm, v + (2 * r + 1) * J->svn + d0)
                                              : _mm256_setzero_si256();
            _mm512_store_si512(tile + 32 * r, pair_rows(a, b2));
        }
    }
}

#endif

/* Key block t packed into kp, vp (the next block's rows prefetched first) */
static void pack_block(const job_t *J, long long t, char *kp, char *vp) {
#ifdef KF_AMX
    if (!J->f32) {
        prefetch_block(J, t, sizeof(uint16_t));
        pack_bf16(J, t, kp, vp);
        return;
    }
#endif
    pack_f32(J, t, kp, vp);
}

/* cap * tanh(s / cap). For |y| = |s / cap| >= 1/4, tanh |y| = (1 - e^-2|y|) / (1 + e^-2|y|), where 1 - e^-2|y|
 * >= 0.39 loses no more than a few ulp; below 1/4 its odd Taylor polynomial to y^9 (the next term is
 * about 1.5e-8 relative at 1/4), so the error stays relative to the score for any cap (the quotient alone
 * would leave an absolute error of about cap * 2^-24: 0.06 for a cap of 1e6). */
static inline vf softcap16(vf s, float cap) {
    const vf y = vf_mul(s, vf_set1(1.0f / cap));
    const vf a = vf_abs(y);
    const vf t = vf_exp(vf_mul(a, vf_set1(-2.0f)));
    const vf one = vf_set1(1.0f);
    vf th = vf_div(vf_sub(one, t), vf_add(one, t));
    th = vf_or_sign(th, y);
    const vf y2 = vf_mul(y, y);
    vf p = vf_set1(62.0f / 2835.0f);
    p = vf_fmadd(p, y2, vf_set1(-17.0f / 315.0f));
    p = vf_fmadd(p, y2, vf_set1(2.0f / 15.0f));
    p = vf_fmadd(p, y2, vf_set1(-1.0f / 3.0f));
    p = vf_fmadd(vf_mul(p, y2), y, y);
    th = vf_blend(vf_lt(a, vf_set1(0.25f)), th, p);
    return vf_mul(th, vf_set1(cap));
}

/* 2^x for x <= 0 on the lanes of `keep` (0 elsewhere): x = n + f with n = floor(x), f in [0, 1] by
 * vreduceps, 2^f by a degree-5 polynomial fitted to it with p(0) = 1 exactly (relative error below 1e-7;
 * a row's largest score gets P = 1, so a row with one key gives that key's value exactly), and 2^n by vscalefps
 * of x itself (it scales by 2^floor). x = -inf gives 0 (vreduceps gives f = 0, vscalefps scales by
 * 2^-inf), as does any x below -150; NaN gives NaN. */
static inline vf exp2_16(__mmask16 keep, vf x) {
    const vf f = vf_frac(x);  /* x - floor(x): round down, no precision exception */
    vf p = vf_set1(1.8671966390684247e-3f);
    p = vf_fmadd(p, f, vf_set1(9.016658179461956e-3f));
    p = vf_fmadd(p, f, vf_set1(5.580046772956848e-2f));
    p = vf_fmadd(p, f, vf_set1(2.401641458272934e-1f));
    p = vf_fmadd(p, f, vf_set1(6.931513547897339e-1f));
    p = vf_fmadd(p, f, vf_set1(1.0f));
    return vf_scale2(keep, p, x);
}

#ifdef KF_AMX
/* exp2_16 for a P that is rounded to bfloat16 next (a relative step of 2^-8): a degree-3 polynomial,
 * relative error below 9e-5 (so lse is within 9e-5 too), p(0) = 1 exactly (a row's largest score still
 * gets P = 1). Two FMAs fewer than exp2_16: 0.92-0.94x the time of bfloat16 dense, causal and window
 * prefill at 4k (degree 4: 0.95-0.98x). */
static inline vf exp2_16_bf(__mmask16 keep, vf x) {
    const vf f = vf_frac(x);
    vf p = vf_set1(7.706519961357117e-2f);
    p = vf_fmadd(p, f, vf_set1(2.2764700651168823e-1f));
    p = vf_fmadd(p, f, vf_set1(6.951163411140442e-1f));
    p = vf_fmadd(p, f, vf_set1(1.0f));
    return vf_scale2(keep, p, x);
}
#endif

/* P's 2^x: exp2_16 for float32, exp2_16_bf for a P rounded to bfloat16 */
static inline vf exp2_p(__mmask16 keep, vf x, const int f32) {
#ifdef KF_AMX
    return f32 ? exp2_16(keep, x) : exp2_16_bf(keep, x);
#else
    (void)f32;  /* no bfloat16 path without AMX */
    return exp2_16(keep, x);
#endif
}

/* whether the mask rows [r0, r1) (of the piece) show any of the 32 keys from j (of the piece) on the
 * lanes [lo, hi) of those 32: -inf hides, any other value (NaN included, so that it reaches the
 * output) shows */
static int block_seen(const float *m, long long ml, long long r0, long long r1, long long j, long long lo,
                      long long hi) {
    const vf ninf = vf_set1(-INFINITY);
    const __mmask16 a = lanes(lo, hi), b = lanes(lo - 16, hi - 16);
    if (ml == 0) r1 = r0 + 1;
    for (long long r = r0; r < r1; r++) {
        const float *x = m + r * ml + j;
        if ((a & vf_ne(vf_maskz_loadu(a, x), ninf)) | (b & vf_ne(vf_maskz_loadu(b, x + 16), ninf)))
            return 1;
    }
    return 0;
}

/* The state of 32 query rows [i0, i0 + nr) in a work item: their q (zero past D and past nr), running
 * max m, sum l (16 partial sums a row, added up at the end: no horizontal sum per step), and O
 * (float32, Dvp columns; bfloat16: not yet written while `fresh`, the first P V zeroing its tiles in
 * place of a memset and a load of O, so a block no P V reached has only rows that saw no key). */
typedef struct {
    long long i0;
    int nr, fresh;
    void *qbuf;
    float *acc, *l;
    float m[QB];
} rows_t;

/* One unit of work: the step of KB keys from u0 SB of piece P for the rows of block B (those of them in
 * the piece: [ra, rb)), with its buffers: S, P in bfloat16 or P in float32 (p32: in place of S, or,
 * for the one-pass softmax, which may read S again, a buffer of its own), and the rescale alpha of O
 * that the unit's softmax leaves for its P V. */
typedef struct {
    const piece_t *P;
    rows_t *B;
    const float *pm, *ps;  /* the piece's mask and row shift at (b, h), or NULL */
    long long u0, j0, ra, rb, kz;
    int ns, any, seen[NS];
    float *sbuf, *p32, *p32own;
    uint16_t *pbuf;
    float alpha[QB] __attribute__((aligned(64)));
} unit_t;

#define PAIR 2  /* bfloat16: units whose Q K^T is issued together (see tasks_t) */
/* bfloat16: rows of softmax between two tasks of tile work. Every 4 rows (8 tasks a unit: a sub-block
 * of Q K^T) took 0.90-0.94x the time of every 3 on dense and causal at 4k and 16k; every 2,
 * 1.01-1.02x; every 6 or 8, 0.93x; every 16, 0.95-0.98x (measured while the previous unit's P V was
 * queued here too; since it runs after the softmax, every 3 or 6 rows: 0.96-1.03x, noise). */
#define PUMP_ROWS 4

/* A thread's scratch: S buffers for two pairs of units (float32: S and its own P, p32own), and one P
 * buffer (a unit's P V runs before the next unit's softmax). */
typedef struct {
    float sbuf[2 * PAIR][QB * KB] __attribute__((aligned(64)));
    uint16_t pbuf[QB * KB] __attribute__((aligned(64)));
} scratch_t;

/* Fill U for piece P, the step from u0, block B; 0 when it has nothing to do (no row of B in the piece,
 * no key of the step that these rows may see, or every sub-block hidden by the mask). */
static int unit_init(unit_t *U, const piece_t *P, rows_t *B, long long u0, const float *pm, const float *ps) {
    const long long ra = P->q0 > B->i0 ? P->q0 : B->i0, rb = P->q1 < B->i0 + B->nr ? P->q1 : B->i0 + B->nr;
    if (ra >= rb) return 0;
    long long kz = P->k1;  /* past the last key any of these rows sees in the piece */
    if (P->causal && P->k0 + (rb - P->q0) < kz) kz = P->k0 + (rb - P->q0);
    const long long uend = (kz + SB - 1) / SB, j0 = u0 * SB;
    if (u0 >= uend || j0 + KB <= P->k0) return 0;
    U->P = P; U->B = B; U->pm = pm; U->ps = ps;
    U->u0 = u0; U->j0 = j0; U->ra = ra; U->rb = rb; U->kz = kz;
    U->ns = (int)(uend - u0 < NS ? uend - u0 : NS);
    U->any = 0;
    int nseen = 0;
    for (int u = 0; u < NS; u++) {
        const long long js = j0 + u * SB;
        U->seen[u] = u < U->ns && (!pm || block_seen(pm, P->ml, ra - P->q0, rb - P->q0, js - P->k0, P->k0 - js, kz - js));
        nseen += U->seen[u];
    }
    return nseen > 0;
}

/* The units of a work item in order: for each piece its steps, for each step the blocks. */
typedef struct {
    int pi, g, started;
    long long u0, kz;
    const float *pm, *ps;
} iter_t;

static int next_unit(const job_t *J, iter_t *it, unit_t *U, rows_t *blocks, int nb, int b, int h) {
    const long long i0 = blocks[0].i0, i1 = blocks[nb - 1].i0 + blocks[nb - 1].nr;
    for (;;) {
        if (it->pi >= J->np) return 0;
        const piece_t *P = J->pieces + it->pi;
        if (!it->started) {
            const long long ra = P->q0 > i0 ? P->q0 : i0, rb = P->q1 < i1 ? P->q1 : i1;
            long long kz = P->k1;
            if (P->causal && P->k0 + (rb - P->q0) < kz) kz = P->k0 + (rb - P->q0);
            if (ra >= rb || P->k0 >= kz) { it->pi++; continue; }
            it->kz = kz;
            it->pm = P->mask ? (const float *)(intptr_t)P->mask + b * P->mb + h * P->mh : NULL;
            it->ps = P->shift ? (const float *)(intptr_t)P->shift + b * P->sb + h * P->sh : NULL;
            it->u0 = P->k0 / SB;
            it->g = 0;
            it->started = 1;
        }
        if (it->u0 * SB >= it->kz) { it->started = 0; it->pi++; continue; }
        const long long u0 = it->u0;
        rows_t *B = &blocks[it->g];
        if (++it->g == nb) { it->g = 0; it->u0 += NS; }
        if (unit_init(U, P, B, u0, it->pm, it->ps)) return 1;
    }
}

/* O = O alpha on the rows of unit U whose max moved (NaN alpha included; the one pass leaves most
 * rows' max where it was), before its P V */
static void rescale_o(const job_t *J, const unit_t *U) {
    const vf one = vf_set1(1.0f);
    uint32_t rows = (uint32_t)vf_ne(vf_load(U->alpha), one) | (uint32_t)vf_ne(vf_load(U->alpha + 16), one) << 16;
    if (U->B->nr < QB) rows &= (1u << U->B->nr) - 1;
    while (rows) {  /* the rows whose alpha is not 1 (NaN included) */
        const int r = __builtin_ctz(rows);
        rows &= rows - 1;
        const vf a = vf_set1(U->alpha[r]);
        float *o = U->B->acc + r * J->Dvp;
        for (int d = 0; d < J->Dvp; d += 16) vf_store(o + d, vf_mul(vf_load(o + d), a));
    }
}

#ifdef KF_AMX
/* S = Q K^T on the tiles for sub-block u: tiles 0-3 the 2 x 2 blocks of 16 rows x 16 keys, 4-5 Q, 6-7 K */
static void scores_amx(const job_t *J, const rows_t *B, float *sbuf, int u, const char *kt) {
    const uint16_t *q = (const uint16_t *)B->qbuf, *k = (const uint16_t *)kt;
    const int Dp = J->Dp;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int c = 0; c < J->nc; c++) {
        _tile_loadd(4, q + 32 * c, Dp * 2);
        _tile_loadd(5, q + 16 * Dp + 32 * c, Dp * 2);
        _tile_loadd(6, k + (size_t)(2 * c) * TILE, 64);
        _tile_loadd(7, k + (size_t)(2 * c + 1) * TILE, 64);
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

/* O += P V for value columns [16 jc, 16 jc + 32) of unit U: tiles 0-3 two 16-column slices of the 32
 * rows of O, loaded, summed into over the seen sub-blocks and stored back; 4-5 P, 6-7 V. (Into a
 * buffer of P V and then O = O alpha + P V in AVX-512: 1.01-1.05x the time.) */
static void values_amx(const job_t *J, const unit_t *U, const char *vp, int jc) {
    const int Dvp = J->Dvp;
    float *o = U->B->acc;
    if (U->B->fresh) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, o + 16 * jc, Dvp * 4);
        _tile_loadd(1, o + 16 * jc + 16, Dvp * 4);
        _tile_loadd(2, o + 16 * Dvp + 16 * jc, Dvp * 4);
        _tile_loadd(3, o + 16 * Dvp + 16 * jc + 16, Dvp * 4);
    }
    for (int u = 0; u < U->ns; u++) {
        if (!U->seen[u]) continue;
        const uint16_t *vt = (const uint16_t *)(vp + (size_t)(U->u0 + u) * vpack_size(J));
        _tile_loadd(4, U->pbuf + SB * u, KB * 2);
        _tile_loadd(5, U->pbuf + 16 * KB + SB * u, KB * 2);
        _tile_loadd(6, vt + (size_t)jc * TILE, 64);
        _tile_loadd(7, vt + (size_t)(jc + 1) * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + 16 * jc, Dvp * 4);
    _tile_stored(1, o + 16 * jc + 16, Dvp * 4);
    _tile_stored(2, o + 16 * Dvp + 16 * jc, Dvp * 4);
    _tile_stored(3, o + 16 * Dvp + 16 * jc + 16, Dvp * 4);
}

/* The tile work of the bfloat16 pipeline. Q K^T of the next pair of units is queued between the rows of
 * the current pair's softmax, one sub-block a task, the two units' in turn (the sub-block's keys, 4
 * KiB, read from L2 once for both: 0.95-0.97x the time of one unit at a time at 4k and 16k, dense and
 * causal; four units, with twice the scores in flight, 1.01-1.05x). A unit's O = O alpha + P V runs right
 * after its softmax, while its P (16 KiB) is still in L1 (P V of the unit before in its place, its P
 * back from L2, beside the next softmax: 1.02-1.05x the time at 4k dense and causal, 1.04x at 16k
 * causal; both units' P V after the second softmax, the values read once: 1.01-1.02x; all of the
 * tile work after the softmax, none beside it: 1.07x). Meant as software pipelining, the tile unit
 * multiplying while the vector units run the softmax; on the Intel Xeon measured the two do not
 * overlap (in isolation 8 tile products of a 32 x 32 block took 60 ns, its softmax 109-116 ns, and
 * the two interleaved 205-225 ns), yet interleaving took 0.92-0.95x the time of the tile work run
 * apart. */
typedef struct {
    const job_t *J;
    const char *kp;
    unit_t *units[PAIR];
    int n, next, k;  /* units queued (0: nothing to do); the next task: sub-block next of units[k] */
} tasks_t;

static void queue(tasks_t *T, unit_t *U, int n) {
    for (int i = 0; i < PAIR; i++) T->units[i] = &U[i];
    T->n = n;
    T->next = T->k = 0;
}

static void pump(tasks_t *T) {
    while (T->n) {
        if (T->next >= NS) {
            T->n = 0;
            break;
        }
        const unit_t *U = T->units[T->k];
        const int u = T->next;
        if (++T->k == T->n) {
            T->k = 0;
            T->next++;
        }
        if (u < U->ns && U->seen[u]) {
            scores_amx(T->J, U->B, U->sbuf, u, T->kp + (size_t)(U->u0 + u) * kpack_size(T->J));
            return;
        }
    }
}

static void drain(tasks_t *T) {
    while (T->n) pump(T);
}

/* O = O alpha + P V of unit U (O = P V on its block's first) */
static void values_unit(const job_t *J, const unit_t *U, const char *vp) {
    if (!U->any) return;
    if (!U->B->fresh) rescale_o(J, U);
    for (int jc = 0; jc < J->nj; jc += 2) values_amx(J, U, vp, jc);
    U->B->fresh = 0;
}
#else
typedef struct { int none; } tasks_t;
static void pump(tasks_t *T) { (void)T; }
#endif

/* S = Q K^T in float32 for sub-block u and the row groups [g0, g1) of QR rows: a QR x 16 QK tile of
 * scores in registers (8 x 32 in 16 of AVX-512's), a broadcast of q times a vector of K^T (16 keys of one
 * dim) per FMA */
static void scores_f32(const job_t *J, const rows_t *B, float *sbuf, int u, const char *kt, int g0, int g1) {
    const int D = J->D, Dp = J->Dp;
    for (int g = g0; g < g1; g++) {
        const float *q = (const float *)B->qbuf + g * QR * Dp;
        for (int h = 0; h < 2; h += QK) {
            const float *k = (const float *)kt + 16 * h;
            vf a[QR][QK];
            for (int r = 0; r < QR; r++)
                for (int x = 0; x < QK; x++) a[r][x] = vf_zero();
            for (int d = 0; d < D; d++) {
                vf kx[QK];
                for (int x = 0; x < QK; x++) {
                    kx[x] = vf_load(k + d * SB + 16 * x);
                    vf_keep(&kx[x]);
                }
                for (int r = 0; r < QR; r++) {
                    const vf y = vf_set1(q[r * Dp + d]);
                    for (int x = 0; x < QK; x++) a[r][x] = vf_fmadd(y, kx[x], a[r][x]);
                }
            }
            float *s = sbuf + g * QR * KB + SB * u + 16 * h;
            for (int r = 0; r < QR; r++)
                for (int x = 0; x < QK; x++) vf_store(s + r * KB + 16 * x, a[r][x]);
        }
    }
}

/* O[rows] += P[rows, keys] V for PR rows, n keys (of consecutive sub-blocks: their P and packed V are
 * contiguous) and nv vectors of 16 columns from c: a PR x 16 nv tile of O in registers, a broadcast of P
 * times a vector of V per FMA */
static inline __attribute__((always_inline)) void pv_tile(float *o, int Dvp, const float *p, const float *vt,
                                                          int n, int c, const int nv) {
    vf a[PR][VF_TILE];
    for (int r = 0; r < PR; r++)
        for (int x = 0; x < nv; x++) a[r][x] = vf_load(o + r * Dvp + c + 16 * x);
    for (int j = 0; j < n; j++) {
        vf w[VF_TILE];
        for (int x = 0; x < nv; x++) {
            w[x] = vf_load(vt + j * Dvp + c + 16 * x);
            vf_keep(&w[x]);
        }
        for (int r = 0; r < PR; r++) {
            const vf y = vf_set1(p[r * KB + j]);
            for (int x = 0; x < nv; x++) a[r][x] = vf_fmadd(y, w[x], a[r][x]);
        }
    }
    for (int r = 0; r < PR; r++)
        for (int x = 0; x < nv; x++) vf_store(o + r * Dvp + c + 16 * x, a[r][x]);
}

#define PU 2  /* float32: sub-blocks (of those in a run) one O tile takes before it is stored */

/* O = O alpha + P V in float32 for the row groups [g0, g1) of PR rows, over runs of up to PU
 * consecutive seen sub-blocks (a run's V, 32 PU x Dvp, stays in L1 for every row group) */
static void values_f32(const job_t *J, const unit_t *U, const char *vp) {
    const rows_t *B = U->B;
    const int Dvp = J->Dvp, g0 = (int)(U->ra - B->i0) / PR, g1 = (int)(U->rb - B->i0 + PR - 1) / PR;
    const int ns = U->ns, *seen = U->seen;
    const long long u0 = U->u0;
    rescale_o(J, U);
    for (int u = 0; u < ns;) {
        if (!seen[u]) { u++; continue; }
        int m = 1;
        while (m < PU && u + m < ns && seen[u + m]) m++;
        const float *vt = (const float *)(vp + (size_t)(u0 + u) * vpack_size(J));
        for (int g = g0; g < g1; g++) {
            float *o = B->acc + g * PR * Dvp;
            const float *p = U->p32 + g * PR * KB + SB * u;
            int c = 0;
            for (; c + 16 * VF_TILE <= Dvp; c += 16 * VF_TILE) pv_tile(o, Dvp, p, vt, SB * m, c, VF_TILE);
#if VF_TILE == 4
            switch ((Dvp - c) / 16) {
                case 3: pv_tile(o, Dvp, p, vt, SB * m, c, 3); break;
                case 2: pv_tile(o, Dvp, p, vt, SB * m, c, 2); break;
                case 1: pv_tile(o, Dvp, p, vt, SB * m, c, 1); break;
                default: break;
            }
#endif
        }
        u += m;
    }
}

/* P of row r, sub-block u (keys 0-15 in p0, 16-31 in p1): float32 at p32, or bfloat16 for the tiles */
static inline __attribute__((always_inline)) void store_p(unit_t *U, int r, int u, vf p0, vf p1,
                                                          const int f32) {
    if (f32) {
        vf_store(U->p32 + r * KB + SB * u, p0);
        vf_store(U->p32 + r * KB + SB * u + 16, p1);
    } else {
#ifdef KF_AMX
        _mm512_store_si512(U->pbuf + r * KB + SB * u, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
#endif
    }
}

/* The lane-wise max of a row's scores at pr over every lane of the sub-blocks up to ns (two chains of
 * the max: a row's latency is short) */
static inline __attribute__((always_inline)) vf row_max(const float *pr, int ns) {
    vf m0 = vf_set1(-INFINITY), m1 = m0;
    for (int u = 0; u < ns; u++) {
        m0 = vf_max(m0, vf_load(pr + SB * u));
        m1 = vf_max(m1, vf_load(pr + SB * u + 16));
    }
    return vf_max(m0, m1);
}

/* P of row r (its S or y at pr) over every lane of every sub-block up to ns: 2^((S a - b) c), stored;
 * returns its sum in 16 lanes (NaN when a score was NaN). Where the product overflows to -inf (a mask
 * of -3e38), vreduceps gives 0 and vscalefps scales by 2^-inf: P = 0, no clamp needed. */
static inline __attribute__((always_inline)) vf row_p(unit_t *U, int r, const float *pr, vf a, vf b,
                                                          vf c, const int f32) {
    vf s0 = vf_zero(), s1 = vf_zero();
    for (int u = 0; u < U->ns; u++) {
        const vf x0 = vf_mul(vf_fmsub(vf_load(pr + SB * u), a, b), c);
        const vf x1 = vf_mul(vf_fmsub(vf_load(pr + SB * u + 16), a, b), c);
        const vf p0 = exp2_p(0xFFFF, x0, f32), p1 = exp2_p(0xFFFF, x1, f32);
        s0 = vf_add(s0, p0);
        s1 = vf_add(s1, p1);
        store_p(U, r, u, p0, p1, f32);
    }
    return vf_add(s0, s1);
}

/* row_p for a row whose buffer keeps S unscaled: (y - m) log2 e as (S - smax) scale log2 e when this
 * step holds the row's max (`here`: exactly 0 at the max, so P = 1), else as (S scale - m) log2 e, the
 * product and subtraction in one rounding */
static inline __attribute__((always_inline)) vf row_p_raw(unit_t *U, int r, const float *pr, float scale,
                                                              int here, float smax, float m, const int f32) {
    const float log2e = LOG2E;
    return row_p(U, r, pr, vf_set1(here ? 1.0f : scale), vf_set1(here ? smax : m),
                 vf_set1(here ? scale * log2e : log2e), f32);
}

/* The end of a unit's softmax that took part (U->any): P = 0 for rows past nr (bfloat16: the last
 * block's enter the tile product; float32 never writes them out), alpha = e^dm, l = l alpha + the
 * step's sums rs on the rows of `rows` (the one pass adds the others' sums to l itself). A NaN m (or
 * sum) makes alpha (or l) NaN: the row's out and lse. */
static inline __attribute__((always_inline)) void unit_close(unit_t *U, const float *dm, const float *rs,
                                                             uint32_t rows, const int f32) {
    rows_t *B = U->B;
    if (!f32)
        for (int r = B->nr; r < QB; r++)
            for (int u = 0; u < U->ns; u++)
                if (U->seen[u]) store_p(U, r, u, vf_zero(), vf_zero(), f32);
    const vf log2e = vf_set1(LOG2E);
    for (int r = 0; r < QB; r += 16)
        vf_store(U->alpha + r, exp2_16(0xFFFF, vf_mul(vf_load(dm + r), log2e)));
    if (B->nr < QB) rows &= (1u << B->nr) - 1;
    while (rows) {
        const int r = __builtin_ctz(rows);
        rows &= rows - 1;
        float *l = B->l + 16 * r;
        vf_store(l, vf_fmadd(vf_load(l), vf_set1(U->alpha[r]), vf_load(rs + 16 * r)));
    }
}

/* How large P = e^(y - m) may grow against a row's running max m before the max moves: 2^8, far inside
 * bfloat16's exponent range (and l's, in float32) */
#define STALE_P 256.0f
/* The largest running max the one pass takes: m log2 e must not overflow (past it, every P of the
 * row would be 0); the general softmax, in base e, takes larger ones */
#define STALE_M (FLT_MAX / LOG2E)

/* Sub-block u of stale_row: P on the lanes k0 (keys 0-15) and k1 (16-31), stored, added to s0, s1 */
static inline __attribute__((always_inline)) void stale_sub(unit_t *U, int r, const float *pr, int u, __mmask16 k0,
                                                            __mmask16 k1, vf a, vf b, vf c,
                                                            const int exact, const int f32, vf *s0, vf *s1) {
    vf x0 = vf_fmsub(vf_load(pr + SB * u), a, b);
    vf x1 = vf_fmsub(vf_load(pr + SB * u + 16), a, b);
    if (exact) {
        x0 = vf_mul(x0, c);
        x1 = vf_mul(x1, c);
    }
    const vf p0 = exp2_p(k0, x0, f32), p1 = exp2_p(k1, x1, f32);
    *s0 = vf_add(*s0, p0);
    *s1 = vf_add(*s1, p1);
    store_p(U, r, u, p0, p1, f32);
}

/* P of row r over the first e keys of the step's ns sub-blocks (lanes past them 0; the first `full`
 * sub-blocks are whole, and take no lane masks), stored; returns its sum in 16 lanes. `exact`:
 * (S - smax) c, exactly 0 at the max (P = 1); else S c - b in one FMA */
static inline __attribute__((always_inline)) vf stale_row(unit_t *U, int r, const float *pr, int e, int full,
                                                              int ns, vf c, vf b, const int exact,
                                                              const int f32) {
    const vf a = exact ? vf_set1(1.0f) : c;
    vf s0 = vf_zero(), s1 = vf_zero();
    int u = 0;
    for (; u < full; u++) stale_sub(U, r, pr, u, 0xFFFF, 0xFFFF, a, b, c, exact, f32, &s0, &s1);
    for (; u < ns; u++)  /* the diagonal's sub-block, then those past the row's last key: P = 0 */
        stale_sub(U, r, pr, u, lanes(0, e - SB * u), lanes(0, e - SB * u - 16), a, b, c, exact, f32, &s0, &s1);
    return vf_add(s0, s1);
}

/* The one-pass softmax of a unit with plain scores (no mask tile, shift or softcap; S unscaled: scale >
 * 0) whose rows all lie in the piece and see the step from its first key (a causal row may stop
 * inside it: the diagonal). P is taken against the row's running max as it stands (FlashAttention-4
 * keeps it until a P would pass 2^8); a row whose P's in a lane sum past 2^8 (so any row with a P past
 * it) is redone against its own max over the step (a pass over its scores, P = 1 there exactly, alpha
 * = e^(m_old - m_new); its max is above m_old, as a sum of 16 P's past 2^8 needs a P above 1). Every
 * other row keeps alpha = 1, so O is not rescaled for it and its sum goes into l as it is made (l =
 * l alpha + sum at the close for every row: 1.02x the time). A row's first step has no running max yet:
 * it is seeded with the max of the step's first 32 keys it sees, so first steps and the diagonal take
 * one pass too. float32 writes P to a buffer of its own (p32own), as a redone row reads its S again.
 * Returns 0, having changed nothing, when a running max or a seed is NaN, infinite or past STALE_M:
 * the general softmax takes the unit. A NaN or infinite score met later still makes its row NaN:
 * NaN reaches the sum, +inf rises above any max and its redo gives inf - inf, and a redo whose max
 * of y = S scale overflows sets the row NaN, as the general softmax does. */
static inline __attribute__((always_inline)) int stale_rows(const job_t *J, unit_t *U, tasks_t *T, const int all,
                                                            const int f32) {
    rows_t *B = U->B;
    const piece_t *P = U->P;
    const int nr = B->nr, ns = U->ns;
    const float sc = f32 && J->qs ? 1.0f : J->scale;  /* y = S sc (1 where q came pre-scaled) */
    const vf a = vf_set1(sc * LOG2E), ninf = vf_set1(-INFINITY);
    const vf tau = vf_set1(STALE_P);
    /* per row: m_old - m_new, a redone row's step sum (16 lanes), a first step's seed */
    float dm[QB] __attribute__((aligned(64))), rs[QB * 16] __attribute__((aligned(64))), seed[QB];
    int end[QB];  /* keys of the step each row sees: [j0, j0 + end) (all: every key, ns SB) */
    uint32_t moved = 0, fresh = 0, seeds = (uint32_t)-1 >> (QB - nr);  /* rows that may need a seed */
    if (all) {  /* every row sees the step: the running maxima checked 16 at a time, and only rows
                 * with none yet (-inf) go on below, for their seed */
        const vf stm = vf_set1(STALE_M);
        const vf m0 = vf_loadu(B->m), m1 = vf_loadu(B->m + 16);
        const uint32_t none = (uint32_t)vf_eq(m0, ninf) | (uint32_t)vf_eq(m1, ninf) << 16;
        const uint32_t ok = (uint32_t)vf_lt(vf_abs(m0), stm) | (uint32_t)vf_lt(vf_abs(m1), stm) << 16;
        if (seeds & ~none & ~ok) return 0;  /* NaN, +inf or too large */
        seeds &= none;
    }
    for (int r = all ? (seeds ? __builtin_ctz(seeds) : nr) : 0; r < nr; r++) {
        if (all) {
            if (!(seeds >> r & 1)) continue;
            end[r] = ns * SB;
        } else {
            long long kr = U->kz;
            if (P->causal && P->k0 + (B->i0 + r - P->q0) + 1 < kr) kr = P->k0 + (B->i0 + r - P->q0) + 1;
            kr -= U->j0;
            end[r] = kr <= 0 ? 0 : kr >= (long long)ns * SB ? ns * SB : (int)kr;
        }
        const float m = B->m[r];
        if (m == -INFINITY && end[r] > 0) {  /* the row's first keys: the seed */
            const float *pr = U->sbuf + r * KB;
            const vf x0 = vf_mask_load(ninf, lanes(0, end[r]), pr);
            const vf x = vf_mask_max(x0, lanes(0, end[r] - 16), x0, vf_load(pr + 16));
            seed[r] = vf_reduce_max(x);  /* of S; the row's max of y is seed sc */
            if (!(fabsf(seed[r] * sc) < STALE_M)) return 0;
            fresh |= 1u << r;
        } else if (m != -INFINITY && !(fabsf(m) < STALE_M)) {  /* NaN, +inf or too large */
            return 0;
        }
    }
    for (int r = 0; r < QB; r++) dm[r] = 0.0f;
    if (f32) {  /* P in a buffer of its own (a redone row reads S again); rows past nr that P V's
                 * groups of PR rows reach get 0 */
        U->p32 = U->p32own;
        for (int r = nr; r < (nr + PR - 1) / PR * PR; r++)
            for (int u = 0; u < ns; u++) store_p(U, r, u, vf_zero(), vf_zero(), 1);
    }
    for (int r = 0; r < nr; r++) {
        if (T && r % PUMP_ROWS == 0) pump(T);
        const float *pr = U->sbuf + r * KB;
        const int e = all ? ns * SB : end[r], full = all ? ns : e / SB;
        vf sum;
        if (fresh >> r & 1) {  /* O and l are 0: alpha = e^-inf = 0 scales nothing. P against the seed,
                                * exactly 1 at it (a row with one key, or one that dominates, gets its
                                * value exactly) */
            dm[r] = -INFINITY;
            B->m[r] = seed[r] * sc;
            sum = stale_row(U, r, pr, e, full, ns, a, vf_set1(seed[r]), 1, f32);
        } else {
            /* y - m in log2 units as S (scale log2 e) - m log2 e, one FMA: not exact at any key, which
             * no row needs here (P's relative error from it is |y| 2^-24, against bfloat16's 2^-9) */
            sum = stale_row(U, r, pr, e, full, ns, a, vf_set1(B->m[r] * LOG2E), 0, f32);
        }
        /* a P above 2^8 makes its lane's sum so; a lane's 16 P's summing past it otherwise is rare,
         * and its redo is exact anyway. A NaN sum stays (NaN is the row's answer). A row kept adds
         * its sum to l here (alpha 1; a seeded row's l is 0); a redone row's l = l alpha + sum at
         * the close. */
        if (vf_gt(sum, tau)) {
            moved |= 1u << r;
        } else {
            float *l = B->l + 16 * r;
            vf_store(l, vf_add(vf_load(l), sum));
        }
    }
    for (uint32_t left = moved; left; left &= left - 1) {  /* rare after a row's first steps */
        const int r = __builtin_ctz(left);
        const float *pr = U->sbuf + r * KB;
        const int e = all ? ns * SB : end[r];
        vf mx = ninf;
        for (int u = 0; u * SB < e; u++) {
            mx = vf_mask_max(mx, lanes(0, e - SB * u), mx, vf_load(pr + SB * u));
            mx = vf_mask_max(mx, lanes(0, e - SB * u - 16), mx, vf_load(pr + SB * u + 16));
        }
        const float smax = vf_reduce_max(mx), mn = smax * sc;
        if (!(fabsf(mn) < INFINITY)) {  /* y = S scale overflows: the row is NaN, as in the general
                                         * softmax (and PyTorch's op) */
            B->m[r] = dm[r] = NAN;
            vf_store(rs + 16 * r, vf_set1(NAN));
            continue;
        }
        dm[r] += B->m[r] - mn;  /* a seeded row's stays -inf */
        B->m[r] = mn;
        /* (S - smax) scale log2 e: exactly 0 at the max, P = 1 */
        vf_store(rs + 16 * r, stale_row(U, r, pr, e, e / SB, ns, a, vf_set1(smax), 1, f32));
    }
    U->any = 1;
    unit_close(U, dm, rs, moved, f32);
    return 1;
}

static inline __attribute__((always_inline)) int softmax_stale(const job_t *J, unit_t *U, tasks_t *T, const int f32) {
    const piece_t *P = U->P;
    long long kr = U->kz;  /* the first row sees the fewest keys */
    if (P->causal && P->k0 + (U->ra - P->q0) + 1 < kr) kr = P->k0 + (U->ra - P->q0) + 1;
    return kr >= U->j0 + (long long)U->ns * SB ? stale_rows(J, U, T, 1, f32) : stale_rows(J, U, T, 0, f32);
}

/* Whether softmax_stale may take U: plain scores (S unscaled: scale > 0), every row of the block in the
 * piece and seeing the step from its first key */
static int stale_unit(const job_t *J, const unit_t *U) {
    if (U->pm || U->ps || J->cap != 0.0f || !(J->qs || J->scale > 0.0f)) return 0;
    return U->ra == U->B->i0 && U->rb == U->B->i0 + U->B->nr && U->P->k0 <= U->j0;
}

/* The online softmax of unit U, row by row, over the step's seen sub-blocks (16 keys a vector), in base
 * e: y the score, m the running max of y, l = sum e^(y - m). A NaN score reaches the max or the sum, and
 * +inf the max: either makes the row NaN. Leaves P, alpha = e^(m_old - m_new) and U->any (whether any
 * row has P to add). T: tile work to pump between rows (bfloat16), or NULL. */
static inline __attribute__((always_inline)) void softmax(const job_t *J, unit_t *U, const int f32, tasks_t *T) {
    const piece_t *P = U->P;
    rows_t *B = U->B;
    const float *pm = U->pm, *ps = U->ps;
    const long long ra = U->ra, rb = U->rb, ka = P->k0, kz = U->kz, j0 = U->j0;
    const int ns = U->ns, *seen = U->seen;
    const vf ninf = vf_set1(-INFINITY), log2e = vf_set1(LOG2E);
    const vf scale = vf_set1(J->scale);
    const int plain = !pm && !ps && J->cap == 0.0f;  /* scores as they come (q pre-scaled: y = S) */
    const int qs = f32 && J->qs;  /* (f32 is a constant here: bfloat16's branches on it fold away) */
    /* per row: dm = m_old - m_new and the step's sum of P; alpha = e^dm and l = l alpha + sum are
     * taken for all rows at once after the loop (a row that takes no part: dm = 0, sum = 0) */
    float dm[QB] __attribute__((aligned(64))), rs[QB * 16] __attribute__((aligned(64)));
    for (int r = 0; r < QB; r++) {
        dm[r] = 0.0f;
        vf_store(rs + 16 * r, vf_zero());
    }
    int any = 0;
    for (int r = 0; r < B->nr; r++) {
        const long long i = B->i0 + r;
        float *pr = U->sbuf + r * KB;  /* float32: P in place of S */
        if (T && r % PUMP_ROWS == 0) pump(T);
        if (i < ra || i >= rb) {  /* not a row of this piece: no P, nothing to rescale */
            for (int u = 0; u < ns; u++)
                if (seen[u]) store_p(U, r, u, vf_zero(), vf_zero(), f32);
            continue;
        }
        long long kr = kz;  /* past the row's last key */
        if (P->causal && P->k0 + (i - P->q0) + 1 < kr) kr = P->k0 + (i - P->q0) + 1;
        const float *mr = pm ? pm + (i - P->q0) * P->ml - P->k0 : NULL;  /* at key j: mr[j] */
        const int full = ka <= j0 && kr >= j0 + (long long)ns * SB;  /* the row sees every key of the step */
        __mmask16 vis[2 * NS];
        vf m0 = ninf, m1 = ninf;  /* two chains of the max (in registers: a row's latency is short) */
        /* pass 1: y in place of S, its max. Where q came pre-scaled, S is y unless a softcap, mask or
         * shift applies */
        const int raw = !qs && full && plain && J->scale > 0.0f;  /* the buffer keeps S */
        if (full && plain && (qs || raw)) {  /* no mask: every sub-block up to ns is seen, every lane.
                                               * raw: y = S scale is taken in pass 2, and y's max is
                                               * S's times scale (rounding is monotone) */
            m1 = row_max(pr, ns);  /* second operand of the max below: a NaN lane stays NaN */
        } else {
            const vf shift = ps ? vf_set1(ps[i - P->q0]) : vf_zero();
            const float cap = J->cap;
            for (int x = 0; x < 2 * ns; x++) {
                vis[x] = 0;
                if (!seen[x / 2]) continue;
                const long long jx = j0 + 16 * x;
                vis[x] = full ? 0xFFFF : lanes(ka - jx, kr - jx);
                vf t = vf_load(pr + 16 * x);
                /* y rounded once here and kept: the row's largest y minus the max is exactly 0 (a
                 * product fused into the later subtraction would not be) */
                if (cap > 0.0f)
                    t = softcap16(qs ? t : vf_mul(t, scale), cap);
                else if (!qs)
                    t = vf_mul_rn(t, scale);
                if (mr) {  /* a pair the mask hides (-inf) is out of vis: its P is exactly 0 */
                    const vf add = vf_maskz_loadu(vis[x], mr + jx);
                    vis[x] &= vf_ne(add, ninf);
                    t = vf_add(t, add);
                }
                if (ps) t = vf_add(t, shift);
                vf_store(pr + 16 * x, t);
                if (x & 1)
                    m1 = vf_mask_max(m1, vis[x], m1, t);
                else
                    m0 = vf_mask_max(m0, vis[x], m0, t);
            }
        }
        const float sm = vf_reduce_max(vf_max(m0, m1)), bm = raw ? sm * J->scale : sm;
        if (isnan(bm) || bm == INFINITY || isnan(B->m[r])) {  /* the row is NaN from here on (out and lse) */
            B->m[r] = dm[r] = NAN;
            any = 1;
            continue;
        }
        const float mn = bm > B->m[r] ? bm : B->m[r];
        if (mn == -INFINITY) {  /* nothing seen yet: no P, nothing to rescale */
            for (int u = 0; u < ns; u++)
                if (seen[u]) store_p(U, r, u, vf_zero(), vf_zero(), f32);
            continue;
        }
        any = 1;
        dm[r] = B->m[r] - mn;  /* -inf on the row's first keys: alpha 0 scales an O and l of 0 */
        const vf mv = vf_set1(mn);
        vf s0 = vf_zero(), s1 = vf_zero();
        /* pass 2: P = e^(y - m) = 2^((y - m) log2 e). Where the product overflows to -inf (a mask of
         * -3e38), vreduceps gives 0 and vscalefps scales by 2^-inf: P = 0, no clamp needed */
        if (raw) {
            s0 = row_p_raw(U, r, pr, J->scale, mn == bm, sm, mn, f32);  /* s1 stays 0 */
        } else if (full && !pm) {  /* every lane of every sub-block up to ns: no lane masks (vis unset) */
            s0 = row_p(U, r, pr, vf_set1(1.0f), mv, log2e, f32);
        } else {
            for (int u = 0; u < ns; u++) {
                if (!seen[u]) continue;
                const vf x0 = vf_mul(vf_sub(vf_load(pr + SB * u), mv), log2e);
                const vf x1 = vf_mul(vf_sub(vf_load(pr + SB * u + 16), mv), log2e);
                const vf p0 = exp2_p(vis[2 * u], x0, f32), p1 = exp2_p(vis[2 * u + 1], x1, f32);
                s0 = vf_add(s0, p0);
                s1 = vf_add(s1, p1);
                store_p(U, r, u, p0, p1, f32);
            }
        }
        vf_store(rs + 16 * r, vf_add(s0, s1));  /* NaN when a score was NaN */
        B->m[r] = mn;
    }
    U->any = any;
    if (any) unit_close(U, dm, rs, (uint32_t)-1, f32);
}

/* A thread's scratch, from the heap (about 250-370 KiB at head size 64, 670-950 KiB at 256: more than a
 * small thread stack holds): the step buffers, then each block's q, O and l. */
static size_t scratch_bytes(const job_t *J) {
    return sizeof(scratch_t) + (size_t)J->G * QB * (J->Dp * (J->f32 ? sizeof(float) : sizeof(uint16_t))
                                                 + (J->Dvp + 16) * sizeof(float));
}

/* One work item: G blocks of 32 rows of (b, h) over the keys of every piece they are in. The blocks take
 * each step of KB keys in turn, so the step's packed keys and values are read from memory once for
 * G x 32 rows (at 16k keys a head's packed keys and values, 4 MiB, outgrow a core's L2). bfloat16
 * pipelines its units (see tasks_t); float32 runs each in turn (its products and its softmax share
 * the vector units). `mem`: the thread's scratch_bytes(J), 64-byte aligned; kp, vp: the kv head's
 * packed key blocks. A head's items run from its last rows to its first: under a causal mask the last
 * see the most keys, so the items left when the threads run out of work are the cheapest (first rows
 * first, a 4k causal call left one thread idle 0.3 ms of 12 at the end, now 0.01 ms). */
static inline __attribute__((always_inline)) void item(const job_t *J, long long w, char *mem, const char *kp,
                                                       const char *vp, const int f32) {
    const int G = J->G;
    const long long nqg = (J->nqb + G - 1) / G, qg = nqg - 1 - w % nqg, bh = w / nqg;
    const int b = (int)(bh / J->Hq), h = (int)(bh % J->Hq);
    const int Dp = J->Dp, Dvp = J->Dvp;
    const size_t qsize = f32 ? sizeof(float) : sizeof(uint16_t);
    scratch_t *X = (scratch_t *)mem;
    char *qbuf = mem + sizeof(scratch_t);                             /* G blocks of QB x Dp */
    float *acc = (float *)(qbuf + (size_t)G * QB * Dp * qsize);      /* G blocks of QB x Dvp */
    float *lbuf = acc + (size_t)G * QB * Dvp;                         /* G blocks of QB x 16 */
    rows_t blocks[GMAX];
    int nb = 0;
    for (int g = 0; g < G; g++) {
        const long long i0 = (qg * G + g) * QB;
        if (i0 >= J->L) break;
        rows_t *B = &blocks[nb++];
        B->i0 = i0;
        B->nr = (int)(J->L - i0 < QB ? J->L - i0 : QB);
        B->qbuf = qbuf + (size_t)g * QB * Dp * qsize;
        B->acc = acc + (size_t)g * QB * Dvp;
        B->l = lbuf + (size_t)g * QB * 16;
        const char *q = (const char *)J->q + (b * J->sqb + h * J->sqh + i0 * J->sqn) * qsize;
        for (int r = 0; r < QB; r++) {  /* q's rows, zeros past D and past nr */
            const int live = r < B->nr;
            if (f32) {  /* float32 q, times a power-of-two scale (exact): S is y */
                float *dst = (float *)B->qbuf + r * Dp;
                const float *src = (const float *)q + (live ? r : 0) * J->sqn;  /* never past q */
                for (int d = 0; d < Dp; d += 16) {
                    const __mmask16 k = first(Dp - d);  /* Dp = D in float32 */
                    const __mmask16 in = live ? k : 0;
                    vf_mask_storeu(dst + d, k, vf_maskz(in, vf_mul(vf_maskz_loadu(in, src + d),
                                                                   vf_set1(J->qs ? J->scale : 1.0f))));
                }
            } else {
#ifdef KF_AMX
                uint16_t *dst = (uint16_t *)B->qbuf + r * Dp;
                const uint16_t *src = (const uint16_t *)q + (live ? r : 0) * J->sqn;
                for (int d = 0; d < Dp; d += 32) {
                    const __mmask32 k = live ? first32(J->D - d) : 0;
                    _mm512_storeu_si512(dst + d, _mm512_maskz_loadu_epi16(k, src + d));
                }
#endif
            }
            B->m[r] = -INFINITY;
            vf_store(B->l + 16 * r, vf_zero());
        }
        B->fresh = !f32;
        if (f32) memset(B->acc, 0, sizeof(float) * QB * Dvp);
    }
    iter_t it = {0, 0, 0, 0, 0, NULL, NULL};
    if (f32) {
        unit_t U;
        U.sbuf = X->sbuf[0];
        U.pbuf = X->pbuf;
        U.p32own = X->sbuf[1];  /* float32 runs one unit at a time: the ring's second S buffer is free */
        while (next_unit(J, &it, &U, blocks, nb, b, h)) {
            const int qa = (int)(U.ra - U.B->i0) / QR, qz = (int)(U.rb - U.B->i0 + QR - 1) / QR;
            for (int u = 0; u < U.ns; u++)
                if (U.seen[u]) scores_f32(J, U.B, U.sbuf, u, kp + (size_t)(U.u0 + u) * kpack_size(J), qa, qz);
            U.p32 = U.sbuf;  /* P in place of S, unless the one pass takes the unit */
            if (!(stale_unit(J, &U) && softmax_stale(J, &U, NULL, 1))) softmax(J, &U, 1, NULL);
            if (U.any) values_f32(J, &U, vp);
        }
    } else {
#ifdef KF_AMX
        /* pipelined by pairs of units: a pair's softmax runs beside Q K^T of the next pair; each
         * unit's P V follows its softmax */
        unit_t ring[2 * PAIR];
        for (int t = 0; t < 2 * PAIR; t++) {
            ring[t].sbuf = X->sbuf[t];
            ring[t].pbuf = X->pbuf;
        }
        tasks_t T = {J, kp, {NULL}, 0, 0, 0};
        int n = 0, base = 0;
        while (n < PAIR && next_unit(J, &it, &ring[n], blocks, nb, b, h)) n++;
        queue(&T, ring, n);
        drain(&T);  /* Q K^T of the first pair, alone */
        while (n) {
            unit_t *cur = &ring[base], *nxt = &ring[PAIR - base];
            int m = 0;
            while (m < PAIR && next_unit(J, &it, &nxt[m], blocks, nb, b, h)) m++;
            queue(&T, nxt, m);
            for (int i = 0; i < n; i++) {
                /* a softcap's softmax ran 1.15x slower with the tile work between its rows (measured,
                 * 16k causal): it takes the tile work after it */
                if (!(stale_unit(J, &cur[i]) && softmax_stale(J, &cur[i], &T, 0)))
                    softmax(J, &cur[i], 0, J->cap > 0.0f ? NULL : &T);
                values_unit(J, &cur[i], vp);  /* its P still in L1 */
            }
            drain(&T);
            base = PAIR - base;
            n = m;
        }
#endif
    }
    /* out = O / l, lse = m + log l; a row that saw no key: 0 and -inf */
    const int Dv = J->Dv;
    for (int g = 0; g < nb; g++) {
        const rows_t *B = &blocks[g];
        for (int r = 0; r < B->nr; r++) {
            const size_t row = (size_t)(bh * J->L + B->i0 + r);
            const float l = vf_reduce_add(vf_load(B->l + 16 * r));
            const int empty = B->m[r] == -INFINITY && l == 0.0f;
            const vf inv = vf_set1(empty ? 0.0f : 1.0f / l);
            const float hi = empty ? -INFINITY : B->m[r] + logf(l);
            J->lse[row] = hi;
            if (J->lse_lo) J->lse_lo[row] = empty ? 0.0f : (float)(((double)B->m[r] + log((double)l)) - (double)hi);
            for (int d = 0; d < Dv; d += 16) {
                const __mmask16 k = first(Dv - d);
                /* an empty row is 0 even where a hidden key's NaN value reached O through a 0 in P */
                const vf y = empty ? vf_zero() : vf_mul(vf_load(B->acc + r * Dvp + d), inv);
#ifdef KF_AMX
                if (J->out_bf16) {
                    _mm256_mask_storeu_epi16((uint16_t *)J->out + row * Dv + d, k, (__m256i)_mm512_cvtneps_pbh(y));
                    continue;
                }
#endif
                vf_mask_storeu((float *)J->out + row * Dv + d, k, y);
            }
        }
    }
}

static void item_f32(const job_t *J, long long w, char *mem, const char *kp, const char *vp) {
    item(J, w, mem, kp, vp, 1);
}
#ifdef KF_AMX
static void item_bf16(const job_t *J, long long w, char *mem, const char *kp, const char *vp) {
    item(J, w, mem, kp, vp, 0);
}
#endif
#endif

/* The work items in one run per thread, in order: thread i's run is the i-th share of the (batch, kv
 * head)s, the ones whose keys and values it packed, so a thread reads what it packed itself (items
 * handed out one at a time in order, OpenMP's dynamic schedule, put both threads on one head, half
 * of whose blocks the other thread had packed: 1.02-1.06x the time at 4k bfloat16 causal, 1.01-1.04x
 * dense, one process, both orders). A thread done with its run takes the next item of the run with
 * the most left, the most costly left there (a head's items run from its last rows), as OpenMP's
 * schedule would: with fewer kv heads than threads that is the schedule. A run is [lo, hi), lo in
 * the low 32 bits of v, hi in the high, taken by compare-and-swap. */
typedef struct {
    long long v;
    char pad[56];
} run_t;

static long long next_item(run_t *runs, int nt, int me) {
    for (;;) {  /* this thread's run, else the one with the most items left */
        int t = me;
        long long x = __atomic_load_n(&runs[me].v, __ATOMIC_ACQUIRE);
        if ((x & 0xFFFFFFFFLL) >= x >> 32) {
            long long most = 0;
            t = -1;
            for (int i = 0; i < nt; i++) {
                const long long y = __atomic_load_n(&runs[i].v, __ATOMIC_ACQUIRE), n = (y >> 32) - (y & 0xFFFFFFFFLL);
                if (n > most) { most = n; t = i; x = y; }
            }
            if (t < 0) return -1;
        }
        const long long lo = x & 0xFFFFFFFFLL, hi = x >> 32;
        if (__atomic_compare_exchange_n(&runs[t].v, &x, (lo + 1) | hi << 32, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return lo;
    }
}

/* The entry point (keyfold/kernels/native.py). q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)
 * bfloat16 (dtype 1: on AMX, D even) or float32 (dtype 0: on AVX-512 or AVX2 FMAs), rows contiguous; `pieces`
 * the plan's np pieces. out (B, Hq, L, Dv) bfloat16 (out_bf16, bfloat16 inputs only) or float32, lse
 * (B, Hq, L), both contiguous; lse_lo (B, Hq, L) or NULL: the low part of a float64 lse, lse + lse_lo
 * (last, so that a caller passing it to an older build, benchmarks/kernel_ab.py's, is ignored). Returns
 * 0; -1 for arguments out of range; -2 when scratch memory cannot be had; -3 when this build cannot run
 * the dtype (bfloat16 without AMX). */
int kf_prefill(const void *q, const void *k, const void *v, int dtype,
               long long sqb, long long sqh, long long sqn, long long skb, long long skh, long long skn,
               long long svb, long long svh, long long svn, int B, int Hq, int Hkv, long long L, long long S,
               int D, int Dv, float scale, float cap, const piece_t *pieces, int np, int out_bf16, void *out,
               float *lse, int threads, float *lse_lo) {
#ifndef KF_F32
    (void)q; (void)k; (void)v; (void)dtype; (void)sqb; (void)sqh; (void)sqn; (void)skb; (void)skh; (void)skn;
    (void)svb; (void)svh; (void)svn; (void)B; (void)Hq; (void)Hkv; (void)L; (void)S; (void)D; (void)Dv;
    (void)scale; (void)cap; (void)pieces; (void)np; (void)out_bf16; (void)out; (void)lse; (void)threads;
    (void)lse_lo;
    return -3;
#else
    const int f32 = dtype == 0;
#ifndef KF_AMX
    if (!f32) return -3;
#endif
    if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || L < 1 || S < 1 || D < 1 || D > MAXD || Dv < 1 || Dv > MAXD
        || (dtype != 0 && dtype != 1) || (!f32 && D % 2) || (f32 && out_bf16) || skn < 1 || skn > (1LL << 26)
        || !(cap >= 0.0f) || np < 0)
        return -1;
    for (int i = 0; i < np; i++)
        if (pieces[i].q0 < 0 || pieces[i].q1 > L || pieces[i].k0 < 0 || pieces[i].k1 > S) return -1;
    job_t J = {q, k, v, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, B, Hq, Hkv, D, Dv,
               f32 ? D : (D + 31) / 32 * 32, f32 ? (Dv + 15) / 16 * 16 : (Dv + 31) / 32 * 32,
               (D + 31) / 32, (Dv + 31) / 32 * 2, L, S, (L + QB - 1) / QB, (S + SB - 1) / SB, scale, cap, pieces,
               np, out_bf16, f32, 0, out, lse, 0, lse_lo};
    int e2;
    J.qs = f32 && scale != 0.0f && fabsf(scale) < INFINITY && fabsf(frexpf(scale, &e2)) == 0.5f;
    if (threads < 1) threads = 1;
    J.G = !f32 && (long long)B * Hq * ((J.nqb + GMAX - 1) / GMAX) >= 4LL * threads ? GMAX : 8;
    const long long nkv = (long long)B * Hkv, nqg = (J.nqb + J.G - 1) / J.G, per_kv = Hq / Hkv * nqg;
    const long long items = nkv * per_kv;
    const size_t ks = kpack_size(&J), vs = vpack_size(&J), per = (scratch_bytes(&J) + 63) / 64 * 64;
    /* Packed keys and values. With a (batch, kv head) for every thread, each thread packs the heads of
     * its run into one buffer of its own, a head at a time, before the head's first item: a 4k head, 1
     * MiB packed, stays in L2 for its items, and the buffers hold a head a thread, not every head (at
     * 64k keys, 8 heads, bfloat16: 32 MiB, not 128). Against packing every head before the items
     * (paired A/B, 4k, 16-60 rounds): float32 0.97x the time causal, 0.99x dense; bfloat16 0.99-1.00x.
     * With fewer heads than threads, the threads pack all of them first, each a share, into one buffer
     * the items read. Only the key blocks some piece reads are packed (a window over a long cache reads
     * the window's): the rest of a buffer is never touched, so the OS never maps it. */
    const int own = nkv >= threads;
    const long long nbuf = own ? threads : nkv;
    unsigned char *need = calloc((size_t)J.nkb, 1);
    char *kp = aligned_alloc(64, (size_t)(nbuf * J.nkb) * ks), *vp = aligned_alloc(64, (size_t)(nbuf * J.nkb) * vs);
    char *scratch = aligned_alloc(64, per * (size_t)threads);
    run_t *runs = aligned_alloc(64, sizeof(run_t) * (size_t)threads);
    if (!need || !kp || !vp || !scratch || !runs || items >= (1LL << 31)) {
        free(need); free(kp); free(vp); free(scratch); free(runs);
        return items >= (1LL << 31) ? -1 : -2;
    }
    for (int i = 0; i < np; i++)
        for (long long u = pieces[i].k0 / SB; u * SB < pieces[i].k1; u++) need[u] = 1;
#ifdef KF_AMX
    const tilecfg_t cfg = tiles16x64();
#endif
    #pragma omp parallel num_threads(threads)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8000);  /* flush to zero: P underflowing costs no microcode assist */
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        char *mem = scratch + per * (size_t)me;
        runs[me].v = nkv * me / nt * per_kv | (nkv * (me + 1) / nt * per_kv) << 32;  /* whole kv heads */
        if (own) {
            #pragma omp barrier
        } else {  /* every head packed first, then read by any thread */
            #pragma omp for schedule(static)
            for (long long t = 0; t < nkv * J.nkb; t++)
                if (need[t % J.nkb]) pack_block(&J, t, kp + (size_t)t * ks, vp + (size_t)t * vs);
        }
#ifdef KF_AMX
        if (!f32) _tile_loadconfig(&cfg);
#endif
        long long packed = -1;  /* the kv head in this thread's buffer */
        for (long long w; (w = next_item(runs, nt, me)) >= 0;) {
            const long long kv = w / per_kv;
            const long long slot = own ? me : kv;  /* the buffer the head is packed in */
            char *hk = kp + (size_t)(slot * J.nkb) * ks, *hv = vp + (size_t)(slot * J.nkb) * vs;
            if (own && kv != packed) {
                for (long long kb = 0; kb < J.nkb; kb++)
                    if (need[kb]) pack_block(&J, kv * J.nkb + kb, hk + (size_t)kb * ks, hv + (size_t)kb * vs);
                packed = kv;
            }
#ifdef KF_AMX
            if (!f32) {
                item_bf16(&J, w, mem, hk, hv);
                continue;
            }
#endif
            item_f32(&J, w, mem, hk, hv);
        }
#ifdef KF_AMX
        if (!f32) _tile_release();
#endif
        _mm_setcsr(csr);
    }
    free(runs);
    free(need);
    free(kp);
    free(vp);
    free(scratch);
    return 0;
#endif
}
