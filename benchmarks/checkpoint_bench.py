"""Checkpoint throughput and training-loop stall, side by side on one machine.

Two gloo ranks on CPU train a small transformer (about 5 M parameters: 21 MB of weights, 63 MB
with AdamW's two moments, half of it per rank). Measured, with repeats interleaved and medians
kept:

1. save and load throughput per rank (MB/s of the rank's own bytes) of `fsdp2kit.Checkpointer`
   against `torch.save` / `torch.load` of the same local tensors to the same directory, fsynced
   like DCP's files: the practical limit of this disk and this CPU;
2. the training-loop stall: the time of the step in which `save` is called and of the steps
   after it, for a synchronous and an asynchronous save, against steps with no save.

    python benchmarks/checkpoint_bench.py            # spawns 2 ranks itself (fsdp2kit.testing.run_world)
    python benchmarks/checkpoint_bench.py --size large --repeats 3 --no-stall   # ~1.3 GB per rank
    torchrun --nproc-per-node 2 benchmarks/checkpoint_bench.py

Writes benchmarks/results/checkpoint.json and checkpoint.md (``--size large``: checkpoint-large.*).
Loads read files just written, so they most likely come from the page cache for both methods
alike: the load figures compare the software path, not the disk.
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
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine as common_machine
from common import reset_rss_peak, rss_peak

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

# --size: "small" is the committed table's model (~32 MB per rank with AdamW at 2 ranks);
# "large" is ~217M parameters, ~1.3 GB per rank with AdamW at 2 ranks (the issue's >= 1 GiB case).
SIZES = {
    "small": dict(vocab=4096, dim=256, depth=4, heads=4, seq=64),
    "large": dict(vocab=32000, dim=1024, depth=12, heads=16, seq=64),
}
MODEL = dict(SIZES["small"])  # the size this process runs (set in main, inherited by spawned ranks)
BATCH, STEPS, SAVE_AT = 2, 8, 2  # a loop of 8 steps saves in step 2 (0-based)


def _build():
    from models import TinyGPT

    import fsdp2kit as fk

    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    fk.shard_model(model, fk.make_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


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


def _count_reads(fn) -> dict[str, int]:
    """How many records a load read straight into place, and how many through DCP's reader."""
    from fsdp2kit.checkpoint.reader import DirectReader

    counts = {"direct": 0, "fallback": 0}
    original = DirectReader.read_data

    def counting(self, plan, planner):
        out = original(self, plan, planner)
        counts["direct"] += self.direct_reads
        counts["fallback"] += self.fallback_reads
        return out

    DirectReader.read_data = counting
    try:
        fn()
    finally:
        DirectReader.read_data = original
    return counts


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
    from fsdp2kit.checkpoint import Checkpointer, read_metadata, step_dir

    MODEL.clear()
    MODEL.update(SIZES[size])

    rank = dist.get_rank()
    work = Path(workdir)
    model, opt = _build()
    gen = torch.Generator().manual_seed(rank)
    _step(model, opt, gen)  # optimizer state exists
    tensors = _local_tensors(model, opt)
    torch_file = work / f"torch_save_rank{rank}.pt"
    ck = Checkpointer(work / "dcp", keep_last=1)
    # The same save with DCP's writer at another thread count (writer.py's WRITER_THREADS, read at
    # each save): 2 threads write two files per rank in parallel.
    import fsdp2kit.checkpoint.writer as writer_module

    threads = writer_module.WRITER_THREADS
    alt_threads = 2 if threads == 1 else 1
    alt_ck = Checkpointer(work / "dcp_alt", keep_last=1)

    def alt_save(step: int) -> None:
        writer_module.WRITER_THREADS = alt_threads
        try:
            alt_ck.save(step, model, optimizer=opt)
        finally:
            writer_module.WRITER_THREADS = threads

    # Plain dcp.save of the same model and optimizer state, each rank on its own (no planning
    # collectives, no validation, no publish), with and without the optimizer's param_groups
    # entries: how much of the gap is DCP's cost per item rather than the Checkpointer's.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    raw = {"model": model.state_dict(), "optimizer": osd}
    raw_tensors = {
        "model": raw["model"],
        "optimizer": {k: v for k, v in osd.items() if not k.startswith("param_groups.")},
    }
    raw_items = {"all": len(raw["model"]) + len(osd), "param_groups": len(osd) - len(raw_tensors["optimizer"])}

    def raw_save(sd, name: str) -> None:
        target = work / f"raw_{name}_rank{rank}"
        shutil.rmtree(target, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
            dcp.save(sd, checkpoint_id=target, no_dist=True)

    # ---- throughput: interleaved, order alternating between repeats -----------------------
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "dcp_save",
            "torch_save",
            "torch_save_new",
            "dcp_save_alt_threads",
            "dcp_load",
            "torch_load",
            "raw_dcp_save",
            "raw_dcp_save_tensors_only",
        )
    }
    for rep in range(repeats + 1):  # repeat 0 warms up (first-touch allocations, imports)
        ops = [
            ("dcp_save", lambda: ck.save(rep, model, optimizer=opt)),  # noqa: B023 - called within this iteration
            ("dcp_save_alt_threads", lambda: alt_save(rep)),  # noqa: B023
            ("torch_save", lambda: _torch_save(tensors, torch_file)),
            # a new file each repeat, as a checkpoint's step always is (the old one deleted untimed)
            ("torch_save_new", lambda: _torch_save(tensors, work / f"torch_new_rank{rank}_{rep}.pt")),  # noqa: B023
            ("raw_dcp_save", lambda: raw_save(raw, "all")),
            ("raw_dcp_save_tensors_only", lambda: raw_save(raw_tensors, "tensors")),
        ]
        loads = [
            ("dcp_load", lambda: ck.load(model, optimizer=opt)),
            ("torch_load", lambda: torch.load(torch_file, weights_only=True)),
        ]
        if rep % 2:
            ops.reverse()
            loads.reverse()
        for name, fn in ops + loads:
            t = _timed(fn)
            if rep > 0:
                times[name].append(t)
            if name == "torch_save_new":
                (work / f"torch_new_rank{rank}_{rep - 1}.pt").unlink(missing_ok=True)
    dcp_bytes = sum(f.stat().st_size for f in step_dir(work / "dcp", repeats).glob(f"__{rank}_*.distcp"))
    # records this rank wrote in the Checkpointer's own step (DCP keeps one entry per record)
    storage = read_metadata(step_dir(work / "dcp", repeats)).storage_data
    ck_records = sum(1 for info in storage.values() if info.relative_path.startswith(f"__{rank}_"))
    torch_bytes = torch_file.stat().st_size
    ck.close()
    alt_ck.close()
    shutil.rmtree(work / "dcp_alt", ignore_errors=True)
    reads = _count_reads(lambda: Checkpointer(work / "dcp").load(model, optimizer=opt))

    # ---- stall: the step that saves, and the ones after, sync against async --------------------
    stall: dict[str, list[list[float]]] = {"sync": [], "async": []}
    waits: list[float] = []
    save_calls: dict[str, list[float]] = {"sync": [], "async": []}  # the save() call alone
    # One Checkpointer per mode for the whole run, as in training: the asynchronous one creates
    # its gloo group and its staging buffers on its first save, which is a warm-up, not measured.
    # The warm-up runs also measure each rank's resident-memory peak over a loop that saves
    # once: synchronously first, then asynchronously (whose staging buffers stay allocated).
    checkpointers = {}
    memory: dict[str, int] = {}
    for mode in ("sync", "async"):
        reset_rss_peak()
        sck = checkpointers[mode] = Checkpointer(work / f"stall_{mode}", keep_last=1, async_save=mode == "async")
        for i in range(STEPS):
            _step(model, opt, gen)
            if i == SAVE_AT:
                sck.save(0, model, optimizer=opt)
        sck.wait()
        memory[f"{mode}_loop_peak_bytes"] = rss_peak()
    memory["saved_bytes"] = sum(t.nbytes for t in tensors.values())
    for rep in range(repeats if stall_runs else 0):
        for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
            sck = checkpointers[mode]
            steps = []
            for i in range(STEPS):
                dist.barrier()
                start = time.perf_counter()
                _step(model, opt, gen)
                if i == SAVE_AT:
                    call = time.perf_counter()
                    sck.save(1000 * (rep + 1) + i, model, optimizer=opt)
                    save_calls[mode].append(time.perf_counter() - call)
                steps.append(time.perf_counter() - start)
            if mode == "async":
                waits.append(_timed(sck.wait))
            stall[mode].append(steps)
    for sck in checkpointers.values():
        sck.close()

    return {
        "rank": rank,
        "items": {**raw_items, "checkpointer_records": ck_records},
        "writer_threads": {"default": threads, "alternative": alt_threads},
        "bytes": {"dcp": dcp_bytes, "torch_save": torch_bytes},
        "times": times,
        "stall": stall,
        "async_wait_s": waits,
        "save_call_s": save_calls,
        "memory": memory,
        "reads": reads,
    }


