"""Blockwise fp8 GEMM for Hopper in Gluon: the promotion of each K block overlaps the next MMA.

Same contract as ``fp8_gemm_kernels.fp8_gemm`` with ``SCALE_MODE`` 2: K-major fp8 ``a`` [M, K] and
``b`` [N, K], one fp32 scale per (row group, K block) of each operand, BLOCK_K equal to the
quantisation block, ``acc += (a_blk @ b_blk^T) * sa * sb`` in fp32 after every K block.

Why a second kernel: in plain Triton the partial product of a K block is consumed by the fp32
promotion right after its ``tl.dot``, so Triton waits for that wgmma (``wgmma.wait_group 0``)
every K step and the tensor cores idle during each promotion (tools/compile_sm90.py shows it).
Gluon exposes the asynchronous wgmma directly, so this kernel issues the MMA of block k+1, then
waits only for block k (``warpgroup_mma_wait(num_outstanding=1)``) and promotes block k while
block k+1 runs. K blocks go in unrolled chunks of ``CHUNK`` (2 or 4, ``chunk_for``) with a full
wait at each chunk's end: a partial still in flight across a loop's back edge would be copied
between registers, and ptxas answers a copy of in-flight wgmma registers by serialising every
wgmma of the kernel (its C7514/C7515 notes). So CHUNK-1 of every CHUNK promotions overlap an MMA
(none do in the Triton kernel), and registers hold 1 + CHUNK fp32 tiles, which bounds the tile at
128 x 128 with 8 warps (225 registers, sm_90, triton 3.6).

Pipeline: a ring of ``STAGES`` shared-memory slots filled by TMA (zero-filled out of bounds), one
``ready`` mbarrier per slot. The load of flattened step ``i + STAGES - 1`` goes into the slot of
step ``i - 1`` as soon as that step's MMA is known complete in every warpgroup (the wgmma wait is
per warpgroup, hence the CTA barrier before the copy). Loads run ahead across tile boundaries of
the persistent loop. The output is stored with masked pointer stores.

Needs triton >= 3.6 with Gluon (``triton.experimental.gluon``) and an sm_90 GPU; the Triton
interpreter does not run Gluon, so ``available()`` says why it cannot serve a call.
"""
from __future__ import annotations

import functools

import torch

from turbo_dispatch.env import env_reader, env_text_reader, parse_bool

from .gemm_kernels import bind_cuda_context, interpreting, num_programs, tile_coords, tma_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover - triton without Gluon
    gluon = None
else:
    # triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 only async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # ... and the CTA barrier thread_barrier (3.6) / barrier (3.9).
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

#: Bumped whenever the kernel's code changes, so stored tuning results are invalidated.
KERNEL_REVISION = "gluon-bw-r1"
#: Triton releases (major.minor) every Gluon kernel of this package compiles on for sm_90
#: (tools/compile_sm90.py). Gluon is experimental and changes its rules between releases, so on
#: any other release these kernels are refused with that reason instead of failing in the compiler
#: at call time.
GLUON_TRITON_RELEASES = ("3.6", "3.8", "3.9")


@functools.lru_cache(maxsize=1)
def _triton_release() -> str:
    import triton

    return ".".join(triton.__version__.split(".")[:2])
#: Set to 0/false to keep the Gluon kernel out of every candidate list (a pinned config then raises).
GLUON_ENV = "PRIMUS_TURBO_GLUON_KERNELS"

