"""Should the last block reshard after forward? A/B in one process, steps interleaved.

    torchrun --nproc_per_node=2 benchmarks/reshard_default.py [--hidden 512 --layers 8 --seq 256]

Two copies of the same Llama-style model are sharded identically except for the last block's
reshard_after_forward (fsdp2kit's default keeps it gathered; FSDP2's own default reshards it).
Steps alternate A, B, A, B... so drift in machine speed hits both alike; the median step time
of each and their ratio are printed by rank 0 and written to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fsdp2kit as fk
from fsdp2kit._internal.quiet import quiet_imports


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/reshard_default.json")
    args = p.parse_args()

    info = fk.init_distributed()
    mesh = fk.make_mesh()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
    )
    base = LlamaForCausalLM(cfg).to(info.device)
    models = {"last block kept (fsdp2kit default)": copy.deepcopy(base), "every block resharded": base}
    fk.shard_model(models["last block kept (fsdp2kit default)"], mesh)
    fk.shard_model(models["every block resharded"], mesh, reshard_after_forward=True)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    gen = torch.Generator().manual_seed(info.rank)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(info.device)
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1]).logits
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opts[name].step()
            opts[name].zero_grad()
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    if info.is_main:
        med = {k: statistics.median(v) for k, v in times.items()}
        a, b = med.values()
        result = {
            "machine": f"{platform.node()} {platform.machine()} ({torch.get_num_threads()} threads/rank)",
            "device": info.device.type,
            "world_size": info.world_size,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "args": vars(args),
            "load_average_at_end": os.getloadavg(),
            "median_step_s": med,
            "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
            "speedup_default_over_all_resharded": b / a,
        }
        for k, v in med.items():
            print(f"{k:36s} median step {v * 1e3:8.1f} ms")
        print(f"speed-up of fsdp2kit's default: {b / a:.3f}x")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        main()
