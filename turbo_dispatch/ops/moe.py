"""moe_dispatch / moe_combine: expert-parallel token dispatch and combine with DeepEP semantics.

Semantics (the contract every backend of the ``moe_dispatch_combine`` op fulfils):

* ``num_experts`` experts are split evenly over the group's ranks in rank order: rank ``r`` holds
  global experts ``[r * L, (r + 1) * L)`` with ``L = num_experts // world_size``.
* ``moe_dispatch`` sends each token ONCE to every rank that holds at least one of its top-k experts
  (``-1`` in ``token_indices`` means "no expert"). A rank receives its rows ordered by source rank,
  then by source token index (deterministic). ``recv_idx[i, j]`` is the LOCAL id of the j-th
  expert of received row i when that expert lives on this rank, else ``-1``; ``recv_probs[i, j]``
  is its probability, or 0 where ``recv_idx`` is ``-1``. ``tokens_per_expert`` counts, per local
  expert, the (row, top-k slot) pairs that name it (DeepEP's ``num_recv_tokens_per_expert_list``:
  a duplicated expert id in one token's top-k counts twice; routers give distinct ids).
* ``moe_combine`` is the reverse: each rank sends every row it received back to the row's source,
  and each source token becomes the SUM of the rows that came back for it (accumulated in fp32
  for bf16/fp16). Combining ``recv_x`` itself therefore gives ``x * (number of destination ranks)``.
* Autograd: the backward of dispatch is a combine (of ``grad recv_x``, and of ``grad recv_probs``
  masked to the local slots, which lands on the ``token_probs`` positions); the backward of
  combine is a dispatch of the gradient rows with the same handle. Every backward is a collective
  too: all ranks must run backward through the same MoE calls, and must agree on which inputs
  require grad (as with any collective-based autograd).

Host synchronisation: without ``num_worst_tokens`` dispatch needs the per-rank row counts on the
host (all_to_all split sizes and the size of the receive buffer), so it synchronises the host once,
which is also why ``tokens_per_expert`` is returned as a Python list (it rides on the same
exchange). Combine and both backward passes reuse the handle's counts and never synchronise.
With ``num_worst_tokens = N > 0`` (DeepEP's meaning: N is a worst case known on the host) nothing
is read back: the receive buffers have exactly N rows (padding: x rows zero, recv_idx -1,
recv_probs 0), ``tokens_per_expert`` is an int64 device tensor (usable as ``group_lens`` of a
grouped GEMM, which accepts ``M_total > sum(group_lens)``), ``handle.num_recv`` a device scalar,
and dispatch, combine and their backward passes make no host read, which is what CUDA-graph
capture (on NCCL) requires. A rank that would receive more than N rows keeps the first N in
receive order and drops the rest (nothing can raise without reading the count); size N for the
worst case.

Bad expert ids (``>= num_experts`` or ``< -1``) are data, not shapes: without ``num_worst_tokens``
they are detected in the one count exchange (each rank sends its min/max id), so EVERY rank raises
the same ValueError naming the offending rank, and no rank is left waiting in a collective; with
``num_worst_tokens`` they are routed nowhere (detecting them would need a host read). Argument
errors that need no data (shapes, dtypes, ``num_experts`` not divisible by the group size, ...)
raise before any communication, on the ranks that made them.

fp8 dispatch: ``x`` may be an fp8 activation with per-row or 1 x block scales (a QuantizedTensor or
DeepEP's ``(x_fp8, scales)`` pair, see ``ops/moe_fp8.py``); the fp8 bytes and the scales travel in one
exchange, side by side in each row, and arrive in the same form, ready for ``grouped_gemm_fp8``.

Problem key (``MoeDispatchProblem``): hidden, topk, num_experts, world size, dtype, whether
probabilities travel, num_worst_tokens, platform. It holds only facts that are the same on every
rank, so every rank resolves the same backend (the token count, which differs between ranks, is
left out on purpose; see the class).

torch.compile: these ops are eager-only. The public functions are wrapped in
``torch.compiler.disable``, so a compiled region graph-breaks at them (and ``fullgraph=True``
raises torch's "Skip calling torch.compiler.disable()d function" error): the outputs' sizes
depend on other ranks' data, the handle is a Python object and ``tokens_per_expert`` a list, none
of which a custom op signature carries cleanly.

Autotuning: the op cannot be profiled from its key alone (it needs a live process group whose every
rank runs the same key at the same time), so its OpSpec makes no inputs and its ``run`` raises a
"not tunable without a process group" ValueError. The autotuner calls ``make_inputs`` and
``reference`` outside its per-candidate error handling, so those two return placeholders instead
of raising; the ValueError from ``run`` is recorded as a failed candidate, the key is remembered as
failed (one warning per key, never re-profiled), and the platform default serves. With rank
consensus on, that one failed profiling still joins the consensus gather; keys are rank-uniform, so
all ranks reach it at the same call.
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

import torch

from ..backend_type import PrecisionType
from ..device_platform import platform_of
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import require_bool, require_dtype, require_tensor
from .moe_fp8 import fp8_payload, pack_rows, packed_layout, unpack_rows

log = logging.getLogger("turbo_dispatch.ops.moe")

#: Dtypes moe_dispatch moves (rows travel as raw bytes, so fp8 works as well as bf16).
DISPATCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                   torch.float8_e4m3fn, torch.float8_e5m2)
#: Dtypes of router probabilities (they travel and come back in their own dtype).
PROB_DTYPES = (torch.float32, torch.bfloat16)
#: Dtypes moe_combine sums.
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class MoeDispatchProblem(NamedTuple):
    """Key of one moe_dispatch call: host facts that are the SAME on every rank of the group.

    The token count is deliberately not part of it. Dispatch is a collective, so every rank must
    run the same backend: a key that differed between ranks (token counts do, e.g. in inference)
    could let ranks pick different backends (a size limit in one backend's ``supports``, a tuned
    entry for one count only) and deadlock, and under autotune rank consensus it would make ranks
    tune different keys. The receive count is data and cannot be in it either.
    """

    hidden: int
    topk: int
    num_experts: int
    world_size: int
    dtype: torch.dtype
    with_probs: bool
    num_worst_tokens: int
    platform: str
    #: every rank of the group runs on this host (what a backend that maps peers' GPU memory needs)
    intranode: bool = False


class MoeHandle:
    """What moe_combine and the backward passes need from one moe_dispatch; opaque to callers.

    Holds the backend that ran the dispatch (combine must use the same one, whatever the settings
    say by then), the dispatch problem (world size, ...), the backend's own layout object (for
    TORCH: the send permutation and both split-size lists, or the fixed slot maps under
    ``num_worst_tokens``; every backend's layout exposes ``num_recv``), ``num_tokens`` (rows of the
    dispatched x, what combine returns) and ``recv_rows`` (rows moe_dispatch returned:
    ``num_worst_tokens`` when padding was asked for).
    """

    __slots__ = ("backend", "adapter", "problem", "layout", "num_tokens", "recv_rows", "device")

    def __init__(self, backend: str, adapter: Any, problem: MoeDispatchProblem, layout: Any, num_tokens: int,
                 recv_rows: int, device: torch.device):
        self.backend = backend
        self.adapter = adapter
        self.problem = problem
        self.layout = layout
        self.num_tokens = num_tokens
        self.recv_rows = recv_rows
        self.device = device

    @property
    def world_size(self) -> int:
        return self.problem.world_size

    @property
    def num_recv(self) -> "int | torch.Tensor":
        """Rows actually received (without padding): an int, or under ``num_worst_tokens`` a 0-d
        int64 device tensor (reading it syncs; a value above ``recv_rows`` means rows were dropped)."""
        return self.layout.num_recv

    def __repr__(self) -> str:
        p = self.problem
        recv = self.num_recv if isinstance(self.num_recv, int) else "on device"
        return (f"MoeHandle(backend={self.backend}, world_size={p.world_size}, num_tokens={self.num_tokens}, "
                f"num_recv={recv}, recv_rows={self.recv_rows})")


# -- validation and problem keys (host facts only: no tensor data is read) ---------------------------
def _group_size(op: str, group: Any) -> int:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"{op}: this torch build has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call torch.distributed.init_process_group "
                           "first (NCCL for GPU tensors, gloo for CPU tensors)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed.ProcessGroup or None (the default group); "
                        f"got {type(group).__name__}")
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(f"{op}: this rank is not a member of the given group")
    return size


def _require_int(op: str, name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int; got {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}; got {value}")
    return value


def moe_dispatch_problem(x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                         num_experts: int, group: Any = None, num_worst_tokens: int = 0,
                         ask_peers: bool = True) -> MoeDispatchProblem:
    """Validates moe_dispatch's arguments (shapes, dtypes, devices, group) and returns its key
    (``ask_peers``: see ``group_is_intranode``; every argument error is raised before it)."""
    op = "moe_dispatch"
    require_tensor(op, "x", x, 2, "[num_tokens, hidden]")
    require_dtype(op, "x.dtype", x.dtype, DISPATCH_DTYPES)
    require_tensor(op, "token_indices", token_indices, 2, "[num_tokens, topk]")
    if token_indices.dtype != torch.int64:
        raise TypeError(f"{op}: token_indices must be int64 global expert ids (-1 = none); got {token_indices.dtype}")
    num_tokens, hidden = x.shape
    topk = token_indices.shape[1]
    if token_indices.shape[0] != num_tokens:
        raise ValueError(f"{op}: token_indices must be [num_tokens={num_tokens}, topk] like x's rows; "
                         f"got {tuple(token_indices.shape)}")
    if topk < 1:
        raise ValueError(f"{op}: token_indices must have at least one top-k column; got {tuple(token_indices.shape)}")
    if token_indices.device != x.device:
        raise ValueError(f"{op}: token_indices must be on x's device {x.device}; got {token_indices.device}")
    if token_probs is not None:
        require_tensor(op, "token_probs", token_probs, 2, "[num_tokens, topk]")
        require_dtype(op, "token_probs.dtype", token_probs.dtype, PROB_DTYPES)
        if token_probs.shape != token_indices.shape:
            raise ValueError(f"{op}: token_probs must have token_indices' shape {tuple(token_indices.shape)}; "
                             f"got {tuple(token_probs.shape)}")
        if token_probs.device != x.device:
            raise ValueError(f"{op}: token_probs must be on x's device {x.device}; got {token_probs.device}")
    _require_int(op, "num_experts", num_experts, 1)
    _require_int(op, "num_worst_tokens", num_worst_tokens, 0)
    world_size = _group_size(op, group)
    if num_experts % world_size:
        raise ValueError(f"{op}: num_experts={num_experts} must be divisible by the group size {world_size} "
                         "(experts are split evenly over the ranks, in rank order)")
    platform = platform_of(x.device.type)
    intranode = platform != "cpu" and group_is_intranode(group, ask_peers=ask_peers, device=x.device)
    return MoeDispatchProblem(hidden, topk, num_experts, world_size, x.dtype, token_probs is not None,
                              num_worst_tokens, platform, intranode)


_INTRANODE: dict = {}


def group_is_intranode(group: Any = None, ask_peers: bool = True, device: "torch.device | None" = None) -> bool:
    """Whether every rank of ``group`` (None: the default group) runs on this host.

    The first call per group all-gathers a hash of each rank's host name over the group, as one
    int64 tensor on ``device`` (default: the CPU for a gloo group, else the current CUDA device),
    so it needs no ``torch.cuda.set_device``; it is a collective: every rank of the group must make
    it, as every rank makes the moe_dispatch it is part of. Later calls read the cached answer.
    With ``ask_peers=False`` (``explain``, which one rank may call alone) nothing is exchanged:
    before that first gather the answer comes from the launcher's environment, true only when
    torchrun's ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``.

    >>> group_is_intranode(ask_peers=False)  # doctest: +SKIP
    True
    """
    import hashlib
    import os
    import socket

    import torch.distributed as dist

    key = (group if group is not None else dist.group.WORLD).group_name
    known = _INTRANODE.get(key)
    if known is not None:
        return known
    size = dist.get_world_size(group)
    if size == 1:
        known = True
    elif not ask_peers:
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        return local is not None and local == world
    else:
        if device is None:
            device = torch.device("cpu") if dist.get_backend(group) == "gloo" else \
                torch.device("cuda", torch.cuda.current_device())
        digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
        hosts = torch.empty(size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(hosts, mine, group=group)
        known = bool((hosts == hosts[0]).all())
    _INTRANODE[key] = known
    return known


def _check_handle(op: str, handle: object, group: Any) -> MoeHandle:
    if not isinstance(handle, MoeHandle):
        raise TypeError(f"{op}: handle must be the MoeHandle that moe_dispatch returned; got {type(handle).__name__}")
    size = _group_size(op, group)
    if size != handle.world_size:
        raise ValueError(f"{op}: the handle was made by a dispatch over a group of {handle.world_size} ranks; "
                         f"this group has {size}")
    return handle


def _check_rows(op: str, name: str, x: object, rows: int, what: str, dtypes, handle: MoeHandle) -> None:
    require_tensor(op, name, x, 2, f"[{rows}, hidden] ({what})")
    require_dtype(op, f"{name}.dtype", x.dtype, dtypes)
    if x.shape[0] != rows:
        raise ValueError(f"{op}: {name} must have {rows} rows ({what}); got {tuple(x.shape)}")
    if x.device != handle.device:
        raise ValueError(f"{op}: {name} must be on the dispatch's device {handle.device}; got {x.device}")


def _note_stream_flags(op: str, backend: str, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if (async_finish or allocate_on_comm_stream) and log.isEnabledFor(logging.DEBUG):
        log.debug("%s: async_finish=%s, allocate_on_comm_stream=%s accepted for DeepEP API compatibility; backend %s "
                  "runs its collectives synchronously with respect to the current stream, so both flags have no "
                  "effect (outputs are ready in stream order, allocated on the current stream)",
                  op, async_finish, allocate_on_comm_stream, backend)


# -- op spec ---------------------------------------------------------------------------------------------
_NOT_TUNABLE = ("moe_dispatch_combine is not tunable without a process group: profiling it needs every rank "
                "of a live group to run the same key at the same time; pin a backend "
                "(PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND) or rely on the platform default")


def _not_tunable(*_args: Any) -> Any:
    raise ValueError(_NOT_TUNABLE)


def _explain_problem(x, token_indices, token_probs=None, num_experts=None, group=None, async_finish=False,
                     allocate_on_comm_stream=False, num_worst_tokens=0) -> MoeDispatchProblem:
    payload = fp8_payload("moe_dispatch", x)
    problem = moe_dispatch_problem(x if payload is None else payload.data, token_indices, token_probs, num_experts,
                                   group, num_worst_tokens, ask_peers=False)
    if payload is None:
        return problem
    # what travels: the packed rows (fp8 data and scales side by side)
    return problem._replace(hidden=packed_layout(payload.data.shape[1], payload.scale)[2])


MOE_DISPATCH_COMBINE = register_op(OpSpec(
    name="moe_dispatch_combine",
    keys_vary_across_ranks=True,
    problem_type=MoeDispatchProblem,
    precision_of=lambda p: PrecisionType.FP8 if p.dtype in _FP8 else precision_of_dtype(p.dtype),
    # The autotuner calls make_inputs and reference outside its per-candidate error handling, so
    # they must not raise: they return placeholders, and ``run`` raises (a per-candidate failure).
    make_inputs=lambda p, device: (),
    run=_not_tunable,
    reference=lambda p, inputs: None,
    check=lambda p, out, ref: _NOT_TUNABLE,
    flops=lambda p: 0.0,
    problem_from_call=_explain_problem,
))


# -- the work, shared by the no-grad path and the autograd Functions ---------------------------------------
def _dispatch(decision, problem: MoeDispatchProblem, x, token_indices, token_probs, group):
    adapter = decision.entry.adapter
    recv_x, recv_idx, recv_probs, tokens_per_expert, layout = adapter.dispatch(
        problem, x, token_indices, token_probs, group)
    handle = MoeHandle(decision.backend, adapter, problem, layout, x.shape[0], recv_x.shape[0], x.device)
    return recv_x, recv_idx, recv_probs, tokens_per_expert, handle


def _combine(y: torch.Tensor, group, handle: MoeHandle) -> torch.Tensor:
    return handle.adapter.combine(handle.layout, y, group)


def _dispatch_rows(rows: torch.Tensor, group, handle: MoeHandle) -> torch.Tensor:
    return handle.adapter.dispatch_rows(handle.layout, rows, group)


def _masked_prob_grad(grad: torch.Tensor, recv_idx: torch.Tensor) -> torch.Tensor:
    """Only the local slots of recv_probs depend on token_probs; the others are constant zeros."""
    return torch.where(recv_idx >= 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_probs, token_indices, decision, problem, group):
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = _dispatch(decision, problem, x, token_indices,
                                                                            token_probs, group)
        ctx.mark_non_differentiable(recv_idx, *([tokens_per_expert] if torch.is_tensor(tokens_per_expert) else []))
        ctx.handle, ctx.group, ctx.recv_idx = handle, group, recv_idx
        return recv_x, recv_idx, recv_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_probs, _grad_list, _grad_handle):
        handle, group = ctx.handle, ctx.group
        gx = gp = None
        if ctx.needs_input_grad[0]:
            gx = _RowsFunction.apply(grad_x, group, handle, False)
        if ctx.needs_input_grad[1]:
            gp = _RowsFunction.apply(_masked_prob_grad(grad_probs, ctx.recv_idx), group, handle, False)
        return gx, gp, None, None, None, None


class _RowsFunction(torch.autograd.Function):
    """``apply(rows, group, handle, to_experts)``: rows sent along a handle's layout, back to their
    tokens (combine, ``to_experts=False``) or out to the experts again (a cached dispatch). Each
    direction's backward is the other one."""

    @staticmethod
    def forward(ctx, rows, group, handle, to_experts):
        ctx.group, ctx.handle, ctx.to_experts = group, handle, to_experts
        return _dispatch_rows(rows, group, handle) if to_experts else _combine(rows, group, handle)

    @staticmethod
    def backward(ctx, grad):
        return _RowsFunction.apply(grad, ctx.group, ctx.handle, not ctx.to_experts), None, None, None


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_disable_compile = getattr(torch.compiler, "disable", None) or (lambda fn: fn)


