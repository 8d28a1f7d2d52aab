"""Optimizer-state offload: parameters and gradients stay on the GPU, AdamW's state and step live in
pinned host memory, and the update runs on the CPU (`make_optimizer(..., offload=True)`).

Why not torchao's ``CPUOffloadOptimizer`` (0.18): it starts each gradient's copy to the host from a
``register_post_accumulate_grad_hook``, and FSDP2 assigns the reduce-scattered gradient to the
sharded parameter itself, outside autograd's accumulation, so (as its code reads) the hook never
fires and the offloaded parameters are never stepped; its state dict is keyed per inner optimizer,
not by parameter, so DCP cannot reshard it. See docs/optimizers.md, Offload.

What this one does, per step: every local gradient shard and parameter shard is copied to its
pinned host buffer (one synchronisation for all of them), torch's single-tensor AdamW updates the
host copy with the host state, and the result is copied back (asynchronously: the next step's
copies into the same buffers are ordered after it on the same stream). The parameter travels both
ways each step (3 x its bytes over PCIe) instead of keeping an fp32 master on the host, so a
`Checkpointer.load` or any edit of the parameters between steps is seen. The copies are not
overlapped with the backward yet: that needs a point after each FSDP unit's reduce-scatter, which
FSDP2 does not expose as a hook.

The state is AdamW's own (``step``, ``exp_avg``, ``exp_avg_sq``), held as DTensors with the
parameters' placements whose local tensors are the pinned host buffers (as FSDP2's own CPU offload
holds parameters): `get_optimizer_state_dict`, DCP and the Checkpointer save, load and reshard it
as they do AdamW's, and a checkpoint moves between offloaded and on-device AdamW (same class name).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

__all__ = ["OffloadedAdamW"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (on the host) as a DTensor with ``p``'s placements, without moving it to the mesh's device."""
    if not isinstance(p, DTensor):
        return local
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad  # FSDP2's own, for the same

    return _from_local_no_grad(local, p._spec)


class OffloadedAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay) with its state and update in pinned host memory.

    ``pin`` defaults to whether the parameters are on an accelerator; `make_optimizer` builds it for
    CUDA parameters only (on CPU there is nothing to offload). ``amsgrad``, ``foreach``, ``fused``,
    ``capturable`` and ``differentiable`` are not offered.
    """

    def __init__(self, params, *, lr: float, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, pin: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                local = _local(p)
                pinned = local.device.type != "cpu" if pin is None else pin

                def host(pinned=pinned, local=local):
                    return torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pinned)

                self._buffers[p] = (host(), host())  # the parameter's and the gradient's way through the host
                # Made now, not at the first step: a checkpoint loads into them before any step.
                self.state[p].update(step=torch.tensor(0.0), exp_avg=_like(p, host()), exp_avg_sq=_like(p, host()))

    def load_state_dict(self, state_dict) -> None:
        # torch's load moves each state tensor to its parameter's device (the GPU); copy the loaded
        # values back into the pinned host buffers the step works on.
        host = {p: (s["exp_avg"], s["exp_avg_sq"]) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, (avg, avg_sq) in host.items():
                state = self.state[p]
                _local(avg).copy_(_local(state["exp_avg"]))
                _local(avg_sq).copy_(_local(state["exp_avg_sq"]))
                state.update(exp_avg=avg, exp_avg_sq=avg_sq, step=state["step"].to("cpu"))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_buf, grad_buf = self._buffers[p]
                param_buf.copy_(_local(p), non_blocking=True)
                grad_buf.copy_(_local(p.grad), non_blocking=True)
                todo.append((group, p))
        devices = {_local(p).device for _, p in todo if _local(p).device.type == "cuda"}
        for device in devices:  # the host update reads what the device-to-host copies wrote
            torch.cuda.current_stream(device).synchronize()
        for group, p in todo:
            state, (param_buf, grad_buf) = self.state[p], self._buffers[p]
            beta1, beta2 = group["betas"]
            adamw(
                [param_buf],
                [grad_buf],
                [_local(state["exp_avg"])],
                [_local(state["exp_avg_sq"])],
                [],
                [state["step"]],
                foreach=False,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            _local(p).copy_(param_buf, non_blocking=True)
        return loss
