"""Weights in and out of sharded models, run inside `run_world` ranks.

The references are plain single-process transformers: the model a checkpoint was saved from
(re-read with ``from_pretrained`` in the same process, so both sides use the same kernels and
thread count and logits can be compared bit for bit), and models built the ordinary way on CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp2kit as fk

VOCAB = 96


def hf_config(kind: str):
    """Tiny configs, one per family the tests cover (uneven sizes on purpose: 40 / 3 ranks)."""
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update(max_position_embeddings=64, attn_implementation="eager")
    if kind in ("llama", "llama-tied", "llama-fused"):
        return t.LlamaConfig(intermediate_size=56, tie_word_embeddings=kind == "llama-tied", **common)
    if kind == "qwen2":
        return t.Qwen2Config(intermediate_size=56, **common)
    if kind == "gemma2":  # tied, pad row 0, embed_scale buffer, (1 + w) RMSNorm initialised to 0
        return t.Gemma2Config(intermediate_size=56, head_dim=10, **common)
    if kind == "mixtral":  # experts fused in the module, one tensor per expert on disk
        return t.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common)
    if kind == "qwen3_moe":
        return t.Qwen3MoeConfig(
            intermediate_size=56, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=10, **common
        )
    if kind == "gpt2":  # tied, Conv1D layers, scaled residual init
        return t.GPT2Config(
            vocab_size=VOCAB, n_embd=40, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            attn_implementation="eager",
        )  # fmt: skip
    raise ValueError(kind)


_fused = []


def fused_llama_class():
    """A Llama whose checkpoints store gate and up projections as one tensor per layer.

    Registered with transformers the way a model with its own on-disk layout is (class-name
    conversion mapping), it exercises a conversion that is not dim-0 sharding safe: one fused
    tensor on disk split into two sharded parameters, and concatenated back on export.
    """
    if not _fused:
        from transformers import LlamaForCausalLM
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import Chunk, WeightConverter

        class FusedGateUpLlama(LlamaForCausalLM):
            pass

        register_checkpoint_conversion_mapping(
            "FusedGateUpLlama",
            [
                WeightConverter(
                    "mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)]
                )
            ],
            overwrite=True,
        )
        _fused.append(FusedGateUpLlama)
    return _fused[0]


def hf_model(kind: str, *, meta: bool = False):
    from transformers import AutoModelForCausalLM

    config = hf_config(kind)
    build = fused_llama_class() if kind == "llama-fused" else AutoModelForCausalLM.from_config
    if meta:
        with torch.device("meta"):
            return build(config)
    return build(config)


KINDS = ("llama", "llama-tied", "gpt2", "gemma2", "qwen2", "mixtral", "qwen3_moe")


def save_references(root: Path) -> None:
    """One saved checkpoint per kind (seed 0), plus llama saved in several files with an index."""
    for kind in KINDS:
        torch.manual_seed(0)
        hf_model(kind).save_pretrained(root / kind)
    torch.manual_seed(0)
    hf_model("llama").save_pretrained(root / "llama-sharded", max_shard_size="20KB")
    torch.manual_seed(0)
    hf_model("llama").to(torch.bfloat16).save_pretrained(root / "llama-bf16")  # the usual published dtype
    # The llama weights with gate and up fused on disk, for the FusedGateUpLlama layout.
    from safetensors.torch import load_file, save_file

    weights = load_file(root / "llama" / "model.safetensors")
    fused = {}
    for key, value in weights.items():
        if ".mlp.gate_proj." in key:
            up = weights[key.replace("gate_proj", "up_proj")]
            fused[key.replace("gate_proj", "gate_up_proj")] = torch.cat([value, up])
        elif ".mlp.up_proj." not in key:
            fused[key] = value
    (root / "llama-fused").mkdir()
    save_file(fused, root / "llama-fused" / "model.safetensors", metadata={"format": "pt"})
    hf_config("llama").save_pretrained(root / "llama-fused")


def pretrained(path, **kwargs):
    """from_pretrained with the attention the tests build with (its default, sdpa, rounds differently)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class Case:
    op: str  # "load", "materialize", "errors", "plain", "edit"
    kind: str = "llama"
    shard: int = -1
    replicate: int = 1
    strategy: str | None = None
    checkpoint: str = ""  # directory under the references root; default: kind
    export: bool = False
    export_dtype: str | None = None
    max_shard_size: str = "5GB"
    dcp: bool = False

    @property
    def label(self) -> str:
        parts = [self.op, self.kind]
        if self.replicate != 1:
            parts.append(f"mesh {self.replicate}x{dist.get_world_size() // self.replicate}")
        if self.checkpoint:
            parts.append(self.checkpoint)
        if self.export:
            parts.append(f"export {self.export_dtype or 'fp32'} max {self.max_shard_size}")
        if self.dcp:
            parts.append("dcp")
        return ", ".join(parts)


