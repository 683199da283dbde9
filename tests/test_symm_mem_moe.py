"""The SYMM_MEM MoE backend.

* Its protocol and kernels on the CPU: W simulated ranks in one process (tests/symm_mem_fake.py),
  the backend's phase generators run in lockstep and its Triton kernels under the interpreter (one
  subprocess, since TRITON_INTERPRET must be set before triton is imported), checked against what
  each rank must receive (tests/moe_checks.py's reference) and against a float64/fp32 combine.
* Its refusals on a CPU-only process.
* The NCCL contract checks with SYMM_MEM pinned run on GPUs through
  ``benchmarks/probes/moe_gpu_check.py --backend SYMM_MEM`` (qa/multi_gpu.sh).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from subprocess_results import assert_check_passed, collect_results

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden=33, topk=3, local_experts=3)
_HALF_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


# -- the interpreter side (runs in the subprocess) ----------------------------------------------------
def _problem(case, world, dtype, with_probs, worst):
    from turbo_dispatch.ops.moe import MoeDispatchProblem

    return MoeDispatchProblem(case.x.shape[1], case.idx.shape[1], case.num_experts, world, dtype, with_probs, worst,
                              "cpu")


def _kept(cases, world, worst):
    """kept[s][t] = destination ranks whose receive buffer holds token t of rank s."""
    local = cases[0].num_experts // world
    kept = [[[] for _ in c.idx.tolist()] for c in cases]
    for r in range(world):
        pos = 0
        for s, case in enumerate(cases):
            for t, row in enumerate(case.idx.tolist()):
                if any(v >= 0 and v // local == r for v in row):
                    if not worst or pos < worst:
                        kept[s][t].append(r)
                    pos += 1
    return kept


def _round_trip(world, seed, dtype=torch.float64, probs_dtype=torch.float32, worst=0, with_probs=True, sizes=SMALL,
                tokens=None):
    import moe_checks
    from symm_mem_fake import FakeFabric, lockstep

    from turbo_dispatch.backends.symm_mem import moe as SM

    cases = [moe_checks.Case(seed, s, world, **sizes, **({"tokens": tokens} if tokens else {}))
             for s in range(world)]
    fabric = FakeFabric(world)
    xs = [c.x.to(dtype) for c in cases]
    probs = [c.probs.to(probs_dtype) if with_probs else None for c in cases]
    p = _problem(cases[0], world, dtype, with_probs, worst)
    out = lockstep(fabric, [SM.dispatch_phases(fabric.arenas[r], p, xs[r], cases[r].idx, probs[r])
                            for r in range(world)])
    for r in range(world):
        want = moe_checks.Expected(cases, r, world)
        recv_x, recv_idx, recv_probs, counts, layout = out[r]
        total = want.x.shape[0]
        m = min(total, worst) if worst else total
        rows = worst or total
        assert recv_x.shape == (rows, xs[r].shape[1]) and recv_x.dtype == dtype, (r, recv_x.shape)
        assert torch.equal(recv_x[:m], want.x[:m].to(dtype)), f"rank {r}: recv_x"
        assert torch.equal(recv_idx[:m], want.idx[:m]), f"rank {r}: recv_idx"
        if with_probs:
            assert torch.equal(recv_probs[:m], want.probs[:m].to(probs_dtype)), f"rank {r}: recv_probs"
        else:
            assert recv_probs is None
        if worst:
            assert bool((recv_x[m:] == 0).all()) and bool((recv_idx[m:] == -1).all()), f"rank {r}: padding"
            assert int(layout.num_recv) == total, (r, int(layout.num_recv), total)
            named = [int(v) for v in recv_idx[:m].reshape(-1) if v >= 0]
            assert counts.tolist() == [named.count(e) for e in range(len(want.counts))], f"rank {r}: counts"
        else:
            assert counts == want.counts and layout.num_recv == total, f"rank {r}: counts"
    ys = [o[0] * 3 if dtype != torch.float8_e4m3fn else o[0] for o in out]
    if dtype in (torch.float8_e4m3fn,):
        return fabric, cases, out
    combined = lockstep(fabric, [SM.combine_phases(out[r][4], ys[r]) for r in range(world)])
    kept = _kept(cases, world, worst)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for s in range(world):
        # every destination returns the same rounded row (x * 3 in x's dtype); adding it c times in
        # acc is exact for these small c, so the reference is exact too
        ref = (xs[s] * 3).to(acc) * torch.tensor([len(k) for k in kept[s]], dtype=acc)[:, None]
        assert combined[s].dtype == dtype, f"rank {s}: combine dtype"
        if dtype in _HALF_ULP:  # the interpreter rounds fp32 -> 16-bit toward zero; GPUs round to nearest
            assert torch.allclose(combined[s].to(acc), ref, rtol=_HALF_ULP[dtype], atol=0), f"rank {s}: combine"
        else:
            assert torch.equal(combined[s], ref.to(dtype)), f"rank {s}: combine"
    again = lockstep(fabric, [SM.dispatch_rows_phases(out[r][4], xs[r] * 2) for r in range(world)])
    for r in range(world):
        assert torch.equal(again[r], out[r][0] * 2), f"rank {r}: cached dispatch"
    return fabric, cases, out


def _check_bad_ids():
    import moe_checks
    from symm_mem_fake import FakeFabric, lockstep

    from turbo_dispatch.backends.symm_mem import moe as SM

    world = 2
    cases = [moe_checks.Case(6, s, world, **SMALL) for s in range(world)]
    cases[1].idx[0, 0] = cases[1].num_experts  # one id past the end, on rank 1 only
    fabric = FakeFabric(world)
    gens = [SM.dispatch_phases(fabric.arenas[r], _problem(cases[r], world, torch.float64, False, 0), cases[r].x,
                               cases[r].idx, None) for r in range(world)]
    fabric.grow(1)  # sized up front, so each rank's first step is the count phase's barrier
    errors = []
    for g in gens:  # both ranks get through the count phase, then both raise
        assert next(g) == "barrier"
    for r, g in enumerate(gens):
        try:
            g.send(None)
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 2 and all("rank 1" in e and "num_experts" in e for e in errors), errors


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    sys.path.insert(0, str(ROOT / "tests"))
    checks = {
        "w3-fp64-sync": lambda: _round_trip(3, 1),
        "w3-fp64-worst": lambda: _round_trip(3, 2, worst=7),
        "w4-bf16-bf16probs": lambda: _round_trip(4, 3, dtype=torch.bfloat16, probs_dtype=torch.bfloat16),
        "w2-fp32-noprobs-worst-roomy": lambda: _round_trip(2, 4, dtype=torch.float32, with_probs=False, worst=64),
        "w1-fp16": lambda: _round_trip(1, 5, dtype=torch.float16),
        "w3-fp8-odd-hidden": lambda: _round_trip(3, 6, dtype=torch.float8_e4m3fn,
                                                 sizes=dict(hidden=35, topk=2, local_experts=2)),
        # more tokens than one routing block (256 at top-8 of 2 ranks): positions carry across blocks
        "w2-blocks": lambda: _round_trip(2, 7, dtype=torch.float32, sizes=dict(hidden=8, topk=8, local_experts=5),
                                         tokens=(600, 517)),
        "w2-blocks-worst": lambda: _round_trip(2, 8, dtype=torch.float32, sizes=dict(hidden=8, topk=8,
                                                                                      local_experts=5),
                                               tokens=(600, 517), worst=700),
        "bad-ids": _check_bad_ids,
    }
    for name, fn in checks.items():
        try:
            fn()
            print("RESULT " + json.dumps({"name": name, "ok": True, "detail": ""}), flush=True)
        except Exception:
            print("RESULT " + json.dumps({"name": name, "ok": False, "detail": traceback.format_exc()[-3000:]}),
                  flush=True)


_NAMES = ["w3-fp64-sync", "w3-fp64-worst", "w4-bf16-bf16probs", "w2-fp32-noprobs-worst-roomy", "w1-fp16",
          "w3-fp8-odd-hidden", "w2-blocks", "w2-blocks-worst", "bad-ids"]


@pytest.fixture(scope="module")
def _interpreter_results(interpreter_refusal) -> dict:
    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, __file__, "--interpreter-checks"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    return collect_results(proc)


@pytest.mark.parametrize("name", _NAMES)
def test_interpreter(_interpreter_results, name):
    assert_check_passed(_interpreter_results, name)


# -- host-side facts ----------------------------------------------------------------------------------
def test_registered_for_cuda_with_reasons_elsewhere():
    from turbo_dispatch import registry
    from turbo_dispatch.backends.symm_mem.moe import SymmMemMoeDispatchCombine
    from turbo_dispatch.ops.moe import MoeDispatchProblem

    names = [e.name for e in registry.get_registry().backends("moe_dispatch_combine")]
    assert "SYMM_MEM" in names
    adapter = SymmMemMoeDispatchCombine()
    p = MoeDispatchProblem(7168, 8, 256, 2, torch.bfloat16, True, 0, "rocm", True)
    assert "CUDA" in adapter.supports(p)
    assert adapter.supports(p._replace(platform="cuda")) is None
    assert "not all on this host" in adapter.supports(p._replace(platform="cuda", intranode=False))
    if not torch.cuda.is_available():
        assert "CUDA" in adapter.available()
    assert "host read" in adapter.describe(p) and "no host read" in adapter.describe(p._replace(num_worst_tokens=64))


def test_cuda_default_is_symm_mem_then_torch():
    from turbo_dispatch import registry
    from turbo_dispatch.ops.moe import MOE_DISPATCH_COMBINE, MoeDispatchProblem
    from turbo_dispatch.resolver import resolve

    assert registry.get_registry().default_chain("moe_dispatch_combine", "cuda") == ("SYMM_MEM", "TORCH")
    across_hosts = MoeDispatchProblem(7168, 8, 256, 2, torch.bfloat16, True, 0, "cuda", False)
    d = resolve(MOE_DISPATCH_COMBINE, across_hosts)
    assert d.backend == "TORCH" and d.source == "default", d
    assert any("platform default SYMM_MEM rejected" in n for n in d.notes), d.notes
    assert registry.get_registry().default_for("moe_dispatch_combine", "cuda", across_hosts) == "TORCH"
    one_host = resolve(MOE_DISPATCH_COMBINE, across_hosts._replace(intranode=True))
    want = "SYMM_MEM" if registry.get_registry().get("moe_dispatch_combine", "SYMM_MEM").check(
        one_host.problem, "cuda") is None else "TORCH"
    assert one_host.backend == want and one_host.source == "default", one_host


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        _interpreter_checks()
