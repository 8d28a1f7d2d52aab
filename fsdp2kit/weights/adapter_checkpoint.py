"""A PEFT model rebuilt in one process from its pretrained base and a checkpoint of its adapters."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdp2kit._internal.hf_load import from_pretrained
from fsdp2kit.checkpoint.comm import quiet_dcp
from fsdp2kit.checkpoint.layout import read_info
from fsdp2kit.checkpoint.state import model_options
from fsdp2kit.checkpoint.unpickler import SafeReader, read_metadata
from fsdp2kit.weights.nf4 import quantize_nf4


def load_alone(state: dict, step_dir: Path, metadata) -> None:
    """``dcp.load`` without a process group (DCP's warning that it assumes one process silenced: it does)."""
    with quiet_dcp(True):
        dcp.load(state, storage_reader=SafeReader(step_dir, metadata), no_dist=True)


def peft_model_from_checkpoint(step_dir: Path, base: str | os.PathLike) -> nn.Module:
    """The PEFT model of a trainable-only step, in one process: ``base`` at the run's storage dtype
    (NF4-quantized again for QLoRA: the same 4 bits), the saved adapter configs, the step's adapters."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    desc = read_info(step_dir).get("peft")
    if not desc:
        raise ValueError(
            f"{step_dir} holds only the trainable parameters of a model that is not a peft PeftModel (parameters "
            "frozen by hand): rebuild that model, load the step into it with fsdp2kit.Checkpointer and call "
            "fsdp2kit.export_hf"
        )
    if not Path(base, "config.json").is_file():
        raise FileNotFoundError(f"base={str(base)!r} is not a Hugging Face model directory (no config.json there)")
    dtype = getattr(torch, desc["base_dtype"]) if desc.get("base_dtype") else None
    model = from_pretrained(AutoModelForCausalLM, str(base), dtype=dtype, local_files_only=True)
    if nf4 := desc.get("nf4"):
        groups = {k: nf4[k] for k in ("block_size", "scaler_block_size")}
        done = quantize_nf4(model, **groups, dtype=getattr(torch, nf4["dtype"]))
        if differ := sorted(set(done) ^ set(nf4["weights"])):
            raise ValueError(f"quantizing {base} to NF4 again gives other weights than the run had: {differ[:6]}")
    configs = {name: PeftConfig.from_peft_type(**d) for name, d in desc["adapters"].items()}
    first, *others = configs
    model = get_peft_model(model, configs[first], adapter_name=first)
    for name in others:
        model.add_adapter(name, configs[name])
    model.base_model.set_adapter(desc["active"])
    # DCP without a process group: this runs alone, even beside a live one (e.g. on rank 0 only).
    options = model_options(trainable_only=True)
    state = {"model": get_model_state_dict(model, options=options)}
    load_alone(state, step_dir, read_metadata(step_dir))  # SafeReader takes the allow-listed metadata
    set_model_state_dict(model, state["model"], options=options)
    return model