_meshes: dict = {}


def _mesh(case: Case):
    key = (case.shard, case.replicate)
    if key not in _meshes:
        _meshes[key] = fk.make_mesh(shard=case.shard, replicate=case.replicate)
    return _meshes[key]


def _sharded_meta(case: Case):
    model = hf_model(case.kind, meta=True)
    fk.shard_model(model, _mesh(case), strategy=case.strategy)
    return model


def _logits(model, x) -> torch.Tensor:
    from torch.distributed.fsdp import FSDPModule

    model.eval()
    with torch.no_grad():
        logits = model(x).logits
    # A forward without backward leaves units that do not reshard after forward gathered.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return logits


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _file_dtypes(directory: Path) -> set[str]:
    from safetensors import safe_open

    found = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            found |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    return found


def _file_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return keys


def run_load(case: Case, refs: Path, out: Path) -> dict:
    rank = dist.get_rank()
    source = refs / (case.checkpoint or case.kind)
    model = _sharded_meta(case)
    result = fk.load_pretrained(model, source)
    fused = case.kind == "llama-fused"
    # The same weights, in the usual layout, in fp32 (the model's dtype; bf16 files are upcast).
    ref = pretrained(refs / "llama" if fused else source, dtype=torch.float32)
    x = tokens()
    logits, ref_logits = _logits(model, x), _logits(ref, x)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    params_equal = all(torch.equal(p.full_tensor(), ref_params[n]) for n, p in model.named_parameters())
    buffers_equal = all(torch.equal(b, dict(ref.named_buffers())[n]) for n, b in model.named_buffers())
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    res = {
        "label": case.label,
        "logits_equal": torch.equal(logits, ref_logits),
        "logits_worst": _worst(logits, ref_logits),
        "params_equal": params_equal,
        "buffers_equal": buffers_equal,
        "bytes_read": result.bytes_read,
        "shard_bytes": shard_bytes,
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
    }
    if case.export:
        dtype = getattr(torch, case.export_dtype) if case.export_dtype else None
        target = out / f"export-{case.label}".replace(" ", "_").replace(",", "")
        fk.export_hf(model, target, dtype=dtype, max_shard_size=case.max_shard_size)
        dist.barrier()
        if rank == 0:
            back = (
                fused_llama_class().from_pretrained(target, attn_implementation="eager")
                if fused
                else pretrained(target)
            )
            compare = ref if dtype is None else pretrained(source, dtype=dtype)
            res["export_logits_equal"] = torch.equal(_logits(back, x), _logits(compare, x))
            res["export_keys_equal"] = _file_keys(target) == _file_keys(source)
            res["export_dtypes"] = sorted(_file_dtypes(target))
            res["export_files"] = sorted(p.name for p in target.iterdir())
    if case.dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        step = out / f"dcp-{case.label}".replace(" ", "_").replace(",", "") / "step_00000001"
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step))
        if rank == 0:
            model.config.save_pretrained(step)
        dist.barrier()
        res["dcp_dir"] = str(step.parent)
    return res


