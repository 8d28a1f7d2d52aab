"""Tensor-parallel style names (transformers' vocabulary) as torch ParallelStyles, and what each does to a weight.

transformers names its plans' styles with strings ("colwise", "rowwise", "embedding_rowwise",
...) and applies them with its own layer classes; fsdp2kit applies the same plans with torch's
`parallelize_module`, so the parameters are torch DTensors that `fully_shard`, DCP and the
optimizers already understand. Only the styles whose meaning maps exactly onto torch's styles
are accepted; anything else (fused / packed projections, experts, MLA) is an error that names it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["STYLE_NAMES", "ReplicateGradSum", "for_module", "resolve_style", "weight_placement"]


class ReplicateGradSum(ParallelStyle):
    """A module whose (small) parameters every TP rank keeps whole, applied to this rank's heads only.

    transformers' "replicated_with_grad_allreduce" (Qwen3's per-head q_norm / k_norm): each rank
    normalises only its own heads, so each rank's weight gradient is a partial sum and the true
    gradient is their sum over the TP group. The parameters become Replicate DTensors and the
    input is declared sharded on dim 0: the module treats every row alike (a norm over the last
    dimension), so "the rows of all ranks, stacked" is a faithful global view, and DTensor then
    turns the weight gradient into a Partial sum that is reduced over the TP group (by FSDP's
    gradient step, or by the optimizer's first use of it).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        src = self.src_data_rank

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                replicated = distribute_tensor(p, mesh, [Replicate()], src_data_rank=src)
                mod.register_parameter(pname, nn.Parameter(replicated, requires_grad=p.requires_grad))

        def inputs(_mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(a, mesh, [Shard(0)], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        def outputs(_mod: nn.Module, out, _mesh: DeviceMesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _named() -> dict[str, ParallelStyle | None]:
    return {
        # output features split over the ranks; the output stays split (the next rowwise consumes it)
        "colwise": ColwiseParallel(),
        # input features split; the partial outputs are summed (one all-reduce)
        "rowwise": RowwiseParallel(),
        # a colwise head whose output is gathered: every rank gets the full logits
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        # a rowwise layer fed a replicated input (it takes its own slice of it)
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        # embeddings: vocabulary-parallel (each rank looks up its own token ids, partial sums
        # all-reduced) or hidden-parallel (each rank a slice of every vector, gathered)
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicateGradSum(),
        # every rank keeps the parameter whole, nothing to do
        "replicate": None,
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
    if isinstance(style, ReplicateGradSum):
        return Replicate()
    linear, embedding = isinstance(module, nn.Linear), isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return Shard(0) if linear else Shard(1) if embedding else "unknown"
    if isinstance(style, RowwiseParallel):
        return Shard(1) if linear else Shard(0) if embedding else "unknown"
    return "unknown"


def for_module(module: nn.Module, style: ParallelStyle | None) -> ParallelStyle | None:
    """The style to apply to this module: torch's colwise / rowwise become torchao's float8 ones on a
    ``Float8Linear`` (from `enable_float8`), which cast the input to float8 before it is redistributed
    and the output gradient after, as the layer's own forward and backward expect."""
    if type(module).__name__ != "Float8Linear" or type(style) not in (ColwiseParallel, RowwiseParallel):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
    return cls(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )
