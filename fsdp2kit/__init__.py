"""fsdp2kit: PyTorch FSDP2 made easy to use well. Every helper changes a module in place (README.md: the order)."""

from fsdp2kit.accumulation import ACCUMULATION, accumulate
from fsdp2kit.blocks import find_blocks
from fsdp2kit.checkpoint import Checkpointer, CheckpointError, PerRank, RNGState
from fsdp2kit.diagnostics import DesyncError, NonFiniteError, RankMonitor, check_finite
from fsdp2kit.diagnostics.collectives import CollectiveCounts, count_collectives
from fsdp2kit.dist import DistInfo, init_distributed, make_mesh
from fsdp2kit.grads import clip_grad_norm_, no_sync
from fsdp2kit.migrate import ImportResult, convert_config, load_fsdp1_checkpoint, load_full_state_dict
from fsdp2kit.optim import OPTIMIZERS, make_optimizer
from fsdp2kit.parallel import apply_context_parallel, apply_tensor_parallel, split_for_context_parallel
from fsdp2kit.plan import ShardPlan, UnitPlan
from fsdp2kit.planner import MemoryPlan, plan_memory
from fsdp2kit.planner.comm import CommPlan, plan_comm
from fsdp2kit.shard import STRATEGIES, estimate_plan, shard_model
from fsdp2kit.stop import EXIT_PREEMPTED, StopSignal
from fsdp2kit.weights.adapters import apply_lora
from fsdp2kit.weights.export import dcp_to_hf, export_hf
from fsdp2kit.weights.materialize import materialize
from fsdp2kit.weights.nf4 import quantize_nf4
from fsdp2kit.weights.pretrained import LoadResult, load_pretrained
from fsdp2kit.wrappers.activation import apply_activation_checkpointing
from fsdp2kit.wrappers.compile import compile_blocks
from fsdp2kit.wrappers.float8 import enable_float8
from fsdp2kit.wrappers.prefetch import set_prefetch

__version__ = "0.1.0"

__all__ = [
    "ACCUMULATION",
    "EXIT_PREEMPTED",
    "OPTIMIZERS",
    "STRATEGIES",
    "CheckpointError",
    "Checkpointer",
    "CollectiveCounts",
    "CommPlan",
    "DesyncError",
    "DistInfo",
    "ImportResult",
    "LoadResult",
    "MemoryPlan",
    "NonFiniteError",
    "PerRank",
    "RNGState",
    "RankMonitor",
    "ShardPlan",
    "StopSignal",
    "UnitPlan",
    "accumulate",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_lora",
    "apply_tensor_parallel",
    "check_finite",
    "clip_grad_norm_",
    "compile_blocks",
    "convert_config",
    "count_collectives",
    "dcp_to_hf",
    "enable_float8",
    "estimate_plan",
    "export_hf",
    "find_blocks",
    "init_distributed",
    "load_fsdp1_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "make_mesh",
    "make_optimizer",
    "materialize",
    "no_sync",
    "plan_comm",
    "plan_memory",
    "quantize_nf4",
    "set_prefetch",
    "shard_model",
    "split_for_context_parallel",
]
