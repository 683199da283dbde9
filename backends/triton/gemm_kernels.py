"""bf16 / fp16 / fp32 GEMM in Triton: one persistent kernel, TMA or pointer loads.

``C[M, N] = op(A) @ op(B)`` with fp32 accumulation, any of the four (trans_a, trans_b) layouts,
any M/N/K (masked edges) and output dtype bf16/fp16/fp32.

* TMA path (Triton with ``triton.tools.tensor_descriptor.TensorDescriptor``, i.e. 3.4+): host-side
  descriptors over each operand *as stored*; a transposed operand is loaded in its stored
  orientation and transposed in shared memory (``.T``), which wgmma reads as an MN-major operand,
  so no layout costs a copy. Needs 16-byte aligned strides and base pointers; out-of-bounds tiles
  are zero-filled by the copy engine.
* Pointer path (older Triton, ROCm, odd strides such as K=1001 in bf16): the same kernel with
  masked ``tl.load``s through arbitrary strides.

The grid is persistent: ``min(#SMs, #tiles)`` programs walk the tiles in GROUP_M-swizzled order
(consecutive programs share B columns and A rows in L2), and the inner K loop is software
pipelined by Triton (``num_stages``).

Interpreter note: under ``TRITON_INTERPRET=1`` (triton 3.9, CPU) ``tl.dot`` on bf16 operands
returns garbage; ``UPCAST`` (set by the launcher only when interpreting) converts the loaded
tiles to fp32 before the dot. fp16 and fp8 dots are right in the interpreter.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from .interpret import interpreting  # re-exported: kernels and adapters import it from here
from .prebound import PreboundKernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

try:  # Host-side TMA descriptors (triton >= 3.4 on NVIDIA sm_90+).
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

#: Bumped whenever a kernel's code changes, so stored tuning results are invalidated.
KERNEL_REVISION = "gemm-r1"


_BOUND = threading.local()

#: Problems of at most this many tile steps (output tiles x K steps of the config) take the pointer
#: loads even where TMA is allowed: a TMA launch builds and encodes two descriptors on the host every
#: call, which a GEMM of a few tiles never wins back on the GPU (a tiny GEMM is host-bound).
POINTER_MAX_TILE_STEPS = 16


def tma_pays(m: int, n: int, k: int, bm: int, bn: int, bk: int) -> bool:
    """Whether an ``[m, n, k]`` problem on ``(bm, bn, bk)`` tiles is large enough for the TMA path:
    more than ``POINTER_MAX_TILE_STEPS`` tile steps.

    >>> tma_pays(16, 16, 16, 128, 128, 64), tma_pays(4096, 4096, 4096, 128, 128, 64)
    (False, True)
    """
    steps = -(-m // bm) * -(-n // bn) * -(-k // bk)
    return steps > POINTER_MAX_TILE_STEPS


class DescriptorLayout:
    """A TMA descriptor's layout (shape, strides, block) checked once, then applied to each call's
    base tensor without Triton's per-construction checks.

    Under one launch key the shape, strides, dtype and 16-byte alignment of the base are fixed, so
    the checks ``TensorDescriptor`` runs on construction (ranks, alignment, block shape) give the
    same answer every call; ``of(base)`` builds the descriptor with them skipped. Nothing keeps a
    reference to a base tensor between calls.
    """

    __slots__ = ("fields", "args")

    def __init__(self, base: torch.Tensor, shape, strides, block_shape) -> None:
        self.args = (list(shape), list(strides), list(block_shape))
        checked = TensorDescriptor(base, *self.args)
        # A TensorDescriptor without an instance dict (none so far) is built the checked way.
        fields = getattr(checked, "__dict__", None)
        self.fields = None if fields is None else {name: v for name, v in fields.items() if name != "base"}

    def of(self, base: torch.Tensor):
        if self.fields is None:
            return TensorDescriptor(base, *self.args)
        desc = object.__new__(TensorDescriptor)
        desc.__dict__.update(self.fields)
        desc.base = base
        return desc


def bind_cuda_context(t: torch.Tensor) -> None:
    """Make the primary CUDA context of ``t``'s device current on this thread if none is.

    Triton encodes a TMA descriptor argument before its launcher binds a context, so a launch
    that is a thread's first CUDA work fails there with "invalid device context": the autograd
    engine's backward thread when a TMA kernel opens its backward, or any fresh thread. Call it before launching with descriptors; it checks the driver once per thread."""
    if getattr(_BOUND, "done", False) or not t.is_cuda or interpreting():  # the common case first
        return
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0:
        # Not known to be bound: the launch reports the driver's error, and the next call asks again.
        return
    if not ctx.value:
        dev = ctypes.c_int()
        for name, call in (("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), t.device.index)),
                           ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
                           ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx))):
            status = call()
            if status != 0:
                raise RuntimeError(f"bind_cuda_context: {name} failed with CUDA error {status}")
    _BOUND.done = True


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def num_programs(device_index: int) -> int:
    """Persistent grid size: the SM count (4 under the interpreter, so the tile loop runs)."""
    if interpreting():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def tma_supported(device_index: int) -> bool:
    """TMA descriptors need triton's host descriptor class and an NVIDIA sm_90+ GPU (the
    interpreter emulates them, so they are exercised on the CPU too)."""
    if TensorDescriptor is None:
        return False
    if interpreting():
        return True
    if getattr(torch.version, "hip", None):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read ``t`` (any rank): a unit last stride, and the base and
    every other stride 16-byte aligned."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((st * es) % 16 == 0 for st in t.stride()[:-1]))


