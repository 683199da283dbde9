"""Reading the results of checks run in a subprocess (the Triton interpreter ones need their own
process: TRITON_INTERPRET must be set before triton is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def collect_results(proc: subprocess.CompletedProcess) -> dict:
    """The ``RESULT {json}`` lines the subprocess printed, by their ``name``; a non-zero exit adds
    ``__crash__`` with the end of its stderr, so a check that never ran says why."""
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["name"]] = r
    if proc.returncode != 0:
        results["__crash__"] = proc.stderr[-3000:]
    return results


def assert_check_passed(results: dict, name: str) -> None:
    """Fails unless the check ``name`` ran in the subprocess and passed; a check that never ran
    shows what the subprocess said."""
    assert name in results, f"check {name} did not run; subprocess said:\n{results.get('__crash__', '')}"
    assert results[name]["ok"], results[name]["detail"]


def assert_all_passed(results: list[dict], names: list[str]) -> None:
    """Fails unless ``results`` (check dicts run in this process) are exactly the checks ``names``
    and each passed; the message lists the missing or extra ones, or those that failed."""
    by_name = {r["name"]: r for r in results}
    assert sorted(by_name) == sorted(names), sorted(set(names) ^ set(by_name))
    failed = [f"{n}: {r['detail']}" for n, r in by_name.items() if not r["ok"]]
    assert not failed, failed


def interpreter_checks(script: str, timeout: float = 240) -> dict:
    """Runs ``script --interpreter-checks`` under the Triton interpreter (``TRITON_INTERPRET=1``)
    and returns its results (``collect_results``)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script, "--interpreter-checks"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    return collect_results(proc)
