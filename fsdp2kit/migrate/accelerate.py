"""Accelerate's `accelerate config` YAML -> recipe settings, key by key (FSDP1 and FSDP2 configs).

The keys and values are those `accelerate config` writes and `accelerate launch` reads
(accelerate/commands/config/cluster.py and utils/dataclasses.py); a ``deepspeed_config`` block goes
to the DeepSpeed rules (deepspeed.py). The tables: docs/migrating.md.
"""

from __future__ import annotations

from typing import Any

from fsdp2kit.migrate.conversion import NO_GAIN, Conversion, truthy
from fsdp2kit.migrate.deepspeed import convert_accelerate_deepspeed

__all__ = ["convert_accelerate"]

TPU_ONLY = "TPU launch setting; fsdp2kit runs on CUDA (NCCL) or CPU (gloo)"


def convert_accelerate(data: dict, path: str) -> Conversion:
    """Convert the parsed YAML of an `accelerate config` file."""
    conv = Conversion("Accelerate", path)
    data = dict(data)
    kind = str(data.get("distributed_type", "NO")).upper()
    machines = int(data.get("num_machines", 1) or 1)
    _top_level(conv, data, kind, machines)
    fsdp = data.pop("fsdp_config", None)
    if fsdp:
        if kind != "FSDP":
            conv.not_needed("fsdp_config", "{...}", f"distributed_type is {kind}, so accelerate ignores fsdp_config")
        else:
            convert_fsdp_config(conv, dict(fsdp), machines)
    elif kind == "FSDP":
        conv.set("parallel", "strategy", "FULL_SHARD", "distributed_type", kind, "no fsdp_config: FULL_SHARD")
    ds = data.pop("deepspeed_config", None)
    if ds:
        if kind != "DEEPSPEED":
            conv.not_needed("deepspeed_config", "{...}", f"distributed_type is {kind}, so accelerate ignores it")
        else:
            convert_accelerate_deepspeed(conv, dict(ds), path)
    for key, value in data.items():
        conv.unknown(key, value, [*TOP_LEVEL, "fsdp_config", "deepspeed_config"])
    return conv


TOP_LEVEL = [
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "gpu_ids", "main_training_function", "enable_cpu_affinity", "downcast_bf16", "dynamo_config", "fp8_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "tpu_name", "tpu_zone", "tpu_use_cluster",
    "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file", "commands", "fp16", "dynamo_backend", "tpu_cluster",
    "ipex_config", "xpu_config", "tp_config",
]  # fmt: skip


