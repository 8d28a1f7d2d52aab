"""Accelerate's `accelerate config` YAML (FSDP1 and FSDP2) -> recipe settings, key by key, as `accelerate launch`
reads them (accelerate/commands/config/cluster.py, utils/dataclasses.py). The tables: docs/migrating.md."""

from __future__ import annotations

from typing import Any

from fsdp2kit.migrate.conversion import NO_GAIN, Conversion, Rule, apply_rules, mapped, refused_when, truthy
from fsdp2kit.migrate.deepspeed import convert_accelerate_deepspeed

__all__ = ["convert_accelerate"]

TPU_ONLY = "TPU launch setting; fsdp2kit runs on CUDA (NCCL) or CPU (gloo)"
ONE_MACHINE = "one machine: torchrun --standalone needs no rendezvous address"
TPU_KEYS = ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env",
            "command_file", "commands")  # fmt: skip


def _given(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def _any_on(value: Any) -> bool:
    return bool(value) and any(truthy(v) for v in dict(value).values())


def _in_order(cfg: dict, rules: dict) -> dict:
    """``cfg`` with the keys that have a rule first, in the rules' order (the order of the TOML's header)."""
    return {k: cfg[k] for k in rules if k in cfg} | cfg


def convert_accelerate(data: dict, path: str) -> Conversion:
    """Convert the parsed YAML of an `accelerate config` file."""
    conv = Conversion("Accelerate", path)
    data = dict(data)
    kind = str(data.get("distributed_type", "NO")).upper()
    machines = int(data.get("num_machines", 1) or 1)
    addr, port = data.get("main_process_ip") or "$MASTER_ADDR", data.get("main_process_port") or 29500
    backend = str(data.get("rdzv_backend", "static") or "static")
    if "num_processes" in data or "num_machines" in data:
        conv.nnodes = machines
    if machines > 1 and "machine_rank" in data:
        conv.torchrun_options.append("--node_rank=$NODE_RANK")
    if machines == 1:
        conv.torchrun_options.append("--standalone")
    elif backend == "static":
        conv.torchrun_options += [f"--master_addr={addr}", f"--master_port={port}"]
    else:
        conv.torchrun_options += [f"--rdzv_backend={backend}", f"--rdzv_endpoint={addr}:{port}"]
    if "fp16" in data:  # accelerate's pre-0.6 spelling of mixed_precision: fp16
        data.setdefault("mixed_precision", "fp16" if truthy(data["fp16"]) else "no")
    if "dynamo_backend" in data:  # the old flat spelling
        data.setdefault("dynamo_config", {"dynamo_backend": data.pop("dynamo_backend")})

    def distributed_type(conv: Conversion, src: str, value: Any) -> None:
        if kind in ("FSDP", "DEEPSPEED"):
            conv.not_needed(src, value, "fsdp2kit always shards with FSDP2 (fully_shard)")
        elif kind == "MULTI_GPU":
            why = "DDP -> NO_SHARD: every rank keeps the whole model, gradients all-reduced (FSDP2, not DDP)"
            conv.set("parallel", "strategy", "NO_SHARD", src, value, why)
        elif kind in ("NO", "MULTI_CPU"):
            conv.not_needed(src, value, "the recipe runs on CPU (gloo) when no GPU is visible")
        else:
            conv.refuse(
                src, value,
                "fsdp2kit runs on CUDA (NCCL) and CPU (gloo) only; XLA/TPU: torch_xla's own FSDP; "
                "Megatron-LM: its own launcher (fsdp2kit's tensor parallelism is fk.apply_tensor_parallel)",
            )  # fmt: skip

    def num_processes(conv: Conversion, src: str, value: Any) -> None:
        total = int(value or -1)
        if total > 0 and total % machines:
            conv.refuse(src, value, f"{total} processes do not split evenly over {machines} machines")
        elif total > 0:
            conv.nproc_per_node = total // machines
            conv.launch(src, value, f"--nproc_per_node={total // machines}", "accelerate counts all machines")
        else:
            conv.launch(src, value, "--nproc_per_node=gpu", "-1: one process per visible GPU")

    def machine_rank(conv: Conversion, src: str, value: Any) -> None:
        if machines > 1:
            conv.launch(src, value, "--node_rank", "each machine passes its own rank (0 .. nnodes-1)")
        else:
            conv.not_needed(src, value, "one machine")

    def rendezvous(target: str) -> Rule:
        return ONE_MACHINE if machines == 1 else lambda conv, src, value: conv.launch(src, value, target)

    def fsdp_config(conv: Conversion, src: str, value: Any) -> None:
        if kind != "FSDP":
            conv.not_needed(src, "{...}", f"distributed_type is {kind}, so accelerate ignores fsdp_config")
        else:
            convert_fsdp_config(conv, dict(value or {}), machines)

    def deepspeed_config(conv: Conversion, src: str, value: Any) -> None:
        if kind != "DEEPSPEED":
            conv.not_needed(src, "{...}", f"distributed_type is {kind}, so accelerate ignores it")
        else:
            convert_accelerate_deepspeed(conv, dict(value or {}), path)

    endpoint = "--master_addr/--master_port" if backend == "static" else "--rdzv_endpoint"
    unsupported = refused_when(_given, "not supported by fsdp2kit")
    rules: dict[str, Rule] = {
        "compute_environment": refused_when(
            lambda v: str(v).upper() != "LOCAL_MACHINE",
            "SageMaker launching is Accelerate's; run torchrun in the job",
            "torchrun runs on the machines you launch it on",
        ),
        "distributed_type": distributed_type,
        "num_machines": lambda conv, src, value: conv.launch(src, value, f"--nnodes={machines}"),
        "num_processes": num_processes,
        "machine_rank": machine_rank,
        "main_process_ip": rendezvous(endpoint),
        "main_process_port": rendezvous(endpoint),
        "rdzv_backend": rendezvous("static rendezvous" if backend == "static" else "--rdzv_backend"),
        "same_network": "torchrun's rendezvous works across networks alike",
        "gpu_ids": _gpu_ids,
        "use_cpu": _use_cpu,
        "debug": _debug,
        "main_training_function": "torchrun runs the script's __main__",
        "enable_cpu_affinity": refused_when(truthy, "torchrun does not pin cores: wrap the command in numactl"),
        "downcast_bf16": TPU_ONLY,
        **dict.fromkeys(TPU_KEYS, refused_when(_given, TPU_ONLY)),
        "megatron_lm_config": unsupported,
        "mpirun_config": unsupported,
        # Blocks of older accelerate releases: Intel's extension (ipex_config: {ipex: bool}, until 1.12),
        # Intel GPUs (xpu_config: {use_xpu: bool}, 0.20), tensor parallelism (tp_config: {tp_size: N}, 1.4-1.6).
        "ipex_config": refused_when(_any_on, "Intel Extension for PyTorch is not used by fsdp2kit"),
        "xpu_config": refused_when(_any_on, "fsdp2kit runs on CUDA (NCCL) or CPU (gloo)"),
        "tp_config": lambda conv, src, value: _parallelism(conv, {"tp_size": 1, **(value or {})}, "tp_config."),
        "fp16": "old spelling; read as mixed_precision",
        "mixed_precision": _mixed_precision,
        "dynamo_config": lambda conv, src, value: _dynamo(conv, value or {}),
        "fp8_config": lambda conv, src, value: _fp8(conv, value or {}),
        "parallelism_config": lambda conv, src, value: _parallelism(conv, value or {}),
        "fsdp_config": fsdp_config,
        "deepspeed_config": deepspeed_config,
    }
    apply_rules(conv, _in_order(data, rules), rules)
    if kind == "FSDP" and not data.get("fsdp_config"):
        conv.set("parallel", "strategy", "FULL_SHARD", "distributed_type", kind, "no fsdp_config: FULL_SHARD")
    return conv


def _gpu_ids(conv: Conversion, src: str, value: Any) -> None:
    if value in (None, "") or str(value).lower() == "all":
        conv.not_needed(src, value, "every visible GPU is used")
    else:
        conv.env["CUDA_VISIBLE_DEVICES"] = str(value)
        conv.launch(src, value, f"CUDA_VISIBLE_DEVICES={value}")


def _use_cpu(conv: Conversion, src: str, value: Any) -> None:
    if truthy(value):
        conv.env["CUDA_VISIBLE_DEVICES"] = ""
        conv.launch(src, value, 'CUDA_VISIBLE_DEVICES=""', "no GPU visible: the recipe runs on CPU (gloo)")
    else:
        conv.not_needed(src, value, "GPUs are used when there are any")


def _debug(conv: Conversion, src: str, value: Any) -> None:
    if truthy(value):
        conv.env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        conv.launch(src, value, "TORCH_DISTRIBUTED_DEBUG=DETAIL", "collective checks, as accelerate's debug")
    else:
        conv.not_needed(src, value, NO_GAIN)


def _mixed_precision(conv: Conversion, src: str, value: Any) -> None:
    name = str(value).lower() if value is not None else "no"
    if name in ("no", "none", "fp32"):
        conv.set("parallel", "mixed_precision", "fp32", src, value)
    elif name in ("bf16", "fp16"):
        note = "bf16 compute, fp32 master weights and fp32 gradient reduction"
        if name == "fp16":
            note = "fp16 compute; the recipe does not scale the loss (accelerate uses a GradScaler): prefer bf16"
        conv.set("parallel", "mixed_precision", name, src, value, note)
    elif name == "fp8":
        conv.set("parallel", "mixed_precision", "bf16", src, value, "fp8 matmuls run inside bf16")
        conv.set("parallel", "float8", True, src, value, "torchao float8 training + float8 all-gather")
    else:
        conv.refuse(src, value, "expected no, fp16, bf16 or fp8")


def _dynamo_backend(conv: Conversion, src: str, value: Any) -> None:
    backend = str(value).upper()
    if backend == "NO":
        conv.not_needed(src, value, NO_GAIN)
    elif backend == "INDUCTOR":
        why = "regional: each block is compiled in place (compile time flat in depth), not the whole model"
        conv.set("parallel", "compile", True, src, value, why)
    else:
        conv.refuse(src, value, "the recipe compiles with inductor only (compile = true)")


_compile_option = refused_when(
    lambda v: v not in (None, False, "default"),
    "the recipe passes no compile options; fk.compile_blocks(model, **kwargs)",
    "torch.compile's default",
)
DYNAMO: dict[str, Rule] = {
    "dynamo_backend": _dynamo_backend,
    "dynamo_use_regional_compilation": "fsdp2kit always compiles per block (fk.compile_blocks)",
    "dynamo_mode": _compile_option,
    "dynamo_use_fullgraph": _compile_option,
    "dynamo_use_dynamic": _compile_option,
}


def _dynamo(conv: Conversion, cfg: dict) -> None:
    # `accelerate launch` reads a dynamo_config key without the "dynamo_" prefix as "dynamo_" + key.
    written = {(k if k.startswith("dynamo_") else "dynamo_" + k): k for k in cfg}
    cfg = {"dynamo_backend": "NO"} | {name: cfg[k] for name, k in written.items()}
    apply_rules(conv, cfg, DYNAMO, "dynamo_config.", written)


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
            why = "the recipe's float8 always all-gathers in float8"
            conv.refuse_if(not truthy(value), src, value, why, "float8 = true always all-gathers in float8")
        elif key == "pad_inner_dim":
            conv.not_needed(src, value, "torchao's default handling of unaligned dims applies")
        else:
            conv.refuse(src, value, f"{backend} option without a torchao counterpart")


PARALLELISM: dict[str, Rule] = {
    "dp_replicate_size": mapped("parallel", "replicate", int, "HSDP replica groups"),
    "dp_shard_size": mapped("parallel", "shard", int),
    "tp_size": refused_when(
        lambda v: int(v) > 1, "the recipe has no tp key: fk.apply_tensor_parallel in your own loop"
    ),
    "cp_size": refused_when(lambda v: int(v) > 1, "context parallelism is not in fsdp2kit"),
    "cp_comm_strategy": "context parallelism only",
}


def _parallelism(conv: Conversion, cfg: dict, prefix: str = "parallelism_config.") -> None:
    written = {k.removeprefix("parallelism_config_"): k for k in cfg}
    apply_rules(conv, {name: cfg[k] for name, k in written.items()}, PARALLELISM, prefix, written)


# ---- the fsdp_config block ----

STRATEGY_NAMES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


# Names accelerate has read for a key, besides its own (accelerate <= 0.33 read the first as the
# second, with a FutureWarning; removed in 0.34, huggingface/accelerate#3098, though its FSDP guide
# still shows it). Keys without the "fsdp" prefix are covered by `canonical_keys`.
ALIASES = {"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"}


def canonical_keys(conv: Conversion, cfg: dict) -> tuple[dict, dict]:
    """``cfg`` under accelerate's current key names (a key without the "fsdp" prefix is read as "fsdp_" + key, as
    accelerate 0.6-0.11 wrote them; `ALIASES`), and each one's spelling; of two spellings the current one wins."""
    out, written = {}, {}
    for key in sorted(cfg, key=lambda k: not k.startswith("fsdp") or k in ALIASES):  # current names first
        name = key if key.startswith("fsdp") else "fsdp_" + key
        name = ALIASES.get(name, name)
        if name in out:
            conv.not_needed("fsdp_config." + key, cfg[key], f"another spelling of {written[name]}, which is used")
            continue
        out[name], written[name] = cfg[key], key
    return out, written


def _backward_prefetch(conv: Conversion, src: str, value: Any) -> None:
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
        old = ALIASES.get(src.removeprefix("fsdp_config."))
        note = notes[name] + (f"; old name of {old} (accelerate >= 0.34 no longer reads it)" if old else "")
        conv.set("parallel", "prefetch", depth, src, value, note)
    else:
        conv.refuse(src, value, "expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH")


WRAP_POLICIES = {
    "TRANSFORMER_BASED_WRAP": "shard_model makes every repeated block a unit (blocks='auto'), then the root",
    "SIZE_BASED_WRAP": "FSDP2 units are the repeated blocks (blocks='auto'); units by parameter count have "
    "no recipe key (in your own loop pass shard_model(blocks=predicate))",
    "NO_WRAP": "the recipe always makes the blocks units (one unit would gather the whole model); your own "
    "loop can pass shard_model(blocks=[])",
}


def _auto_wrap_policy(conv: Conversion, src: str, value: Any) -> None:
    reason = WRAP_POLICIES.get(str(value).upper()) if value else NO_GAIN
    conv.refuse_if(reason is None, src, value, "expected " + ", ".join(WRAP_POLICIES), reason)


def _activation_checkpointing(conv: Conversion, src: str, value: Any) -> None:
    if truthy(value):
        conv.set("parallel", "activation_checkpointing", "full", src, value)
    else:
        conv.not_needed(src, value, "off is the recipe's default")


def _switch(table: str, key: str, note: str) -> Rule:
    """Sets ``table.key`` to whether the value is on; ``note`` says what on means."""
    return lambda conv, src, value: conv.set(table, key, truthy(value), src, value, note if truthy(value) else "")


def convert_fsdp_config(conv: Conversion, cfg: dict, machines: int) -> None:
    """Convert the keys of an ``fsdp_config`` block (``machines``: the YAML's ``num_machines``)."""
    cfg, written = canonical_keys(conv, cfg)
    version = int(cfg.get("fsdp_version", 1) or 1)

    def strategy(conv: Conversion, src: str, value: Any) -> None:
        if isinstance(value, bool) or (version == 2 and str(value).lower() in ("true", "false")):
            name = "FULL_SHARD" if truthy(value) else "SHARD_GRAD_OP"
        else:  # a name (any case), or FSDP1's enum number 1-5
            text = str(value).strip().upper()
            name = dict(enumerate(STRATEGY_NAMES, 1)).get(int(text)) if text.isdigit() else text
        if name not in STRATEGY_NAMES:
            conv.refuse(src, value, f"expected a strategy name or 1-5 ({', '.join(STRATEGY_NAMES)}) or a bool")
            return
        note = ""
        if name.startswith("HYBRID"):
            if machines > 1:
                conv.set("parallel", "replicate", machines, src, value, "HSDP: shard in a machine, replicate across")
            else:
                name = "FULL_SHARD" if name == "HYBRID_SHARD" else "SHARD_GRAD_OP"
                note = f"one machine: {value} has nothing to replicate across, which is {name}"
        conv.set("parallel", "strategy", name, src, value, note)

    both = "accelerate takes the strategy from fsdp_sharding_strategy when both are set"
    rules: dict[str, Rule] = {
        "fsdp_version": "the recipe is FSDP2 (fully_shard) whatever this says",
        "fsdp_sharding_strategy": strategy,
        "fsdp_reshard_after_forward": both if "fsdp_sharding_strategy" in cfg else strategy,
        "fsdp_offload_params": _switch(
            "parallel", "cpu_offload", "FSDP2's CPU offload also runs the optimizer step on CPU"
        ),
        "fsdp_auto_wrap_policy": _auto_wrap_policy,
        "fsdp_transformer_layer_cls_to_wrap": "found from the model (its _no_split_modules or its repeated "
        "blocks); in your own loop shard_model(blocks=[LayerClass]) takes the classes, not their names",
        "fsdp_min_num_params": "units are blocks (see above)",
        "fsdp_backward_prefetch": _backward_prefetch,
        "fsdp_forward_prefetch": "[parallel] prefetch sets forward and backward prefetch together "
        "(fk.set_prefetch(forward=, backward=) sets them apart)",
        "fsdp_state_dict_type": "fsdp2kit.Checkpointer always writes sharded DCP checkpoints that load at any "
        "world size; full weights come from `fsdp2kit export-hf` / fk.export_hf. Old checkpoints: "
        "fk.load_fsdp1_checkpoint",
        "fsdp_use_orig_params": "FSDP2 always keeps the original parameters (one DTensor each): per-parameter "
        "optimizer groups, torch.compile and frozen parameters work without it",
        "fsdp_sync_module_states": "nothing to broadcast: the recipe builds on the meta device and every rank "
        "fills its own shards (materialize from the seed, or load_pretrained from the files)",
        "fsdp_cpu_ram_efficient_loading": _switch(
            "model", "meta_init", "built on the meta device; load_pretrained reads only each rank's rows"
        ),
        "fsdp_activation_checkpointing": _activation_checkpointing,
        "fsdp_activation_checkpointing_offload": refused_when(
            truthy,
            "activations are not offloaded to CPU by fsdp2kit; activation_checkpointing = 'full' keeps one "
            "input per block",
        ),
        "fsdp_ignored_modules": refused_when(
            bool,
            "no recipe key: in your own loop keep those modules out of shard_model's blocks, or call "
            "fully_shard(ignored_params=...) yourself",
        ),
    }
    apply_rules(conv, _in_order(cfg, rules), rules, "fsdp_config.", written)