# -- public API --------------------------------------------------------------------------------------------
@_disable_compile
def moe_dispatch(x: Any, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                 num_experts: int, group: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, num_worst_tokens: int = 0):
    """Sends each token to every rank that holds one of its top-k experts (DeepEP semantics).

    Args:
        x: [num_tokens, hidden] bf16/fp16/fp32/fp64/fp8 rows, or an fp8 activation with its scales
            (a row/1-D-block QuantizedTensor, or DeepEP's ``(x_fp8, scales)`` pair): recv_x then
            comes back in the same form, scales included.
        token_indices: [num_tokens, topk] int64 global expert ids; -1 = no expert.
        token_probs: [num_tokens, topk] float32 or bf16 router probabilities, or None.
        num_experts: total experts; must be divisible by the group size (split in rank order).
        group: the expert-parallel ProcessGroup (None: the default group).
        async_finish, allocate_on_comm_stream: accepted for DeepEP API compatibility; the TORCH
            backend ignores both (logged at debug): its collectives finish in current-stream order
            and its outputs are allocated on the current stream.
        num_worst_tokens: if > 0, the receive buffers have exactly this many rows (x rows zero,
            recv_idx -1, recv_probs 0 past the real ones) and no host sync happens (see the module
            docstring: rows past this count are dropped, bad ids routed nowhere).

    Returns:
        ``(recv_x, recv_idx, recv_probs, tokens_per_expert, handle)``: recv_x [R, hidden] ordered
        by source rank then source token; recv_idx [R, topk] int64 local expert ids or -1;
        recv_probs [R, topk] in token_probs' dtype (0 where recv_idx is -1; None without
        token_probs); tokens_per_expert, one count per local expert: a list of ints (the one host
        sync rides on it, like DeepEP's num_recv_tokens_per_expert_list), or with num_worst_tokens
        an int64 device tensor; handle: pass it to :func:`moe_combine`.

    Example (every rank of an initialised group runs this):
        >>> recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, idx, probs, 64, ep_group)  # doctest: +SKIP
        >>> y = moe_combine(expert_mlp(recv_x, recv_idx, recv_probs, counts), ep_group, handle)  # doctest: +SKIP
    """
    payload = fp8_payload("moe_dispatch", x)
    if payload is not None:
        recv, recv_idx, recv_probs, counts, handle = moe_dispatch(
            pack_rows(payload.data, payload.scale), token_indices, token_probs, num_experts, group, async_finish,
            allocate_on_comm_stream, num_worst_tokens)
        recv = payload.wrap(*unpack_rows(recv, payload.data.shape[1], payload.scale))
        return recv, recv_idx, recv_probs, counts, handle
    problem = moe_dispatch_problem(x, token_indices, token_probs, num_experts, group, num_worst_tokens)
    require_bool("moe_dispatch", "async_finish", async_finish)
    require_bool("moe_dispatch", "allocate_on_comm_stream", allocate_on_comm_stream)
    decision = resolve(MOE_DISPATCH_COMBINE, problem)
    _note_stream_flags("moe_dispatch", decision.backend, async_finish, allocate_on_comm_stream)
    if _needs_grad(x, token_probs):
        return _DispatchFunction.apply(x, token_probs, token_indices, decision, problem, group)
    return _dispatch(decision, problem, x, token_indices, token_probs, group)


