"""Context parallelism on ONE GPU: two ranks share cuda:0 over gloo (NCCL refuses two ranks on one device),
so that ring attention's CUDA kernels, which run only on CUDA, are checked against one process on a
machine with a single GPU. tests/dist/cp_cases.py's parity cases (3 AdamW steps, fp32): ring, and the
all-to-all style with and without packed documents. gloo moves CUDA tensors through host memory, so
this says nothing about speed.

    python tests/cuda/ring_one_gpu.py        # prints one JSON line per case; exit 1 if any fails 1e-5
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
RTOL = 1e-5


def _child(rank: int, port: int, queue) -> None:
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "dist")]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32, not TF32
    from cp_cases import CPCase, run_parity

    out = {}
    for name, case in {
        "ring": CPCase(shard=1, packed=False, style="ring"),
        "ring qwen3 (GQA)": CPCase(model="qwen3", shard=1, packed=False, style="ring"),
        "all_to_all": CPCase(shard=1, packed=False),
        "all_to_all packed": CPCase(shard=1, packed=True),
    }.items():
        try:
            out[name] = run_parity(case)
        except Exception:
            out[name] = {"error": traceback.format_exc()[-3000:]}
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("ring_one_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    bad = 0
    for name, res in results[0].items():
        ok = "error" not in res and res["worst_rel"] <= RTOL
        bad += not ok
        print(json.dumps({"case": name, "ok": ok, **res}, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
