"""Flash attention forward and backward in plain Triton (the FlashAttention-2 algorithm).

Pointer loads only (no TMA, no warp specialisation), so the same kernels compile for NVIDIA GPUs
and for ROCm. Semantics are the ``attention`` op's (turbo_dispatch/ops/attention.py):

* layouts: dense ``[B, S, H, D]`` or packed varlen ``[T, H, D]`` with int32 ``cu_seqlens``
  (``VARLEN``); any strides (each launcher passes them);
* GQA/MQA: query head ``h`` reads kv head ``h // GROUP``;
* masks aligned to the bottom-right corner: query ``i`` of a sequence with ``sq`` queries and
  ``sk`` keys may attend key ``j`` when ``i + sk - sq - LEFT <= j <= i + sk - sq + RIGHT``, each
  side only where ``HAS_LEFT`` / ``HAS_RIGHT`` (causal is ``RIGHT = 0``);
* the lse is the natural-log log-sum-exp of the scaled scores, float32, ``[B, H, Sq]`` dense or
  ``[H, Tq]`` varlen; a row that may attend no key gets out = 0, lse = -inf and zero gradients;
* attention sinks (``HAS_SINK``): a float logit ``SINK[h]`` per query head joins every row's
  softmax denominator and contributes no value, so the lse includes it and a row that may attend
  no key gets out = 0 and lse = ``SINK[h]``;
* fp8 (``FP8``): q, k, v arrive as float8 e4m3 with float32 dequantisation scales (``QS``, ``KS``,
  ``VS``, ``[B, H, blocks]``), one per ``SCALE_BLOCK`` tokens of one head (a per-tensor scale is
  a one-element tensor with zero strides and a ``SCALE_BLOCK`` longer than any sequence).

Forward (``attn_fwd_kernel``): one program per (query block, batch x head); online softmax over
key blocks in the exp2 domain (scores times ``scale * log2(e)``), fp32 accumulation. Only the key
blocks a query block may attend are visited, split in three runs (``_block_span``): masked blocks
at the low edge, whole blocks that need no mask, masked blocks at the high edge (the diagonal and
the sequence end). Head dims that are not powers of two are padded to the next one (at least 16,
tl.dot's minimum) with masked loads. With a sink, the online softmax starts from the sink's
term (running max = the sink, running sum = 1) instead of an empty sum, which costs nothing per
key block. Under ``FP8`` both products run on fp8 operands with fp32 accumulation: the scores are
dequantised by the q scale of each row and the k scale of the key block, and the probabilities
(at most 1) are quantised to e4m3 times ``P_SCALE`` (the e4m3 maximum) for the PV product, whose
result is scaled back by the v scale of the key block over ``P_SCALE``; a key block must lie in
one scale block and fp8 dots reduce over at least 32 elements (``32 <= BLOCK_N``, ``BLOCK_N``
divides ``SCALE_BLOCK``, ``BLOCK_DQK >= 32``: the launcher's guarantees).

Backward, deterministic by construction (no atomics):

* ``attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` and the lse turned into the exp2
  domain with +inf on empty rows (so ``exp2(s - lse2)`` is 0 there);
* ``attn_bwd_dkdv_kernel``: one program per (key block, batch x kv head x split); it loops over
  the query heads of its GQA group (a share of them when the group is split over programs, whose
  partial sums the launcher adds in a fixed order) and over the query blocks that may attend its
  keys, accumulating dK and dV in fp32 registers;
* ``attn_bwd_dq_kernel``: one program per (query block, batch x head), looping over key blocks.

The backward kernels know nothing of sinks: a sink changes only the lse, and the probabilities
``exp2(s - lse2)`` they recompute already carry its share of each row's denominator. The sink's
own gradient is a per-head reduction of ``exp(sink - lse) * delta`` (the launcher's, in torch).

``UPCAST`` converts dot operands to fp32 first; the launcher sets it only under the Triton
interpreter, whose bf16 ``tl.dot`` is wrong (triton 3.9, CPU).
"""
from __future__ import annotations

