"""Pre-bound Triton launches (backends/triton/prebound.py) and the GEMM kernels that use them.

CPU, no triton needed: the plan logic against a scripted kernel that records how it is launched
(the first call through Triton's normal path, later ones through the compiled kernel's launcher,
with every argument in signature order; the normal path where no compiled kernel comes back).
CPU, triton: the GEMM launch keys change with every fact Triton specialises on. CPU, Triton
interpreter (a subprocess, as in test_triton_gemm.py): a second call of a key takes its plan and
gives the first call's bits, on the TMA and pointer paths, every layout, bf16 and fp8; the fp8
quantiser's launches likewise (with the reference quantiser's bits), and TritonGemmFp8 lists a
problem's candidates once. CPU: the quantiser's keys, its cached cast constants, and the fp8
adapter's plan key.
GPU (``gpu``): the second call launches the compiled kernel directly, with the same result.
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import sys
import types
import weakref

import pytest
import torch

from subprocess_results import assert_check_passed, interpreter_checks

from turbo_dispatch.backends.triton import prebound
from turbo_dispatch.backends.triton.prebound import BoundedCache, PreboundKernel, order_of


# -- the plan logic, against a scripted kernel ----------------------------------------------------
class _Compiled:
    """Stands in for a CompiledKernel: ``compiled[grid](*args)`` records a direct launch."""

    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args, {}))


class _Jit:
    """Stands in for a JITFunction: ``kernel[grid](*args, **options)`` records a normal launch and
    returns ``compiled`` (None: what the interpreter returns)."""

    arg_names = ["x", "BLOCK", "y", "n", "FLAG"]

    def __init__(self, compiled=True, hooks=()):
        self.log = []
        self.compiled = _Compiled(self.log) if compiled else None
        self.pre_run_hooks = list(hooks)

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("normal", grid, args, options))
            return self.compiled
        return launch


def test_second_call_launches_the_compiled_kernel_with_every_argument_in_order():
    jit = _Jit()
    kernel = PreboundKernel(jit, per_call=("x", "y"))
    assert kernel.plan("key") is None
    plan = kernel.bind("key", (6,), ("x0", "y0"), {"n": 7, "BLOCK": 32, "FLAG": True}, {"num_warps": 4},
                       state=("rows", 3))
    assert jit.log == [("normal", (6, 1, 1), ("x0", 32, "y0", 7, True), {"num_warps": 4})]
    assert plan.direct and plan.state == ("rows", 3) and kernel.binds == 1
    again = kernel.plan("key")
    assert again is plan and kernel.hits == 1
    again("x1", "y1")
    assert jit.log[-1] == ("direct", (6, 1, 1), ("x1", 32, "y1", 7, True), {})
    assert kernel.plan("other key") is None


@pytest.mark.parametrize("jit, why", [(_Jit(compiled=False), "no compiled kernel came back"),
                                      (_Jit(hooks=[print]), "pre-run hooks")])
def test_without_a_compiled_kernel_plans_take_the_normal_path_and_say_so_once(caplog, jit, why):
    kernel = PreboundKernel(jit, per_call=("x", "y"))
    with caplog.at_level(logging.DEBUG, logger=prebound.log.name):
        plan = kernel.bind("k1", (2, 3), ("x0", "y0"), {"n": 1, "BLOCK": 16, "FLAG": False}, {"num_stages": 2})
        kernel.bind("k2", (2,), ("x0", "y0"), {"n": 2, "BLOCK": 16, "FLAG": False}, {})
    assert not plan.direct
    plan("x1", "y1")
    assert jit.log[-1] == ("normal", (2, 3, 1), ("x1", 16, "y1", 1, False), {"num_stages": 2})
    told = [r for r in caplog.records if r.name == prebound.log.name]
    assert len(told) == 1 and told[0].levelno == logging.DEBUG and why in told[0].getMessage()


class _RawCompiled(_Compiled):
    """A CompiledKernel with its C launcher (``run``), function handle and packed metadata."""

    packed_metadata = ("packed",)

    def run(self, *args):
        self.log.append(("raw", args))


class _Chain:
    def __init__(self, calls=()):
        self.calls = list(calls)


def test_a_plan_calls_the_c_launcher_itself_unless_a_launch_hook_is_installed(monkeypatch):
    jit = _Jit()
    jit.compiled = _RawCompiled(jit.log)
    hooks = [_Chain(), _Chain()]
    monkeypatch.setattr(prebound, "_launch_hooks", lambda: tuple(hooks))
    monkeypatch.setattr(prebound, "_current_stream", lambda: 77)
    kernel = PreboundKernel(jit, per_call=("x", "y"))
    plan = kernel.bind("key", (6, 2), ("x0", "y0"), {"n": 7, "BLOCK": 32, "FLAG": True}, {"num_warps": 4})
    plan("x1", "y1")
    assert jit.log[-1] == ("raw", (6, 2, 1, 77, _RawCompiled.function, ("packed",), None, None, None,
                                   "x1", 32, "y1", 7, True))
    hooks[0] = _Chain([print])  # a profiler's hook: Triton's own launcher calls it
    plan("x2", "y2")
    assert jit.log[-1] == ("direct", (6, 2, 1), ("x2", 32, "y2", 7, True), {})
    hooks[0], hooks[1] = None, print  # a plain callable set by hand counts too
    plan("x3", "y3")
    assert jit.log[-1][0] == "direct"


# -- straight into the C launch function, against a launcher of triton 3.6's form ------------------
#: Read from the launcher's globals, as triton's driver module holds them.
_BASE_ARGS_FORMAT_LEN = 13
_ENCODED: list = []


def make_tensordesc_arg(arg, meta):
    """Stands in for triton's encoder: records each encoding; with metadata, an "encoding" of the
    base pointer, else the base with the shape and strides twice."""
    _ENCODED.append(arg.base.data_ptr())
    if meta is None:
        return [arg.base, *arg.shape, *arg.strides, arg.padding == "nan", *arg.shape, *arg.strides]
    return [("tma", meta, arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding), *arg.shape,
            *arg.strides]


def _wrap(launcher, tensordesc_indices, tensordesc_meta):
    """Triton's ``wrap_handle_tensordesc`` form: every launch expands each descriptor argument."""
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        k = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[k]))
                k += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class CudaLauncher:
    """Triton 3.6's launcher object: ``__call__`` adds the flags and scratch buffers."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, launch, scratch=0):
        self.launch, self.global_scratch_size, self.profile_scratch_size = launch, scratch, 0

    def __call__(self, gx, gy, gz, stream, function, *args):
        scratch = "scratch" if self.global_scratch_size else None
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, scratch, None, *args)


class _Desc:
    def __init__(self, base, shape=(64, 32), strides=(32, 1), padding="zero"):
        self.base, self.shape, self.strides, self.padding = base, list(shape), list(strides), padding


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class _DescJit(_Jit):
    arg_names = ["a_desc", "x", "BLOCK", "b_desc", "n"]


def _c_plan(monkeypatch, metas=("meta-a", "meta-b"), scratch=0):
    calls = []
    jit = _DescJit()
    jit.compiled = _RawCompiled(jit.log)
    jit.compiled.run = CudaLauncher(_wrap(lambda *args: calls.append(args), {0, 3}, list(metas)), scratch)
    hooks = [_Chain(), _Chain()]
    monkeypatch.setattr(prebound, "_launch_hooks", lambda: tuple(hooks))
    monkeypatch.setattr(prebound, "_current_stream", lambda: 77)
    kernel = PreboundKernel(jit, per_call=("x", "a_desc", "b_desc"))
    plan = kernel.bind("key", (6, 2), ("x0", _Desc(_Ptr(16)), _Desc(_Ptr(32))), {"n": 7, "BLOCK": 32},
                       {"num_warps": 4})
    return jit, plan, calls, hooks


@pytest.mark.parametrize("metas", [("meta-a", "meta-b"), (None, None)])
def test_a_plan_launches_the_c_function_with_what_tritons_launcher_would_pass(monkeypatch, metas):
    jit, plan, calls, hooks = _c_plan(monkeypatch, metas)
    assert isinstance(plan, prebound._PerCallPlan)
    per_call = ("x1", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    plan(*per_call)
    # Triton's own path for the same arguments: its launcher object on the plan's full argument list
    jit.compiled.run(6, 2, 1, 77, _RawCompiled.function, ("packed",), None, None, None,
                     per_call[1], "x1", 32, per_call[2], 7)
    assert len(calls) == 2 and calls[0] == calls[1]
    hooks[0] = _Chain([print])  # a profiler's hook: Triton's launcher calls it
    plan(*per_call)
    assert jit.log[-1] == ("direct", (6, 2, 1), (per_call[1], "x1", 32, per_call[2], 7), {})


def test_a_plan_keeps_no_tensor_of_its_first_call(monkeypatch):
    jit, plan, calls, _ = _c_plan(monkeypatch)
    first = torch.zeros(4)
    kept = weakref.ref(first)
    kernel = PreboundKernel(jit, per_call=("x", "a_desc", "b_desc"))
    plan = kernel.bind("key", (6, 2), (first, _Desc(_Ptr(16)), _Desc(_Ptr(32))), {"n": 7, "BLOCK": 32}, {})
    jit.log.clear()  # the stand-in kernel's record of the first launch
    del first
    gc.collect()
    assert kept() is None  # the template holds the per-call positions empty
    plan("x1", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    assert calls[-1][14:18] == (64, 32, 32, 1) and calls[-1][18] == "x1"  # a_desc's shape and strides, x


def test_descriptor_encodings_are_kept_per_data_pointer(monkeypatch):
    _, plan, calls, _ = _c_plan(monkeypatch)
    _ENCODED.clear()
    for _ in range(3):
        plan("x", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    assert _ENCODED == [48, 64]  # encoded once each, then reused
    plan("x", _Desc(_Ptr(80)), _Desc(_Ptr(64)))
    assert _ENCODED == [48, 64, 80] and calls[-1][13] == ("tma", "meta-a", 80, (64, 32), (32, 1), "zero")
    for ptr in range(96, 96 + 16 * prebound.DESCRIPTOR_CACHE, 16):  # a full slot starts over
        plan("x", _Desc(_Ptr(ptr)), _Desc(_Ptr(64)))
    assert len(_ENCODED) == 3 + prebound.DESCRIPTOR_CACHE


@pytest.mark.parametrize("other", [dict(shape=(48, 32)), dict(strides=(40, 1)), dict(padding="nan")])
def test_a_descriptor_of_another_layout_is_encoded_as_tritons_launcher_would(monkeypatch, other):
    jit, plan, calls, _ = _c_plan(monkeypatch)
    plan("x", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    odd = _Desc(_Ptr(48), **other)  # the same base as a kept encoding, another layout
    plan("x", odd, _Desc(_Ptr(64)))
    jit.compiled.run(6, 2, 1, 77, _RawCompiled.function, ("packed",), None, None, None, odd, "x", 32,
                     _Desc(_Ptr(64)), 7)
    assert calls[-2] == calls[-1] and calls[-1][13][3:] == (tuple(odd.shape), tuple(odd.strides), odd.padding)


def test_the_switch_keeps_plans_bound_after_it_on_tritons_launcher(monkeypatch):
    monkeypatch.setenv(prebound.C_LAUNCH_ENV, "0")
    jit, plan, calls, _ = _c_plan(monkeypatch)
    assert not isinstance(plan, prebound._PerCallPlan)
    plan("x1", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    assert calls[-1][:9] == (6, 2, 1, 77, _RawCompiled.function, False, True, None, None)
    monkeypatch.setenv(prebound.C_LAUNCH_ENV, "1")
    assert isinstance(_c_plan(monkeypatch)[1], prebound._PerCallPlan)


def test_a_launcher_that_needs_scratch_or_has_another_form_keeps_tritons_launcher(monkeypatch):
    jit, plan, calls, _ = _c_plan(monkeypatch, scratch=256)
    assert not isinstance(plan, prebound._PerCallPlan)
    plan("x1", _Desc(_Ptr(48)), _Desc(_Ptr(64)))
    assert calls[-1][7] == "scratch"  # through the launcher object, which allocates it
    odd = CudaLauncher(functools.partial(print))  # a C function: no descriptor parameters
    assert prebound._c_launch_parts(type("K", (), {"run": odd, "packed_metadata": ()})()) is not None
    odd.launch = lambda *args, launcher=print: None  # a Python launch whose closure is not triton's
    assert prebound._c_launch_parts(type("K", (), {"run": odd, "packed_metadata": ()})()) is None
    # A driver module of another form (triton 3.9 passes the kernel's arguments otherwise and names
    # no _BASE_ARGS_FORMAT_LEN): not used, even for a C function.
    other = types.ModuleType("other_triton_driver")
    other.make_tensordesc_arg = make_tensordesc_arg
    monkeypatch.setitem(sys.modules, other.__name__, other)
    launcher_cls = type("CudaLauncher", (CudaLauncher,), {"__module__": other.__name__})
    later = launcher_cls(functools.partial(print))
    assert prebound._c_launch_parts(type("K", (), {"run": later, "packed_metadata": ()})()) is None
    other._BASE_ARGS_FORMAT_LEN = 13
    assert prebound._c_launch_parts(type("K", (), {"run": later, "packed_metadata": ()})()) is not None


def test_launch_keys_on_grid_fixed_values_and_each_tensors_specialisation():
    jit = _Jit()
    kernel = PreboundKernel(jit, per_call=("x", "y"))
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    fixed, options = {"n": 7, "BLOCK": 32, "FLAG": True}, {"num_warps": 4}
    kernel.launch((6,), (x, y), fixed, options)
    kernel.launch((6,), (x + 1, y), fixed, options)  # another tensor, same specialisation: pre-bound
    assert [entry[0] for entry in jit.log] == ["normal", "direct"] and kernel.binds == 1 and kernel.hits == 1
    assert jit.log[-1][2][0] is not x  # the call's own tensor is launched, not the first call's
    kernel.launch((7,), (x, y), fixed, options)  # another grid
    kernel.launch((6,), (x, y), {**fixed, "n": 8}, options)  # another fixed value
    kernel.launch((6,), (x, y.float()), fixed, options)  # another dtype
    kernel.launch((6,), (x[1:], y), fixed, options)  # a pointer that is not 16-byte aligned
    kernel.launch((6,), (x, y), fixed, {"num_warps": 8})  # other options
    assert kernel.binds == 6 and [entry[0] for entry in jit.log].count("normal") == 6


def test_arguments_must_cover_the_signature_once():
    assert order_of(["a", "B", "c"], ("a", "c"), ("B",)) == (0, 2, 1)
    with pytest.raises(ValueError, match=r"missing \['FLAG'\]"):
        PreboundKernel(_Jit(), per_call=("x", "y")).bind("k", (1,), (1, 2), {"n": 1, "BLOCK": 2}, {})
    with pytest.raises(ValueError, match=r"unknown \['z'\]"):
        order_of(["a"], ("a",), ("z",))
    with pytest.raises(ValueError):
        order_of(["a", "b"], ("a", "a"), ("b",))


def test_plans_are_bounded():
    cache = BoundedCache(3)
    for i in range(5):
        cache.put(i, str(i))
    assert list(cache) == [2, 3, 4]
    kernel = PreboundKernel(_Jit(), per_call=("x", "y"), max_plans=2)
    for i in range(3):
        kernel.bind(i, (1,), (0, 0), {"n": i, "BLOCK": 1, "FLAG": False}, {})
    assert kernel.plan(0) is None and kernel.plan(2) is not None


# -- the GEMM kernels' launch keys ----------------------------------------------------------------
def _gemm_kernels():
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton import gemm_kernels as GK
    from turbo_dispatch.backends.triton.configs import TileConfig

    return GK, FK, TileConfig


def test_gemm_launch_key_changes_with_every_specialised_fact():
    GK, _, TileConfig = _gemm_kernels()
    cfg = TileConfig(32, 32, 32, 2, 2, 4)
    a, b = torch.randn(40, 24, dtype=torch.float16), torch.randn(24, 20, dtype=torch.float16)
    base = GK.launch_key(a, b, False, False, torch.float32, cfg, None)
    assert GK.launch_key(a.clone(), b.clone(), False, False, torch.float32, cfg, None) == base
    padded = torch.randn(40, 32, dtype=torch.float16)[:, :24]  # same shape, other row stride
    unaligned = torch.randn(40 * 24 + 1, dtype=torch.float16)[1:].view(40, 24)  # 2-byte offset
    variants = [
        GK.launch_key(padded, b, False, False, torch.float32, cfg, None),
        GK.launch_key(unaligned, b, False, False, torch.float32, cfg, None),
        GK.launch_key(a.bfloat16(), b.bfloat16(), False, False, torch.float32, cfg, None),
        GK.launch_key(a, b, False, False, torch.bfloat16, cfg, None),
        GK.launch_key(a, b, False, False, torch.float32, cfg._replace(block_n=64), None),
        GK.launch_key(a, b, False, False, torch.float32, cfg._replace(occupancy=2), None),
        GK.launch_key(a, b, False, False, torch.float32, cfg, False),
        GK.launch_key(a.t().contiguous().t(), b, False, False, torch.float32, cfg, None),  # column-major
        GK.launch_key(a.t(), b, True, False, torch.float32, cfg, None),
        GK.launch_key(torch.randn(41, 24, dtype=torch.float16), b, False, False, torch.float32, cfg, None),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_fp8_launch_key_changes_with_every_specialised_fact():
    _, FK, TileConfig = _gemm_kernels()
    cfg = TileConfig(32, 32, 32, 2, 2, 4)
    e4 = torch.float8_e4m3fn
    a, b = torch.randn(40, 64).to(e4), torch.randn(20, 64).to(e4)
    sa, sb = torch.rand(40, 2), torch.rand(20, 2)
    base = FK.launch_key(a, b, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1, None)
    assert FK.launch_key(a.clone(), b.clone(), sa.clone(), sb.clone(), FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1,
                         None) == base
    variants = [
        FK.launch_key(a, torch.randn(20, 64).to(torch.float8_e5m2), sa, sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1,
                      None),
        FK.launch_key(a, b, sa.t().contiguous().t(), sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1, None),
        FK.launch_key(a, b, sa, sb, FK.SCALE_BLOCK, torch.float32, cfg, 1, 1, None),
        FK.launch_key(a, b, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, cfg._replace(num_warps=8), 1, 1, None),
        FK.launch_key(a, b, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 32, None),
        FK.launch_key(a, b, sa, sb, FK.SCALE_ROW, torch.bfloat16, cfg, 1, 1, None),
        FK.launch_key(a, b, torch.rand(81)[1:].view(40, 2), sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1, None),
        FK.launch_key(a, b, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, cfg, 1, 1, False),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_quantiser_key_changes_with_every_specialised_fact():
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity as G

    e4 = torch.float8_e4m3fn
    x = torch.randn(40, 64)
    args = dict(dtype=e4, gran=G.BLOCKWISE, axis=1, block_size=32, block_2d=False, want_t=False, row_pad=16,
                scale_mn_major=True, amax=None)
    base = Q._run_key(x, **args)
    variants = [Q._run_key(x.t().contiguous().t(), **args), Q._run_key(torch.randn(40, 96), **args),
                Q._run_key(x.half(), **args), Q._run_key(torch.randn(641)[1:].view(40, 16), **args)]
    variants += [Q._run_key(x, **{**args, name: value}) for name, value in
                 (("dtype", torch.float8_e5m2), ("gran", G.ROWWISE), ("axis", 0), ("block_size", 64),
                  ("block_2d", True), ("want_t", True), ("row_pad", 1), ("scale_mn_major", False),
                  ("amax", torch.zeros(40)))]
    assert len({base, *variants}) == len(variants) + 1
    assert Q._run_key(torch.randn(40, 64), **args) == base  # the values are not part of it
    both = Q._both_key(x, True)
    assert len({both, Q._both_key(x, False), Q._both_key(x.t().contiguous().t(), True),
                Q._both_key(x.double(), True)}) == 4


def test_cast_constants_are_computed_once_per_dtype_and_scale_form(monkeypatch):
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import quantize as Q

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    monkeypatch.setattr(Q, "SCALE_BY_DIVISION", False)
    by_recip = Q._cast_constants(e4)
    assert Q._cast_constants(e4) is by_recip and by_recip["RECIP"] == Q._f32_recip(448.0)
    assert Q._cast_constants(e5)["RECIP"] == Q._f32_recip(57344.0)
    monkeypatch.setattr(Q, "SCALE_BY_DIVISION", True)
    assert Q._cast_constants(e4)["RECIP"] == 0.0


def test_fp8_plan_key_follows_the_gluon_switch_where_gluon_can_serve(monkeypatch):
    from turbo_dispatch.backends.triton import gemm as TG
    from turbo_dispatch.backends.triton.fp8_blockwise_gluon import GLUON_ENV
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem

    e4 = torch.float8_e4m3fn
    a, b = torch.randn(48, 128), torch.randn(40, 128)
    blockwise = gemm_fp8_problem(a, b, False, True, torch.float32, e4, e4, G.BLOCKWISE, 128, False, True)
    rowwise = gemm_fp8_problem(a, b, False, True, torch.float32, e4, e4, G.ROWWISE, None, False, False)
    on_gpu = blockwise._replace(platform="cuda")
    monkeypatch.delenv(GLUON_ENV, raising=False)
    keys = {TG._fp8_plan_key(p, None) for p in (blockwise, rowwise, on_gpu)}
    monkeypatch.setenv(GLUON_ENV, "0")
    assert TG._fp8_plan_key(on_gpu, None) not in keys
    assert TG._fp8_plan_key(rowwise, None) in keys and TG._fp8_plan_key(blockwise, None) in keys
    assert TG._fp8_plan_key(rowwise, [64, 64, 128, 8, 3, 4]) == TG._fp8_plan_key(rowwise, (64, 64, 128, 8, 3, 4))


# -- the interpreter: a planned call gives the first call's bits ---------------------------------------
def _emit(name: str, ok: bool, detail: str = "") -> None:
    print("RESULT " + json.dumps({"name": name, "ok": bool(ok), "detail": detail}), flush=True)


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    import itertools

    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton import gemm_kernels as GK
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.backends.triton.configs import TileConfig
    from turbo_dispatch.low_precision import ScalingGranularity as G

    torch.manual_seed(7)
    cfg = TileConfig(32, 32, 32, 2, 2, 4)
    for dt, (ta, tb), tma in itertools.product((torch.float16, torch.bfloat16), itertools.product([False, True], repeat=2),
                                               (None, False)):
        # 16-byte rows in every layout and more tile steps than gemm_kernels.POINTER_MAX_TILE_STEPS, so
        # tma=None takes TMA; edge tiles still masked.
        m, n, k = 72, 88, 104
        shape_a, shape_b = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
        a1, b1 = torch.randn(shape_a).to(dt), torch.randn(shape_b).to(dt)
        a2, b2 = torch.randn(shape_a).to(dt), torch.randn(shape_b).to(dt)
        binds, hits = GK.GEMM_LAUNCHER.binds, GK.GEMM_LAUNCHER.hits
        first = GK.gemm(a1, b1, ta, tb, torch.float32, cfg, use_tma=tma)
        second = GK.gemm(a2, b2, ta, tb, torch.float32, cfg, use_tma=tma)  # the same key: planned
        GK.GEMM_LAUNCHER.clear()
        fresh = GK.gemm(a2, b2, ta, tb, torch.float32, cfg, use_tma=tma)  # resolved again from scratch
        ref = (a2.t() if ta else a2).double() @ (b2.t() if tb else b2).double()
        err = float((second.double() - ref).norm() / ref.norm())
        key = GK.launch_key(a2, b2, ta, tb, torch.float32, cfg, tma)
        layouts = GK.GEMM_LAUNCHER.plan(key).state[2]
        ok = (GK.GEMM_LAUNCHER.binds - binds == 2 and GK.GEMM_LAUNCHER.hits - hits == 2
              and torch.equal(second, fresh) and err < 1e-2 and not torch.equal(first, second)
              and (layouts is None) == (tma is False))
        _emit(f"gemm_planned[{dt}-{int(ta)}{int(tb)}-tma={tma}]", ok,
              f"binds {GK.GEMM_LAUNCHER.binds - binds}, hits {GK.GEMM_LAUNCHER.hits - hits}, err {err:.1e}")

    e4 = torch.float8_e4m3fn
    for (g, bs, b2d, mode), tma in itertools.product(
            [(G.TENSORWISE, None, False, FK.SCALE_TENSOR), (G.ROWWISE, None, False, FK.SCALE_ROW),
             (G.BLOCKWISE, 32, True, FK.SCALE_BLOCK)], (None, False)):
        def operands():
            qa, sa = Q.quantize_kmajor(torch.randn(48, 96), e4, g, bs, False)
            qb, sb = Q.quantize_kmajor(torch.randn(40, 96), e4, g, bs, b2d)
            if mode == FK.SCALE_ROW:
                sa, sb = sa.reshape(-1), sb.reshape(-1)
            return qa, qb, sa, sb

        groups = dict(a_group=1, b_group=32 if b2d else 1)
        first_ops, second_ops = operands(), operands()
        binds = FK.FP8_GEMM_LAUNCHER.binds
        FK.fp8_gemm(*first_ops, mode, torch.float32, cfg, use_tma=tma, **groups)
        second = FK.fp8_gemm(*second_ops, mode, torch.float32, cfg, use_tma=tma, **groups)
        FK.FP8_GEMM_LAUNCHER.clear()
        fresh = FK.fp8_gemm(*second_ops, mode, torch.float32, cfg, use_tma=tma, **groups)
        _emit(f"fp8_planned[{g.name}-tma={tma}]", torch.equal(second, fresh) and FK.FP8_GEMM_LAUNCHER.binds - binds == 2,
              f"binds {FK.FP8_GEMM_LAUNCHER.binds - binds}, max diff {float((second - fresh).abs().max())}")

    _quantiser_checks()
    _fp8_adapter_checks()


#: (name, granularity, axis, block_size, block_2d, transposed input) of the quantiser's plan
#: checks: every path of ``quantize._run`` (one-pass row, split amax along a strided dim,
#: tensorwise's two kernels, 1-D runs, 2-D tiles).
_QUANT_CASES = [("rowwise", "ROWWISE", 1, None, False, False), ("rowwise_strided", "ROWWISE", 1, None, False, True),
                ("rowwise_axis0", "ROWWISE", 0, None, False, False), ("tensorwise", "TENSORWISE", 1, None, False, False),
                ("blockwise", "BLOCKWISE", 1, 32, False, False), ("blockwise_axis0", "BLOCKWISE", 0, 32, False, True),
                ("blockwise_2d", "BLOCKWISE", 1, 32, True, False)]


def _quantiser_checks() -> None:  # pragma: no cover - runs in the subprocess
    """A second quantisation of a key takes its plans (no new bind) and gives the reference's
    bits, through every entry point: ``quantize_fp8`` (and its transposed copy),
    ``quantize_kmajor``, ``quantize_fp8_both`` and ``quantize_fp8_in_turn``."""
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity as G, quantize

    torch.manual_seed(11)
    e4 = torch.float8_e4m3fn
    launchers = (Q._QUANT_LAUNCHER, Q._AMAX_LAUNCHER, Q._AMAX_BOTH_LAUNCHER, Q._CAST_BOTH_LAUNCHER)

    def same(q, ref) -> bool:
        return (torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
                and torch.equal(q.scale.reshape(ref.scale.shape), ref.scale))

    def planned(make) -> tuple[bool, str]:
        """``make(x)`` twice on new inputs of one key: (second call bound nothing new and matched
        the reference, detail)."""
        make(torch.randn(40, 72))
        binds = [k.binds for k in launchers]
        x = torch.randn(40, 72)
        ok = make(x)
        new = [k.binds - b for k, b in zip(launchers, binds)]
        return ok and not any(new), f"new binds {new}"

    for name, g_name, axis, bs, b2d, transposed in _QUANT_CASES:
        g = G[g_name]

        def direct(x):
            x = x.t().contiguous().t() if transposed else x
            q, q_t = Q.quantize_fp8_with_transpose(x, e4, g, axis=axis, block_size=bs, block_2d=b2d)
            ref = quantize(x, e4, g, axis=axis, block_size=bs, block_2d=b2d)
            return (same(Q.quantize_fp8(x, e4, g, axis=axis, block_size=bs, block_2d=b2d), ref) and same(q, ref)
                    and torch.equal(q_t.data.view(torch.uint8), ref.data.t().contiguous().view(torch.uint8)))

        ok, detail = planned(direct)
        _emit(f"quantize_planned[{name}]", ok, detail)
        if axis == 1:
            def kmajor(x):
                x = x.t().contiguous().t() if transposed else x
                data, scale = Q.quantize_kmajor(x, e4, g, bs, b2d)
                ref = quantize(x, e4, g, axis=1, block_size=bs, block_2d=b2d)
                return torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(
                    scale.reshape(ref.scale.shape), ref.scale)

            ok, detail = planned(kmajor)
            _emit(f"kmajor_planned[{name}]", ok, detail)
    for g in (G.TENSORWISE, G.ROWWISE):
        def both(x):
            rows, cols = Q.quantize_fp8_both(x, e4, g)
            along_rows, along_cols = Q.quantize_fp8_in_turn(x, e4, g)
            ref_rows, ref_cols = quantize(x, e4, g, axis=1), quantize(x, e4, g, axis=0)
            return (same(rows, ref_rows) and same(cols, ref_cols) and same(along_rows(), ref_rows)
                    and same(along_cols(), ref_cols))

        ok, detail = planned(both)
        _emit(f"both_planned[{g.name}]", ok, detail)


def _fp8_adapter_checks() -> None:  # pragma: no cover - runs in the subprocess
    """TritonGemmFp8 lists a problem's candidates once, then runs from its plan: a later call of
    the same (problem, config) gives what a call with every cache emptied gives."""
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton import gemm as TG
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem

    torch.manual_seed(12)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    adapter = TG.TritonGemmFp8()
    listed = []
    candidates = adapter._candidates
    adapter._candidates = lambda p: listed.append(p) or candidates(p)
    for g, bs in ((G.TENSORWISE, None), (G.ROWWISE, None), (G.BLOCKWISE, 32)):
        w2d = g is G.BLOCKWISE
        x, w, grad = torch.randn(48, 64), torch.randn(40, 64), torch.randn(48, 40)
        fwd = gemm_fp8_problem(x, w, False, True, torch.float32, e4, e4, g, bs, False, w2d)
        dgrad = gemm_fp8_problem(grad, w, False, False, torch.float32, e5, e4, g, bs, False, w2d)
        for name, p, a, b in (("fwd", fwd, x, w), ("dgrad", dgrad, grad, w)):
            listed.clear()
            adapter.run(p, a, b)
            second = adapter.run(p, a, b)
            third = adapter.run(p, a, b)
            TG._FP8_PLANS.clear()
            for launcher in (FK.FP8_GEMM_LAUNCHER, Q._QUANT_LAUNCHER, Q._AMAX_LAUNCHER):
                launcher.clear()
            Q._LAYOUTS.clear()
            fresh = adapter.run(p, a, b)
            _emit(f"fp8_adapter_planned[{g.name}-{name}]",
                  len(listed) == 2 and torch.equal(second, third) and torch.equal(second, fresh),
                  f"candidate lists built {len(listed)} (want 2: first call, after clearing)")


_CPU_NAMES = (
    [f"gemm_planned[{dt}-{ta}{tb}-tma={tma}]" for dt in (torch.float16, torch.bfloat16) for ta in (0, 1)
     for tb in (0, 1) for tma in (None, False)]
    + [f"fp8_planned[{g}-tma={tma}]" for g in ("TENSORWISE", "ROWWISE", "BLOCKWISE") for tma in (None, False)]
    + [f"quantize_planned[{case[0]}]" for case in _QUANT_CASES]
    + [f"kmajor_planned[{case[0]}]" for case in _QUANT_CASES if case[2] == 1]
    + [f"both_planned[{g}]" for g in ("TENSORWISE", "ROWWISE")]
    + [f"fp8_adapter_planned[{g}-{name}]" for g in ("TENSORWISE", "ROWWISE", "BLOCKWISE") for name in ("fwd", "dgrad")]
)


@pytest.fixture(scope="module")
def _interpreter_results(interpreter_refusal) -> dict:
    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    return interpreter_checks(__file__)


@pytest.mark.parametrize("name", _CPU_NAMES)
def test_interpreter(_interpreter_results, name):
    assert_check_passed(_interpreter_results, name)


# -- GPU: the second call launches the compiled kernel ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False)])
def test_gpu_second_call_is_prebound_and_identical(ta, tb):
    from turbo_dispatch.backends.triton import gemm_kernels as GK
    from turbo_dispatch.backends.triton.gemm import TritonGemm
    from turbo_dispatch.ops.gemm import gemm_problem

    torch.manual_seed(3)
    m, n, k = 300, 260, 520
    a = torch.randn((k, m) if ta else (m, k), device="cuda").bfloat16()
    b = torch.randn((n, k) if tb else (k, n), device="cuda").bfloat16()
    p = gemm_problem(a, b, ta, tb, torch.bfloat16)
    adapter = TritonGemm()
    first = adapter.run(p, a, b)
    binds, hits = GK.GEMM_LAUNCHER.binds, GK.GEMM_LAUNCHER.hits
    second = adapter.run(p, a, b)
    torch.cuda.synchronize()
    assert (GK.GEMM_LAUNCHER.binds, GK.GEMM_LAUNCHER.hits) == (binds, hits + 1), "the second call must be planned"
    tile = adapter.configs(p)[0]
    from turbo_dispatch.backends.triton import configs as C

    plan = GK.GEMM_LAUNCHER.plan(GK.launch_key(a, b, ta, tb, torch.bfloat16, C.from_tuple(tile), None))
    assert plan is not None and plan.direct, "on a GPU the plan launches the compiled kernel"
    assert torch.equal(first, second)
    ref = (a.t() if ta else a).float() @ (b.t() if tb else b).float()
    assert float((second.float() - ref).norm() / ref.norm()) < 2e-2
    # Another input of the same key (a new address) through the plan.
    a2 = torch.randn_like(a)
    ref2 = (a2.t() if ta else a2).float() @ (b.t() if tb else b).float()
    out2 = adapter.run(p, a2, b)
    assert float((out2.float() - ref2).norm() / ref2.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise"])
def test_gpu_fp8_second_call_is_prebound_and_identical(granularity):
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem

    torch.manual_seed(4)
    g = G(granularity)
    bs = 128 if g is G.BLOCKWISE else None
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    e4 = torch.float8_e4m3fn
    p = gemm_fp8_problem(a, b, False, True, torch.bfloat16, e4, e4, g, bs, False, g is G.BLOCKWISE)
    adapter = TritonGemmFp8()
    from turbo_dispatch.backends.triton import configs as C

    tile = next(c for c in adapter.configs(p) if C.from_tuple(c).kernel == C.KERNEL_TRITON)  # not a Gluon one
    first = adapter.run(p, a, b, config=tile)
    binds, hits = FK.FP8_GEMM_LAUNCHER.binds, FK.FP8_GEMM_LAUNCHER.hits
    second = adapter.run(p, a, b, config=tile)
    torch.cuda.synchronize()
    assert FK.FP8_GEMM_LAUNCHER.binds == binds and FK.FP8_GEMM_LAUNCHER.hits == hits + 1
    assert torch.equal(first, second)
    ref = a.double() @ b.double().t()
    noise = float((second.double() - ref).pow(2).sum())
    assert 10 * torch.log10(torch.tensor(float(ref.pow(2).sum()) / noise)) >= 25


@pytest.mark.gpu
@pytest.mark.parametrize("granularity, block_2d, transposed", [
    ("tensorwise", False, False), ("rowwise", False, False), ("rowwise", False, True),
    ("blockwise", False, False), ("blockwise", True, False), ("blockwise", False, True)])
def test_gpu_quantiser_second_call_is_prebound_and_identical(granularity, block_2d, transposed):
    """The quantiser's launches (``quantize_kmajor``, as both fp8 GEMM adapters' quantisers call
    ``_run``) take the compiled kernel directly from the second call of a key, with the
    reference's bits; so do ``quantize_fp8_both``'s."""
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity as G, quantize

    torch.manual_seed(5)
    g = G(granularity)
    bs = 128 if g is G.BLOCKWISE else None
    e4 = torch.float8_e4m3fn

    def make():
        x = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)
        return x.t().contiguous().t() if transposed else x

    Q.quantize_kmajor(make(), e4, g, bs, block_2d)
    binds = Q._QUANT_LAUNCHER.binds, Q._AMAX_LAUNCHER.binds
    x = make()
    data, scale = Q.quantize_kmajor(x, e4, g, bs, block_2d)
    torch.cuda.synchronize()
    assert (Q._QUANT_LAUNCHER.binds, Q._AMAX_LAUNCHER.binds) == binds, "the second call must be planned"
    key = Q._run_key(x, e4, g, 1, bs, block_2d, False, 16, g is G.BLOCKWISE and not block_2d, None)
    assert Q._QUANT_LAUNCHER.plan(key).direct, "on a GPU the plan launches the compiled kernel"
    ref = quantize(x, e4, g, axis=1, block_size=bs, block_2d=block_2d)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale.reshape(ref.scale.shape), ref.scale)
    if g is not G.BLOCKWISE:
        Q.quantize_fp8_both(make(), e4, g)
        binds = Q._AMAX_BOTH_LAUNCHER.binds, Q._CAST_BOTH_LAUNCHER.binds
        rows, cols = Q.quantize_fp8_both(x, e4, g)
        assert (Q._AMAX_BOTH_LAUNCHER.binds, Q._CAST_BOTH_LAUNCHER.binds) == binds
        ref_cols = quantize(x, e4, g, axis=0)
        assert torch.equal(rows.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(cols.data.view(torch.uint8), ref_cols.data.view(torch.uint8))
        assert torch.equal(cols.scale, ref_cols.scale)


@pytest.mark.gpu
def test_gpu_pinned_triton_op_calls_are_prebound():
    """Through the op with TRITON pinned in code: every call after the first of a key takes the
    plan, and each reads its own operands."""
    import turbo_dispatch as turbo
    from turbo_dispatch.backends.triton import gemm_kernels as GK

    turbo.GlobalBackendManager.set_gemm_backend("TRITON")
    pairs = [(torch.randn(16, 16, device="cuda").bfloat16(), torch.randn(16, 16, device="cuda").bfloat16())
             for _ in range(6)]
    turbo.ops.gemm(*pairs[0])
    binds, hits = GK.GEMM_LAUNCHER.binds, GK.GEMM_LAUNCHER.hits
    for x, y in pairs[1:]:
        got, want = turbo.ops.gemm(x, y).float(), x.float() @ y.float()
        assert float((got - want).norm() / want.norm()) < 2e-2
    assert (GK.GEMM_LAUNCHER.binds, GK.GEMM_LAUNCHER.hits) == (binds, hits + 5)


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    _interpreter_checks()
