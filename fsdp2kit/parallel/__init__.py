"""Tensor parallelism over a model's own plan, and context parallelism over its attention, composed with FSDP."""

from fsdp2kit.parallel.context_parallel import apply_context_parallel
from fsdp2kit.parallel.cp_inputs import split_for_context_parallel
from fsdp2kit.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["apply_context_parallel", "apply_tensor_parallel", "split_for_context_parallel"]
