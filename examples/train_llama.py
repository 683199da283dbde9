"""Train a small Llama-style decoder with turbo_dispatch's modules, in bf16 or fp8.

The model is the Llama recipe at a small size: RMSNorm, attention with grouped-query heads
(``turbo_dispatch.ops.flash_attn_func``, causal) and rotary position embeddings, a SwiGLU MLP.
The attention's norm and q/k/v projection are one ``turbo_dispatch.modules.RMSNormLinear``, the
MLP a ``turbo_dispatch.modules.SwiGLUMLP``, the other projections ``turbo_dispatch.modules.Linear``.
``--fp8 tensorwise|rowwise|blockwise`` runs the block projections' GEMMs in fp8 (HYBRID format:
E4M3 forward, E5M2 gradients; blockwise uses 1x128 activation and 128x128 weight blocks); on a
GPU the norm and the SwiGLU then write their GEMM's fp8 input themselves. The output head stays
in the model's dtype, as is usual, because the logits feed the loss directly. Parameters are bf16
on a GPU and fp32 on the CPU.

The data is synthetic: a fixed token stream drawn from a random sparse bigram chain (each token
has a few likely successors), so the loss falls quickly from ln(vocab) and a run shows at a glance
whether training works. Each op call goes to the backend the resolver picks (the tuning DB in
force, or the platform default); ``turbo-dispatch tune --model llama3.1-8b`` tunes real shapes.

Usage::

    python examples/train_llama.py --tiny                        # CPU, a few seconds
    python examples/train_llama.py --steps 200 --fp8 rowwise     # one GPU

Prints the loss every ``--log-every`` steps and, last, ``final loss X (first Y)``. Helpers here
(the corpus, the decoder with a pluggable MLP, the training loop) are reused by train_moe.py, and
the decoder with its ``LayerKit`` by benchmarks/bench_model.py.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig

FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
#: Model sizes: ``--tiny`` (CPU, seconds) and the default (one GPU). Command-line values win.
PRESETS = {
    "tiny": dict(device="cpu", layers=2, hidden=64, heads=4, kv_heads=2, seq_len=32, batch=4, vocab=128,
                 steps=20, lr=1e-2, log_every=5),
    "default": dict(device=None, layers=4, hidden=1024, heads=16, kv_heads=4, seq_len=1024, batch=8, vocab=8192,
                    steps=100, lr=1e-3, log_every=10),
}


def fp8_config(recipe: str) -> Optional[Float8QuantConfig]:
    """The Float8QuantConfig for a ``--fp8`` choice (None for ``none``): HYBRID format, and
    128-element blocks for blockwise (DeepSeek-style 1x128 activations, 128x128 weights)."""
    if recipe == "none":
        return None
    return Float8QuantConfig(format="hybrid", granularity=recipe, block_size=128 if recipe == "blockwise" else None)


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# -- data ------------------------------------------------------------------------------------------------
class BigramCorpus:
    """A fixed stream of ``length`` tokens from a random bigram chain with ``branching`` successors
    per token, drawn from ``seed``: the same corpus on every run and every rank."""

    def __init__(self, vocab: int, length: int = 1 << 16, branching: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, branching), generator=g).tolist()
        choices = torch.randint(branching, (length,), generator=g).tolist()
        tokens = [0] * length
        for i in range(1, length):
            tokens[i] = successors[tokens[i - 1]][choices[i]]
        self.tokens = torch.tensor(tokens, dtype=torch.long)

    def batch(self, batch: int, seq_len: int, generator: torch.Generator, device: torch.device):
        """``(inputs, targets)``, both int64 ``[batch, seq_len]``: random windows of the stream
        and the same windows shifted by one token."""
        if seq_len + 1 > self.tokens.numel():
            raise ValueError(f"seq_len {seq_len} needs a corpus longer than {self.tokens.numel()} tokens")
        starts = torch.randint(self.tokens.numel() - seq_len, (batch,), generator=generator)
        windows = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()]).to(device)
        return windows[:, :-1], windows[:, 1:]


# -- model -----------------------------------------------------------------------------------------------
#: Llama's RMSNorm epsilon.
NORM_EPS = 1e-5


@dataclass(frozen=True)
class LayerKit:
    """What a decoder's layers are made of. ``linear(in, out, fp8)``: a bias-free projection;
    ``norm_linear(hidden, out, eps, fp8)``: ``linear(RMSNorm(x))`` as a module with children
    ``norm`` and ``linear``; ``mlp(hidden, ffn, fp8)``: the SwiGLU MLP with children
    ``gate_proj``, ``up_proj``, ``down_proj``; ``attend(q, k, v)``: causal attention of
    ``[B, S, H, D]`` tensors, k and v with fewer heads than q (grouped-query);
    ``split_rotary(qkv, heads, kv_heads, cos, sin)``: the q/k/v projection's output
    ``[B, S, (heads + 2 kv_heads) D]`` split into contiguous ``[B, S, H, D]`` q, k, v with q and
    k rotated by position (rotate-half, float32 arithmetic); ``swiglu(gate, up)``:
    ``silu(gate) * up`` (the MoE experts' activation).

    Every kit names its parameters alike, so one state_dict loads into a decoder of each kit
    (benchmarks/bench_model.py builds the same model from plain torch and from this library)."""

    linear: Callable[[int, int, Optional[Float8QuantConfig]], torch.nn.Module]
    norm_linear: Callable[[int, int, float, Optional[Float8QuantConfig]], torch.nn.Module]
    mlp: Callable[[int, int, Optional[Float8QuantConfig]], torch.nn.Module]
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    split_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: The library's modules: ``RMSNormLinear`` and ``SwiGLUMLP`` write their GEMM's fp8 input from
#: the norm / SwiGLU kernel itself where the fused producers run (a GPU with an fp8 recipe), and
#: are the unfused pair elsewhere.
TURBO_KIT = LayerKit(
    linear=lambda i, o, fp8: turbo.modules.Linear(i, o, bias=False, fp8_config=fp8),
    norm_linear=lambda h, o, eps, fp8: turbo.modules.RMSNormLinear(h, o, eps=eps, fp8_config=fp8),
    mlp=lambda h, f, fp8: turbo.modules.SwiGLUMLP(h, f, fp8_config=fp8),
    attend=lambda q, k, v: turbo.ops.flash_attn_func(q, k, v, causal=True),
    split_rotary=turbo.ops.split_qkv_rotary_emb,
    swiglu=turbo.ops.swiglu,
)


def rotary_tables(seq_len: int, head_dim: int, device: torch.device, base: float = 10000.0):
    """fp32 ``(cos, sin)`` tables ``[seq_len, head_dim // 2]``; made per call, not stored as
    buffers, so that casting the model to bf16 never rounds them."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [B, S, H, D]`` by position (the rotate-half convention), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def torch_split_rotary(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``LayerKit.split_rotary`` in plain torch ops: split, rotate q and k, copy v."""
    b, s, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.view(b, s, heads, head_dim), cos, sin)
    k = apply_rotary(k.view(b, s, kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(b, s, kv_heads, head_dim).contiguous()


class Attention(torch.nn.Module):
    """The pre-norm attention branch ``out(attend(rope(qkv(norm(x)))))``: causal, ``kv_heads``
    key/value heads shared by ``heads`` query heads of ``head_dim`` (default hidden / heads;
    smaller under tensor parallelism), the norm and the q/k/v projection one ``kit.norm_linear``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, fp8: Optional[Float8QuantConfig],
                 kit: LayerKit = TURBO_KIT, head_dim: Optional[int] = None) -> None:
        super().__init__()
        if heads % kv_heads or (head_dim is None and hidden % heads):
            raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        self.qkv = kit.norm_linear(hidden, (heads + 2 * kv_heads) * self.head_dim, NORM_EPS, fp8)
        self.out = kit.linear(heads * self.head_dim, hidden, fp8)
        self.attend, self.split_rotary = kit.attend, kit.split_rotary

    def forward(self, x: torch.Tensor, rotary) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.split_rotary(self.qkv(x), self.heads, self.kv_heads, *rotary)
        o = self.attend(q, k, v)
        return self.out(o.reshape(b, s, -1))


class Block(torch.nn.Module):
    """Pre-norm transformer block: ``x + attn(x)`` (the norm inside), then ``x + mlp(norm(x))``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: torch.nn.Module,
                 fp8: Optional[Float8QuantConfig], kit: LayerKit = TURBO_KIT, head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.attn = Attention(hidden, heads, kv_heads, fp8, kit, head_dim)
        self.mlp_norm = torch.nn.RMSNorm(hidden, eps=NORM_EPS)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary) -> torch.Tensor:
        x = x + self.attn(x, rotary)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(torch.nn.Module):
    """Token embedding, ``layers`` blocks whose MLP ``make_mlp(layer_index)`` builds, final norm,
    and an output head (``kit.linear``, never fp8: the logits feed the loss directly);
    ``forward(tokens [B, S])`` returns logits ``[B, S, vocab]``."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 make_mlp: Callable[[int], torch.nn.Module], fp8: Optional[Float8QuantConfig],
                 kit: LayerKit = TURBO_KIT, head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, kv_heads, make_mlp(i), fp8, kit, head_dim)
                                          for i in range(layers))
        self.norm = torch.nn.RMSNorm(hidden, eps=NORM_EPS)
        self.head = kit.linear(hidden, vocab, None)
        self.head_dim = head_dim or hidden // heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks_forward(self.embed(tokens))))

    def blocks_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks alone on hidden states ``x [B, S, hidden]`` (what the embedding hands them)."""
        rotary = rotary_tables(x.shape[1], self.head_dim, x.device)
        for block in self.blocks:
            x = block(x, rotary)
        return x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, S, vocab]`` against ``targets [B, S]``, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# -- command line and training loop ------------------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by the examples; size options default to None and are filled from a preset."""
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU that trains in seconds")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available; cpu with --tiny)")
    parser.add_argument("--fp8", choices=FP8_RECIPES, default="none", help="fp8 recipe of the GEMMs (default none)")
    for name in ("steps", "layers", "hidden", "heads", "kv-heads", "seq-len", "batch", "vocab", "log-every"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--lr", type=float, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def fill_preset(args: argparse.Namespace, presets: dict) -> argparse.Namespace:
    """Fills every option left at None from the tiny or default preset; picks the device and dtype."""
    for key, value in presets["tiny" if args.tiny else "default"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.float32 if torch.device(args.device).type == "cpu" else torch.bfloat16
    return args


def train(model: torch.nn.Module, corpus: BigramCorpus, args: argparse.Namespace, generator: torch.Generator,
          sync_grads: Optional[Callable[[], None]] = None,
          global_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
          show: bool = True) -> tuple[float, float]:
    """Runs ``args.steps`` AdamW steps of next-token cross-entropy; returns ``(first, final)`` loss.

    ``sync_grads`` runs between backward and the optimizer step (data/expert-parallel gradient
    reduction and clipping); without it the gradient norm is clipped to 1. ``global_loss`` maps
    this process's loss to the one reported (e.g. the mean over ranks; it must be called on every
    rank); ``show`` prints (rank 0 only under torchrun).
    """
    device = torch.device(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=args.no_progress or not show)
    first = last = math.nan
    for step in bar:
        inputs, targets = corpus.batch(args.batch, args.seq_len, generator, device)
        loss = next_token_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sync_grads is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            sync_grads()
        optimizer.step()
        last = float(global_loss(loss.detach()))
        first = last if step == 1 else first
        bar.set_postfix(loss=f"{last:.4f}")
        if show and (step % args.log_every == 0 or step == args.steps):
            tqdm.write(f"step {step}/{args.steps} loss {last:.4f}")
    if show:
        print(f"final loss {last:.4f} (first {first:.4f})", flush=True)
    return first, last


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    args = fill_preset(parser.parse_args(argv), PRESETS)
    torch.manual_seed(args.seed)
    fp8 = fp8_config(args.fp8)
    ffn = round_up(8 * args.hidden // 3, 128)
    model = Decoder(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads,
                    lambda _: TURBO_KIT.mlp(args.hidden, ffn, fp8), fp8).to(args.device, args.dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"llama: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, ffn {ffn}, "
          f"{params / 1e6:.2f}M params; {args.device} {str(args.dtype).removeprefix('torch.')}, fp8 {args.fp8}; "
          f"batch {args.batch} x {args.seq_len} tokens", flush=True)
    corpus = BigramCorpus(args.vocab, seed=args.seed)
    train(model, corpus, args, torch.Generator().manual_seed(args.seed + 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
