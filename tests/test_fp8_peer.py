"""Where an fp8 GEMM has a high-precision counterpart (gemm_fp8 -> gemm, grouped_gemm_fp8 ->
grouped_gemm), the tuner also times that op's platform default against the fp8 winner, in turns on
the same inputs; the tuning DB keeps the comparison (``peer_*`` fields) and ``explain`` and
``db show`` say whether fp8 wins on the key, and by how much.

On the CPU the fixture backends declare their cost on the autotuner's virtual clock
(tests/fixture_backends.py): SLOW gemm costs 200 ms a call, SLOWFP8 gemm_fp8 400 ms, so the
ratios are known without depending on the machine's speed.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, autotune
from turbo_dispatch.cli import main as cli
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.ops.gemm_problem import explain_gemm_fp8
from turbo_dispatch.ops.gemm_spec import GEMM_FP8
from turbo_dispatch.ops.grouped_gemm_problem import explain_grouped_gemm_fp8
from turbo_dispatch.ops.grouped_gemm_spec import GROUPED_GEMM_FP8
from turbo_dispatch.registry import get_registry, reload_registry
from turbo_dispatch.tuning import database, store
from turbo_dispatch.tuning.codec import encode_key
from turbo_dispatch.tuning.stamp import current_stamp

from plugin_registry import use_plugins
from db_lines import db_file


def _registry(gemm_default: str, fp8_default: str) -> str:
    return ("version: 1\nops:\n"
            f"  gemm:\n    defaults: {{cpu: {gemm_default}}}\n    backends:\n"
            "      - name: SLOW\n        adapter: fixture_backends:SlowGemm\n        platforms: [cpu]\n"
            "      - name: BROKEN\n        adapter: fixture_backends:BrokenGemm\n        platforms: [cpu]\n"
            f"  gemm_fp8:\n    defaults: {{cpu: {fp8_default}}}\n    backends:\n"
            "      - name: SLOWFP8\n        adapter: fixture_backends:SlowFp8Gemm\n        platforms: [cpu]\n")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Installs ``_registry(gemm_default, fp8_default)``; returns the installer."""
    def install(gemm_default: str, fp8_default: str, fp8_torch: bool = True) -> None:
        use_plugins(tmp_path, monkeypatch, _registry(gemm_default, fp8_default))
        if not fp8_torch:
            monkeypatch.setattr(get_registry().get("gemm_fp8", "TORCH").adapter, "supports",
                                lambda p: "switched off here")

    yield install
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


def _key(m: int = 24):
    return explain_gemm_fp8(torch.empty(m, 16, dtype=torch.bfloat16), torch.empty(16, 8, dtype=torch.bfloat16))


def _candidates(op: str, problem):
    return [e for e in get_registry().backends(op) if e.check(problem, "cpu") is None]


# -- the hooks --------------------------------------------------------------------------------------
def test_the_hooks_map_a_high_precision_key_to_its_peer_on_the_same_inputs():
    problem = _key()
    sets = [GEMM_FP8.make_inputs(problem, torch.device("cpu")) for _ in range(2)]
    op, peer, peer_sets = GEMM_FP8.high_precision_peer(problem, sets)
    assert op == "gemm" and (peer.m, peer.n, peer.k, peer.a_dtype, peer.out_dtype) == (24, 8, 16, torch.bfloat16,
                                                                                         torch.bfloat16)
    assert all(x is y for pair, peer_pair in zip(sets, peer_sets) for x, y in zip(pair, peer_pair))
    lens = torch.tensor([5, 11], dtype=torch.int64)
    grouped = explain_grouped_gemm_fp8(torch.empty(16, 32, dtype=torch.bfloat16),
                                       torch.empty(2, 24, 32, dtype=torch.bfloat16), lens)
    op, peer, _ = GROUPED_GEMM_FP8.high_precision_peer(grouped, [()])
    assert op == "grouped_gemm" and (peer.g, peer.m, peer.n, peer.k, peer.dtype) == (2, 16, 24, 32, torch.bfloat16)


