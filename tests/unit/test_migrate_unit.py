"""convert-config on the documented examples (golden TOML), every key accounted for, the TOML valid for the
recipe; and the checkpoint loaders' errors, on plain modules (no process group needed)."""

from __future__ import annotations

import dataclasses
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp2kit as fk
from fsdp2kit.cli import main as cli
from fsdp2kit.migrate.conversion import RECIPE_KEYS, truthy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "docs" / "examples").iterdir() if p.suffix in (".yaml", ".json"))
pytestmark = pytest.mark.timeout(120)


def _leaves(data, prefix=""):
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip(".")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_converts_to_the_committed_toml(example: Path) -> None:
    conv = fk.convert_config(example)
    assert conv.to_toml(f"{example.stem}.toml") == example.with_suffix(".toml").read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_source_key_is_accounted_for(example: Path) -> None:
    import json

    import yaml

    text = example.read_text()
    data = json.loads(text) if example.suffix == ".json" else yaml.safe_load(text)
    conv = fk.convert_config(example)
    keys = {e.key for e in conv.entries}
    toml = conv.to_toml()
    for leaf in _leaves(data):
        parts = leaf.split(".")
        covered = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in keys]
        assert covered, f"{example.name}: {leaf} was dropped"
        assert covered[0] in toml, f"{example.name}: {covered[0]} is not in the TOML"


def test_recipe_keys_exist_in_the_recipe() -> None:
    from support.options import Config

    defaults = Config()  # `from __future__ import annotations` makes field types strings: use instances
    tables = {}
    for table in dataclasses.fields(Config):
        tables[table.name] = {f.name for f in dataclasses.fields(getattr(defaults, table.name))}
    for table, keys in RECIPE_KEYS.items():
        assert set(keys) <= tables[table], f"[{table}] {set(keys) - tables[table]} are not recipe keys"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if "nvme" not in e.name], ids=lambda p: p.name)
def test_toml_is_accepted_by_the_recipe(example: Path, tmp_path: Path) -> None:
    from support.config import parse_config
    from support.options import Config

    conv = fk.convert_config(example)
    path = tmp_path / "c.toml"
    path.write_text(conv.to_toml())
    cfg = parse_config(Config, ["--config", str(path)])
    for table, values in conv.settings.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, table), key) == value
    assert tomllib.loads(path.read_text()) == conv.settings


@pytest.mark.parametrize("example", [e for e in EXAMPLES if "nvme" not in e.name], ids=lambda p: p.name)
def test_settings_pass_shard_models_checks(example: Path) -> None:
    """The converted [parallel] settings are ones shard_model accepts (strategy vs mesh shape, precision)."""
    from models import TinyGPT

    p = fk.convert_config(example).settings.get("parallel", {})
    with torch.device("meta"):
        model = TinyGPT()
    shard = p.get("shard", 8) if p.get("shard", -1) > 0 else 8
    fk.estimate_plan(
        model,
        shard=shard,
        replicate=p.get("replicate", 1),
        strategy=p.get("strategy"),
        mixed_precision=p.get("mixed_precision"),
        cpu_offload=p.get("cpu_offload", False),
    )


def test_docs_show_every_example() -> None:
    doc = (ROOT / "docs" / "migrating.md").read_text()
    for example in EXAMPLES:
        assert example.read_text().strip() in doc, f"docs/migrating.md does not show {example.name}"
        assert f"docs/examples/{example.name}" in doc


