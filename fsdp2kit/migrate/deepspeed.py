"""DeepSpeed's ZeRO JSON config (and Accelerate's deepspeed_config block) -> recipe settings, key by key
(stages, "auto" and every key: docs/migrating.md)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from fsdp2kit.migrate.conversion import NO_GAIN, Conversion, Rule, apply_rules, mapped, refused_when, truthy

__all__ = ["convert_accelerate_deepspeed", "convert_deepspeed"]

AUTO = "'auto' is filled in by the HF Trainer / Accelerate from the training script; the recipe's default applies"
TUNING = "DeepSpeed bucket/overlap tuning; FSDP2 overlaps per unit (one all-gather / reduce-scatter per block)"
EXPORT = "fsdp2kit export-hf / fk.export_hf write consolidated weights from any checkpoint"
NVME = "NVMe offload is not in FSDP2: cpu_offload = true keeps the sharded state in CPU memory, or add GPUs"
STAGE_STRATEGY = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
STAGE_NOTES = {
    0: "no ZeRO: whole model on every rank, gradients all-reduced",
    1: "FSDP2 has no optimizer-only sharding; SHARD_GRAD_OP also shards gradients and parameters at rest",
    2: "parameters stay gathered from forward to backward; gradients and optimizer state sharded",
    3: "parameters, gradients and optimizer state sharded; each block gathered when it runs",
}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _unless_auto(rule: Rule) -> Rule:
    """``rule``, except that ``"auto"`` leaves the recipe's default."""
    return lambda conv, src, value: conv.not_needed(src, value, AUTO) if _is_auto(value) else rule(conv, src, value)


def _stage(conv: Conversion, src: str, value: Any) -> None:
    stage = int(value)
    if stage in STAGE_STRATEGY:
        conv.set("parallel", "strategy", STAGE_STRATEGY[stage], src, value, STAGE_NOTES[stage])
    else:
        conv.refuse(src, value, "ZeRO stages are 0-3")


def _offload(conv: Conversion, src: str, value: Any) -> None:
    device = str(value).lower()
    if device == "none":
        conv.not_needed(src, value, NO_GAIN)
    elif device == "cpu":
        why = "FSDP2's CPU offload moves parameters, gradients and the optimizer step to CPU together"
        conv.set("parallel", "cpu_offload", True, src, value, why)
    else:
        conv.refuse(src, value, NVME if device == "nvme" else "expected device none, cpu or nvme")


TRAIN: dict[str, Rule] = {
    "train_micro_batch_size_per_gpu": _unless_auto(mapped("data", "batch_size", int)),
    "gradient_accumulation_steps": _unless_auto(mapped("train", "grad_accum", int, "micro-steps run under fk.no_sync")),
    "gradient_clipping": _unless_auto(mapped("train", "clip", float, "fk.clip_grad_norm_ over all shards (0: off)")),
    "seed": _unless_auto(mapped("train", "seed", int)),
}


def _zero3_init(conv: Conversion, src: str, value: Any) -> None:
    if truthy(value):
        conv.set("model", "meta_init", True, src, value, "meta-device init: no rank holds the whole model")
    else:
        conv.not_needed(src, value, "the recipe builds on the meta device unless [model] meta_init = false")


HOSTS = "torchrun has no hostfile: run it on each node (or under Slurm)"
ACCELERATE_DS: dict[str, Rule] = {
    "zero_stage": _stage,
    "offload_optimizer_device": _offload,
    "offload_param_device": _offload,
    **dict.fromkeys(
        ("offload_optimizer_nvme_path", "offload_param_nvme_path"),
        refused_when(lambda v: str(v).lower() not in ("none", ""), NVME),
    ),
    **{key: TRAIN[key] for key in ("gradient_accumulation_steps", "gradient_clipping")},
    "zero3_save_16bit_model": EXPORT,
    "zero3_init_flag": _zero3_init,
    "deepspeed_moe_layer_cls_names": "MoE blocks are found and sharded like any other block",
    "deepspeed_multinode_launcher": "torchrun launches each node (or recipes/slurm.sh under Slurm)",
    **dict.fromkeys(
        ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"),
        refused_when(lambda v: v not in (None, "", "none"), HOSTS),
    ),
}


