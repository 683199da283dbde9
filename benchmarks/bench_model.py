"""Model-level benchmark: whole training steps of one model built twice, from plain PyTorch and from
turbo_dispatch, with the same weights and the same batches.

The model is examples/train_llama.py's decoder (token embedding, pre-norm blocks of grouped-query
attention with rotary embeddings and a SwiGLU MLP or a routed MoE, final norm, output head),
built from a ``LayerKit``:

* ``torch``: ``nn.Linear``, ``nn.RMSNorm``, ``F.scaled_dot_product_attention`` (``enable_gqa``)
  and, for the experts, ``torch._grouped_mm`` (sm_90/sm_100; a per-expert ``torch.mm`` loop
  elsewhere). It is the peer: ``ratio_vs_best_peer`` is its step time over the variant's.
* ``turbo``: the library's modules and ops (``modules.RMSNormLinear`` for the attention's norm and
  q/k/v projection, ``modules.SwiGLUMLP``, ``modules.Linear``, ``modules.GroupedLinear``,
  ``ops.flash_attn_func``, ``ops.split_qkv_rotary_emb`` for the q/k/v split and rotation and
  ``ops.swiglu`` for the experts' activation, which the torch peer writes as torch ops); with an
  fp8 recipe on a GPU the norm and the SwiGLU write their GEMM's fp8 input themselves (the fused
  producers).
* ``unfused`` (a variant flag): the same with the norm and the SwiGLU as separate torch ops before
  each ``modules.Linear``, which shows what the fused producers buy.

Variants (``--variants``, comma-separated): ``torch``; ``bf16`` (the library in the model dtype,
fp32 on the CPU); ``fp8-tensorwise``, ``fp8-rowwise``, ``fp8-blockwise`` (HYBRID fp8 GEMMs in the
blocks; the head and the MoE router stay in the model dtype); each turbo variant takes the flags
``:tune`` (autotuning on, into a fresh tuning DB that this run writes next to its reports, the
shipped DBs off, so every key is tuned on this GPU) and ``:unfused``. A variant without ``:tune``
runs what a user gets out of the box: the shipped DBs, else each op's default (no user DB).

Configs (``--config``): ``llama3.1-8b`` (4 layers of Llama-3.1-8B, B2 x S4096),
``llama3.1-70b-tp8`` (4 layers of Llama-3.1-70B at the widths one rank of TP8 computes: 8/1 heads,
FFN 3584; no collectives), ``deepseek-v3-ep8`` (2 MoE layers holding one EP8 rank's share of
DeepSeek-V3's experts, 32 of 256 with top-8 routing over them, expert FFN 2048, 4096 tokens; no
collectives, and GQA 56/8 heads standing in for MLA; expert parallelism over ranks is
examples/train_moe.py's). The vocabulary is 32768 (not the models' own) so that the head does not
dominate a few-layer stack. ``--quick`` on a GPU takes one layer and 10 training steps; on the CPU
every config shrinks to a tiny model (smoke runs: the timings mean nothing).

Per config and variant:

1. check: one forward+backward on the first batch; the loss and the gradient of every parameter
   against the torch model run in float32 (float64 on the CPU) on the same weights (an MoE model
   routes the tokens as the reference did, see ``LocalMoE``). The build must expose the
   reference's parameters (names, shapes, requires_grad) and give each a gradient. The torch
   peer passes within 10% (a sanity bound); a turbo variant in the model dtype within max(2e-2
   bf16 / 5e-3 fp32, twice the peer's error) per tensor, an fp8 one at SNR >= 15 dB (every fp8
   GEMM of the stack adds its error, where the op benches gate one GEMM at 20 dB). A FAIL voids
   the row's timing. On a GPU the reference's gradients wait in host memory;
2. training: ``--steps`` AdamW steps (lr ``--lr``, gradient clipping at 1) from the same weights
   on the same batches: ``loss_dev_pct`` is the largest relative gap of the loss curve to the
   torch peer's, ``train_step_ms`` the median step with the optimizer, ``peak_mem_gib`` the most
   memory the variant's training held (weights, gradients, optimizer state, activations), over
   what was allocated before it was built. How far apart two correct bf16 curves may drift
   depends on the run: rounding differences grow over the steps, and a GPU's atomics
   (attention's backward, the MoE combine's ``index_add``) can make even one build differ from
   itself. So the peer trains once more as a replay whose GEMMs sum in a different, equally
   valid order (``SplitKLinear``): ``loss_noise_pct`` is the replay's gap to the peer, and a
   variant's curve agrees (``loss_ok``) when its gap is within ``loss_tol_pct`` = max(1%,
   3x the noise). A gradient defect shows in the first-step check; the curve catches what
   grows over the steps;
3. timing: forward (``fwd_ms``) and forward+backward (``step_ms``, gradients set to None first,
   no optimizer: the optimizer is the same torch code in every variant) of every variant in
   turns (benchmarks/harness.py's ``Timer.time_interleaved``), so GPU clock drift reaches all
   alike. tokens/s and MFU come from ``step_ms``; MFU counts the model's FLOPs (3x the forward
   GEMMs, 3.5x the causal attention forward) against the GPU's dense bf16 peak for every
   variant, fp8 included (``--peak-tflops`` sets it where the GPU is not in the table).
   ``layers_step_ms`` times the blocks alone the same way (forward and backward of the decoder
   blocks on fixed random hidden states, one fixed random gradient at their output: no
   embedding, final norm, output head or loss), the step of a layer stack as the issue measures
   it; ``layers_ratio`` is the peer's over the variant's.

Results: ``<out>/<gpu>_<date>_<name>.{csv,md,png}``, ``--out`` defaulting to
``$TURBO_BENCH_OUT/model``, else bench-out/model. The markdown leads with a table per config.

Usage:
    python benchmarks/bench_model.py                                  # every config, GPU
    python benchmarks/bench_model.py --config llama3.1-8b --layers 8
    python benchmarks/bench_model.py --config llama3.1-8b --variants torch,bf16,fp8-rowwise:tune
    python benchmarks/bench_model.py --quick --device cpu             # smoke run (tiny configs)
    python benchmarks/bench_model.py --config llama3.1-8b --layers 2 --variants torch,fp8-rowwise --profile 3
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness as H  # noqa: E402
from bench_grouped_gemm import TorchGroupedMM, grouped_mm_usable, loop_grouped  # noqa: E402
from train_llama import (TURBO_KIT, BigramCorpus, Decoder, LayerKit, fp8_config,  # noqa: E402
                         next_token_loss, torch_split_rotary)

import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch import GlobalBackendManager  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402
from turbo_dispatch.presets import get_model  # noqa: E402
from turbo_dispatch.registry import kernel_module  # noqa: E402

#: Dense bf16 peak TFLOPS by a substring of the device name, first match wins (no sparsity).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("H800", 989.4), ("A100", 312.0), ("MI300X", 1307.4), ("MI325X", 1307.4), ("B200", 2250.0))
PEER_MAX_REL_ERR = 0.1
FP8_MIN_SNR_DB = 15.0
LOSS_TARGET_PCT = 1.0
#: A variant's loss curve may stray from the peer's this many times as far as the peer's replay does.
LOSS_NOISE_FACTOR = 3.0


# -- configs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    """One model to build: a dense decoder (``ffn``) or an MoE one (``experts`` > 0, each of
    width ``expert_ffn``, ``topk`` per token); ``variants``: the default ``--variants``."""

    name: str
    note: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    batch: int
    seq_len: int
    vocab: int = 32768
    ffn: int = 0
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    variants: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def shape(self) -> str:
        return f"L{self.layers} b{self.batch} s{self.seq_len}"


DENSE_VARIANTS = ("torch", "bf16", "bf16:tune", "fp8-tensorwise:tune", "fp8-rowwise:tune", "fp8-blockwise:tune",
                  "fp8-rowwise:unfused:tune", "fp8-blockwise:unfused:tune")
MOE_VARIANTS = ("torch", "bf16", "bf16:tune", "fp8-rowwise:tune", "fp8-blockwise:tune")


def _configs() -> dict[str, ModelConfig]:
    l8, l70, v3 = get_model("llama3.1-8b"), get_model("llama3.1-70b"), get_model("deepseek-v3")
    tp, ep = 8, 8
    return {c.name: c for c in (
        ModelConfig("llama3.1-8b", "Llama-3.1-8B layers", l8.hidden, l8.heads, l8.kv_heads, l8.head_dim, layers=4,
                    batch=2, seq_len=4096, ffn=l8.intermediate, variants=DENSE_VARIANTS),
        ModelConfig("llama3.1-70b-tp8", "Llama-3.1-70B layers at one TP8 rank's widths", l70.hidden, l70.heads // tp,
                    l70.kv_heads // tp, l70.head_dim, layers=4, batch=2, seq_len=4096, ffn=l70.intermediate // tp,
                    variants=DENSE_VARIANTS),
        ModelConfig("deepseek-v3-ep8", "DeepSeek-V3-like MoE layers, one EP8 rank's experts, local",
                    v3.hidden, v3.hidden // 128, 8, 128, layers=2, batch=1, seq_len=4096, experts=v3.experts // ep,
                    topk=v3.topk, expert_ffn=v3.moe_intermediate, variants=MOE_VARIANTS),
    )}


CONFIGS = _configs()


def cpu_config(c: ModelConfig) -> ModelConfig:
    """The tiny CPU form of ``c``: same kind (dense or MoE; the TP config keeps heads x head_dim
    narrower than hidden), seconds per variant."""
    heads, kv, hd = (2, 1, 16) if c.heads * c.head_dim != c.hidden else (4, 2, 16)
    return replace(c, hidden=64, heads=heads, kv_heads=kv, head_dim=hd, layers=2, batch=2, seq_len=32, vocab=128,
                   ffn=96 if c.ffn else 0, experts=4 if c.experts else 0, topk=2 if c.experts else 0,
                   expert_ffn=32 if c.experts else 0)


# -- flops -----------------------------------------------------------------------------------------
def model_flops(c: ModelConfig) -> tuple[float, float]:
    """(forward, training step) FLOPs: GEMMs 2*M*N*K (the experts over the routed rows), the
    causal attention 2 * attended pairs * heads * 2 * head_dim; a step is 3x the GEMMs and 3.5x
    the attention (its backward has five matmuls to the forward's two)."""
    t, q, kv = c.tokens, c.heads * c.head_dim, c.kv_heads * c.head_dim
    gemm = 2.0 * t * (c.hidden * (q + 2 * kv) + q * c.hidden)
    if c.experts:
        gemm += 2.0 * t * c.hidden * c.experts + 2.0 * t * c.topk * 3 * c.hidden * c.expert_ffn
    else:
        gemm += 2.0 * t * 3 * c.hidden * c.ffn
    attn = 2.0 * c.batch * (c.seq_len * (c.seq_len + 1) // 2) * c.heads * 2 * c.head_dim
    head = 2.0 * t * c.hidden * c.vocab
    forward = c.layers * (gemm + attn) + head
    return forward, 3.0 * (c.layers * gemm + head) + 3.5 * c.layers * attn


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)


# -- the plain-torch kit and the unfused library kit ------------------------------------------------
class NormLinear(torch.nn.Module):
    """``linear(RMSNorm(x))`` as two ops, with modules.RMSNormLinear's children and parameter names."""

    def __init__(self, hidden: int, eps: float, linear: torch.nn.Module) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class SwiGLU(torch.nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` as separate ops, modules.SwiGLUMLP's names;
    ``swiglu(gate, up)`` computes the activation."""

    def __init__(self, gate_proj: torch.nn.Module, up_proj: torch.nn.Module, down_proj: torch.nn.Module,
                 swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch_swiglu) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))


def unfused_kit(linear: Callable[[int, int, Optional[Float8QuantConfig]], torch.nn.Module],
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                split_rotary: Callable[..., tuple] = torch_split_rotary,
                swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch_swiglu) -> LayerKit:
    """A kit whose norms and SwiGLU are separate ops around ``linear`` projections (torch ops
    unless ``split_rotary`` / ``swiglu`` say otherwise)."""
    return LayerKit(linear=linear, norm_linear=lambda h, o, eps, fp8: NormLinear(h, eps, linear(h, o, fp8)),
                    mlp=lambda h, f, fp8: SwiGLU(linear(h, f, fp8), linear(h, f, fp8), linear(f, h, fp8), swiglu),
                    attend=attend, split_rotary=split_rotary, swiglu=swiglu)


def torch_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query SDPA on ``[B, S, H, D]`` tensors (``enable_gqa``). In float32 on a GPU
    (the reference) k and v are expanded to q's heads instead: flash attention takes no float32,
    and a GQA call the memory-efficient kernel refuses would fall to the math path, which holds a
    [B, H, S, S] matrix per layer."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and q.dtype == torch.float32:
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)


TORCH_KIT = unfused_kit(lambda i, o, fp8: torch.nn.Linear(i, o, bias=False), torch_attend)


class SplitKLinear(torch.nn.Linear):
    """``nn.Linear`` whose product is two half-K products summed in float32, then rounded to the
    input's dtype: the same math in a different, equally valid summation order (what a split-K
    GEMM does), with nn.Linear's parameters. The peer's replay is built from it, so that its gap
    to the peer measures how far rounding alone moves the loss curve."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.in_features // 2
        if half == 0:
            return super().forward(x)
        lo = F.linear(x[..., :half], self.weight[:, :half]).float()
        out = (lo + F.linear(x[..., half:], self.weight[:, half:]).float()).to(x.dtype)
        return out if self.bias is None else out + self.bias


REPLAY_KIT = unfused_kit(lambda i, o, fp8: SplitKLinear(i, o, bias=False), torch_attend)
# the fp8 producers unfused, the other ops the library's
UNFUSED_KIT = unfused_kit(TURBO_KIT.linear, TURBO_KIT.attend, TURBO_KIT.split_rotary, TURBO_KIT.swiglu)


class TorchGroupedLinear(torch.nn.Module):
    """modules.GroupedLinear in plain torch: ``weight [G, out, in]``; ``forward(x, group_lens)``
    through ``torch._grouped_mm`` where it runs (bf16 on sm_90/sm_100), else a per-group loop."""

    def __init__(self, num_groups: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features))
        bound = 1.0 / math.sqrt(in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and grouped_mm_usable(x.device) is None:
            return TorchGroupedMM.apply(x.contiguous(), self.weight, group_lens.cumsum(0).to(torch.int32))
        return loop_grouped(x, self.weight, group_lens.tolist())


class LocalMoE(torch.nn.Module):
    """Top-k routed SwiGLU experts, all on this device: train_moe.py's MoE with one rank (router
    in the model dtype, softmax in fp32, the k probabilities renormalised), routed without a host
    sync. ``grouped(G, in, out, fp8)`` makes the expert layers.

    ``last_routing`` holds the experts each token went to in the last forward; ``routing``, when
    set, imposes them instead of the top-k (the probabilities still come from the router). The
    check runs every model on the reference's routing: rounding breaks near-ties between a
    token's k-th and next expert either way, which would count whole rows as errors."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, kit: LayerKit,
                 grouped: Callable[..., torch.nn.Module], fp8: Optional[Float8QuantConfig]) -> None:
        super().__init__()
        self.experts, self.topk = experts, topk
        self.routing: Optional[torch.Tensor] = None
        self.last_routing: Optional[torch.Tensor] = None
        self.router = kit.linear(hidden, experts, None)
        self.swiglu = kit.swiglu
        self.up_gate = grouped(experts, hidden, 2 * ffn, fp8)
        self.down = grouped(experts, ffn, hidden, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        if self.routing is None:
            top_probs, top_idx = probs.topk(self.topk, dim=-1)
        else:
            top_idx = self.routing
            top_probs = probs.gather(-1, top_idx)
        self.last_routing = top_idx.detach()
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        flat = top_idx.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.topk
        # scatter_add, not bincount: bincount sizes its output from the data (a host sync on a GPU)
        group_lens = flat.new_zeros(self.experts).scatter_add_(0, flat, torch.ones_like(flat))
        gate, up = self.up_gate(tokens[rows], group_lens).chunk(2, dim=-1)
        out = self.down(self.swiglu(gate, up), group_lens)
        weighted = out * top_probs.flatten()[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(tokens).index_add(0, rows, weighted).view_as(x)


def build_model(c: ModelConfig, kit: LayerKit, fp8: Optional[Float8QuantConfig]) -> Decoder:
    """``c`` as a Decoder of ``kit`` (experts: ``TorchGroupedLinear`` for the torch and replay
    kits, else ``modules.GroupedLinear``), on the current default device, randomly initialised."""
    if c.experts:
        if kit in (TORCH_KIT, REPLAY_KIT):
            grouped = lambda g, i, o, fp8: TorchGroupedLinear(g, i, o)  # noqa: E731
        else:
            grouped = lambda g, i, o, fp8: turbo.modules.GroupedLinear(g, i, o, fp8_config=fp8)  # noqa: E731
        make_mlp = lambda _: LocalMoE(c.hidden, c.expert_ffn, c.experts, c.topk, kit, grouped, fp8)  # noqa: E731
    else:
        make_mlp = lambda _: kit.mlp(c.hidden, c.ffn, fp8)  # noqa: E731
    return Decoder(c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, make_mlp, fp8, kit, c.head_dim)


def load_model(c: ModelConfig, kit: LayerKit, fp8: Optional[Float8QuantConfig], state: dict, device: torch.device,
               dtype: torch.dtype) -> Decoder:
    """``build_model`` in ``dtype`` with the weights of ``state`` (built on the meta device: no
    init cost, no float32 copy of a bf16 model)."""
    with torch.device("meta"):
        model = build_model(c, kit, fp8)
    model = model.to(dtype).to_empty(device=device)
    model.load_state_dict(state)  # copies convert: a bf16 state loads into a float32 reference too
    return model


def moe_layers(model: torch.nn.Module) -> list[LocalMoE]:
    """``model``'s MoE layers, first block first."""
    return [m for m in model.modules() if isinstance(m, LocalMoE)]


def set_routing(model: torch.nn.Module, routes: Optional[list]) -> None:
    """Imposes ``routes`` (one per MoE layer, in order) on ``model``'s MoE layers; None frees them."""
    for i, moe in enumerate(moe_layers(model)):
        moe.routing = None if routes is None else routes[i]


def parameter_table(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    """What ``model`` hands the optimizer: (name, shape, requires_grad) of every parameter."""
    return [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]


# -- variants --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One build of the model: ``kit`` torch, turbo or unfused; ``recipe`` an fp8 recipe or
    ``none``; ``tune``: autotuning into the run's fresh DB."""

    spec: str
    kit: str
    recipe: str
    tune: bool

    @property
    def peer(self) -> bool:
        return self.kit == "torch"

    def label(self, dtype: torch.dtype) -> str:
        precision = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
        if self.peer:
            return f"torch {precision}"
        words = ["turbo", precision if self.recipe == "none" else f"fp8 {self.recipe}"]
        return " ".join(words + ["unfused"] * (self.kit == "unfused") + ["autotune"] * self.tune)

    def layer_kit(self) -> LayerKit:
        return {"torch": TORCH_KIT, "turbo": TURBO_KIT, "unfused": UNFUSED_KIT}[self.kit]


def parse_variant(spec: str) -> Variant:
    """``torch``, ``bf16`` or ``fp8-<recipe>``, then the flags ``:tune`` and ``:unfused``."""
    head, *flags = spec.strip().split(":")
    bad = set(flags) - {"tune", "unfused"}
    recipe = head.removeprefix("fp8-") if head.startswith("fp8-") else ("none" if head == "bf16" else None)
    if head == "torch" and not flags:
        return Variant(spec, "torch", "none", False)
    if bad or recipe not in ("none", "tensorwise", "rowwise", "blockwise"):
        raise ValueError(f"bad variant {spec!r}: torch, bf16 or fp8-tensorwise|rowwise|blockwise, then :tune and/or "
                         f":unfused (not on torch)")
    return Variant(spec, "unfused" if "unfused" in flags else "turbo", recipe, "tune" in flags)


def settings(v: Variant, db: Path) -> Callable[[], None]:
    """The function that puts the library's settings in ``v``'s state (see the module docstring)."""
    def enter() -> None:
        GlobalBackendManager.reset()
        GlobalBackendManager.set_tune_db(db if v.tune else None)
        if v.tune:
            GlobalBackendManager.set_shipped_tune_db(False)
        GlobalBackendManager.set_auto_tune(v.tune)
    return enter


def fused_producers_note(device: torch.device) -> str:
    """Whether modules.RMSNormLinear / SwiGLUMLP take their fused path for models on ``device``."""
    module, why = kernel_module("fused_fp8_producers")
    reason = why if module is None else module.available()
    if reason is None and not module.serves(torch.empty(0, device=device)):
        reason = f"they do not take {device.type} tensors here"
    return "fused fp8 producers: " + ("on" if reason is None else f"off ({reason})")


# -- one config ------------------------------------------------------------------------------------
@dataclass
class Measured:
    """What one variant's build, check and training gave (the model stays for the timing)."""

    variant: Variant
    model: Optional[torch.nn.Module] = None
    enter: Callable[[], None] = lambda: None
    check: Optional[H.Check] = None
    errors: dict = field(default_factory=dict)  # relative error per checked tensor
    losses: list[float] = field(default_factory=list)
    train_step_ms: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    setup_s: Optional[float] = None


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One step's loss with the gradients in ``.grad`` (dropped first); returns the detached loss."""
    model.zero_grad(set_to_none=True)
    loss = next_token_loss(model(inputs), targets)
    loss.backward()
    return loss.detach()


@dataclass
class ReferenceRun:
    """The torch model's first step in float32 / float64: ``tensors`` the loss and every
    parameter's gradient (on the host when the model ran on a GPU), ``routes`` each MoE layer's
    routing, ``params`` its ``parameter_table``."""

    tensors: dict
    routes: list
    params: list


def reference(c: ModelConfig, state: dict, batch, device: torch.device, dtype: torch.dtype) -> ReferenceRun:
    """The first step of the torch model in ``dtype`` on ``batch``."""
    model = load_model(c, TORCH_KIT, None, state, device, dtype)
    loss = forward_backward(model, *batch)
    # Every gradient of a multi-billion-parameter model in float32 would crowd the GPU that the
    # variants train on next: they wait on the host, and the check brings each back in turn.
    tensors = {"loss": loss.cpu(), **{name: p.grad.detach().cpu() for name, p in model.named_parameters()
                                      if p.grad is not None}}
    run = ReferenceRun(tensors, [moe.last_routing for moe in moe_layers(model)], parameter_table(model))
    del model
    H.free_memory(device)
    return run


def compare(v: Variant, got: dict, ref: dict, peer_err: dict, dtype: torch.dtype) -> tuple[H.Check, dict]:
    """The check of one variant (see the module docstring) and its relative error per tensor;
    ``got``: the variant's loss and gradients by name (None: no gradient), ``peer_err``: the
    torch peer's relative errors (empty when the peer did not run)."""
    check, errors = H.Check(), {}
    for name, r in ref.items():
        out = got.get(name)
        if out is None:
            check.ok = False
            check.reasons.append(f"{name}: no gradient")
            continue
        err = H.rel_err(out, r.to(out.device))
        errors[name] = err
        if not math.isfinite(err):
            check.ok = False
            check.reasons.append(f"{name}: NaN/inf")
            continue
        snr = math.inf if err == 0 else -20 * math.log10(err)  # signal / noise is 1 / err^2
        check.snr_db, check.rel_err = min(check.snr_db, snr), max(check.rel_err, err)
        if v.recipe != "none":
            if snr < FP8_MIN_SNR_DB:
                check.ok = False
                check.reasons.append(f"{name}: SNR {snr:.1f} dB < {FP8_MIN_SNR_DB}")
            continue
        tol = PEER_MAX_REL_ERR if v.peer else max(H.REL_TOL.get(dtype, 5e-3), 2 * peer_err.get(name, 0.0))
        if err > tol:
            check.ok = False
            check.reasons.append(f"{name}: rel err {err:.2e} > {tol:.1e}")
    return check, errors


def train_variant(c: ModelConfig, v: Variant, state: dict, batches: list, ref: ReferenceRun, peer_err: dict, args,
                  device: torch.device, dtype: torch.dtype, db: Path) -> Measured:
    """Builds ``v``'s model, checks its first step against ``ref`` and trains it
    ``len(batches)`` steps."""
    m = Measured(v, enter=settings(v, db) if not v.peer else GlobalBackendManager.reset)
    fp8 = fp8_config(v.recipe)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    m.enter()
    t0 = time.perf_counter()
    try:
        m.model = load_model(c, v.layer_kit(), fp8, state, device, dtype)
        set_routing(m.model, ref.routes)
        loss = forward_backward(m.model, *batches[0])
        set_routing(m.model, None)
        got = {"loss": loss, **{name: p.grad for name, p in m.model.named_parameters()}}
        m.check, m.errors = compare(v, got, ref.tensors, peer_err, dtype)
        table = parameter_table(m.model)
        if table != ref.params:
            m.check.ok = False
            m.check.reasons.append("its parameters (names, shapes, requires_grad) differ from the torch model's: "
                                   + ", ".join(sorted({t[0] for t in set(table) ^ set(ref.params)})[:8]))
        H.sync(device)
        m.setup_s = time.perf_counter() - t0
        m.model.zero_grad(set_to_none=True)
        m.losses, m.train_step_ms, m.peak_mem_gib = train(m.model, batches, args.lr, device, base)
        if not all(math.isfinite(x) for x in m.losses):
            m.check = H.failed(f"training diverged: loss {m.losses}")
    except Exception as exc:  # a crashing variant is a FAIL, the run goes on
        m.check, m.model = H.failed("raised " + H.error_note(exc)), None
        H.free_memory(device)
    return m


def train(model: torch.nn.Module, batches: list, lr: float, device: torch.device,
          base_bytes: int) -> tuple[list[float], Optional[float], Optional[float]]:
    """AdamW steps over ``batches``: (losses, median step ms from the third step on, peak GiB
    above ``base_bytes`` from the second step on; None on the CPU). Nothing waits on the GPU
    between steps, so the host runs ahead as in training."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gpu = device.type == "cuda"
    losses, marks = [], []
    for step, (inputs, targets) in enumerate(batches):
        if gpu and step == 1:
            # from the second step on: the first may still tune keys, whose trial runs are no training footprint
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        marks.append(_mark(gpu))
        losses.append(forward_backward(model, inputs, targets))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    marks.append(_mark(gpu))
    H.sync(device)
    if gpu:
        times = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        times = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    peak = None
    if gpu and len(batches) > 1:
        peak = (torch.cuda.max_memory_allocated(device) - base_bytes) / 2**30
    del optimizer
    model.zero_grad(set_to_none=True)
    return [float(x) for x in losses], statistics.median(times[2:] or times), peak


def _mark(gpu: bool):
    """A recorded CUDA event on a GPU, else the wall clock."""
    if not gpu:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def time_variants(measured: list[Measured], batch, timer: H.Timer, hidden: int,
                  dtype: torch.dtype) -> dict[int, tuple]:
    """Forward, forward+backward and the blocks' forward+backward of every PASSing variant, in
    turns; {index: (fwd_ms, step_ms, step_host_ms, layers_step_ms)}."""
    live = [(i, m) for i, m in enumerate(measured) if m.check is not None and m.check.ok and m.model is not None]
    if not live:
        return {}
    models = [m.model for _, m in live]

    def setup(m: Measured) -> Callable[[], None]:
        def go() -> None:
            for other in models:  # one model's gradients alive at a time
                other.zero_grad(set_to_none=True)
            m.enter()
        return go

    def forward(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        return lambda: next_token_loss(model(batch[0]), batch[1])

    setups = [setup(m) for _, m in live]
    fwd = timer.time_interleaved([forward(m.model) for _, m in live], setups)
    step = timer.time_interleaved([lambda model=m.model: forward_backward(model, *batch) for _, m in live], setups)
    host = timer.last_host_ms
    gen = torch.Generator(device=batch[0].device).manual_seed(7)
    shape = (*batch[0].shape, hidden)
    x0 = torch.randn(shape, generator=gen, device=batch[0].device, dtype=dtype)
    grad = torch.randn(shape, generator=gen, device=batch[0].device, dtype=dtype) / shape[-1] ** 0.5

    def layers(model: torch.nn.Module) -> Callable[[], None]:
        return lambda: model.blocks_forward(x0).backward(grad)

    layer_steps = timer.time_interleaved([layers(m.model) for _, m in live], setups)
    for model in models:
        model.zero_grad(set_to_none=True)
    return {i: (f, s, h, ls) for (i, _), f, s, h, ls in zip(live, fwd, step, host, layer_steps)}


def profile_variants(c: ModelConfig, measured: list[Measured], batch, iters: int, device: torch.device,
                     dtype: torch.dtype, folder: Path) -> None:
    """``--profile N``: N forward+backward steps of every timed variant under cProfile and
    torch.profiler (the kernel table shows where the step's GPU time goes), one text file each in
    ``folder``."""
    for m in measured:
        if m.model is None or m.check is None or not m.check.ok:
            continue
        m.enter()
        label = m.variant.label(dtype)
        H.profile_to_file(folder, f"{c.name}_{label}", lambda model=m.model: forward_backward(model, *batch), iters,
                          device, f"{c.name} {c.shape}: {label}, forward + backward")
        m.model.zero_grad(set_to_none=True)


def replay_or_note(c: ModelConfig, state: dict, batches: list, peer_losses: list[float], args, device: torch.device,
                   dtype: torch.dtype, notes: list[str]) -> list[float]:
    """The peer's loss curve once more, from ``REPLAY_KIT``'s build (``SplitKLinear``: the same
    math, summed in another order) on the same weights and batches; empty, with a note in
    ``notes``, when it raised."""
    t0 = time.time()
    GlobalBackendManager.reset()
    try:
        model = load_model(c, REPLAY_KIT, None, state, device, dtype)
        losses = train(model, batches, args.lr, device, 0)[0]
    except Exception as exc:  # the replay only widens the loss tolerance: the run goes on without it
        notes.append(f"{c.name}: the torch replay raised {H.error_note(exc)}; loss tolerance {LOSS_TARGET_PCT}%")
        return []
    finally:
        model = None
        H.free_memory(device)
    gap = curve_gap_pct(losses, peer_losses)
    print(f"  torch replay (split-K sums): loss {losses[0]:.4f} -> {losses[-1]:.4f}"
          + (f", {gap:.3f}% from the peer" if gap is not None else "") + f" [{time.time() - t0:.1f} s]", flush=True)
    return losses


def curve_gap_pct(losses: list[float], peer: list[float]) -> Optional[float]:
    """The largest relative gap (%) of ``losses`` to ``peer`` over the steps; None unless both
    curves are complete and of one length."""
    if not losses or len(losses) != len(peer):
        return None
    return 100 * max(abs(a - b) / abs(b) for a, b in zip(losses, peer))


def run_config(c: ModelConfig, variants: list[Variant], args, device: torch.device, dtype: torch.dtype,
               timer: H.Timer, db: Path, peak: Optional[float], rows: list[H.Row], notes: list[str]) -> None:
    """Appends the rows of one config (see the module docstring) and its notes to ``rows`` and
    ``notes``; when interrupted (Ctrl-C, SIGTERM), the rows of the variants measured so far."""
    measured: list[Measured] = []
    times: dict = {}
    config_notes: list[str] = []
    replay: list[float] = []
    try:
        ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
        torch.manual_seed(args.seed)
        with torch.device(device):
            init = build_model(c, TORCH_KIT, None)
        state = {k: t.detach().to(dtype) for k, t in init.state_dict().items()}
        del init
        corpus = BigramCorpus(c.vocab, length=max(1 << 16, 4 * (c.seq_len + 1)), seed=args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)
        batches = [corpus.batch(c.batch, c.seq_len, gen, device) for _ in range(max(args.steps, 1))]
        ref = reference(c, state, batches[0], device, ref_dtype)
        peer_err: dict = {}
        for v in sorted(variants, key=lambda v: not v.peer):  # the peer first: the others' tolerance uses its error
            t0 = time.time()
            m = train_variant(c, v, state, batches, ref, peer_err, args, device, dtype, db)
            if v.peer:
                peer_err = m.errors
            if not m.check.ok:
                m.model = None  # nothing left to time: its memory goes back before the next variant
                H.free_memory(device)
            measured.append(m)
            print(f"  {v.label(dtype)}: {m.check.status}"
                  + (f", {m.train_step_ms:.2f} ms/train step" if m.train_step_ms else "")
                  + (f", loss {m.losses[0]:.4f} -> {m.losses[-1]:.4f}" if m.losses else "")
                  + (f" ({'; '.join(m.check.reasons)})" if m.check.reasons else "") + f" [{time.time() - t0:.1f} s]",
                  flush=True)
            if v.peer:
                replay = replay_or_note(c, state, batches, m.losses, args, device, dtype, config_notes)
        try:
            times = time_variants(measured, batches[0], timer, c.hidden, dtype)
        except Exception as exc:  # e.g. out of memory with every variant's model held: keep the checks and curves
            config_notes.append(f"{c.name}: timing raised {H.error_note(exc)}")
        if args.profile > 0:
            profile_variants(c, measured, batches[0], args.profile, device, dtype, args.profile_dir)
    finally:
        step_flops = model_flops(c)[1]
        config_rows = [make_row(c, m, times.get(i, (None, None, None, None)), measured, replay, dtype, peak)
                       for i, m in enumerate(measured)]
        fill_layers_ratio(config_rows)
        rows += config_rows
        notes.append(f"{c.name}: {c.note}; {c.layers} layers, hidden {c.hidden}, heads {c.heads}/{c.kv_heads} x "
                     f"{c.head_dim}, " + (f"{c.experts} experts top-{c.topk} of width {c.expert_ffn}" if c.experts
                                          else f"FFN {c.ffn}")
                     + f", vocab {c.vocab}; batch {c.batch} x {c.seq_len} tokens; {args.steps} training steps; "
                     f"step FLOPs {step_flops / 1e12:.2f} T")
        notes += config_notes
        for m in measured:
            m.model = None
        GlobalBackendManager.reset()
        H.free_memory(device)


def make_row(c: ModelConfig, m: Measured, times: tuple, measured: list[Measured], replay: list[float],
             dtype: torch.dtype, peak: Optional[float]) -> H.Row:
    """The report row of one variant; ``times``: its (fwd_ms, step_ms, step_host_ms,
    layers_step_ms), None where not timed; ``measured``: every variant of the config (the loss gap
    is to the peer's curve); ``replay``: the peer's replay curve (empty if none ran), which sets
    the loss tolerance."""
    fwd_ms, step_ms, host_ms, layers_ms = times
    fwd_flops, step_flops = model_flops(c)
    row = H.Row(op=c.name, shape=c.shape, backend=m.variant.label(dtype), model=c.note, mb=c.batch, m=c.tokens,
                n=c.hidden, k=c.ffn or c.expert_ffn, flops=fwd_flops, step_flops=step_flops, check=m.check,
                fwd_ms=fwd_ms, step_ms=step_ms, step_host_ms=host_ms, peer=m.variant.peer)
    if fwd_ms is not None and step_ms is not None:
        row.bwd_ms = step_ms - fwd_ms
    peer = next((p for p in measured if p.variant.peer), None)
    dev = noise = None
    if peer is not None:
        dev, noise = curve_gap_pct(m.losses, peer.losses), curve_gap_pct(replay, peer.losses)
    tol = max(LOSS_TARGET_PCT, LOSS_NOISE_FACTOR * (noise or 0.0))
    timed = step_ms is not None and row.passed
    row.extra = {
        "variant": m.variant.spec,
        "tokens_per_s": round(c.tokens / (step_ms * 1e-3)) if timed else "",
        "mfu_pct": round(100 * step_flops / (step_ms * 1e-3) / (peak * 1e12), 1) if timed and peak else "",
        "peak_mem_gib": round(m.peak_mem_gib, 2) if m.peak_mem_gib is not None else "",
        "train_step_ms": round(m.train_step_ms, 3) if m.train_step_ms and row.passed else "",
        "loss_first": round(m.losses[0], 5) if m.losses else "",
        "loss_last": round(m.losses[-1], 5) if m.losses else "",
        "loss_dev_pct": round(dev, 3) if dev is not None else "",
        "loss_noise_pct": round(noise, 3) if noise is not None else "",
        "loss_tol_pct": round(tol, 3) if dev is not None else "",
        "loss_ok": ("yes" if dev <= tol else "no") if dev is not None else "",
        "setup_s": round(m.setup_s, 1) if m.setup_s is not None else "",
        "layers_step_ms": round(layers_ms, 3) if layers_ms is not None and row.passed else "",
        "layers_ratio": "",
    }
    return row


def fill_layers_ratio(rows: list[H.Row]) -> None:
    """``layers_ratio`` of each timed row of one config: the peer's ``layers_step_ms`` over its own."""
    peer = next((r for r in rows if r.peer and r.extra["layers_step_ms"] != ""), None)
    for r in rows:
        if peer is not None and r.extra["layers_step_ms"] != "":
            r.extra["layers_ratio"] = round(peer.extra["layers_step_ms"] / r.extra["layers_step_ms"], 3)


# -- reports ---------------------------------------------------------------------------------------
def headline(rows: list[H.Row]) -> list[str]:
    """A markdown table per config: the figures a reader looks for first."""
    lines = ["## Training step per config (ratio = the torch peer's step time / the variant's)", ""]
    for op in dict.fromkeys(r.op for r in rows):
        lines += [f"### {op}", "", "| variant | check | ms/step | tokens/s | ratio vs torch | MFU % | peak GiB | "
                  "ms/train step (AdamW) | loss dev % | loss tol % | loss ok | layers ms/step | layers ratio |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for r in (r for r in rows if r.op == op):
            e = r.extra
            cells = [r.backend, r.check.status if r.check else "SKIP", H._fmt(r.step_ms, 2), e["tokens_per_s"],
                     H._fmt(r.ratio, 3), e["mfu_pct"], e["peak_mem_gib"], e["train_step_ms"], e["loss_dev_pct"],
                     e["loss_tol_pct"], e["loss_ok"], e["layers_step_ms"], e["layers_ratio"]]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
        lines.append("")
    return lines


def write(rows: list[H.Row], notes: list[str], name: str, device: torch.device, out: Path) -> None:
    """The harness's reports, with the per-config tables before the score."""
    paths = H.write_reports(rows, name=name, device=device, out_dir=out, notes=notes,
                            title="Model training step: plain torch vs turbo_dispatch")
    text = paths["md"].read_text()
    at = text.index("## Score")
    paths["md"].write_text(text[:at] + "\n".join(headline(rows)) + "\n" + text[at:])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=",".join(CONFIGS),
                        help=f"comma-separated configs (default all: {', '.join(CONFIGS)})")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants (default per config; see the module docstring)")
    parser.add_argument("--layers", type=int, default=None, help="blocks per model (default per config)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps of the loss curve (default 50; 10 with --quick, 2 on the CPU)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of this GPU for MFU (default: from the device name)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timing, profile N forward+backward steps of every variant (cProfile and "
                             "torch.profiler kernel tables, <out>/profiles/<config>_<variant>.txt)")
    H.add_common_args(parser)
    args = parser.parse_args(argv)
    device = H.pick_device(args.device)
    H.set_tune_budget(args.tune_budget_ms, args.quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    unknown = [n for n in args.config.split(",") if n not in CONFIGS]
    if unknown:
        parser.error(f"--config: unknown {', '.join(unknown)}; valid: {', '.join(CONFIGS)}")
    try:
        chosen = None if args.variants is None else [parse_variant(s) for s in args.variants.split(",") if s]
    except ValueError as exc:
        parser.error(str(exc))
    if args.steps is None:
        args.steps = 2 if device.type == "cpu" else (10 if args.quick else 50)
    configs = []
    for n in args.config.split(","):
        c = CONFIGS[n] if device.type == "cuda" else cpu_config(CONFIGS[n])
        c = replace(c, layers=args.layers or (1 if args.quick and device.type == "cuda" else c.layers),
                    batch=args.batch or c.batch, seq_len=args.seq_len or c.seq_len)
        configs.append(c)
    out = Path(args.out_dir) if args.out_dir else H.resolve_out_dir() / "model"
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or "model" + ("_quick" if args.quick else "")
    args.profile_dir = out / "profiles"
    db = out / f"{name}_tuning.jsonl"
    db.unlink(missing_ok=True)  # a fresh DB: the autotuned variants tune every key in this run
    if args.quick:
        timer = H.make_timer(device, True, args.target_ms)
    else:
        timer = H.Timer(device, warmup=1, min_repeats=4, max_repeats=10, target_ms=args.target_ms or 1000.0)
    peak = peak_tflops(device, args.peak_tflops)
    torch.set_float32_matmul_precision("highest")  # the float32 reference must not run in TF32

    t0 = time.time()
    rows: list[H.Row] = []
    notes: list[str] = []
    with H.interruptible() as stopped:
        for c in configs:
            variants = chosen or [parse_variant(s) for s in c.variants]
            print(f"[{c.name}] {c.shape}: {', '.join(v.label(dtype) for v in variants)}", flush=True)
            run_config(c, variants, args, device, dtype, timer, db, peak, rows, notes)
    if stopped:
        notes.append(f"INTERRUPTED ({stopped[0]}): partial results")
    GlobalBackendManager.reset()
    tuned = sum('"type": "result"' in line for line in db.read_text().splitlines()) if db.exists() else 0
    notes += [
        f"check: loss and every parameter's gradient ({'float64' if device.type == 'cpu' else 'float32'} torch "
        f"reference, same weights; snr_db/rel_err: the worst tensor): peer rel err <= {PEER_MAX_REL_ERR}; turbo "
        f"{str(dtype).removeprefix('torch.')} rel err <= "
        f"max({H.REL_TOL.get(dtype, 5e-3)}, 2x the peer's); fp8 SNR >= {FP8_MIN_SNR_DB} dB. A FAIL voids the timing",
        "step_ms: forward+backward (gradients set to None first), no optimizer, variants timed in turns; "
        "train_step_ms: the same with AdamW, sequential; loss_dev_pct: largest relative gap of the loss "
        "curve to the torch peer's; loss_noise_pct: the same gap of the peer's replay (split-K sums, same "
        f"weights and batches); loss_ok: loss_dev_pct <= loss_tol_pct = max({LOSS_TARGET_PCT}, "
        f"{LOSS_NOISE_FACTOR:g} x loss_noise_pct)",
        f"MFU against {peak} TFLOPS dense bf16 for every variant" if peak else "MFU: no peak known for this device "
        "(--peak-tflops)",
        fused_producers_note(device),
        f"autotuned variants: fresh tuning DB {db} ({tuned} results), shipped DBs off; autotune budget per key "
        f"PRIMUS_TURBO_TUNE_BUDGET_MS={os.environ.get('PRIMUS_TURBO_TUNE_BUDGET_MS')}; other variants: shipped "
        "DBs, no user DB",
        f"elapsed {time.time() - t0:.0f} s",
    ]
    write(rows, notes, name, device, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
