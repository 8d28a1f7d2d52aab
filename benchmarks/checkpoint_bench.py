"""Checkpoint save and load against torch.save / torch.load of the same bytes, and the training-loop stall.

Two gloo ranks on CPU train a TinyGPT with AdamW. One method, repeats interleaved (the order
alternating between repeats), medians kept, per rank:

1. save: `fsdp2kit.Checkpointer.save` (DCP records, each a ``torch.save`` archive carrying its
   CRC-32, fsynced, published by an atomic rename) against ``torch.save`` of the same local
   tensors (this rank's shards of every parameter and optimizer state) to a new file, fsynced,
   CRC-32 on (torch's default): what a checkpoint writes each time. Deleting the previous step
   or file is left out of the timed region for both;
2. load: `Checkpointer.load` with ``verify=True`` (the default: every record's CRC-32 recomputed
   before anything is read into the model) and with ``verify=False``, against ``torch.load`` of
   the file just saved. Loads read files just written, most likely from the page cache for all
   three: the load figures compare the software path, not the disk;
3. (unless ``--no-stall``) the training-loop stall: the step in which ``save`` is called and the
   steps after it, synchronous against asynchronous, and each rank's resident-memory peak.

    python benchmarks/checkpoint_bench.py                        # ~32 MB per rank
    python benchmarks/checkpoint_bench.py --size large --no-stall  # ~1.3 GB per rank

    python benchmarks/checkpoint_bench.py --size large --no-stall --ranks 1  # one rank, 2 verify threads

Writes benchmarks/results/checkpoint.json and .md (``--size large``: checkpoint-large.*; ``--ranks 1``:
``-1rank``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine as common_machine
from common import reset_rss_peak, rss_peak

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

SIZES = {
    "small": dict(vocab=4096, dim=256, depth=4, heads=4, seq=64),  # ~32 MB per rank with AdamW at 2 ranks
    "large": dict(vocab=32000, dim=1024, depth=12, heads=16, seq=64),  # ~217M parameters, ~1.3 GB per rank
}
MODEL = dict(SIZES["small"])  # the size this process runs (set in main and in bench_rank)
BATCH, STEPS, SAVE_AT = 2, 8, 2  # a stall loop of 8 steps saves in step 2 (0-based)
OPS = ("ck_save", "torch_save", "ck_load", "ck_load_unverified", "torch_load")


def _build():
    from models import TinyGPT

    import fsdp2kit as fk

    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    fk.shard_model(model, fk.make_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, gen) -> None:
    from models import lm_loss

    tokens = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1), generator=gen)
    lm_loss(model, tokens).backward()
    opt.step()
    opt.zero_grad()


def _local_tensors(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer state: what DCP writes for this rank."""
    from torch.distributed.tensor import DTensor

    out = {f"model.{k}": v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        for name, v in state.items():
            out[f"optim.{id(p)}.{name}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _torch_save(tensors, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(tensors, fh)
        fh.flush()
        os.fsync(fh.fileno())  # DCP fsyncs its files; so must the baseline


def bench_rank(workdir: str, repeats: int, size: str = "small", stall_runs: bool = True) -> dict:
    from fsdp2kit.checkpoint import Checkpointer, step_dir

    MODEL.clear()
    MODEL.update(SIZES[size])
    rank = dist.get_rank()
    work = Path(workdir)
    model, opt = _build()
    gen = torch.Generator().manual_seed(rank)
    _step(model, opt, gen)  # optimizer state exists
    tensors = _local_tensors(model, opt)
    ck = Checkpointer(work / "dcp", keep_last=1)
    unverified = Checkpointer(work / "dcp", keep_last=1, verify=False)
    assert torch.serialization.get_crc32_options(), "the baseline must keep torch.save's CRC-32 (its default)"

    times: dict[str, list[float]] = {k: [] for k in OPS}
    for rep in range(repeats + 1):  # repeat 0 warms up (first-touch allocations, imports)
        torch_file = work / f"torch_rank{rank}_{rep}.pt"
        ops = [
            ("ck_save", lambda: ck.save(rep, model, optimizer=opt)),  # noqa: B023 - called in this iteration
            ("torch_save", lambda: _torch_save(tensors, torch_file)),  # noqa: B023
        ]
        loads = [
            ("ck_load", lambda: ck.load(model, optimizer=opt)),
            ("ck_load_unverified", lambda: unverified.load(model, optimizer=opt)),
            ("torch_load", lambda: torch.load(torch_file, weights_only=True)),  # noqa: B023
        ]
        if rep % 2:
            ops.reverse()
            loads.reverse()
        for name, fn in ops + loads:
            t = _timed(fn)
            if rep > 0:
                times[name].append(t)
            # untimed: the previous step's deletion (keep_last=1, on a thread) and the previous file
            ck.wait()
            (work / f"torch_rank{rank}_{rep - 1}.pt").unlink(missing_ok=True)
    step = step_dir(work / "dcp", repeats)
    dcp_bytes = sum(f.stat().st_size for f in step.glob(f"__{rank}_*.distcp"))
    torch_bytes = (work / f"torch_rank{rank}_{repeats}.pt").stat().st_size
    ck.close()

    stall: dict[str, list[list[float]]] = {"sync": [], "async": []}
    waits: list[float] = []
    calls: dict[str, list[float]] = {"sync": [], "async": []}
    memory: dict[str, int] = {"saved_bytes": sum(t.nbytes for t in tensors.values())}
    if stall_runs:
        # One Checkpointer per mode for the whole run, as in training; a first loop per mode warms
        # it up (the async one makes its gloo group and staging buffers) and measures each rank's
        # resident peak over a loop that saves once (the async staging buffers stay allocated).
        checkpointers = {}
        for mode in ("sync", "async"):
            reset_rss_peak()
            sck = checkpointers[mode] = Checkpointer(work / f"stall_{mode}", keep_last=1, async_save=mode == "async")
            for i in range(STEPS):
                _step(model, opt, gen)
                if i == SAVE_AT:
                    sck.save(0, model, optimizer=opt)
            sck.wait()
            memory[f"{mode}_loop_peak_bytes"] = rss_peak()
        for rep in range(repeats):
            for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                sck, steps = checkpointers[mode], []
                for i in range(STEPS):
                    dist.barrier()
                    start = time.perf_counter()
                    _step(model, opt, gen)
                    if i == SAVE_AT:
                        call = time.perf_counter()
                        sck.save(1000 * (rep + 1) + i, model, optimizer=opt)
                        calls[mode].append(time.perf_counter() - call)
                    steps.append(time.perf_counter() - start)
                if mode == "async":
                    waits.append(_timed(sck.wait))
                stall[mode].append(steps)
        for sck in checkpointers.values():
            sck.close()
    return {
        "rank": rank,
        "bytes": {"dcp": dcp_bytes, "torch_save": torch_bytes},
        "times": times,
        "stall": stall,
        "async_wait_s": waits,
        "save_call_s": calls,
        "memory": memory,
    }


def summarize(ranks: list[dict]) -> dict:
    med = statistics.median
    per_rank = []
    for r in ranks:
        t = {k: med(v) for k, v in r["times"].items()}
        mb, mb_t = r["bytes"]["dcp"] / 1e6, r["bytes"]["torch_save"] / 1e6
        per_rank.append(
            {
                "rank": r["rank"],
                "MB": {"dcp": round(mb, 2), "torch_save": round(mb_t, 2)},
                "median_s": {k: round(v, 4) for k, v in t.items()},
                # MB/s of the rank's own bytes, each method over its own file's size
                "MBps": {k: round((mb_t if k.startswith("torch") else mb) / v, 1) for k, v in t.items()},
                "memory_MB": {k.removesuffix("_bytes"): round(v / 1e6, 1) for k, v in r["memory"].items()},
            }
        )
    for p, r in zip(per_rank, ranks):
        s = p["MBps"]
        p["ratio_vs_torch"] = {
            "save": round(s["ck_save"] / s["torch_save"], 2),
            "load": round(s["ck_load"] / s["torch_load"], 2),
            "load_unverified": round(s["ck_load_unverified"] / s["torch_load"], 2),
        }
        p["min_median_max_s"] = {k: [round(f(v), 3) for f in (min, med, max)] for k, v in r["times"].items()}
        # the same ratios per repeat (both timed in that repeat, a few seconds apart): their spread
        # says how much of a ratio is the machine's load rather than the method
        scale = (r["bytes"]["dcp"] / r["bytes"]["torch_save"]) if r["bytes"]["torch_save"] else 1.0
        paired = {
            "save": [b / a * scale for a, b in zip(r["times"]["ck_save"], r["times"]["torch_save"])],
            "load": [b / a * scale for a, b in zip(r["times"]["ck_load"], r["times"]["torch_load"])],
            "load_unverified": [
                b / a * scale for a, b in zip(r["times"]["ck_load_unverified"], r["times"]["torch_load"])
            ],
        }
        p["paired_ratio_min_median_max"] = {k: [round(f(v), 2) for f in (min, med, max)] for k, v in paired.items()}

    # The loop is lock-step (FSDP collectives), so a step lasts as long as its slowest rank.
    def steps_of(mode: str) -> list[list[float]]:
        return [
            [max(v) for v in zip(*[r["stall"][mode][i] for r in ranks])] for i in range(len(ranks[0]["stall"][mode]))
        ]

    stall: dict = {}
    for mode in ("sync", "async") if ranks[0]["stall"]["sync"] else ():
        runs = steps_of(mode)
        waits = [max(w) for w in zip(*[r["async_wait_s"] for r in ranks])] if mode == "async" else [0.0] * len(runs)
        stall[mode] = {
            "plain_step_s": round(med(s for run in runs for s in run[:SAVE_AT]), 4),
            "save_step_s": round(med(run[SAVE_AT] for run in runs), 4),
            # paired within each run (the saving step minus that run's own plain steps), median over runs
            "stall_s": round(med(run[SAVE_AT] - statistics.mean(run[:SAVE_AT]) for run in runs), 4),
            "save_call_s": round(med(max(c) for c in zip(*[r["save_call_s"][mode] for r in ranks])), 4),
            # everything the save cost the loop: all its steps and the final wait, minus plain steps
            "loop_extra_s": round(
                med(sum(run) + w - STEPS * statistics.mean(run[:SAVE_AT]) for run, w in zip(runs, waits)), 4
            ),
        }
    if stall:
        stall["async_stall_over_sync"] = round(stall["async"]["stall_s"] / stall["sync"]["stall_s"], 3)
        stall["async_save_call_over_sync"] = round(stall["async"]["save_call_s"] / stall["sync"]["save_call_s"], 3)
        stall["async_loop_extra_over_sync"] = round(stall["async"]["loop_extra_s"] / stall["sync"]["loop_extra_s"], 3)
    return {"throughput_per_rank": per_rank, "stall": stall}


def write_markdown(result: dict, path: Path) -> None:
    m, st, s = result["machine"], result["setup"], result["stall"]
    lines = [
        "# Checkpoint benchmark",
        "",
        f"Machine: {m['description']}, {m['memory']}, torch {m['torch']}, {m['date']}. "
        f"Disk: `{result['workdir_filesystem']}`.",
        f"Load average before: `{m['loadavg_before']}`; after: `{m['loadavg_after']}` (1, 5, 15 minutes).",
        "",
        f"Setup: {st['ranks']} ranks, gloo (CPU), TinyGPT {st['model']}, AdamW, {st['repeats']} interleaved repeats "
        f"(medians). `python benchmarks/checkpoint_bench.py{st['command_args']}` reproduces it.",
        "",
        "## Save and load per rank (MB/s of the rank's own bytes; ratio: fsdp2kit / torch)",
        "",
        "| rank | MB (DCP / torch.save) | Checkpointer.save | torch.save+fsync, new file | save ratio "
        "| Checkpointer.load (verify) | load, verify=False | torch.load | load ratio (verify / off) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["throughput_per_rank"]:
        r, q = p["MBps"], p["ratio_vs_torch"]
        lines.append(
            f"| {p['rank']} | {p['MB']['dcp']} / {p['MB']['torch_save']} | {r['ck_save']} | {r['torch_save']} | "
            f"{q['save']} | {r['ck_load']} | {r['ck_load_unverified']} | {r['torch_load']} | "
            f"{q['load']} / {q['load_unverified']} |"
        )
    lines += [
        "",
        "Per repeat (the ratio of the two times of the same repeat; min / median / max over the repeats):",
        "",
        "| rank | save ratio | load ratio (verify) | load ratio (verify=False) | seconds min / median / max |",
        "|---|---|---|---|---|",
    ]
    for p in result["throughput_per_rank"]:
        q, t = p["paired_ratio_min_median_max"], p["min_median_max_s"]
        lines.append(
            f"| {p['rank']} | "
            + " | ".join(" / ".join(map(str, q[k])) for k in ("save", "load", "load_unverified"))
            + " | "
            + "; ".join(f"{k} " + " / ".join(map(str, v)) for k, v in t.items())
            + " |"
        )
    lines += [
        "",
        "Both saves keep torch.save's CRC-32 (torch's default; the Checkpointer's load verifies it). "
        "Checkpointer.save includes building the state dict, DCP's planning (collectives), writing and fsyncing one "
        "archive per record and `.metadata`, and the atomic publish; Checkpointer.load includes reading and checking "
        "the metadata, (verify) recomputing every record's CRC-32, DCP's reader (a `torch.load` per record, then a "
        "copy into the model's tensor) and restoring the model and optimizer. The torch baselines write or read one "
        "file of the same tensors. Median seconds per rank: "
        + "; ".join(
            f"rank {p['rank']}: " + ", ".join(f"{k} {v}" for k, v in p["median_s"].items())
            for p in result["throughput_per_rank"]
        )
        + ".",
    ]
    if s:
        lines += [
            "",
            "## Training-loop stall (seconds, slowest rank, medians)",
            "",
            "| save | plain step | step that saves | stall | save() call | whole loop's extra time |",
            "|---|---|---|---|---|---|",
        ]
        for mode in ("sync", "async"):
            x = s[mode]
            lines.append(
                f"| {mode} | {x['plain_step_s']} | {x['save_step_s']} | {x['stall_s']} | {x['save_call_s']} | "
                f"{x['loop_extra_s']} |"
            )
        lines += [
            "",
            f"Async / sync: stall {s['async_stall_over_sync']}x (the saving step minus that run's plain steps), "
            f"save() call {s['async_save_call_over_sync']}x, whole loop's extra time {s['async_loop_extra_over_sync']}x "
            f"(all {STEPS} steps and the final wait(), minus {STEPS} plain steps: on 2 shared cores the writer thread "
            "slows the steps after an async save).",
            "",
            "| rank | bytes saved per rank (MB) | peak RSS, loop with a sync save | with an async save | async / sync |",
            "|---|---|---|---|---|",
        ]
        for p in result["throughput_per_rank"]:
            mm = p["memory_MB"]
            lines.append(
                f"| {p['rank']} | {mm['saved']} | {mm['sync_loop_peak']} | {mm['async_loop_peak']} | "
                f"{round(mm['async_loop_peak'] / mm['sync_loop_peak'], 2)} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default=None, help="where to write checkpoints (default: a temporary directory)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="small: ~32 MB per rank; large: ~1.3 GB")
    parser.add_argument("--no-stall", action="store_true", help="skip the training-loop stall runs (slow at large)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="1: one rank with both cores (results/checkpoint-large-1rank.md was measured when the load's "
        "check ran on threads)",
    )
    parser.add_argument("--render", metavar="JSON", help="rewrite the tables of a saved result from its raw times")
    args = parser.parse_args(argv)
    if args.render:
        saved = Path(args.render)
        result = json.loads(saved.read_text())
        result.update(summarize(result["raw"]))
        saved.write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(result, saved.with_suffix(".md"))
        return
    MODEL.clear()
    MODEL.update(SIZES[args.size])
    from fsdp2kit.testing import run_world

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    loadavg_before = os.getloadavg()
    try:
        ranks = run_world(
            bench_rank, args.ranks, str(workdir), args.repeats, args.size, not args.no_stall, timeout=3600
        )
        disk = subprocess.run(["df", "-hT", str(workdir)], capture_output=True, text=True).stdout.splitlines()[-1]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    machine = common_machine(world_size=args.ranks)
    machine["loadavg_before"] = [round(x, 2) for x in loadavg_before]
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    command = (f" --size {args.size}" if args.size != "small" else "") + (" --no-stall" if args.no_stall else "")
    command += f" --repeats {args.repeats}" if args.repeats != 5 else ""
    command += f" --ranks {args.ranks}" if args.ranks != 2 else ""
    setup = {"ranks": args.ranks, "model": MODEL, "repeats": args.repeats, "command_args": command}
    result = {"machine": machine, "workdir_filesystem": disk, "setup": setup, **summarize(ranks), "raw": ranks}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "checkpoint" if args.size == "small" else f"checkpoint-{args.size}"
    stem += f"-{args.ranks}rank" if args.ranks != 2 else ""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