if gluon is not None:
    _tile_coords = gluon.jit(tile_coords.fn)

    @gluon.jit
    def _scales(s_ptr, offs, off0, kt, s_row, s_k, n_valid, GROUP: gl.constexpr, BLOCK: gl.constexpr):
        """The K-block ``kt`` scales of a tile's rows: a scalar when the whole tile lies in one
        group, else one per row (``offs`` carries the layout the promotion broadcasts against)."""
        if GROUP >= BLOCK and GROUP % BLOCK == 0:
            return gl.load(s_ptr + (off0 // GROUP) * s_row + kt * s_k)
        else:
            return gl.load(s_ptr + (offs // GROUP) * s_row + kt * s_k, mask=offs < n_valid, other=0.0)

    @gluon.jit
    def _promote(acc, part, sa, sb, A_SCALAR: gl.constexpr, B_SCALAR: gl.constexpr):
        if A_SCALAR:
            if B_SCALAR:
                return acc + part * (sa * sb)
            else:
                return acc + part * (sa * sb)[None, :]
        else:
            if B_SCALAR:
                return acc + part * (sa * sb)[:, None]
            else:
                return acc + part * sa[:, None] * sb[None, :]

    @gluon.jit
    def _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid, num_pid_m, num_pid_n,
                    NUM_PROGS, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
        """TMA copies of flattened step ``step`` (this program's tile ``step // k_tiles``, K block
        ``step % k_tiles``) into slot ``step % STAGES``; a no-op past the last step."""
        tile_id = pid + (step // k_tiles) * NUM_PROGS
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_k = (step % k_tiles) * BLOCK_K
        slot = step % STAGES
        live = step < total
        bar = ready.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        _tma_load(a_desc, [pid_m * BLOCK_M, off_k], bar, a_bufs.index(slot), pred=live)
        _tma_load(b_desc, [pid_n * BLOCK_N, off_k], bar, b_bufs.index(slot), pred=live)

    @gluon.jit
    def _issue_mma(a_bufs, b_bufs, ready, step, kt, zero, sa_ptr, sb_ptr, offs_m, off_m, offs_n, off_n, M, N,
                   ssa_r, ssa_k, ssb_r, ssb_k, A_GROUP: gl.constexpr, B_GROUP: gl.constexpr,
                   STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Wait for flattened step ``step``'s tiles, start its wgmma (fresh fp32 partial, not
        awaited) and load K block ``kt``'s scales for its promotion."""
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False,
                             is_async=True)
        sa = _scales(sa_ptr, offs_m, off_m, kt, ssa_r, ssa_k, M, A_GROUP, BLOCK_M)
        sb = _scales(sb_ptr, offs_n, off_n, kt, ssb_r, ssb_k, N, B_GROUP, BLOCK_N)
        return part, sa, sb

    @gluon.jit
    def _refill(a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid, num_pid_m, num_pid_n, NUM_PROGS,
                STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                GROUP_M: gl.constexpr):
        """Once step ``step - 1``'s wgmma is done in this warpgroup, load step ``step + STAGES - 1``
        into its slot."""
        # The wgmma wait is per warpgroup: every warpgroup must be past it before the slot is reused.
        _cta_barrier()
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, step + STAGES - 1, total, k_tiles, pid, num_pid_m,
                    num_pid_n, NUM_PROGS, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)

    @gluon.jit
    def _retire(acc, part, sa, sb, a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid, num_pid_m,
                num_pid_n, NUM_PROGS, OUTSTANDING: gl.constexpr, A_SCALAR: gl.constexpr, B_SCALAR: gl.constexpr,
                STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                GROUP_M: gl.constexpr):
        """Promote the partial ``part`` as soon as it is done, leaving ``OUTSTANDING`` newer wgmmas
        (step ``step``'s, or none) in flight, then refill the slot of step ``step - 1``."""
        done = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(part,))
        acc = _promote(acc, done, sa, sb, A_SCALAR, B_SCALAR)
        _refill(a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid, num_pid_m, num_pid_n, NUM_PROGS,
                STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        return acc

    @gluon.jit
    def _fp8_blockwise_kernel(a_desc, b_desc, c, sa_ptr, sb_ptr, M, N, K, sc_m, sc_n,
                              ssa_r, ssa_k, ssb_r, ssb_k, NUM_PROGS,
                              A_GROUP: gl.constexpr, B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                              STAGES: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr):
        # One 16-row wgmma atom per warp along M (BLOCK_M = 16 * num_warps), the full BLOCK_N per
        # instruction, K = 32 for 8-bit operands.
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        A_SCALAR: gl.constexpr = A_GROUP >= BLOCK_M and A_GROUP % BLOCK_M == 0
        B_SCALAR: gl.constexpr = B_GROUP >= BLOCK_N and B_GROUP % BLOCK_N == 0

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        my_tiles = gl.cdiv(num_pid_m * num_pid_n - pid, NUM_PROGS)
        total = my_tiles * k_tiles
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)

        for p in gl.static_range(STAGES - 1):
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, p, total, k_tiles, pid, num_pid_m, num_pid_n,
                        NUM_PROGS, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        step = 0
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * NUM_PROGS, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=rows_layout)
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
            acc = zero
            k_chunked = k_tiles - k_tiles % CHUNK
            for kc in range(0, k_chunked, CHUNK):
                # CHUNK K blocks unrolled: the wgmma of block u+1 runs while block u is promoted.
                # No wgmma stays in flight across the loop's back edge, because ptxas serialises
                # every wgmma of a kernel that copies in-flight accumulator registers (a loop-
                # carried partial does exactly that).
                part, sa, sb = _issue_mma(a_bufs, b_bufs, ready, step, kc, zero, sa_ptr, sb_ptr, offs_m, off_m,
                                          offs_n, off_n, M, N, ssa_r, ssa_k, ssb_r, ssb_k, A_GROUP, B_GROUP,
                                          STAGES, BLOCK_M, BLOCK_N)
                # The slot this look-ahead load reuses held the previous block, waited to zero.
                _refill(a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid, num_pid_m, num_pid_n,
                        NUM_PROGS, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
                step += 1
                for u in gl.static_range(1, CHUNK):
                    nxt, sa_nxt, sb_nxt = _issue_mma(a_bufs, b_bufs, ready, step, kc + u, zero, sa_ptr, sb_ptr,
                                                     offs_m, off_m, offs_n, off_n, M, N, ssa_r, ssa_k, ssb_r,
                                                     ssb_k, A_GROUP, B_GROUP, STAGES, BLOCK_M, BLOCK_N)
                    acc = _retire(acc, part, sa, sb, a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles,
                                  pid, num_pid_m, num_pid_n, NUM_PROGS, 1, A_SCALAR, B_SCALAR, STAGES, BLOCK_M,
                                  BLOCK_N, BLOCK_K, GROUP_M)
                    step += 1
                    part = nxt
                    sa = sa_nxt
                    sb = sb_nxt
                done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                acc = _promote(acc, done, sa, sb, A_SCALAR, B_SCALAR)
            for kt in range(k_chunked, k_tiles):
                # The K blocks past the last whole chunk, one at a time without overlap.
                part, sa, sb = _issue_mma(a_bufs, b_bufs, ready, step, kt, zero, sa_ptr, sb_ptr, offs_m, off_m,
                                          offs_n, off_n, M, N, ssa_r, ssa_k, ssb_r, ssb_k, A_GROUP, B_GROUP,
                                          STAGES, BLOCK_M, BLOCK_N)
                acc = _retire(acc, part, sa, sb, a_desc, b_desc, a_bufs, b_bufs, ready, step, total, k_tiles, pid,
                              num_pid_m, num_pid_n, NUM_PROGS, 0, A_SCALAR, B_SCALAR, STAGES, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M)
                step += 1
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            gl.store(c + offs_m[:, None] * sc_m + offs_n[None, :] * sc_n, acc.to(c.dtype.element_ty), mask=mask)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))


