"""Model presets: the GEMM, grouped-GEMM and attention shapes of real LLMs.

Dimensions are taken from each model's published configuration (the ``config.json`` of its
official Hugging Face release: hidden_size, intermediate_size / moe_intermediate_size,
num_attention_heads, num_key_value_heads, head_dim, n_routed_experts / num_local_experts,
num_experts_per_tok, and the MLA ranks of the DeepSeek-style models). ``seq_len`` is the
sequence length our benchmarks and ``turbo-dispatch tune --model`` use per micro-batch, not the
model's maximum context.

Conventions: a linear layer is ``y[m, n] = x[m, k] @ W[n, k]^T`` (nn.Linear), so ``n`` is the
output features, ``k`` the input features, and ``m`` the tokens of a micro-batch. Fused
projections are listed the way training frameworks run them: q/k/v as one GEMM, gate and up as
one GEMM.

Example:
    >>> from turbo_dispatch.presets import get_model, dense_linear_shapes
    >>> [s.name for s in dense_linear_shapes(get_model("llama3.1-8b"))]
    ['qkv', 'o_proj', 'gate_up', 'down']
    >>> dense_linear_shapes(get_model("llama3.1-8b"))[0]
    LinearShape(name='qkv', m=4096, n=6144, k=4096)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "GroupedShape",
    "LinearShape",
    "MODELS",
    "ModelPreset",
    "attention_shapes",
    "dense_linear_shapes",
    "get_model",
    "moe_grouped_shapes",
]


@dataclass(frozen=True)
class ModelPreset:
    """One model's layer dimensions (see the module docstring for where they come from).

    ``intermediate`` is the width of the *dense* FFN layers: a dense model's MLP, or an MoE
    model's leading dense layers; 0 when every FFN layer is MoE. ``moe_intermediate`` is one
    routed expert's FFN width; ``shared_experts`` counts always-active experts of that width.
    ``attention`` is ``"gqa"`` (standard multi-head / grouped-query attention), ``"gqa_sinks"``
    (GQA plus learned per-head sink logits, which the plain attention op does not model) or
    ``"mla"`` (DeepSeek's multi-head latent attention; ``head_dim`` is then the q/k head size,
    nope + rope, and ``v_head_dim`` the value head size).
    """

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    topk: int = 0
    moe_intermediate: int = 0
    seq_len: int = 4096
    note: str = ""
    # Optional details beyond the core fields (all default to "not applicable").
    shared_experts: int = 0
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


class LinearShape(NamedTuple):
    """A forward linear GEMM: ``y[m, n] = x[m, k] @ W[n, k]^T``."""

    name: str
    m: int
    n: int
    k: int


class GroupedShape(NamedTuple):
    """A grouped (per-expert) GEMM: ``groups`` weights [n, k], ``m_total`` routed tokens in all."""

    name: str
    groups: int
    m_total: int
    n: int
    k: int


_MLA_V3 = dict(attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128)

MODELS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama2-7b", 4096, 11008, 32, 32, 128, note="Llama-2-7B: multi-head attention (no GQA)"),
    ModelPreset("llama2-70b", 8192, 28672, 64, 8, 128, note="Llama-2-70B"),
    ModelPreset("llama3.1-8b", 4096, 14336, 32, 8, 128, note="Llama-3.1-8B"),
    ModelPreset("llama3.1-70b", 8192, 28672, 64, 8, 128, note="Llama-3.1-70B"),
    ModelPreset("llama3.1-405b", 16384, 53248, 128, 8, 128, note="Llama-3.1-405B"),
    ModelPreset("qwen2.5-7b", 3584, 18944, 28, 4, 128, note="Qwen2.5-7B"),
    ModelPreset("qwen2.5-72b", 8192, 29568, 64, 8, 128, note="Qwen2.5-72B"),
    ModelPreset("mistral-7b", 4096, 14336, 32, 8, 128, note="Mistral-7B-v0.1"),
    ModelPreset("deepseek-v3", 7168, 18432, 128, 128, 192, experts=256, topk=8, moe_intermediate=2048,
                shared_experts=1, note="DeepSeek-V3 (671B): MLA; first 3 layers dense (ffn 18432)", **_MLA_V3),
    ModelPreset("deepseek-v2", 5120, 12288, 128, 128, 192, experts=160, topk=6, moe_intermediate=1536,
                shared_experts=2, note="DeepSeek-V2 (236B): MLA; first layer dense (ffn 12288)", **_MLA_V3),
    ModelPreset("qwen3-30b-a3b", 2048, 0, 32, 4, 128, experts=128, topk=8, moe_intermediate=768,
                note="Qwen3-30B-A3B: every FFN layer is MoE; q/o width 32*128=4096 != hidden"),
    ModelPreset("mixtral-8x7b", 4096, 0, 32, 8, 128, experts=8, topk=2, moe_intermediate=14336,
                note="Mixtral-8x7B: every FFN layer is MoE (expert ffn 14336)"),
    ModelPreset("kimi-k2", 7168, 18432, 64, 64, 192, experts=384, topk=8, moe_intermediate=2048,
                shared_experts=1, note="Kimi-K2 (1T): DeepSeek-V3 architecture, 64 heads; first layer dense",
                **_MLA_V3),
    ModelPreset("gpt-oss-20b", 2880, 0, 64, 8, 64, experts=32, topk=4, moe_intermediate=2880,
                attention="gqa_sinks", note="gpt-oss-20b: every FFN layer is MoE; attention with learned sinks"),
    ModelPreset("tiny", 64, 128, 4, 2, 16, experts=4, topk=2, moe_intermediate=32, seq_len=32,
                note="not a real model: CPU smoke runs (dense FFN and MoE both present)"),
)}


def get_model(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive); ValueError listing the valid names."""
    if isinstance(name, ModelPreset):
        return name
    key = str(name).strip().lower()
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(MODELS)}") from None


