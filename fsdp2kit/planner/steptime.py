"""Step time, predicted: each unit's matmul time against its collectives, under FSDP2's overlap rules.

How it works and why: docs/step_time.md. In short: a unit computes for its FLOPs / (peak x efficiency);
a collective takes its bytes on the wire / the bandwidth of the link its group crosses, plus a latency a
ring step; one compute stream and one communication queue (all-gathers, reduce-scatters and HSDP
all-reduces share the link) run as FSDP2 orders them: the all-gather of the unit ``prefetch`` ahead is
issued when a unit starts computing, a unit computes once its own all-gather is done, a unit's
reduce-scatter (then its all-reduce across replicas) is issued when its backward ends. So the first
all-gather and the last reduce-scatter are exposed, and the rest hides under compute while compute is longer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from fsdp2kit.planner.comm import Collective, CommPlan, comm_of_plan
from fsdp2kit.planner.flops import UnitFlops, count_flops
from fsdp2kit.planner.hardware import Hardware

__all__ = ["DEFAULT_PRICE", "StepTime", "default_nodes", "predict_step", "simulate"]

# US$ per GPU-hour: an illustrative on-demand H100 price, not a quote; pass --price-per-gpu-hour.
DEFAULT_PRICE = 2.50


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
    nodes = math.ceil(world / hardware.gpus_per_node)
    while world % nodes:
        nodes += 1
    return nodes


def link_seconds(hw: Hardware, *, group: int, per_node_in_group: int, per_node: int) -> tuple[float, float]:
    """(seconds a byte on the wire, latency of one collective) for a ring over ``group`` ranks that has
    ``per_node_in_group`` of its ranks on each of its nodes, on nodes of ``per_node`` GPUs.

    Within a node: NVLink. Across nodes: NCCL runs one ring a NIC, so one collective gets the whole node's
    network, shared by the groups that run at once on that node (``per_node / per_node_in_group`` of them:
    the tp groups of a 2-D mesh's shard dimension, the replica groups of each local rank under HSDP)."""
    if group <= 1:
        return 0.0, 0.0
    if group <= per_node_in_group:
        return 1.0 / hw.nvlink_bytes_per_s, hw.latency_s * (group - 1)
    concurrent = max(1, per_node // per_node_in_group)
    bw = min(hw.nvlink_bytes_per_s, hw.network_bytes_per_s / concurrent)
    return 1.0 / bw, hw.latency_s * (group - 1)


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
    """(end of compute, end of communication) of one micro-batch. ``order``: units in forward order, the root
    first (its own compute, the head, is placed at the end of forward and the start of backward). ``ag``,
    ``ag_bwd``, ``after_bwd``: seconds of each unit's forward all-gather, backward all-gather, and
    reduce-scatter + all-reduce (0: none)."""
    depth = max(1, prefetch)  # FSDP2's implicit prefetch is one unit ahead too (the CPU runs ahead)
    rest = [u for u in order if u != root]
    # steps: (unit, compute seconds, all-gather seconds before it, collective seconds after it)
    steps = [(root, 0.0, ag[root], 0.0)] + [(u, fwd[u], ag[u], 0.0) for u in rest] + [(root, fwd[root], 0.0, 0.0)]
    back = [(root, bwd[root], ag_bwd[root], 0.0)] + [(u, bwd[u], ag_bwd[u], after_bwd[u]) for u in reversed(rest)]
    steps += [*back, (root, 0.0, 0.0, after_bwd[root])]  # the root reduces at the end of backward
    comm = 0.0  # when the communication queue is next free
    gathered: dict[int, float] = {}
    t = 0.0

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
    """Predict one optimizer step's time for ``model`` trained with ``settings`` (`fsdp2kit.planner.api.Settings`,
    ``grad_accum`` micro-batches a step, communicating as ``accumulation``, else ``settings.accumulation``, says)
    on ``hardware`` over ``nodes`` nodes (the world, replicate x shard x cp x tp, split evenly over them).
    The collective bytes are `fsdp2kit.planner.comm`'s, the ones `fsdp2kit.count_collectives` measures."""
    from fsdp2kit.planner.api import _as_trained, plan_settings
    from fsdp2kit.precision import resolve_precision
    from fsdp2kit.shard import estimate_plan

    cache = {} if cache is None else cache
    s = settings
    s.check()
    cp = s.cp  # context parallelism: FSDP shards over shard x cp, each rank holds seq / cp tokens
    world = s.replicate * s.shard * cp * s.tp
    if nodes < 1 or world % nodes:
        raise ValueError(
            f"nodes={nodes}: the world of {world} GPUs (replicate x shard x cp x tp) must split evenly over it"
        )
    per_node = world // nodes
    if per_node > hardware.gpus_per_node:
        raise ValueError(
            f"{world} GPUs on {nodes} node(s) is {per_node} a node, more than {hardware.name}'s "
            f"{hardware.gpus_per_node}: give --nodes {math.ceil(world / hardware.gpus_per_node)} or more"
        )
    if price_per_gpu_hour < 0:
        raise ValueError(f"price_per_gpu_hour={price_per_gpu_hour!r}: expected >= 0")
    compute = resolve_precision(s.mixed_precision).compute_dtype
    trained = _as_trained(model, s, compute, cache)
    plan = estimate_plan(
        trained, shard=s.shard * cp, replicate=s.replicate, strategy=s.strategy, mixed_precision=s.mixed_precision
    )
    unit_names = [list(u.modules) for u in plan.units]
    key = ("flops", id(trained), s.batch, s.seq, s.activation_checkpointing, compute)
    if key not in cache:
        cache[key] = count_flops(
            trained,
            unit_names,
            batch=s.batch,
            seq=s.seq,
            compute_dtype=compute,
            activation_checkpointing=s.activation_checkpointing,
        )
    flops, order = cache[key]
    if cp > 1:
        # Each cp rank runs the Linears on seq / cp tokens and attention on the whole sequence for heads / cp
        # (all-to-all style): 1 / cp of every matmul, whatever its kind.
        flops = [UnitFlops(f.forward / cp, f.backward / cp, f.recompute / cp) for f in flops]
    comm = comm_of_plan(trained, plan, micro_batches=s.grad_accum, accumulation=accumulation or s.accumulation)
    itemsize = (compute or next(model.parameters()).dtype).itemsize
    acts = activation_collectives(model, unit_names, s, itemsize, trained=trained)
    host = [(u.bytes_per_rank, u.trainable_bytes_per_rank) for u in plan.units] if s.cpu_offload else None
    return _predict(
        hardware,
        flops,
        order,
        comm,
        memory_plan or plan_settings(model, s, cache),
        s,
        nodes=nodes,
        per_node=per_node,
        price=price_per_gpu_hour,
        acts=acts,
        host=host,
    )


def activation_collectives(
    model: nn.Module, unit_names: list[list[str]], s, itemsize: int, trained: nn.Module | None = None
) -> list[list[tuple]]:
    """Per unit, one micro-batch's collectives on activations, ``(phase, kind, group, bytes)``, bytes as
    `fsdp2kit.count_collectives` counts them: tensor parallelism's from the model's own plan (a rowwise or
    vocabulary-parallel module all-reduces its output in forward, a colwise one its input's gradient in backward,
    a gathered head all-gathers its output) and context parallelism's, by ``s.cp_style`` (docs/step_time.md).
    ``unit_names`` name ``trained``'s modules (the model as trained: a LoRA model's blocks are under its peft
    wrapper's names), ``model`` itself if not given."""
    from fsdp2kit.blocks import find_blocks
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
    trained = model if trained is None else trained
    names_of = {id(m): n for n, m in trained.named_modules()}
    for block in find_blocks(trained):
        unit = unit_of(names_of[id(block)])
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


def _predict(
    hw: Hardware,
    flops: list[UnitFlops],
    order: list[int],
    comm: CommPlan,
    memory_plan,
    s,
    *,
    nodes: int,
    per_node: int,
    price: float,
    acts: list[list[tuple]] | None = None,
    host: list[tuple[int, int]] | None = None,
) -> StepTime:
    rate = hw.bf16_flops * hw.efficiency
    fwd = [f.forward / rate for f in flops]
    bwd = [f.backward / rate for f in flops]
    compute_s = comm.micro_batches * (sum(fwd) + sum(bwd))
    # Mesh (replicate, shard, tp), tp innermost: a shard group is ``shard`` ranks ``tp`` apart, so it has
    # min(shard, per_node / tp) ranks on a node; a replica group's ranks are shard x tp apart.
    cp = s.cp
    block = s.shard * cp * s.tp

    sizes = {**comm.group_sizes, "tp": s.tp, "cp": cp}

    def link(group: str) -> tuple[float, float, float]:
        """(seconds a byte on the wire, latency, wire bytes a buffer byte) of a collective over ``group``."""
        n = sizes.get(group, 1)
        # "shard", "shard/K" (a reshard-to-K gather: K consecutive shard ranks), NO_SHARD's "shard" and "cp" are
        # tp apart; "tp" is innermost
        if group == "replicate":
            in_node = max(1, min(n, per_node // block))
        else:
            in_node = min(n, per_node) if group == "tp" else min(n, max(1, per_node // s.tp))
        byte_s, lat = link_seconds(hw, group=n, per_node_in_group=in_node, per_node=per_node)
        return byte_s, lat, (n - 1) / n if n > 1 else 0.0

    def seconds(c) -> float:
        byte_s, lat, wire = link(c.group)
        if c.kind == "permute":  # the whole buffer to the next rank (the ring's rotation)
            return c.nbytes * byte_s + lat
        if c.kind == "all_reduce":  # ring: a reduce-scatter then an all-gather
            return c.nbytes * 2 * wire * byte_s + 2 * lat
        return c.nbytes * wire * byte_s + lat

    # Activations' collectives block the compute that needs their result: they lengthen the unit's compute.
    # Recompute (in backward) repeats the forward ones but a block's last all-reduce: checkpoint stops once
    # what backward needs exists, and the block's output is not among it.
    act_bytes = act_s = 0.0
    for i, unit in enumerate(acts or []):
        last = max((k for k, a in enumerate(unit) if a[0] == "forward"), default=-1)
        for k, (phase, kind, group, nbytes) in enumerate(unit):
            t = seconds(Collective(kind, group, nbytes, "", 1, phase))
            n = 1 + (phase == "forward" and flops[i].recompute > 0 and not (k == last and kind == "all_reduce"))
            (fwd if phase == "forward" else bwd)[i] += t
            bwd[i] += (n - 1) * t
            act_bytes += n * nbytes
            act_s += n * t

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
                # With cpu_offload each all-gather first copies the unit's shards to the GPU, each reduction
                # copies its gradient shards back, on the same queue.
                h2d, d2h = host[i] if host else (0, 0)
                if c.kind == "all_gather":
                    (ag if c.phase == "forward" else ag_bwd)[i] += seconds(c) + h2d / hw.host_bytes_per_s
                else:
                    after[i] += seconds(c) + (d2h / hw.host_bytes_per_s if c.kind == "reduce_scatter" else 0.0)
        _, end = simulate(order, order[0], fwd, bwd, ag, ag_bwd, after, s.prefetch)
        end_all += end
    # The optimizer step reads and writes the sharded parameters, gradients and state once: HBM-bound.
    opt_bytes = 2 * (memory_plan.param_bytes + memory_plan.grad_bytes + memory_plan.optimizer_bytes)
    optimizer_s = 0.0 if s.cpu_offload else opt_bytes / hw.hbm_bytes_per_s
    if s.optimizer_offload:  # each trainable parameter and its gradient to the host, the updated parameter back
        moved = 2 * memory_plan.trainable_param_bytes + memory_plan.grad_bytes
        optimizer_s = moved / hw.host_bytes_per_s
    comm_s = sum(c.count * seconds(c) for u in comm.units for c in u.collectives) + m * act_s
    notes = []
    if s.cpu_offload or s.optimizer_offload:
        notes.append("offload: host transfers modelled, the CPU optimizer step not: a lower bound")
    return StepTime(
        hardware=hw,
        nodes=nodes,
        world=s.replicate * s.shard * cp * s.tp,
        tokens_per_step_per_gpu=m * s.batch * s.seq / (s.tp * cp),
        compute_s=compute_s,
        exposed_comm_s=end_all - compute_s,
        optimizer_s=optimizer_s,
        step_s=end_all + optimizer_s,
        model_flops=m * sum(f.model for f in flops),
        comm_bytes=comm.bytes_per_step + int(m * act_bytes),
        comm_s=comm_s,
        price_per_gpu_hour=price,
        notes=notes,
    )
