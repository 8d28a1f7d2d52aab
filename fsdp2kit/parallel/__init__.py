"""Tensor parallelism over a model's own plan, composed with FSDP on one DeviceMesh."""

from fsdp2kit.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_info

__all__ = ["apply_tensor_parallel", "tensor_parallel_info"]