if triton is not None:

    @triton.jit
    def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of a linear tile id, walking GROUP_M rows of tiles column by column
        so that programs running together reuse operand tiles from L2."""
        per_group = GROUP_M * num_pid_n
        group = tile_id // per_group
        first_m = group * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        local = tile_id % per_group
        return first_m + local % rows, local // rows

    @triton.jit
    def _gemm_kernel(a, b, c, M, N, K, sa_m, sa_k, sb_k, sb_n, sc_m, sc_n,
                     USE_TMA: tl.constexpr, A_STORED_KM: tl.constexpr, B_STORED_NK: tl.constexpr,
                     UPCAST: tl.constexpr, FP32_IN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_PROGS, GROUP_M: tl.constexpr):
        """Persistent GEMM. With USE_TMA, ``a``/``b`` are descriptors over the stored operands:
        A stored [K, M] when A_STORED_KM (else [M, K]), B stored [N, K] when B_STORED_NK (else
        [K, N]). Without, they are pointers and (sa_m, sa_k) / (sb_k, sb_n) the logical strides."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile_id in tl.range(pid, num_pid_m * num_pid_n, NUM_PROGS):
            pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(k_tiles):
                off_k = kt * BLOCK_K
                if USE_TMA:
                    if A_STORED_KM:
                        av = a.load([off_k, off_m]).T
                    else:
                        av = a.load([off_m, off_k])
                    if B_STORED_NK:
                        bv = b.load([off_n, off_k]).T
                    else:
                        bv = b.load([off_k, off_n])
                else:
                    offs_k = off_k + tl.arange(0, BLOCK_K)
                    av = tl.load(a + offs_m[:, None] * sa_m + offs_k[None, :] * sa_k,
                                 mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
                    bv = tl.load(b + offs_k[:, None] * sb_k + offs_n[None, :] * sb_n,
                                 mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
                if UPCAST:
                    acc = tl.dot(av.to(tl.float32), bv.to(tl.float32), acc)
                elif FP32_IN:
                    # Three TF32 products recover ~fp32 accuracy at tensor-core speed.
                    acc = tl.dot(av, bv, acc, input_precision="tf32x3")
                else:
                    acc = tl.dot(av, bv, acc)
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tl.store(c + offs_m[:, None] * sc_m + offs_n[None, :] * sc_n, acc.to(c.dtype.element_ty), mask=mask)


def gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
         cfg, use_tma: bool | None = None) -> torch.Tensor:
    """``op(a) @ op(b)`` with tile config ``cfg`` (a configs.TileConfig).

    ``use_tma=None`` picks TMA when the device and both operands allow it and the problem is larger
    than a few tiles (``tma_pays``); False forces the pointer kernel (True raises if TMA is
    impossible, for tests that must cover that path).
    The launch is resolved once per problem key (``launch_key``) and pre-bound (prebound.py): a
    later call with the same key only allocates the output, builds the descriptors and launches.
    """
    key = launch_key(a, b, trans_a, trans_b, out_dtype, cfg, use_tma)
    plan = GEMM_LAUNCHER.plan(key)
    if plan is None:
        return _gemm_first(key, a, b, trans_a, trans_b, out_dtype, cfg, use_tma)
    rows, cols, layouts = plan.state
    c = torch.empty((rows, cols), dtype=out_dtype, device=a.device)
    if layouts is None:
        plan(a, b, c)
    else:
        bind_cuda_context(a)
        # The stored operand of a transposed view starts at the same address as the view: the
        # descriptor takes its shape and strides from the plan, its base from the call.
        plan(layouts[0].of(a), layouts[1].of(b), c)
    return c


def launch_key(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype, cfg,
               use_tma: bool | None) -> tuple:
    """What fixes a ``gemm`` launch: the operands' shapes, strides, dtypes, device and 16-byte
    alignment (TMA and Triton's pointer specialisation depend on it), the layout flags, the output
    dtype, the tile config and the TMA request. The output is a fresh ``torch.empty`` (always
    aligned), so it adds nothing."""
    return (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, a.device, a.data_ptr() % 16 == 0,
            b.data_ptr() % 16 == 0, trans_a, trans_b, out_dtype, cfg, use_tma)


def _gemm_first(key: tuple, a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
                cfg, use_tma: bool | None) -> torch.Tensor:
    """``gemm`` for a key without a plan: resolves the launch, runs it and binds the plan."""
    A = a.t() if trans_a else a  # logical [M, K]
    B = b.t() if trans_b else b  # logical [K, N]
    M, K = A.shape
    N = B.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    dev = a.device.index if a.is_cuda else 0
    bm, bn, bk, group_m, stages, warps = cfg[:6]
    occupancy = cfg[6] if len(cfg) > 6 else 1
    # Stored orientation with a unit last stride, if either works.
    a_st, a_km = (A, False) if A.stride(1) == 1 else (A.t(), True)
    b_st, b_nk = (B.t(), True) if B.stride(0) == 1 else (B, False)
    can_tma = tma_supported(dev) and tma_ok(a_st) and tma_ok(b_st)
    if use_tma is None:
        use_tma = can_tma and tma_pays(M, N, K, bm, bn, bk)
    elif use_tma and not can_tma:
        raise ValueError("gemm: TMA requested but the operands or device do not allow it")
    if use_tma:
        bind_cuda_context(a_st)
        layouts = (DescriptorLayout(a_st, a_st.shape, a_st.stride(), [bk, bm] if a_km else [bm, bk]),
                   DescriptorLayout(b_st, b_st.shape, b_st.stride(), [bn, bk] if b_nk else [bk, bn]))
        a_arg, b_arg = layouts[0].of(a), layouts[1].of(b)
    else:
        layouts, a_arg, b_arg = None, a, b
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = min(tiles, num_programs(dev) * occupancy)
    fixed = dict(M=M, N=N, K=K, sa_m=A.stride(0), sa_k=A.stride(1), sb_k=B.stride(0), sb_n=B.stride(1),
                 sc_m=c.stride(0), sc_n=c.stride(1), USE_TMA=use_tma, A_STORED_KM=a_km, B_STORED_NK=b_nk,
                 UPCAST=interpreting() and a.dtype == torch.bfloat16, FP32_IN=a.dtype == torch.float32,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGS=progs, GROUP_M=group_m)
    GEMM_LAUNCHER.bind(key, (progs,), (a_arg, b_arg, c), fixed, dict(num_stages=stages, num_warps=warps),
                       state=(M, N, layouts))
    return c


#: ``_gemm_kernel``'s plans; only the operands and the output change between calls of one key.
GEMM_LAUNCHER = PreboundKernel(_gemm_kernel, per_call=("a", "b", "c")) if triton is not None else None
