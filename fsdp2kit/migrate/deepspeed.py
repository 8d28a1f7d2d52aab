"""DeepSpeed's ZeRO JSON config (and Accelerate's deepspeed_config block) -> recipe settings, key by key.

ZeRO stage 3 is FULL_SHARD, stages 1 and 2 SHARD_GRAD_OP (FSDP2 has no optimizer-only sharding); a
value of ``"auto"`` (filled in by the HF Trainer) leaves the recipe's default. The tables: docs/migrating.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdp2kit.migrate.conversion import NO_GAIN, Conversion, truthy

__all__ = ["convert_accelerate_deepspeed", "convert_deepspeed"]

AUTO = "'auto' is filled in by the HF Trainer / Accelerate from the training script; the recipe's default applies"
TUNING = "DeepSpeed bucket/overlap tuning; FSDP2 overlaps per unit (one all-gather / reduce-scatter per block)"
EXPORT = "fsdp2kit export-hf / fk.export_hf write consolidated weights from any checkpoint"
NVME = "NVMe offload is not in FSDP2: cpu_offload = true keeps the sharded state in CPU memory, or add GPUs"
STAGE_STRATEGY = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def convert_deepspeed(data: dict, path: str) -> Conversion:
    """Convert the parsed JSON of a DeepSpeed config file."""
    conv = Conversion("DeepSpeed", path)
    _convert(conv, dict(data), "")
    conv.torchrun_options.append("--standalone")
    return conv


def convert_accelerate_deepspeed(conv: Conversion, cfg: dict, yaml_path: str) -> None:
    """Accelerate's ``deepspeed_config`` block: its own names, or a pointer to a DeepSpeed JSON file."""
    p = "deepspeed_config."
    if "deepspeed_config_file" in cfg:
        name = cfg.pop("deepspeed_config_file")
        file = Path(name) if Path(name).is_absolute() else Path(yaml_path).parent / name
        if not file.is_file():
            conv.refuse(p + "deepspeed_config_file", name, f"{file} is not there: convert the JSON file itself")
        else:
            conv.launch(p + "deepspeed_config_file", name, "(its keys follow, prefixed with its name)")
            try:
                data = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                conv.refuse(p + "deepspeed_config_file", name, f"cannot read it as JSON: {e}")
                data = {}
            _convert(conv, data, f"{name}:")
    for key, value in cfg.items():
        src = p + key
        if key == "zero_stage":
            _stage(conv, value, src)
        elif key in ("offload_optimizer_device", "offload_param_device"):
            _offload(conv, value, src)
        elif key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            conv.refuse_if(str(value).lower() not in ("none", ""), src, value, NVME)
        elif key in ("gradient_accumulation_steps", "gradient_clipping"):
            _train_key(conv, key, value, src)
        elif key == "zero3_save_16bit_model":
            conv.not_needed(src, value, EXPORT)
        elif key == "zero3_init_flag" and truthy(value):
            conv.set("model", "meta_init", True, src, value, "meta-device init: no rank holds the whole model")
        elif key == "zero3_init_flag":
            conv.not_needed(src, value, "the recipe builds on the meta device unless [model] meta_init = false")
        elif key == "deepspeed_moe_layer_cls_names":
            conv.not_needed(src, value, "MoE blocks are found and sharded like any other block")
        elif key == "deepspeed_multinode_launcher":
            conv.not_needed(src, value, "torchrun launches each node (or recipes/slurm.sh under Slurm)")
        elif key in ("deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"):
            why = "torchrun has no hostfile: run it on each node (or under Slurm)"
            conv.refuse_if(value not in (None, "", "none"), src, value, why)
        else:
            conv.unknown(src, value, ACCELERATE_DS_KEYS)


ACCELERATE_DS_KEYS = [
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
    "zero3_save_16bit_model", "zero3_init_flag", "deepspeed_moe_layer_cls_names", "deepspeed_multinode_launcher",
    "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
]  # fmt: skip
TOP = [
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "zero_optimization", "steps_per_print",
    "wall_clock_breakdown", "activation_checkpointing", "communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "tensorboard",
    "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger", "checkpoint", "data_types",
    "memory_breakdown", "dump_state", "seed",
]  # fmt: skip


