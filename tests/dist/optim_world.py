"""Rank-side code for test_optim.py: every `make_optimizer` choice on FSDP2's DTensor shards.

The model is a few 128 x 128 Linear layers: at world 2 each weight's shard is 64 rows = 8192
elements, at least torchao's 4096 and a multiple of its blocks (256, 4-bit 128), so the low-bit
state really is quantized, and the shard boundary falls on a block boundary: every block of a
shard is a block of the unsharded tensor. The biases (128 elements) keep full-precision state.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from optim_memory import step_rise
from torch.distributed.tensor import DTensor

import fsdp2kit as fk
from fsdp2kit._internal.dtensor import gather_full
from fsdp2kit.planner.live import tensor_storages

DIM, BATCH, STEPS, LR = 128, 4, 4, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + F.gelu(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _global_batch(step: int):
    xs, ys = zip(*(_batch(r, step) for r in range(dist.get_world_size())))
    return torch.cat(xs), torch.cat(ys)


def _loss(model, x, y, dtype):
    return F.mse_loss(model(x.to(dtype)).float(), y)


def _precision(name: str) -> tuple[str | None, torch.dtype]:
    return ("pure_bf16", torch.bfloat16) if name == "adamw_bf16sr" else (None, torch.float32)


def _sharded(name: str, mesh, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    mp, _ = _precision(name)
    fk.shard_model(model, mesh, mixed_precision=mp)
    return model, fk.make_optimizer(model, name, lr=LR, weight_decay=0.1)


def _step(model, opt, x, y, dtype) -> float:
    loss = _loss(model, x, y, dtype)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: gather_full(p).float() for n, p in model.named_parameters()}


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _mean_diff(a: dict, b: dict) -> float:
    return sum((a[k] - b[k]).abs().sum().item() for k in a) / sum(v.numel() for v in a.values())


def _noise(name: str, ref_end: dict) -> dict:
    """The single-process run's own noise: the same run with each batch's rows permuted (the same mean
    loss, summed in another order, as a sharded run's reduce-scatter does) and, for the stochastic
    rounding, other random draws."""
    _, dtype = _precision(name)
    torch.manual_seed(0)
    ref = Net().to(dtype)
    opt = fk.make_optimizer(ref, name, lr=LR, weight_decay=0.1)
    torch.manual_seed(12345)
    for step in range(STEPS):
        x, y = _global_batch(step)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))
        _step(ref, opt, x[perm], y[perm], dtype)
    end = {k: v.float() for k, v in ref.named_parameters()}
    return {"max": _diff(end, ref_end), "mean": _mean_diff(end, ref_end)}


def parity(name: str) -> dict:
    """Sharded (world N) vs one process on the concatenated batch, same optimizer, same init."""
    rank = dist.get_rank()
    _, dtype = _precision(name)
    torch.manual_seed(0)
    ref = Net().to(dtype)
    ref_opt = fk.make_optimizer(ref, name, lr=LR, weight_decay=0.1)
    model, opt = _sharded(name, fk.make_mesh())
    start = _full(model)
    start_diff = _diff(start, {k: v.float() for k, v in ref.named_parameters()})
    sharded_losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        ref_losses.append(_step(ref, ref_opt, x, y, dtype))
        xl, yl = _batch(rank, step)
        local = _loss(model, xl, yl, dtype)
        local.backward()
        if step == STEPS - 1:  # the step compiled: what it allocates above the state (the planner's temporaries)
            rise = step_rise(opt)
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        t = local.detach().clone()
        dist.all_reduce(t)
        sharded_losses.append(t.item() / dist.get_world_size())
    weight = model.blocks[0].lin.weight
    st = opt.state[weight]
    end, ref_end = _full(model), {k: v.float() for k, v in ref.named_parameters()}
    noise = _noise(name, ref_end)
    return {
        "start_diff": start_diff,
        "param_diff": _diff(end, ref_end),
        "param_mean_diff": _mean_diff(end, ref_end),
        "noise": noise,
        "moved": _diff(_full(model), start),
        "loss_diff": max(abs(a - b) for a, b in zip(sharded_losses, ref_losses)),
        "state_types": sorted(
            {type(v._local_tensor if hasattr(v, "_local_tensor") else v).__name__ for v in st.values()}
        ),
        "param_dtype": str(weight.dtype),
        "step_rise": rise,
    }


def resume(name: str, root: str) -> dict:
    """Save at world 2 (shard 2) after 2 steps, continue 2 steps; load at replicate 2 x shard 1 (every
    rank the whole tensor, as one process has it) and at shard 2 again, and continue 2 steps each."""
    rank = dist.get_rank()
    _, dtype = _precision(name)
    ck = fk.Checkpointer(f"{root}/{name}", keep_last=None)
    model, opt = _sharded(name, fk.make_mesh())
    for step in range(2):
        _step(model, opt, *_batch(rank, step), dtype)
    ck.save(2, model, optimizer=opt)
    out = {"saved": _state_summary(opt, model)}  # what reshard_hop's chain starts from
    losses = [_step(model, opt, *_batch(rank, step), dtype) for step in (2, 3)]
    end = _full(model)
    for label, mesh in (("same_mesh", fk.make_mesh()), ("replicated", fk.make_mesh(shard=1, replicate=2))):
        other, other_opt = _sharded(name, mesh, seed=1)  # another init: everything must come from the checkpoint
        assert ck.load(other, optimizer=other_opt) == 2
        # the same batches as the uninterrupted run: rank r's batch, whatever the mesh
        again = [_step(other, other_opt, *_batch(rank, step), dtype) for step in (2, 3)]
        local = other_opt.state[other.blocks[0].lin.weight]["exp_avg"]
        out[label] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, again)),
            "param_diff": _diff(end, _full(other)),
            "local_numel": getattr(local, "_local_tensor", local).numel(),
        }
    ck.close()
    return out


def odd_model() -> nn.Module:
    return nn.Sequential(nn.Linear(160, 40), nn.Linear(40, 160))


def odd_rows() -> dict[str, dict]:
    """Weights whose shards torchao alone would keep in fp32 (3200 local elements < 4096): 40 x 160
    (rows of 160) and 160 x 40 (rows of 40). Per low-bit optimizer: each weight state's class, block
    and local numel, and the bytes of every parameter's two states on this rank."""
    torch.manual_seed(0)
    model = odd_model()
    fk.shard_model(model, fk.make_mesh())
    out = {}
    for name in ("adamw8bit", "adamw4bit", "adamw_fp8"):
        opt = fk.make_optimizer(model, name, lr=1e-3)
        # the states the first step would allocate
        states = {p: [opt._new_buffer(p, signed)._local_tensor for signed in (True, False)] for p in model.parameters()}
        kinds = [(type(st[0]).__name__, getattr(st[0], "block_size", None), st[0].numel()) for st in states.values()]
        nbytes = sum(
            s.nbytes() for st in states.values() for t in st for s in {id(s): s for s in tensor_storages(t)}.values()
        )
        out[name] = {"weights": kinds[::2], "bytes": nbytes}
    return out


def errors() -> dict:
    """What make_optimizer refuses, with the message."""
    out = {}
    model, _ = _sharded("adamw", fk.make_mesh())  # fp32 masters
    for label, call in {
        "bf16sr_fp32": lambda: fk.make_optimizer(model, "adamw_bf16sr", lr=1e-3),
        "unknown": lambda: fk.make_optimizer(model, "lion", lr=1e-3),
        "offload": lambda: fk.make_optimizer(model, "adamw", lr=1e-3, offload=True),  # CPU parameters
        "offload_low_bit": lambda: fk.make_optimizer(model, "adamw8bit", lr=1e-3, offload=True),
    }.items():
        try:
            call()
            out[label] = None
        except (ValueError, NotImplementedError) as e:
            out[label] = f"{type(e).__name__}: {e}"
    frozen = copy.deepcopy(Net())
    for p in frozen.blocks.parameters():
        p.requires_grad_(False)
    out["trainable_only"] = len(fk.make_optimizer(frozen, "adamw8bit", lr=1e-3).param_groups[0]["params"])
    return out


def offloaded(root: str) -> dict:
    """OffloadedAdamW's update and checkpoint on CPU ranks (host buffers unpinned: make_optimizer builds
    it for CUDA parameters only): against torch's AdamW step by step, and a save loaded into a plain
    AdamW on the 2 x 1 mesh and into an OffloadedAdamW on the same mesh."""
    from fsdp2kit.optim_offload import OffloadedAdamW

    rank = dist.get_rank()
    model, plain = _sharded("adamw", fk.make_mesh())
    torch.manual_seed(0)
    other = Net()
    fk.shard_model(other, fk.make_mesh())
    off = OffloadedAdamW(other.parameters(), lr=LR, weight_decay=0.1)
    for step in range(2):
        _step(model, plain, *_batch(rank, step), torch.float32)
        _step(other, off, *_batch(rank, step), torch.float32)
    out = {
        "param_diff": _diff(_full(model), _full(other)),
        "state_device": str(off.state[other.head.weight]["exp_avg"].to_local().device),
    }
    ck = fk.Checkpointer(f"{root}/offloaded", keep_last=None)
    ck.save(2, other, optimizer=off)
    for _ in range(1):
        _step(other, off, *_batch(rank, 2), torch.float32)
    end = _full(other)
    for label, mesh, kind in (
        ("into_adamw_2x1", fk.make_mesh(shard=1, replicate=2), "adamw"),
        ("into_offloaded", fk.make_mesh(), "offloaded"),
    ):
        again, _ = _sharded("adamw", mesh, seed=1)
        opt = (
            fk.make_optimizer(again, "adamw", lr=LR, weight_decay=0.1)
            if kind == "adamw"
            else OffloadedAdamW(again.parameters(), lr=LR, weight_decay=0.1)
        )
        if kind == "adamw":  # CPU shards on a CPU mesh: torch's own choice of kernel, not make_optimizer's fused
            out["fused_on_a_cpu_mesh"] = opt.defaults["fused"]
        assert ck.load(again, optimizer=opt) == 2
        _step(again, opt, *_batch(rank, 2), torch.float32)
        out[label] = _diff(end, _full(again))
    ck.close()
    out["between"] = {m: _offload_vs_adamw(rank, m) for m in ("plain", "clip", "foreach_clip", "no_sync", "twice")}
    return out


def _offload_vs_adamw(rank: int, mode: str) -> dict:
    """2 steps of torch's AdamW and of OffloadedAdamW from the same init: each backward whole ("plain"), then
    fsdp2kit's clip_grad_norm_ ("clip") or torch's with foreach=True ("foreach_clip": its in-place scaling of
    DTensor gradients moves no version counter), two half batches under no_sync then synced ("no_sync"), or
    both synced ("twice"). The largest parameter difference and the norms clipped."""
    from contextlib import nullcontext

    from fsdp2kit.optim_offload import OffloadedAdamW

    ends, norms = [], []
    for kind in ("adamw", "offloaded"):
        torch.manual_seed(0)
        model = Net()
        fk.shard_model(model, fk.make_mesh())
        opt = (OffloadedAdamW if kind == "offloaded" else torch.optim.AdamW)(
            model.parameters(), lr=LR, weight_decay=0.1
        )
        for step in range(2):
            x, y = _batch(rank, step)
            if mode in ("no_sync", "twice"):
                with fk.no_sync(model) if mode == "no_sync" else nullcontext():
                    _loss(model, x[:2], y[:2], torch.float32).backward()
                x, y = x[2:], y[2:]
            _loss(model, x, y, torch.float32).backward()
            if mode == "clip":
                norms.append(fk.clip_grad_norm_(model.parameters(), max_norm=0.05).item())
            if mode == "foreach_clip":
                norms.append(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True).full_tensor().item()
                )
            opt.step()
            opt.zero_grad(set_to_none=True)
        ends.append(_full(model))
    return {"diff": _diff(*ends), "norms": norms}


