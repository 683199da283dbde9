"""Installing a test's plugin registry (fixture backends from tests/fixture_backends.py)."""
from __future__ import annotations

from pathlib import Path

from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.registry import reload_registry

HERE = Path(__file__).resolve().parent


def use_plugins(tmp_path: Path, monkeypatch, text: str) -> Path:
    """Writes the registry ``text`` under ``tmp_path``, points PRIMUS_TURBO_EXTRA_REGISTRY at it
    (``monkeypatch`` undoes that), makes ``fixture_backends`` importable and reloads the registry
    and the settings; returns the file. The caller reloads both again after ``monkeypatch.undo()``."""
    path = tmp_path / "plugins.yaml"
    path.write_text(text)
    monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", str(path))
    monkeypatch.syspath_prepend(str(HERE))
    reload_registry()
    GlobalBackendManager.reset()
    return path
