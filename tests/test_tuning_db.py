"""The persistent tuning database: store, validation, layers, writers, autotune integration, CLI.

Multi-process properties (concurrent writers, SIGKILL mid-write, a second job reusing the DB)
run real child processes (tests/tunedb_worker.py). The fixture backends (tests/fixture_backends.py)
give the autotuner a slow-but-correct and a fast-but-wrong candidate whose speed the test controls.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, autotune
from turbo_dispatch.cli import main as cli
from turbo_dispatch.registry import get_registry, reload_registry
from turbo_dispatch.tuning import offline, store
from turbo_dispatch.tuning.codec import decode_key, encode_key
from turbo_dispatch.tuning.database import judge
from turbo_dispatch.tuning.report import inspect
from turbo_dispatch.tuning.stamp import Stamp, current_stamp

from plugin_registry import use_plugins

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tunedb_worker.py"

PLUGINS = """
version: 1
ops:
  gemm:
    backends:
      - name: SLOW
        adapter: fixture_backends:SlowGemm
        platforms: [cpu]
      - name: WRONG_FAST
        adapter: fixture_backends:WrongFastGemm
        platforms: [cpu]
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Registers the SLOW and WRONG_FAST fixture backends for gemm on the CPU."""
    yield use_plugins(tmp_path, monkeypatch, PLUGINS)
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    env["PRIMUS_TURBO_TUNE_DB_SHIPPED"] = "0"
    env["PRIMUS_TURBO_TUNE_DB"] = "off"  # never the user's real DB; tests that want one pass it
    env.update(extra)
    return env


def _worker(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


def _gemm_problem(m=8, n=6, k=5, dtype=torch.float32):
    from turbo_dispatch.ops.gemm import gemm_problem

    return gemm_problem(torch.empty(m, k, dtype=dtype), torch.empty(k, n, dtype=dtype))


def _contents_with(results: list[store.Result], stamp: Stamp | None = None) -> store.Contents:
    contents = store.Contents()
    stamp = stamp or current_stamp("cpu")
    contents.stamps[stamp.id] = stamp
    for result in results:
        contents.add_result(result)
    return contents


def _result(problem, backend="TORCH", time_ms=1.0, stamp=None, identity=None, config=None, op="gemm"):
    from turbo_dispatch.registry import get_registry

    stamp = stamp or current_stamp("cpu")
    if identity is None:
        identity = get_registry().get(op, backend).adapter.identity(config)
    return store.Result(stamp.id, op, encode_key(problem), backend, config, identity, time_ms)


# -- codec ------------------------------------------------------------------------------------------
def test_keys_round_trip_for_every_op_kind():
    from turbo_dispatch.op_spec import get_op_spec
    from turbo_dispatch.tuning.keys import OPS, model_keys

    keys = model_keys("tiny", OPS, "cpu")
    assert {op for op, _ in keys} == set(OPS)
    for op, problem in keys:
        encoded = json.loads(json.dumps(encode_key(problem)))
        assert decode_key(get_op_spec(op).problem_type, encoded) == problem


def test_key_with_other_fields_does_not_decode():
    from turbo_dispatch.ops.gemm import GemmProblem

    encoded = encode_key(_gemm_problem())
    encoded["accumulate"] = False  # a field this version's problem does not have
    with pytest.raises(ValueError, match="do not match"):
        decode_key(GemmProblem, encoded)


# -- writers ----------------------------------------------------------------------------------------
def test_eight_concurrent_writers_lose_nothing(tmp_path):
    db = tmp_path / "shared.jsonl"
    env = _env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "write_many", str(db), str(w), "15"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(8)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    contents = store.parse(db.read_text())
    assert not contents.skipped and contents.foreign is None
    written = {(r.key["m"], r.key["n"]) for r in contents.results.values()}
    assert written == {(w + 1, i + 1) for w in range(8) for i in range(15)}


def test_writer_killed_mid_write_leaves_a_valid_file(tmp_path):
    db = tmp_path / "killed.jsonl"
    env = _env()
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, str(WORKER), "write_forever", str(db), "3000"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3 + 0.17 * attempt)  # land the kill at different points of the write cycle
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        text = db.read_text()
        contents = store.parse(text)
        assert not contents.skipped, contents.skipped
        assert text.startswith('{"type": "header"') and text.endswith("\n")
        assert len(contents.results) >= 3000  # every complete version holds all 3000 base results
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # A killed writer may leave its temp file behind; it is never the DB itself and never read.
    assert all(name.startswith(".killed.jsonl.") for name in leftovers)


def test_merge_keeps_the_faster_measurement(tmp_path):
    problem = _gemm_problem()
    fast, slow = _result(problem, time_ms=0.5), _result(problem, time_ms=2.0)
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    store.update(a, _contents_with([slow]))
    store.update(b, _contents_with([fast]))
    assert cli(["db", "merge", "-o", str(out), str(a), str(b)]) == 0
    merged = store.parse(out.read_text())
    assert [r.time_ms for r in merged.results.values()] == [0.5]
    # and the other order, and a slower measurement merged later, keep it too
    store.update(out, _contents_with([slow]))
    assert [r.time_ms for r in store.parse(out.read_text()).results.values()] == [0.5]


def test_output_is_stable_and_sorted(tmp_path):
    results = [_result(_gemm_problem(m=m), time_ms=1.0) for m in (9, 3, 7)]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    store.update(one, _contents_with(results))
    store.update(two, _contents_with(list(reversed(results))))
    assert one.read_text() == two.read_text()
    ms = [json.loads(line)["key"]["m"] for line in one.read_text().splitlines() if '"result"' in line]
    assert ms == [3, 7, 9]


# -- tolerant reading -------------------------------------------------------------------------------
def test_corrupt_and_foreign_lines_are_skipped_with_counted_reasons(tmp_path, capsys):
    here = current_stamp("cpu")
    other = Stamp("cpu", "Some Other CPU", here.arch, here.sm_count + 1, "none", "none", here.torch, here.triton)
    good = _result(_gemm_problem(m=11))
    foreign = _result(_gemm_problem(m=12), stamp=other)
    stale = _result(_gemm_problem(m=13), identity="torch-0.1:TorchGemm")
    db = tmp_path / "mixed.jsonl"
    store.update(db, _contents_with([good, stale]))
    lines = db.read_text().splitlines()
    lines.append(json.dumps(other.to_json()))
    lines.append(json.dumps(foreign.to_json()))
    lines.append("this is not json")
    lines.append('{"type": "result", "stamp": "abc"')  # truncated
    lines.append(json.dumps({"type": "result", "stamp": "000000000000", "op": "gemm", "key": {}, "backend": "TORCH",
                             "config": None, "identity": "x", "time_ms": 1.0}))  # unknown stamp
    lines.append(json.dumps({"type": "mystery"}))
    db.write_text("\n".join(lines) + "\n")

    report = inspect(db)
    assert report.line_problems["corrupt line (not a JSON object)"] == 2
    assert report.line_problems["result references a stamp the file does not define"] == 1
    assert report.line_problems["unknown line type 'mystery'"] == 1
    assert report.entry_skips["tuned on another machine"] == 1
    assert report.entry_skips["stale"] == 1
    assert report.usable == 1

    assert cli(["db", "show", str(db)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("3 entries (1 usable here, 6 skipped")
    assert "2 x corrupt line" in last and "1 x stale" in last and "1 x tuned on another machine" in last

    assert cli(["db", "validate", str(db)]) == 1  # corrupt lines and a stale entry are problems

    # The usable entry still serves, the stale and foreign ones do not.
    GlobalBackendManager.set_tune_db(db)
    assert turbo.explain("gemm", torch.randn(11, 5), torch.randn(5, 6)).source == "tuned-db"
    assert turbo.explain("gemm", torch.randn(12, 5), torch.randn(5, 6)).source == "default"
    assert turbo.explain("gemm", torch.randn(13, 5), torch.randn(5, 6)).source == "default"


def test_rewrite_backs_up_unusable_lines_instead_of_dropping_them(tmp_path):
    db = tmp_path / "db.jsonl"
    store.update(db, _contents_with([_result(_gemm_problem(m=3))]))
    with open(db, "a") as f:
        f.write("garbage line\n")
    store.update(db, _contents_with([_result(_gemm_problem(m=4))]))
    assert not store.parse(db.read_text()).skipped
    assert (tmp_path / "db.jsonl.corrupt").read_text() == "garbage line\n"


def test_foreign_file_is_never_overwritten(tmp_path):
    db = tmp_path / "other_tool.jsonl"
    db.write_text('{"type": "header", "format": "something-else", "version": 1}\n')
    before = db.read_text()
    GlobalBackendManager.set_tune_db(db)
    GlobalBackendManager.set_auto_tune(True)
    a, b = torch.randn(8, 5), torch.randn(5, 6)
    torch.testing.assert_close(turbo.ops.gemm(a, b), a @ b)  # the job runs on
    assert db.read_text() == before
    with pytest.raises(ValueError, match="refusing to overwrite"):
        store.update(db, _contents_with([_result(_gemm_problem())]))


def test_soft_mismatch_still_serves_and_is_reported(tmp_path):
    here = current_stamp("cpu")
    soft = Stamp(here.platform, here.gpu, here.arch, here.sm_count, "other-driver", here.runtime, here.torch,
                 here.triton)
    result = _result(_gemm_problem(m=21), stamp=soft)
    verdict = judge(result, {soft.id: soft})
    assert verdict.reason is None and verdict.soft == ("driver",)


# -- layers -----------------------------------------------------------------------------------------
def test_layer_order_user_then_read_only_then_shipped(tmp_path, plugins, monkeypatch):
    problem = _gemm_problem(m=31)
    user, ro1, ro2 = tmp_path / "user.jsonl", tmp_path / "ro1.jsonl", tmp_path / "ro2.jsonl"
    store.update(ro1, _contents_with([_result(problem, backend="SLOW", time_ms=5.0)]))
    store.update(ro2, _contents_with([_result(problem, backend="TORCH", time_ms=1.0)]))
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB", str(user))
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB_PATH", f"{ro1}{os.pathsep}{ro2}")
    GlobalBackendManager.reset()
    a, b = torch.randn(31, 5), torch.randn(5, 6)
    decision = turbo.explain("gemm", a, b)
    assert (decision.source, decision.backend) == ("tuned-db", "SLOW")  # first read-only layer wins
    assert str(ro1) in decision.notes[0]
    store.update(user, _contents_with([_result(problem, backend="TORCH", time_ms=9.0)]))
    GlobalBackendManager.reset()
    assert turbo.explain("gemm", a, b).backend == "TORCH"  # the user DB comes first
    assert [layer for layer, _ in GlobalBackendManager.tune_db_layers()] == ["user", "read-only", "read-only"]


def test_read_only_layers_are_never_modified(tmp_path, plugins, monkeypatch):
    ro = tmp_path / "cluster.jsonl"
    store.update(ro, _contents_with([_result(_gemm_problem(m=41), time_ms=1.0)]))
    ro.chmod(0o444)
    before = (ro.read_bytes(), ro.stat().st_mtime_ns)
    user = tmp_path / "user.jsonl"
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB", str(user))
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB_PATH", str(ro))
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    GlobalBackendManager.reset()
    for m in (41, 42, 43):  # one hit in the read-only layer, two new keys to tune
        turbo.ops.gemm(torch.randn(m, 5), torch.randn(5, 6))
    assert (ro.read_bytes(), ro.stat().st_mtime_ns) == before
    tuned = {r.key["m"] for r in store.parse(user.read_text()).results.values()}
    assert tuned == {42, 43}
    # `db prune` refuses nothing here but must only ever touch the file it is given.
    assert cli(["db", "prune", str(user)]) == 0
    assert (ro.read_bytes(), ro.stat().st_mtime_ns) == before


def test_turning_a_db_layer_off_stops_its_cached_hits(tmp_path, monkeypatch):
    """A DB hit is cached, but under the DB settings it was read with: once the shipped DBs are
    turned off (or a read-only path dropped), the key goes back to the platform default."""
    from turbo_dispatch.tuning import config

    shipped = tmp_path / "tuned"
    shipped.mkdir()
    store.update(shipped / "this-machine.jsonl", _contents_with([_result(_gemm_problem(m=52))]))
    read_only = tmp_path / "cluster.jsonl"
    store.update(read_only, _contents_with([_result(_gemm_problem(m=53))]))
    monkeypatch.setattr(config, "SHIPPED_DIR", shipped)
    a, b = torch.randn(52, 5), torch.randn(5, 6)
    GlobalBackendManager.set_shipped_tune_db(True)
    assert turbo.explain("gemm", a, b).source == "tuned-db"
    turbo.ops.gemm(a, b)
    GlobalBackendManager.set_shipped_tune_db(False)
    assert turbo.explain("gemm", a, b).source == "default"
    GlobalBackendManager.set_shipped_tune_db(True)
    assert turbo.explain("gemm", a, b).source == "tuned-db"
    c = torch.randn(53, 5)
    GlobalBackendManager.set_tune_db_path([read_only])
    assert turbo.explain("gemm", c, b).source == "tuned-db"
    GlobalBackendManager.set_tune_db_path(None)
    assert turbo.explain("gemm", c, b).source == "default"


def test_no_writable_db_keeps_results_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB", "off")
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    GlobalBackendManager.reset()
    assert GlobalBackendManager.get_tune_db() is None
    turbo.ops.gemm(torch.randn(8, 5), torch.randn(5, 6))
    assert autotune.lookup("gemm", _gemm_problem()) is not None


def test_shipped_dbs_load_when_enabled(tmp_path, monkeypatch):
    from turbo_dispatch.tuning import config

    shipped = tmp_path / "tuned"
    shipped.mkdir()
    store.update(shipped / "this-machine.jsonl", _contents_with([_result(_gemm_problem(m=51))]))
    monkeypatch.setattr(config, "SHIPPED_DIR", shipped)
    a, b = torch.randn(51, 5), torch.randn(5, 6)
    assert turbo.explain("gemm", a, b).source == "default"  # conftest turns shipped DBs off
    GlobalBackendManager.set_shipped_tune_db(True)
    decision = turbo.explain("gemm", a, b)
    assert decision.source == "tuned-db" and "shipped" in decision.notes[0]


def test_package_ships_valid_tuned_dbs():
    from turbo_dispatch.tuning import config

    files = sorted(config.SHIPPED_DIR.glob("*.jsonl"))
    for path in files:
        report = inspect(path)
        assert not report.line_problems and report.foreign is None, path
        assert report.rows, f"{path} is empty"


# -- autotune integration ---------------------------------------------------------------------------
def test_wrong_but_fast_never_wins_and_rejection_is_recorded(tmp_path, plugins):
    GlobalBackendManager.set_auto_tune(True)
    a, b = torch.randn(16, 9), torch.randn(9, 7)
    torch.testing.assert_close(turbo.ops.gemm(a, b), a @ b)
    decision = turbo.explain("gemm", a, b)
    assert decision.source == "autotune" and decision.backend != "WRONG_FAST"
    (result,) = store.parse(Path(GlobalBackendManager.get_tune_db()).read_text()).results.values()
    assert result.backend != "WRONG_FAST"
    assert result.candidates["WRONG_FAST"] is None
    assert any(label == "WRONG_FAST" and "correctness gate" in why for label, why in result.rejected)


def test_second_process_reuses_the_db_with_zero_profiling(tmp_path, plugins):
    db = tmp_path / "job.jsonl"
    env = _env(PRIMUS_TURBO_TUNE_DB=str(db), PRIMUS_TURBO_AUTO_TUNE="1",
               PRIMUS_TURBO_EXTRA_REGISTRY=str(plugins))
    shapes = json.dumps([[16, 8, 12], [33, 17, 9], [5, 64, 40]])
    first = json.loads(_worker("run_gemms", shapes, env=env).stdout)
    assert first["stats"]["keys_profiled"] == 3 and first["stats"]["candidate_runs"] >= 9
    assert {s for s, _, _ in first["decisions"]} == {"autotune"}
    second = json.loads(_worker("run_gemms", shapes, env=env).stdout)
    assert second["stats"].get("keys_profiled", 0) == 0
    assert second["stats"].get("candidate_runs", 0) == 0
    assert [s for s, _, _ in second["decisions"]] == ["tuned-db"] * 3
    assert [b for _, b, _ in second["decisions"]] == [b for _, b, _ in first["decisions"]]
    assert all(str(db) in notes[0] for _, _, notes in second["decisions"])


def test_decision_during_capture_uses_the_db(tmp_path, plugins):
    db = tmp_path / "job.jsonl"
    env = _env(PRIMUS_TURBO_TUNE_DB=str(db), PRIMUS_TURBO_AUTO_TUNE="1", PRIMUS_TURBO_EXTRA_REGISTRY=str(plugins))
    _worker("run_gemms", json.dumps([[16, 8, 12]]), env=env)
    out = json.loads(_worker("decide_while_capturing", json.dumps([[16, 8, 12], [7, 7, 7]]), env=env).stdout)
    (tuned_source, _, tuned_provisional), (miss_source, miss_backend, miss_provisional) = out["decisions"]
    assert (tuned_source, tuned_provisional) == ("tuned-db", False)
    assert (miss_source, miss_provisional) == ("default", True)  # a miss is not profiled during capture
    assert out["stats"].get("candidate_runs", 0) == 0


def test_stored_results_apply_without_autotune_but_misses_are_not_profiled(tmp_path):
    db = Path(GlobalBackendManager.get_tune_db())
    store.update(db, _contents_with([_result(_gemm_problem(m=61))]))
    GlobalBackendManager.reset()
    runs = autotune.STATS["candidate_runs"]
    assert turbo.explain("gemm", torch.randn(61, 5), torch.randn(5, 6)).source == "tuned-db"
    assert turbo.explain("gemm", torch.randn(62, 5), torch.randn(5, 6)).source == "default"
    assert autotune.STATS["candidate_runs"] == runs
    assert {r.key["m"] for r in store.parse(db.read_text()).results.values()} == {61}


def test_pinned_backend_ignores_the_db(tmp_path, plugins):
    db = Path(GlobalBackendManager.get_tune_db())
    store.update(db, _contents_with([_result(_gemm_problem(m=71), backend="SLOW")]))
    GlobalBackendManager.set_gemm_backend("TORCH")
    decision = turbo.explain("gemm", torch.randn(71, 5), torch.randn(5, 6))
    assert (decision.source, decision.backend) == ("code", "TORCH")


# -- offline flow ----------------------------------------------------------------------------------
def test_record_untuned_then_tune_from_recorded(tmp_path, monkeypatch, capsys):
    recorded = tmp_path / "recorded.jsonl"
    monkeypatch.setenv("PRIMUS_TURBO_RECORD_UNTUNED", str(recorded))
    GlobalBackendManager.reset()
    for m in (81, 82, 82):
        turbo.ops.gemm(torch.randn(m, 5), torch.randn(5, 6))
    contents = store.parse(recorded.read_text())
    assert sorted(k["m"] for k in contents.keys.values()) == [81, 82]

    out_db = tmp_path / "tuned.jsonl"
    assert cli(["tune", "--from-recorded", str(recorded), "--db", str(out_db), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "2 keys: 2 tuned" in printed
    assert {r.key["m"] for r in store.parse(out_db.read_text()).results.values()} == {81, 82}
    # A second run finds them stored and profiles nothing.
    runs = autotune.STATS["candidate_runs"]
    GlobalBackendManager.set_tune_db(out_db)
    assert cli(["tune", "--from-recorded", str(recorded), "--no-progress"]) == 0
    assert "2 already stored" in capsys.readouterr().out
    assert autotune.STATS["candidate_runs"] == runs


def test_tune_model_preset_cli_and_db_show(tmp_path, capsys):
    db = tmp_path / "tiny.jsonl"
    assert cli(["tune", "--model", "tiny", "--ops", "gemm", "--db", str(db)]) == 0  # with the tqdm bar
    captured = capsys.readouterr()
    out = captured.out
    assert "tuning: 100%" in captured.err
    assert "keys:" in out and "failed" in out and "DEFAULT" in out
    assert cli(["db", "show", str(db)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    count = len(store.parse(db.read_text()).results)
    assert count >= 6 and last == f"{count} entries ({count} usable here, 0 skipped)"
    assert cli(["db", "validate", str(db)]) == 0


def test_tune_reports_a_configured_default_by_its_first_config(tmp_path, monkeypatch):
    """A default backend that has configs is timed by the config it runs without one (its first):
    the tune report gives that time and the winner's speedup over it, not a blank."""
    path = tmp_path / "configured.yaml"
    path.write_text("version: 1\nops:\n  gemm:\n    defaults: {cpu: CONFIGURED}\n    backends:\n"
                    "      - name: CONFIGURED\n        adapter: fixture_backends:ConfiguredGemm\n"
                    "        platforms: [cpu]\n")
    monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", str(path))
    monkeypatch.syspath_prepend(str(HERE))
    reload_registry()
    GlobalBackendManager.reset()
    try:
        report, _ = offline.tune_one("gemm", _gemm_problem(m=77), db=tmp_path / "db.jsonl")
    finally:
        monkeypatch.undo()
        reload_registry()
        GlobalBackendManager.reset()
    assert (report.status, report.default) == ("tuned", "CONFIGURED")
    # "slow" declares 300 ms per call; the winner ("fast", or the built-in TORCH: the same matmul) nothing.
    assert report.default_ms >= 300.0 > report.winner_ms
    assert report.speedup > 1.0