#: The text of the Gluon switch (``GLUON_ENV``) as it is now, None when unset.
read_switch = env_text_reader(GLUON_ENV)
_SWITCH_RAW = env_reader(GLUON_ENV)
_INTERPRET_RAW = env_reader("TRITON_INTERPRET")


def launch_env() -> tuple:
    """The raw values of the environment variables that the Triton backend's launch paths read on
    every call (the Gluon switch ``GLUON_ENV``, ``TRITON_INTERPRET``): equal between two calls
    exactly when neither changed. A launcher prepared under one value serves only calls under
    the same one."""
    return _SWITCH_RAW(), _INTERPRET_RAW()


def available(device_index: int | None = None) -> str | None:
    """None when this kernel can run, else why not (switched off, no Gluon, an unchecked Triton
    release, interpreter, not sm_90).

    Asked several times per blockwise step, so the machine's part of the answer (a CUDA build
    with a GPU, the device's compute capability: costly queries) is kept per device; the env
    switch, the Triton release and the interpreter flag are looked at on every call."""
    switch = read_switch()
    if switch is not None and parse_bool(switch, GLUON_ENV) is False:
        return f"the Gluon kernels are switched off ({GLUON_ENV}={switch})"
    if gluon is None:
        return "triton.experimental.gluon is missing (triton >= 3.6 needed)"
    release = _triton_release()
    if release not in GLUON_TRITON_RELEASES:
        return (f"the Gluon kernels are checked on triton {', '.join(GLUON_TRITON_RELEASES)}; this is triton "
                f"{release}")
    if interpreting():
        return "the Triton interpreter does not run Gluon kernels"
    if device_index is None:
        why = _machine_refusal()
        if why is not None:
            return why
        device_index = torch.cuda.current_device()
    return _device_refusal(device_index)


