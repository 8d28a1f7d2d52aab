"""Accelerate's ``fsdp_config`` block -> recipe settings: strategy, offload, wrapping, prefetch, state dicts.

FSDP1 configs give the strategy as ``fsdp_sharding_strategy`` (a name, or FSDP1's enum number 1-5)
or, in newer accelerate, as ``fsdp_reshard_after_forward`` holding a strategy name; FSDP2 configs
give ``fsdp_reshard_after_forward`` as a bool. Keys that only steered FSDP1 (flat parameters, rank-0
broadcast, state-dict types) are reported as not needed, with the reason.
"""

from __future__ import annotations

from typing import Any

from fsdp2kit.migrate.conversion import Conversion, truthy

__all__ = ["STRATEGY_NAMES", "convert_fsdp_config"]

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
        name = {"1": "BACKWARD_PRE", "2": "BACKWARD_POST"}.get(name, name)  # BackwardPrefetch's numbers
        notes = {
            "BACKWARD_PRE": "the next block's all-gather is issued before this block's backward",
            "BACKWARD_POST": "the next block's all-gather is issued before this block's backward (FSDP2 has no "
            "BACKWARD_POST; this is BACKWARD_PRE)",
            "NO_PREFETCH": "no explicit prefetch; FSDP2 still overlaps one all-gather implicitly",
        }
        note = notes.get("NO_PREFETCH" if name == "NONE" else name)
        if note:
            note = "; ".join(filter(None, [note, ALIAS_NOTES.get(written["fsdp_backward_prefetch"])]))
            conv.set(
                "parallel", "prefetch", int(name.startswith("BACKWARD")), src("fsdp_backward_prefetch"), value, note
            )
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