def test_cli_refuses_and_lists(tmp_path: Path, capsys) -> None:
    nvme = ROOT / "docs" / "examples" / "deepspeed_zero3_nvme.json"
    assert cli(["convert-config", str(nvme)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "offload_param.device = 'nvme'" in captured.err and "cpu_offload = true" in captured.err
    assert cli(["convert-config", str(nvme), "--allow-refused", "-o", str(tmp_path / "x.toml")]) == 0
    assert "# REFUSED:" in (tmp_path / "x.toml").read_text()
    ok = ROOT / "docs" / "examples" / "accelerate_fsdp1.yaml"
    assert cli(["convert-config", str(ok)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("# Converted by")
    assert (
        "run: torchrun --nproc_per_node=8 --standalone recipes/train.py --config accelerate_fsdp1.toml" in captured.err
    )


def _convert(tmp_path: Path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return fk.convert_config(path)


@pytest.mark.parametrize(
    "value, machines, strategy, replicate",
    [
        (1, 1, "FULL_SHARD", None),
        ("2", 1, "SHARD_GRAD_OP", None),
        ("no_shard", 1, "NO_SHARD", None),
        (4, 1, "FULL_SHARD", None),  # HYBRID on one machine is FULL_SHARD
        (5, 1, "SHARD_GRAD_OP", None),
        ("HYBRID_SHARD", 2, "HYBRID_SHARD", 2),
    ],
)
def test_accelerate_strategies(tmp_path: Path, value, machines, strategy, replicate) -> None:
    conv = _convert(
        tmp_path,
        f"distributed_type: FSDP\nnum_machines: {machines}\nnum_processes: {8 * machines}\n"
        f"fsdp_config:\n  fsdp_sharding_strategy: {value}\n",
    )
    assert conv.settings["parallel"]["strategy"] == strategy
    assert conv.settings["parallel"].get("replicate") == replicate
    assert conv.nproc_per_node == 8 and not conv.refused


# The YAML of Accelerate's own FSDP guide (docs/source/usage_guides/fsdp.md), as printed there.
ACCELERATE_GUIDE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_fsdp_guide_yaml_converts(tmp_path: Path) -> None:
    conv = _convert(tmp_path, ACCELERATE_GUIDE_YAML)
    assert not conv.refused, [(e.key, e.note) for e in conv.refused]
    prefetch = next(e for e in conv.entries if e.key == "fsdp_config.fsdp_backward_prefetch_policy")
    assert prefetch.target == "parallel.prefetch" and "old name of fsdp_backward_prefetch" in prefetch.note
    assert conv.settings["parallel"]["prefetch"] == 1 and conv.settings["parallel"]["strategy"] == "FULL_SHARD"


# Every other spelling accelerate reads for a key: in fsdp_config without the "fsdp_" prefix (`accelerate
# launch` adds it; accelerate 0.6-0.11 wrote sharding_strategy, offload_params, min_num_params,
# transformer_layer_cls_to_wrap so), the old backward_prefetch_policy, dynamo_config keys without
# "dynamo_", fp8_config keys with "fp8_", and top-level blocks of older releases.
ALIASES = [
    ("fsdp_config", "sharding_strategy", "2", "parallel.strategy", "SHARD_GRAD_OP"),
    ("fsdp_config", "reshard_after_forward", "false", "parallel.strategy", "SHARD_GRAD_OP"),
    ("fsdp_config", "offload_params", "true", "parallel.cpu_offload", True),
    ("fsdp_config", "min_num_params", "100000000", None, None),
    ("fsdp_config", "transformer_layer_cls_to_wrap", "BertLayer", None, None),
    ("fsdp_config", "auto_wrap_policy", "TRANSFORMER_BASED_WRAP", None, None),
    ("fsdp_config", "backward_prefetch", "BACKWARD_POST", "parallel.prefetch", 1),
    ("fsdp_config", "backward_prefetch_policy", "NO_PREFETCH", "parallel.prefetch", 0),
    ("fsdp_config", "fsdp_backward_prefetch_policy", "BACKWARD_PRE", "parallel.prefetch", 1),
    ("fsdp_config", "fsdp_backward_prefetch", "1", "parallel.prefetch", 1),  # BackwardPrefetch.BACKWARD_PRE
    ("fsdp_config", "forward_prefetch", "false", None, None),
    ("fsdp_config", "state_dict_type", "FULL_STATE_DICT", None, None),
    ("fsdp_config", "use_orig_params", "true", None, None),
    ("fsdp_config", "sync_module_states", "true", None, None),
    ("fsdp_config", "cpu_ram_efficient_loading", "true", "model.meta_init", True),
    ("fsdp_config", "activation_checkpointing", "true", "parallel.activation_checkpointing", "full"),
    ("fsdp_config", "version", "2", None, None),
    ("dynamo_config", "backend", "INDUCTOR", "parallel.compile", True),
    ("dynamo_config", "use_regional_compilation", "true", None, None),
    ("dynamo_config", "mode", "default", None, None),
    ("fp8_config", "fp8_backend", "AO", "parallel.float8", True),
    ("fp8_config", "fp8_pad_inner_dim", "true", None, None),
    (None, "tpu_cluster", "false", None, None),
    (None, "ipex_config", "{ipex: false}", None, None),
    (None, "xpu_config", "{use_xpu: false}", None, None),
    (None, "tp_config", "{tp_size: 1}", None, None),
]


@pytest.mark.parametrize(("block", "key", "value", "target", "expected"), ALIASES, ids=lambda v: str(v))
def test_accelerate_key_aliases(tmp_path: Path, block, key, value, target, expected) -> None:
    nested = f"{block}:\n  {key}: {value}\n" if block else f"{key}: {value}\n"
    text = "distributed_type: FSDP\n" + nested
    conv = _convert(tmp_path, text)
    assert not conv.refused, [(e.key, e.note) for e in conv.refused]
    src = key if block is None else f"{block}.{key}"
    entry = next(e for e in conv.entries if e.key == src or e.key.startswith(src + "."))  # as written
    if target is not None:
        table, name = target.split(".")
        assert entry.target == target and conv.settings[table][name] == expected


def test_accelerate_current_name_wins_over_an_alias(tmp_path: Path) -> None:
    conv = _convert(
        tmp_path,
        "distributed_type: FSDP\nfsdp_config:\n  backward_prefetch_policy: NO_PREFETCH\n"
        "  fsdp_backward_prefetch: BACKWARD_PRE\n",
    )
    assert conv.settings["parallel"]["prefetch"] == 1
    other = next(e for e in conv.entries if e.key == "fsdp_config.backward_prefetch_policy")
    assert "another spelling of fsdp_backward_prefetch" in other.note


def test_fsdp2_reshard_after_forward_bool(tmp_path: Path) -> None:
    conv = _convert(
        tmp_path, "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
    )
    assert conv.settings["parallel"]["strategy"] == "SHARD_GRAD_OP"


def test_unknown_and_unsupported_keys_are_refused(tmp_path: Path) -> None:
    conv = _convert(
        tmp_path,
        "distributed_type: XLA\nfsdp_config:\n  fsdp_bogus: 1\nsomething_new: true\nmixed_precision: fp8\n",
    )
    refused = {e.key: e.note for e in conv.refused}
    assert "distributed_type" in refused and "torch_xla" in refused["distributed_type"]
    assert "unknown Accelerate key" in refused["something_new"]
    assert conv.settings["parallel"] == {"mixed_precision": "bf16", "float8": True}
    assert "fsdp_config" in {e.key for e in conv.entries}  # ignored by accelerate when not FSDP: said so


def test_deepspeed_conflicts_and_auto(tmp_path: Path) -> None:
    conv = _convert(
        tmp_path,
        '{"bf16": {"enabled": true}, "fp16": {"enabled": true}, "gradient_clipping": "auto",'
        ' "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},'
        ' "optimizer": {"type": "Lamb", "params": {"lr": 1e-4, "betas": [0.8, 0.9]}}}',
        "ds.json",
    )
    refused = {e.key: e.note for e in conv.refused}
    assert "conflicts" in refused["fp16.enabled"]
    assert "partial offload" in refused["zero_optimization.offload_optimizer.ratio"]
    assert "AdamW" in refused["optimizer.type"] and "optimizer.params.betas" in refused
    assert conv.settings["parallel"] == {"mixed_precision": "bf16", "strategy": "SHARD_GRAD_OP", "cpu_offload": True}
    assert conv.settings["train"] == {"lr": 1e-4}
    assert any(e.key == "gradient_clipping" and "auto" in e.note for e in conv.entries)


def test_accelerate_deepspeed_block(tmp_path: Path) -> None:
    conv = _convert(
        tmp_path,
        "distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_optimizer_device: cpu\n  offload_param_device: none\n  gradient_accumulation_steps: 4\n"
        "  zero3_init_flag: true\n  zero3_save_16bit_model: true\n",
    )
    assert not conv.refused
    assert conv.settings["parallel"] == {"strategy": "FULL_SHARD", "cpu_offload": True}
    assert conv.settings["train"] == {"grad_accum": 4} and conv.settings["model"] == {"meta_init": True}


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid YAML"):
        _convert(tmp_path, "a: [b\n")
    with pytest.raises(ValueError, match="looks like a DeepSpeed config"):
        _convert(tmp_path, "zero_optimization: {stage: 3}\n")
    with pytest.raises(FileNotFoundError):
        fk.convert_config(tmp_path / "absent.yaml")


# ---- checkpoint loaders, on a plain module (the sharded paths are in tests/dist/test_migrate_checkpoints.py) ----


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)


def test_full_state_dict_errors_name_the_keys(tmp_path: Path) -> None:
    model, other = Net(), Net()
    sd = other.state_dict()
    torch.save({k: v for k, v in sd.items() if k != "b.bias"}, tmp_path / "missing.bin")
    with pytest.raises(ValueError, match=r"missing from the file: b\.bias"):
        fk.load_full_state_dict(model, tmp_path / "missing.bin")
    torch.save({**sd, "a.weight": torch.zeros(5, 3), "c.extra": torch.zeros(1)}, tmp_path / "bad.bin")
    with pytest.raises(ValueError, match=r"shape mismatch: a\.weight \[5, 3\].*the model lacks: c\.extra"):
        fk.load_full_state_dict(model, tmp_path / "bad.bin")
    torch.save({"model": sd, "step": 3}, tmp_path / "wrapped.pt")  # torch.save({"model": ...}) layouts unwrap
    fk.load_full_state_dict(model, tmp_path / "wrapped.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), sd.values()))


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_pickled_code_is_never_run(tmp_path: Path, capfd) -> None:
    with open(tmp_path / "pytorch_model_fsdp.bin", "wb") as f:
        pickle.dump({"a.weight": _Evil()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        fk.load_fsdp1_checkpoint(Net(), tmp_path)
    assert "pickled code ran" not in capfd.readouterr().out


def test_fsdp1_layout_errors(tmp_path: Path) -> None:
    (tmp_path / "ds" / "global_step10").mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step10")
    with pytest.raises(ValueError, match=re.escape("zero_to_fp32.py")):
        fk.load_fsdp1_checkpoint(Net(), tmp_path / "ds")
    (tmp_path / "local").mkdir()
    torch.save({}, tmp_path / "local" / "pytorch_model_fsdp_0_rank0.bin")
    with pytest.raises(ValueError, match="use_dcp=False or LOCAL_STATE_DICT"):
        fk.load_fsdp1_checkpoint(Net(), tmp_path / "local")
    (tmp_path / "full").mkdir()
    model = Net()
    torch.save(model.state_dict(), tmp_path / "full" / "pytorch_model_fsdp.bin")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="holds no optimizer state"):
        fk.load_fsdp1_checkpoint(model, tmp_path / "full", opt)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "full" / "optimizer.bin")  # keyed by index: FSDP1's flat shards
    with pytest.raises(ValueError, match="keyed by parameter index"):
        fk.load_fsdp1_checkpoint(model, tmp_path / "full", opt)


def test_deepspeed_style_file_into_a_meta_built_hf_model(tmp_path: Path) -> None:
    """zero_to_fp32 output of a transformers model: in-memory names, rotary inv_freq included."""
    from models import tiny_llama
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = tiny_llama(tied=True)
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}  # tied: once
    state.update({n: b.clone() for n, b in source.named_buffers() if n.endswith("inv_freq")})
    save_file(state, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = tiny_llama(tied=True)
    result = fk.load_full_state_dict(model, tmp_path)
    assert result.skipped_keys == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    for (name, got), want in zip(model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(got, want), name
    rotary = model.model.rotary_emb.inv_freq
    assert torch.equal(rotary, source.model.rotary_emb.inv_freq)  # recomputed, not left as garbage
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    ("value", "on"),
    [({}, False), ({"enabled": "false"}, False), ({"enabled": "yes"}, True), ({"stage": 3}, True), ("off", False)],
)
def test_truthy_reads_switches_and_deepspeed_blocks(value, on):
    assert truthy(value) is on
