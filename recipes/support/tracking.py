"""Experiment trackers for the recipe (TensorBoard, Weights & Biases, MLflow) behind the JSONL log, on rank 0 only.

Each tracker is an optional extra (``pip install 'fsdp2kit[tensorboard]'``, ``[wandb]``,
``[mlflow]``) chosen by ``[log] trackers = "tensorboard,wandb,mlflow"``. `RunLog.log` takes the
same records the JSONL file gets: the start record's ``config`` becomes the run's configuration;
every other number (loss, eval loss, lr, grad norm, tokens/s, MFU, peak memory) is a scalar at
the record's ``step``; a list (``peak_rss_gib_per_rank``) becomes one scalar per rank; text
(the start event's ``memory_plan`` and ``shard_plan``) stays in the JSONL file only.
Nothing here talks to a network: W&B runs in offline mode (``wandb sync`` uploads later) unless
``WANDB_MODE`` says otherwise, and MLflow writes to a local file store (``MLFLOW_TRACKING_URI``
overrides it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.metrics import JsonlLogger

__all__ = ["TRACKERS", "RunLog", "TrackerError", "parse_trackers"]

TRACKERS = ("tensorboard", "wandb", "mlflow")
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackerError(ValueError):
    pass


def parse_trackers(names: str) -> list[str]:
    out = [n.strip().lower() for n in names.split(",") if n.strip()]
    for n in out:
        if n not in TRACKERS:
            raise TrackerError(f"[log] trackers: unknown tracker {n!r}; known: {', '.join(TRACKERS)}")
    return out


def _import(name: str, module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise TrackerError(
            f"[log] trackers asks for {name}, which is not installed: pip install 'fsdp2kit[{_EXTRA[name]}]'"
        ) from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record as tracker scalars: lists become ``key/rank_<i>``."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/rank_{i}": float(x) for i, x in enumerate(v)})
    return out


class _TensorBoard:
    def __init__(self, root: Path, run: str, config: dict):
        tensorboard = _import("tensorboard", "torch.utils.tensorboard")
        _import("tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(log_dir=str(root / "tensorboard" / run))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, root: Path, run: str, config: dict, project: str):
        import os

        wandb = _import("wandb", "wandb")
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run,
            dir=str(root),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="finish_previous",
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, root: Path, run: str, config: dict, project: str):
        import os

        mlflow = _import("mlflow", "mlflow")
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A local file store, as the recipe promises no network and no database; MLflow 3
            # keeps it working behind this switch (a server: set MLFLOW_TRACKING_URI instead).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((root / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=run)
        flat = {f"{t}.{k}": v for t, table in config.items() if isinstance(table, dict) for k, v in table.items()}
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        # MLflow metric names may not contain some characters; '/' and '_' are fine.
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class RunLog:
    """The JSONL log plus the chosen trackers; only the rank created with ``enabled=True`` writes anything."""

    def __init__(
        self,
        jsonl: str | Path | None,
        *,
        trackers: str = "",
        directory: str | Path = "outputs/tracking",
        project: str = "fsdp2kit",
        run_name: str = "",
        enabled: bool = True,
    ):
        self.names = parse_trackers(trackers)  # every rank checks the names: a typo fails everywhere
        self.jsonl = JsonlLogger(jsonl, enabled=enabled)
        self.enabled = enabled
        self.directory, self.project, self.run_name = Path(directory), project, run_name
        self.trackers: list = []
        self._started = False

    def _start(self, config: dict) -> None:
        self._started = True
        if not self.enabled:
            return
        run = self.run_name or "run"
        for name in self.names:
            if name == "tensorboard":
                self.trackers.append(_TensorBoard(self.directory, run, config))
            elif name == "wandb":
                self.trackers.append(_Wandb(self.directory, run, config, self.project))
            else:
                self.trackers.append(_MLflow(self.directory, run, config, self.project))

    def log(self, record: dict[str, Any]) -> None:
        self.jsonl.log(record)
        if not self._started:
            self._start(record.get("config", {}))
        values = scalars({k: v for k, v in record.items() if k not in ("world_size",)})
        if self.enabled and values and "step" in record:
            for t in self.trackers:
                t.log(values, int(record["step"]))

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers.clear()
