"""The persistent kernels' zeroed work-item counters (backends/triton/work_counters.py)."""
import pytest
import torch

from turbo_dispatch.backends.triton import work_counters
from turbo_dispatch.backends.triton.work_counters import _Pool, zeroed_counter


def test_pool_hands_out_distinct_aligned_slots_and_refills_each_cycle():
    pool = _Pool(torch.device("cpu"), slots=5)
    first = [pool.take() for _ in range(5)]
    assert len({v.data_ptr() for v in first}) == 5
    assert all(v.data_ptr() % 16 == 0 and v.shape == (1,) and v.dtype == torch.int32 for v in first)
    assert all(v.item() == 0 for v in first)
    for i, v in enumerate(first):  # launches counted their work items
        v.fill_(100 + i)
    again = pool.take()  # a new cycle: the whole buffer is zeroed before its first slot is reused
    assert again.data_ptr() == first[0].data_ptr()
    assert int(pool.buffer.abs().sum()) == 0
    assert [pool.take().data_ptr() for _ in range(4)] == [v.data_ptr() for v in first[1:]]


@pytest.mark.gpu
def test_gpu_counters_per_stream_and_fresh_under_capture(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(work_counters, "_pools", {})
    main = zeroed_counter(torch.device("cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = zeroed_counter(torch.device("cuda"))
    assert main.data_ptr() != other.data_ptr() and len(work_counters._pools) == 2
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        captured = zeroed_counter(torch.device("cuda"))
        captured.add_(5)
    assert len(work_counters._pools) == 2  # no buffer was made inside the capture
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert captured.item() == 5  # the graph zeroes it on every replay
