"""Train a small MoE decoder with expert parallelism under torchrun (gloo on the CPU, NCCL on GPUs).

Every block is train_llama.py's Llama block with its MLP replaced by a mixture of experts:

1. a router (``turbo_dispatch.modules.Linear`` to ``num_experts`` logits, softmax in fp32, top-k,
   the k probabilities renormalised to sum to 1);
2. ``turbo_dispatch.ops.moe_dispatch`` sends each token once to every rank that holds one of its
   experts (rank r holds global experts ``[r * L, (r + 1) * L)``, ``L = num_experts / world``);
3. the received (row, expert) pairs are sorted by local expert and run through two
   ``turbo_dispatch.modules.GroupedLinear`` layers, a SwiGLU up_gate and a down projection,
   scaled by their router probabilities and summed per received row;
4. ``turbo_dispatch.ops.moe_combine`` sends the rows back and sums them per source token.

Each rank trains on its own batches (data parallel for attention, norms, router and embeddings,
whose gradients are averaged over the ranks) and owns its experts (their gradients arrive through
the combine/dispatch backward, already summed over every rank's tokens, and are divided by the
world size so both kinds follow the mean loss over ranks). Rank 0 prints the mean loss.

Backends: every call goes to the backend the resolver picks, so this script uses whatever tuning
DB is in force: the DBs shipped with the package for this GPU, the user DB
(``PRIMUS_TURBO_TUNE_DB``) and any read-only DBs (``PRIMUS_TURBO_TUNE_DB_PATH``). To tune for
this machine first, run e.g. ``turbo-dispatch tune --model deepseek-v3 --ops grouped_gemm --step``
(add ``--distributed`` under torchrun). Without a stored winner each op takes its platform default.

Usage::

    torchrun --nproc_per_node 2 examples/train_moe.py --tiny             # CPU, gloo
    torchrun --nproc_per_node 8 examples/train_moe.py --steps 100        # 8 GPUs, NCCL
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import BigramCorpus, Decoder, add_common_args, fill_preset, fp8_config, train  # noqa: E402

import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402

PRESETS = {
    "tiny": dict(device="cpu", layers=2, hidden=64, heads=4, kv_heads=2, seq_len=32, batch=4, vocab=128,
                 steps=20, lr=1e-2, log_every=1, experts=8, topk=2, expert_ffn=64),
    "default": dict(device=None, layers=4, hidden=1024, heads=16, kv_heads=4, seq_len=1024, batch=4, vocab=8192,
                    steps=100, lr=1e-3, log_every=10, experts=64, topk=8, expert_ffn=512),
}


class MoE(torch.nn.Module):
    """Top-k routed SwiGLU experts, ``num_experts // world`` of them on this rank.

    ``forward(x [B, S, hidden])`` returns ``[B, S, hidden]``: each token's sum over its k experts
    of ``prob * expert(x)``. It is a collective: every rank of ``group`` must call it (forward and
    backward) the same number of times.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, group: Optional[dist.ProcessGroup],
                 fp8: Optional[Float8QuantConfig]) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"--experts {num_experts} must be divisible by the number of ranks {world}")
        self.num_experts, self.topk, self.group = num_experts, topk, group
        self.local_experts = num_experts // world
        self.router = turbo.modules.Linear(hidden, num_experts, bias=False)
        self.up_gate = turbo.modules.GroupedLinear(self.local_experts, hidden, 2 * ffn, fp8_config=fp8)
        self.down = turbo.modules.GroupedLinear(self.local_experts, ffn, hidden, fp8_config=fp8)

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters only this rank holds (not replicated over the ranks)."""
        return [self.up_gate.weight, self.down.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        top_probs, top_idx = probs.topk(self.topk, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = turbo.ops.moe_dispatch(
            tokens, top_idx, top_probs, self.num_experts, self.group)
        # One entry per (received row, local expert) pair, grouped by local expert: the row order
        # GroupedLinear needs, with group sizes equal to moe_dispatch's tokens_per_expert.
        rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)
        order = recv_idx[rows, slots].argsort(stable=True)
        rows, slots = rows[order], slots[order]
        group_lens = torch.tensor(tokens_per_expert, dtype=torch.int64, device=x.device)
        gate, up = self.up_gate(recv_x[rows], group_lens).chunk(2, dim=-1)
        out = self.down(turbo.ops.swiglu(gate, up), group_lens)
        weighted = out * recv_probs[rows, slots].unsqueeze(-1).to(out.dtype)
        per_row = torch.zeros_like(recv_x).index_add(0, rows, weighted)
        return turbo.ops.moe_combine(per_row, self.group, handle).view_as(x)


def init_distributed(device: str) -> tuple[int, int]:
    """Joins the torchrun job (NCCL with one GPU per rank, or gloo on the CPU); returns (rank, world)."""
    if "RANK" not in os.environ:
        raise SystemExit("train_moe.py runs under torchrun, e.g. torchrun --nproc_per_node 2 "
                         "examples/train_moe.py --tiny")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--experts", type=int, help="experts in each MoE layer, over all ranks")
    parser.add_argument("--topk", type=int, help="experts per token")
    parser.add_argument("--expert-ffn", type=int, help="each expert's SwiGLU width")
    args = fill_preset(parser.parse_args(argv), PRESETS)
    if args.device == "cuda":
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    rank, world = init_distributed(args.device)
    try:
        # The same seed everywhere makes the replicated parameters equal on every rank; the experts
        # are then drawn again per rank, so that no two ranks hold the same experts.
        torch.manual_seed(args.seed)
        fp8 = fp8_config(args.fp8)
        moes = [MoE(args.hidden, args.expert_ffn, args.experts, args.topk, None, fp8) for _ in range(args.layers)]
        model = Decoder(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads, lambda i: moes[i], fp8)
        torch.manual_seed(args.seed + 1 + rank)
        for moe in moes:
            moe.up_gate.reset_parameters()
            moe.down.reset_parameters()
        model.to(args.device, args.dtype)
        expert_params = {id(p) for moe in moes for p in moe.expert_parameters()}
        replicated = [p for p in model.parameters() if id(p) not in expert_params]
        experts = [p for p in model.parameters() if id(p) in expert_params]

        def sync_grads() -> None:
            """Averages the replicated gradients over the ranks, scales the experts' to the mean
            loss, and clips by the norm of the whole model's gradient (the same on every rank,
            so the replicated parameters stay equal)."""
            grads = [p.grad for p in replicated + experts if p.grad is not None]
            for p in replicated:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            torch._foreach_div_(grads, world)
            replicated_sq = torch.nn.utils.get_total_norm([p.grad for p in replicated if p.grad is not None]) ** 2
            expert_sq = torch.nn.utils.get_total_norm([p.grad for p in experts if p.grad is not None]) ** 2
            dist.all_reduce(expert_sq)
            torch.nn.utils.clip_grads_with_norm_(grads, 1.0, (replicated_sq + expert_sq).sqrt())

        def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
            loss = loss.clone()
            dist.all_reduce(loss)
            return loss / world

        if rank == 0:
            print(f"moe: {world} ranks, {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
                  f"({args.experts // world} per rank), top-{args.topk}, expert ffn {args.expert_ffn}; "
                  f"{torch.device(args.device).type} {str(args.dtype).removeprefix('torch.')}, fp8 {args.fp8}; "
                  f"batch {args.batch} x {args.seq_len} tokens per rank", flush=True)
        corpus = BigramCorpus(args.vocab, seed=args.seed)
        train(model, corpus, args, torch.Generator().manual_seed(args.seed + 1000 + rank), sync_grads,
              mean_over_ranks, show=rank == 0)
    finally:
        # A rank that exits with gloo's threads still running can abort and fail the whole job.
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
