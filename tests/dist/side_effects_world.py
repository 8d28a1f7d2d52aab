"""Every public call of fsdp2kit that runs in a world of two, each between two `side_effects.snapshot()`s.

Run inside `run_world` ranks. The models are the user's (built, seeded, trained by the test); only
the fsdp2kit call itself is between the snapshots. Each rank starts from its own seeds, so a call
that overwrote one rank's random state with another's shows up as a difference too.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from models import TinyGPT, lm_loss, tiny_llama
from side_effects import differences, snapshot

import fsdp2kit as fk

# Every call checked, in order; the test asserts each one separately (names are stable ids).
CALLS = [
    "init_distributed (again)", "make_mesh", "find_blocks", "estimate_plan", "plan_memory",
    "apply_activation_checkpointing", "compile_blocks", "enable_float8", "shard_model", "make_optimizer",
    "shard_model(bf16)",
    "set_prefetch", "materialize", "no_sync", "clip_grad_norm_", "check_finite", "RankMonitor", "StopSignal",
    "Checkpointer.save", "Checkpointer.load", "Checkpointer.save(async)", "Checkpointer.save(async) in flight",
    "Checkpointer.wait", "Checkpointer.load(after async)", "dcp_to_hf", "export_hf", "load_pretrained",
    "apply_tensor_parallel", "quantize_nf4", "apply_lora", "export_hf(peft)", "load_full_state_dict",
    "load_fsdp1_checkpoint", "convert_config",
]  # fmt: skip

ACCELERATE_YAML = """\
distributed_type: FSDP
mixed_precision: bf16
num_processes: 2
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def _seed_per_rank() -> None:
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    random.seed(2000 + rank)
    np.random.seed(3000 + rank)


def _warm_up() -> None:
    """What a user's process has done before its first fsdp2kit call: transformers imported and a model
    built (transformers adds nn.Module.smart_apply on its first init; torchao gets imported), compile."""
    import torch._dynamo
    import transformers.integrations.moe
    import transformers.masking_utils  # noqa: F401

    lm_loss(tiny_llama(), torch.zeros(1, 4, dtype=torch.long)).backward()
    torch.compile(lambda x: x + 1)  # imports inductor (its loggers, its atexit) without compiling


def _tokens(n: int = 9) -> torch.Tensor:
    return torch.randint(0, 96, (2, n), generator=torch.Generator().manual_seed(dist.get_rank()))


