"""Pre-bound launches of Triton JIT kernels: resolve a launch once per problem key, then launch the
compiled kernel directly.

Triton's ``JITFunction.run`` binds every argument, works out each one's specialisation and hashes
them into its cache key on every call, although for one problem key (shapes, dtypes, strides,
alignment, config) the answer never changes. A ``PreboundKernel`` keeps one ``Plan`` per key: the
grid, the arguments the key fixes (constexprs, sizes, strides), the launch options and the
``CompiledKernel`` that Triton returned from the key's first launch. Later calls pass only the
arguments that change from call to call (pointers, TMA descriptors) to ``compiled[grid]``, the
compiled kernel's own launcher (the one ``run`` ends in; triton 3.6 to 3.9 have it with this
form). That launcher still takes the current stream and Triton's launch hooks on every call.

What the caller guarantees: its key determines everything Triton specialises on apart from the
per-call arguments' values. That is each per-call tensor's dtype and whether its data pointer is
16-byte aligned (a TMA descriptor's dtype and block shape), the device, and every fixed argument.
A key that missed one of these would launch a kernel compiled for another specialisation.
Triton's process-wide knobs that change compilation (``TRITON_DEBUG``, instrumentation) are read at
a key's first launch; a plan keeps the kernel they gave.

Where the compiled kernel cannot be used, a plan launches through ``kernel[grid](...)`` with the
same resolved arguments (the normal path, correct but without the saving), and the first such
plan of each kernel logs why at debug level. That happens under the interpreter
(``TRITON_INTERPRET=1``, which compiles nothing), where the kernel has pre-run hooks (only
``run`` calls them), and where the first launch returned no compiled kernel.

>>> order_of(["a", "b", "BLOCK", "n"], per_call=("a", "b"), fixed=("BLOCK", "n"))
(0, 1, 2, 3)
>>> order_of(["a", "BLOCK", "b"], per_call=("a", "b"), fixed=("BLOCK",))
(0, 2, 1)
"""
from __future__ import annotations

import functools
import logging
import operator
import os
import sys
import threading
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from turbo_dispatch.env import parse_bool

log = logging.getLogger("turbo_dispatch.backends.triton.prebound")

#: Plans kept per kernel; the oldest is dropped beyond it. A job whose shapes vary without bound
#: (every token count of a MoE layer, say) must not grow the cache without bound.
MAX_PLANS = 4096