def _top_level(conv: Conversion, data: dict, kind: str, machines: int) -> None:
    pop = data.pop
    if "compute_environment" in data:
        env = pop("compute_environment")
        if str(env).upper() == "LOCAL_MACHINE":
            conv.not_needed("compute_environment", env, "torchrun runs on the machines you launch it on")
        else:
            conv.refuse("compute_environment", env, "SageMaker launching is Accelerate's; run torchrun in the job")
    if "distributed_type" in data:
        value = pop("distributed_type")
        if kind in ("FSDP", "DEEPSPEED"):
            conv.not_needed("distributed_type", value, "fsdp2kit always shards with FSDP2 (fully_shard)")
        elif kind == "MULTI_GPU":
            conv.set(
                "parallel", "strategy", "NO_SHARD", "distributed_type", value,
                "DDP -> NO_SHARD: every rank keeps the whole model, gradients all-reduced (FSDP2, not DDP)",
            )  # fmt: skip
        elif kind in ("NO", "MULTI_CPU"):
            conv.not_needed("distributed_type", value, "the recipe runs on CPU (gloo) when no GPU is visible")
        else:
            conv.refuse(
                "distributed_type", value,
                "fsdp2kit runs on CUDA (NCCL) and CPU (gloo) only; XLA/TPU: torch_xla's own FSDP; "
                "Megatron-LM: its own launcher (fsdp2kit's tensor parallelism is fk.apply_tensor_parallel)",
            )  # fmt: skip
    if "num_processes" in data or "num_machines" in data:
        total = pop("num_processes", None)
        if "num_machines" in data:
            conv.launch("num_machines", pop("num_machines"), f"--nnodes={machines}")
        conv.nnodes = machines
        if total is not None:
            total = int(total)
            if total > 0 and total % machines:
                conv.refuse("num_processes", total, f"{total} processes do not split evenly over {machines} machines")
            elif total > 0:
                conv.nproc_per_node = total // machines
                conv.launch(
                    "num_processes", total, f"--nproc_per_node={total // machines}", "accelerate counts all machines"
                )
            else:
                conv.launch("num_processes", total, "--nproc_per_node=gpu", "-1: one process per visible GPU")
    if "machine_rank" in data:
        rank = pop("machine_rank")
        if machines > 1:
            conv.torchrun_options.append("--node_rank=$NODE_RANK")
            conv.launch("machine_rank", rank, "--node_rank", "each machine passes its own rank (0 .. nnodes-1)")
        else:
            conv.not_needed("machine_rank", rank, "one machine")
    ip, port = pop("main_process_ip", None), pop("main_process_port", None)
    backend = str(pop("rdzv_backend", "static") or "static")
    if machines > 1:
        endpoint = f"{ip or '$MASTER_ADDR'}:{port or 29500}"
        if backend == "static":
            conv.torchrun_options += [f"--master_addr={ip or '$MASTER_ADDR'}", f"--master_port={port or 29500}"]
        else:
            conv.torchrun_options += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={endpoint}"]
        for key, value in (("main_process_ip", ip), ("main_process_port", port)):
            if value is not None:
                conv.launch(key, value, "--master_addr/--master_port" if backend == "static" else "--rdzv_endpoint")
        conv.launch("rdzv_backend", backend, "static rendezvous" if backend == "static" else "--rdzv_backend")
    else:
        for key, value in (("main_process_ip", ip), ("main_process_port", port), ("rdzv_backend", backend)):
            if value is not None:
                conv.not_needed(key, value, "one machine: torchrun --standalone needs no rendezvous address")
        conv.torchrun_options.append("--standalone")
    if "same_network" in data:
        conv.not_needed("same_network", pop("same_network"), "torchrun's rendezvous works across networks alike")
    if "gpu_ids" in data:
        ids = pop("gpu_ids")
        if ids in (None, "all", "") or str(ids).lower() == "all":
            conv.not_needed("gpu_ids", ids, "every visible GPU is used")
        else:
            conv.env["CUDA_VISIBLE_DEVICES"] = str(ids)
            conv.launch("gpu_ids", ids, f"CUDA_VISIBLE_DEVICES={ids}")
    if "use_cpu" in data:
        value = pop("use_cpu")
        if truthy(value):
            conv.env["CUDA_VISIBLE_DEVICES"] = ""
            conv.launch("use_cpu", value, 'CUDA_VISIBLE_DEVICES=""', "no GPU visible: the recipe runs on CPU (gloo)")
        else:
            conv.not_needed("use_cpu", value, "GPUs are used when there are any")
    if "debug" in data:
        value = pop("debug")
        if truthy(value):
            conv.env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
            conv.launch("debug", value, "TORCH_DISTRIBUTED_DEBUG=DETAIL", "collective checks, as accelerate's debug")
        else:
            conv.not_needed("debug", value, NO_GAIN)
    if "main_training_function" in data:
        conv.not_needed("main_training_function", pop("main_training_function"), "torchrun runs the script's __main__")
    if "enable_cpu_affinity" in data:
        value = pop("enable_cpu_affinity")
        conv.refuse_if(
            truthy(value), "enable_cpu_affinity", value, "torchrun does not pin cores: wrap the command in numactl"
        )
    if "downcast_bf16" in data:
        conv.not_needed("downcast_bf16", pop("downcast_bf16"), TPU_ONLY)
    for key in ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env",
                "command_file", "commands", "megatron_lm_config", "mpirun_config"):  # fmt: skip
        if key in data:
            value = pop(key)
            why = TPU_ONLY if key.startswith(("tpu", "command")) else "not supported by fsdp2kit"
            conv.refuse_if(value not in (None, False, [], {}, ""), key, value, why)
    # Blocks of older accelerate releases: Intel's extension (ipex_config: {ipex: bool}, until 1.12),
    # Intel GPUs (xpu_config: {use_xpu: bool}, 0.20), tensor parallelism (tp_config: {tp_size: N}, 1.4-1.6).
    for key, why in (("ipex_config", "Intel Extension for PyTorch is not used by fsdp2kit"),
                     ("xpu_config", "fsdp2kit runs on CUDA (NCCL) or CPU (gloo)")):  # fmt: skip
        if key in data:
            value = pop(key)
            conv.refuse_if(bool(value) and any(truthy(v) for v in dict(value).values()), key, value, why)
    if "tp_config" in data:
        cfg = dict(pop("tp_config") or {})
        _parallelism(conv, {"tp_size": cfg.pop("tp_size", 1), **cfg}, prefix="tp_config.")
    if "fp16" in data:  # accelerate's pre-0.6 spelling of mixed_precision: fp16
        value = pop("fp16")
        data.setdefault("mixed_precision", "fp16" if truthy(value) else "no")
        conv.not_needed("fp16", value, "old spelling; read as mixed_precision")
    if "mixed_precision" in data:
        _mixed_precision(conv, pop("mixed_precision"))
    if "dynamo_backend" in data:  # the old flat spelling
        data.setdefault("dynamo_config", {"dynamo_backend": pop("dynamo_backend")})
    if "dynamo_config" in data:
        _dynamo(conv, pop("dynamo_config") or {})
    if "fp8_config" in data:
        _fp8(conv, pop("fp8_config") or {})
    if "parallelism_config" in data:
        _parallelism(conv, pop("parallelism_config") or {})


