"""A one-minute self-check of a training configuration, before a long run spends hours on it.

Each check prints PASS or FAIL on rank 0:
- loss finite and falling over a few steps;
- the same loss on every rank for the same batch (the shards really form one model);
- a checkpoint save/load round-trip after which training continues with bitwise-equal losses,
  in `smoke_dir`: ``<checkpoint.dir>.smoke`` beside the checkpoint directory (the same file
  system, which every rank must see, and never the run's own checkpoints), removed afterwards;
- the measured peak memory per rank against the ShardPlan's floor (parameters + gradients +
  Adam state): the difference is activations and runtime overhead.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2kit._internal.fmt import fmt_bytes
from fsdp2kit.checkpoint import Checkpointer
from fsdp2kit.dist import DistInfo
from fsdp2kit.grads import clip_grad_norm_
from fsdp2kit.plan import ShardPlan
from support.metrics import peak_memory_bytes

__all__ = ["run_smoke", "smoke_dir"]


def smoke_dir(checkpoint_dir: str | Path) -> Path:
    """Where the round-trip checkpoint goes: ``outputs/ckpt`` -> ``outputs/ckpt.smoke``."""
    root = Path(checkpoint_dir).resolve()
    return root.with_name(root.name + ".smoke")


def _to(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _step(model, optimizer, scheduler, batches, loss_fn, device) -> float:
    loss = loss_fn(model, _to(next(batches), device))
    loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return out.item()


def run_smoke(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    loader,
    plan: ShardPlan,
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    info: DistInfo,
    ckpt_dir: Path,
    *,
    steps: int = 10,
) -> bool:
    results: list[tuple[str, bool, str]] = []
    batches = iter(loader)

    losses = [_step(model, optimizer, scheduler, batches, loss_fn, info.device) for _ in range(steps)]
    k = max(1, steps // 3)
    falling = sum(losses[-k:]) / k < sum(losses[:k]) / k
    results.append(
        (
            "loss finite and falling",
            all(map(math.isfinite, losses)) and falling,
            f"{losses[0]:.4f} -> {losses[-1]:.4f} over {steps} steps",
        )
    )

    probe = _to(next(batches), info.device)
    for t in probe.values():
        dist.broadcast(t, src=0)  # one batch, the same on every rank
    with torch.no_grad():
        local = loss_fn(model, probe).detach().reshape(1)
    everyone = [torch.zeros_like(local) for _ in range(info.world_size)]
    dist.all_gather(everyone, local)
    values = [t.item() for t in everyone]
    results.append(("same loss on every rank", len(set(values)) == 1, f"{values[0]:.6f} on {len(values)} ranks"))

    if info.is_main:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.barrier()
    ck = Checkpointer(ckpt_dir, keep_last=1)
    extra = {"scheduler": scheduler, "data": loader}
    ck.save(steps, model, optimizer=optimizer, extra=extra)
    ck.wait()
    batches = iter(loader)
    after = [_step(model, optimizer, scheduler, batches, loss_fn, info.device) for _ in range(3)]
    ck.load(model, optimizer=optimizer, extra=extra)
    batches = iter(loader)
    again = [_step(model, optimizer, scheduler, batches, loss_fn, info.device) for _ in range(3)]
    results.append(
        (
            "save/load round-trip continues the loss exactly",
            after == again,
            f"{after} vs {again} (in {ckpt_dir}, now removed)",
        )
    )
    dist.barrier()  # every rank has read it back
    if info.is_main:
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    peak = torch.tensor([peak_memory_bytes(info.device)], dtype=torch.float64, device=info.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    floor = plan.state_bytes_per_rank
    results.append(
        (
            "peak memory per rank covers the plan's floor",
            peak.item() >= floor,
            f"peak {fmt_bytes(peak.item())} vs floor {fmt_bytes(floor)} "
            f"(params + grads + Adam; the rest is activations and runtime)",
        )
    )

    ok = all(passed for _, passed, _ in results)
    if info.is_main:
        for name, passed, detail in results:
            print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}", flush=True)
        print(f"smoke: {sum(p for _, p, _ in results)}/{len(results)} checks passed", flush=True)
    return ok
