"""`fsdp2kit launch`: torchrun's launch, ended by one line naming the failed rank and how it ended (issue 27).

The workers are a few lines of Python (no torch): what is checked is the launcher's own output and status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FSDP2KIT = str(Path(sys.executable).with_name("fsdp2kit"))
# Rank 1 ends as told after 0.5 s; rank 0 leaves at once with status 0 (torchrun then has one failure), or with
# "alive" is still running when rank 1 fails, so torchrun SIGTERMs it and lists it too.
WORKER = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    print("rank 1 ends", flush=True)
    os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == "kill" else sys.exit(int(sys.argv[1]))
elif sys.argv[2:] == ["alive"]:
    time.sleep(60)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how, status, line",
    [
        ("3", 3, "fsdp2kit launch: rank 1 exited with status 3"),
        ("kill", 128 + 9, "fsdp2kit launch: rank 1 killed by SIGKILL"),
        ("0", 0, None),
        # the cause first, and its status, though torchrun's SIGTERM to rank 0 lands in the same second
        ("3 alive", 3, "fsdp2kit launch: rank 1 exited with status 3, then rank 0 killed by SIGTERM"),
    ],
)
def test_a_failed_worker_is_one_line(tmp_path, how, status, line):
    (tmp_path / "worker.py").write_text(WORKER)
    proc = subprocess.run(
        [FSDP2KIT, "launch", "--nproc_per_node", "2", "--max-restarts", "0", "worker.py", *how.split()],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=100,
    )
    # the worker's own line, then the launcher's, and nothing of torchrun's (no traceback, no log lines)
    assert proc.stdout == "rank 1 ends\n", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ([line] if line else []), proc.stderr
    assert proc.returncode == status, proc.stderr