def convert_deepspeed(data: dict, path: str) -> Conversion:
    """Convert the parsed JSON of a DeepSpeed config file."""
    conv = Conversion("DeepSpeed", path)
    _convert(conv, dict(data), "")
    conv.torchrun_options.append("--standalone")
    return conv


def convert_accelerate_deepspeed(conv: Conversion, cfg: dict, yaml_path: str) -> None:
    """Accelerate's ``deepspeed_config`` block: its own names, or a pointer to a DeepSpeed JSON file (read first)."""

    def config_file(conv: Conversion, src: str, name: Any) -> None:
        file = Path(name) if Path(name).is_absolute() else Path(yaml_path).parent / name
        if not file.is_file():
            conv.refuse(src, name, f"{file} is not there: convert the JSON file itself")
            return
        conv.launch(src, name, "(its keys follow, prefixed with its name)")
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            conv.refuse(src, name, f"cannot read it as JSON: {e}")
            data = {}
        _convert(conv, data, f"{name}:")

    # deepspeed_config_file first: the JSON file's keys are converted before the block's other keys
    first = {k: cfg[k] for k in ("deepspeed_config_file",) if k in cfg}
    apply_rules(conv, first | cfg, {"deepspeed_config_file": config_file, **ACCELERATE_DS}, "deepspeed_config.")


def _block(convert: Any) -> Rule:
    """A rule for a nested block: ``convert(conv, dict, prefix)`` on its keys."""
    return lambda conv, src, value: convert(conv, dict(value or {}), src + ".")


def _convert(conv: Conversion, data: dict, p: str) -> None:
    micro, accum = data.get("train_micro_batch_size_per_gpu"), data.get("gradient_accumulation_steps")

    def train_batch_size(conv: Conversion, src: str, value: Any) -> None:
        if isinstance(micro, int) and isinstance(accum, int) and micro * accum and value % (micro * accum) == 0:
            ranks = value // (micro * accum)
            conv.nproc_per_node = conv.nproc_per_node or ranks
            why = "one node assumed; train_batch_size = micro batch x grad_accum x ranks, which the recipe derives"
            conv.launch(src, value, f"{ranks} ranks in all", why)
        else:
            conv.not_needed(src, value, "derived: data.batch_size x train.grad_accum x the world size")

    apply_rules(conv, data, {"train_batch_size": _unless_auto(train_batch_size), **TOP}, p)


def _precision(key: str, conv: Conversion, src: str, value: Any) -> None:
    cfg = dict(value) if isinstance(value, dict) else {"enabled": value}
    enabled = cfg.pop("enabled", False)
    if key == "amp":
        conv.refuse_if(truthy(enabled), src + ".enabled", enabled, "apex AMP is not used: mixed_precision = 'bf16'")
        for k, v in cfg.items():
            conv.not_needed(f"{src}.{k}", v, "apex AMP option")
        return
    if _is_auto(enabled):
        conv.not_needed(src + ".enabled", enabled, AUTO)
    elif truthy(enabled):
        note = "" if key == "bf16" else "fp16 compute; the recipe does not scale the loss: prefer bf16"
        conv.set("parallel", "mixed_precision", key, src + ".enabled", enabled, note)
    else:
        conv.not_needed(src + ".enabled", enabled, NO_GAIN)
    for k, v in cfg.items():
        s = f"{src}.{k}"
        if key == "fp16" and k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                   "consecutive_hysteresis", "min_loss_scale", "auto_cast"):  # fmt: skip
            conv.not_needed(s, v, "loss scaling: the recipe has none (use bf16, whose range needs none)")
        elif key == "bf16" and k in ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                                     "bf16_optimizer_states"):  # fmt: skip
            conv.not_needed(s, v, "FSDP2 keeps fp32 master weights and optimizer state")
        else:
            conv.unknown(s, v, ["enabled", "loss_scale", "initial_scale_power"])