from .interpret import interpreting  # noqa: F401  (the adapter asks AK.interpreting())

try:  # Triton stays optional: this module imports without it, and the adapter's available() says why.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

#: Bumped whenever a kernel's code changes, so stored tuning results are invalidated.
KERNEL_REVISION = "attn-r2"

#: log2(e): the kernels work in the exp2 domain, so the launcher folds it into the softmax scale.
LOG2E = 1.4426950408889634
#: The largest float8 e4m3 (OCP ``float8_e4m3fn``) value: fp8 probabilities are stored times this.
P_SCALE = 448.0


if triton is not None:

    @triton.jit
    def _mm(a, b, acc, UPCAST: tl.constexpr):
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc)

    @triton.jit
    def _sequence(CU, b, SEQ, VARLEN: tl.constexpr):
        """(first token, length) of sequence ``b``: from ``CU`` (varlen) or ``(0, SEQ)``."""
        if VARLEN:
            start = tl.load(CU + b)
            length = tl.load(CU + b + 1) - start
        else:
            start = b * 0
            length = SEQ + b * 0
        return start, length

    @triton.jit
    def _tile(base, first, offs, rows_ok, stride_s, stride_d, D: tl.constexpr, BLOCK_D: tl.constexpr,
              MASK_ROWS: tl.constexpr):
        """Rows ``first + offs`` of one head's [S, D] slice starting at ``base``, as a
        [rows, BLOCK_D] tile with zeros past D (and in rows not ``rows_ok`` where MASK_ROWS). An
        unmasked dimension stays out of the mask, so the loads stay vectorised."""
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + first * stride_s + offs[:, None] * stride_s + cols[None, :] * stride_d
        if MASK_ROWS:
            if BLOCK_D != D:
                x = tl.load(ptrs, mask=rows_ok[:, None] & (cols[None, :] < D), other=0.0)
            else:
                x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            if BLOCK_D != D:
                x = tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
            else:
                x = tl.load(ptrs)
        return x

    @triton.jit
    def _store_tile(base, first, offs, rows_ok, x, stride_s, stride_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """``x`` (cast to the destination's type) into the rows of ``_tile``'s addressing."""
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + first * stride_s + offs[:, None] * stride_s + cols[None, :] * stride_d
        x = x.to(base.dtype.element_ty)
        if BLOCK_D != D:
            tl.store(ptrs, x, mask=rows_ok[:, None] & (cols[None, :] < D))
        else:
            tl.store(ptrs, x, mask=rows_ok[:, None])

    @triton.jit
    def _head(ptr, b64, h64, stride_b, stride_h):
        """One (batch, head) slice of a dense [B, S, H, D] or packed [T, H, D] tensor (stride_b 0)."""
        return ptr + b64 * stride_b + h64 * stride_h

    @triton.jit
    def _block_span(a0, a_last, len_b, shift, lo_w, hi_w, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                    BLOCK: tl.constexpr):
        """The blocks along axis B that the rows ``a0..a_last`` of axis A meet, when row ``a`` may
        meet ``b`` iff ``a + shift - lo_w <= b <= a + shift + hi_w`` (each side only where HAS_*)
        and ``0 <= b < len_b``. Returns ``(start, full_start, full_end, end)``: blocks starting in
        [start, full_start) and [full_end, end) need the element mask; those in
        [full_start, full_end) lie wholly inside every row's range and inside ``len_b``. All block
        starts are ``start + k * BLOCK``; an empty range gives no whole blocks."""
        lo = a0 * 0
        full_lo = a0 * 0
        if HAS_LO:
            lo = tl.maximum(a0 + shift - lo_w, 0)
            full_lo = tl.maximum(a_last + shift - lo_w, 0)
        hi = len_b + a0 * 0
        full_hi = len_b + a0 * 0
        if HAS_HI:
            hi = tl.minimum(a_last + shift + hi_w + 1, len_b)
            full_hi = tl.minimum(a0 + shift + hi_w + 1, len_b)
        hi = tl.maximum(hi, lo)
        start = (lo // BLOCK) * BLOCK
        end_aligned = start + tl.cdiv(hi - start, BLOCK) * BLOCK
        full_start = tl.minimum(start + tl.cdiv(full_lo - start, BLOCK) * BLOCK, end_aligned)
        full_end = full_start + (tl.maximum(full_hi - full_start, 0) // BLOCK) * BLOCK
        return start, full_start, full_end, hi

    @triton.jit
    def _part(PART: tl.constexpr, start, full_start, full_end, end):
        """Block starts of run PART of a ``_block_span``: 0 and 2 the masked edges, 1 the whole blocks."""
        lo = start
        hi = full_start
        if PART == 1:
            lo = full_start
            hi = full_end
        if PART == 2:
            lo = full_end
            hi = end
        return lo, hi

    @triton.jit
    def _query_program(CU_Q, CU_K, SEQ_Q, SEQ_K, HEADS_Q, GROUP, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
                       REVERSE: tl.constexpr):
        """(batch, head, kv head, first query token, sq, first key token, sk, first row of the block)
        of this program of a ``(batch * heads_q, query blocks)`` grid; ``REVERSE`` walks the query
        blocks last-first (causal: the longest first)."""
        bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        if REVERSE:
            pid_m = tl.num_programs(1) - 1 - pid_m
        b = bh // HEADS_Q
        h = bh % HEADS_Q
        q_start, sq = _sequence(CU_Q, b, SEQ_Q, VARLEN)
        k_start, sk = _sequence(CU_K, b, SEQ_K, VARLEN)
        return b, h, h // GROUP, q_start, sq, k_start, sk, pid_m * BLOCK_M

    @triton.jit
    def _query_block(Q, K, V, b, h, hk, q_start, sq, k_start, m0, stride_qb, stride_qs, stride_qh, stride_qd,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, D_QK: tl.constexpr,
                     BLOCK_DQK: tl.constexpr, BLOCK_M: tl.constexpr):
        """What a query-block program of the forward and of the dQ kernel starts from:
        ``(offs_m, rows, rows_ok, b64, h64, hk64, first, q, k_base, v_base)``: the block's row
        offsets and positions, which of them are real, the int64 batch/head indices, its first
        token, its q tile, and where its sequence's keys and values start."""
        offs_m = tl.arange(0, BLOCK_M)
        rows = m0 + offs_m
        rows_ok = rows < sq
        b64, h64, hk64 = tl.cast(b, tl.int64), tl.cast(h, tl.int64), tl.cast(hk, tl.int64)
        first = tl.cast(q_start + m0, tl.int64)
        q = _tile(_head(Q, b64, h64, stride_qb, stride_qh), first, offs_m, rows_ok, stride_qs, stride_qd, D_QK,
                  BLOCK_DQK, True)
        k_base = _head(K, b64, hk64, stride_kb, stride_kh) + tl.cast(k_start, tl.int64) * stride_ks
        v_base = _head(V, b64, hk64, stride_vb, stride_vh) + tl.cast(k_start, tl.int64) * stride_vs
        return offs_m, rows, rows_ok, b64, h64, hk64, first, q, k_base, v_base

    @triton.jit
    def _query_key_span(m0, sq, sk, LEFT, RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``(shift, start, full_start, full_end, end)``: sk - sq, and the key blocks that the
        query rows of the block starting at ``m0`` meet (see ``_block_span``)."""
        shift = sk - sq
        m_last = tl.minimum(m0 + BLOCK_M, sq) - 1
        start, full_start, full_end, end = _block_span(m0, m_last, sk, shift, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                                                       BLOCK_N)
        return shift, start, full_start, full_end, end

    @triton.jit
    def _allowed(i, j, len_j, shift, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """May query position ``i`` attend key position ``j`` (broadcast shapes; ``shift`` = sk - sq)."""
        ok = j < len_j
        if HAS_RIGHT:
            ok = ok & (j - i <= shift + right)
        if HAS_LEFT:
            ok = ok & (j - i >= shift - left)
        return ok

    # -- forward ------------------------------------------------------------------------------------
    @triton.jit
    def _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, rows, sk, shift,
                    left, right, lo, hi, qk_scale, ks_base, vs_base, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
                    SCALE_BLOCK: tl.constexpr):
        """Online softmax over the key blocks starting in [lo, hi). ``qk_scale`` is a scalar, or
        under FP8 a per-row vector (softmax scale x log2(e) x the row's q scale); ``ks_base`` /
        ``vs_base`` point at this head's k / v scales (FP8 only)."""
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + offs_n
            keys_ok = keys < sk
            n_off = tl.cast(n0, tl.int64)
            k = _tile(k_base, n_off, offs_n, keys_ok, stride_ks, stride_kd, D_QK, BLOCK_DQK, MASKED)
            if FP8:
                s = _mm(q, tl.trans(k), None, False) * (qk_scale * tl.load(ks_base + n0 // SCALE_BLOCK))[:, None]
            else:
                s = _mm(q, tl.trans(k), None, UPCAST) * qk_scale
            if MASKED:
                ok = _allowed(rows[:, None], keys[None, :], sk, shift, left, right, HAS_LEFT, HAS_RIGHT)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASKED:  # a row with no key yet keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(v_base, n_off, offs_n, keys_ok, stride_vs, stride_vd, D_V, BLOCK_DV, MASKED)
            if FP8:  # 448.0 is P_SCALE (a global would have to be a constexpr, which needs triton)
                pv = tl.dot((p * 448.0).to(v.dtype), v)
                acc = acc * alpha[:, None] + pv * (tl.load(vs_base + n0 // SCALE_BLOCK) / 448.0)
            else:
                acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def attn_fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, SINK, QS, KS, VS,
                        stride_qb, stride_qs, stride_qh, stride_qd,
                        stride_kb, stride_ks, stride_kh, stride_kd,
                        stride_vb, stride_vs, stride_vh, stride_vd,
                        stride_ob, stride_os, stride_oh, stride_od,
                        stride_lb, stride_lh,
                        stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                        SEQ_Q, SEQ_K, HEADS_Q, GROUP, qk_scale, LEFT, RIGHT,
                        VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr,
                        UPCAST: tl.constexpr, HAS_SINK: tl.constexpr, FP8: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr):
        """Grid ``(batch * heads_q, cdiv(max seqlen_q, BLOCK_M))``. ``qk_scale`` is the softmax
        scale times log2(e). ``SINK`` (read where HAS_SINK) holds one logit per query head;
        ``QS``/``KS``/``VS`` and their strides are read under FP8 only."""
        b, h, hk, q_start, sq, k_start, sk, m0 = _query_program(CU_Q, CU_K, SEQ_Q, SEQ_K, HEADS_Q, GROUP, BLOCK_M,
                                                                VARLEN, REVERSE)
        if m0 >= sq:
            return
        offs_m, rows, rows_ok, b64, h64, hk64, first, q, k_base, v_base = _query_block(
            Q, K, V, b, h, hk, q_start, sq, k_start, m0, stride_qb, stride_qs, stride_qh, stride_qd, stride_kb,
            stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, D_QK, BLOCK_DQK, BLOCK_M)
        ks_base = KS
        vs_base = VS
        scale = qk_scale
        if FP8:
            ks_base = _head(KS, b64, hk64, stride_ksb, stride_ksh)
            vs_base = _head(VS, b64, hk64, stride_vsb, stride_vsh)
            q_scales = tl.load(_head(QS, b64, h64, stride_qsb, stride_qsh) + rows // SCALE_BLOCK, mask=rows_ok,
                               other=0.0)
            scale = qk_scale * q_scales

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        if HAS_SINK:  # the sink's term opens the running sum: max = the sink, sum = exp2(0) = 1
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        shift, start, full_start, full_end, end = _query_key_span(m0, sq, sk, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                                                                  BLOCK_M, BLOCK_N)
        for part in tl.static_range(3):
            lo, hi = _part(part, start, full_start, full_end, end)
            acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                        rows, sk, shift, LEFT, RIGHT, lo, hi, scale, ks_base, vs_base, part != 1,
                                        HAS_LEFT, HAS_RIGHT, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_N, UPCAST, FP8,
                                        SCALE_BLOCK)

        attended = l_i > 0.0
        l_safe = tl.where(attended, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(attended, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        _store_tile(_head(O, b64, h64, stride_ob, stride_oh), first, offs_m, rows_ok, out, stride_os, stride_od, D_V,
                    BLOCK_DV)
        tl.store(_head(LSE, b64, h64, stride_lb, stride_lh) + tl.cast(q_start, tl.int64) + rows, lse, mask=rows_ok)

    # -- backward -----------------------------------------------------------------------------------
    @triton.jit
    def attn_bwd_preprocess_kernel(O, DO, LSE, LSE2, DELTA, CU_Q,
                                   stride_ob, stride_os, stride_oh, stride_od,
                                   stride_gb, stride_gs, stride_gh, stride_gd,
                                   stride_lb, stride_lh,
                                   SEQ_Q, HEADS_Q, VARLEN: tl.constexpr, D_V: tl.constexpr,
                                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
        """``DELTA = rowsum(dO * O)`` and ``LSE2 = lse * log2(e)`` (+inf where lse is -inf), both
        in the lse's layout (``LSE``, ``LSE2`` and ``DELTA`` share strides). Grid as the forward's."""
        b, h, _, q_start, sq, _, _, m0 = _query_program(CU_Q, CU_Q, SEQ_Q, SEQ_Q, HEADS_Q, 1, BLOCK_M, VARLEN, False)
        if m0 >= sq:
            return
        offs_m = tl.arange(0, BLOCK_M)
        rows = m0 + offs_m
        rows_ok = rows < sq
        b64, h64 = tl.cast(b, tl.int64), tl.cast(h, tl.int64)
        first = tl.cast(q_start + m0, tl.int64)
        o = _tile(_head(O, b64, h64, stride_ob, stride_oh), first, offs_m, rows_ok, stride_os, stride_od, D_V,
                  BLOCK_DV, True)
        do = _tile(_head(DO, b64, h64, stride_gb, stride_gh), first, offs_m, rows_ok, stride_gs, stride_gd, D_V,
                   BLOCK_DV, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        l_off = b64 * stride_lb + h64 * stride_lh + tl.cast(q_start, tl.int64) + rows
        lse = tl.load(LSE + l_off, mask=rows_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        tl.store(LSE2 + l_off, lse2, mask=rows_ok)
        tl.store(DELTA + l_off, delta, mask=rows_ok)

    @triton.jit
    def _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, stride_qs, stride_qd, stride_gs, stride_gd, keys, sq,
                     shift, left, right, lo, hi, qk_scale, LSE2, DELTA, MASKED: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
                     BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                     UPCAST: tl.constexpr):
        """dK/dV contributions of the query blocks starting in [lo, hi), in the transposed
        orientation (scores as [keys, queries])."""
        offs_m = tl.arange(0, BLOCK_M)
        for m0 in range(lo, hi, BLOCK_M):
            rows = m0 + offs_m
            rows_ok = rows < sq
            m_off = tl.cast(m0, tl.int64)
            q = _tile(q_base, m_off, offs_m, rows_ok, stride_qs, stride_qd, D_QK, BLOCK_DQK, MASKED)
            do = _tile(do_base, m_off, offs_m, rows_ok, stride_gs, stride_gd, D_V, BLOCK_DV, MASKED)
            if MASKED:
                lse2 = tl.load(LSE2 + l_base + rows, mask=rows_ok, other=float("inf"))
                delta = tl.load(DELTA + l_base + rows, mask=rows_ok, other=0.0)
            else:
                lse2 = tl.load(LSE2 + l_base + rows)
                delta = tl.load(DELTA + l_base + rows)
            st = _mm(k, tl.trans(q), None, UPCAST) * qk_scale
            pt = tl.math.exp2(st - lse2[None, :])
            if MASKED:
                ok = _allowed(rows[None, :], keys[:, None], 2147483647, shift, left, right, HAS_LEFT, HAS_RIGHT)
                pt = tl.where(ok & rows_ok[None, :], pt, 0.0)
            dv = _mm(pt.to(do.dtype), do, dv, UPCAST)
            dpt = _mm(v, tl.trans(do), None, UPCAST)
            dst = pt * (dpt - delta[None, :])
            dk = _mm(dst.to(q.dtype), q, dk, UPCAST)
        return dk, dv

    @triton.jit
    def attn_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE2, DELTA, CU_Q, CU_K,
                             stride_qb, stride_qs, stride_qh, stride_qd,
                             stride_kb, stride_ks, stride_kh, stride_kd,
                             stride_vb, stride_vs, stride_vh, stride_vd,
                             stride_gb, stride_gs, stride_gh, stride_gd,
                             stride_dkp, stride_dkb, stride_dks, stride_dkh, stride_dkd,
                             stride_dvp, stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                             stride_lb, stride_lh,
                             SEQ_Q, SEQ_K, HEADS_KV, GROUP, SPLITS, qk_scale, sm_scale, LEFT, RIGHT,
                             VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                             D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                             BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             UPCAST: tl.constexpr):
        """Grid ``(batch * heads_kv * SPLITS, cdiv(max seqlen_k, BLOCK_N))``. Program split ``s``
        of a kv head sums the query heads ``s, s + SPLITS, ...`` of its group and writes its
        partial dK/dV at ``DK + s * stride_dkp`` (``SPLITS`` = 1: the gradients themselves)."""
        pid = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = pid % SPLITS
        bh = pid // SPLITS
        b = bh // HEADS_KV
        hk = bh % HEADS_KV
        q_start, sq = _sequence(CU_Q, b, SEQ_Q, VARLEN)
        k_start, sk = _sequence(CU_K, b, SEQ_K, VARLEN)
        n0 = pid_n * BLOCK_N
        if n0 >= sk:
            return
        offs_n = tl.arange(0, BLOCK_N)
        keys = n0 + offs_n
        keys_ok = keys < sk
        b64, hk64 = tl.cast(b, tl.int64), tl.cast(hk, tl.int64)
        first_k = tl.cast(k_start + n0, tl.int64)
        k = _tile(_head(K, b64, hk64, stride_kb, stride_kh), first_k, offs_n, keys_ok, stride_ks, stride_kd, D_QK,
                  BLOCK_DQK, True)
        v = _tile(_head(V, b64, hk64, stride_vb, stride_vh), first_k, offs_n, keys_ok, stride_vs, stride_vd, D_V,
                  BLOCK_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        shift = sk - sq
        n_last = tl.minimum(n0 + BLOCK_N, sk) - 1
        # Rows that may attend keys n0..n_last: the forward's span seen from the keys' side.
        start, full_start, full_end, end = _block_span(n0, n_last, sq, -shift, RIGHT, LEFT, HAS_RIGHT, HAS_LEFT,
                                                       BLOCK_M)
        q_first = tl.cast(q_start, tl.int64)
        for g in range(split, GROUP, SPLITS):
            h64 = hk64 * GROUP + g
            q_base = _head(Q, b64, h64, stride_qb, stride_qh) + q_first * stride_qs
            do_base = _head(DO, b64, h64, stride_gb, stride_gh) + q_first * stride_gs
            l_base = b64 * stride_lb + h64 * stride_lh + q_first
            for part in tl.static_range(3):
                lo, hi = _part(part, start, full_start, full_end, end)
                dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, l_base, stride_qs, stride_qd, stride_gs,
                                      stride_gd, keys, sq, shift, LEFT, RIGHT, lo, hi, qk_scale, LSE2, DELTA, part != 1,
                                      HAS_LEFT, HAS_RIGHT, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, UPCAST)
        split64 = tl.cast(split, tl.int64)
        _store_tile(_head(DK, b64, hk64, stride_dkb, stride_dkh) + split64 * stride_dkp, first_k, offs_n, keys_ok,
                    dk * sm_scale, stride_dks, stride_dkd, D_QK, BLOCK_DQK)
        _store_tile(_head(DV, b64, hk64, stride_dvb, stride_dvh) + split64 * stride_dvp, first_k, offs_n, keys_ok,
                    dv, stride_dvs, stride_dvd, D_V, BLOCK_DV)

    @triton.jit
    def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, rows, sk,
                   shift, left, right, lo, hi, qk_scale, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        """dQ contributions of the key blocks starting in [lo, hi)."""
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + offs_n
            keys_ok = keys < sk
            n_off = tl.cast(n0, tl.int64)
            k = _tile(k_base, n_off, offs_n, keys_ok, stride_ks, stride_kd, D_QK, BLOCK_DQK, MASKED)
            v = _tile(v_base, n_off, offs_n, keys_ok, stride_vs, stride_vd, D_V, BLOCK_DV, MASKED)
            s = _mm(q, tl.trans(k), None, UPCAST) * qk_scale
            p = tl.math.exp2(s - lse2[:, None])
            if MASKED:
                ok = _allowed(rows[:, None], keys[None, :], sk, shift, left, right, HAS_LEFT, HAS_RIGHT)
                p = tl.where(ok, p, 0.0)
            dp = _mm(do, tl.trans(v), None, UPCAST)
            ds = p * (dp - delta[:, None])
            dq = _mm(ds.to(k.dtype), k, dq, UPCAST)
        return dq

    @triton.jit
    def attn_bwd_dq_kernel(Q, K, V, DO, DQ, LSE2, DELTA, CU_Q, CU_K,
                           stride_qb, stride_qs, stride_qh, stride_qd,
                           stride_kb, stride_ks, stride_kh, stride_kd,
                           stride_vb, stride_vs, stride_vh, stride_vd,
                           stride_gb, stride_gs, stride_gh, stride_gd,
                           stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                           stride_lb, stride_lh,
                           SEQ_Q, SEQ_K, HEADS_Q, GROUP, qk_scale, sm_scale, LEFT, RIGHT,
                           VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                           D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr,
                           UPCAST: tl.constexpr):
        """Grid ``(batch * heads_q, cdiv(max seqlen_q, BLOCK_M))``, as the forward's."""
        b, h, hk, q_start, sq, k_start, sk, m0 = _query_program(CU_Q, CU_K, SEQ_Q, SEQ_K, HEADS_Q, GROUP, BLOCK_M,
                                                                VARLEN, REVERSE)
        if m0 >= sq:
            return
        offs_m, rows, rows_ok, b64, h64, hk64, first, q, k_base, v_base = _query_block(
            Q, K, V, b, h, hk, q_start, sq, k_start, m0, stride_qb, stride_qs, stride_qh, stride_qd, stride_kb,
            stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, D_QK, BLOCK_DQK, BLOCK_M)
        do = _tile(_head(DO, b64, h64, stride_gb, stride_gh), first, offs_m, rows_ok, stride_gs, stride_gd, D_V,
                   BLOCK_DV, True)
        l_off = b64 * stride_lb + h64 * stride_lh + tl.cast(q_start, tl.int64) + rows
        lse2 = tl.load(LSE2 + l_off, mask=rows_ok, other=float("inf"))
        delta = tl.load(DELTA + l_off, mask=rows_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
        shift, start, full_start, full_end, end = _query_key_span(m0, sq, sk, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
                                                                  BLOCK_M, BLOCK_N)
        for part in tl.static_range(3):
            lo, hi = _part(part, start, full_start, full_end, end)
            dq = _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd, rows,
                            sk, shift, LEFT, RIGHT, lo, hi, qk_scale, part != 1, HAS_LEFT, HAS_RIGHT, D_QK, D_V,
                            BLOCK_DQK, BLOCK_DV, BLOCK_N, UPCAST)
        _store_tile(_head(DQ, b64, h64, stride_dqb, stride_dqh), first, offs_m, rows_ok, dq * sm_scale, stride_dqs,
                    stride_dqd, D_QK, BLOCK_DQK)
