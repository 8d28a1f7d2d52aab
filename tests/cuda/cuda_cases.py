"""The CUDA cases, run inside `run_world(..., device="cuda")` ranks: each returns plain CPU values.

Every case builds its models from the tiny configs in tests/models.py and compares with a
reference computed on the same GPU: an unsharded model trained in one process on the
concatenation of every rank's batch (fp32, TF32 off), or a model loaded by transformers itself.
The cases take their device from `init_distributed`, so they also run on CPU ranks, which is how
they were checked on a machine without a GPU (`run_all(..., device="cpu")`).
"""

from __future__ import annotations

import copy
import math
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from models import build, lm_loss, tiny_llama

import fsdp2kit as fk

VOCAB, BATCH = 96, 2
# 2 x 16 = 32 tokens per rank: float8's weight-gradient matmul contracts over the tokens, and
# torch._scaled_mm on CUDA needs every contracted dimension divisible by 16.
SEQ = 16
STEPS = 3


def _info():
    return fk.init_distributed()  # already started by run_world: returns the rank's device


def _batches(world: int, steps: int = STEPS, seed: int = 1234) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def _train_sharded(model: nn.Module, opt, batches: list[torch.Tensor], device: torch.device) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for tokens in batches:
        loss = lm_loss(model, tokens[rank * BATCH : (rank + 1) * BATCH].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _train_ref(model: nn.Module, opt, batches: list[torch.Tensor], device: torch.device) -> list[float]:
    losses = []
    for tokens in batches:
        loss = lm_loss(model, tokens.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full fp32 CPU tensor (gathering DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().cpu().clone()  # a copy even where .cpu() is a no-op
    return out


def _compare(start: dict, got: dict, want: dict) -> dict:
    """Worst relative parameter difference, and how the two runs' updates compare."""
    worst = max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item() for n in want)
    d_got = torch.cat([(got[n] - start[n]).flatten() for n in want])
    d_want = torch.cat([(want[n] - start[n]).flatten() for n in want])
    return {
        "worst_rel": worst,
        "update_rel": ((d_got - d_want).norm() / d_want.norm().clamp_min(1e-30)).item(),
        "update_cos": torch.nn.functional.cosine_similarity(d_got, d_want, dim=0).item(),
    }


def _exp_avg(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["exp_avg"].full_tensor().cpu() for n, p in model.named_parameters()}


def _loss_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---- the cases --------------------------------------------------------------------------------


def case_nccl() -> dict:
    """The group init_distributed starts on CUDA: NCCL for device tensors, gloo for CPU ones."""
    info = _info()
    rank, world = dist.get_rank(), dist.get_world_size()
    on_device = torch.full((4,), float(rank + 1), device=info.device)
    dist.all_reduce(on_device)
    on_cpu = torch.full((4,), float(rank + 1))
    dist.all_reduce(on_cpu)
    mesh = fk.make_mesh()
    return {
        "backend": info.backend,
        "device": str(info.device),
        "current_device": torch.cuda.current_device() if info.device.type == "cuda" else None,
        "local_rank": info.local_rank,
        "sum_device": on_device.cpu().tolist(),
        "sum_cpu": on_cpu.tolist(),
        "expected": [world * (world + 1) / 2] * 4,
        "mesh_device_type": mesh.device_type,
    }


def case_bf16_parity() -> dict:
    """bf16 compute (fp32 master weights and reduction) against the fp32 reference."""
    info = _info()
    out = {}
    for optim in ("sgd", "adamw"):
        ref = build("llama").to(info.device)
        model = copy.deepcopy(ref)
        start = _full(ref)
        fk.shard_model(model, fk.make_mesh(), mixed_precision="bf16")
        batches = _batches(dist.get_world_size())
        losses = _train_sharded(model, _optimizer(optim, model.parameters()), batches, info.device)
        ref_losses = _train_ref(ref, _optimizer(optim, ref.parameters()), batches, info.device)
        dtypes = {str(p.dtype) for p in model.parameters()}
        out[optim] = {
            "loss_rel": _loss_rel(losses, ref_losses),
            "losses": losses,
            "ref_losses": ref_losses,
            "master_dtypes": sorted(dtypes),
            **_compare(start, _full(model), _full(ref)),
        }
    return out


def case_float8() -> dict:
    """float8 matmuls with float8 all-gather against plain bf16, from the same weights and data."""
    info = _info()
    if info.device.type == "cuda" and torch.cuda.get_device_capability(info.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(info.device)
        return {
            "skip": f"float8 matmuls need compute capability 8.9 or newer (H100, L40S, 4090): this is {major}.{minor}",
        }
    from torchao.float8.float8_linear import Float8Linear

    base = build("llama-f8").to(info.device)
    start = _full(base)
    batches = _batches(dist.get_world_size())
    runs = {}
    for name in ("bf16", "float8"):
        model = copy.deepcopy(base)
        if name == "float8":
            fk.enable_float8(model, fsdp_all_gather=True)
        fk.shard_model(model, fk.make_mesh(), mixed_precision="bf16")
        losses = _train_sharded(model, _optimizer("adamw", model.parameters()), batches, info.device)
        runs[name] = (losses, _full(model), model)
    f8_model = runs["float8"][2]
    layers = [m for m in f8_model.modules() if isinstance(m, Float8Linear)]
    local_types = sorted({type(m.weight.to_local()).__name__ for m in layers})
    try:  # 15 tokens: refused before the forward, in words, not by _scaled_mm in the backward
        f8_model(torch.zeros(1, 15, dtype=torch.long, device=info.device))
        odd_tokens_error = None
    except ValueError as e:
        odd_tokens_error = str(e)
    return {
        "odd_tokens_error": odd_tokens_error,
        "float8_layers": len(layers),
        "weight_local_types": local_types,
        "loss_rel": _loss_rel(runs["float8"][0], runs["bf16"][0]),
        "losses": runs["float8"][0],
        "bf16_losses": runs["bf16"][0],
        "finite": all(math.isfinite(x) for x in runs["float8"][0]),
        **_compare(start, runs["float8"][1], runs["bf16"][1]),
    }


def case_cpu_offload() -> dict:
    """Sharded state in (pinned) CPU memory, compute on the GPU, the optimizer step on CPU."""
    info = _info()
    ref = build("llama").to(info.device)
    model = copy.deepcopy(ref).cpu()
    start = _full(ref)
    fk.shard_model(model, fk.make_mesh(), cpu_offload=True)
    locals_ = [p.to_local() for p in model.parameters()]
    placement = {
        "devices": sorted({str(t.device) for t in locals_}),
        "all_pinned": all(t.is_pinned() for t in locals_ if t.numel()),
    }
    batches = _batches(dist.get_world_size())
    opt = fk.make_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1, eps=1e-5)  # as _optimizer's, fused
    losses = _train_sharded(model, opt, batches, info.device)
    ref_losses = _train_ref(ref, _optimizer("adamw", ref.parameters()), batches, info.device)
    grads_on = sorted({str(p.grad.to_local().device) for p in model.parameters() if p.grad is not None})
    return {
        **placement,
        "devices_after": sorted({str(p.to_local().device) for p in model.parameters()}),
        "grad_devices": grads_on,  # zero_grad(set_to_none) leaves none: [] is expected
        "fused": opt.defaults["fused"],  # make_optimizer's fused CPU kernel for host shards on a GPU mesh
        "loss_rel": _loss_rel(losses, ref_losses),
        **_compare(start, _full(model), _full(ref)),
    }


def case_checkpoint(root: str) -> dict:
    """Asynchronous save stages the GPU shards into CPU memory before save() returns."""
    info = _info()
    torch.manual_seed(0)
    batches = _batches(dist.get_world_size(), steps=2)

    def trained(seed: int):
        model = build("llama", seed=seed).to(info.device)
        fk.shard_model(model, fk.make_mesh())
        opt = _optimizer("adamw", model.parameters())
        _train_sharded(model, opt, batches[:1], info.device)
        return model, opt

    model, opt = trained(0)
    saved = _full(model)
    saved_avg = _exp_avg(model, opt)
    with fk.Checkpointer(f"{root}/async", keep_last=1, async_save=True) as ck:
        ck.save(1, model, optimizer=opt)
        # The save is in flight: training goes on and changes every GPU shard in place.
        _train_sharded(model, opt, batches[1:], info.device)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        published = ck.wait()
    changed = _full(model)

    fresh, fresh_opt = trained(7)
    step = fk.Checkpointer(f"{root}/async").load(fresh, optimizer=fresh_opt)
    loaded = _full(fresh)
    loaded_avg = _exp_avg(fresh, fresh_opt)

    # The synchronous path, from GPU memory too, reloaded into the model that went on training.
    sync = fk.Checkpointer(f"{root}/sync", keep_last=1)
    sync.save(2, fresh, optimizer=fresh_opt)
    fk.Checkpointer(f"{root}/sync").load(model, optimizer=opt)
    return {
        "published": published,
        "loaded_step": step,
        "params_equal_saved": all(torch.equal(loaded[n], saved[n]) for n in saved),
        "params_differ_after_save": any(not torch.equal(changed[n], saved[n]) for n in saved),
        "exp_avg_equal": all(torch.equal(loaded_avg[n], saved_avg[n]) for n in saved_avg),
        "loaded_devices": sorted({str(p.to_local().device) for p in fresh.parameters()}),
        "sync_roundtrip_equal": all(torch.equal(a, b) for a, b in zip(_full(model).values(), loaded.values())),
    }


def case_load_pretrained(hf_dir: str) -> dict:
    """A transformers checkpoint read into CUDA shards: logits equal transformers' own load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    info = _info()
    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fk.shard_model(model, fk.make_mesh())
    result = fk.load_pretrained(model, hf_dir)
    # Before the forward: after a forward without backward the root unit stays unsharded.
    devices = sorted({str(p.to_local().device) for p in model.parameters()})
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32).to(info.device)
    tokens = _batches(1, steps=1, seed=5)[0].to(info.device)
    with torch.no_grad():
        got = model(tokens).logits.float()
        want = ref(tokens).logits.float()
    return {
        "rel": ((got - want).abs().max() / want.abs().max()).item(),
        "devices": devices,
        "meta_left": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "tensors": result.tensors,
        "bytes_read": result.bytes_read,
    }


def case_compile() -> dict:
    """Per-block torch.compile: inductor emits Triton kernels on CUDA; training matches eager."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    info = _info()
    inductor_config.force_disable_caches = True  # count kernels generated here, not cache hits
    metrics.reset()
    ref = build("llama").to(info.device)
    model = copy.deepcopy(ref)
    start = _full(ref)
    model.config.use_cache = False
    fk.compile_blocks(model)
    fk.shard_model(model, fk.make_mesh())
    batches = _batches(dist.get_world_size())
    losses = _train_sharded(model, _optimizer("adamw", model.parameters()), batches, info.device)
    ref_losses = _train_ref(ref, _optimizer("adamw", ref.parameters()), batches, info.device)
    from torch.utils._triton import has_triton

    return {
        "has_triton": has_triton(),
        "kernels": metrics.generated_kernel_count,
        "loss_rel": _loss_rel(losses, ref_losses),
        **_compare(start, _full(model), _full(ref)),
    }


def case_low_bit_optimizers() -> dict:
    """make_optimizer's torchao states on the device's shards (quantized, compiled for the GPU), each
    against one process with the same optimizer on the concatenated batch; offload still refused."""
    info = _info()
    out = {}
    for name in ("adamw8bit", "adamw4bit", "adamw_fp8"):
        torch.manual_seed(0)
        ref = tiny_llama(hidden=128, intermediate=256).to(info.device)  # weights of 4096+ elements: quantized
        model = copy.deepcopy(ref)
        start = _full(ref)
        fk.shard_model(model, fk.make_mesh())
        opt = fk.make_optimizer(model, name, lr=1e-3, weight_decay=0.1)
        batches = _batches(dist.get_world_size())
        losses = _train_sharded(model, opt, batches, info.device)
        ref_losses = _train_ref(ref, fk.make_optimizer(ref, name, lr=1e-3, weight_decay=0.1), batches, info.device)
        states = [opt.state[p]["exp_avg"].to_local() for p in model.parameters() if p.dim() >= 2 and p.numel() >= 4096]
        out[name] = {
            "state_types": sorted({type(t).__name__ for t in states}),
            "state_devices": sorted({str(t.device) for t in states}),
            "loss_rel": _loss_rel(losses, ref_losses),
            **_compare(start, _full(model), _full(ref)),
        }
    try:
        fk.make_optimizer(model, "adamw8bit", lr=1e-3, offload=True)
        out["offload"] = None
    except ValueError as e:
        out["offload"] = str(e)
    return out


def case_state_offload() -> dict:
    """make_optimizer(offload=True): parameters and gradients on the GPU, AdamW's state in pinned host
    memory and its update on the CPU; against torch's AdamW on the GPU in one process."""
    info = _info()
    ref = build("llama").to(info.device)
    model = copy.deepcopy(ref)
    start = _full(ref)
    fk.shard_model(model, fk.make_mesh())
    opt = fk.make_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1, eps=1e-5, offload=True)
    batches = _batches(dist.get_world_size())
    losses = _train_sharded(model, opt, batches, info.device)
    ref_losses = _train_ref(ref, _optimizer("adamw", ref.parameters()), batches, info.device)
    states = [opt.state[p][k].to_local() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return {
        "optimizer": type(opt).__name__,
        "state_devices": sorted({str(t.device) for t in states}),
        "state_pinned": all(t.is_pinned() for t in states if t.numel()),
        "param_devices": sorted({str(p.to_local().device) for p in model.parameters()}),
        "loss_rel": _loss_rel(losses, ref_losses),
        **_compare(start, _full(model), _full(ref)),
    }


def case_cp_ring() -> dict:
    """apply_context_parallel(style="ring") (CUDA only): tests/dist/cp_cases.py's parity with one process on the
    whole sequences, one document a row (ring masks causally only), cp 2 with FSDP over the rest."""
    from cp_cases import CPCase, run_parity

    world = dist.get_world_size()
    if world % 2:
        return {"skipped": f"cp 2 needs an even number of GPUs, got {world}"}
    return run_parity(CPCase(model="llama", kernel="sdpa", shard=world // 2, packed=False, style="ring", seq=128))


CASES = {  # the slowest (compiling) last, so that a run cut short still reports the others
    "nccl": lambda root, hf_dir: case_nccl(),
    "bf16": lambda root, hf_dir: case_bf16_parity(),
    "cpu_offload": lambda root, hf_dir: case_cpu_offload(),
    "checkpoint": lambda root, hf_dir: case_checkpoint(root),
    "load_pretrained": lambda root, hf_dir: case_load_pretrained(hf_dir),
    "state_offload": lambda root, hf_dir: case_state_offload(),
    "cp_ring": lambda root, hf_dir: case_cp_ring(),
    "float8": lambda root, hf_dir: case_float8(),
    "low_bit_optimizers": lambda root, hf_dir: case_low_bit_optimizers(),
    "compile": lambda root, hf_dir: case_compile(),
}


def run_all(root: str, hf_dir: str, names: list[str] | None = None) -> dict:
    """Every case in one world (process start-up and NCCL set-up are paid once); a case that
    raises reports its traceback instead of taking the others down with it."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for name in names or list(CASES):
        start = time.perf_counter()
        try:
            out[name] = CASES[name](root, hf_dir)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        if dist.get_rank() == 0:  # progress, for a run cut short by its time limit (pytest -s shows it)
            print(f"[cuda case] {name}: {time.perf_counter() - start:.1f} s {str(out[name])[:300]}", flush=True)
    return out


def save_tiny_llama(path: str) -> None:
    """The checkpoint `case_load_pretrained` reads: a tiny Llama in transformers' own format."""
    torch.manual_seed(3)
    tiny_llama().save_pretrained(path, safe_serialization=True)