def _mixed_precision(conv: Conversion, value: Any) -> None:
    name = str(value).lower() if value is not None else "no"
    if name in ("no", "none", "fp32"):
        conv.set("parallel", "mixed_precision", "fp32", "mixed_precision", value)
    elif name in ("bf16", "fp16"):
        note = "bf16 compute, fp32 master weights and fp32 gradient reduction"
        if name == "fp16":
            note = "fp16 compute; the recipe does not scale the loss (accelerate uses a GradScaler): prefer bf16"
        conv.set("parallel", "mixed_precision", name, "mixed_precision", value, note)
    elif name == "fp8":
        conv.set("parallel", "mixed_precision", "bf16", "mixed_precision", value, "fp8 matmuls run inside bf16")
        conv.set("parallel", "float8", True, "mixed_precision", value, "torchao float8 training + float8 all-gather")
    else:
        conv.refuse("mixed_precision", value, "expected no, fp16, bf16 or fp8")


def _dynamo(conv: Conversion, cfg: dict) -> None:
    # `accelerate launch` reads a dynamo_config key without the "dynamo_" prefix as "dynamo_" + key.
    written = {(k if k.startswith("dynamo_") else "dynamo_" + k): k for k in cfg}
    cfg = {name: cfg[k] for name, k in written.items()}
    backend = str(cfg.pop("dynamo_backend", "NO")).upper()
    src = "dynamo_config." + written.get("dynamo_backend", "dynamo_backend")
    if backend == "NO":
        conv.not_needed(src, backend, NO_GAIN)
    elif backend == "INDUCTOR":
        conv.set(
            "parallel", "compile", True, src, backend,
            "regional: each block is compiled in place (compile time flat in depth), not the whole model",
        )  # fmt: skip
    else:
        conv.refuse(src, backend, "the recipe compiles with inductor only (compile = true)")
    for key, value in cfg.items():
        src = f"dynamo_config.{written[key]}"
        if key == "dynamo_use_regional_compilation":
            conv.not_needed(src, value, "fsdp2kit always compiles per block (fk.compile_blocks)")
        elif key in ("dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic"):
            if value in (None, False, "default"):
                conv.not_needed(src, value, "torch.compile's default")
            else:
                conv.refuse(src, value, "the recipe passes no compile options; fk.compile_blocks(model, **kwargs)")
        else:
            conv.unknown(src, value, ["dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic"])


