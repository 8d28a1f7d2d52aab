"""GPU presets for the step-time model, TOML files and overrides (docs/step_time.md, "Presets and their sources")."""

from __future__ import annotations

import dataclasses
import os

import tomllib

__all__ = ["GPUS", "Hardware", "load_hardware"]

_MIB = 2**20
_GBIT = 10**9 / 8  # bytes/s in one Gb/s


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and how it is wired. Bandwidths are one direction's bytes/s (what a ring collective's busbw reaches
    at most); ``network_bytes_per_s`` is a node's total off-node bandwidth, shared by its GPUs."""

    name: str
    bf16_flops: float  # dense (no sparsity) peak
    fp8_flops: float | None  # dense peak; None: no fp8 tensor cores
    memory_bytes: int  # HBM a GPU that CUDA can see (nvidia-smi's total where known; else the datasheet's GB)
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # intra-node, per GPU, one direction
    network_bytes_per_s: float  # inter-node, per node, one direction
    # host <-> GPU, one direction (offload's transfers): PCIe Gen5 x16, the datasheets' 128 GB/s being both ways
    host_bytes_per_s: float = 64e9
    # host memory bandwidth per GPU (optimizer offload's host AdamW step): an assumption, not measured: a
    # 2-socket DDR5-4800 host, 8 channels a socket (2 x 307 GB/s peak), shared by 8 GPUs
    host_memory_bytes_per_s: float = 76.8e9
    gpus_per_node: int = 8
    latency_s: float = 10e-6  # per collective step: NCCL's small-message floor is ~10 us intra-node
    efficiency: float = 0.5  # achievable fraction of bf16_flops for the step's matmuls (the one fit)
    source: str = ""  # where the figures come from

    def check(self) -> None:
        for f in ("bf16_flops", *(n for n in _FIELDS if n.endswith("_per_s"))):
            if not getattr(self, f) > 0:
                raise ValueError(f"gpu {self.name!r}: {f}={getattr(self, f)!r} must be > 0")
        if self.memory_bytes <= 0 or self.gpus_per_node < 1 or self.latency_s < 0:
            raise ValueError(f"gpu {self.name!r}: memory_bytes, gpus_per_node must be positive, latency_s >= 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"gpu {self.name!r}: efficiency={self.efficiency!r} must be in (0, 1]")


# The fitted factors, each from one published torchtitan run (which, and how: docs/step_time.md, "Calibration";
# benchmarks/steptime_published.py --calibrate recomputes them). H200 and B200 borrow H100's.
_H100_EFF = 0.3704

_H100 = Hardware(
    name="h100",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    memory_bytes=81559 * _MIB,  # nvidia-smi's total for the 80GB HBM3 card
    hbm_bytes_per_s=3350e9,
    nvlink_bytes_per_s=450e9,  # NVLink 4: 900 GB/s both directions
    network_bytes_per_s=8 * 400 * _GBIT,  # DGX H100: 8 x 400 Gb/s NDR InfiniBand (ConnectX-7)
    efficiency=_H100_EFF,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM); DGX H100 datasheet (8x NDR 400 Gb/s)",
)

GPUS: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100",
        bf16_flops=312e12,
        fp8_flops=None,
        memory_bytes=81920 * _MIB,  # nvidia-smi's total for the 80GB card
        hbm_bytes_per_s=2039e9,
        nvlink_bytes_per_s=300e9,  # NVLink 3: 600 GB/s both directions
        network_bytes_per_s=8 * 200 * _GBIT,  # DGX A100: 8 x 200 Gb/s HDR InfiniBand (compute fabric)
        host_bytes_per_s=32e9,  # PCIe Gen4 x16: the datasheet's 64 GB/s is both directions
        host_memory_bytes_per_s=51.2e9,  # assumed: 2 sockets of 8-channel DDR4-3200 shared by 8 GPUs
        efficiency=0.6100,  # fitted, as _H100_EFF
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); DGX A100 datasheet (8x HDR 200 Gb/s)",
    ),
    "h100": _H100,
    "h200": dataclasses.replace(
        _H100,
        name="h200",
        memory_bytes=143771 * _MIB,  # nvidia-smi's total for the 141GB card
        hbm_bytes_per_s=4800e9,  # and as H100: NVLink 4, one 400 Gb/s NIC a GPU (HGX H200)
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM); 8x 400 Gb/s NICs assumed",
    ),
    "b200": Hardware(
        name="b200",
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        memory_bytes=180 * 10**9,  # the datasheet's 180 GB (decimal: a conservative reading)
        hbm_bytes_per_s=8000e9,
        nvlink_bytes_per_s=900e9,  # NVLink 5: 1.8 TB/s both directions
        network_bytes_per_s=8 * 400 * _GBIT,  # DGX B200: 8 x 400 Gb/s (ConnectX-7)
        efficiency=_H100_EFF,
        source="NVIDIA DGX B200 / HGX B200 datasheets (per-GPU figures: the 8-GPU totals / 8)",
    ),
}
_ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "h200-sxm": "h200"}

_FIELDS = {f.name: f for f in dataclasses.fields(Hardware)}


def load_hardware(spec: str | Hardware, **overrides: float | int | None) -> Hardware:
    """A preset name (``"h100"``) or a ``.toml`` file of `Hardware` fields (``base = "h100"`` starts from a preset,
    else every peak is required), with ``overrides`` (a field each; None: kept)."""
    fields, where = {}, ""
    if isinstance(spec, str) and spec.endswith(".toml"):
        with open(spec, "rb") as f:
            table = tomllib.load(f)
        fields, where = {"name": os.path.basename(spec), **table.get("gpu", table)}, f"{spec}: "
        spec = fields.pop("base", None)
    fields |= {k: v for k, v in overrides.items() if v is not None}
    bad = sorted(set(fields) - set(_FIELDS))
    if bad:
        where = where if set(bad) - set(overrides) else ""  # an override's typo is not the file's
        raise ValueError(f"{where}unknown gpu field(s) {bad}: expected some of {sorted(_FIELDS)}")
    if spec is None:
        missing = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING and n not in fields]
        if missing:
            raise ValueError(f"{where}missing gpu field(s) {missing} (or give base = one of {sorted(GPUS)})")
        hw = Hardware(**fields)
    elif isinstance(spec, Hardware):
        hw = dataclasses.replace(spec, **fields)
    else:
        key = _ALIASES.get(spec.lower(), spec.lower())
        if key not in GPUS:
            raise ValueError(f"unknown gpu {spec!r}: use one of {sorted(GPUS)} or a .toml file of Hardware fields")
        hw = dataclasses.replace(GPUS[key], **fields)
    hw.check()
    return hw