def run_cases(root: str, names: tuple[str, ...]) -> dict:
    out = {"errors": errors(), "odd_rows": odd_rows(), "offloaded": offloaded(root)}
    for name in names:
        out[name] = {"parity": parity(name), "resume": resume(name, root)}
    mesh = tuple(n for n in names if n != "adamw_bf16sr")  # stochastic rounding: other draws on other shapes
    one = mesh_states(mesh, sharded=False) if dist.get_rank() == 0 else None  # no collective inside
    out["mesh"] = {"world": mesh_states(mesh), "one": one}
    out["tp"] = tp_states()
    return out


MESH_ROWS, MESH_STEPS = 6, 3  # a global batch every world of 1, 2 and 3 splits evenly


def _mesh_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(MESH_ROWS, DIM, generator=g), torch.randn(MESH_ROWS, DIM, generator=g)


def _state_summary(opt, model) -> dict:
    """Per parameter and state: the local tensor's class, its block, and the whole state dequantized
    (gathered over the mesh: rows in order, replicas once); each parameter whole too. Classes and
    blocks are this rank's."""
    out = {}
    for fqn, p in model.named_parameters():
        out[f"{fqn}.param"] = {"type": "param", "block": None, "value": _full_value(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            v = opt.state[p][key]
            local = v._local_tensor if isinstance(v, DTensor) else v
            value = local.dequantize() if hasattr(local, "dequantize") else local.float()
            if isinstance(v, DTensor):
                value = DTensor.from_local(
                    value.reshape(local.shape), v.device_mesh, v.placements, shape=v.shape, stride=v.stride()
                )
            out[f"{fqn}.{key}"] = {
                "type": type(local).__name__,
                "block": getattr(local, "block_size", None),
                "value": _full_value(value),
            }
    return out


def _full_value(t: torch.Tensor):
    # a numpy array: a tensor would not outlive the rank's process on the way back to the test
    return (gather_full(t) if isinstance(t, DTensor) else t).detach().float().clone().numpy()


def mesh_states(names: tuple[str, ...], sharded: bool = True) -> dict:
    """Each optimizer's state after MESH_STEPS steps on the same global batches, every rank taking its
    rows: on this world's FSDP2 mesh, or (``sharded=False``) one process with the whole batch."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    rows = MESH_ROWS // world
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = Net()
        if sharded:
            fk.shard_model(model, fk.make_mesh())
        opt = fk.make_optimizer(model, name, lr=LR, weight_decay=0.1)
        for step in range(MESH_STEPS):
            x, y = _mesh_batch(step)
            _step(model, opt, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows], torch.float32)
        out[name] = _state_summary(opt, model)
    return out


def reshard_hop(src: str, dst: str | None, names: tuple[str, ...], shape: tuple[int, ...] = ()) -> dict:
    """Load each optimizer's newest checkpoint under ``src/<name>`` into a fresh model (another init)
    on this world's mesh (``shape``: make_mesh's shard, replicate), describe what was loaded, and save
    it unchanged under ``dst/<name>`` for the next hop of a chain (2 -> 3 -> 1 ranks, 2x2 -> 4)."""
    mesh = fk.make_mesh(*shape)
    out = {}
    for name in names:
        model, opt = _sharded(name, mesh, seed=1)
        step = fk.Checkpointer(f"{src}/{name}", keep_last=None).load(model, optimizer=opt)
        out[name] = _state_summary(opt, model)
        if dst is not None:
            with fk.Checkpointer(f"{dst}/{name}", keep_last=None) as ck:
                ck.save(step + 1, model, optimizer=opt)
    return out


def hsdp_to_flat(root: str, names: tuple[str, ...]) -> dict:
    """World 4: train 2 steps on a 2 x 2 HSDP mesh and save; load into a 1-D mesh of 4 (reshard_hop)."""
    rank = dist.get_rank()
    saved = {}
    for name in names:
        model, opt = _sharded(name, fk.make_mesh(shard=2, replicate=2))
        for step in range(2):
            _step(model, opt, *_batch(rank, step), _precision(name)[1])
        with fk.Checkpointer(f"{root}/{name}", keep_last=None) as ck:
            ck.save(2, model, optimizer=opt)
        saved[name] = _state_summary(opt, model)
    return {"saved": saved, "loaded": reshard_hop(root, None, names, (4, 1))}


def world3_cases(root: str, mesh_names: tuple[str, ...], hop_names: tuple[str, ...]) -> dict:
    """World 3's spawn: the mesh-independence states, and the 2 -> 3 hop of the reshard chain."""
    return {"mesh": mesh_states(mesh_names), "hop": reshard_hop(root, f"{root}/w3", hop_names)}


def tp_states(name: str = "adamw4bit") -> dict:
    """A 128 x 256 Linear split row-wise over tp=2 (weight Shard(1): 128-element local rows, a multiple of
    4-bit's block of 128) and in one process, the same 3 steps on the same batches: each one's state summary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    out = {}
    for label in ("tp", "one"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2 * DIM, DIM))
        if label == "tp":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
            parallelize_module(model, mesh, {"0": RowwiseParallel(input_layouts=Replicate())})
        elif dist.get_rank() != 0:
            break
        opt = fk.make_optimizer(model, name, lr=LR, weight_decay=0.1)
        for step in range(MESH_STEPS):
            g = torch.Generator().manual_seed(700 + step)
            x, y = torch.randn(BATCH, 2 * DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
            _step(model, opt, x, y, torch.float32)
        out[label] = _state_summary(opt, model)
        out[f"{label}_placements"] = [str(p.placements) for p in model.parameters() if isinstance(p, DTensor)]
    return out
