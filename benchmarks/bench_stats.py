"""Step-time statistics of the FSDP benchmark: medians, quartiles, paired per-round ratios, loss parity."""

from __future__ import annotations

import math
import statistics

__all__ = ["loss_parity", "quantile", "summarize_time", "throughput_ratio"]


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_time(t: dict, tokens_per_step: int, flops_per_token: float, peak: float | None) -> dict:
    xs = t["step_times_s"]
    med = statistics.median(xs)
    tps = tokens_per_step / med
    return {
        "median_step_s": med,
        "p25_step_s": quantile(xs, 0.25),
        "p75_step_s": quantile(xs, 0.75),
        "min_step_s": min(xs),
        "max_step_s": max(xs),
        "tokens_per_s_per_rank": tps,
        "mfu": tps * flops_per_token / peak if peak else None,
        **t,
    }


def throughput_ratio(num: dict, den: dict) -> dict:
    """Throughput of ``num`` over ``den``: the ratio of median step times, and the quartiles of
    the per-round ratios (the two steps of a round ran back to back, so each ratio carries
    little of the machine's drift)."""
    per_round = [td / tn for tn, td in zip(num["step_times_s"], den["step_times_s"])]
    return {
        "ratio": den["median_step_s"] / num["median_step_s"],
        "round_median": statistics.median(per_round),
        "round_p25": quantile(per_round, 0.25),
        "round_p75": quantile(per_round, 0.75),
    }


def loss_parity(results: dict[str, dict], reference: str, compiled: set[str], tol: float, tol_compiled: float) -> dict:
    ref = results[reference]["losses_per_rank"]
    per_variant = {}
    for key, r in results.items():
        worst = max(
            abs(a - b) / abs(b) for mine, theirs in zip(r["losses_per_rank"], ref) for a, b in zip(mine, theirs)
        )
        limit = tol_compiled if key in compiled else tol
        per_variant[key] = {"max_rel_diff": worst, "tolerance": limit, "ok": worst <= limit}
    return {"reference": reference, "variants": per_variant, "ok": all(p["ok"] for p in per_variant.values())}
