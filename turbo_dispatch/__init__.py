"""turbo_dispatch: one call per hot training operator, on the fastest correct backend.

Example:
    >>> import torch, turbo_dispatch as turbo
    >>> c = turbo.ops.gemm(torch.randn(8, 16), torch.randn(16, 4))
    >>> turbo.explain("gemm", torch.randn(8, 16), torch.randn(16, 4)).backend
    'TORCH'
"""
from . import low_precision, modules, ops
from .backend_type import BackendChoice, BackendType, PrecisionType
from .decision import Decision
from .errors import BackendUnsupportedError, ConfigError, NoBackendError, RegistryError, TurboDispatchError
from .explain import explain
from .manager import GlobalBackendManager
from .tuning.rank_sync import SyncReport, sync_tuning

__version__ = "0.1.0"

__all__ = [
    "BackendChoice",
    "BackendType",
    "BackendUnsupportedError",
    "ConfigError",
    "Decision",
    "GlobalBackendManager",
    "NoBackendError",
    "PrecisionType",
    "RegistryError",
    "SyncReport",
    "TurboDispatchError",
    "explain",
    "low_precision",
    "modules",
    "ops",
    "sync_tuning",
]