def summarize(ranks: list[dict], machine: dict, workdir: str) -> dict:
    med = statistics.median
    per_rank = []
    for r in ranks:
        mb = r["bytes"]["dcp"] / 1e6
        mb_t = r["bytes"]["torch_save"] / 1e6
        t = {k: med(v) for k, v in r["times"].items()}
        per_rank.append(
            {
                "rank": r["rank"],
                "MB": {"dcp": round(mb, 2), "torch_save": round(mb_t, 2)},
                "median_s": {k: round(v, 4) for k, v in t.items()},
                "items": r["items"],
                "reads": r.get("reads"),
                "writer_threads": r.get("writer_threads"),
                "memory_MB": {k.removesuffix("_bytes"): round(v / 1e6, 1) for k, v in r.get("memory", {}).items()},
                "MBps": {
                    "raw_dcp_save": round(mb / t["raw_dcp_save"], 1),
                    "raw_dcp_save_tensors_only": round(mb / t["raw_dcp_save_tensors_only"], 1),
                    "dcp_save": round(mb / t["dcp_save"], 1),
                    "dcp_save_alt_threads": round(mb / t["dcp_save_alt_threads"], 1),
                    "torch_save": round(mb_t / t["torch_save"], 1),
                    "torch_save_new": round(mb_t / t["torch_save_new"], 1) if "torch_save_new" in t else None,
                    "dcp_load": round(mb / t["dcp_load"], 1),
                    "torch_load": round(mb_t / t["torch_load"], 1),
                },
            }
        )
    for p in per_rank:
        p["ratio_vs_torch"] = {
            "save": round(p["MBps"]["dcp_save"] / p["MBps"]["torch_save"], 2),
            "save_vs_new_file": round(p["MBps"]["dcp_save"] / p["MBps"]["torch_save_new"], 2)
            if p["MBps"].get("torch_save_new")
            else None,
            "load": round(p["MBps"]["dcp_load"] / p["MBps"]["torch_load"], 2),
        }

    # The loop is lock-step (FSDP collectives), so a step lasts as long as its slowest rank.
    def steps_of(mode: str) -> list[list[float]]:
        return [
            [max(vals) for vals in zip(*[r["stall"][mode][i] for r in ranks])]
            for i in range(len(ranks[0]["stall"][mode]))
        ]

    stall: dict = {}
    for mode in ("sync", "async") if ranks[0]["stall"]["sync"] else ():
        runs = steps_of(mode)
        before = [s for run in runs for s in run[:SAVE_AT]]
        stall[mode] = {
            "plain_step_s": round(med(before), 4),
            "save_step_s": round(med(run[SAVE_AT] for run in runs), 4),
            "next_step_s": round(med(run[SAVE_AT + 1] for run in runs), 4),
            "later_steps_s": round(med(s for run in runs for s in run[SAVE_AT + 2 :]), 4),
        }
        # Paired within each run (the saving step minus that run's own plain steps), then the
        # median over runs: steps drift between runs on a shared machine.
        stall[mode]["stall_s"] = round(med(run[SAVE_AT] - statistics.mean(run[:SAVE_AT]) for run in runs), 4)
        if "save_call_s" in ranks[0]:
            calls = [max(c) for c in zip(*[r["save_call_s"][mode] for r in ranks])]
            stall[mode]["save_call_s"] = round(med(calls), 4)
        waits = [max(w) for w in zip(*[r["async_wait_s"] for r in ranks])] if mode == "async" else [0.0] * len(runs)
        # Everything the save cost the loop: all its steps and the final wait, minus plain steps.
        stall[mode]["loop_extra_s"] = round(
            med(sum(run) + w - STEPS * statistics.mean(run[:SAVE_AT]) for run, w in zip(runs, waits)), 4
        )
    if stall:
        stall["async"]["wait_at_end_s"] = round(med(max(w) for w in zip(*[r["async_wait_s"] for r in ranks])), 4)
        stall["async_stall_over_sync_stall"] = round(stall["async"]["stall_s"] / stall["sync"]["stall_s"], 3)
        if "save_call_s" in stall["sync"]:
            stall["async_save_call_over_sync"] = round(stall["async"]["save_call_s"] / stall["sync"]["save_call_s"], 3)
        stall["async_loop_extra_over_sync"] = round(stall["async"]["loop_extra_s"] / stall["sync"]["loop_extra_s"], 3)
    return {
        "machine": machine,
        "workdir_filesystem": subprocess.run(
            f"df -hT {workdir} | tail -1", shell=True, capture_output=True, text=True
        ).stdout.strip(),
        "setup": {
            "ranks": len(ranks),
            "backend": "gloo (CPU)",
            "model": MODEL,
            "optimizer": "AdamW",
            "batch_per_rank": BATCH,
            "repeats": len(ranks[0]["times"]["dcp_save"]),
            "steps_per_stall_run": STEPS,
            "save_in_step": SAVE_AT,
            "command_args": "",
        },
        "throughput_per_rank": per_rank,
        "stall": stall,
        "raw": {"per_rank": ranks},
    }