def _tokens(model: ModelPreset, micro_batch: int, seq_len: int | None) -> int:
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int; got {micro_batch!r}")
    seq = model.seq_len if seq_len is None else seq_len
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq_len must be a positive int or None; got {seq_len!r}")
    return micro_batch * seq


def _attention_linears(model: ModelPreset, m: int) -> list[LinearShape]:
    h = model.hidden
    if model.attention == "mla":
        nope = model.head_dim - model.qk_rope_head_dim
        shapes = []
        if model.q_lora_rank:
            # q down-projection fused with the kv down-projection and the shared rope key.
            shapes.append(LinearShape("q_kv_a", m, model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim, h))
            shapes.append(LinearShape("q_b", m, model.heads * model.head_dim, model.q_lora_rank))
        else:
            shapes.append(LinearShape("q", m, model.heads * model.head_dim, h))
            shapes.append(LinearShape("kv_a", m, model.kv_lora_rank + model.qk_rope_head_dim, h))
        shapes.append(LinearShape("kv_b", m, model.heads * (nope + model.v_head_dim), model.kv_lora_rank))
        shapes.append(LinearShape("o_proj", m, h, model.heads * model.v_head_dim))
        return shapes
    q_width = model.heads * model.head_dim
    return [
        LinearShape("qkv", m, (model.heads + 2 * model.kv_heads) * model.head_dim, h),
        LinearShape("o_proj", m, h, q_width),
    ]


def dense_linear_shapes(model: ModelPreset | str, micro_batch: int = 1, seq_len: int | None = None) -> list[LinearShape]:
    """The forward linear GEMMs of one transformer layer at ``micro_batch * seq_len`` tokens.

    Dense models: ``qkv``, ``o_proj``, ``gate_up`` (n = 2 * intermediate), ``down``. MoE models:
    their attention projections (MLA projections for DeepSeek-style models), the dense FFN of
    their leading dense layers (``gate_up``/``down``, when ``intermediate`` > 0) and the shared
    experts fused into one FFN (``shared_gate_up``/``shared_down``). The router (n = experts) is
    left out: it is tiny and usually runs in fp32. Routed experts are ``moe_grouped_shapes``.

    Example:
        >>> [s.name for s in dense_linear_shapes("deepseek-v3")]
        ['q_kv_a', 'q_b', 'kv_b', 'o_proj', 'gate_up', 'down', 'shared_gate_up', 'shared_down']
    """
    model = get_model(model)
    m = _tokens(model, micro_batch, seq_len)
    shapes = _attention_linears(model, m)
    if model.intermediate:
        shapes += [LinearShape("gate_up", m, 2 * model.intermediate, model.hidden),
                   LinearShape("down", m, model.hidden, model.intermediate)]
    if model.shared_experts:
        width = model.shared_experts * model.moe_intermediate
        shapes += [LinearShape("shared_gate_up", m, 2 * width, model.hidden),
                   LinearShape("shared_down", m, model.hidden, width)]
    return shapes


def moe_grouped_shapes(model: ModelPreset | str, ep: int = 1, tokens_per_expert: int = 4096) -> list[GroupedShape]:
    """The routed-expert grouped GEMMs on one rank under expert parallelism ``ep``.

    A rank holds ``experts // ep`` experts (at least 1) and, for the benchmark, ``tokens_per_expert``
    tokens each on average, so ``m_total = local_experts * tokens_per_expert``. ``up_gate`` has
    n = 2 * moe_intermediate, k = hidden; ``down`` has n = hidden, k = moe_intermediate.

    Example:
        >>> moe_grouped_shapes("deepseek-v3", ep=8, tokens_per_expert=1024)[0]
        GroupedShape(name='up_gate', groups=32, m_total=32768, n=4096, k=7168)
    """
    model = get_model(model)
    if not model.is_moe:
        raise ValueError(f"moe_grouped_shapes: {model.name} is a dense model (no experts)")
    for arg, value in (("ep", ep), ("tokens_per_expert", tokens_per_expert)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"moe_grouped_shapes: {arg} must be a positive int; got {value!r}")
    local = max(1, model.experts // ep)
    m_total = local * tokens_per_expert
    return [
        GroupedShape("up_gate", local, m_total, 2 * model.moe_intermediate, model.hidden),
        GroupedShape("down", local, m_total, model.hidden, model.moe_intermediate),
    ]


def attention_shapes(model: ModelPreset | str, micro_batch: int = 1, seq_len: int | None = None) -> list[tuple]:
    """``[(batch, seqlen, heads, kv_heads, head_dim)]`` for models with standard GQA/MHA attention;
    empty for MLA models and for attention with sinks (neither is what the attention op computes).

    Example:
        >>> attention_shapes("llama3.1-70b", micro_batch=2)
        [(2, 4096, 64, 8, 128)]
    """
    model = get_model(model)
    seq = _tokens(model, micro_batch, seq_len) // micro_batch
    if model.attention != "gqa":
        return []
    return [(micro_batch, seq, model.heads, model.kv_heads, model.head_dim)]
