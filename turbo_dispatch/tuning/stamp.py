"""The environment stamp: what a tuning result was measured on.

A result only transfers to a machine with the same *hard* fields (platform, GPU model, arch, SM
count): a different GPU is a different problem. The *soft* fields (driver, GPU runtime, torch,
triton) are recorded and reported but do not disqualify an entry on their own; what a library
upgrade really changes is caught by the backend's ``identity()``, which each result stores and
which must still match.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform as _py_platform
from dataclasses import asdict, dataclass, fields

import torch

HARD_FIELDS = ("platform", "gpu", "arch", "sm_count")
SOFT_FIELDS = ("driver", "runtime", "torch", "triton")


@dataclass(frozen=True)
class Stamp:
    """One machine/software environment. ``id`` is a short hash of every field.

    Example:
        >>> s = current_stamp("cpu")
        >>> s.platform, len(s.id)
        ('cpu', 12)
    """

    platform: str
    gpu: str
    arch: str
    sm_count: int
    driver: str
    runtime: str
    torch: str
    triton: str

    @property
    def id(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha1(canonical.encode()).hexdigest()[:12]

    def to_json(self) -> dict:
        return {"type": "stamp", "id": self.id, **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict) -> "Stamp":
        """Raises KeyError/TypeError/ValueError on a malformed stamp line."""
        values = {}
        for f in fields(cls):
            value = obj[f.name]
            expected = int if f.name == "sm_count" else str
            if not isinstance(value, expected) or isinstance(value, bool):
                raise TypeError(f"stamp field {f.name!r} must be {expected.__name__}, got {value!r}")
            values[f.name] = value
        stamp = cls(**values)
        if obj.get("id") != stamp.id:
            raise ValueError(f"stamp id {obj.get('id')!r} does not match its fields (expected {stamp.id})")
        return stamp

    def hard_mismatch(self, here: "Stamp") -> str | None:
        """Why a result measured under ``self`` cannot serve machine ``here`` (None: it can)."""
        diffs = [f"{name} {getattr(self, name)!r} (here {getattr(here, name)!r})"
                 for name in HARD_FIELDS if getattr(self, name) != getattr(here, name)]
        return None if not diffs else "tuned on another machine: " + ", ".join(diffs)

    def soft_mismatch(self, here: "Stamp") -> list[str]:
        """The soft fields that differ (the entry still serves; reported by ``db show``)."""
        return [name for name in SOFT_FIELDS if getattr(self, name) != getattr(here, name)]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _py_platform.processor() or _py_platform.machine()


def _triton_version() -> str:
    try:
        import triton
    except Exception:  # absent or broken: either way no triton kernel ran
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def _driver_version() -> str:
    if not torch.cuda.is_available():
        return "none"
    if torch.version.hip:
        return f"hip {torch.version.hip}"
    try:
        from torch.cuda import _get_nvml_driver_version  # type: ignore[attr-defined]
        return str(_get_nvml_driver_version())
    except Exception:
        pass
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        return f"cuda-driver-api {version.value // 1000}.{version.value % 1000 // 10}"
    except Exception:
        return "unknown"


@functools.lru_cache(maxsize=None)
def current_stamp(platform: str, device_index: int | None = None) -> Stamp:
    """The stamp of this process's environment for ``platform`` (cpu, cuda or rocm)."""
    if torch.version.hip:
        runtime = f"HIP {torch.version.hip}"
    elif torch.version.cuda:
        runtime = f"CUDA {torch.version.cuda}"
    else:
        runtime = "none"
    if platform in ("cuda", "rocm"):
        index = torch.cuda.current_device() if device_index is None else device_index
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", "") if torch.version.hip else f"sm_{props.major}{props.minor}"
        gpu, sm_count, driver = props.name, int(props.multi_processor_count), _driver_version()
    else:
        gpu, arch, sm_count, driver = cpu_model(), _py_platform.machine(), os.cpu_count() or 0, "none"
    return Stamp(platform, gpu, arch, sm_count, driver, runtime, torch.__version__, _triton_version())
