"""Every environment error names the variable and its valid values, never a bare Python error."""
from __future__ import annotations

import pytest

from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.autotune import BUDGET_ENV, CONSENSUS_ENV, _budget_s, consensus_enabled
from turbo_dispatch.env import parse_backend_setting
from turbo_dispatch.errors import ConfigError


@pytest.mark.parametrize("value", ["fp32:", "fp8: ,bf16:torch", ":"])
def test_item_without_a_backend_names_the_variable(value):
    with pytest.raises(ConfigError, match=r"PRIMUS_TURBO_GEMM_BACKEND=.*names no backend; valid backends: .*TORCH"):
        parse_backend_setting(value, "PRIMUS_TURBO_GEMM_BACKEND", set())


def test_empty_precision_item_errors_on_use(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp32:")
    try:
        with pytest.raises(ConfigError, match="PRIMUS_TURBO_GEMM_BACKEND"):
            GlobalBackendManager.reset()
    finally:
        monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND")
        GlobalBackendManager.reset()


@pytest.mark.parametrize("value", ["abc", "-5", "inf", "nan"])
def test_bad_tune_budget_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(BUDGET_ENV, value)
    with pytest.raises(ConfigError, match=rf"{BUDGET_ENV}='{value}': expected a number >= 0"):
        _budget_s()


def test_tune_budget_default_and_value(monkeypatch):
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert _budget_s() == 3.0
    monkeypatch.setenv(BUDGET_ENV, "250")
    assert _budget_s() == 0.25


def test_bad_consensus_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(CONSENSUS_ENV, "sometimes")
    with pytest.raises(ConfigError, match=f"{CONSENSUS_ENV}='sometimes': expected one of 1/0"):
        consensus_enabled()


def test_backend_env_edited_in_a_running_process_counts_on_the_next_call(monkeypatch):
    """No reset(): the next call sees the new PRIMUS_TURBO_GEMM_BACKEND text, and a bad edit
    raises an error naming the variable on that call."""
    import torch

    import turbo_dispatch as turbo

    a, b = torch.randn(8, 5), torch.randn(5, 6)
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND", raising=False)
    GlobalBackendManager.reset()
    assert turbo.explain("gemm", a, b).source == "default"
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "torch")
    decision = turbo.explain("gemm", a, b)
    assert (decision.backend, decision.source) == ("TORCH", "env")
    turbo.ops.gemm(a, b)
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "nonesuch")
    with pytest.raises(ConfigError, match="PRIMUS_TURBO_GEMM_BACKEND='nonesuch'"):
        turbo.ops.gemm(a, b)
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND")
    assert turbo.explain("gemm", a, b).source == "default"
    import os  # a plain edit of os.environ, as a user's script makes it, counts the same way

    os.environ["PRIMUS_TURBO_GEMM_BACKEND"] = "torch"
    try:
        assert turbo.explain("gemm", a, b).source == "env"
    finally:
        del os.environ["PRIMUS_TURBO_GEMM_BACKEND"]
    assert turbo.explain("gemm", a, b).source == "default"
    GlobalBackendManager.reset()


def test_env_reader_sees_every_edit_of_os_environ(monkeypatch):
    from turbo_dispatch.env import env_reader

    read = env_reader("PRIMUS_TURBO_TEST_READER")
    monkeypatch.delenv("PRIMUS_TURBO_TEST_READER", raising=False)
    unset = read()
    assert unset is None
    monkeypatch.setenv("PRIMUS_TURBO_TEST_READER", "a")
    first = read()
    monkeypatch.setenv("PRIMUS_TURBO_TEST_READER", "b")
    assert read() != first and read() == read() and first is not None
    monkeypatch.setenv("PRIMUS_TURBO_TEST_READER", "a")
    assert read() == first
    monkeypatch.delenv("PRIMUS_TURBO_TEST_READER")
    assert read() is None
