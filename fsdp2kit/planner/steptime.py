"""Step time, predicted: each unit's matmul time against its collectives, under FSDP2's overlap rules
(how and why: docs/step_time.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from fsdp2kit.planner.comm import Collective, comm_of_settings
from fsdp2kit.planner.flops import UnitFlops, count_flops
from fsdp2kit.planner.hardware import Hardware
from fsdp2kit.planner.trace import block_names

__all__ = ["DEFAULT_PRICE", "StepTime", "default_nodes", "predict_step", "simulate"]

# US$ per GPU-hour: an illustrative on-demand H100 price, not a quote; pass --price-per-gpu-hour.
DEFAULT_PRICE = 2.50

# torch's fused CPU AdamW reaches this fraction of the memory bandwidth of an in-place streaming op (measured 1.02,
# rounds 0.99-1.06: benchmarks/results/host_adamw_speed.md): it runs at the memory's speed
HOST_ADAMW_EFFICIENCY = 1.0


def offload_step_seconds(
    param_bytes: float,
    grad_bytes: float,
    state_bytes: float,
    hw: Hardware,
    efficiency: float = HOST_ADAMW_EFFICIENCY,
    transfers: bool = True,
) -> float:
    """Optimizer offload's step: parameters and gradients to the host, parameters back (none if not ``transfers``:
    cpu_offload's host shards), then fused CPU AdamW, memory-bound: reads params, grads, state; writes params, state."""
    moved = (2 * param_bytes + grad_bytes) / hw.host_bytes_per_s if transfers else 0.0
    return moved + (2 * param_bytes + grad_bytes + 2 * state_bytes) / (hw.host_memory_bytes_per_s * efficiency)


