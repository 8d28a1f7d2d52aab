"""Peak memory per rank while setting up QLoRA from a bf16 checkpoint: meta + quantize-as-you-load vs eager.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/qlora_load_bench.py [--worlds 2]

A Llama-style model of about 94M parameters is saved in bf16 (how published checkpoints are
stored). For each world size, one set of gloo ranks measures, per rank, the set-up of the same
QLoRA model (NF4 blocks, r=16 adapters on all seven projections, `shard_model`) two ways:

1. meta: built on the meta device, `quantize_nf4` (NF4 placeholders), peft, `shard_model`,
   then `load_pretrained` quantizes each rank's rows of each weight into its NF4 shard;
2. eager: ``from_pretrained`` (the whole bf16 model in every process), `quantize_nf4`, peft,
   `shard_model` (what issue 11 shipped first, and what most QLoRA scripts do).

Measured as in load_pretrained_bench.py: the rise of the resident set's high-water mark (VmHWM,
reset before each phase after ``malloc_trim``) over the resident set when the phase began. The
code both use is imported first; the meta phase then runs first in fresh processes, and memory
the eager phase could reuse only makes it look better. Beside it: the bytes of the rank's shards (the floor) and of the whole model in bf16 (what
a rank holding the unquantized base would need). Both set-ups give the same NF4 shards, bit for
bit (tests/dist/test_qlora_load.py). Results: benchmarks/results/qlora_load.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine as common_machine
from common import reset_rss_peak, rss, rss_peak

HERE = Path(__file__).resolve().parent
CONFIG = dict(
    vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MB = 1e6


def _bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for ``t`` (a DTensor's local shard; an NF4 tensor's inner tensors)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if type(t).__name__ == "NF4Tensor":
        return sum(_bytes(getattr(t, a)) for a in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _phase(fn) -> dict:
    start = reset_rss_peak()
    t0 = time.perf_counter()
    model = fn()
    seconds = time.perf_counter() - t0
    return {
        "start_rss": start,
        "peak_increase": rss_peak() - start,
        "end_increase": rss() - start,
        "shard_bytes": sum(_bytes(p) for p in model.parameters()),
        "seconds": seconds,
        "model": model,
    }


def measure(hf_dir: str) -> dict:
    # Imported before either phase: loading peft's and torchao's code is resident memory too, and
    # the first phase would otherwise pay for it alone.
    import peft  # noqa: F401
    import torch.distributed as dist
    from torchao.quantization import to_nf4  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401

    import fsdp2kit as fk
    from fsdp2kit.weights import nf4  # noqa: F401

    mesh = fk.make_mesh()

    def meta():
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(hf_dir)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        fk.quantize_nf4(model)
        model = fk.apply_lora(model, r=16, alpha=32, targets=TARGETS)
        fk.shard_model(model, mesh, mixed_precision="bf16")
        fk.load_pretrained(model, hf_dir)
        return model

    def eager():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
        fk.quantize_nf4(model)
        model = fk.apply_lora(model, r=16, alpha=32, targets=TARGETS)
        fk.shard_model(model, mesh, mixed_precision="bf16")
        gc.collect()
        return model

    out = {}
    for name, fn in (("meta", meta), ("eager", eager)):
        dist.barrier()
        out[name] = _phase(fn)
        del out[name]["model"]
        gc.collect()
    dist.barrier()
    out["load"] = list(os.getloadavg())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp2kit.testing import run_world

    machine = common_machine()
    machine["load_before"] = list(os.getloadavg())
    results = {"machine": machine, "config": CONFIG, "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        results["model"] = {"parameters": n_params, "bf16_bytes": n_params * 2}
        print(f"model: {n_params / 1e6:.1f}M parameters, {n_params * 2 / MB:.0f} MB in bf16")
        for world in args.worlds:
            ranks = run_world(measure, world, tmp, timeout=600)
            results["worlds"][str(world)] = ranks
            for r, res in enumerate(ranks):
                a, b = res["meta"], res["eager"]
                print(
                    f"world {world} rank {r}: shard {a['shard_bytes'] / MB:.0f} MB | meta peak "
                    f"+{a['peak_increase'] / MB:.0f} MB | eager peak +{b['peak_increase'] / MB:.0f} MB"
                )
    machine["load_after"] = list(os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qlora_load.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "qlora_load.md").write_text(_markdown(results))
    print(f"wrote {args.out / 'qlora_load.json'} and .md")


def _loads(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _markdown(results: dict) -> str:
    m, model = results["machine"], results["model"]
    whole = model["bf16_bytes"]
    lines = [
        "# Peak memory per rank setting up QLoRA from a bf16 checkpoint: meta + quantize-as-you-load vs eager",
        "",
        f"Model: Llama-style, {model['parameters'] / 1e6:.1f}M parameters, {whole / MB:.0f} MB in bf16 on disk "
        "(one file). QLoRA: the blocks' Linear weights in NF4 (block 64, scaler block 256), embeddings, norms "
        'and head in bf16, r=16 fp32 adapters on all seven projections, `shard_model(mixed_precision="bf16")`.',
        "",
        "- meta: meta device, `quantize_nf4` (placeholders), peft, `shard_model`, `load_pretrained` (each rank",
        "  quantizes its own rows of each weight into its NF4 shard);",
        "- eager: `from_pretrained` in bf16 on every rank, `quantize_nf4`, peft, `shard_model`.",
        "",
        "Per rank: the rise of the resident set's high-water mark (VmHWM, reset before the phase) over the resident",
        "set when the phase began. `shard` is the bytes of the rank's shards after set-up (the floor); the whole",
        "model in bf16 is what a rank that ever held the unquantized base would need at least.",
        "",
        "| world | rank | shard MB | whole model bf16 MB | meta peak MB | x shard | / whole bf16 | eager peak MB | x shard | "
        "/ whole bf16 | eager / meta |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in results["worlds"].items():
        for r, res in enumerate(ranks):
            a, b = res["meta"], res["eager"]
            s, pa, pb = a["shard_bytes"], a["peak_increase"], b["peak_increase"]
            lines.append(
                f"| {world} | {r} | {s / MB:.0f} | {whole / MB:.0f} | {pa / MB:.0f} | {pa / s:.2f} | {pa / whole:.2f} | "
                f"{pb / MB:.0f} | {pb / s:.2f} | {pb / whole:.2f} | {pb / pa:.1f} |"
            )
    lines += [
        "",
        "Reading the table: the meta set-up never holds more than one weight's rows unquantized, so its peak is",
        "the shards plus the transients of one weight or module at a time (the bf16 rows as read, the",
        "quantization scratch of 64K weights at a time, and `materialize`'s full-size stand-in for one module",
        "while the adapters get their init): it is set by the largest module, not by the model. The eager one",
        "holds the whole bf16 model on every rank before anything is quantized or sharded, whatever the world",
        "size, and then torchao's scratch for quantizing a whole weight (up to 1M weights at a time).",
        "",
        "Set-up times (informational only: one run on a shared CPU machine is not a timing result): "
        + "; ".join(
            f"world {w}: meta {max(r['meta']['seconds'] for r in ranks):.1f} s, "
            f"eager {max(r['eager']['seconds'] for r in ranks):.1f} s (slowest rank)"
            for w, ranks in results["worlds"].items()
        ),
        "",
        f"Machine: `{m['uname']}`; {m['nproc']} CPUs; memory {m['memory']}; torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['date']}. Load average before {_loads(m['load_before'])}, after "
        f"{_loads(m['load_after'])} (a shared machine: memory figures are per process and do not depend on load).",
        "",
        "Reproduce: `PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/qlora_load_bench.py`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