def write_markdown(result: dict, path: Path) -> None:
    m, s = result["machine"], result["stall"]
    p0 = result["throughput_per_rank"][0]
    lines = [
        "# Checkpoint benchmark",
        "",
        f"Machine: `{m['uname']}`, {m['nproc']} cores, torch {m['torch']}, Python {m['python']}, {m['date']}.",
        f"Disk under the work directory: `{result['workdir_filesystem']}`.",
        f"Load before: `{m['uptime_before']}`; after: `{m['uptime_after']}`.",
    ]
    if m.get("shared"):
        lines.append(
            "**The machine was shared with other jobs while this ran** (load average above the core count): "
            "absolute times are noisy; the ratios, measured interleaved in the same run, are what to read."
        )
    st = result["setup"]
    lines += [
        "",
        f"Setup: {st['ranks']} ranks, {st['backend']}, TinyGPT {st['model']}, {st['optimizer']}, "
        f"{st['repeats']} interleaved repeats (medians). `python benchmarks/checkpoint_bench.py"
        f"{st.get('command_args', '')}` reproduces it.",
        "",
        "## Throughput per rank (MB/s of the rank's own bytes)",
        "",
        "| rank | MB (DCP / torch.save) | Checkpointer.save | torch.save+fsync, same file | ratio "
        "| torch.save+fsync, new file | ratio | Checkpointer.load | torch.load | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["throughput_per_rank"]:
        r = p["MBps"]
        lines.append(
            f"| {p['rank']} | {p['MB']['dcp']} / {p['MB']['torch_save']} | {r['dcp_save']} | {r['torch_save']} | "
            f"{p['ratio_vs_torch']['save']} | {r.get('torch_save_new', '-')} | "
            f"{p['ratio_vs_torch'].get('save_vs_new_file', '-')} | {r['dcp_load']} | {r['torch_load']} | "
            f"{p['ratio_vs_torch']['load']} |"
        )
    lines += [
        "",
        "Checkpointer.save includes building the state dict, DCP planning (two collectives), writing and fsyncing, "
        "and the atomic publish; Checkpointer.load includes reading the metadata, validating it, resharding and "
        "restoring the optimizer. The torch baselines only write or read one file of the same tensors. Loads most "
        "likely hit the page cache for both. The two torch.save baselines: the same file overwritten each repeat "
        "(its blocks already allocated), and a new file each repeat (the previous one deleted outside the timed "
        "region), which is what a checkpoint always writes; both with torch.save's default CRC-32 on.",
        "",
        "Where the save time goes: plain `dcp.save` of the same state on each rank alone (no collectives, no "
        "checks, no publish), and the same without the optimizer's `param_groups` entries. DCP writes every entry "
        "as its own serialized record; flattened per parameter, AdamW's hyper-parameters are most of the entries "
        "of a model this small (each a one-number pickle), which costs more than their bytes suggest. Their share "
        "shrinks as tensors grow; the item count does not grow with model width.",
        "",
        "| rank | format-1 items (of which param_groups) | plain dcp.save MB/s | without param_groups MB/s | "
        "Checkpointer.save MB/s | Checkpointer records |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["throughput_per_rank"]:
        r = p["MBps"]
        lines.append(
            f"| {p['rank']} | {p['items']['all']} ({p['items']['param_groups']}) | {r['raw_dcp_save']} | "
            f"{r['raw_dcp_save_tensors_only']} | {r['dcp_save']} | {p['items'].get('checkpointer_records', '-')} |"
        )
    lines += [
        "",
        "The plain `dcp.save` columns store the optimizer in fsdp2kit's format 1 (flattened per parameter, "
        "`flatten_optimizer_state_dict`); the Checkpointer writes format 2 (checkpoint/optim.py: hyper-parameters once "
        "per param group, scalar states packed), whose record count is the last column.",
        "",
        "Records a Checkpointer.load read straight into the model's and optimizer's tensors (checkpoint/reader.py) / "
        "through DCP's own reader: "
        + ", ".join(
            f"rank {p['rank']}: {p['reads']['direct']} / {p['reads']['fallback']}"
            for p in result["throughput_per_rank"]
            if p.get("reads")
        )
        + ".",
        "",
        f"DCP's writer threads per rank: {p0['writer_threads']['default']} (`WRITER_THREADS`, the tables above); "
        f"the same save with {p0['writer_threads']['alternative']}, interleaved in the same repeats: "
        + ", ".join(
            f"rank {p['rank']} {p['MBps']['dcp_save_alt_threads']} MB/s "
            f"({round(p['MBps']['dcp_save_alt_threads'] / p['MBps']['dcp_save'], 2)}x)"
            for p in result["throughput_per_rank"]
        )
        + ".",
        "",
        "## Memory (resident set per rank, MB)",
        "",
        "| rank | bytes saved per rank | peak over a loop with one sync save | with one async save (staging buffers kept) "
        "| async / sync |",
        "|---|---|---|---|---|",
    ]
    for p in result["throughput_per_rank"]:
        m = p.get("memory_MB") or {}
        if m:
            lines.append(
                f"| {p['rank']} | {m['saved']} | {m['sync_loop_peak']} | {m['async_loop_peak']} | "
                f"{round(m['async_loop_peak'] / m['sync_loop_peak'], 2)} |"
            )
    if not s:
        lines.append("\nNo stall runs (`--no-stall`).\n")
        path.write_text("\n".join(lines))
        return
    lines += [
        "",
        "## Training-loop stall (seconds per step, slowest rank, medians)",
        "",
        "| save | plain step | step that saves | stall | save() call alone | next step | later steps "
        "| wait() at the end | whole loop's extra time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("sync", "async"):
        x = s[mode]
        lines.append(
            f"| {mode} | {x['plain_step_s']} | {x['save_step_s']} | {x['stall_s']} | {x.get('save_call_s', '-')} | "
            f"{x['next_step_s']} | "
            f"{x['later_steps_s']} | {x.get('wait_at_end_s', '-')} | {x.get('loop_extra_s', '-')} |"
        )
    lines += [
        "",
        f"The asynchronous save stalls the loop {s['async_stall_over_sync_stall']}x as long as the synchronous one "
        "(stall = the saving step minus the plain steps before it in the same run, median over runs; timing the save() call alone, slowest rank, gives "
        f"{s.get('async_save_call_over_sync', '-')}x). The rest of its cost moves to the steps after it, where the "
        "writer thread competes with training for the same cores: counting those too (the whole loop's extra time: "
        f"all {STEPS} steps and the final wait(), minus {STEPS} of that run's plain steps), the asynchronous save costs the loop "
        f"{s.get('async_loop_extra_over_sync', '-')}x what the synchronous one does.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--workdir", default=None, help="where to write checkpoints (default: a new temporary directory)"
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="small: ~32 MB per rank; large: ~1.3 GB")
    parser.add_argument("--no-stall", action="store_true", help="skip the training-loop stall runs (slow at large)")
    args = parser.parse_args(argv)
    MODEL.clear()
    MODEL.update(SIZES[args.size])

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    machine = common_machine()
    machine["uptime_before"] = machine["uptime"]
    try:
        if "RANK" in os.environ:  # under torchrun
            import fsdp2kit as fk

            fk.init_distributed(device="cpu")
            torch.set_num_threads(1)
            mine = bench_rank(str(workdir), args.repeats, args.size, not args.no_stall)
            ranks: list = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            if dist.get_rank() != 0:
                return
        else:
            from fsdp2kit.testing import run_world

            ranks = run_world(bench_rank, 2, str(workdir), args.repeats, args.size, not args.no_stall, timeout=3600)
        machine["uptime_after"] = common_machine()["uptime"]
        load = max(
            float(u.split("load average:")[1].split(",")[0])
            for u in (machine["uptime_before"], machine["uptime_after"])
        )
        machine["shared"] = load > (os.cpu_count() or 1)
        result = summarize(ranks, machine, str(workdir))
        result["setup"]["command_args"] = "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--out")
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "checkpoint" if args.size == "small" else f"checkpoint-{args.size}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
