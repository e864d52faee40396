/* What keyfold's two decode kernels (decode.c, AVX-512; decode_avx2.c, AVX2) share: the merge of a head's
 * key chunks into (out, lse), plain C (docs/math.md: lse = M + log L, out = sum_c exp(m_c - M) acc_c / L
 * with M = max_c m_c and L = sum_c exp(m_c - M) l_c). lse is written in double, M + log L summed there:
 * rounded to float32 it would carry 2^-24 |lse| (4e-6 at lse 65), a rounding the naive attention never
 * makes, and a caller that merges this state with others' (split-KV, a window's sinks and band, a
 * cascade's prefix) weighs this state's out by exp(lse - lse_total): out would carry it too. */
#ifndef KEYFOLD_DECODE_MERGE_H
#define KEYFOLD_DECODE_MERGE_H
#include <math.h>
#include <stddef.h>
#include <string.h>

/* BH heads of R rows over C chunks: chunk c of row r of head bh has its running max (double: exact scores'
 * maxima are doubles; float32 ones are exact in it) and sum at m[i],
 * l[i] and its accumulator at acc + i * P (P floats a row, P >= Dv), i = (bh * C + c) * R + r; out
 * (BH, R, Dv) and lse (BH, R), float64. A chunk of no keys (m = -inf, l = 0) is skipped; any other, NaN included,
 * takes part, so a NaN or +inf score reaches out and lse as NaN. A row that saw no key in any chunk
 * (masked, or every score -inf) gets out 0 and lse -inf. */
static void merge_chunks(int BH, int R, int C, int Dv, int P, const double *m, const float *l, const float *acc,
                         float *out, double *lse) {
    for (int bh = 0; bh < BH; bh++)
        for (int r = 0; r < R; r++) {
            double M = -INFINITY;
            float L = 0.0f;
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)(bh * C + c) * R + r;
                if (l[i] == 0.0f && m[i] == -INFINITY) continue;
                if (isnan(m[i]) || isnan(l[i])) M = NAN;
                else if (m[i] > M) M = m[i];
            }
            float *o = out + ((size_t)bh * R + r) * Dv;
            memset(o, 0, sizeof(float) * Dv);
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)(bh * C + c) * R + r;
                if (l[i] == 0.0f && m[i] == -INFINITY) continue;
                const float f = (float)exp(m[i] - M);
                const float *a = acc + i * P;
                L += f * l[i];
                for (int d = 0; d < Dv; d++) o[d] += f * a[d];
            }
            if (L == 0.0f && M == -INFINITY) {
                lse[(size_t)bh * R + r] = -INFINITY;
                continue;
            }
            const float inv = 1.0f / L;
            for (int d = 0; d < Dv; d++) o[d] *= inv;
            lse[(size_t)bh * R + r] = M + log((double)L);
        }
}
#endif