def test_prune_drops_stale_entries_only(tmp_path):
    here = current_stamp("cpu")
    other = Stamp("cpu", "Other CPU", here.arch, here.sm_count, "none", "none", here.torch, here.triton)
    db = tmp_path / "db.jsonl"
    store.update(db, _contents_with([_result(_gemm_problem(m=91)),
                                     _result(_gemm_problem(m=92), identity="torch-0.0:Old")]))
    store.update(db, _contents_with([_result(_gemm_problem(m=93), stamp=other)], stamp=other))
    assert cli(["db", "prune", str(db)]) == 0
    assert {r.key["m"] for r in store.parse(db.read_text()).results.values()} == {91, 93}
    assert cli(["db", "prune", str(db), "--foreign"]) == 0
    assert {r.key["m"] for r in store.parse(db.read_text()).results.values()} == {91}


def test_prune_min_speedup_keeps_only_clear_wins_over_the_default(tmp_path, plugins, capsys):
    """``db prune --min-speedup X`` drops the entries whose winner was not X times faster than the
    op's default (TORCH for gemm on the CPU) in its own profile, or whose profile never timed it."""
    import dataclasses

    def entry(m, candidates, backend="SLOW"):
        return dataclasses.replace(_result(_gemm_problem(m=m), backend=backend), candidates=candidates)

    db = tmp_path / "ship.jsonl"
    store.update(db, _contents_with([
        entry(61, {"TORCH": 2.0, "SLOW": 1.0}),  # 2x the default: kept
        entry(62, {"TORCH": 1.1, "SLOW": 1.0}),  # 1.1x: dropped at 1.25
        entry(63, {"SLOW": 1.0}),  # the default not timed: dropped
        entry(64, {"TORCH": 1.0}, backend="TORCH"),  # the default itself: dropped (a miss runs it anyway)
    ]))
    assert cli(["db", "prune", str(db), "--min-speedup", "1.25"]) == 0
    assert "removed 3 entries, kept 1" in capsys.readouterr().out
    assert {r.key["m"] for r in store.parse(db.read_text()).results.values()} == {61}
    assert cli(["db", "prune", str(db), "--min-speedup", "0"]) == 2
    assert "--min-speedup must be a positive number" in capsys.readouterr().err


