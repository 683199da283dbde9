"""On a real GPU: CUDA graph capture uses tuned decisions and never profiles; replays are correct."""
import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import autotune

pytestmark = pytest.mark.gpu


def test_capture_uses_tuned_decision_and_replays_correctly():
    turbo.GlobalBackendManager.set_auto_tune(True)
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    eager = turbo.ops.gemm(a, b, trans_b=True)  # tunes this key
    assert turbo.explain("gemm", a, b, trans_b=True).source == "autotune"
    profiled = autotune.STATS["keys_profiled"]
    turbo_dispatch_resolver = __import__("turbo_dispatch.resolver", fromlist=["clear_cache"])
    turbo_dispatch_resolver.clear_cache()  # the tuned store, not the decision cache, must answer

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        turbo.ops.gemm(a, b, trans_b=True)  # warm-up on the capture stream, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = turbo.ops.gemm(a, b, trans_b=True)
        fresh = turbo.ops.gemm(a[:200], b, trans_b=True)  # an untuned key: default, no profiling
    assert autotune.STATS["keys_profiled"] == profiled
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    ref = a.float() @ b.float().t()
    assert ((captured.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((fresh.float() - ref[:200]).norm() / ref[:200].norm()).item() < 1e-2
    assert not torch.equal(captured, eager)  # the replay really recomputed with the new a
    # After capture, the untuned key gets tuned on its next eager call.
    assert turbo.explain("gemm", a[:200], b, trans_b=True).source == "autotune"
    assert autotune.STATS["keys_profiled"] == profiled + 1


def test_capture_in_a_fresh_process_state_uses_the_tuning_db(tmp_path):
    """The DB (not this process's memory) answers during capture: memory is wiped first."""
    from turbo_dispatch.tuning import store
    from turbo_dispatch.tuning.database import contents_of, result_for
    from turbo_dispatch.ops.gemm import GEMM

    a = torch.randn(320, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(192, 256, device="cuda", dtype=torch.bfloat16)
    problem = turbo.explain("gemm", a, b, trans_b=True).problem
    entry = next(e for e in __import__("turbo_dispatch.registry", fromlist=["x"]).get_registry().backends("gemm")
                 if e.name == "TORCH")
    db = tmp_path / "gpu.jsonl"
    record = autotune.TuneRecord("TORCH", None, 0.01, timings=(("TORCH", 0.01),))
    store.update(db, contents_of([result_for(GEMM, problem, record, [entry])]))
    turbo.GlobalBackendManager.reset()  # forget every in-memory result and decision
    turbo.GlobalBackendManager.set_tune_db(db)
    turbo.GlobalBackendManager.set_auto_tune(True)
    runs = autotune.STATS["candidate_runs"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.matmul(a, b.t())  # warm cuBLAS on the capture stream without resolving our key
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = turbo.ops.gemm(a, b, trans_b=True)
    decision = turbo.explain("gemm", a, b, trans_b=True)
    assert (decision.source, decision.provisional) == ("tuned-db", False)
    assert autotune.STATS["candidate_runs"] == runs
    graph.replay()
    torch.cuda.synchronize()
    ref = a.float() @ b.float().t()
    assert ((captured.float() - ref).norm() / ref.norm()).item() < 1e-2
