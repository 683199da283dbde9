"""AITER adapter for grouped_gemm (bf16/fp16): AITER's Triton grouped GEMMs, ``aiter.ops.triton.gmm``.

* forward / dgrad (fixed K): ``gmm(lhs, rhs, group_sizes, preferred_element_type=dtype)``, out
  ``[M, N]`` with ``out[rows of group g] = lhs[rows of group g] @ rhs[g]``. ``lhs`` must be
  row-major ``[M, K]``. ``rhs`` is taken in one of the library's documented layouts: ``[G, K, N]``
  row-major, or (trans_b) the ``[G, K, N]`` view of a row-major ``[G, N, K]`` weight (its
  "transposed layout 1", strides ``(K*N, 1, K)``). The library tells its layouts apart by shape and
  strides and cannot when K == N for a row-major ``[G, K, N]`` weight (it matches two layouts and
  is rejected), so that one case hands over a column-major copy of the weight instead.
* wgrad (variable K): ``ptgmm`` (persistent) or ``nptgmm`` (one program per tile), the two
  configs, with ``lhs`` the ``[P, T]`` column-major view of our token-major ``x [T, P]`` (again the
  library's unambiguous "transposed layout 1") and ``rhs = y [T, Q]`` row-major; out
  ``[G, P, Q]``. An empty group gets zeros (the kernel stores a zero accumulator for it).

Both read ``group_sizes`` (our int64 ``group_lens``) on the device: no host sync. The library
asserts a non-empty problem, so zero tokens return an empty (fixed K) or zero (wgrad) result here
without calling it. Kernel tiles come from AITER's per-arch tables (gfx942/gfx950-GMM.json).

Contract-tested against a stand-in ``aiter`` (tests/test_rocm_adapters.py); not run on AMD hardware.
"""
from __future__ import annotations

from . import library
from .base import AiterAdapter

_GMM = "ops.triton.gmm"
_FIXED_CONFIGS = ("gmm", "gmm_work_stealing")
_WGRAD_CONFIGS = ("ptgmm", "nptgmm")


class AiterGroupedGemm(AiterAdapter):
    """bf16/fp16 grouped GEMM through ``aiter.ops.triton.gmm`` (gmm; ptgmm / nptgmm for the wgrad)."""

    entry_points = ((_GMM, "gmm"), (_GMM, "ptgmm"), (_GMM, "nptgmm"))

    def supports(self, p) -> str | None:
        return self.platform_reason(p) or self.half_reason(p.dtype, "AITER's gmm")

    def configs(self, p) -> list[str]:
        return list(_WGRAD_CONFIGS if p.variable_k else _FIXED_CONFIGS)

    def describe(self, p) -> str:
        if p.variable_k:
            return "aiter.ops.triton.gmm.ptgmm / nptgmm (wgrad), group sizes read on the device"
        copy = "; K == N: the weight is copied column-major" if p.k == p.n and not p.trans_b else ""
        return f"aiter.ops.triton.gmm.gmm (persistent), group sizes read on the device{copy}"

    def run(self, p, a, b, group_lens, group_offs=None, config=None):
        names = self.configs(p)
        name = names[0] if config is None else config
        if name not in names:
            raise ValueError(f"{type(self).__name__}: unknown config {config!r}; valid: {', '.join(names)}")
        if p.variable_k:
            if p.k == 0:
                return a.new_zeros((p.g, p.m, p.n))
            lhs = a.contiguous().t()  # [P, T], strides (1, P)
            return library.call(_GMM, name)(lhs, b.contiguous(), group_lens, preferred_element_type=p.dtype)
        if p.m == 0:
            return a.new_empty((0, p.n))
        if p.trans_b:
            rhs = b.contiguous().transpose(1, 2)  # [G, K, N], strides (K*N, 1, K)
        elif p.k == p.n:
            rhs = b.transpose(1, 2).contiguous().transpose(1, 2)  # the same [G, K, N], column-major
        else:
            rhs = b.contiguous()
        return library.call(_GMM, "gmm")(a.contiguous(), rhs, group_lens, preferred_element_type=p.dtype,
                                         work_stealing=name == "gmm_work_stealing")
