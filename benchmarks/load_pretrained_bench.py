"""Peak memory per rank while loading a Hugging Face checkpoint: load_pretrained vs full-load-then-shard.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/load_pretrained_bench.py [--worlds 2 4] [--dtypes float32 bfloat16]

A Llama-style model of about 340 MB (fp32) is saved with ``save_pretrained`` in 200 MB files.
For each world size, one set of gloo ranks on this machine measures, per rank:

1. fsdp2kit: build on the meta device, `shard_model`, `load_pretrained` (each rank reads its rows);
2. naive: ``from_pretrained`` on every rank (the whole model in every process), then `shard_model`.

What is measured is the resident set's high-water mark (``VmHWM`` in /proc/self/status), reset
just before each phase by writing 5 to /proc/self/clear_refs, minus the resident set at that
moment: the most memory the phase ever had resident on top of what the process already held.
This is the kernel's own exact figure for every allocation (torch's C++ allocator included, which
``tracemalloc`` cannot see, and with no sampling gaps, which polling ``psutil`` would have); it
also counts the checkpoint's page-cache pages while they are mapped into the process, which is
memory the load really touches. The fsdp2kit phase runs first in fresh processes; the naive phase
then starts after ``malloc_trim``, and any freed-but-resident memory it can reuse only makes it
look *better*, so the ratio is if anything understated.

The figure to compare both against is the sharded size: the bytes of this rank's parameter shards.
The checkpoint is saved twice: in fp32 (what the model holds; transformers' from_pretrained then
maps the file and its tensors can stay backed by the page cache, so the naive way only touches
the pages of the rows each rank keeps) and in bf16 (how most published checkpoints are stored;
loading into fp32 master weights converts, so the naive way builds the whole fp32 model on every
rank). Results go to benchmarks/results/load_pretrained.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine as common_machine
from common import reset_rss_peak, rss, rss_peak

HERE = Path(__file__).resolve().parent
CONFIG = dict(
    vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
MB = 1e6


def _phase(fn) -> dict:
    start = reset_rss_peak()
    t0 = time.perf_counter()
    model = fn()
    seconds = time.perf_counter() - t0
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {
        "start_rss": start,
        "peak_rss": rss_peak(),
        "peak_increase": rss_peak() - start,
        "end_increase": rss() - start,
        "shard_bytes": shard,
        "seconds": seconds,
        "model": model,
    }


def measure(hf_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp2kit as fk

    mesh = fk.make_mesh()
    config = LlamaConfig(**CONFIG)
    with torch.device("meta"):  # costs nothing; built before the phase so it counts in neither
        model = LlamaForCausalLM(config)
    fk.shard_model(model, mesh)

    def streamed():
        fk.load_pretrained(model, hf_dir)  # noqa: F821 - bound above; deleted only after use
        return model  # noqa: F821

    def naive():
        full = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        fk.shard_model(full, mesh)
        gc.collect()
        return full

    out = {}
    dist.barrier()
    out["load_pretrained"] = _phase(streamed)
    del model, out["load_pretrained"]["model"]
    dist.barrier()
    out["naive"] = _phase(naive)
    del out["naive"]["model"]
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default: fp32 at 2, bf16 at 2 and 4)")
    parser.add_argument("--dtypes", nargs="+", help="checkpoint dtypes on disk (float32, bfloat16)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp2kit.testing import run_world

    if args.worlds or args.dtypes:
        runs = [(d, w) for d in args.dtypes or ["float32", "bfloat16"] for w in args.worlds or [2, 4]]
    else:  # about two minutes on a 2-core machine; each run is a fresh set of processes
        runs = [("float32", 2), ("bfloat16", 2), ("bfloat16", 4)]
    dtypes = sorted({d for d, _ in runs})
    machine = common_machine()
    machine["uptime_before"] = machine["uptime"]
    results = {"machine": machine, "config": CONFIG, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        n_params = sum(p.numel() for p in model.parameters())
        for dtype in dtypes:
            model.to(getattr(torch, dtype)).save_pretrained(Path(tmp) / dtype, max_shard_size="200MB")
        del model
        files = {d: sorted(p.name for p in (Path(tmp) / d).glob("*.safetensors")) for d in dtypes}
        results["model"] = {"parameters": n_params, "fp32_bytes": n_params * 4, "files": files}
        print(f"model: {n_params / 1e6:.1f}M parameters, {n_params * 4 / MB:.0f} MB fp32, files {files}")
        for dtype, world in runs:
            t0 = time.perf_counter()
            ranks = run_world(measure, world, str(Path(tmp) / dtype), timeout=300)
            results["worlds"][f"{dtype} on disk, world {world}"] = ranks
            print(f"{dtype} checkpoint, world {world} ({time.perf_counter() - t0:.0f}s)")
            for r, res in enumerate(ranks):
                a, b = res["load_pretrained"], res["naive"]
                print(
                    f"  rank {r}: shard {a['shard_bytes'] / MB:.0f} MB | load_pretrained peak "
                    f"+{a['peak_increase'] / MB:.0f} MB ({a['seconds']:.1f}s) | naive peak "
                    f"+{b['peak_increase'] / MB:.0f} MB ({b['seconds']:.1f}s)"
                )
    machine["uptime_after"] = common_machine()["uptime"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_pretrained.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "load_pretrained.md").write_text(_markdown(results))
    print(f"wrote {args.out / 'load_pretrained.json'} and .md")


def _markdown(results: dict) -> str:
    m = results["machine"]
    model = results["model"]
    lines = [
        "# Peak memory per rank during `load_pretrained` vs a naive full load then shard",
        "",
        f"Model: Llama-style, {model['parameters'] / 1e6:.1f}M parameters, {model['fp32_bytes'] / MB:.0f} MB in fp32, "
        "saved by `save_pretrained` with max_shard_size=200MB ("
        + ", ".join(f"{d}: {len(f)} file{'s' if len(f) > 1 else ''}" for d, f in model["files"].items())
        + "); bf16 is the usual dtype of published checkpoints. Both are loaded into fp32 parameters (the master dtype).",
        "",
        "Per rank, increase of the resident set's high-water mark (VmHWM, reset before each phase) over the",
        "resident set when the phase began; `shard` is the bytes of that rank's parameter shards, the floor.",
        "",
        "| checkpoint, world | rank | shard MB | load_pretrained peak MB | x shard | naive peak MB | x shard | naive / load_pretrained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in results["worlds"].items():
        for r, res in enumerate(ranks):
            a, b = res["load_pretrained"], res["naive"]
            s = a["shard_bytes"]
            lines.append(
                f"| {world} | {r} | {s / MB:.0f} | {a['peak_increase'] / MB:.0f} | {a['peak_increase'] / s:.2f} | "
                f"{b['peak_increase'] / MB:.0f} | {b['peak_increase'] / s:.2f} | {b['peak_increase'] / a['peak_increase']:.1f} |"
            )
    lines += [
        "",
        "Reading the table:",
        "",
        "- `load_pretrained` copies each tensor's rows from safetensors' `get_slice` (a view of its memory",
        "  map) into the shard: the mapped pages a rank touches are page cache, counted in its resident set",
        "  while the load runs. (Tables measured before this reader replaced hand-written `readinto` calls",
        "  say so in their header.)",
        "- naive, fp32 file: transformers memory-maps the file and, with nothing to convert, its tensors",
        "  stay backed by the page cache; `shard_model` then copies each rank's rows, so only those",
        "  pages become resident (counted while mapped, beside the copies: about 2x the shard). This is the friendliest",
        "  case for the naive way, and it holds only on CPU: on GPUs every rank would first move the",
        "  whole model to its device.",
        "- naive, bf16 file into fp32: every rank converts the whole model (the fp32 model plus the",
        "  mapped bf16 file: 1.5x the fp32 model), whatever the world size, so the gap grows with it.",
        "",
        "Load times (informational only: one run on a shared CPU machine is not a timing result):",
        "",
    ]
    for world, ranks in results["worlds"].items():
        lp = max(r["load_pretrained"]["seconds"] for r in ranks)
        nv = max(r["naive"]["seconds"] for r in ranks)
        lines.append(f"- {world}: load_pretrained {lp:.1f} s, naive {nv:.1f} s (slowest rank)")
    lines += [
        "",
        "Machine:",
        "",
        f"- `{m['uname']}`",
        f"- {m['nproc']} CPUs; memory: {m['memory']}",
        f"- torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}",
        f"- {m['date']}",
        f"- shared with other jobs? load before: `{m['uptime_before']}`; after: `{m['uptime_after']}` "
        "(load averages above the CPU count mean other work was running; memory figures are per process and "
        "do not depend on it, times do)",
        "",
        "Method: `benchmarks/load_pretrained_bench.py` (see its docstring for why VmHWM and not tracemalloc/psutil).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
