"""``turbo-dispatch backends``: every registered op x backend, whether it can run here and why
not, each op's default per platform, plus the versions of everything a decision depends on."""
from __future__ import annotations

import argparse
import platform as _py_platform
from typing import Callable

import torch

from .common import table


def add_parser(sub) -> None:
    """Adds the ``backends`` command to the top-level subparsers ``sub``."""
    backends = sub.add_parser("backends", help="list backends per op, their availability, and versions")
    backends.set_defaults(func=_cmd_backends)


def _safe(call: Callable[[], str]) -> str:
    """The result of a probe, or a short note when the probe itself fails."""
    try:
        return str(call())
    except Exception as exc:  # an adapter or library probe must not take the listing down
        return f"? ({type(exc).__name__}: {exc})"


def _versions() -> list[tuple[str, str]]:
    """Everything a backend decision (and a tuning result) depends on, as (name, value) rows."""
    from .. import __version__
    from ..device_platform import default_platform

    if getattr(torch.version, "hip", None):
        runtime = f"HIP {torch.version.hip}"
    elif torch.version.cuda:
        runtime = f"CUDA {torch.version.cuda}"
    else:
        runtime = "none (CPU-only torch build)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    except Exception as exc:  # e.g. a broken install: report it, do not crash
        triton_version = f"import failed ({type(exc).__name__}: {exc})"
    rows = [
        ("turbo_dispatch", __version__),
        ("python", _py_platform.python_version()),
        ("torch", torch.__version__),
        ("torch GPU runtime", runtime),
        ("triton", triton_version),
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(gpus):
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", None) if torch.version.hip else None
        arch = arch or f"compute capability {props.major}.{props.minor}"
        rows.append((f"gpu {index}", f"{props.name}, {arch}, {props.multi_processor_count} SMs"))
    if not gpus:
        rows.append(("gpu", "none visible to torch"))
    rows.append(("platform", f"{default_platform()} ({_py_platform.platform()})"))
    return rows


def _cmd_backends(args: argparse.Namespace) -> int:
    from ..device_platform import default_platform
    from ..op_spec import KNOWN_OPS
    from ..registry import get_registry

    registry = get_registry()
    here = default_platform()
    rows = []
    for op in sorted(registry.entries):
        for entry in registry.backends(op):
            if here not in entry.platforms:
                # The adapter's own reason too: it says what a machine of its platform would need.
                status, reason = "no", f"not registered for platform {here}"
                why = entry.available()
                reason += f" ({why})" if why else ""
            else:
                reason = entry.available()
                status = "available" if reason is None else "unavailable"
            default_on = []
            for p in entry.platforms:
                chain = registry.default_chain(op, p)
                if entry.name in chain:
                    before = chain[:chain.index(entry.name)]
                    default_on.append(f"{p} (after {', '.join(before)})" if before else p)
            mark = "*" if entry.name in registry.default_chain(op, here) else ""
            library = str(getattr(entry.adapter, "library", "unknown"))
            rows.append([mark, op, entry.name, ",".join(entry.platforms), status,
                         ",".join(default_on) or "-", library, _safe(entry.adapter.version), reason or ""])
    print(f"backends (this machine's platform: {here}; * = the op's default here, or in its default chain)")
    if rows:
        headers = ["", "OP", "BACKEND", "PLATFORMS", "STATUS", "DEFAULT ON", "LIBRARY", "VERSION", "REASON"]
        print(table(headers, rows))
    else:
        print("  (no backend registered)")

    missing = sorted(KNOWN_OPS - set(registry.entries))
    if missing:
        print("\nnot implemented yet (no registered backend):")
        print("\n".join(f"  {op}" for op in missing))

    print("\nversions:")
    print(table(["COMPONENT", "VERSION"], _versions()))
    return 0
