"""Tuning-DB files are shared across a cluster: reading or writing one must never block, replace
a non-file, follow a planted symbolic link, or let one hostile line disable the rest."""
from __future__ import annotations

import json
import os
import threading

import pytest

from turbo_dispatch.tuning import store

HEADER = json.dumps({"type": "header", "format": store.FORMAT, "version": store.VERSION})


def _one_key(m: int) -> store.Contents:
    contents = store.Contents()
    key = {"m": m}
    contents.keys[("gemm", store.key_text(key))] = key
    return contents


def test_device_node_is_never_replaced(tmp_path):
    # os.replace over a device node would turn it into a regular file (as root: /dev/null).
    with pytest.raises(store.TuningDBPathError, match="character device"):
        store.update("/dev/null", _one_key(1))
    assert not os.path.isfile("/dev/null")


def test_directory_is_refused(tmp_path):
    with pytest.raises(store.TuningDBPathError, match="directory"):
        store.update(tmp_path, _one_key(1))


def test_symlinked_user_db_writes_through_to_its_target(tmp_path):
    team = tmp_path / "team.jsonl"
    store.update(team, _one_key(1))
    link = tmp_path / "mine.jsonl"
    link.symlink_to(team)
    store.update(link, _one_key(2))
    assert link.is_symlink(), "the link was replaced by a private copy"
    assert len(store.parse(team.read_text()).keys) == 2


def test_fifo_is_skipped_on_read_and_refused_on_write(tmp_path):
    fifo = tmp_path / "db.jsonl"
    os.mkfifo(fifo)
    done = threading.Event()

    def read_it():
        assert not store.read(fifo).results
        done.set()

    reader = threading.Thread(target=read_it, daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert done.is_set(), "reading a FIFO blocked"
    with pytest.raises(store.TuningDBPathError, match="FIFO"):
        store.update(fifo, _one_key(1))


@pytest.mark.parametrize("sidecar", [".lock", ".corrupt"])
def test_sidecars_never_follow_symlinks(tmp_path, sidecar):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    db = tmp_path / "db.jsonl"
    db.write_text(HEADER + "\nnot json\n")
    (tmp_path / ("db.jsonl" + sidecar)).symlink_to(victim)
    with pytest.raises(store.TuningDBPathError, match="symbolic link"):
        store.update(db, _one_key(1))
    assert victim.read_text() == "untouched\n"


def test_deeply_nested_line_costs_only_that_line(tmp_path):
    nested = '{"type": "key", "op": "gemm", "key": ' + '{"a": ' * 20000 + "1" + "}" * 20000 + "}"
    good = json.dumps({"type": "key", "op": "gemm", "key": {"m": 3}})
    contents = store.parse("\n".join([HEADER, "[" * 200000 + "]" * 200000, nested, good]))
    assert len(contents.keys) == 1
    assert sum(contents.skipped.values()) == 2
    assert all("RecursionError" in why for why in contents.skipped)
    db = tmp_path / "db.jsonl"
    db.write_text("\n".join([HEADER, nested, good]) + "\n")
    written = store.update(db, _one_key(4))
    assert len(written.keys) == 2
    assert (tmp_path / "db.jsonl.corrupt").read_text().count("\n") == 1


# -- entries are judged against the adapter that would run them ---------------------------------------
def _judge(config, backend="TORCH"):
    import torch

    from turbo_dispatch.ops.gemm import gemm_problem
    from turbo_dispatch.registry import get_registry
    from turbo_dispatch.tuning import database
    from turbo_dispatch.tuning.codec import encode_config, encode_key
    from turbo_dispatch.tuning.stamp import current_stamp

    problem = gemm_problem(torch.empty(8, 5), torch.empty(5, 6))
    stamp = current_stamp("cpu")
    adapter = get_registry().get("gemm", backend).adapter
    result = store.Result(stamp.id, "gemm", encode_key(problem), backend, encode_config(config),
                          adapter.identity(config), 1.0)
    return database.judge(result, {stamp.id: stamp})


@pytest.mark.parametrize("config", [(3, 99999999999), (3, 64, 64, 8, 3, 4), "fast", 7])
def test_a_config_the_adapter_does_not_offer_is_skipped_with_a_reason(config):
    verdict = _judge(config)
    assert verdict.reason is not None and verdict.reason.startswith("invalid config for TORCH"), verdict


def test_the_adapters_own_configs_pass():
    assert _judge(None).reason is None


@pytest.mark.parametrize("var", ["PRIMUS_TURBO_RECORD_UNTUNED", "PRIMUS_TURBO_TUNE_DB"])
def test_env_paths_naming_a_device_leave_it_alone(monkeypatch, var):
    """A job pointed at /dev/null keeps running (the write is refused with a warning) and the
    device node stays a device node."""
    import stat

    import torch

    from turbo_dispatch import GlobalBackendManager, ops

    monkeypatch.setenv(var, "/dev/null")
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    GlobalBackendManager.reset()
    try:
        ops.gemm(torch.randn(33, 17), torch.randn(17, 9))
    finally:
        monkeypatch.undo()
        GlobalBackendManager.reset()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
