"""Stop signals, tracker choice and the trackers' output, without a process group of more than one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fsdp2kit as fk
from fsdp2kit.diagnostics.desync import _process_end
from fsdp2kit.stop import parse_signals
from support.tracking import RunLog, TrackerError, parse_trackers, scalars


def test_signal_names_parse_and_bad_ones_are_named():
    assert parse_signals("SIGTERM, usr1,10") == [signal.SIGTERM, signal.SIGUSR1, signal.Signals(10)]
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        parse_signals("SIGNOPE")
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        parse_signals("SIGKILL")


@pytest.mark.timeout(60)
def test_a_signal_sets_the_flag_and_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR2)
    with fk.StopSignal("SIGUSR2") as stop:
        assert not stop.requested and not stop.should_stop()
        os.kill(os.getpid(), signal.SIGUSR2)  # delivered to the main thread before the next bytecode
        assert stop.requested and stop.received == signal.SIGUSR2
        assert stop.should_stop() and stop.describe().startswith("SIGUSR2 reached rank 0")
    assert signal.getsignal(signal.SIGUSR2) is before


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_first_time_and_aborts_the_second_time():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    seen = []
    with fk.StopSignal(repeat_after=0.2, on_signal=seen.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C: a stop, not a KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)  # torchrun forwarding the same Ctrl-C a moment later
        assert stop.received == signal.SIGINT and seen == [signal.SIGINT]
        assert stop.should_stop() and stop.describe().startswith("SIGINT reached rank 0")
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: KeyboardInterrupt, at once
        assert {s: signal.getsignal(s) for s in before} == before  # put back before it raised
    assert {s: signal.getsignal(s) for s in before} == before
    # torchrun turns a second Ctrl-C into SIGTERM: an abort too
    with fk.StopSignal(repeat_after=0.2) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM after SIGINT"):
            os.kill(os.getpid(), signal.SIGTERM)
    # a scheduler's signals are not a user at the terminal: a repeat is only a stop
    with fk.StopSignal(repeat_after=0.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before


def test_tracker_names_and_scalars():
    assert parse_trackers(" tensorboard ,MLflow") == ["tensorboard", "mlflow"]
    with pytest.raises(TrackerError, match="unknown tracker 'neptune'"):
        parse_trackers("tensorboard,neptune")
    values = scalars({"step": 3, "loss": 2.5, "peak_mem_gib_per_rank": [1.0, 2.0], "event": "x", "ok": True})
    assert values == {"loss": 2.5, "peak_mem_gib_per_rank/rank_0": 1.0, "peak_mem_gib_per_rank/rank_1": 2.0}


def test_a_missing_tracker_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    log = RunLog(tmp_path / "log.jsonl", trackers="wandb", directory=tmp_path)
    with pytest.raises(TrackerError, match=r"pip install 'fsdp2kit\[wandb\]'"):
        log.log({"event": "start", "step": 0, "config": {}})


def _records():
    yield {"event": "start", "step": 0, "config": {"train": {"lr": 0.003, "steps": 3}}, "world_size": 2}
    for step in (1, 2, 3):
        yield {"step": step, "loss": 4.0 / step, "lr": 0.003, "peak_mem_gib_per_rank": [0.5, 0.25]}


@pytest.mark.timeout(120)
def test_mlflow_local_file_store_reads_back(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log = RunLog(None, trackers="mlflow", directory=tmp_path, project="p", run_name="r")
    for r in _records():
        log.log(r)
    run_id = log.trackers[0].run.info.run_id
    log.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.003" and run.info.run_name == "r"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 4.0), (2, 2.0), (3, 4 / 3)]
    assert run.data.metrics["peak_mem_gib_per_rank/rank_1"] == 0.25


@pytest.mark.timeout(180)
def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = RunLog(None, trackers="wandb", directory=tmp_path, project="p", run_name="r")
    for r in _records():
        log.log(r)
    run = log.trackers[0].run
    assert run.offline and run.config["train"]["lr"] == 0.003
    log.close()  # W&B commits a step's values when the next step (or the end) comes
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The offline record log that `wandb sync` uploads, JSON values inside. W&B's own service
    # process writes it, and on a loaded machine it was seen still flushing after finish()
    # returned (the file held its header only): wait for it a while before judging.
    deadline = time.monotonic() + 60
    while True:
        data = runs[0].read_bytes()
        found = b"peak_mem_gib_per_rank/rank_1" in data and repr(4 / 3).encode() in data
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert found, data[:200]


@pytest.mark.timeout(60)
def test_a_killed_process_is_named_with_its_signal_until_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert _process_end(proc.pid) is None  # running
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _process_end(proc.pid) == "was killed by SIGKILL"  # a zombie: its parent has not reaped it
    proc.wait()
    assert _process_end(proc.pid) == "has exited"
