"""Checkpointer and load_pretrained from GPU memory: the I/O cases of benchmarks/gpu_bench.py.

``build(name)`` returns ``(model on the meta device, config)``; every case cleans up its files.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_report import filesystem, free_memory, memory_per_rank, reset_peak, rss_bytes, sync

import fsdp2kit as fk


def checkpoint_case(build, name: str, info, workdir: Path) -> dict:
    """Checkpointer save / load throughput from device memory, and the asynchronous save's stall."""
    device = info.device
    model, config = build(name)
    fk.shard_model(model, fk.make_mesh(), mixed_precision="bf16")
    fk.materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        tokens = torch.randint(0, config.vocab_size, (1, 256), device=device)
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    step()  # the optimizer state exists from here on
    tensors = [
        *model.parameters(),
        *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()),
    ]
    local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)
    free = shutil.disk_usage(workdir).free
    out = {"model": name, "rank_bytes": local, "disk_free": free, "fs": filesystem(workdir)}
    if free < 1.5 * local * dist.get_world_size():
        return {**out, "status": f"skipped: {free / 2**30:.0f} GiB free under {workdir}, too little"}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    ck = fk.Checkpointer(workdir / "sync", keep_last=1)
    out["save_s"] = timed(lambda: ck.save(1, model, optimizer=opt))
    out["load_s"] = timed(lambda: ck.load(model, optimizer=opt))
    shutil.rmtree(workdir / "sync", ignore_errors=True)
    out["plain_step_s"] = min(step() for _ in range(3))
    with fk.Checkpointer(workdir / "async", keep_last=1, async_save=True) as ack:
        for i in (1, 2):  # the first save also allocates the pinned staging buffers; the second reuses them
            stall = timed(lambda i=i: ack.save(i, model, optimizer=opt))
            step_during = step()  # a training step while the write is in flight
            out[f"async_{i}"] = {"stall_s": stall, "step_during_write_s": step_during, "write_s": timed(ack.wait)}
            shutil.rmtree(workdir / "async" / f"step_{i:08d}", ignore_errors=True)  # one checkpoint's disk at a time
    shutil.rmtree(workdir / "async", ignore_errors=True)
    out["status"] = "ok"
    for key in ("save", "load"):
        out[f"{key}_gb_per_s_per_rank"] = local / out[f"{key}_s"] / 1e9
    out["staging_gb_per_s_per_rank"] = local / out["async_2"]["stall_s"] / 1e9
    return out


def load_pretrained_case(build, name: str, info, workdir: Path) -> dict:
    """load_pretrained of a local safetensors checkpoint into GPU shards: time and peaks."""
    device = info.device
    model, _ = build(name)
    fk.shard_model(model, fk.make_mesh())
    fk.materialize(model)
    hf_dir = workdir / "hf"
    start = time.perf_counter()
    fk.export_hf(model, hf_dir, dtype=torch.bfloat16, overwrite=True)
    dist.barrier()
    out = {"model": name, "export_hf_s": time.perf_counter() - start, "file_dtype": "bfloat16"}
    del model
    free_memory()
    fresh, _ = build(name)
    fk.shard_model(fresh, fk.make_mesh())
    rss_before = rss_bytes()
    reset_peak(device)
    start = time.perf_counter()
    result = fk.load_pretrained(fresh, hf_dir)
    sync(device)
    dist.barrier()
    out.update(
        status="ok",
        load_s=time.perf_counter() - start,
        bytes_read_rank0=result.bytes_read,
        tensors=result.tensors,
        memory=memory_per_rank(device),
        rss_growth=rss_bytes() - rss_before,
        fs=filesystem(workdir),
    )
    out["gb_per_s_rank0"] = result.bytes_read / out["load_s"] / 1e9
    shutil.rmtree(hf_dir, ignore_errors=True)
    return out
