"""What the GPU probes share: a JSON-lines record kept on disk as it grows, and CUDA-event timing.

    log = Jsonl(out_path, gpu=torch.cuda.get_device_name())
    log({"probe": "time", "ms": event_ms(fn, 20)})
    graph = capture_graph(step, warmups=2)  # then graph.replay()
    with Smi("power.draw,clocks.sm") as smi:
        ...  # the work
    watts = smi.median(0)
"""
from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any, Callable

import torch


class Jsonl:
    """Records written to ``path`` one JSON object per line, each also printed, the file rewritten
    after every record so that a run cut by its time limit keeps what it measured. ``common``
    fields (the GPU's name, say) go into every record."""

    def __init__(self, path: Path, **common: Any):
        self.path, self.common, self.lines = Path(path), common, []
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict) -> None:
        self.lines.append(json.dumps({**record, **self.common}))
        print(self.lines[-1], flush=True)
        self.path.write_text("\n".join(self.lines) + "\n")


def event_ms(fn: Callable[[], Any], reps: int) -> float:
    """Mean milliseconds of ``reps`` back-to-back calls of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def capture_graph(fn: Callable[[], Any], warmups: int, empty_cache: bool = False) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after ``warmups`` eager calls on a side stream (kernels
    compiled and decisions resolved outside the capture, on a stream other than the legacy one).
    ``empty_cache`` returns the allocator's cached blocks first, so that none is freed mid-capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


class Smi:
    """``nvidia-smi`` sampling the query ``fields`` every ``ms`` milliseconds while the ``with``
    block runs; afterwards ``rows`` holds one list of field strings per sample."""

    def __init__(self, fields: str, ms: int = 50):
        self.fields, self.ms, self.rows = fields, ms, []
        self._proc = None

    def __enter__(self) -> "Smi":
        self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.fields}", "--format=csv,noheader,nounits",
                                       "-lms", str(self.ms)], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        out, _ = self._proc.communicate()
        width = len(self.fields.split(","))
        self.rows = [[v.strip() for v in line.split(",")] for line in out.strip().splitlines()
                     if line.count(",") == width - 1]

    def values(self, i: int) -> list[float]:
        """Field ``i`` of every sample that reads as a number."""
        out = []
        for row in self.rows:
            try:
                out.append(float(row[i]))
            except ValueError:  # "[N/A]" and the like
                pass
        return out

    def median(self, i: int) -> float | None:
        v = self.values(i)
        return statistics.median(v) if v else None
