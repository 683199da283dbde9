"""Build a CUDA source of this folder for sm_90a with nvcc and launch its kernels through
cuda-bindings on torch's current stream: the probes' shared loader (tools/probe_cuda_*.py).

    kernels = Cubin(Path("fp8_blockwise_cluster.cu"), out_dir, ["fp8bw_c1"], smem=197696)
    kernels.launcher("fp8bw_c1", grid, 384, [ctypes.c_int(3), ...])()
"""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import torch


def check(result):
    """The values of a cuda-bindings call's result tuple, raising on a non-zero CUresult."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) or None)


class Cubin:
    """``source`` compiled to ``out_dir``/<stem>.cubin (ptxas's report beside it), its kernels
    ``names`` loaded into torch's context, each allowed ``smem`` bytes of dynamic shared memory."""

    def __init__(self, source: Path, out_dir: Path, names, smem: int = 0):
        from cuda.bindings import driver as cu
        self.cu = cu
        cubin = out_dir / (source.stem + ".cubin")
        cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(cubin),
               str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        (out_dir / (source.stem + ".ptxas.log")).write_text(done.stdout + done.stderr)
        if done.returncode:
            raise SystemExit(f"nvcc failed:\n{done.stderr}")
        torch.empty(1, device="cuda")  # torch's primary context, current on this thread
        check(cu.cuInit(0))
        self.module = check(cu.cuModuleLoad(str(cubin).encode()))
        self.funcs = {}
        for name in names:
            f = check(cu.cuModuleGetFunction(self.module, name.encode()))
            if smem:
                check(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            smem))
            self.funcs[name] = f
        self.smem = smem

    def tensor_map(self, t: torch.Tensor, box_rows: int = 128, box_bytes: int = 128):
        """A 2-D TMA map over byte-element ``t`` [rows, K] (K-major), boxes of ``box_rows`` x
        ``box_bytes``, 128-byte swizzle, as a by-value kernel argument."""
        cu = self.cu
        rows, k = t.shape
        tmap = check(cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, t.data_ptr(),
            [cu.cuuint64_t(k), cu.cuuint64_t(rows)], [cu.cuuint64_t(t.stride(0))],
            [cu.cuuint32_t(box_bytes), cu.cuuint32_t(box_rows)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
        return (ctypes.c_uint64 * 16).from_buffer_copy(ctypes.string_at(tmap.getPtr(), 128))

    def launcher(self, name: str, grid, block: int, params: list):
        """A no-argument launch of kernel ``name`` with ctypes values ``params`` (kept alive)."""
        ptrs = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        f, cu = self.funcs[name], self.cu
        gx, gy, gz = (tuple(grid) + (1, 1))[:3] if isinstance(grid, tuple) else (grid, 1, 1)

        def launch():
            stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
            check(cu.cuLaunchKernel(f, gx, gy, gz, block, 1, 1, self.smem, stream, ctypes.addressof(ptrs), 0))
        launch.keep = (params, ptrs)  # the driver reads the values at each launch
        return launch