def _fp8(conv: Conversion, cfg: dict) -> None:
    # accelerate writes fp8_config keys bare and `accelerate launch` reads them as "fp8_" + key: both spellings.
    written = {k.removeprefix("fp8_"): k for k in cfg}
    cfg = {name: cfg[k] for name, k in written.items()}
    backend = str(cfg.pop("backend", "AO")).upper()
    src = "fp8_config." + written.get("backend", "backend")
    if backend == "AO":
        conv.set("parallel", "float8", True, src, backend, "torchao float8 (fk.enable_float8)")
    else:
        conv.refuse(src, backend, "fsdp2kit's float8 is torchao's: float8 = true (backend AO)")
    for key, value in cfg.items():
        src = f"fp8_config.{written[key]}"
        if key == "enable_fsdp_float8_all_gather":
            if truthy(value):
                conv.not_needed(src, value, "float8 = true always all-gathers in float8")
            else:
                conv.refuse(src, value, "the recipe's float8 always all-gathers in float8")
        elif key == "pad_inner_dim":
            conv.not_needed(src, value, "torchao's default handling of unaligned dims applies")
        else:
            conv.refuse(src, value, f"{backend} option without a torchao counterpart")


def _parallelism(conv: Conversion, cfg: dict, prefix: str = "parallelism_config.") -> None:
    for key, value in dict(cfg).items():
        src = prefix + key
        name = key.removeprefix("parallelism_config_")
        if name == "dp_replicate_size":
            conv.set("parallel", "replicate", int(value), src, value, "HSDP replica groups")
        elif name == "dp_shard_size":
            conv.set("parallel", "shard", int(value), src, value)
        elif name == "tp_size":
            conv.refuse_if(
                int(value) > 1, src, value, "the recipe has no tp key: fk.apply_tensor_parallel in your own loop"
            )
        elif name == "cp_size":
            conv.refuse_if(int(value) > 1, src, value, "context parallelism is not in fsdp2kit")
        elif name == "cp_comm_strategy":
            conv.not_needed(src, value, "context parallelism only")
        else:
            conv.unknown(src, value, ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"])


# ---- the fsdp_config block ----

STRATEGY_NAMES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
ORIG_PARAMS = (
    "FSDP2 always keeps the original parameters (one DTensor each): per-parameter optimizer groups, "
    "torch.compile and frozen parameters work without it"
)
SYNC_STATES = (
    "nothing to broadcast: the recipe builds on the meta device and every rank fills its own shards "
    "(materialize from the seed, or load_pretrained from the files)"
)
STATE_DICT = (
    "fsdp2kit.Checkpointer always writes sharded DCP checkpoints that load at any world size; full "
    "weights come from `fsdp2kit export-hf` / fk.export_hf. Old checkpoints: fk.load_fsdp1_checkpoint"
)


def strategy_name(value: Any) -> str | None:
    """FSDP1's strategy as accelerate accepts it: a name (any case) or the enum number 1-5."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        n = int(value)
        return STRATEGY_NAMES[n - 1] if 1 <= n <= len(STRATEGY_NAMES) else None
    if isinstance(value, str) and value.strip().upper() in STRATEGY_NAMES:
        return value.strip().upper()
    return None


FSDP_KEYS = [
    "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
    "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params", "fsdp_backward_prefetch",
    "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states", "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload",
    "fsdp_ignored_modules",
]  # fmt: skip


# Names accelerate has read for a key, besides its own (accelerate <= 0.33 read the first as the
# second, with a FutureWarning; removed in 0.34, huggingface/accelerate#3098, though its FSDP guide
# still shows it). Keys without the "fsdp" prefix are covered by `canonical_keys`.
ALIASES = {"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"}
ALIAS_NOTES = {
    "fsdp_backward_prefetch_policy": "old name of fsdp_backward_prefetch (accelerate >= 0.34 no longer reads it)"
}


def canonical_keys(conv: Conversion, cfg: dict) -> tuple[dict, dict]:
    """``cfg`` under accelerate's current key names, and each name's spelling in the file.

    `accelerate launch` reads an ``fsdp_config`` key that does not start with "fsdp" as "fsdp_" +
    key (``sharding_strategy``, ``offload_params``... as the configs of accelerate 0.6 to 0.11
    wrote them), and older names by `ALIASES`. When two spellings of one key are given, the
    current name wins (then the first one written); the others are reported as not needed.
    """
    out: dict = {}
    written: dict = {}
    order = sorted(cfg, key=lambda k: k not in FSDP_KEYS)  # current names first
    for key in order:
        name = key if key.startswith("fsdp") else "fsdp_" + key
        name = ALIASES.get(name, name)
        if name in out:
            conv.not_needed("fsdp_config." + key, cfg[key], f"another spelling of {written[name]}, which is used")
            continue
        out[name], written[name] = cfg[key], key
    return out, written


def convert_fsdp_config(conv: Conversion, cfg: dict, machines: int) -> None:
    """Convert the keys of an ``fsdp_config`` block (``machines``: the YAML's ``num_machines``)."""
    cfg, written = canonical_keys(conv, cfg)

    def src(key: str) -> str:
        return "fsdp_config." + written.get(key, key)

    version = int(cfg.pop("fsdp_version", 1) or 1)
    conv.not_needed(src("fsdp_version"), version, "the recipe is FSDP2 (fully_shard) whatever this says")
    strategy_key = None
    if "fsdp_sharding_strategy" in cfg:
        strategy_key = "fsdp_sharding_strategy"
    elif "fsdp_reshard_after_forward" in cfg:
        strategy_key = "fsdp_reshard_after_forward"
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        if key not in cfg:
            continue
        value = cfg.pop(key)
        if key != strategy_key:
            conv.not_needed(src(key), value, f"accelerate takes the strategy from {strategy_key} when both are set")
            continue
        if isinstance(value, bool) or (version == 2 and str(value).lower() in ("true", "false")):
            name = "FULL_SHARD" if truthy(value) else "SHARD_GRAD_OP"
        else:
            name = strategy_name(value)
        if name is None:
            conv.refuse(src(key), value, f"expected a strategy name or 1-5 ({', '.join(STRATEGY_NAMES)}) or a bool")
            continue
        note = ""
        if name.startswith("HYBRID"):
            if machines > 1:
                conv.set(
                    "parallel", "replicate", machines, src(key), value, "HSDP: shard in a machine, replicate across"
                )
            else:
                name = "FULL_SHARD" if name == "HYBRID_SHARD" else "SHARD_GRAD_OP"
                note = f"one machine: {value} has nothing to replicate across, which is {name}"
        conv.set("parallel", "strategy", name, src(key), value, note)
    if "fsdp_offload_params" in cfg:
        value = cfg.pop("fsdp_offload_params")
        conv.set(
            "parallel", "cpu_offload", truthy(value), src("fsdp_offload_params"), value,
            "FSDP2's CPU offload also runs the optimizer step on CPU" if truthy(value) else "",
        )  # fmt: skip
    policy = str(cfg.pop("fsdp_auto_wrap_policy", "") or "")
    if policy:
        reasons = {
            "TRANSFORMER_BASED_WRAP": "shard_model makes every repeated block a unit (blocks='auto'), then the root",
            "SIZE_BASED_WRAP": "FSDP2 units are the repeated blocks (blocks='auto'); units by parameter count have "
            "no recipe key (in your own loop pass shard_model(blocks=predicate))",
            "NO_WRAP": "the recipe always makes the blocks units (one unit would gather the whole model); your own "
            "loop can pass shard_model(blocks=[])",
        }
        if policy.upper() in reasons:
            conv.not_needed(src("fsdp_auto_wrap_policy"), policy, reasons[policy.upper()])
        else:
            conv.refuse(src("fsdp_auto_wrap_policy"), policy, "expected " + ", ".join(reasons))
    if "fsdp_transformer_layer_cls_to_wrap" in cfg:
        conv.not_needed(
            src("fsdp_transformer_layer_cls_to_wrap"), cfg.pop("fsdp_transformer_layer_cls_to_wrap"),
            "found from the model (its _no_split_modules or its repeated blocks); in your own loop "
            "shard_model(blocks=[LayerClass]) takes the classes, not their names",
        )  # fmt: skip
    if "fsdp_min_num_params" in cfg:
        conv.not_needed(src("fsdp_min_num_params"), cfg.pop("fsdp_min_num_params"), "units are blocks (see above)")
    if "fsdp_backward_prefetch" in cfg:
        value = cfg.pop("fsdp_backward_prefetch")
        name = str(value).strip().upper() if value is not None else "NO_PREFETCH"
        # BackwardPrefetch's numbers, and None written as a name
        name = {"1": "BACKWARD_PRE", "2": "BACKWARD_POST", "NONE": "NO_PREFETCH"}.get(name, name)
        issued = "the next block's all-gather is issued before this block's backward"
        notes = {
            "BACKWARD_PRE": issued,
            "BACKWARD_POST": f"{issued} (FSDP2 has no BACKWARD_POST; this is BACKWARD_PRE)",
            "NO_PREFETCH": "no explicit prefetch; FSDP2 still overlaps one all-gather implicitly",
        }
        if name in notes:
            depth = 0 if name == "NO_PREFETCH" else 1  # [parallel] prefetch is a depth; 0: FSDP2's implicit one
            note = "; ".join(filter(None, [notes[name], ALIAS_NOTES.get(written["fsdp_backward_prefetch"])]))
            conv.set("parallel", "prefetch", depth, src("fsdp_backward_prefetch"), value, note)
        else:
            conv.refuse(src("fsdp_backward_prefetch"), value, "expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH")
    if "fsdp_forward_prefetch" in cfg:
        value = cfg.pop("fsdp_forward_prefetch")
        conv.not_needed(
            src("fsdp_forward_prefetch"), value,
            "[parallel] prefetch sets forward and backward prefetch together (fk.set_prefetch(forward=, backward=) "
            "sets them apart)",
        )  # fmt: skip
    if "fsdp_state_dict_type" in cfg:
        conv.not_needed(src("fsdp_state_dict_type"), cfg.pop("fsdp_state_dict_type"), STATE_DICT)
    if "fsdp_use_orig_params" in cfg:
        conv.not_needed(src("fsdp_use_orig_params"), cfg.pop("fsdp_use_orig_params"), ORIG_PARAMS)
    if "fsdp_sync_module_states" in cfg:
        conv.not_needed(src("fsdp_sync_module_states"), cfg.pop("fsdp_sync_module_states"), SYNC_STATES)
    if "fsdp_cpu_ram_efficient_loading" in cfg:
        value = cfg.pop("fsdp_cpu_ram_efficient_loading")
        conv.set(
            "model", "meta_init", truthy(value), src("fsdp_cpu_ram_efficient_loading"), value,
            "built on the meta device; load_pretrained reads only each rank's rows" if truthy(value) else "",
        )  # fmt: skip
    if "fsdp_activation_checkpointing" in cfg:
        value = cfg.pop("fsdp_activation_checkpointing")
        if truthy(value):
            conv.set("parallel", "activation_checkpointing", "full", src("fsdp_activation_checkpointing"), value)
        else:
            conv.not_needed(src("fsdp_activation_checkpointing"), value, "off is the recipe's default")
    if "fsdp_activation_checkpointing_offload" in cfg:
        value = cfg.pop("fsdp_activation_checkpointing_offload")
        conv.refuse_if(
            truthy(value), src("fsdp_activation_checkpointing_offload"), value,
            "activations are not offloaded to CPU by fsdp2kit; activation_checkpointing = 'full' keeps one "
            "input per block",
        )  # fmt: skip
    if "fsdp_ignored_modules" in cfg:
        value = cfg.pop("fsdp_ignored_modules")
        conv.refuse_if(
            bool(value), src("fsdp_ignored_modules"), value,
            "no recipe key: in your own loop keep those modules out of shard_model's blocks, or call "
            "fully_shard(ignored_params=...) yourself",
        )  # fmt: skip
    for key, value in cfg.items():
        conv.unknown(src(key), value, FSDP_KEYS)
