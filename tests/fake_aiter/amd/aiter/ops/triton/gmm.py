"""Stand-in for ``aiter.ops.triton.gmm``: gmm, ptgmm and nptgmm with the library's layout rules
(aiter/ops/triton/utils/gmm_common.py): layouts are told apart by shape and strides, and a
layout that matches two of them (K == N, or K == M for the TGMMs) is rejected."""
import torch

from aiter import CALLS

_DTYPES = (torch.float16, torch.bfloat16)


def _check_inputs(lhs, rhs, group_sizes, out_dtype):
    assert lhs.dtype == rhs.dtype and lhs.dtype in _DTYPES, f"lhs/rhs must be fp16/bf16 alike; got {lhs.dtype}, {rhs.dtype}"
    assert group_sizes.dtype in (torch.int32, torch.int64) and group_sizes.dim() == 1
    assert out_dtype in _DTYPES


def _bounds(group_sizes):
    sizes = group_sizes.tolist()
    assert all(s >= 0 for s in sizes), "group sizes must be non-negative"
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    return starts


def gmm(lhs, rhs, group_sizes, bias=None, preferred_element_type=torch.bfloat16, existing_out=None,
        work_stealing=False, config=None, grid_dim=None):
    """out[M, N]: out[rows of g] = lhs[rows of g] @ rhs[g]; lhs row-major [M, K]; rhs [G, K, N]
    row-major, [G, K, N] strides (K*N, 1, K), or [G, N, K] row-major."""
    _check_inputs(lhs, rhs, group_sizes, preferred_element_type)
    m, k = lhs.shape
    g, d1, d2 = rhs.shape
    assert g == group_sizes.shape[0] and m > 0 and k > 0
    n = d2 if d1 == k else d1
    assert lhs.stride() == (k, 1), "lhs must be row-major"
    kn, nk = (d1, d2) == (k, n), (d1, d2) == (n, k)
    layouts = [kn and rhs.stride() == (k * n, n, 1), kn and rhs.stride() == (k * n, 1, k),
               nk and rhs.stride() == (k * n, k, 1)]
    assert sum(layouts) == 1, f"rhs must match exactly one layout; shape {tuple(rhs.shape)}, strides {rhs.stride()}"
    weights = rhs.double() if not layouts[2] else rhs.double().transpose(1, 2)
    starts = _bounds(group_sizes)
    assert starts[-1] <= m
    out = torch.zeros((m, n), dtype=torch.float64)
    for i in range(g):
        out[starts[i]:starts[i + 1]] = lhs[starts[i]:starts[i + 1]].double() @ weights[i]
    CALLS.append(("gmm", {"layout": ("non-transposed", "layout1", "layout2")[layouts.index(True)],
                          "work_stealing": work_stealing}))
    return out.to(preferred_element_type)


def _tgmm(name, lhs, rhs, group_sizes, preferred_element_type):
    """out[G, K, N]: out[g] = lhs[:, tokens of g] @ rhs[tokens of g]; lhs [K, M] row-major,
    [K, M] strides (1, K), or [M, K] row-major; rhs row-major [M, N]."""
    _check_inputs(lhs, rhs, group_sizes, preferred_element_type)
    m, n = rhs.shape
    g = group_sizes.shape[0]
    d1, d2 = lhs.shape
    k = d1 if d2 == m else d2
    assert m > 0 and k > 0 and n > 0
    km, mk = (d1, d2) == (k, m), (d1, d2) == (m, k)
    layouts = [km and lhs.stride() == (m, 1), km and lhs.stride() == (1, k), mk and lhs.stride() == (k, 1)]
    assert sum(layouts) == 1, f"lhs must match exactly one layout; shape {tuple(lhs.shape)}, strides {lhs.stride()}"
    assert rhs.stride() == (n, 1), "rhs must be row-major"
    logical = lhs.double() if not layouts[2] else lhs.double().t()  # [K, M]
    starts = _bounds(group_sizes)
    out = torch.zeros((g, k, n), dtype=torch.float64)
    for i in range(g):
        out[i] = logical[:, starts[i]:starts[i + 1]] @ rhs[starts[i]:starts[i + 1]].double()
    CALLS.append((name, {"layout": ("non-transposed", "layout1", "layout2")[layouts.index(True)]}))
    return out.to(preferred_element_type)


def ptgmm(lhs, rhs, group_sizes, bias_grad=None, preferred_element_type=torch.bfloat16, existing_out=None,
          accumulate=False, config=None, grid_dim=None):
    return _tgmm("ptgmm", lhs, rhs, group_sizes, preferred_element_type)


def nptgmm(lhs, rhs, group_sizes, bias_grad=None, preferred_element_type=torch.bfloat16, existing_out=None,
           accumulate=False, config=None):
    return _tgmm("nptgmm", lhs, rhs, group_sizes, preferred_element_type)