class BoundedCache(dict):
    """A dict that forgets its oldest entry once it holds ``limit``: its keys are problems, whose
    number a job with varying shapes does not bound. ``put`` stores and returns the value."""

    def __init__(self, limit: int = MAX_PLANS) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Hashable, value: Any) -> Any:
        if len(self) >= self.limit:
            try:
                self.pop(next(iter(self)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile: drop nothing now
                pass
        self[key] = value
        return value


def order_of(names: Sequence[str], per_call: Sequence[str], fixed: Sequence[str]) -> tuple[int, ...]:
    """For each kernel parameter in ``names`` (signature order), its index in the concatenation
    ``per_call values + fixed values``. Raises ValueError unless the two name lists cover every
    parameter exactly once."""
    position = {name: i for i, name in enumerate([*per_call, *fixed])}
    if len(position) != len(per_call) + len(fixed) or set(position) != set(names):
        missing = sorted(set(names) - set(position))
        extra = sorted(set(position) - set(names))
        raise ValueError(f"prebound launch: arguments must cover the kernel's parameters once each "
                         f"(missing {missing}, unknown {extra})")
    return tuple(position[name] for name in names)


class Plan:
    """One problem key's resolved launch: ``plan(*per_call)`` launches the kernel with the per-call
    arguments (in the order the ``PreboundKernel`` was given them) and the key's fixed ones.

    ``direct`` says whether it launches the compiled kernel itself (else Triton's normal path);
    ``state`` holds what the caller keeps per key beside the launch (output shape, descriptor
    layouts), so that a call that finds the plan recomputes none of it."""

    __slots__ = ("_launch", "_pick", "_fixed", "direct", "state")

    def __init__(self, launch: Callable[..., Any], pick: Callable[[tuple], tuple], fixed: tuple, direct: bool,
                 state: Any) -> None:
        self._launch, self._pick, self._fixed = launch, pick, fixed
        self.direct, self.state = direct, state

    def __call__(self, *per_call: Any) -> None:
        self._launch(*self._pick(per_call + self._fixed))


class _PerCallPlan(Plan):
    """A plan whose launch takes the per-call arguments alone (``c_launcher``'s form)."""

    __slots__ = ()

    def __call__(self, *per_call: Any) -> None:
        self._launch(*per_call)


class PreboundKernel:
    """A Triton JIT kernel launched through one ``Plan`` per problem key.

    ``per_call`` names the parameters whose values change from call to call under one key
    (tensors and descriptors), in the order ``Plan.__call__`` takes them; ``bind`` gives every
    other parameter. ``binds`` and ``hits`` count first launches and pre-bound ones (tests and
    benchmarks read them)."""

    def __init__(self, kernel: Any, per_call: Sequence[str], max_plans: int = MAX_PLANS) -> None:
        self.kernel = kernel
        self.per_call = tuple(per_call)
        self.binds = 0
        self.hits = 0
        self._plans = BoundedCache(max_plans)
        self._lock = threading.Lock()
        self._told = False

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None), "__name__", "kernel")

    def plan(self, key: Hashable) -> Plan | None:
        """The plan bound for ``key``, or None (then the caller resolves the launch and ``bind``s it)."""
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
        return plan

    def bind(self, key: Hashable, grid: Sequence[int], per_call: Sequence[Any], fixed: Mapping[str, Any],
             options: Mapping[str, Any], state: Any = None) -> Plan:
        """Launches the kernel once through Triton's normal path (compiling it if needed) with
        ``per_call`` values (in ``self.per_call`` order), the ``fixed`` arguments by name and the
        launch ``options`` (``num_warps``, ``num_stages``, ...), on ``grid`` (a sequence of at most 3
        ints), and keeps the plan that later calls of ``key`` launch with."""
        names = list(self.kernel.arg_names)
        fixed_names = tuple(fixed)
        order = order_of(names, self.per_call, fixed_names)
        fixed_values = tuple(fixed[name] for name in fixed_names)
        pick = operator.itemgetter(*order) if len(order) > 1 else (lambda values: (values[order[0]],))
        full = pick(tuple(per_call) + fixed_values)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        compiled = self.kernel[grid3](*full, **options)
        if hasattr(compiled, "result"):  # an asynchronously compiled kernel
            compiled = compiled.result()
        launch, why_not = _direct_launcher(self.kernel, compiled, grid3)
        direct = launch is not None
        if not direct:
            if not self._told:
                self._told = True
                log.debug("prebound launch of %s: the normal Triton launch serves each call (%s)", self.name, why_not)
            normal = self.kernel[grid3]
            launch = (lambda *args: normal(*args, **options)) if options else normal
        per_call_at = tuple(order.index(j) for j in range(len(self.per_call)))
        fast = None
        if direct and c_launch_enabled():
            fast = c_launcher(compiled, grid3, full, per_call_at, launch, pick, fixed_values)
        if fast is not None:
            plan = _PerCallPlan(fast, pick, fixed_values, direct, state)
        else:
            plan = Plan(launch, pick, fixed_values, direct, state)
        with self._lock:
            self.binds += 1
            self._plans.put(key, plan)
        return plan

    def launch(self, grid: Sequence[int], per_call: Sequence[Any], fixed: Mapping[str, Any],
               options: Mapping[str, Any]) -> None:
        """Launches with a key derived from the call itself: the grid, every fixed argument, the
        options, and per tensor of ``per_call`` its dtype, device and whether its data pointer is
        16-byte aligned (what Triton specialises a pointer on). For kernels whose per-call
        arguments are all tensors; a key seen before skips Triton's per-call binding."""
        key = (tuple(grid), tuple(fixed.items()), tuple(options.items()),
               tuple((t.dtype, t.device, t.data_ptr() % 16 == 0) for t in per_call))
        self.launch_keyed(key, per_call, lambda: (grid, fixed, options))

    def launch_keyed(self, key: Hashable, per_call: Sequence[Any],
                     resolve: Callable[[], tuple[Sequence[int], Mapping[str, Any], Mapping[str, Any]]]) -> None:
        """Launches ``per_call`` through the plan of a caller-made ``key``; on a miss ``resolve()``
        gives the launch's (grid, fixed arguments, options) and the plan is bound with them, so a
        call that finds its plan works out none of them."""
        plan = self.plan(key)
        if plan is None:
            grid, fixed, options = resolve()
            self.bind(key, grid, per_call, fixed, options)
        else:
            plan(*per_call)

    def clear(self) -> None:
        """Forgets every plan (the compiled kernels stay in Triton's own cache)."""
        with self._lock:
            self._plans.clear()


