"""fsdp2kit: PyTorch FSDP2 made easy to use well. Every helper changes a module in place (README.md: the order)."""

# ruff: noqa: F401  (every import here is a re-export; __all__ below lists them)
import types

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

# The public names are the ones imported above, written once there (the submodules those imports bind are not).
__all__ = sorted(
    name for name, value in globals().items() if not name.startswith("_") and not isinstance(value, types.ModuleType)
)
