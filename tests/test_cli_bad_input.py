"""User errors on the command line exit 2 with a one-line message; a bad recorded key is a
failed key in the report, not a traceback."""
from __future__ import annotations

import json
import os

import pytest

from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.cli import main
from turbo_dispatch.tuning import store


@pytest.fixture(autouse=True)
def no_user_db(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB", "off")
    GlobalBackendManager.reset()
    yield
    monkeypatch.undo()
    GlobalBackendManager.reset()


def _one_line_error(capsys, what: str) -> None:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and what in err, err


@pytest.mark.parametrize("argv", [
    ["db", "show", "{dir}"], ["db", "validate", "{dir}"], ["db", "prune", "{dir}"],
    ["db", "merge", "-o", "{out}", "{dir}"], ["tune", "--from-recorded", "{dir}", "--db", "{out}", "--no-progress"],
])
def test_a_directory_is_not_a_db_file(tmp_path, capsys, argv):
    argv = [a.format(dir=tmp_path, out=tmp_path / "out.jsonl") for a in argv]
    assert main(argv) == 2
    _one_line_error(capsys, "is a directory, not a regular file")


def test_a_missing_db_file_is_an_error(tmp_path, capsys):
    assert main(["db", "validate", str(tmp_path / "none.jsonl")]) == 2
    _one_line_error(capsys, "does not exist")


def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "db.jsonl"
    os.mkfifo(fifo)
    assert main(["db", "show", str(fifo)]) == 2
    _one_line_error(capsys, "is a FIFO")


@pytest.mark.parametrize("m", ["1000000000000000000000000000000", "2147483648", "0", "-5", "x"])
def test_absurd_sizes_are_usage_errors(capsys, m):
    assert main(["explain", "gemm", "--m", m, "--n", "64", "--k", "64"]) == 2
    assert "argument --m" in capsys.readouterr().err


def test_bad_recorded_keys_are_failed_keys(tmp_path, capsys):
    fields = dict(n=8, k=8, trans_a=False, trans_b=True, a_dtype="fp32", b_dtype="fp32", out_dtype="fp32",
                  platform="cpu")
    keys = [dict(m=-5, **fields), dict(m=8, **{**fields, "a_dtype": "e4m3", "b_dtype": "e4m3"}), dict(m=8, **fields)]
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("\n".join([json.dumps({"type": "header", "format": store.FORMAT, "version": store.VERSION})]
                                  + [json.dumps({"type": "key", "op": "gemm", "key": k}) for k in keys]) + "\n")
    db = tmp_path / "db.jsonl"
    assert main(["tune", "--from-recorded", str(recorded), "--db", str(db), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "3 keys: 1 tuned, 0 already stored, 2 failed" in out, out
    assert "m=-5" in out and "cannot tune this key" in out
    assert len(store.parse(db.read_text()).results) == 1
