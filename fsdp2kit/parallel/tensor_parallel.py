"""apply_tensor_parallel: a model's own transformers TP plan (or yours) applied with torch's parallelize_module."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

from fsdp2kit._internal.fmt import fmt_list
from fsdp2kit._internal.markers import TENSOR_PARALLEL
from fsdp2kit.blocks import tied_slots
from fsdp2kit.parallel.cp_inputs import sub_mesh
from fsdp2kit.parallel.styles import for_module, resolve_style, weight_placement
from fsdp2kit.weights.nf4 import is_nf4
from fsdp2kit.wrappers.forward import check_order

__all__ = ["apply_tensor_parallel", "model_tp_plan", "planned_tp_shapes"]

Plan = Mapping[str, "str | ParallelStyle"]


def model_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The plan transformers would use for ``model``: the base model's ``base_model_tp_plan``, the
    input embeddings (vocabulary-parallel) and the head's ``_tp_plan``, with full module names."""
    plan = getattr(model, "tp_plan", None)  # transformers 5: merged over the base model and the head
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    base = dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})
    if not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix) and getattr(model, prefix) is not model:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    base.update(getattr(type(model), "_tp_plan", None) or {})
    return base


def _pattern(key: str) -> re.Pattern:
    """A plan key as a regex over full module names: ``*`` stands for one name segment (a layer number)."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*")))


def _config_sizes(model: nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    values = {f: getattr(config, f, None) for f in fields}
    sizes = {f: v for f, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
    if "num_attention_heads" in sizes:
        sizes.setdefault("num_key_value_heads", sizes["num_attention_heads"])
    return sizes


_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "out_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "w1", "w2", "w3"}


def _split_shapes(model: nn.Module, styles: dict[str, ParallelStyle | None], tp: int) -> dict[int, tuple[int, ...]]:
    """Each split parameter's shape on one TP rank (by ``id``), once checked: colwise / rowwise only on Linear and
    Embedding; the sizes the split modules depend on divide by ``tp`` (else unequal slices, or half-heads)."""
    modules = dict(model.named_modules())
    wrong = [
        f"{n} ({type(modules[n]).__name__})"
        for n, s in styles.items()
        if hasattr(s, "input_layouts") and not isinstance(modules[n], (nn.Linear, nn.Embedding))
    ]  # styles without input_layouts (the replicated one, a user's own ParallelStyle) are theirs to check
    if wrong:
        raise ValueError(
            "colwise / rowwise tensor parallelism splits nn.Linear and nn.Embedding weights; these plan entries are "
            f"other modules: {fmt_list(wrong)}"
        )
    split = {n for n, s in styles.items() if s is not None}
    leaves = {n.rsplit(".", 1)[-1] for n in split}
    # the config sizes the split modules depend on, by transformers' projection names (as its get_kv_heads_per_rank)
    relevant = dict.fromkeys(["num_attention_heads", "num_key_value_heads"], bool(leaves & _ATTENTION))
    relevant["intermediate_size"] = bool(leaves & _MLP)
    relevant["vocab_size"] = any(isinstance(modules[n], nn.Embedding) or n.endswith("lm_head") for n in split)
    problems = [f"config.{f} = {v}" for f, v in _config_sizes(model).items() if relevant[f] and v % tp]
    shapes: dict[int, tuple[int, ...]] = {}
    for name, style in styles.items():
        placement = weight_placement(modules[name], style)
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim
        for pname, p in modules[name].named_parameters(recurse=False):
            # a colwise Linear's bias is split with its outputs; other biases stay whole
            if (pname == "weight" or (dim == 0 and p.ndim == 1)) and p.ndim > dim:
                if pname == "weight" and p.shape[dim] % tp:
                    problems.append(f"{name}.weight dim {dim} = {p.shape[dim]}")
                shapes[id(p)] = (*p.shape[:dim], p.shape[dim] // tp, *p.shape[dim + 1 :])
    if problems:
        raise ValueError(
            f"tensor parallelism over {tp} ranks needs these sizes to divide by {tp}, and they do not: "
            f"{fmt_list(problems)}. Choose a TP size that divides the model's heads, KV heads, MLP width and "
            "vocabulary"
        )
    return shapes


def _check_ties(groups, styles: dict[str, ParallelStyle | None]) -> None:
    """A weight shared by several modules (a tied head) must be split the same way by each of them."""
    for group in groups:
        layouts = {  # no style: not split (weight_placement's None); a split module's other parameters: unknown
            f"{m}.{p}": weight_placement(module, styles.get(m)) if p == "weight" or styles.get(m) is None else "unknown"
            for m, module, p in group
        }
        values = list(layouts.values())
        if "unknown" in values or any(v != values[0] for v in values):
            shown = ", ".join(f"{k}: {v if v is not None else 'not split'}" for k, v in layouts.items())
            raise ValueError(
                f"a tied weight is laid out differently by its modules' tensor-parallel styles ({shown}); give every "
                "module that shares it a style that splits it the same way (e.g. embedding_rowwise with a "
                "colwise head), or untie it"
            )


def _resolve(model: nn.Module, plan: str | Plan) -> tuple[dict[str, Any], dict[str, ParallelStyle | None]]:
    """Every module the plan names, with its style as given and as a torch style; unmatched patterns of yours raise."""
    if isinstance(plan, str) and plan != "auto":
        raise ValueError(f"plan must be 'auto' or a mapping of module patterns to styles, got {plan!r}")
    if not isinstance(plan, (str, Mapping)):
        raise TypeError(f"plan must be 'auto' or a mapping, got {type(plan).__name__}")
    given = plan if isinstance(plan, Mapping) else model_tp_plan(model)
    if not given and isinstance(plan, str):
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan of its own (no base_model_tp_plan in its config); "
            "pass plan={'layers.*.attn.q_proj': 'colwise', ...}"
        )
    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    chosen: dict[str, Any] = {}
    unmatched = []
    for key, style in given.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor-parallel plan keys are module-name patterns (str), got {key!r}")
        rx = _pattern(key)
        hits = [n for n in modules if rx.fullmatch(n)]
        if not hits and any(rx.fullmatch(p) for p in params):
            raise ValueError(
                f"tensor-parallel plan entry {key!r} names a parameter, not a module: apply_tensor_parallel "
                "shards whole modules (name the module that owns it)"
            )
        if not hits:
            unmatched.append(key)
        chosen.update(dict.fromkeys(hits, style))  # a later, more specific entry wins, as in a dict update
    if unmatched and isinstance(plan, Mapping):
        raise ValueError(f"tensor-parallel plan entries match no module of {type(model).__name__}: {unmatched}")
    return chosen, {name: resolve_style(style, name) for name, style in chosen.items()}


def planned_tp_shapes(model: nn.Module, tp: int, plan: str | Plan = "auto") -> dict[int, tuple[int, ...]]:
    """`_split_shapes` without a mesh (for planning), after the same checks as `apply_tensor_parallel`."""
    return _split_shapes(model, _resolve(model, plan)[1], tp)


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: str | Plan = "auto", *, loss_parallel: bool = False
) -> nn.Module:
    """Split ``model``'s layers over ``mesh["tp"]`` in place (Megatron-style tensor parallelism); returns it.

    ``model``: unsharded, on its device or on the meta device, after `enable_float8` / PEFT and before
    `apply_activation_checkpointing`, `compile_blocks` and `shard_model` (ORDER in fsdp2kit.wrappers.forward).
    ``mesh``: from ``fsdp2kit.make_mesh(shard=..., tp=...)``. ``plan``: ``"auto"`` (the model's own transformers
    plan) or a mapping from module-name patterns (``*`` is one name segment) to a style name
    (`fsdp2kit.parallel.styles.STYLE_NAMES`) or a torch ``ParallelStyle``. ``loss_parallel``: keep the logits of
    the head (``model.get_output_embeddings()``) split over the vocabulary; compute the loss inside
    ``torch.distributed.tensor.parallel.loss_parallel()``.
    Every rank builds the same model (same seed) and keeps its slice of its own copy: nothing is broadcast.
    What is checked before any collective, and how it composes: README.md, section Tensor parallelism.
    """
    tp_mesh = sub_mesh(mesh, "apply_tensor_parallel", "tp", required=True)
    check_order(model, "apply_tensor_parallel")
    nf4 = [n for n, p in model.named_parameters() if is_nf4(p)]
    if nf4:
        # torchao's NF4Tensor splits only along rows into whole quantization groups and re-quantizes
        # on any other slice, so a column split would change the weights: refused up front.
        raise ValueError(
            f"apply_tensor_parallel cannot split NF4 weights ({fmt_list(nf4, 2)}): QLoRA runs with FSDP / HSDP "
            "only (tensor parallelism and NF4 are not supported together); drop tp, or quantize_nf4 not at all"
        )
    chosen, styles = _resolve(model, plan)
    if loss_parallel:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"loss_parallel=True needs the output head as an nn.Linear from model.get_output_embeddings(); "
                f"{type(model).__name__} gives {type(head).__name__}"
            )
        head_name = next(n for n, m in model.named_modules() if m is head)
        chosen[head_name] = "colwise (loss parallel)"
        styles[head_name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    tp = tp_mesh.size()
    _split_shapes(model, styles, tp)
    groups = tied_slots(model)
    _check_ties(groups, styles)

    modules = dict(model.named_modules())
    active = {name: for_module(modules[name], style) for name, style in styles.items() if style is not None}
    # src_data_rank=None: each rank keeps its slice of its own copy (no collective; a meta model stays on meta)
    parallelize_module(model, tp_mesh, active, src_data_rank=None)
    for (_, first, first_name), *others in groups:
        for _, module, pname in others:  # parallelize_module gave each module a new Parameter: tie them again
            module._parameters[pname] = first._parameters[first_name]
    labels = {n: s if isinstance(s, str) else type(s).__name__ for n, s in chosen.items()}
    setattr(model, TENSOR_PARALLEL, {"tp": tp, "plan": labels})
    return model