def _convert(conv: Conversion, data: dict, p: str) -> None:
    micro = data.get("train_micro_batch_size_per_gpu")
    accum = data.get("gradient_accumulation_steps")
    for key, value in data.items():
        src = p + key
        if key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "seed"):
            _train_key(conv, key, value, src)
        elif key == "train_batch_size":
            if _is_auto(value):
                conv.not_needed(src, value, AUTO)
            elif isinstance(micro, int) and isinstance(accum, int) and micro * accum and value % (micro * accum) == 0:
                ranks = value // (micro * accum)
                conv.nproc_per_node = conv.nproc_per_node or ranks
                why = "one node assumed; train_batch_size = micro batch x grad_accum x ranks, which the recipe derives"
                conv.launch(src, value, f"{ranks} ranks in all", why)
            else:
                conv.not_needed(src, value, "derived: data.batch_size x train.grad_accum x the world size")
        elif key == "zero_optimization":
            _zero(conv, dict(value or {}), src + ".")
        elif key == "optimizer":
            _optimizer(conv, dict(value or {}), src + ".")
        elif key == "scheduler":
            _scheduler(conv, dict(value or {}), src + ".")
        elif key in ("bf16", "fp16", "amp"):
            _precision(conv, key, value, src)
        elif key == "steps_per_print":
            conv.set("log", "every", int(value), src, value)
        elif key in ("wall_clock_breakdown", "memory_breakdown", "dump_state"):
            conv.not_needed(src, value, "the recipe logs step time, tokens/s and peak memory per step in its JSONL")
        elif key == "activation_checkpointing":
            _activation(conv, dict(value or {}), src + ".")
        elif key == "communication_data_type":
            why = "fsdp2kit reduces gradients in fp32; a bf16 reduce needs your own "
            why += "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) passed to shard_model"
            fp32 = str(value).lower() in ("fp32", "float32", "none")
            conv.refuse_if(not fp32, src, value, why, "fsdp2kit reduces gradients in fp32 in every named policy")
        elif key in ("prescale_gradients", "gradient_predivide_factor"):
            why = "FSDP2 divides once by the world size; no pre-division knob in the recipe"
            conv.refuse_if(
                value not in (False, 1, 1.0), src, value, why, "FSDP2 averages gradients in its reduce-scatter"
            )
        elif key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
            conv.not_needed(src, value, "any torch.optim optimizer works on FSDP2's DTensor parameters")
        elif key in ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger"):
            why = "the recipe writes JSONL metrics ([log] jsonl); feed them to your tracker"
            conv.refuse_if(truthy(value), src, value, why)
        elif key == "checkpoint":
            conv.not_needed(src, value, "DCP checkpoints (fsdp2kit.Checkpointer) reshard at load: any world size")
        elif key == "data_types":
            conv.not_needed(src, value, "gradients accumulate in the parameters' dtype (fp32 master weights)")
        else:
            conv.unknown(src, value, TOP)


def _train_key(conv: Conversion, key: str, value: Any, src: str) -> None:
    if _is_auto(value):
        conv.not_needed(src, value, AUTO)
        return
    if key == "train_micro_batch_size_per_gpu":
        conv.set("data", "batch_size", int(value), src, value)
    elif key == "gradient_accumulation_steps":
        conv.set("train", "grad_accum", int(value), src, value, "micro-steps run under fk.no_sync")
    elif key == "gradient_clipping":
        conv.set("train", "clip", float(value), src, value, "fk.clip_grad_norm_ over all shards (0: off)")
    elif key == "seed":
        conv.set("train", "seed", int(value), src, value)


def _stage(conv: Conversion, value: Any, src: str) -> None:
    stage = int(value)
    if stage not in STAGE_STRATEGY:
        conv.refuse(src, value, "ZeRO stages are 0-3")
        return
    notes = {
        0: "no ZeRO: whole model on every rank, gradients all-reduced",
        1: "FSDP2 has no optimizer-only sharding; SHARD_GRAD_OP also shards gradients and parameters at rest",
        2: "parameters stay gathered from forward to backward; gradients and optimizer state sharded",
        3: "parameters, gradients and optimizer state sharded; each block gathered when it runs",
    }
    conv.set("parallel", "strategy", STAGE_STRATEGY[stage], src, value, notes[stage])


def _offload(conv: Conversion, value: Any, src: str) -> None:
    device = str(value).lower()
    if device == "none":
        conv.not_needed(src, value, NO_GAIN)
    elif device == "cpu":
        conv.set(
            "parallel", "cpu_offload", True, src, value,
            "FSDP2's CPU offload moves parameters, gradients and the optimizer step to CPU together",
        )  # fmt: skip
    elif device == "nvme":
        conv.refuse(src, value, NVME)
    else:
        conv.refuse(src, value, "expected device none, cpu or nvme")


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
            _stage(conv, value, src)
        elif key in ("offload_optimizer", "offload_param"):
            sub = dict(value) if isinstance(value, dict) else {"device": value}
            _offload(conv, sub.pop("device", "none"), f"{src}.device")
            for k, v in sub.items():
                if k == "ratio" and float(v) != 1:
                    conv.refuse(f"{src}.{k}", v, "partial offload: FSDP2 offloads all of a unit or nothing")
                elif k in OFFLOAD_TUNING:
                    conv.not_needed(f"{src}.{k}", v, "offload tuning; FSDP2's CPUOffloadPolicy pins host memory itself")
                else:
                    conv.unknown(f"{src}.{k}", v, ["device", *sorted(OFFLOAD_TUNING)])
        elif key in ("cpu_offload", "cpu_offload_params") and truthy(value):  # older spellings
            _offload(conv, "cpu", src)
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


def _optimizer(conv: Conversion, cfg: dict, p: str) -> None:
    kind = str(cfg.pop("type", "")).lower()
    note = "the recipe trains with torch.optim.AdamW"
    note += " (DeepSpeed's Adam is AdamW by default: adam_w_mode)" if kind == "adam" else ""
    why = "the recipe trains with AdamW; any torch.optim optimizer works in your own loop"
    conv.refuse_if(kind not in ("adamw", "adam"), p + "type", kind, why, note)
    params = dict(cfg.pop("params", {}) or {})
    for key, value in params.items():
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
    params = dict(cfg.pop("params", {}) or {})
    for key, value in params.items():
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


def _precision(conv: Conversion, key: str, value: Any, src: str) -> None:
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