def _stats_problems(model, cpu) -> list[str]:
    """Each parameter looks drawn from the same distribution as in an ordinary CPU construction."""
    problems = []
    reference = dict(cpu.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        full, ref = p.full_tensor().float(), reference[name].float()
        if not torch.isfinite(full).all():
            problems.append(f"{name}: not finite")
            continue
        if ref.std() == 0 or full.numel() < 2:  # constant init (norms, biases): equal exactly
            if not torch.equal(full, ref):
                problems.append(f"{name}: constant init differs")
            continue
        if full.numel() >= 400:  # enough samples for a 25% check on the standard deviation
            ratio = (full.std() / ref.std()).item()
            if (
                not 0.75 < ratio < 1.33
                or abs(full.mean().item()) > 3 * ref.std().item() / math.sqrt(full.numel()) + 1e-3
            ):
                problems.append(f"{name}: std ratio {ratio:.2f}, mean {full.mean().item():.2e}")
        emb = getattr(model.get_input_embeddings(), "padding_idx", None)
        if name.endswith("embed_tokens.weight") and emb is not None and full[emb].abs().max() != 0:
            problems.append(f"{name}: padding row {emb} not zero")
    return problems


def run_materialize(case: Case) -> dict:
    from fsdp2kit.blocks import shared_parameters

    # Ranks start from different random states on purpose: materialize must agree on one, and leave
    # each rank's own stream as it found it (CPU and, where there is one, the GPU's).
    torch.manual_seed(1234 + dist.get_rank())
    model = _sharded_meta(case)
    rng = _rng_states()
    fk.materialize(model)
    rng_kept = all(torch.equal(a, b) for a, b in zip(rng, _rng_states(), strict=True))
    # The same init on an unsharded copy from rank 0's seed, in this process.
    torch.manual_seed(1234)
    single = fk.materialize(hf_model(case.kind, meta=True))
    torch.manual_seed(0)
    cpu = hf_model(case.kind)
    singles = dict(single.named_parameters(remove_duplicate=False))
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), singles[n])]
    cpu_buffers = dict(cpu.named_buffers())
    buffers = {n: torch.equal(b, cpu_buffers[n]) for n, b in model.named_buffers()}
    ties = list(shared_parameters(cpu).values())
    tied_ok = all(len({id(model.get_parameter(n)) for n in names}) == 1 for names in ties)
    return {
        "label": case.label,
        "differ_from_unsharded": differ,
        "buffers": buffers,
        "stats_problems": _stats_problems(model, cpu),
        "ties": ties,
        "tied_ok": tied_ok,
        "finite_logits": bool(torch.isfinite(_logits(model, tokens())).all()),
        "rng_kept": rng_kept,
    }


def _rng_states() -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]


def plain_init(module: torch.nn.Module) -> None:
    """An init_fn for the hand-written TinyGPT, written as for an unsharded model."""
    from models import TinyGPT

    if isinstance(module, TinyGPT):
        torch.nn.init.normal_(module.pos, std=0.02)
    elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, torch.nn.LayerNorm):
        module.reset_parameters()


