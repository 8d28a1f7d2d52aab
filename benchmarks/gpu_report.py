"""Machine description, memory readers and the JSON + markdown files of the GPU benchmark (gpu_bench.py)."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import re
import subprocess
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2kit.mfu import peak_flops

GIB = 2**30


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def _git_rev() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
        return rev.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL: the record says so instead of failing the run
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def describe_machine(info) -> dict:
    """Device, software and host, as recorded beside every figure."""
    device = info.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        gpu = {
            "device": name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "gpu_count": torch.cuda.device_count(),
            "peak_bf16_flops": peak_flops(device),
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(),
        }
    else:
        name = "cpu"
        gpu = {"device": f"CPU ({platform.processor() or platform.machine()})", "gpu_count": 0, "peak_bf16_flops": None}
    with open("/proc/meminfo") as f:
        mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    return {
        **gpu,
        "slug": re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world": info.world_size,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "torchao": _version("torchao"),
        "python": platform.python_version(),
        "fsdp2kit_rev": _git_rev(),
        "host_cpus": os.cpu_count(),
        "host_memory_bytes": mem,
        "loadavg_start": os.getloadavg(),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_per_rank(device: torch.device) -> list[dict]:
    """Every rank's allocator high-water marks since the last reset (None on CPU)."""
    mine = {"max_allocated": None, "max_reserved": None}
    if device.type == "cuda":
        mine = {
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "max_reserved": torch.cuda.max_memory_reserved(device),
        }
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def filesystem(path: Path) -> str:
    """The file system type holding ``path`` (tmpfs makes disk figures memory figures)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if real.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def junit_summary(path: str | None) -> dict | None:
    """Counts and failures of a pytest JUnit XML file (the cuda tests of `make gpu-check`)."""
    if not path:
        return None
    if not Path(path).is_file():
        return {"status": f"no test report at {path} (the tests did not run or were killed)"}
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed, skipped = [], []
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name')}"
        for tag in ("failure", "error"):
            bad = c.find(tag)
            if bad is not None:
                failed.append({"test": name, "message": (bad.get("message") or "")[:400]})
        skip = c.find("skipped")
        if skip is not None:
            skipped.append({"test": name, "reason": (skip.get("message") or "")[:200]})
    return {
        "tests": len(cases),
        "passed": len(cases) - len(failed) - len(skipped),
        "failed": failed,
        "skipped": skipped,
        "seconds": sum(float(c.get("time", 0)) for c in cases),
    }


def _gib(x) -> str:
    return "–" if x is None else f"{x / GIB:.1f}"


def _peak(rec: dict, key: str) -> str:
    mem = rec.get("memory") or []
    vals = [m[key] for m in mem if m and m.get(key) is not None]
    return _gib(max(vals)) if vals else "–"


def _train_rows(recs: list[dict]) -> list[str]:
    rows = [
        "| model | variant | batch x seq | tokens/s | MFU | step ms | planner step ms | max allocated GiB "
        "| planner live GiB | / allocated | max reserved GiB | planner GiB (live + margin) | / reserved "
        "| first step s | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in recs:
        if r.get("status") != "ok":
            rows.append(
                f"| {r.get('model', '')} | {r.get('variant', '')} | {r.get('batch', '')}x{r.get('seq', '')} "
                f"| | | | | | | | | | | | {r.get('status', '')} |"
            )
            continue
        planner = r.get("planner", {})
        ok = planner.get("status") == "ok"
        peak = planner.get("peak_bytes") if ok else None
        margin = ((planner.get("report") or {}).get("parts") or {}).get("margin", 0)
        live = None if peak is None else peak - margin  # the allocator's margin is for reserved memory
        planned = _gib(peak) if ok else planner.get("status", "–")
        mem = r.get("memory") or []
        allocated = max((m["max_allocated"] for m in mem if m and m.get("max_allocated")), default=None)
        reserved = max((m["max_reserved"] for m in mem if m and m.get("max_reserved")), default=None)
        vs_allocated = f"{live / allocated - 1:+.2%}" if live and allocated else "–"
        vs_reserved = f"{peak / reserved - 1:+.2%}" if peak and reserved else "–"
        mfu = "–" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        pred = r.get("step_prediction") or {}
        predicted = f"{1000 * pred['step_seconds']:.0f}" if pred.get("status") == "ok" else pred.get("status", "–")
        name = r["model"] + (" (CPU offload, " + r["optimizer"] + ")" if r.get("cpu_offload") else "")
        rows.append(
            f"| {name} | {r['variant']} | {r['batch']}x{r['seq']} | {r['tokens_per_s']:,.0f} | {mfu} "
            f"| {1000 * r['step_s']:.0f} | {predicted} | {_gib(allocated)} | {_gib(live)} | {vs_allocated} "
            f"| {_gib(reserved)} | {planned} | {vs_reserved} | {r['first_step_s']:.1f} | ok |"
        )
    return rows


def markdown(result: dict) -> str:
    r = result
    lines = [
        f"# GPU benchmark: {r['device']}"
        + (" (DRY RUN on CPU: code path only, no figure means anything)" if r["dry_run"] else ""),
        "",
        f"{r['date']}; {r['gpu_count']} GPU(s), capability {r.get('capability', '–')}, "
        f"{_gib(r.get('gpu_memory_bytes'))} GiB; world {r['world']}; torch {r['torch']} (CUDA {r.get('cuda', '–')}, "
        f"NCCL {r.get('nccl', '–')}), transformers {r['transformers']}, torchao {r['torchao']}; fsdp2kit {r['fsdp2kit_rev']}; "
        f"host {r['host_cpus']} CPUs, {_gib(r['host_memory_bytes'])} GiB; load average at start "
        f"{', '.join(f'{x:.1f}' for x in r['loadavg_start'])}. Time used {r.get('elapsed_s', 0):.0f} s of a {r['budget_s']:.0f} s budget.",
        "",
        "## cuda tests",
        "",
    ]
    tests = r.get("tests")
    if tests is None:
        lines.append("Not run with this benchmark.")
    elif "status" in tests:
        lines.append(tests["status"])
    else:
        lines.append(
            f"{tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped "
            f"of {tests['tests']} ({tests['seconds']:.0f} s)."
        )
        lines += [f"- FAILED {f['test']}: {f['message']}" for f in tests["failed"]]
        lines += [f"- skipped {s['test']}: {s['reason']}" for s in tests["skipped"]]
    peak = r.get("peak_bf16_flops")
    lines += [
        "",
        "## Training steps",
        "",
        "bf16 compute over fp32 master weights (FSDP2 mixed precision), AdamW unless said, random tokens; "
        "median of the timed steps after warm-up. MFU = model FLOPs (6 per parameter per token, the tied head "
        "counted once, plus attention) x tokens/s / the device's dense bf16 peak "
        + (f"({peak / 1e12:.0f} TFLOP/s)" if peak else "(unknown for this device: no MFU)")
        + "; activation recomputation is not counted as useful work. Memory: the allocator's high-water marks "
        f"during the steps, worst rank. Planner: {r['planner']}; its step time is `predict_step` on this "
        "GPU's preset (fsdp2kit/planner/hardware.py; compile and float8 are not modelled).",
        "",
        *_train_rows(r["train"] + ([r["offload"]] if r.get("offload") and r["offload"].get("variant") else [])),
    ]
    if r.get("offload") and not r["offload"].get("variant"):
        lines += ["", f"8B with CPU offload: {r['offload']['status']}"]
    ck = r.get("checkpoint")
    if ck:
        lines += ["", "## Checkpointer from GPU memory", ""]
        if ck.get("status") != "ok":
            lines.append(ck.get("status", ""))
        else:
            a1, a2 = ck["async_1"], ck["async_2"]
            lines += [
                f"Model + AdamW state, {_gib(ck['rank_bytes'])} GiB per rank, written to {ck['fs']}. "
                f"Synchronous save {ck['save_s']:.1f} s ({ck['save_gb_per_s_per_rank']:.2f} GB/s per rank), "
                f"load {ck['load_s']:.1f} s ({ck['load_gb_per_s_per_rank']:.2f} GB/s; the files were just written, "
                "so likely from the page cache).",
                "",
                f"Asynchronous save: the training loop stalls {a1['stall_s']:.2f} s on the first save (which also "
                f"allocates the pinned staging buffers) and {a2['stall_s']:.2f} s on later ones "
                f"({ck['staging_gb_per_s_per_rank']:.1f} GB/s device-to-host); a step during the write took "
                f"{1000 * a2['step_during_write_s']:.0f} ms against {1000 * ck['plain_step_s']:.0f} ms without one; "
                f"the write finished {a2['write_s']:.1f} s after that step.",
            ]
    lp = r.get("load_pretrained")
    if lp:
        lines += ["", "## load_pretrained onto the GPU", ""]
        if lp.get("status") != "ok":
            lines.append(lp.get("status", ""))
        else:
            lines.append(
                f"{lp['model']} from a local bf16 safetensors export ({lp['fs']}; exported by export_hf in "
                f"{lp['export_hf_s']:.1f} s): {lp['load_s']:.1f} s, {lp['gb_per_s_rank0']:.2f} GB/s read by rank 0, "
                f"GPU peak {_peak(lp, 'max_allocated')} GiB allocated, host memory grew {_gib(lp['rss_growth'])} GiB."
            )
    if r["skipped"]:
        lines += ["", "## Not measured", "", *[f"- {s}" for s in r["skipped"]]]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write (or rewrite) the JSON and markdown files; returns their paths."""
    result["tests"] = junit_summary(result.get("tests_junit"))
    result["loadavg_now"] = os.getloadavg()
    out_dir.mkdir(parents=True, exist_ok=True)
    day = result["date"][:10]
    tag = f"-{result['tag']}" if result.get("tag") else ""
    stem = f"gpu-{'dryrun-' if result['dry_run'] else ''}{result['slug']}-{day}{tag}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md_path.write_text(markdown(result))
    return json_path, md_path
