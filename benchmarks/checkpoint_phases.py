"""Where a Checkpointer save and load spend their time: timers around each phase, 2 ranks.

Wraps (monkeypatches, in the benchmark's ranks only) the Checkpointer's steps (state-dict build,
checks, publish, the agreements), DCP's planner and file writer/reader, and times them over
interleaved repeats beside torch.save+fsync (to a new file, as checkpoint_bench.py) and torch.load of
the same tensors. Prints one line
per phase: seconds per save or load (median per call x calls), rank 0 and rank 1.

    python benchmarks/checkpoint_phases.py small 4
    python benchmarks/checkpoint_phases.py large 2     # 1.3 GB per rank: ~6 min, ~9 GB of memory
"""

import functools
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
import checkpoint_bench as cb  # noqa: E402 - found through the path set just above

T = {}


def wrap(obj, name, label):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T.setdefault(label, []).append(time.perf_counter() - t)

    setattr(obj, name, w)


def instrument():
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import default_planner as dp

    import fsdp2kit.checkpoint.checkpointer as C

    # The Checkpointer's phases, as the names it calls them by (checks.py's checks, layout.py's
    # prepare_dir/publish, the model's restore is DCP's set_model_state_dict, agree the collectives).
    for n in [
        "state_to_save",
        "state_to_load",
        "prepare_dir",
        "publish",
        "check_optimizer",
        "check_against",
        "check_extra_keys",
        "verify_files",
        "read_metadata",
        "set_model_state_dict",
        "restore_optimizer",
        "restore_extra",
    ]:
        wrap(C, n, n)
    wrap(C, "agree", "agree")
    wrap(C.dcp, "save", "dcp.save")
    wrap(C.dcp, "load", "dcp.load")
    wrap(FileSystemWriter, "write_data", "W.write_data")
    wrap(FileSystemWriter, "finish", "W.finish")
    wrap(FileSystemReader, "read_data", "R.read_data")
    import torch.distributed.checkpoint.state_dict_loader as sl

    wrap(sl, "_load_state_dict", "dcp._load_state_dict")
    wrap(dp.DefaultSavePlanner, "create_local_plan", "SP.local_plan")
    wrap(dp.DefaultSavePlanner, "create_global_plan", "SP.global_plan")
    wrap(dp.DefaultLoadPlanner, "create_local_plan", "LP.local_plan")
    wrap(dp.DefaultLoadPlanner, "create_global_plan", "LP.global_plan")
    wrap(dp.DefaultLoadPlanner, "set_up_planner", "LP.setup")
    wrap(dp.DefaultSavePlanner, "set_up_planner", "SP.setup")
    import fsdp2kit.checkpoint.optim as O

    wrap(O, "get_optimizer_state_dict", "get_optimizer_state_dict")
    wrap(O, "set_optimizer_state_dict", "set_optimizer_state_dict")
    import fsdp2kit.checkpoint.state as S

    wrap(S, "get_model_state_dict", "get_model_state_dict")
    import fsdp2kit.checkpoint.layout as L

    wrap(L, "fsync", "fsync")
    wrap(FileSystemWriter, "prepare_global_plan", "W.prepare_global_plan")
    import torch.distributed.checkpoint.filesystem as FS

    wrap(FS, "_write_item", "W._write_item")


def run(workdir, size, reps):
    from fsdp2kit.checkpoint import Checkpointer

    cb.MODEL.clear()
    cb.MODEL.update(cb.SIZES[size])
    torch.set_num_threads(1)
    instrument()
    rank = dist.get_rank()
    model, opt = cb._build()
    gen = torch.Generator().manual_seed(rank)
    cb._step(model, opt, gen)
    tensors = cb._local_tensors(model, opt)
    work = Path(workdir)
    ck = Checkpointer(work / "dcp", keep_last=1)
    for r in range(reps + 1):
        if r == 1:
            T.clear()
        for name, fn in [
            ("SAVE", lambda: ck.save(r, model, optimizer=opt)),  # noqa: B023 - called in this iteration
            # torch.save to a new file, the previous one deleted only afterwards (as a step is)
            ("tsave", lambda: cb._torch_save(tensors, work / f"t{rank}_{r}.pt")),  # noqa: B023
            ("LOAD", lambda: ck.load(model, optimizer=opt)),
            ("tload", lambda: torch.load(work / f"t{rank}_{r}.pt", weights_only=True)),  # noqa: B023
        ]:
            dist.barrier()
            t = time.perf_counter()
            fn()
            T.setdefault(name, []).append(time.perf_counter() - t)
            if name == "tsave":
                (work / f"t{rank}_{r - 1}.pt").unlink(missing_ok=True)
    ck.close()
    return {k: statistics.median(v) * len(v) / reps for k, v in T.items()}  # per-op median x calls per op


if __name__ == "__main__":
    import tempfile

    from fsdp2kit.testing import run_world

    size = sys.argv[1]
    reps = int(sys.argv[2])
    d = tempfile.mkdtemp(prefix="ckprof-")
    try:
        res = run_world(run, 2, d, size, reps, timeout=3000)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(os.getloadavg())
    keys = list(res[0])
    for k in keys:
        print(f"{k:28s}", "  ".join(f"{r.get(k, 0):8.4f}" for r in res))
