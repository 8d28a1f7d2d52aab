"""transformers' tensor-parallel style names as torch ParallelStyles, and what each does to a weight."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["STYLE_NAMES", "for_module", "resolve_style", "weight_placement"]


def _named() -> dict[str, ParallelStyle | None]:
    return {
        "colwise": ColwiseParallel(),  # output features split; the output stays split (the next rowwise takes it)
        "rowwise": RowwiseParallel(),  # input features split; the partial outputs are summed (one all-reduce)
        # a colwise head whose output is gathered: every rank gets the full logits
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        # a rowwise layer fed a replicated input (it takes its own slice of it)
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel: partial sums reduced
        "embedding_colwise": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),  # hidden-parallel
        # Qwen3's per-head q_norm / k_norm: whole on every rank, run on this rank's heads only. The input declared
        # split on dim 0 (a norm treats rows alike) makes the weight's gradient a Partial sum, reduced over TP.
        "replicated_with_grad_allreduce": SequenceParallel(sequence_dim=0, use_local_output=True),
        "replicate": None,  # every rank keeps the parameter whole, nothing to do
    }


STYLE_NAMES: tuple[str, ...] = tuple(_named())


def resolve_style(style: str | ParallelStyle, where: str) -> ParallelStyle | None:
    """A fresh torch ParallelStyle for a style name (None: leave the module alone), or the style given."""
    if isinstance(style, ParallelStyle):
        return style
    named = _named()
    if not isinstance(style, str) or style not in named:
        raise ValueError(
            f"tensor-parallel plan entry {where!r}: style {style!r} is not supported; use one of {list(named)} or a "
            "torch.distributed.tensor.parallel ParallelStyle (fused/packed projections, MoE experts and MLA "
            "styles have no exact torch equivalent)"
        )
    return named[style]


def weight_placement(module: nn.Module, style: ParallelStyle | None) -> Placement | str | None:
    """How ``style`` lays out ``module.weight`` over the TP mesh: a Placement, None (untouched) or "unknown"."""
    if style is None:
        return None
    if isinstance(style, SequenceParallel):
        return Replicate()
    linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return Shard(0) if linear else Shard(1) if embedding else "unknown"
    if isinstance(style, RowwiseParallel):
        return Shard(1) if linear else Shard(0) if embedding else "unknown"
    return "unknown"


def for_module(module: nn.Module, style: ParallelStyle | None) -> ParallelStyle | None:
    """``style``, or on a ``Float8Linear`` (`enable_float8`) torchao's float8 colwise / rowwise, which cast the
    input to float8 before it is redistributed, as the layer expects."""
    if type(module).__name__ != "Float8Linear" or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
    return cls(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )
