"""PEFT models seen from fsdp2kit: which parameters are adapters, the base's own names, merged weights."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2kit._internal.dtensor import gather_full, local_shard
from fsdp2kit.weights.hf_layout import clean_fqn, is_instance_of
from fsdp2kit.weights.nf4 import is_nf4


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (without importing peft for other models)."""
    return is_instance_of(model, "peft", "PeftModel")


def peft_description(model: nn.Module) -> dict | None:
    """What rebuilds a PEFT model around its pretrained base, for a checkpoint of its adapters only: peft's
    adapter configs, the active adapters, the base's storage dtype, a QLoRA base's NF4 groups and weights."""
    if not is_peft_model(model):
        return None
    adapters = {
        name: {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        for name, config in model.peft_config.items()
    }
    nf4 = [(n, local_shard(p)) for n, p in model.named_parameters() if is_nf4(p)]
    plain = [p.dtype for p in model.parameters() if not p.requires_grad and not is_nf4(p) and p.is_floating_point()]
    base_dtype = max(set(plain), key=plain.count) if plain else (nf4[0][1].dtype if nf4 else None)
    return {
        "adapters": adapters,
        "active": list(model.active_adapters),  # peft's PeftModel gives a list
        "base_dtype": str(base_dtype).removeprefix("torch.") if base_dtype is not None else None,
        "nf4": {
            "block_size": nf4[0][1].block_size,
            "scaler_block_size": nf4[0][1].scaler_block_size,
            "dtype": str(nf4[0][1].dtype).removeprefix("torch."),
            "weights": sorted(base_name(clean_fqn(n)) for n, _ in nf4),
        }
        if nf4
        else None,
    }


def adapter_keys(model: nn.Module, adapter: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Model parameter name -> the key PEFT writes it under, as peft's ``get_peft_model_state_dict`` says
    (its values mapped back to our names by identity)."""
    from peft.utils import get_peft_model_state_dict

    by_id = {id(t): n for n, t in tensors.items()}
    selected = get_peft_model_state_dict(model, state_dict=tensors, adapter_name=adapter, save_embedding_layers=False)
    return {by_id[id(value)]: key for key, value in selected.items()}


def base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def peft_view(
    model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]
) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, str]]:
    """A PEFT model's frozen base under the wrapped model's names: that model, its tensors and tied-name aliases."""
    adapters = {n for adapter in model.peft_config for n in adapter_keys(model, adapter, tensors)}
    names = {  # base name -> PEFT model name
        base_name(name.replace(".original_module.", ".")): name
        for name in tensors
        if name not in adapters and ".modules_to_save." not in name
    }
    return (
        model.get_base_model(),
        {b: tensors[n] for b, n in names.items()},
        {b: base_name(aliases.get(n, n)) for b, n in names.items()},
    )


def lora_merges(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each LoRA-wrapped base weight's name -> its (layer, active adapter) pairs to fold in; DoRA, LoRA biases,
    modules_to_save and other PEFT types are a ``ValueError``."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config_types = sorted({c.peft_type.value for c in model.peft_config.values()})
    if config_types != ["LORA"]:
        raise ValueError(f"export_hf(merge=True) merges LoRA adapters only; this model has {config_types}")
    active = list(model.active_adapters)
    merges, bad = {}, []
    for name, module in model.named_modules():
        label = clean_fqn(name)
        if ".modules_to_save" in label:
            bad.append(f"{label} (modules_to_save)")
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            bad.append(f"{label} ({type(module).__name__})")
        elif any(a in getattr(module, "lora_magnitude_vector", {}) for a in active):
            bad.append(f"{label} (DoRA)")
        elif any(getattr(module.lora_B[a], "bias", None) is not None for a in active if a in module.lora_B):
            bad.append(f"{label} (lora_bias)")
        merges[base_name(f"{label}.base_layer.weight")] = [(module, a) for a in active if a in module.lora_A]
    if bad:
        raise ValueError(f"export_hf(merge=True) cannot fold these into the base weights: {bad[:8]}")
    return merges


def merged_weight(weight: torch.Tensor, layers: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """``weight + sum(scaling * B @ A)`` over the (layer, adapter) pairs in the wider dtype, bit for bit peft's
    ``merge_and_unload()``; an NF4 weight is dequantized first. Collective: the factors are gathered whole."""
    if is_nf4(weight):
        weight = weight.get_original_weight()
    out = weight
    for layer, adapter in layers:
        delta = gather_full(layer.lora_B[adapter].weight) @ gather_full(layer.lora_A[adapter].weight)
        delta = (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]
        out = (out.to(torch.promote_types(out.dtype, delta.dtype)) + delta).to(weight.dtype)
    return out


def peft_init_fn(model: nn.Module):
    """An ``init_fn`` for `fsdp2kit.materialize`: peft's own adapter init (``init_lora_weights`` True,
    "gaussian" or False) re-run on a PEFT model built on meta, and the wrapped model's init elsewhere."""
    import math

    from peft.tuners.lora import LoraLayer

    roles: dict[int, tuple[str, object, int]] = {}  # id(lora_A / lora_B module) -> (factor, how, r)
    for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
        for adapter in layer.lora_A:
            how = model.peft_config[adapter].init_lora_weights
            if how not in (True, False, "gaussian"):
                raise ValueError(
                    f"init_lora_weights={how!r} cannot be re-run on a model built on the meta device (it needs the "
                    "base weights first); build the PEFT model on CPU, or use init_lora_weights=True / 'gaussian' / "
                    "False"
                )
            roles[id(layer.lora_A[adapter])] = ("A", how, layer.r[adapter])
            roles[id(layer.lora_B[adapter])] = ("B", how, layer.r[adapter])
    own = getattr(model.get_base_model(), "_init_weights", None)

    def init(module: nn.Module) -> None:
        kind, how, r = roles.get(id(module), (None, None, 0))
        if kind is None:
            if not any(True for _ in module.parameters(recurse=False)):
                return
            if own is not None:
                own(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            return
        if how is False:
            module.reset_parameters()
        elif kind == "B":  # zero, so the adapted model starts as the base
            nn.init.zeros_(module.weight)
        elif how is True:
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            nn.init.normal_(module.weight, std=1 / r)
        if how is not False and getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    return init


def apply_lora(
    model: nn.Module,
    *,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    targets: str | list[str] = "all-linear",
    **lora_kwargs,
) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters (``get_peft_model``), checking the targets first.

    Call it before `fsdp2kit.shard_model` (after `fsdp2kit.quantize_nf4` for QLoRA); peft keeps
    the adapters in fp32 even on a bf16 base.

    Args:
        targets: ``"all-linear"`` (peft's: every Linear but the output head), or module names
            as peft matches them (a name equal to, or ending with ``.`` + the target). A target
            that matches no ``nn.Linear`` raises ``ValueError`` listing the Linear names there are.
        lora_kwargs: any other ``peft.LoraConfig`` field (``init_lora_weights``, ``use_rslora``...).
    """
    from peft import LoraConfig, get_peft_model

    if targets != "all-linear":
        targets = [targets] if isinstance(targets, str) else targets
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
        if unmatched:
            leaves = sorted({n.rpartition(".")[2] for n in linear})
            raise ValueError(
                f"LoRA targets {unmatched} match no nn.Linear of {type(model).__name__}; its Linear layers are "
                f"named {leaves} (targets match a module name or its last parts, e.g. 'q_proj' or 'self_attn.q_proj')"
            )
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, **lora_kwargs)
    return get_peft_model(model, config)
