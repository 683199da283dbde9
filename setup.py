"""Packaging glue that pyproject.toml cannot express.

The repo keeps the adapters in ``backends/`` and the registry in ``registry.yaml`` at its root
(DESIGN.md layout), but the wheel must ship both inside the ``turbo_dispatch`` namespace so that
site-packages never gains a generic top-level ``backends`` module.
"""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


class BuildPyWithRegistry(build_py):
    """Copies the root registry.yaml into the built turbo_dispatch package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "turbo_dispatch" / "registry.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "registry.yaml", target)


packages = find_packages(include=["turbo_dispatch", "turbo_dispatch.*"])
packages += ["turbo_dispatch.backends"] + [
    "turbo_dispatch.backends." + p for p in find_packages(where="backends")
]

setup(
    packages=packages,
    package_dir={"turbo_dispatch": "turbo_dispatch", "turbo_dispatch.backends": "backends"},
    # Tuned DBs for GPUs we tuned on; they load automatically when the machine matches.
    package_data={"turbo_dispatch": ["tuned/*.jsonl"]},
    cmdclass={"build_py": BuildPyWithRegistry},
)