class CallKeyedKernel:
    """A JIT kernel launched as ``kernel[grid](*args, **kwargs)`` would be, through a
    ``PreboundKernel`` whose key is made from the call: for kernels whose callers build the whole
    argument list anyway (TMA descriptors, many sizes and strides) and only need Triton's per-call
    binding gone.

    ``per_call`` names the parameters that change from call to call under one key; the caller
    passes them positionally, and they must be tensors or Gluon TMA descriptors. The key is the
    grid, every other positional argument by value, the keyword arguments (constexprs and launch
    options, hashable), and per tensor its dtype, device and whether its data pointer is 16-byte
    aligned, per descriptor its base's dtype, device, block shape, layout and padding: what Triton
    specialises on.

    >>> CallKeyedKernel.trait(torch.zeros(2))
    (torch.float32, device(type='cpu'), True)
    """

    def __init__(self, kernel: Any, per_call: Sequence[str], max_plans: int = MAX_PLANS) -> None:
        self.prebound = PreboundKernel(kernel, per_call, max_plans)
        self._names = tuple(kernel.arg_names)
        self._per_call_at = tuple(self._names.index(name) for name in per_call)
        self._fixed_at = tuple(i for i in range(len(self._names)) if i not in self._per_call_at)

    @staticmethod
    def trait(value: Any) -> tuple:
        if isinstance(value, torch.Tensor):
            return value.dtype, value.device, value.data_ptr() % 16 == 0
        base = value.base  # a Gluon TMA descriptor
        return (base.dtype, base.device, tuple(value.block_shape), value.layout, getattr(value, "padding", None))

    def __call__(self, grid: Sequence[int], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Launches ``kernel[grid](*args, **kwargs)``; ``args`` are positional in signature order
        (the keyword arguments may name the remaining parameters and launch options)."""
        self.launch_and_plan(grid, args, kwargs)

    def launch_and_plan(self, grid: Sequence[int], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Plan:
        """Launches as ``__call__`` does and returns the plan that served the launch.

        A caller that keeps the plan may launch later calls with ``plan(*per_call)`` (the
        ``per_call`` parameters in the order given to the constructor), skipping the key, as long
        as everything the key holds is the same for them: the grid, every other argument's value,
        the keyword arguments, and the per-call tensors' and descriptors' ``trait``. Such a launch
        is not counted in ``prebound.hits``."""
        per_call = tuple(args[i] for i in self._per_call_at)
        fixed_args = tuple(args[i] for i in self._fixed_at if i < len(args))
        key = (tuple(grid), fixed_args, tuple(kwargs.items()), tuple(map(self.trait, per_call)))
        plan = self.prebound.plan(key)
        if plan is None:
            grid, fixed, options = self._resolve(grid, args, kwargs)
            return self.prebound.bind(key, grid, per_call, fixed, options)
        plan(*per_call)
        return plan

    def _resolve(self, grid: Sequence[int], args: Sequence[Any], kwargs: Mapping[str, Any]):
        fixed = {self._names[i]: args[i] for i in self._fixed_at if i < len(args)}
        options = {}
        for name, value in kwargs.items():
            (fixed if name in self._names else options)[name] = value
        return tuple(grid), fixed, options


def rebaser(descriptor: Any) -> Callable[[Any], Any]:
    """A function that makes copies of host TMA descriptor ``descriptor`` over other base tensors,
    without the validation its constructor repeats (about twenty Python calls per descriptor).

    For a caller whose key fixes everything the descriptor was validated on: the new base has the
    same dtype, shape, strides and device as the old one and a 16-byte aligned data pointer (a
    fresh allocation, or an input whose alignment the key holds). A launch reads only the base's
    data pointer and dtype (the shape and strides it encodes are the descriptor's own), so a tensor
    of which the old base's layout is a view at offset zero (``x`` for ``x.t()``) serves as well
    and saves making the view. Where the descriptor class keeps
    no instance ``__dict__`` (a dataclass with slots), the copies go through its constructor,
    which validates. The function keeps no reference to ``descriptor``'s base tensor.

    >>> class D:
    ...     def __init__(self, base, shape):
    ...         self.base, self.shape = base, shape
    >>> rebaser(D("x", [2, 3]))("y").__dict__
    {'base': 'y', 'shape': [2, 3]}
    """
    fields = getattr(descriptor, "__dict__", None)
    if not isinstance(fields, dict) or "base" not in fields:
        import dataclasses

        # Through the constructor, which validates; the first call's tensor is not kept.
        kept = {f.name: getattr(descriptor, f.name) for f in dataclasses.fields(descriptor) if f.name != "base"}
        cls = descriptor.__class__
        return lambda base: cls(base=base, **kept)
    cls = descriptor.__class__
    new = object.__new__
    template = {**fields, "base": None}  # the template must not keep the first call's tensor alive

    def rebased(base: Any) -> Any:
        copy = new(cls)
        copy.__dict__ = {**template, "base": base}
        return copy

    return rebased


def _direct_launcher(kernel: Any, compiled: Any, grid3: tuple) -> tuple[Callable[..., Any] | None, str]:
    """(the compiled kernel's launcher on ``grid3``, "") or (None, why the normal path must serve)."""
    if getattr(kernel, "pre_run_hooks", None):
        return None, "the kernel has pre-run hooks, which only JITFunction.run calls"
    if compiled is None or not callable(getattr(compiled, "__getitem__", None)) \
            or not hasattr(compiled, "function"):
        return None, "no compiled kernel came back from the first launch (the interpreter compiles nothing)"
    try:
        runner = compiled[grid3]
    except Exception as exc:  # a Triton whose CompiledKernel has no launcher of this form
        return None, f"the compiled kernel has no launcher: {type(exc).__name__}: {exc}"
    return _raw_launcher(compiled, grid3, runner) or runner, ""


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch enter and exit hooks (a profiler such as proton installs them), looked up
    on every launch: a hook may be installed at any time."""
    runtime = _knobs().runtime
    return runtime.launch_enter_hook, runtime.launch_exit_hook


@functools.lru_cache(maxsize=None)
def _knobs() -> Any:
    # imported once: an import statement on every launch is host time
    from triton import knobs

    return knobs


def _current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's own launcher takes it (the
    device straight from torch's C API: CUDA is initialised once a kernel has been launched)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _hooked(hook: Any) -> bool:
    # triton 3.6+ keeps hooks in a HookChain (``calls`` lists them); an older Triton, or a user,
    # may set a plain callable or None
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    """Whether a launch enter or exit hook is installed now: then only Triton's own launcher
    calls them with the metadata they expect."""
    enter, leave = _launch_hooks()
    return _hooked(enter) or _hooked(leave)


def _raw_launcher(compiled: Any, grid3: tuple, runner: Callable[..., Any]) -> Callable[..., Any] | None:
    """A launch straight into the compiled kernel's C launcher (``compiled.run``) with its function
    handle and packed metadata, or None where this Triton's CompiledKernel lacks them.

    It skips what Triton's ``runner`` does per call besides the launch: looking up the device and
    stream through its driver, building launch metadata and calling the empty hook chains, several
    microseconds of Python per launch. While a launch hook is installed it hands the call to
    ``runner``, which calls the hooks with the metadata they expect."""
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        _launch_hooks()
    except Exception:
        return None
    if not callable(run):
        return None
    gx, gy, gz = grid3

    def launch(*args: Any) -> None:
        if _hooks_installed():
            runner(*args)
        else:
            run(gx, gy, gz, _current_stream(), function, packed, None, None, None, *args)

    return launch


#: Set to 0/false to keep every plan bound from then on on Triton's launcher object (``c_launcher``
#: off): read when a plan is bound.
C_LAUNCH_ENV = "PRIMUS_TURBO_TRITON_C_LAUNCH"


def c_launch_enabled() -> bool:
    """Whether plans bound now launch through ``c_launcher`` (``PRIMUS_TURBO_TRITON_C_LAUNCH``, on
    unless set to a false value)."""
    return parse_bool(os.environ.get(C_LAUNCH_ENV), C_LAUNCH_ENV) is not False


#: How many TMA descriptors (one per data pointer) a plan keeps per descriptor argument. A training
#: step's tensors mostly come back at the same addresses from the caching allocator, so a few
#: cover the steady state; beyond it the slot starts over.
DESCRIPTOR_CACHE = 8
#: The launch arguments the C launch function of triton 3.6 takes before the kernel's own (grid
#: x/y/z, stream, function, cooperative, PDL, the two scratch buffers, packed metadata, launch
#: metadata, the two hooks); a driver module whose ``_BASE_ARGS_FORMAT_LEN`` differs is not used.
_C_BASE_ARGS = 13


def c_launcher(compiled: Any, grid3: tuple, first: tuple, per_call_at: tuple[int, ...], launch: Callable[..., Any],
               pick: Callable[[tuple], tuple], fixed: tuple) -> Callable[..., Any] | None:
    """``launch(per_call...)`` straight into the C function of Triton's launcher module, or None
    where this Triton's launcher does not have the form it relies on.

    Triton's ``CudaLauncher`` spends Python time on every launch around its C function: it looks
    for scratch buffers, and for a kernel with TMA descriptor parameters it walks every argument
    and encodes each descriptor again (``make_tensordesc_arg``: a driver call per descriptor). Here
    the kernel's arguments are expanded once, from the first call's (``first``, in signature
    order), into the C function's form; a call puts its per-call arguments (at signature positions
    ``per_call_at``) into a copy and launches. A TMA descriptor's encoding depends on its base's
    data pointer, its shape, strides and padding, and the kernel's metadata for it; each
    descriptor argument keeps the encodings of the first call's layout by data pointer
    (``DESCRIPTOR_CACHE``) and encodes any other layout afresh. Scratch buffers, which the launcher
    allocates per launch, are left to it: a kernel that needs them gets None. While a launch hook
    is installed a call goes through ``launch`` (with ``pick(per_call + fixed)``), which calls it.
    """
    found = _c_launch_parts(compiled)
    if found is None:
        return None
    c_launch, desc_at, metas, encode, cooperative, pdl = found
    expanded: list = []
    slots = {}
    descriptors = iter(metas)
    for i, arg in enumerate(first):
        at = len(expanded)
        if i in desc_at:
            meta = next(descriptors)
            parts = encode(arg, meta)
            expanded.extend(parts)
            # A TMA encoding (with metadata) is kept by data pointer for this layout only.
            known = {} if meta is not None else None
            layout = (list(arg.shape), list(arg.strides), getattr(arg, "padding", None))
            slots[i] = (at, len(parts), meta, layout, known)
        else:
            expanded.append(arg)
            slots[i] = (at, 1, None, None, None)
    per_call_slots = tuple(slots[i] for i in per_call_at)
    for at, *_ in per_call_slots:  # each call sets these: the plan must not keep the first call's tensors alive
        expanded[at] = None
    gx, gy, gz = grid3
    function, packed = compiled.function, compiled.packed_metadata

    def fast(*per_call: Any) -> None:
        if _hooks_installed():
            launch(*pick(per_call + fixed))
            return
        args = expanded.copy()
        for (at, width, meta, layout, known), value in zip(per_call_slots, per_call):
            if layout is None:
                args[at] = value
            elif known is not None and (list(value.shape), list(value.strides),
                                        getattr(value, "padding", None)) == layout:
                ptr = value.base.data_ptr()
                encoded = known.get(ptr)
                if encoded is None:
                    if len(known) >= DESCRIPTOR_CACHE:
                        known.clear()
                    encoded = known[ptr] = encode(value, meta)[0]
                args[at] = encoded
            else:  # another layout, or no TMA metadata: encoded as Triton's launcher would
                args[at:at + width] = encode(value, meta)
        c_launch(gx, gy, gz, _current_stream(), function, cooperative, pdl, None, None, packed, None, None, None,
                 *args)

    return fast


def _c_launch_parts(compiled: Any) -> tuple | None:
    """(C launch function, signature positions of TMA descriptor parameters, their metadata,
    triton's descriptor encoder, cooperative flag, PDL flag) of ``compiled``'s launcher, or None
    where it is not a ``CudaLauncher`` of the form this relies on (triton 3.6's: its driver module
    names ``_BASE_ARGS_FORMAT_LEN`` 13 and ``make_tensordesc_arg``, and a kernel with descriptor
    parameters wraps the C function in a closure over ``launcher``, ``tensordesc_indices`` and
    ``tensordesc_meta``), or where it needs scratch buffers."""
    run = getattr(compiled, "run", None)
    if type(run).__name__ != "CudaLauncher" or not hasattr(compiled, "packed_metadata"):
        return None
    driver = vars(sys.modules.get(type(run).__module__) or object)
    encode = driver.get("make_tensordesc_arg")
    if driver.get("_BASE_ARGS_FORMAT_LEN") != _C_BASE_ARGS or not callable(encode):
        return None
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        cooperative, pdl, launch = run.launch_cooperative_grid, run.launch_pdl, run.launch
    except AttributeError:
        return None
    code, cells = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None:  # the C function itself: the kernel has no descriptor parameters
        return (launch, frozenset(), [], encode, cooperative, pdl) if callable(launch) else None
    if cells is None:
        return None
    free = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
    c_launch, desc_at, metas = free.get("launcher"), free.get("tensordesc_indices"), free.get("tensordesc_meta")
    if not callable(c_launch) or desc_at is None or metas is None or len(metas) != len(desc_at):
        return None
    return c_launch, frozenset(desc_at), list(metas), encode, cooperative, pdl