@_disable_compile
def moe_combine(x: torch.Tensor, group: Any, handle: MoeHandle, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> torch.Tensor:
    """Sends each received row back to its source and sums, per source token, what came back.

    ``x`` is [R, hidden] with the R rows moe_dispatch returned (``handle.recv_rows``: padded rows,
    if any, are ignored) in bf16/fp16/fp32/fp64; hidden may differ from the dispatch's. Returns
    [num_tokens, hidden] in x's dtype (summed in fp32 for bf16/fp16, in rank order, so results are
    deterministic). Tokens that went nowhere come back as zeros. ``group`` must have the
    dispatch's size. The stream flags are accepted and ignored, as in :func:`moe_dispatch`.
    """
    handle = _check_handle("moe_combine", handle, group)
    _check_rows("moe_combine", "x", x, handle.recv_rows, "the rows moe_dispatch returned", COMBINE_DTYPES, handle)
    require_bool("moe_combine", "async_finish", async_finish)
    require_bool("moe_combine", "allocate_on_comm_stream", allocate_on_comm_stream)
    _note_stream_flags("moe_combine", handle.backend, async_finish, allocate_on_comm_stream)
    if _needs_grad(x):
        return _RowsFunction.apply(x, group, handle, False)
    return _combine(x, group, handle)


@_disable_compile
def moe_dispatch_cached(x: torch.Tensor, group: Any, handle: MoeHandle) -> torch.Tensor:
    """Dispatches more rows of the same tokens with an existing handle (DeepEP's cached mode).

    ``x`` is [num_tokens, C] (any dispatch dtype, e.g. fp8 scales next to fp8 data); returns
    [handle.recv_rows, C] in the same order as the handle's dispatch (padding rows zero), with no host sync.
    """
    handle = _check_handle("moe_dispatch_cached", handle, group)
    _check_rows("moe_dispatch_cached", "x", x, handle.num_tokens, "one row per dispatched token", DISPATCH_DTYPES,
                handle)
    if _needs_grad(x):
        return _RowsFunction.apply(x, group, handle, True)
    return _dispatch_rows(x, group, handle)


def check_id_ranges(ranges: "list[tuple[int, int]]", num_experts: int, me: int) -> None:
    """Raises the collective bad-expert-id ValueError if any rank's ``(min id, max id)`` is outside
    ``[-1, num_experts)``. Every backend calls it with the same all-gathered ranges on every rank, so
    all ranks raise the same error (naming the offending ranks) and none is left in a collective."""
    bad = [(r, lo, hi) for r, (lo, hi) in enumerate(ranges) if lo < -1 or hi >= num_experts]
    if bad:
        where = "; ".join(f"rank {r}{' (this rank)' if r == me else ''} passed ids in [{lo}, {hi}]"
                          for r, lo, hi in bad)
        raise ValueError(f"moe_dispatch: token_indices must hold expert ids in [-1, num_experts={num_experts}); "
                         f"{where} (every rank of the group raises this)")


def dispatch_layout(token_indices: torch.Tensor, num_experts: int, world_size: int):
    """Per-rank and per-expert routing counts without communication or host sync.

    Returns ``(num_tokens_per_rank [W] int64, num_tokens_per_expert [E] int64,
    is_token_in_rank [T, W] bool)``, DeepEP's get_dispatch_layout results (DeepEP's counts are
    int32; the Buffer facade converts). Ids outside
    ``[0, num_experts)`` count nowhere (they are reported by moe_dispatch's collective check).
    """
    t, _ = token_indices.shape
    local = num_experts // world_size
    valid = (token_indices >= 0) & (token_indices < num_experts)
    rank_of = torch.where(valid, token_indices // local, world_size)
    is_token_in_rank = torch.zeros((t, world_size + 1), dtype=torch.bool, device=token_indices.device)
    is_token_in_rank.scatter_(1, rank_of, True)
    is_token_in_rank = is_token_in_rank[:, :world_size]
    expert = torch.where(valid, token_indices, num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=token_indices.device)
    per_expert.scatter_add_(0, expert, torch.ones_like(expert))
    return is_token_in_rank.sum(0, dtype=torch.int64), per_expert[:num_experts], is_token_in_rank
