"""The Triton kernel source: forward (online softmax), dQ and dK/dV backward, in-kernel masks and scores."""

from ._env import _BIG, _jit, tl, triton

_BIG_K = tl.constexpr(_BIG) if triton is not None else _BIG


@_jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` in float32; IEEE float32 products for float32 inputs (no TF32 rounding)."""
    if IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@_jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``."""
    if IEEE:
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@_jit
def _tanh(x):
    # tanh without libdevice (the interpreter has none): the exp form, and its series near 0
    # where 1 - e^{-2|x|} would cancel.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.05, small, big)
    return tl.where(x < 0, -t, t)


@_jit
def _modify(x, SCORE: tl.constexpr, slope, cap, qp, kp):
    """The score modifier on natural-unit scores ``x``: returns ``(y, dy/dx)``."""
    dy = tl.full(x.shape, 1.0, tl.float32)
    if SCORE == 1:    # ALiBi
        y = x - slope * tl.abs(qp - kp).to(tl.float32)
    elif SCORE == 2:  # softcap
        t = _tanh(x / cap)
        y = cap * t
        dy = 1.0 - t * t
    elif SCORE == 3:  # softcap(x + alibi)
        t = _tanh((x - slope * tl.abs(qp - kp).to(tl.float32)) / cap)
        y = cap * t
        dy = 1.0 - t * t
    elif SCORE == 4:  # softcap(x) + alibi
        t = _tanh(x / cap)
        y = cap * t - slope * tl.abs(qp - kp).to(tl.float32)
        dy = 1.0 - t * t
    else:
        y = x
    return y, dy


@_jit
def _literal_value(OP: tl.constexpr, prm, aux, bits, b, h, slot, qp, kp, q0, k0, q_last, k_last,
                   TILE_N: tl.constexpr):
    """One literal (see ``_Op``) on broadcastable absolute positions ``qp`` and ``kp``."""
    if OP == 1:    # TRUE
        res = (qp >= -_BIG_K) | (kp >= -_BIG_K)
    elif OP == 2:  # CAUSAL
        res = kp <= qp
    elif OP == 3:  # WINDOW
        res = (kp >= qp - tl.load(prm)) & (kp <= qp + tl.load(prm + 1))
    elif OP == 4:  # SINKS
        res = (kp < tl.load(prm)) & (qp >= -_BIG_K)
    elif OP == 5:  # SINKS_BATCH
        n = tl.load(aux + tl.load(prm) + b * tl.load(prm + 1))
        res = (kp < n) & (qp >= -_BIG_K)
    elif OP == 6:  # DOCUMENTS; padding rows and columns read a valid id
        qc = tl.minimum(tl.maximum(qp, 0), q_last)
        kc = tl.minimum(tl.maximum(kp, 0), k_last)
        qid = tl.load(aux + tl.load(prm) + b * tl.load(prm + 2) + qc)
        kid = tl.load(aux + tl.load(prm + 1) + b * tl.load(prm + 3) + kc)
        res = qid == kid
    elif OP == 7:  # BLOCK_SPARSE
        bs = tl.load(prm + 1)
        qc = tl.minimum(tl.maximum(qp, 0), q_last)
        kc = tl.minimum(tl.maximum(kp, 0), k_last)
        cell = tl.load(aux + tl.load(prm) + h * tl.load(prm + 2) + (qc // bs) * tl.load(prm + 3) + kc // bs)
        res = cell != 0
    elif OP == 8:  # DILATED
        res = ((qp - kp) % tl.load(prm)) == 0
    else:          # TILE: a mask callable's values on this partial tile, evaluated on the host
        base = slot * tl.load(prm).to(tl.int64) + b * tl.load(prm + 1) + h * tl.load(prm + 2)
        res = tl.load(bits + base + (qp - q0) * TILE_N + (kp - k0)) != 0
    return res


@_jit
def _visible(PROG: tl.constexpr, NLIT: tl.constexpr, prm, aux, bits, b, h, slot, qp, kp, q0, k0,
             q_last, k_last, TILE_N: tl.constexpr):
    """The mask program on one tile: an OR of AND clauses, unrolled at compile time."""
    vis = (qp < -_BIG_K) & (kp < -_BIG_K)        # all false, tile-shaped
    clause = (qp >= -_BIG_K) | (kp >= -_BIG_K)   # all true
    for i in tl.static_range(NLIT):
        code = (PROG >> (8 * i)) & 255
        lit = _literal_value(code & 15, prm + 4 * i, aux, bits, b, h, slot, qp, kp, q0, k0,
                             q_last, k_last, TILE_N)
        if (code & 16) != 0:
            lit = lit == 0
        clause = clause & lit
        if (code & 32) != 0:
            vis = vis | clause
            clause = (qp >= -_BIG_K) | (kp >= -_BIG_K)
    return vis


@_jit
def _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, kb, slot, offs_d, offs_dv, qp, q0, b, h,
              Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
              MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """One (query block x key block) tile of the online softmax."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = offs_n < Nk
    kT = tl.load(Kb + offs_n[None, :] * skn + offs_d[:, None],
                 mask=kmask[None, :] & (offs_d[:, None] < D), other=0.0)        # (BD, BN)
    v = tl.load(Vb + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    s = _mm(q, kT, IEEE)                                                       # (BM, BN)
    if SCORE == 0:
        s = s * (sm_scale * 1.4426950408889634)
    else:
        y, dy = _modify(s * sm_scale, SCORE, slope, cap, qp[:, None], kp[None, :])
        s = y * 1.4426950408889634
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[:, None], kp[None, :], q0,
                       kv_offset + kb * BLOCK_N, q_last, k_last, BLOCK_N)
        s = tl.where(vis, s, float("-inf"))
    if not EVEN_N:
        s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@_jit
def _fwd_kernel(Q, K, V, O, LSE,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                p_ptr, p_col, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                Hq, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, batch*head): partial key blocks with the mask, then full ones."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # last (under causal: heaviest) blocks first
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < Nq
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    Kb = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    Vb = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    qp = q_offset + offs_m
    q0 = q_offset + qb * BLOCK_M
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    slope = tl.load(slopes + h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo = tl.load(p_ptr + qb)
    hi = tl.load(p_ptr + qb + 1)
    for t in range(lo, hi):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, tl.load(p_col + t), t, offs_d, offs_dv,
                                  qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                                  prm, aux, bits, True, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    lo = tl.load(f_ptr + qb)
    hi = tl.load(f_ptr + qb + 1)
    for t in range(lo, hi):  # runs of full key blocks: the inner loop has affine addresses
        for kb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, kb, t, offs_d, offs_dv,
                                      qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                                      prm, aux, bits, False, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    seen = l_i > 0.0  # a row that saw no key: out 0, lse -inf (never NaN)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    ob = b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(O + ob + offs_m[:, None] * som + offs_dv[None, :], out,
             mask=rmask[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=rmask)


@_jit
def _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, kb, slot, offs_d, offs_dv, qp, q0, b, h,
             Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
             MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
             BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """dQ of one tile: dS = P * (dO V^T - delta) * dy/dx, dQ += dS K."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = offs_n < Nk
    k = tl.load(Kb + offs_n[:, None] * skn + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BN, BD)
    v = tl.load(Vb + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    y, dy = _modify(_mm(q, tl.trans(k), IEEE) * sm_scale, SCORE, slope, cap, qp[:, None], kp[None, :])
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[:, None], kp[None, :], q0,
                       kv_offset + kb * BLOCK_N, q_last, k_last, BLOCK_N)
        y = tl.where(vis, y, float("-inf"))
    if not EVEN_N:
        y = tl.where(kmask[None, :], y, float("-inf"))
    p = tl.exp2(y * 1.4426950408889634 - lse2[:, None])                      # (BM, BN)
    dp = _mm(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    if SCORE >= 2:
        ds = ds * dy
    return _mma(ds.to(k.dtype), k, dq, IEEE)


@_jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                   p_ptr, p_col, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                   Hq, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                   PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, batch*head): dQ over the same key lists as the forward."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # last (under causal: heaviest) blocks first
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < Nq
    qbase = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    q = tl.load(Q + qbase + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=rmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)      # (BM, BDV)
    row = bh.to(tl.int64) * Nq + offs_m
    lse2 = tl.load(LSE + row, mask=rmask, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row, mask=rmask, other=0.0)
    Kb = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    Vb = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    qp = q_offset + offs_m
    q0 = q_offset + qb * BLOCK_M
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    slope = tl.load(slopes + h)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.load(p_ptr + qb)
    hi = tl.load(p_ptr + qb + 1)
    for t in range(lo, hi):
        dq = _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, tl.load(p_col + t), t, offs_d, offs_dv,
                      qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                      prm, aux, bits, True, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    lo = tl.load(f_ptr + qb)
    hi = tl.load(f_ptr + qb + 1)
    for t in range(lo, hi):
        for kb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
            dq = _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, kb, t, offs_d, offs_dv,
                          qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                          prm, aux, bits, False, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    tl.store(DQ + bh.to(tl.int64) * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq * sm_scale,
             mask=rmask[:, None] & (offs_d[None, :] < D))


@_jit
def _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSEb, DELTAb, sqm, sdm, qb, slot, offs_d, offs_dv,
               b, h, Nq, D, Dv, q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
               MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of one tile, computed transposed (keys as rows): dV += P^T dO, dK += dS^T Q."""
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_m < Nq
    q = tl.load(Qb + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    do = tl.load(DOb + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=rmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)      # (BM, BDV)
    lse2 = tl.load(LSEb + offs_m, mask=rmask, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTAb + offs_m, mask=rmask, other=0.0)
    qp = q_offset + offs_m
    yT, dyT = _modify(_mm(k, tl.trans(q), IEEE) * sm_scale, SCORE, slope, cap, qp[None, :], kp[:, None])
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[None, :], kp[:, None],
                       q_offset + qb * BLOCK_M, k0, q_last, k_last, BLOCK_N)
        yT = tl.where(vis, yT, float("-inf"))
    pT = tl.exp2(yT * 1.4426950408889634 - lse2[None, :])                    # (BN, BM)
    dv = _mma(pT.to(do.dtype), do, dv, IEEE)
    dsT = pT * (_mm(v, tl.trans(do), IEEE) - delta[None, :])
    if SCORE >= 2:
        dsT = dsT * dyT
    dk = _mma(dsT.to(q.dtype), q, dk, IEEE)
    return dk, dv


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                     p_ptr, p_row, p_slot, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                     Hq, Hkv, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                     PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):
    """Program (key block, batch*kv head): dK, dV summed over the GQA group's query heads."""
    kb = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kmask = offs_n < Nk
    k = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BN, BD)
    v = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    k0 = kv_offset + kb * BLOCK_N
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        slope = tl.load(slopes + h)
        Qb = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        DOb = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        row = (b.to(tl.int64) * Hq + h) * Nq
        lo = tl.load(p_ptr + kb)
        hi = tl.load(p_ptr + kb + 1)
        for t in range(lo, hi):
            dk, dv = _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSE + row, DELTA + row, sqm, sdm,
                                tl.load(p_row + t), tl.load(p_slot + t), offs_d, offs_dv, b, h, Nq, D, Dv,
                                q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
                                True, PROG, NLIT, SCORE, BLOCK_M, BLOCK_N, IEEE)
        lo = tl.load(f_ptr + kb)
        hi = tl.load(f_ptr + kb + 1)
        for t in range(lo, hi):
            for qb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
                dk, dv = _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSE + row, DELTA + row, sqm, sdm,
                                    qb, t, offs_d, offs_dv, b, h, Nq, D, Dv,
                                    q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
                                    False, PROG, NLIT, SCORE, BLOCK_M, BLOCK_N, IEEE)
    out = bhk.to(tl.int64) * Nk
    tl.store(DK + (out + offs_n[:, None]) * D + offs_d[None, :], dk * sm_scale,
             mask=kmask[:, None] & (offs_d[None, :] < D))
    tl.store(DV + (out + offs_n[:, None]) * Dv + offs_dv[None, :], dv,
             mask=kmask[:, None] & (offs_dv[None, :] < Dv))


# ============================================================================ host side
