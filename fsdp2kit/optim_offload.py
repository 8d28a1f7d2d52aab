"""Optimizer-state offload (`make_optimizer(..., offload=True)`): AdamW's state and step in pinned host memory,
parameters and gradients on the GPU (how, limits, why not torchao's CPUOffloadOptimizer: docs/optimizers.md)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from fsdp2kit._internal.dtensor import local_shard

__all__ = ["OffloadedAdamW"]


class OffloadedAdamW(torch.optim.AdamW):
    """torch's AdamW with its state and update in host memory, pinned for parameters on an accelerator;
    ``amsgrad``, ``foreach``, ``fused``, ``capturable`` and ``differentiable`` are not offered."""

    def __init__(self, params, *, lr: float, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                local = local_shard(p)
                pinned = local.device.type != "cpu"
                host = [torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pinned) for _ in range(4)]
                self._buffers[p] = (host[0], host[1])  # the parameter's and the gradient's way through the host
                # The state as DTensors of p's placements without a move to the mesh's device (FSDP2's own helper),
                # made now, not at the first step: a checkpoint loads into them before any step.
                avg, avg_sq = (_from_local_no_grad(h, p._spec) if isinstance(p, DTensor) else h for h in host[2:])
                self.state[p].update(step=torch.tensor(0.0), exp_avg=avg, exp_avg_sq=avg_sq)

    def load_state_dict(self, state_dict) -> None:
        # torch's load moves each state tensor to its parameter's device (the GPU); copy the loaded
        # values back into the pinned host buffers the step works on.
        host = {p: (s["exp_avg"], s["exp_avg_sq"]) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, (avg, avg_sq) in host.items():
                state = self.state[p]
                local_shard(avg).copy_(local_shard(state["exp_avg"]))
                local_shard(avg_sq).copy_(local_shard(state["exp_avg_sq"]))
                state.update(exp_avg=avg, exp_avg_sq=avg_sq, step=state["step"].to("cpu"))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []  # (group, its parameters that have a gradient)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                param_buf, grad_buf = self._buffers[p]
                param_buf.copy_(local_shard(p), non_blocking=True)
                grad_buf.copy_(local_shard(p.grad), non_blocking=True)
            todo.append((group, params))
        devices = {local_shard(p).device for _, params in todo for p in params if local_shard(p).device.type == "cuda"}
        for device in devices:  # the host update reads what the device-to-host copies wrote
            torch.cuda.current_stream(device).synchronize()
        for group, params in todo:  # a group with no gradient is an empty call (torch's fused kernel returns)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            # torch's fused CPU kernel: one vectorised pass over each tensor where the single-tensor path makes
            # about ten (the host step is most of an offloaded step: docs/optimizers.md, "Offload")
            adamw(
                [self._buffers[p][0] for p in params],
                [self._buffers[p][1] for p in params],
                [local_shard(st["exp_avg"]) for st in states],
                [local_shard(st["exp_avg_sq"]) for st in states],
                [],
                [st["step"] for st in states],
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            for p in params:
                # asynchronous: the next step's copies into the same buffers are ordered after it on the same stream
                local_shard(p).copy_(self._buffers[p][0], non_blocking=True)
        return loss