def _activation(conv: Conversion, cfg: dict, p: str) -> None:
    why = (
        "configures deepspeed.checkpointing.checkpoint, which your model code calls; here "
        "[parallel] activation_checkpointing = 'full' checkpoints every block"
    )
    refusals = {
        "cpu_checkpointing": "activations are not offloaded to CPU by fsdp2kit",
        "partition_activations": "activations are not partitioned across ranks by fsdp2kit (no sequence split)",
    }
    for key, value in cfg.items():
        conv.refuse_if(key in refusals and truthy(value), p + key, value, refusals.get(key, ""), why)


def _optimizer(conv: Conversion, cfg: dict, p: str) -> None:
    kind = str(cfg.pop("type", "")).lower()
    note = "the recipe trains with torch.optim.AdamW"
    note += " (DeepSpeed's Adam is AdamW by default: adam_w_mode)" if kind == "adam" else ""
    why = "the recipe trains with AdamW; any torch.optim optimizer works in your own loop"
    conv.refuse_if(kind not in ("adamw", "adam"), p + "type", kind, why, note)
    for key, value in dict(cfg.pop("params", {}) or {}).items():
        src = f"{p}params.{key}"
        if _is_auto(value):
            conv.not_needed(src, value, AUTO)
        elif key == "lr":
            conv.set("train", "lr", float(value), src, value, "peak learning rate")
        elif key == "weight_decay":
            conv.set("train", "weight_decay", float(value), src, value)
        elif (key == "betas" and [float(b) for b in value] == [0.9, 0.999]) or (key == "eps" and float(value) == 1e-8):
            conv.not_needed(src, value, "torch.optim.AdamW's default")
        elif key in ("torch_adam", "adam_w_mode", "fused"):
            conv.not_needed(src, value, "torch.optim.AdamW (foreach on CPU, fused where torch picks it)")
        else:
            conv.refuse(src, value, "no recipe key: edit the AdamW line of recipes/train.py")
    for key, value in cfg.items():
        conv.unknown(p + key, value, ["type", "params"])


def _scheduler(conv: Conversion, cfg: dict, p: str) -> None:
    kind = str(cfg.pop("type", ""))
    shapes = {
        "WarmupLR": "linear warm-up then constant; the recipe decays (cosine to 10% of lr) after it",
        "WarmupDecayLR": "linear warm-up then linear decay to 0; the recipe decays by cosine to 10% of lr",
        "WarmupCosineLR": "warm-up then cosine decay; the recipe's cosine ends at 10% of lr",
    }
    why = "the recipe has one schedule (linear warm-up, cosine); yours in your own loop"
    conv.refuse_if(kind not in shapes, p + "type", kind, why, "the recipe's schedule: " + shapes.get(kind, ""))
    for key, value in dict(cfg.pop("params", {}) or {}).items():
        src = f"{p}params.{key}"
        if _is_auto(value):
            conv.not_needed(src, value, AUTO)
        elif key == "warmup_num_steps":
            conv.set("train", "warmup", int(value), src, value)
        elif key == "total_num_steps":
            conv.set("train", "steps", int(value), src, value)
        elif key in ("warmup_max_lr", "cos_max_lr"):
            conv.set("train", "lr", float(value), src, value, "peak learning rate")
        elif key in ("warmup_min_lr", "warmup_min_ratio") and float(value) == 0:
            conv.not_needed(src, value, "the recipe's warm-up starts near 0 (lr x 1/warmup at the first step)")
        elif key == "warmup_type" and value == "linear":
            conv.not_needed(src, value, "the recipe's warm-up is linear")
        else:
            conv.refuse(src, value, "no recipe key: the schedule is the lr_at function in recipes/train.py")
    for key, value in cfg.items():
        conv.unknown(p + key, value, ["type", "params"])


ZERO_TUNING = {
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "allgather_partitions",
    "reduce_scatter", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size", "round_robin_gradients",
    "use_multi_rank_bucket_allreduce", "ignore_unused_parameters", "memory_efficient_linear",
    "stage3_module_granularity_threshold", "elastic_checkpoint", "load_from_fp32_weights",
}  # fmt: skip
ZERO_PP = (
    "ZeRO++ has no FSDP2 counterpart; HSDP ([parallel] replicate = nodes, strategy = 'HYBRID_SHARD') keeps "
    "all-gathers inside a node, and float8 = true halves their bytes"
)
OFFLOAD_TUNING = {"pin_memory", "nvme_path", "buffer_count", "buffer_size", "fast_init", "max_in_cpu",
                  "pipeline_read", "pipeline_write", "ratio"}  # fmt: skip