def run(root: str) -> dict[str, list[str]]:
    root = Path(root)
    rank = dist.get_rank()
    _warm_up()
    _seed_per_rank()
    found: dict[str, list[str]] = {}

    def check(name: str, fn: Callable):
        assert name in CALLS and name not in found, name
        before = snapshot()
        out = fn()
        found[name] = differences(before, snapshot())
        return out

    check("init_distributed (again)", fk.init_distributed)
    mesh = check("make_mesh", fk.make_mesh)
    model = TinyGPT()
    check("find_blocks", lambda: fk.find_blocks(model))
    with torch.device("meta"):
        planned = tiny_llama()
    check("estimate_plan", lambda: fk.estimate_plan(planned, shard=2))
    check("plan_memory", lambda: fk.plan_memory(planned, shard=2, batch=1, seq=16, activation_checkpointing="full"))

    # Wrappers, sharding, a fresh init and a training step, as a loop does them.
    check("apply_activation_checkpointing", lambda: fk.apply_activation_checkpointing(model, mode="selective"))
    to_compile, to_float8 = TinyGPT(), TinyGPT(dim=32)
    check("compile_blocks", lambda: fk.compile_blocks(to_compile))  # compiled lazily: nothing runs here
    check("enable_float8", lambda: fk.enable_float8(to_float8))
    check("shard_model", lambda: fk.shard_model(model, mesh))
    check("make_optimizer", lambda: fk.make_optimizer(model, "adamw8bit", lr=1e-3))  # imports torchao: nothing new
    with torch.device("meta"):
        meta = tiny_llama()
    check("shard_model(bf16)", lambda: fk.shard_model(meta, mesh, mixed_precision="bf16"))
    check("set_prefetch", lambda: fk.set_prefetch(meta, forward=1, backward=1))
    check("materialize", lambda: fk.materialize(meta))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def accumulate():
        with fk.no_sync(model):
            lm_loss(model, _tokens()).backward()

    check("no_sync", accumulate)
    loss = lm_loss(model, _tokens())
    loss.backward()
    norm = check("clip_grad_norm_", lambda: fk.clip_grad_norm_(model.parameters(), max_norm=1.0))
    check("check_finite", lambda: fk.check_finite(model, step=0, loss=loss, grad_norm=norm))

    def monitor():
        mon = fk.RankMonitor(model, check_every=1, timeout=60)
        mon.step(0)
        with mon.guard():
            mon.micro_step(0, _tokens())
            mon.step_end()
        mon.close()

    check("RankMonitor", monitor)

    def stop_signal():
        with fk.StopSignal() as stop:  # the default signals: SIGTERM, SIGUSR1 and SIGINT
            stop.should_stop()

    check("StopSignal", stop_signal)
    opt.step()

    # Checkpoints, synchronous and asynchronous. The RNG is saved and restored on load (rng=True):
    # reseeded alike before the save and the load, the restore must leave it exactly as it was.
    ck = fk.Checkpointer(root / "ckpt", keep_last=3)
    _seed_per_rank()
    check("Checkpointer.save", lambda: ck.save(1, model, optimizer=opt, extra={"note": "x"}))
    _seed_per_rank()
    check("Checkpointer.load", lambda: ck.load(model, optimizer=opt))
    big = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))  # 32 MB: the write takes a while
    fk.shard_model(big, mesh)
    ack = fk.Checkpointer(root / "async", async_save=True)
    _seed_per_rank()
    check("Checkpointer.save(async)", lambda: ack.save(1, big))
    # While the save is written in the background, the caller's process must be as it was too.
    before = snapshot()
    seen: set[str] = set()
    while ack._pending is not None and not ack._pending[1].done():
        seen.update(differences(before, snapshot()))
        time.sleep(0.001)
    found["Checkpointer.save(async) in flight"] = sorted(seen)
    check("Checkpointer.wait", ack.wait)
    _seed_per_rank()
    check("Checkpointer.load(after async)", lambda: ack.load(big))
    ack.close()

    # Hugging Face weights: from a checkpoint, export, load into a meta-built model, tensor parallelism, QLoRA.
    llama = tiny_llama()
    fk.shard_model(llama, mesh)
    with fk.Checkpointer(root / "llama_ckpt") as lck:
        lck.save(1, llama)
    step_dir = root / "llama_ckpt" / "step_00000001"
    check("dcp_to_hf", lambda: fk.dcp_to_hf(step_dir, root / f"from_dcp{rank}", config=llama.config))
    check("export_hf", lambda: fk.export_hf(llama, root / "hf"))
    with torch.device("meta"):
        loaded = tiny_llama()
    fk.shard_model(loaded, mesh)
    check("load_pretrained", lambda: fk.load_pretrained(loaded, root / "hf"))
    tp_mesh = fk.make_mesh(shard=1, tp=2)
    tp_model = tiny_llama()
    check("apply_tensor_parallel", lambda: fk.apply_tensor_parallel(tp_model, tp_mesh))
    torch.manual_seed(0)
    base, twin = (tiny_llama(hidden=64, intermediate=128).to(torch.bfloat16) for _ in range(2))
    check("quantize_nf4", lambda: fk.quantize_nf4(base, block_size=32, scaler_block_size=8))
    fk.quantize_nf4(twin, block_size=32, scaler_block_size=8)
    # apply_lora is peft's get_peft_model: the adapters are drawn from the caller's stream as peft draws
    # them (a module construction, like the base's). Anything else it changed is a side effect.
    from peft import LoraConfig, get_peft_model

    _seed_per_rank()
    get_peft_model(twin, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    drawn_by_peft = torch.get_rng_state()
    _seed_per_rank()
    peft_model = check("apply_lora", lambda: fk.apply_lora(base, r=4, targets=["q_proj", "v_proj"]))
    if torch.equal(torch.get_rng_state(), drawn_by_peft):
        found["apply_lora"] = [d for d in found["apply_lora"] if not d.startswith("torch CPU RNG state")]
    fk.shard_model(peft_model, mesh)
    check("export_hf(peft)", lambda: fk.export_hf(peft_model, root / "adapter"))

    # Checkpoints of other tools: a consolidated state dict, and FSDP1 / Accelerate's sharded DCP layout.
    source = TinyGPT()
    if rank == 0:
        torch.save(source.state_dict(), root / "full.pt")
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": source.state_dict()}, checkpoint_id=root / "fsdp1" / "pytorch_model_fsdp_0")
    dist.barrier()
    target = TinyGPT()
    fk.shard_model(target, mesh)
    check("load_full_state_dict", lambda: fk.load_full_state_dict(target, root / "full.pt"))
    check("load_fsdp1_checkpoint", lambda: fk.load_fsdp1_checkpoint(target, root / "fsdp1"))
    (root / f"accelerate{rank}.yaml").write_text(ACCELERATE_YAML)
    check("convert_config", lambda: fk.convert_config(root / f"accelerate{rank}.yaml"))
    with contextlib.suppress(Exception):
        ck.close()
    assert sorted(found) == sorted(CALLS), set(CALLS) ^ set(found)
    return found
