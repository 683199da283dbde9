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