def test_cli_errors_are_clear(tmp_path, capsys):
    assert cli(["db", "show", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli(["tune", "--model", "no-such-model", "--db", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert cli(["tune", "--ops", "gemm,bogus", "--db", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown op" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("caller_group", [False, True])
def test_distributed_tune_destroys_only_the_group_it_made(tmp_path, monkeypatch, caller_group):
    """``tune --distributed`` in one process (world size 1, gloo): the process group it made is
    destroyed before it returns (a rank that exits with gloo's threads alive can abort); a group
    the caller made before is left to the caller."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29633" if caller_group else "29632")
    if caller_group:
        dist.init_process_group("gloo")
    try:
        code = cli(["tune", "--model", "tiny", "--ops", "gemm", "--db", str(tmp_path / "one.jsonl"), "--distributed",
                    "--no-progress", "--device", "cpu"])
        assert code == 0
        assert dist.is_initialized() is caller_group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_tune_shards_keys_and_rank0_merges(tmp_path):
    db = tmp_path / "dist.jsonl"
    env = _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29631",
           "-m", "turbo_dispatch.cli", "tune", "--model", "tiny", "--ops", "gemm", "--db", str(db),
           "--distributed", "--no-progress", "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    contents = store.parse(db.read_text())
    from turbo_dispatch.tuning.keys import model_keys

    expected = model_keys("tiny", ["gemm"], "cpu")
    assert len(contents.results) == len(expected)
    assert f"{len(expected)} keys: {len(expected)} tuned" in proc.stdout


def test_consensus_is_skipped_for_ops_whose_keys_vary_across_ranks(monkeypatch):
    """A collective on a per-rank key (MoE token counts) could hang the other ranks."""
    from turbo_dispatch.op_spec import get_op_spec
    from turbo_dispatch.tuning.keys import model_keys

    monkeypatch.setattr(autotune, "consensus_enabled", lambda: True)
    gathered = []
    monkeypatch.setattr(autotune, "agree_across_ranks", lambda key, timings: gathered.append(key) or timings)
    grouped = next(p for op, p in model_keys("tiny", ["grouped_gemm"], "cpu") if op == "grouped_gemm")
    spec = get_op_spec("grouped_gemm")
    candidates = [e for e in get_registry().backends("grouped_gemm") if e.check(grouped, "cpu") is None]
    assert autotune.profile(spec, grouped, candidates).backend is not None
    assert gathered == []
    dense = _gemm_problem()
    gemm_candidates = [e for e in get_registry().backends("gemm") if e.check(dense, "cpu") is None]
    autotune.profile(get_op_spec("gemm"), dense, gemm_candidates)
    assert len(gathered) == 1


def test_budget_never_skips_a_backends_first_config(tmp_path, plugins, monkeypatch):
    """A slow first candidate that eats the whole budget must not keep the others unmeasured."""
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_BUDGET_MS", "0")
    GlobalBackendManager.reset()
    from turbo_dispatch.op_spec import get_op_spec

    problem = _gemm_problem(m=17)
    candidates = [e for e in get_registry().backends("gemm") if e.check(problem, "cpu") is None]
    record = autotune.profile(get_op_spec("gemm"), problem, candidates)
    timings = dict(record.timings)
    assert set(timings) == {e.name for e in candidates}
    assert all(ms != float("inf") for name, ms in timings.items() if name != "WRONG_FAST")
    assert not [r for r in record.rejected if "budget" in r[1]]