@dataclass
class StepTime:
    """What `predict_step` returns; times in seconds, per optimizer step."""

    hardware: Hardware
    nodes: int
    world: int
    tokens_per_step_per_gpu: float
    compute_s: float  # matmul time, recompute included
    exposed_comm_s: float  # communication nothing overlapped
    optimizer_s: float  # the optimizer step (HBM-bound)
    step_s: float
    model_flops: float  # per rank per step: forward + backward, no recompute (what MFU counts)
    comm_bytes: int  # per rank per step, all collectives' payloads
    comm_s: float  # all collectives' time, overlapped or not
    price_per_gpu_hour: float = DEFAULT_PRICE
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step_per_gpu / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.hardware.bf16_flops

    @property
    def cost_per_billion_tokens(self) -> float:
        return 1e9 / self.tokens_per_second_per_gpu / 3600 * self.price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.hardware.name,
            "nodes": self.nodes,
            "step_seconds": self.step_s,
            "compute_seconds": self.compute_s,
            "exposed_comm_seconds": self.exposed_comm_s,
            "optimizer_seconds": self.optimizer_s,
            "comm_seconds": self.comm_s,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "mfu": self.mfu,
            "comm_bytes_per_step": self.comm_bytes,
            "model_flops_per_step": self.model_flops,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "cost_per_billion_tokens": self.cost_per_billion_tokens,
            "efficiency": self.hardware.efficiency,
            "step_notes": self.notes,
        }

    def __str__(self) -> str:
        hw = self.hardware
        lines = [
            f"Step time on {self.world} x {hw.name} ({self.nodes} node{'s' if self.nodes > 1 else ''}, "
            f"{hw.efficiency:.0%} of the bf16 peak for matmuls):",
            f"  step {self.step_s * 1e3:,.0f} ms = compute {self.compute_s * 1e3:,.0f} ms + exposed communication "
            f"{self.exposed_comm_s * 1e3:,.0f} ms + optimizer {self.optimizer_s * 1e3:,.0f} ms "
            f"(communication {self.comm_s * 1e3:,.0f} ms in all, {self.comm_bytes / 2**30:,.2f} GiB a rank)",
            f"  {self.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%}, "
            f"${self.cost_per_billion_tokens:,.0f} per billion tokens at ${self.price_per_gpu_hour:.2f}/GPU-hour",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def default_nodes(settings, hardware: Hardware) -> int:
    """The fewest nodes of ``hardware`` that hold the world (replicate x shard x cp x tp) evenly."""
    world = settings.replicate * settings.shard * settings.cp * settings.tp
    return next(n for n in range(math.ceil(world / hardware.gpus_per_node), world + 1) if world % n == 0)


def simulate(
    order: list[int],
    root: int,
    fwd: list[float],
    bwd: list[float],
    ag: list[float],
    ag_bwd: list[float],
    after_bwd: list[float],
    prefetch: int,
) -> tuple[float, float]:
    """(end of compute, end of communication) of one micro-batch; ``order``: units in forward order, the root first;
    ``ag``, ``ag_bwd``, ``after_bwd``: each unit's seconds of gathers and of reductions (docs/step_time.md)."""
    depth = max(1, prefetch)  # FSDP2's implicit prefetch is one unit ahead too (the CPU runs ahead)
    rest = [u for u in order if u != root]
    # steps: (unit, compute seconds, all-gather seconds before it, collective seconds after it)
    steps = [(root, 0.0, ag[root], 0.0)] + [(u, fwd[u], ag[u], 0.0) for u in rest] + [(root, fwd[root], 0.0, 0.0)]
    back = [(root, bwd[root], ag_bwd[root], 0.0)] + [(u, bwd[u], ag_bwd[u], after_bwd[u]) for u in reversed(rest)]
    steps += [*back, (root, 0.0, 0.0, after_bwd[root])]  # the root reduces at the end of backward
    t = comm = 0.0  # when compute, and the communication queue, are next free
    gathered: dict[int, float] = {}

    def issue(k: int, at: float) -> None:
        nonlocal comm
        if k < len(steps):
            comm = max(comm, at) + steps[k][2]
            gathered[k] = comm

    for k in range(depth):
        issue(k, 0.0)
    for k, (_, compute, _, after) in enumerate(steps):
        start = max(t, gathered[k])
        issue(k + depth, start)
        t = start + compute
        if after:
            comm = max(comm, t) + after
    return t, max(t, comm)


def predict_step(
    model: nn.Module,
    settings,
    hardware: Hardware,
    *,
    nodes: int = 1,
    price_per_gpu_hour: float = DEFAULT_PRICE,
    cache: dict | None = None,
    memory_plan=None,
    accumulation: str | None = None,
) -> StepTime:
    """One optimizer step's time for ``model`` trained with ``settings`` (`fsdp2kit.planner.api.Settings`; its
    ``accumulation`` unless given) on ``hardware`` over ``nodes`` nodes (docs/step_time.md)."""
    from fsdp2kit.planner.api import plan_settings, trained_plan

    cache = {} if cache is None else cache
    s, hw = settings, hardware
    trained, plan = trained_plan(model, s, cache)
    cp = s.cp  # context parallelism: FSDP shards over shard x cp, each rank holds seq / cp tokens
    world = s.replicate * s.shard * cp * s.tp
    if nodes < 1 or world % nodes:
        raise ValueError(
            f"nodes={nodes}: the world of {world} GPUs (replicate x shard x cp x tp) must split evenly over it"
        )
    per_node = world // nodes
    if per_node > hw.gpus_per_node:
        raise ValueError(
            f"{world} GPUs on {nodes} node(s) is {per_node} a node, more than {hw.name}'s "
            f"{hw.gpus_per_node}: give --nodes {math.ceil(world / hw.gpus_per_node)} or more"
        )
    if price_per_gpu_hour < 0:
        raise ValueError(f"price_per_gpu_hour={price_per_gpu_hour!r}: expected >= 0")
    compute = plan.precision.compute_dtype
    unit_names = [list(u.modules) for u in plan.units]
    key = ("flops", id(trained), s.batch, s.seq, s.activation_checkpointing, compute)
    if key not in cache:
        cache[key] = count_flops(trained, unit_names, s.batch, s.seq, compute, s.activation_checkpointing)
    flops, order = cache[key]
    # Each cp rank runs the Linears on seq / cp tokens and attention on the whole sequence for heads / cp
    # (all-to-all style): 1 / cp of every matmul, whatever its kind (x / 1 is x exactly).
    flops = [UnitFlops(f.forward / cp, f.backward / cp, f.recompute / cp) for f in flops]
    comm = comm_of_settings(model, s, accumulation=accumulation, cache=cache)
    itemsize = (compute or next(model.parameters()).dtype).itemsize
    acts = activation_collectives(model, unit_names, s, itemsize, trained=trained)
    memory_plan = memory_plan or plan_settings(model, s, cache)

    rate = hw.bf16_flops * hw.efficiency
    fwd = [f.forward / rate for f in flops]
    bwd = [f.backward / rate for f in flops]
    compute_s = comm.micro_batches * (sum(fwd) + sum(bwd))
    sizes = {**comm.group_sizes, "tp": s.tp, "cp": cp}

    def seconds(c: Collective) -> float:
        """A ring collective's time: the bytes a rank puts on the wire over its group's link, + a latency a step."""
        n = sizes.get(c.group, 1)
        if n <= 1:
            return 0.0
        # The group's ranks on one node: the mesh is (replicate, shard, cp, tp), tp innermost, so "shard",
        # "shard/K" (a reshard-to-K gather), NO_SHARD's "shard" and "cp" ranks are tp apart.
        apart = {"replicate": s.shard * cp * s.tp, "tp": 1}.get(c.group, s.tp)
        in_node = max(1, min(n, per_node // apart))
        # Within a node NVLink; across nodes (NCCL: a ring a NIC) the node's network, shared by the groups
        # that run at once on it (a 2-D mesh's tp groups, HSDP's replica groups of each local rank).
        bw = hw.nvlink_bytes_per_s
        if n > in_node:
            bw = min(bw, hw.network_bytes_per_s / max(1, per_node // in_node))
        passes = 2 if c.kind == "all_reduce" else 1  # ring: a reduce-scatter then an all-gather
        wire = 1 if c.kind == "permute" else (n - 1) / n  # permute: the whole buffer to the next rank (ring rotation)
        return c.nbytes * passes * wire * (1.0 / bw) + passes * hw.latency_s * (n - 1)

    # Activations' collectives lengthen their unit's compute; recompute repeats the forward ones but a block's
    # last all-reduce (why: docs/step_time.md, item 8).
    act_bytes = act_s = 0.0
    for i, unit in enumerate(acts):
        last = max((k for k, a in enumerate(unit) if a[0] == "forward"), default=-1)
        for k, (phase, kind, group, nbytes) in enumerate(unit):
            t = seconds(Collective(kind, group, nbytes, "", 1, phase))
            n = 1 + (phase == "forward" and flops[i].recompute > 0 and not (k == last and kind == "all_reduce"))
            (fwd if phase == "forward" else bwd)[i] += t
            bwd[i] += (n - 1) * t
            act_bytes += n * nbytes
            act_s += n * t

    # With cpu_offload each all-gather first copies the unit's shards to the GPU, each reduction copies its
    # gradient shards back, on the same queue.
    host = [(u.bytes_per_rank, u.trainable_bytes_per_rank) if s.cpu_offload else (0, 0) for u in plan.units]
    m = comm.micro_batches
    end_all = 0.0
    for micro in range(m):
        ag, ag_bwd, after = ([0.0] * len(flops) for _ in range(3))
        for i, unit in enumerate(comm.units):
            for c in unit.collectives:
                # A collective issued k times in m micro-batches: every one (k == m), or the first (a gather
                # kept across micro-batches) or the last (a reduction deferred to the end of accumulation).
                gather = c.kind == "all_gather"
                if not (c.count == m or (gather and micro == 0) or (not gather and micro == m - 1)):
                    continue
                h2d, d2h = host[i]
                if gather:
                    (ag if c.phase == "forward" else ag_bwd)[i] += seconds(c) + h2d / hw.host_bytes_per_s
                else:
                    after[i] += seconds(c) + (d2h / hw.host_bytes_per_s if c.kind == "reduce_scatter" else 0.0)
        end_all += simulate(order, order[0], fwd, bwd, ag, ag_bwd, after, s.prefetch)[1]
    # The optimizer step reads and writes the sharded parameters, gradients and state once: HBM-bound.
    opt_bytes = 2 * (memory_plan.param_bytes + memory_plan.grad_bytes + memory_plan.optimizer_bytes)
    optimizer_s = opt_bytes / hw.hbm_bytes_per_s
    notes = []
    if s.optimizer_offload or s.cpu_offload:  # cpu_offload: the shards' copies are in the collectives above
        host_step = (memory_plan.trainable_param_bytes, memory_plan.grad_bytes, memory_plan.optimizer_bytes, hw)
        optimizer_s = offload_step_seconds(*host_step, transfers=s.optimizer_offload)
        notes.append(
            f"{'cpu_offload' if s.cpu_offload else 'optimizer offload: transfers not overlapped'}, host AdamW "
            f"step (make_optimizer's fused kernel) memory-bound at {hw.host_memory_bytes_per_s / 1e9:.0f} GB/s "
            "per GPU (assumed: a 2-socket host shared by 8 GPUs)"
        )
    comm_s = sum(c.count * seconds(c) for u in comm.units for c in u.collectives) + m * act_s
    return StepTime(
        hardware=hw,
        nodes=nodes,
        world=world,
        tokens_per_step_per_gpu=m * s.batch * s.seq / (s.tp * cp),
        compute_s=compute_s,
        exposed_comm_s=end_all - compute_s,
        optimizer_s=optimizer_s,
        step_s=end_all + optimizer_s,
        model_flops=m * sum(f.model for f in flops),
        comm_bytes=comm.bytes_per_step + int(m * act_bytes),
        comm_s=comm_s,
        price_per_gpu_hour=price_per_gpu_hour,
        notes=notes,
    )


def activation_collectives(
    model: nn.Module, unit_names: list[list[str]], s, itemsize: int, trained: nn.Module | None = None
) -> list[list[tuple]]:
    """Per unit, one micro-batch's TP and CP collectives on activations, ``(phase, kind, group, bytes)``
    (docs/step_time.md); ``unit_names`` name ``trained``'s modules (``model``'s if not given)."""
    from fsdp2kit.parallel.tensor_parallel import _pattern, model_tp_plan

    tokens = s.batch * s.seq // s.cp  # a rank's, with the whole batch (tp ranks share it)
    owners = sorted(((n, i) for i, names in enumerate(unit_names) for n in names), key=lambda t: -len(t[0]))
    out: list[list[tuple]] = [[] for _ in unit_names]

    def unit_of(name: str) -> list[tuple]:
        return out[next(i for n, i in owners if not n or name == n or name.startswith(n + "."))]

    styles = [(_pattern(k), v) for k, v in model_tp_plan(model).items()] if s.tp > 1 else []
    for name, mod in model.named_modules() if styles else ():
        style = next((v for pat, v in styles if isinstance(v, str) and pat.fullmatch(name)), "")
        if "rowwise" in style:
            width = mod.embedding_dim if isinstance(mod, nn.Embedding) else mod.out_features
            unit_of(name).append(("forward", "all_reduce", "tp", tokens * width * itemsize))
        elif "colwise" in style:
            unit_of(name).append(("backward", "all_reduce", "tp", tokens * mod.in_features * itemsize))
            if "gather" in style:
                unit_of(name).append(("forward", "all_gather", "tp", tokens * mod.out_features * itemsize))
    if s.cp == 1:
        return out
    config = getattr(model, "config", None)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for name in block_names(model if trained is None else trained):
        unit = unit_of(name)
        if s.cp_style == "ring":
            # torch's ring (planner/trace.py, _RingAttention): k and v, repeated to the query heads, all-gathered in
            # forward and again in backward; dk and dv, in fp32, sent on to the next rank cp times
            kv_elements = 2 * tokens * heads // s.tp * dim
            gathered = s.cp * kv_elements * itemsize
            unit.extend([(phase, "all_gather", "cp", gathered) for phase in ("forward", "backward")])
            unit.extend([("backward", "permute", "cp", kv_elements * 4)] * s.cp)
            continue
        for width in (heads, 2 * kv, heads):  # q; k and v in one exchange; the output (parallel/context_parallel)
            nbytes = tokens * width // s.tp * dim * itemsize
            unit.extend([(phase, "all_to_all", "cp", nbytes) for phase in ("forward", "backward")])
    return out
