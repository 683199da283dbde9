"""Shared test setup: clean backend settings per test, per-test seeds, and the ``device`` fixture.

* Every test starts and ends with ``GlobalBackendManager.reset()``: the settings snapshot the
  ``PRIMUS_TURBO_*`` environment variables, and ``reset()`` drops code settings, re-reads the
  environment and clears cached decisions, so no test sees another's choices. Fixtures that use
  ``monkeypatch`` are set up after this one and therefore torn down before it: the final reset
  re-reads the environment as monkeypatch restored it.
* Every test gets its own writable tuning DB under its tmp_path (``PRIMUS_TURBO_TUNE_DB``) and
  the package's shipped DBs switched off (``PRIMUS_TURBO_TUNE_DB_SHIPPED=0``).
* Every test gets its own deterministic seed (from its node id), so a failure reproduces when
  the test runs alone. ``TURBO_TEST_SEED=<int>`` shifts all seeds (to check a margin is not luck).
* ``gluon_off_here`` makes a test see a machine where the Gluon kernels cannot run, on any host;
  ``interpreter_refusal`` says why this triton's interpreter cannot run our kernels (None: it can).
* ``device`` runs a test on the CPU and, as a ``gpu``-marked param, on CUDA. ``@pytest.mark.gpu``
  tests (and the CUDA params) are skipped when ``torch.cuda.is_available()`` is False. The
  ``gpu``/``slow`` markers themselves are declared in pyproject.toml.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import zlib

import pytest
import torch

import turbo_dispatch

#: Params for a device-parametrized test: ``@pytest.mark.parametrize("device", DEVICES)``, or
#: just take the ``device`` fixture below.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu", and "cuda" (marked ``gpu``, so skipped without a GPU)."""
    return request.param


_DB_ENV = {"PRIMUS_TURBO_TUNE_DB": None, "PRIMUS_TURBO_TUNE_DB_SHIPPED": "0",
           "PRIMUS_TURBO_TUNE_DB_PATH": None, "PRIMUS_TURBO_RECORD_UNTUNED": None}


@pytest.fixture(autouse=True)
def _reset_backend_settings(tmp_path):
    # No test may read or write the user's real tuning DB, and the DBs shipped in the package
    # stay out of the way unless a test turns them back on. (Not via monkeypatch: this fixture
    # must tear down after the test's own monkeypatch has restored the environment.)
    saved = {var: os.environ.get(var) for var in _DB_ENV}
    for var, value in _DB_ENV.items():
        os.environ.pop(var, None)
        if value is not None:
            os.environ[var] = value
    os.environ["PRIMUS_TURBO_TUNE_DB"] = str(tmp_path / "user_tuning.jsonl")
    try:
        turbo_dispatch.GlobalBackendManager.reset()
        yield
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value
    turbo_dispatch.GlobalBackendManager.reset()


@pytest.fixture(autouse=True)
def _seed(request):
    base = int(os.environ.get("TURBO_TEST_SEED", "0"))
    torch.manual_seed((zlib.crc32(request.node.nodeid.encode()) + base) % (2**31))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """torch._dynamo state reset around a torch.compile test, so cases do not share graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def gluon_off_here(monkeypatch):
    """For tests of what happens where the Gluon kernels cannot run: on a CPU-only machine they
    already cannot; on an sm_90 GPU host they are switched off with their env switch, so the same
    assertions hold there (the refusal then names the switch, not the missing GPU)."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GLK

    if GLK.available() is None:
        monkeypatch.setenv(GLK.GLUON_ENV, "0")
    return GLK.available()


_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _loop_over_a_scalar_argument(out_ptr, n):
    for i in range(n):
        tl.store(out_ptr + i, i)

out = torch.zeros(3, dtype=torch.int32)
_loop_over_a_scalar_argument[(1,)](out, 3)
assert out.tolist() == [0, 1, 2], out
"""


@functools.lru_cache(maxsize=1)
def _interpreter_refusal() -> str | None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 0:
        return None
    import numpy
    import triton

    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return (f"triton {triton.__version__}'s interpreter cannot loop over a scalar kernel argument with "
            f"numpy {numpy.__version__} (probe: {last[:200]}); the compiled kernels' GPU tests cover this host")


@pytest.fixture(scope="session")
def interpreter_refusal() -> str | None:
    """Why the Triton interpreter of this environment cannot run our kernels, or None. Seen on
    triton 3.6 with numpy 2.4 (the GPU image): its interpreter takes ``int()`` of a one-element
    array for a scalar argument's ``__index__``, which that numpy refuses; triton 3.9 runs it."""
    pytest.importorskip("triton")
    return _interpreter_refusal()