def test_no_peer_for_a_pre_quantised_operand_or_mixed_dtypes():
    problem = _key()
    assert GEMM_FP8.high_precision_peer(problem._replace(a_dtype=problem.a_fp8), [()]) is None
    assert GEMM_FP8.high_precision_peer(problem._replace(b_dtype=torch.float16), [()]) is None
    lens = torch.tensor([5, 11], dtype=torch.int64)
    grouped = explain_grouped_gemm_fp8(torch.empty(16, 32, dtype=torch.bfloat16),
                                       torch.empty(2, 24, 32, dtype=torch.bfloat16), lens)
    assert GROUPED_GEMM_FP8.high_precision_peer(grouped._replace(b_dtype=grouped.b_fp8), [()]) is None
    assert GROUPED_GEMM_FP8.high_precision_peer(grouped._replace(out_dtype=torch.float32), [()]) is None


# -- the tuner -------------------------------------------------------------------------------------
def test_profile_times_the_peer_in_turns_and_fp8_loses(plugins):
    plugins("SLOW", "SLOWFP8", fp8_torch=False)
    problem = _key()
    record = autotune.profile(GEMM_FP8, problem, _candidates("gemm_fp8", problem))
    assert record.backend == "SLOWFP8"
    assert (record.peer_op, record.peer_backend) == ("gemm", "SLOW")
    assert 200.0 <= record.peer_ms < 300.0 and 400.0 <= record.peer_winner_ms < 500.0
    text = database.peer_text(record.peer_op, record.peer_backend, record.peer_ms, record.peer_winner_ms, "bf16")
    assert text.startswith("bf16 peer gemm SLOW: 2") and "fp8 loses on this key" in text
    assert f"= {record.peer_ms / record.peer_winner_ms:.2f}x its speed" in text