def run_plain(case: Case, out: Path) -> dict:
    """A hand-written model (no transformers): init_fn on shards, then export and read back."""
    from models import TinyGPT
    from safetensors.torch import load_file

    torch.manual_seed(99 + dist.get_rank())
    with torch.device("meta"):
        model = TinyGPT(tied=True)
    fk.shard_model(model, _mesh(case), strategy=case.strategy)
    fk.materialize(model, init_fn=plain_init)
    torch.manual_seed(99)
    with torch.device("meta"):
        single = TinyGPT(tied=True)
    fk.materialize(single, init_fn=plain_init)
    singles = dict(single.named_parameters())
    target = out / f"plain-{dist.get_world_size()}"
    fk.export_hf(model, target)
    dist.barrier()
    exported = load_file(target / "model.safetensors") if dist.get_rank() == 0 else singles
    return {
        "label": case.label,
        "differ_from_unsharded": [
            n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), singles[n])
        ],
        "tied_ok": model.head.weight is model.tok.weight,
        "export_equal": all(torch.equal(exported[n], singles[n]) for n in singles) and "head.weight" not in exported,
    }


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def run_errors(case: Case, refs: Path) -> dict:
    """Bad inputs: every rank gets the same clear error, and none hangs."""
    out = {"label": case.label}
    out["missing_dir"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "does-not-exist"))
    out["missing_key"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "llama-missing-key"))
    out["extra_key"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "llama-extra-key"))
    out["shape"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "llama-wide"))
    out["wrong_model"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "gpt2"))
    out["empty_dir"] = _error(lambda: fk.load_pretrained(_sharded_meta(case), refs / "empty"))
    for damage in ("truncated", "padded"):  # found from the header, before any rank reads or allocates
        model = _sharded_meta(case)
        out[damage] = _error(lambda model=model, damage=damage: fk.load_pretrained(model, refs / f"llama-{damage}"))
        out[f"{damage}_still_meta"] = all(p.is_meta for p in model.parameters())
    # strict=False: the missing weight keeps its initialisation, the rest is loaded.
    model = _sharded_meta(case)
    result = fk.load_pretrained(model, refs / "llama-missing-key", strict=False)
    out["lenient_missing"] = result.missing_keys
    out["lenient_finite"] = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())
    result = fk.load_pretrained(_sharded_meta(case), refs / "llama-extra-key", strict=False)
    out["lenient_unexpected"] = result.unexpected_keys
    return out


def _train_step(model, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    import torch.nn.functional as F

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = F.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss.item(), {n: p.to_local().clone() for n, p in model.named_parameters()}


def run_edit(case: Case, refs: Path, out: Path) -> dict:
    """The checkpoint file is rewritten in place, then truncated, under a loaded model: the model must not see it."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    source, path = out / "edited", out / "edited" / "model.safetensors"
    if dist.get_rank() == 0:
        shutil.copytree(refs / case.kind, source)
        save_file({k: v * 2 + 1 for k, v in load_file(path).items()}, out / "other.safetensors")
    dist.barrier()
    model = _sharded_meta(case)
    fk.load_pretrained(model, source)
    x = tokens()
    shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
    logits = _logits(model, x)
    inode = path.stat().st_ino

    def unchanged() -> bool:
        same = all(torch.equal(p.to_local(), shards[n]) for n, p in model.named_parameters())
        return same and torch.equal(_logits(model, x), logits)

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copyfile(out / "other.safetensors", path)  # what `cp new.safetensors model.safetensors` does
    dist.barrier()
    res = {"label": case.label, "same_inode": path.stat().st_ino == inode, "after_overwrite": unchanged()}
    dist.barrier()
    if dist.get_rank() == 0:
        os.truncate(path, 64)
    dist.barrier()
    res["after_truncate"] = unchanged()
    batch = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss, trained = _train_step(model, batch)
    reference = _sharded_meta(case)  # the same step from the untouched checkpoint
    fk.load_pretrained(reference, refs / case.kind)
    ref_loss, ref_trained = _train_step(reference, batch)
    res["step_equal"] = loss == ref_loss and all(torch.equal(trained[n], ref_trained[n]) for n in trained)
    return res


def run_cases(cases: list[Case], refs: str, out: str) -> list[dict]:
    refs_path, out_path = Path(refs), Path(out)
    results = []
    for case in cases:
        start = time.perf_counter()
        if case.op == "load":
            results.append(run_load(case, refs_path, out_path))
        elif case.op == "materialize":
            results.append(run_materialize(case))
        elif case.op == "plain":
            results.append(run_plain(case, out_path))
        elif case.op == "errors":
            results.append(run_errors(case, refs_path))
        elif case.op == "edit":
            results.append(run_edit(case, refs_path, out_path))
        else:
            raise ValueError(case.op)
        results[-1]["seconds"] = time.perf_counter() - start
    return results
