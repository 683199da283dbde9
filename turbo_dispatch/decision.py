"""Decision: which backend serves a problem, with which config, and why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from .op_spec import format_key

#: Where a decision came from, in priority order.
SOURCES = ("code", "env", "tuned-db", "autotune", "default", "fallback")


@dataclass(frozen=True)
class Decision:
    """The resolver's answer for one (op, problem key).

    ``provisional`` decisions (made while autotuning was not allowed to profile, e.g. during
    CUDA graph capture) are used for that call but not cached, so the key is tuned later.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> d = turbo.explain("gemm", torch.randn(4, 8), torch.randn(8, 2))
        >>> d.backend, d.source
        ('TORCH', 'default')
    """

    op: str
    problem: Any
    backend: str
    source: str
    config: Hashable = None
    rejected: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    provisional: bool = False
    entry: Any = field(default=None, repr=False, compare=False)

    @property
    def adapter(self):
        return self.entry.adapter

    @property
    def key(self) -> str:
        return format_key(self.problem)

    def __str__(self) -> str:
        lines = [
            f"op:      {self.op}",
            f"key:     {self.key}",
            f"backend: {self.backend}" + ("" if self.config is None else f"  config={self.config}"),
            f"source:  {self.source}" + ("  (provisional: not cached)" if self.provisional else ""),
        ]
        if self.entry is not None:
            lines.append(f"identity: {self.adapter.identity(self.config)}")
        for note in self.notes:
            lines.append(f"note:    {note}")
        if self.rejected:
            lines.append("other backends:")
            width = max(len(name) for name, _ in self.rejected)
            lines += [f"  {name:<{width}}  {reason}" for name, reason in self.rejected]
        return "\n".join(lines)
