"""Where benchmark output goes: one rule for the harness benches and the suite (no torch import,
so the suite's ``--list`` and ``--dry-run`` stay instant)."""
from __future__ import annotations

import os
from pathlib import Path

#: Where output goes when neither ``--out`` nor ``$TURBO_BENCH_OUT`` names a folder. Ignored by
#: git: results are run artifacts; docs/performance.md keeps the figures that last.
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench-out"
OUT_ENV = "TURBO_BENCH_OUT"


def resolve_out_dir(arg: Path | str | None = None) -> Path:
    """The output folder: ``arg`` (a script's ``--out``) if given, else ``$TURBO_BENCH_OUT`` if set
    and non-empty, else ``DEFAULT_OUT``."""
    return Path(arg or os.environ.get(OUT_ENV) or DEFAULT_OUT)
