"""The contract every backend adapter fulfils.

An adapter knows its library and nothing else: no env vars, priorities or tuning database.
Those are the resolver's business.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence


class Adapter:
    """Base class for backend adapters; one subclass per (backend, op).

    Subclasses override ``run`` and, where they have limits, ``available`` and ``supports``.
    ``available`` is called once per process (the registry caches it), so it may import its
    library lazily and probe the device. ``supports`` is called once per problem key and must
    look only at the problem (host-side facts), never at tensor data.

    Example:
        >>> from turbo_dispatch.adapter import Adapter
        >>> class Doubler(Adapter):
        ...     library = "example"
        ...     def run(self, problem, x, config=None):
        ...         return 2 * x
        >>> Doubler().supports(None) is None
        True
    """

    #: Library the adapter drives; shown in ``turbo-dispatch backends`` and used in identity().
    library: str = "unknown"
    #: True when ``run`` is made of differentiable torch ops and serves every problem of its op, so
    #: an op may let torch's autograd record it directly instead of wrapping it (saves ~9 us/call).
    differentiable: bool = False

    def available(self) -> str | None:
        """None when the backend can run in this process, else the reason it cannot."""
        return None

    def supports(self, problem: Any) -> str | None:
        """None when this backend can serve ``problem``, else the reason it cannot."""
        return None

    def configs(self, problem: Any) -> Sequence[Hashable]:
        """Configs the autotuner may try for ``problem``; ``[None]`` means "just the default".
        The first is the one ``run`` uses when called without a config (reports time it as the
        backend's default)."""
        return [None]

    def check_config(self, problem: Any, config: Hashable) -> str | None:
        """None when ``run(problem, ..., config=config)`` may be called, else why not. A config
        read from a tuning DB passes through here before it can win, so a hand-edited or hostile
        entry (a tile of 3 rows, a split of 10**11) is skipped instead of failing every call.

        The default accepts ``None`` and the configs ``configs(problem)`` offers; an adapter whose
        config space is larger than what it offers overrides this with a schema check."""
        if config is None:
            return None
        offered = self.configs(problem)
        if config in offered:
            return None
        return f"config {config!r} is not among the {len(offered)} this backend offers for the key"

    def describe(self, problem: Any) -> str | None:
        """Optional one-line note on how this backend would run ``problem`` (shown by explain)."""
        return None

    def version(self) -> str:
        """Version of the library behind the adapter."""
        return "unknown"

    def identity(self, config: Hashable = None) -> str:
        """What a tuning result was measured on: library, version and kernel/config."""
        suffix = "" if config is None else f"/{config}"
        return f"{self.library}-{self.version()}:{type(self).__name__}{suffix}"

    def run(self, problem: Any, *tensors: Any, config: Hashable = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def prepare(self, problem: Any, *tensors: Any, config: Hashable = None) -> tuple[Any, Callable[..., Any]]:
        """``(run(problem, *tensors, config=config), again)``: this call's result, and a function
        ``again(*tensors)`` that runs ``problem`` with ``config`` on later tensors laid out as these
        are (same types, dtypes, shapes, strides, devices and 16-byte alignment of their data;
        a caller that keeps ``again`` holds these in its key). An adapter may resolve here, once,
        what ``run`` works out on every call (launch arguments, descriptors, kernel plans); the
        default ``again`` is ``run`` itself. ``again`` must give what ``run`` would, also after a
        setting it depends on changed (then it may call ``run``)."""
        return (self.run(problem, *tensors, config=config),
                lambda *tensors: self.run(problem, *tensors, config=config))
