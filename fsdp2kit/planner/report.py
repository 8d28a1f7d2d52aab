"""MemoryPlan: the predicted per-rank peak, its parts and when it happens, as a table or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp2kit._internal.fmt import fmt_bytes

__all__ = ["PART_NAMES", "MemoryPlan"]

# Parts of the peak, in table order, with what each one holds.
PART_NAMES: dict[str, str] = {
    "params": "sharded parameters (master dtype)",
    "gathered": "unsharded parameters of the units gathered at the peak",
    "comm_buffers": "all-gather / reduce-scatter flat buffers in flight",
    "unsharded_grads": "gradients of the unit in backward, before its reduce-scatter",
    "grads": "sharded gradients",
    "optimizer": "optimizer state",
    "activations": "activations saved for backward, still held",
    "temporaries": "everything else alive at the peak (logits/loss, recompute, op outputs, optimizer temporaries)",
    "margin": "allocator margin (see margin_bytes)",
}


def _ac_name(ac: Any) -> str:
    if ac is None:
        return "none"
    if callable(ac):
        return getattr(ac, "__name__", "custom")
    return f"every {ac}" if isinstance(ac, int) else str(ac)


@dataclass
class MemoryPlan:
    """What `fsdp2kit.plan_memory` returns: ``peak_bytes`` per rank, ``parts`` at that moment, ``phase``."""

    config: dict[str, Any]
    peak_bytes: int
    phase: str  # "forward <module>", "backward <unit>", "optimizer step"
    parts: dict[str, int]
    # Figures that are not parts of the peak but explain it.
    saved_activations: int = 0  # at the end of forward (all blocks)
    activations_per_block: int = 0  # the largest block's
    logits_and_loss: int = 0  # held from the loss to backward (fp32 upcast included)
    forward_peak: int = 0
    backward_peak: int = 0
    optimizer_peak: int = 0
    host_bytes: int = 0  # CPU memory per rank with cpu_offload or optimizer_offload
    # Held all step, per rank (on the host with cpu_offload): for AdamW the ShardPlan's figures.
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    trainable_param_bytes: int = 0  # of param_bytes, the trainable parameters' (what optimizer offload moves)
    gpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)  # cheapest changes that fit (see search.py)
    measured_like: dict[str, int] = field(default_factory=dict)  # figures the CPU check compares one to one

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.peak_bytes <= self.gpu_memory

    @property
    def headroom(self) -> int | None:
        return None if self.gpu_memory is None else self.gpu_memory - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {
            "config": {k: (_ac_name(v) if callable(v) else v) for k, v in self.config.items()},
            "peak_bytes": self.peak_bytes,
            "peak_gib": round(self.peak_bytes / 2**30, 3),
            "phase": self.phase,
            "parts": dict(self.parts),
        }
        named = ("saved_activations", "activations_per_block", "logits_and_loss", "forward_peak", "backward_peak")
        out |= {f"{n}_bytes": getattr(self, n) for n in (*named, "optimizer_peak")}
        out |= {n: getattr(self, n) for n in ("host_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")}
        out["gpu_memory_bytes"] = self.gpu_memory
        return out | {
            "fits": self.fits,
            "headroom_bytes": self.headroom,
            "changes": self.changes,
            "check": self.measured_like,
            "notes": self.notes,
        }

    def __str__(self) -> str:
        c = self.config
        mesh = f"shard={c['shard']}" + "".join(f" x {k}={c[k]}" for k in ("replicate", "cp", "tp") if c.get(k, 1) > 1)
        head = (
            f"Memory plan: {c.get('model', '')} on {mesh}, batch {c['batch']} x seq {c['seq']}, "
            f"AC {_ac_name(c['activation_checkpointing'])}, precision {c['mixed_precision'] or 'as built'}, "
            f"optimizer {c['optimizer']}" + (", CPU offload" if c.get("cpu_offload") else "")
        )
        head += ", optimizer state offloaded" if c.get("optimizer_offload") else ""
        if c.get("lora"):
            targets = c.get("lora_targets", "all-linear")
            head += f", {'QLoRA' if c.get('qlora') else 'LoRA'} r={c['lora']} on "
            head += targets if isinstance(targets, str) else ",".join(targets)
        elif c.get("peft"):
            head += ", the peft model's adapters trained"
        if "master_dtype" in c:
            head += f"\nmaster weights {c['master_dtype']}, optimizer state {c['state_dtype']}"
        rows = [(k, fmt_bytes(v), PART_NAMES[k]) for k, v in self.parts.items()]
        rows.append(("peak", fmt_bytes(self.peak_bytes), f"per rank, in {self.phase}"))
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = [head, *(f"{a.ljust(w0)}  {b.rjust(w1)}  {d}" for a, b, d in rows)]
        lines.insert(-1, "-" * (w0 + w1 + 4))  # above the peak
        lines.append(
            f"forward peak {fmt_bytes(self.forward_peak)}, backward peak {fmt_bytes(self.backward_peak)}, "
            f"optimizer step {fmt_bytes(self.optimizer_peak)}; activations saved at the end of forward "
            f"{fmt_bytes(self.saved_activations)} ({fmt_bytes(self.activations_per_block)} in the largest block), "
            f"logits and loss {fmt_bytes(self.logits_and_loss)}"
        )
        lines.append(
            f"per rank, all step: parameters {fmt_bytes(self.param_bytes)}, gradients {fmt_bytes(self.grad_bytes)}, "
            f"optimizer state {fmt_bytes(self.optimizer_bytes)}"
        )
        if self.host_bytes:
            what = "CPU offload" if c.get("cpu_offload") else "optimizer state, its step's parameters and gradients"
            lines.append(f"host memory per rank ({what}): {fmt_bytes(self.host_bytes)}")
        lines += [f"note: {n}" for n in self.notes]
        if self.gpu_memory is not None:
            verdict = "yes" if self.fits else "no"
            lines.append(f"fits: {verdict}, headroom {self.headroom / 2**30:.1f} GiB (of {fmt_bytes(self.gpu_memory)})")
        if self.changes:
            lines.append("cheapest changes that fit, cheapest first (then the recipe's options for it):")
            width = max(44, *(len(ch["change"]) for ch in self.changes))
            for ch in self.changes:
                lines.append(f"  {ch['change']:<{width}} peak {fmt_bytes(ch['peak_bytes']):>10}  cost {ch['cost']}")
                if ch.get("recipe"):
                    lines.append(f"    recipes/train.py {ch['recipe']}")
        elif self.fits is False:
            lines.append("no single change in the search fits; try combining them or more ranks")
        return "\n".join(lines)