def test_online_tuning_stores_the_peer_and_explain_says_fp8_wins(plugins):
    plugins("SLOW", "TORCH")
    GlobalBackendManager.set_auto_tune(True)
    a, b = torch.randn(24, 16, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    turbo.ops.gemm_fp8(a, b)
    decision = turbo.explain("gemm_fp8", a, b)
    assert decision.source == "autotune" and decision.backend == "TORCH"
    (note,) = [n for n in decision.notes if " peer " in n]
    assert note.startswith("bf16 peer gemm SLOW: 2") and "this fp8 choice" in note
    assert "loses" not in note and "quantisation included" in note
    ratio = float(note.split(" = ")[1].split("x")[0])
    assert ratio > 1.0
    line = next(json.loads(raw) for raw in open(GlobalBackendManager.get_tune_db()) if '"result"' in raw)
    assert (line["peer_op"], line["peer_backend"]) == ("gemm", "SLOW")
    assert 200_000 <= line["peer_us"] < 300_000 and line["peer_winner_us"] < line["peer_us"]


def test_a_grouped_fp8_key_is_timed_against_grouped_gemm():
    """The product CPU backends: only that a comparison is recorded, never which one is faster."""
    lens = torch.tensor([5, 11], dtype=torch.int64)
    problem = GROUPED_GEMM_FP8.shared_problem(explain_grouped_gemm_fp8(
        torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(2, 24, 32, dtype=torch.bfloat16), lens))
    record = autotune.profile(GROUPED_GEMM_FP8, problem, _candidates("grouped_gemm_fp8", problem))
    assert record.backend == "TORCH" and (record.peer_op, record.peer_backend) == ("grouped_gemm", "TORCH")
    assert record.peer_ms > 0 and record.peer_winner_ms > 0


def test_a_hook_that_returns_none_records_nothing(plugins):
    plugins("SLOW", "TORCH")
    spec = dataclasses.replace(GEMM_FP8, high_precision_peer=lambda p, sets: None)
    problem = _key()
    record = autotune.profile(spec, problem, _candidates("gemm_fp8", problem))
    assert record.backend == "TORCH"
    assert (record.peer_op, record.peer_backend, record.peer_ms, record.peer_winner_ms) == (None,) * 4
    result, _ = database.result_for(spec, problem, record, _candidates("gemm_fp8", problem))
    assert not any(name.startswith("peer") for name in result.to_json())


def test_a_failing_peer_does_not_break_tuning(plugins, caplog):
    plugins("BROKEN", "TORCH")
    problem = _key()
    with caplog.at_level(logging.WARNING, logger="turbo_dispatch.autotune"):
        record = autotune.profile(GEMM_FP8, problem, _candidates("gemm_fp8", problem))
    assert record.backend == "TORCH" and record.peer_ms is None and record.peer_op is None
    assert "timing the high-precision peer failed (RuntimeError: fixture gemm always fails)" in caplog.text


def test_a_raising_hook_does_not_break_tuning(plugins, caplog):
    plugins("SLOW", "TORCH")

    def broken(p, sets):
        raise KeyError("no such field")

    problem = _key()
    with caplog.at_level(logging.WARNING, logger="turbo_dispatch.autotune"):
        record = autotune.profile(dataclasses.replace(GEMM_FP8, high_precision_peer=broken), problem,
                                  _candidates("gemm_fp8", problem))
    assert record.backend == "TORCH" and record.peer_ms is None
    assert "timing the high-precision peer failed (KeyError" in caplog.text


# -- the DB ----------------------------------------------------------------------------------------
def _entry(problem, **fields) -> dict:
    identity = get_registry().get("gemm_fp8", "TORCH").adapter.identity(None)
    return {"type": "result", "stamp": current_stamp("cpu").id, "op": "gemm_fp8", "key": encode_key(problem),
            "backend": "TORCH", "config": None, "identity": identity, "time_ms": 0.945, **fields}


_PEER = {"peer_op": "gemm", "peer_backend": "TORCH", "peer_us": 913.0, "peer_winner_us": 945.0}


def test_peer_fields_round_trip_and_older_lines_load(tmp_path, capsys):
    db = db_file(tmp_path / "db.jsonl", [_entry(_key(11), **_PEER), _entry(_key(12))])
    contents = store.parse(db.read_text())
    assert not contents.skipped
    by_m = {r.key["m"]: r for r in contents.results.values()}
    assert (by_m[11].peer_op, by_m[11].peer_backend, by_m[11].peer_us, by_m[11].peer_winner_us) == \
        ("gemm", "TORCH", 913.0, 945.0)
    assert (by_m[12].peer_op, by_m[12].peer_us) == (None, None)
    assert store.Result.from_json(by_m[11].to_json()) == by_m[11]
    assert not any(name.startswith("peer") for name in by_m[12].to_json())

    assert cli(["db", "show", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:9] == ["OP", "KEY", "BACKEND", "CONFIG", "MS", "GPU_US", "HOST_US", "TIMED", "VS_PEER"]
    assert next(r for r in out if "m=11," in r).split()[8] == "gemm/TORCH:0.97x"
    assert next(r for r in out if "m=12," in r).split()[8] == "-"
    assert any(r.startswith("VS_PEER: ") and "below 1x the fp8 op is slower" in r for r in out)


def test_explain_states_a_db_entrys_comparison(tmp_path):
    db = db_file(tmp_path / "db.jsonl", [_entry(_key(11), **_PEER), _entry(_key(12))])
    GlobalBackendManager.set_tune_db(db)
    a = torch.randn(11, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    decision = turbo.explain("gemm_fp8", a, b)
    assert decision.source == "tuned-db"
    assert ("bf16 peer gemm TORCH: 0.913 ms per call; this fp8 choice 0.945 ms = 0.97x its speed: "
            "fp8 loses on this key") in " ".join(decision.notes), decision.notes
    decision = turbo.explain("gemm_fp8", torch.randn(12, 16, dtype=torch.bfloat16), b)
    assert decision.source == "tuned-db" and not any(" peer " in n for n in decision.notes)


@pytest.mark.parametrize("fields", [
    {**_PEER, "peer_us": "fast"}, {**_PEER, "peer_us": 0}, {**_PEER, "peer_winner_us": -1.0},
    {**_PEER, "peer_us": float("inf")}, {**_PEER, "peer_op": 3}, {**_PEER, "peer_backend": ""},
    {k: v for k, v in _PEER.items() if k != "peer_backend"}, {"peer_us": 913.0},
])
def test_a_malformed_peer_skips_the_line(tmp_path, fields):
    db = db_file(tmp_path / "db.jsonl", [_entry(_key(11), **fields)])
    contents = store.parse(db.read_text())
    assert not contents.results and sum(contents.skipped.values()) == 1
    assert next(iter(contents.skipped)).startswith("malformed result: ")
    assert cli(["db", "validate", str(db)]) == 1


@pytest.mark.parametrize("peer_ms, winner_ms, verdict", [(0.913, 0.945, ": fp8 loses on this key"),
                                                          (1.20, 1.00, ": fp8 wins on this key"),
                                                          (1.00, 1.01, ": a tie within 2%"),
                                                          (1.015, 1.00, ": a tie within 2%")])
def test_peer_text_names_a_loss_a_win_and_a_tie(peer_ms, winner_ms, verdict):
    text = database.peer_text("grouped_gemm", "TORCH", peer_ms, winner_ms, "bf16")
    assert f"x its speed{verdict} (" in text


# -- GPU ---------------------------------------------------------------------------------------------
def _peer_note(decision) -> str:
    (note,) = [n for n in decision.notes if " peer " in n]
    return note


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gemm_fp8-rowwise", "grouped_gemm_fp8-blockwise"])
def test_gpu_online_tuning_records_the_bf16_peer_and_explain_states_it(case, tmp_path):
    """The product backends on a GPU: tuning an fp8 key times the bf16 op's default beside the
    winner, the DB line keeps both, and ``explain`` states the comparison; never which one wins."""
    GlobalBackendManager.reset()
    GlobalBackendManager.set_tune_db(tmp_path / "db.jsonl")
    GlobalBackendManager.set_auto_tune(True)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        if case == "gemm_fp8-rowwise":
            cfg = Float8QuantConfig(granularity="rowwise")
            a = torch.randn(2048, 4096, device="cuda", generator=gen).bfloat16()
            b = torch.randn(4096, 4096, device="cuda", generator=gen).bfloat16()
            turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg)
            decision, peer_op = turbo.explain("gemm_fp8", a, b, trans_b=True, config=cfg), "gemm"
        else:
            cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
            a = torch.randn(16 * 512, 768, device="cuda", generator=gen).bfloat16()
            b = torch.randn(16, 2048, 768, device="cuda", generator=gen).bfloat16()
            lens = torch.full((16,), 512, dtype=torch.int64, device="cuda")
            turbo.ops.grouped_gemm_fp8(a, b, lens, config=cfg)
            decision = turbo.explain("grouped_gemm_fp8", a, b, lens, config=cfg)
            peer_op = "grouped_gemm"
        note = _peer_note(decision)
        print(f"{case}: {decision.backend} ({decision.source}); {note}")
        assert decision.source == "autotune" and note.startswith(f"bf16 peer {peer_op} ")
        ratio = float(note.split(" = ")[1].split("x")[0])
        assert 0.05 < ratio < 20.0
        line = next(json.loads(raw) for raw in open(tmp_path / "db.jsonl") if '"result"' in raw)
        assert line["peer_op"] == peer_op and line["peer_us"] > 0 and line["peer_winner_us"] > 0
    finally:
        GlobalBackendManager.reset()