def _zero(conv: Conversion, cfg: dict, p: str) -> None:
    for key, value in cfg.items():
        src = p + key
        if key == "stage":
            _stage(conv, src, value)
        elif key in ("offload_optimizer", "offload_param"):
            sub = dict(value) if isinstance(value, dict) else {"device": value}
            _offload(conv, f"{src}.device", sub.pop("device", "none"))
            for k, v in sub.items():
                if k == "ratio" and float(v) != 1:
                    conv.refuse(f"{src}.{k}", v, "partial offload: FSDP2 offloads all of a unit or nothing")
                elif k in OFFLOAD_TUNING:
                    conv.not_needed(f"{src}.{k}", v, "offload tuning; FSDP2's CPUOffloadPolicy pins host memory itself")
                else:
                    conv.unknown(f"{src}.{k}", v, ["device", *sorted(OFFLOAD_TUNING)])
        elif key in ("cpu_offload", "cpu_offload_params") and truthy(value):  # older spellings
            _offload(conv, src, "cpu")
        elif key in ("cpu_offload", "cpu_offload_params"):
            conv.not_needed(src, value, NO_GAIN)
        elif key == "cpu_offload_use_pin_memory":
            conv.not_needed(src, value, "FSDP2's CPUOffloadPolicy pins host memory itself")
        elif key in ZERO_TUNING:
            conv.not_needed(src, value, TUNING)
        elif key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            conv.not_needed(src, value, EXPORT)
        elif key == "mics_shard_size":
            why = f"MiCS groups are HSDP: [parallel] shard = {int(value)}, replicate = world size / shard, "
            why += "strategy = 'HYBRID_SHARD'"
            conv.refuse_if(int(value) > 0, src, value, why)
        elif key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
                     "mics_hierarchical_params_gather"):  # fmt: skip
            conv.refuse_if(value not in (False, 0, 1, None), src, value, ZERO_PP)
        else:
            conv.unknown(src, value, sorted({"stage", "offload_optimizer", "offload_param", *ZERO_TUNING}))


TRACKERS = ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger")
REDUCE = "fsdp2kit reduces gradients in fp32; a bf16 reduce needs your own "
REDUCE += "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) passed to shard_model"
TOP: dict[str, Rule] = {
    **TRAIN,
    "zero_optimization": _block(_zero),
    "optimizer": _block(_optimizer),
    "scheduler": _block(_scheduler),
    **{key: partial(_precision, key) for key in ("bf16", "fp16", "amp")},
    "steps_per_print": mapped("log", "every", int),
    **dict.fromkeys(
        ("wall_clock_breakdown", "memory_breakdown", "dump_state"),
        "the recipe logs step time, tokens/s and peak memory per step in its JSONL",
    ),
    "activation_checkpointing": _block(_activation),
    "communication_data_type": refused_when(
        lambda v: str(v).lower() not in ("fp32", "float32", "none"),
        REDUCE,
        "fsdp2kit reduces gradients in fp32 in every named policy",
    ),
    **dict.fromkeys(
        ("prescale_gradients", "gradient_predivide_factor"),
        refused_when(
            lambda v: v not in (False, 1, 1.0),
            "FSDP2 divides once by the world size; no pre-division knob in the recipe",
            "FSDP2 averages gradients in its reduce-scatter",
        ),
    ),
    **dict.fromkeys(
        ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"),
        "any torch.optim optimizer works on FSDP2's DTensor parameters",
    ),
    **dict.fromkeys(
        TRACKERS, refused_when(truthy, "the recipe writes JSONL metrics ([log] jsonl); feed them to your tracker")
    ),
    "checkpoint": "DCP checkpoints (fsdp2kit.Checkpointer) reshard at load: any world size",
    "data_types": "gradients accumulate in the parameters' dtype (fp32 master weights)",
}
