"""Style names used in tensor-parallel plans -> PyTorch ``ParallelStyle`` objects.

A plan maps module names to these names; what each becomes depends on whether sequence parallelism and
loss parallelism are on (e.g. ``rowwise`` returns a replicated plain tensor without SP, a sequence-sharded
DTensor with it), so one plan serves every combination.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ...errors import StrategyError
from ...utils import did_you_mean
from .conv1d import Conv1DColwiseParallel, Conv1DRowwiseParallel, is_conv1d
from .experts import StackedExpertsParallel, expert_intermediate_size, is_stacked_experts
from .fused import FusedColwiseParallel
from .sequence import SequenceGather


@dataclass(frozen=True)
class Flags:
    """sequence_parallel: the residual stream between blocks is sharded on the sequence dim (Shard(1)).
    loss_parallel: the output head leaves its logits vocab-sharded (a ``Shard(-1)`` DTensor)."""

    sequence_parallel: bool = False
    loss_parallel: bool = False


@dataclass(frozen=True)
class StyleSpec:
    """One style name: what it does, which modules it takes, the dimension it splits, and its builder."""

    doc: str
    accepts: Callable[[nn.Module], bool]
    kinds: str  # the accepted module kinds, for error messages
    split: Callable[[nn.Module], list[tuple[str, int]]]  # (dimension label, size) pairs that tp must divide
    build: Callable[[nn.Module, Flags], ParallelStyle | None]  # None: nothing to do with these flags


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def _out_features(m: nn.Module) -> int:
    return m.nf if is_conv1d(m) else m.out_features


def _in_features(m: nn.Module) -> int:
    return m.nx if is_conv1d(m) else m.in_features


def _colwise(m: nn.Module, **kw) -> ParallelStyle:
    return Conv1DColwiseParallel(**kw) if is_conv1d(m) else ColwiseParallel(**kw)


def _rowwise(m: nn.Module, **kw) -> ParallelStyle:
    return Conv1DRowwiseParallel(**kw) if is_conv1d(m) else RowwiseParallel(**kw)


def _stream_layout(f: Flags):
    """Layout of the residual stream between blocks (where embeddings and row-wise layers write)."""
    return Shard(1) if f.sequence_parallel else Replicate()


def _any(m: nn.Module) -> bool:
    return True


STYLES: dict[str, StyleSpec] = {
    "colwise": StyleSpec(
        "column-wise Linear/Conv1D (output features split, e.g. q/k/v, gate/up); output stays sharded for a "
        "following 'rowwise' layer",
        _is_linear, "nn.Linear or Conv1D",
        lambda m: [("output features", _out_features(m))],
        lambda m, f: _colwise(m),
    ),
    "rowwise": StyleSpec(
        "row-wise Linear/Conv1D (input features split, e.g. o_proj, down_proj); partial outputs are summed "
        "(all-reduce), or reduce-scattered over the sequence under sequence parallelism",
        _is_linear, "nn.Linear or Conv1D",
        lambda m: [("input features", _in_features(m))],
        lambda m, f: _rowwise(m, output_layouts=_stream_layout(f), use_local_output=not f.sequence_parallel),
    ),
    "colwise_gather": StyleSpec(
        "column-wise Linear/Conv1D whose output is gathered (replicated): a lone split layer such as a classifier",
        _is_linear, "nn.Linear or Conv1D",
        lambda m: [("output features", _out_features(m))],
        lambda m, f: _colwise(m, input_layouts=_stream_layout(f), output_layouts=Replicate()),
    ),
    "lm_head": StyleSpec(
        "vocabulary-parallel output head (column-wise): logits gathered, or left vocab-sharded (a Shard(-1) "
        "DTensor) for loss_parallel",
        _is_linear, "nn.Linear or Conv1D",
        lambda m: [("vocabulary size (output features)", _out_features(m))],
        lambda m, f: _colwise(m, input_layouts=_stream_layout(f),
                              output_layouts=Shard(-1) if f.loss_parallel else Replicate(),
                              use_local_output=not f.loss_parallel),
    ),
    "vocab_embedding": StyleSpec(
        "vocabulary-parallel Embedding (rows split; out-of-shard tokens masked, results summed)",
        lambda m: isinstance(m, nn.Embedding), "nn.Embedding",
        lambda m: [("vocabulary size (num_embeddings)", m.num_embeddings)],
        lambda m, f: RowwiseParallel(input_layouts=Replicate(), output_layouts=_stream_layout(f),
                                     use_local_output=not f.sequence_parallel),
    ),
    "embedding_colwise": StyleSpec(
        "Embedding with the embedding dimension split (columns), output gathered",
        lambda m: isinstance(m, nn.Embedding), "nn.Embedding",
        lambda m: [("embedding_dim", m.embedding_dim)],
        lambda m, f: ColwiseParallel(input_layouts=Replicate(), output_layouts=_stream_layout(f),
                                     use_local_output=not f.sequence_parallel),
    ),
    "fused_qkv": StyleSpec(
        "column-wise Linear/Conv1D whose output concatenates q, k and v (GPT-2 c_attn): each rank holds its "
        "slice of each, the parameter keeps the original layout",
        _is_linear, "nn.Linear or Conv1D",
        lambda m: [("features per q/k/v block", _out_features(m) // 3)] if _out_features(m) % 3 == 0 else
        [("output features (3 equal q/k/v blocks)", _out_features(m))],
        lambda m, f: FusedColwiseParallel(blocks=3),
    ),
    "moe_experts": StyleSpec(
        "every expert of a stacked-experts module split like an MLP (gate/up column-wise, down row-wise); "
        "router replicated",
        is_stacked_experts, "a stacked-experts module (3-D gate_up_proj and down_proj parameters)",
        lambda m: [("expert intermediate size", expert_intermediate_size(m))],
        lambda m, f: StackedExpertsParallel(),
    ),
    "sequence_parallel": StyleSpec(
        "norm/dropout computed on its sequence shard (sequence parallelism only; nothing otherwise)",
        _any, "any module (norms, dropout)", lambda m: [],
        lambda m, f: SequenceParallel() if f.sequence_parallel else None,
    ),
    "sp_gather_input": StyleSpec(
        "all-gather the sequence-sharded hidden states entering an attention/MLP module (sequence "
        "parallelism only)",
        _any, "any module", lambda m: [],
        lambda m, f: SequenceGather() if f.sequence_parallel else None,
    ),
    "sp_gather_input_scatter_output": StyleSpec(
        "'sp_gather_input' for a module computing on plain tensors with a replicated output (MoE block): "
        "plain input, output split back over the sequence (sequence parallelism only)",
        _any, "any module", lambda m: [],
        lambda m, f: SequenceGather(local_input=True, scatter_output=True) if f.sequence_parallel else None,
    ),
}

#: styles that split a module's parameters (the others only move activations)
SHARDING_STYLES = frozenset({"colwise", "rowwise", "colwise_gather", "lm_head", "vocab_embedding",
                             "embedding_colwise", "fused_qkv", "moe_experts"})
#: styles that only act under sequence parallelism
SEQUENCE_STYLES = frozenset({"sequence_parallel", "sp_gather_input", "sp_gather_input_scatter_output"})


def check_style_name(name: str, where: str) -> None:
    """Raises StrategyError for an unknown style name (closest names suggested, all listed)."""
    if name not in STYLES:
        raise StrategyError(
            f"tensor_parallel: unknown style '{name}' for {where}.{did_you_mean(name, STYLES)} "
            f"Valid styles: {', '.join(STYLES)}."
        )


def style_for(name: str, module: nn.Module, fqn: str, flags: Flags) -> ParallelStyle | None:
    """The ``ParallelStyle`` for ``module`` (named ``fqn``), or None when the style is inactive.

    Raises:
        StrategyError: unknown style, or a module of a kind the style cannot shard.
    """
    check_applicable(name, module, fqn)
    return STYLES[name].build(module, flags)


def check_applicable(name: str, module: nn.Module, fqn: str) -> None:
    """Raises StrategyError when ``name`` is unknown or cannot shard a module of this kind."""
    check_style_name(name, fqn)
    spec = STYLES[name]
    if not spec.accepts(module):
        raise StrategyError(
            f"tensor_parallel: style '{name}' cannot be applied to {fqn} ({type(module).__name__}); it takes "
            f"{spec.kinds}. Pick another style for this module or leave it out of the plan."
        )


def split_sizes(name: str, module: nn.Module) -> list[tuple[str, int]]:
    """(label, size) of every dimension ``name`` splits on ``module`` (each must be divisible by tp)."""
    return STYLES[name].split(module)