@functools.lru_cache(maxsize=None)
def _machine_refusal() -> str | None:
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return "the Gluon blockwise kernel needs an NVIDIA GPU"
    return None


@functools.lru_cache(maxsize=None)
def _device_refusal(device_index: int) -> str | None:
    why = _machine_refusal()
    if why is not None:
        return why
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the Gluon blockwise kernel is written for sm_90 wgmma (this GPU is sm_{major}{minor})"
    return None


def config_error(cfg, b_group: int) -> str | None:
    """Why ``cfg`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps[, ...]) cannot run this
    kernel with ``b``'s scales shared by ``b_group`` rows, or None.

    ``b``'s scale must be one value per tile (a ``b_group`` that is a multiple of BLOCK_N): a
    per-column scale is a vector of BLOCK_N / 4 values per thread, kept for every partial in
    flight, and spills at every candidate tile (sm_90, triton 3.6). So the kernel serves the
    forward and dgrad GEMMs (weight in 2-D blocks), not the wgrad (both operands 1-D)."""
    bm, bn, bk, _, stages, warps = cfg[:6]
    if bm != 16 * warps:
        return f"BLOCK_M must be 16 * num_warps ({16 * warps}), got {bm}"
    if bn % 8 or not 8 <= bn <= 128:
        return f"BLOCK_N must be a multiple of 8 in [8, 128] (three fp32 tiles live in registers), got {bn}"
    if bk % 32:
        return f"BLOCK_K must be a multiple of 32 (the fp8 wgmma K), got {bk}"
    if stages < 2:
        return f"num_stages must be >= 2, got {stages}"
    if b_group < bn or b_group % bn:
        return (f"b's scales must be one per tile: b_group={b_group} is not a multiple of BLOCK_N={bn} "
                f"(per-column scales spill in this kernel)")
    return None


def operands_error(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why these K-major fp8 operands cannot go through TMA, or None."""
    for name, t in (("a", a), ("b", b)):
        if not tma_ok(t):
            return f"{name} must be K-contiguous with 16-byte aligned rows and base for TMA"
    return None


def device_error(**tensors: torch.Tensor) -> str | None:
    """Why the named tensors cannot all feed one Gluon launch, or None: each must be a CUDA tensor
    and all on one GPU. Checked by the public entry points, so that a CPU tensor on a GPU machine is
    named here instead of failing inside Triton's launcher ("cannot be accessed from Triton")."""
    first = None
    for name, t in tensors.items():
        if t.device.type != "cuda":
            return f"{name} is on {t.device}; the Gluon kernels take CUDA tensors only"
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            return f"{name} is on {t.device} but {first[0]} on {first[1]}; all operands must be on one GPU"
    return None


def checked_output(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, config_why: str | None,
                   label: str, **others: torch.Tensor) -> torch.Tensor:
    """The uninitialised output [M, N] of a dense Gluon blockwise GEMM of ``a`` [M, K] and ``b``
    [N, K], after the checks every Gluon kernel makes: the shapes, then the first of this machine
    (``available``), the tensors' devices (``a``, ``b`` and the named ``others``, ``device_error``),
    the config (``config_why``, the kernel's own ``config_error``) and the operands
    (``operands_error``) that refuses. Raises ValueError prefixed with ``label``."""
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"{label}: a is {tuple(a.shape)}, b is {tuple(b.shape)}; both must be [*, K]")
    why = available(a.device.index) or device_error(a=a, b=b, **others) or config_why or operands_error(a, b)
    if why:
        raise ValueError(f"{label}: {why}")
    return torch.empty((M, N), dtype=out_dtype, device=a.device)


