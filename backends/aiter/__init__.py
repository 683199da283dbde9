"""AITER backends: AMD's AI Tensor Engine for ROCm (``amd-aiter``, import name ``aiter``), driven
through its published Python entry points. Optional: imported lazily by ``available()``, which
refuses PyPI's unrelated ``aiter`` package with that reason. None of these adapters has run on
AMD hardware yet (docs/rocm.md)."""