def fp8_blockwise_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                       out_dtype: torch.dtype, cfg, a_group: int = 1, b_group: int = 1) -> torch.Tensor:
    """``C = dequant(a) @ dequant(b)^T`` with blockwise scales, on the Gluon kernel.

    Arguments as ``fp8_gemm_kernels.fp8_gemm`` with ``scale_mode=SCALE_BLOCK``: ``sa`` is
    [M / a_group, K / BLOCK_K] and ``sb`` [N / b_group, K / BLOCK_K], any strides. Raises
    ValueError naming the reason when the kernel cannot run here or ``cfg`` does not suit it.

    >>> from turbo_dispatch.backends.triton.quantize import quantize_kmajor  # doctest: +SKIP
    >>> qa, sa = quantize_kmajor(x, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE, 128, False)  # doctest: +SKIP
    >>> qw, sw = quantize_kmajor(w, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE, 128, True)  # doctest: +SKIP
    >>> y = fp8_blockwise_gemm(qa, qw, sa, sw, torch.bfloat16, (128, 128, 128, 8, 5, 8), b_group=128)  # doctest: +SKIP
    """
    c = checked_output(a, b, out_dtype, config_error(cfg, b_group), "fp8_blockwise_gemm", sa=sa, sb=sb)
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0:
        return c
    bm, bn, bk, group_m, stages, warps = cfg[:6]
    occupancy = cfg[6] if len(cfg) > 6 else 1
    a_desc = make_descriptor(a, [bm, bk])
    b_desc = make_descriptor(b, [bn, bk])
    tiles = -(-M // bm) * -(-N // bn)
    progs = min(tiles, num_programs(a.device.index) * occupancy)
    _fp8_blockwise_kernel[(progs,)](a_desc, b_desc, c, sa, sb, M, N, K, c.stride(0), c.stride(1),
                                    sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), progs,
                                    A_GROUP=a_group, B_GROUP=b_group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    GROUP_M=group_m, STAGES=stages, CHUNK=chunk_for(bm, bn, warps), num_warps=warps)
    return c


def chunk_for(block_m: int, block_n: int, num_warps: int) -> int:
    """K blocks unrolled per overlap chunk. ptxas keeps every partial of a chunk in its own
    registers until the chunk's final wait, so a chunk costs (1 + CHUNK) fp32 tiles: 2 blocks
    when a tile is 64 registers per thread (225 in all at 128 x 128 / 8 warps), 4 when it is 32
    or fewer (190 at 128 x 64). Larger chunks spill."""
    return 2 if block_m * block_n // (32 * num_warps) > 32 else 4


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype_name: str):
    """The default NVMMA swizzle for a ``block`` of Gluon dtype ``dtype_name``, built once: it is
    the same for every call with that block, and building it cost about 6 us of host time per
    descriptor (three per launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype_name))


def make_descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over 2-D K-major fp8 ``t`` with the default swizzle for ``block``."""
    layout = shared_layout(tuple(block), "float8e4nv" if t.dtype == torch.float8_e4m3fn else "float8e5")
    bind_cuda_context(t)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout)


__all__ = ["GLUON_ENV", "KERNEL_REVISION", "available", "checked_output", "config_error", "device_error",
           "fp8_blockwise_gemm", "make_descriptor", "operands_error", "read_switch", "shared_layout"]
