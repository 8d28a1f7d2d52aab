"""LoRA and QLoRA under shard_model against single-process PEFT, run inside `run_world` ranks.

The reference is the same PEFT model, unsharded, trained in one process on the concatenation of
every rank's batch (as in parity.py). Exports are read back with peft and transformers in the
same process and compared by logits.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from comm_check import counted_calls, predicted_calls
from models import lm_loss, tiny_llama

import fsdp2kit as fk
from fsdp2kit._internal.dtensor import gather_full
from fsdp2kit.weights.hf_layout import clean_fqn

VOCAB, SEQ, BATCH = 96, 12, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    kind: str  # "lora" | "frozen" | "mixed" | "qlora" | "export[-qlora]" | "load" | "ckpt" | "offline[-qlora]"
    # | "replicated" (replicate_adapters=True, 4 micro-batches under fk.accumulate(accumulation))
    wrappers: bool = False  # full activation checkpointing before sharding, prefetch 1/1 after
    shard: int = -1
    replicate: int = 1
    mixed_precision: str | None = None
    base_dtype: str = "float32"
    steps: int = 3
    accumulation: str = "regather"
    tmp: str = ""

    @property
    def label(self) -> str:
        parts = [self.kind, f"mesh {self.replicate}x{dist.get_world_size() // self.replicate}"]
        if self.mixed_precision:
            parts.append(self.mixed_precision)
        if self.base_dtype != "float32":
            parts.append(f"base {self.base_dtype}")
        if self.wrappers:
            parts.append("AC full + prefetch")
        return ", ".join(parts)


_meshes: dict[tuple[int, int], object] = {}


def _mesh(case: Case):
    key = (case.shard, case.replicate)
    if key not in _meshes:
        _meshes[key] = fk.make_mesh(shard=case.shard, replicate=case.replicate)
    return _meshes[key]


def lora_config(init_lora_weights=False):
    from peft import LoraConfig

    # init_lora_weights=False: B is random too, so both factors get gradients from step one.
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=init_lora_weights)


def peft_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **model_kw):
    from peft import get_peft_model

    base = tiny_llama(**model_kw).to(dtype)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, lora_config())


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, eps=1e-5)


def shard(case: Case, model, **kw):
    """shard_model, with the speed and memory wrappers around it when the case asks for them."""
    if case.wrappers:
        fk.apply_activation_checkpointing(model, "full")
    plan = fk.shard_model(model, _mesh(case), **kw)
    if case.wrappers:
        fk.set_prefetch(model, forward=1, backward=1)
    return plan


def train_both(case: Case, model, ref, steps: int, counted: list | None = None):
    """Three AdamW steps on the sharded model and on the reference; returns both loss lists. With a
    ``counted`` list, the first step's collectives are appended to it (comm_check.counted_calls)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses = [], []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen)
        counting = fk.count_collectives(_mesh(case)) if counted is not None and step == 0 else contextlib.nullcontext()
        with counting as counts:
            loss = lm_loss(model, tokens[rank * BATCH : (rank + 1) * BATCH])
            loss.backward()
        if counts is not None:
            counted.extend(counted_calls(counts))
        ref_loss = lm_loss(ref, tokens)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        ref_losses.append(ref_loss.item())
    return losses, ref_losses


def _dequant(t: torch.Tensor) -> torch.Tensor:
    return t.get_original_weight() if type(t).__name__ == "NF4Tensor" else t


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local()
    if type(local).__name__ != "NF4Tensor":
        return local.numel() * local.element_size()
    return sum(getattr(local, a).numel() * getattr(local, a).element_size() for a in local.__tensor_flatten__()[0])


def _compare(model, ref, before: dict[str, torch.Tensor]) -> dict:
    """Worst relative error on trainable parameters; frozen ones must equal their start bit for bit."""
    ref_params = dict(ref.named_parameters())
    worst, worst_name, changed, dtypes = 0.0, "", [], {}
    for wrapped, p in model.named_parameters():
        name = clean_fqn(wrapped)  # activation checkpointing inserts a wrapper segment
        full = _dequant(gather_full(p).detach())
        if p.requires_grad:
            r = ref_params[name].detach()
            rel = ((full - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
            if rel > worst:
                worst, worst_name = rel, name
            dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + 1
        elif not torch.equal(full, before[name]):
            changed.append(name)
    return {"worst_rel": worst, "worst_param": worst_name, "frozen_changed": changed, "trainable_dtypes": dtypes}


def run_lora(case: Case) -> dict:
    dtype = getattr(torch, case.base_dtype)
    torch.manual_seed(0)
    ref = peft_llama(dtype=dtype)
    if case.kind == "frozen":  # no PEFT: a plain model frozen by hand, norms left trainable in fp32
        torch.manual_seed(0)
        ref = tiny_llama().to(dtype)
        for name, p in ref.named_parameters():
            p.requires_grad_("norm" in name)
            if p.requires_grad:
                p.data = p.data.float()
    if case.kind == "mixed":  # trainable dtypes mixed in one block: fp64 adapters, fp32 norms
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.data = p.data.double()
            elif "norm" in name:
                p.requires_grad_(True)
    model = copy.deepcopy(ref)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    predicted = _predicted(case, model)
    plan = shard(case, model, mixed_precision=case.mixed_precision)
    grad_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    counted: list = []
    losses, ref_losses = train_both(case, model, ref, case.steps, counted)
    out = _compare(model, ref, before)
    out.update(
        label=case.label,
        losses=losses,
        ref_losses=ref_losses,
        plan_grad_bytes=plan.grad_bytes_per_rank,
        grad_bytes=grad_bytes,
        n_units=len(plan.units),
        counted=counted,
        predicted=predicted,
    )
    return out


def _predicted(case: Case, model) -> list[tuple]:
    """fsdp2kit.planner.comm's calls for one step of the unsharded (peft) model, as the case shards it."""
    mesh = _mesh(case)
    plan = fk.plan_comm(
        model,
        shard=mesh.shape[-1],
        replicate=mesh.shape[0] if mesh.ndim == 2 else 1,
        mixed_precision=case.mixed_precision,
    )
    return predicted_calls(plan)


def qlora_llama(seed: int = 0, quantize: bool = True, dtype=torch.float32):
    from peft import get_peft_model

    base = qlora_base(seed, quantize, dtype)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, lora_config())


def qlora_base(seed: int = 0, quantize: bool = True, dtype=torch.float32):
    """A Llama with NF4-friendly sizes (hidden 64: every block weight is whole 256-element groups
    per rank up to 4 ranks with block_size 32 x scaler_block_size 8), wide init so the loss
    actually depends on the weights (a 0.02-std tiny model predicts near-uniform logits)."""
    torch.manual_seed(seed)
    base = tiny_llama(hidden=64, intermediate=128).to(dtype)
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    if quantize:
        fk.quantize_nf4(base, block_size=32, scaler_block_size=8)
    return base


def run_qlora(case: Case) -> dict:
    # Built twice from the same seed: torchao's NF4Tensor.clone (so deepcopy) re-quantizes with
    # its default group sizes, which changes the values.
    ref, model = qlora_llama(), qlora_llama()
    lora, lora_model = qlora_llama(quantize=False), qlora_llama(quantize=False)
    before = {n: _dequant(p.detach()) for n, p in model.named_parameters() if not p.requires_grad}
    # The quantization error of the base itself, ||W - dequant(nf4(W))|| / ||W||, worst weight.
    plain = dict(lora.named_parameters())
    quant_err = max(((w - plain[n].detach()).norm() / plain[n].detach().norm()).item() for n, w in before.items())
    n_nf4 = sum(type(p).__name__ == "NF4Tensor" for p in model.parameters())
    predicted = _predicted(case, model)
    plan = shard(case, model, mixed_precision=case.mixed_precision)
    local_bytes = sum(_local_bytes(p) for p in model.parameters())
    fk.shard_model(lora_model, _mesh(case), mixed_precision=case.mixed_precision)
    counted: list = []
    losses, ref_losses = train_both(case, model, ref, case.steps, counted)
    lora_losses, _ = train_both(case, lora_model, lora, case.steps)
    out = _compare(model, ref, before)
    out.update(
        label=case.label,
        losses=losses,
        ref_losses=ref_losses,
        lora_losses=lora_losses,
        quant_err=quant_err,
        n_nf4=n_nf4,
        plan_bytes=plan.param_bytes_per_rank,
        local_bytes=local_bytes,
        counted=counted,
        predicted=predicted,
    )
    return out


ACCUM = 4


def run_replicated(case: Case) -> dict:
    """replicate_adapters=True: 4 micro-batches a step against one process on the concatenated batch, the
    first step's collectives counted; then a checkpoint reloaded into sharded adapters, and the exports."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = peft_llama()
    model, sharded = copy.deepcopy(ref), copy.deepcopy(ref)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    mesh = _mesh(case)
    plan = fk.plan_comm(
        model,
        shard=mesh.shape[-1],
        replicate=mesh.shape[0] if mesh.ndim == 2 else 1,
        micro_batches=ACCUM,
        accumulation=case.accumulation,
        replicate_adapters=True,
    )
    if rank == 1:  # built differently on another rank: shard_model starts every rank from rank 0's adapters
        with torch.no_grad():
            next(p for p in model.parameters() if p.requires_grad).add_(1.0)
    shard(case, model, replicate_adapters=True)
    whole = all(not isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses, counted = [], [], []
    for step in range(case.steps):
        counting = fk.count_collectives(mesh) if step == 0 else contextlib.nullcontext()
        total, ref_total = torch.zeros(()), 0.0
        with counting as counts:
            for micro in range(ACCUM):
                tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen)
                with fk.accumulate(model, case.accumulation, micro, ACCUM):
                    loss = lm_loss(model, tokens[rank * BATCH : (rank + 1) * BATCH]) / ACCUM
                    loss.backward()
                total += loss.detach()
                ref_loss = lm_loss(ref, tokens) / ACCUM
                ref_loss.backward()
                ref_total += ref_loss.item()
        if counts is not None:
            counted = counted_calls(counts)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        ref_losses.append(ref_total)
    out = _compare(model, ref, before)
    out.update(label=case.label, losses=losses, ref_losses=ref_losses, whole=whole)
    out.update(counted=counted, predicted=predicted_calls(plan))
    # A checkpoint of replicated adapters reloads into adapters sharded as usual (and back), and exports
    # the same PEFT adapter files as a sharded run holding the same values.
    root = Path(case.tmp) / f"replicated-w{world}"
    fk.Checkpointer(root / "ckpt").save(case.steps, model, optimizer=opt)
    fk.shard_model(sharded, mesh)
    sharded_opt = _optimizer(sharded)
    out["step"] = fk.Checkpointer(root / "ckpt").load(sharded, optimizer=sharded_opt)
    out["reload_diff"] = max(
        (gather_full(a).detach() - gather_full(b).detach()).abs().max().item()
        for (_, a), (_, b) in zip(model.named_parameters(), sharded.named_parameters())
    )
    # Built on the meta device, shard_model broadcasts nothing: materialize must draw the same adapters everywhere
    with torch.device("meta"):
        meta = peft_llama()
    shard(case, meta, replicate_adapters=True)
    fk.materialize(meta)
    mine = torch.cat([p.detach().reshape(-1) for p in meta.parameters() if p.requires_grad])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out["meta_adapters_equal"] = all(torch.equal(every[0], t) for t in every) and bool(mine.abs().sum() > 0)
    fk.export_hf(model, root / "replicated")
    fk.export_hf(sharded, root / "sharded")
    if rank == 0:  # and read back by one process (world 1): the offline export of the checkpoint
        torch.manual_seed(0)
        tiny_llama().save_pretrained(root / "base")
        fk.dcp_to_hf(root / "ckpt", root / "offline", base=root / "base")
        a, b, c = _files(root / "replicated"), _files(root / "sharded"), _files(root / "offline")
        out["export_keys"] = len(a) if a.keys() == b.keys() == c.keys() else -1
        out["export_unequal"] = sorted(
            k for k in a.keys() & b.keys() & c.keys() if not (torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]))
        )
    return out


def run_cases(cases: list[Case]) -> list[dict]:
    runs = {"qlora": run_qlora, "export": run_export, "export-qlora": run_export, "load": run_load, "ckpt": run_ckpt}
    runs["replicated"] = run_replicated
    runs.update({"offline": run_offline, "offline-qlora": run_offline})
    return [runs.get(c.kind, run_lora)(c) for c in cases]


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits.float()


def _dequantized(model):
    """The same model with every NF4 weight replaced by its dequantized plain tensor."""
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and type(w).__name__ == "NF4Tensor":
            module.weight = torch.nn.Parameter(w.get_original_weight(), requires_grad=False)
    return model


def _trained_two_steps(case: Case, qlora: bool, seed: int):
    """The LoRA (or QLoRA) test model, sharded as the case says and trained two AdamW steps."""
    if qlora:
        model = qlora_llama()
    else:
        torch.manual_seed(0)
        model = peft_llama()
    shard(case, model)
    opt = _optimizer(model)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        lm_loss(model, torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def run_export(case: Case) -> dict:
    """Train a little, export adapters and a merged model, and read both back with peft / transformers."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    qlora = case.kind == "export-qlora"

    def base():
        if qlora:
            return qlora_base()
        torch.manual_seed(0)
        return tiny_llama()

    model, _ = _trained_two_steps(case, qlora, seed=7)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    sharded = _logits(model, x)
    root = Path(case.tmp) / f"{case.kind}-w{dist.get_world_size()}-{case.replicate}"
    adapter_dir, merged_dir = root / "adapter", root / "merged"
    fk.export_hf(model, adapter_dir)
    fk.export_hf(model, merged_dir, merge=True)
    out = {"label": case.label}
    if dist.get_rank() == 0:
        with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
            out["adapter_keys"] = sorted(f.keys())
        peft_ref = PeftModel.from_pretrained(_dequantized(base()) if qlora else base(), adapter_dir)
        out["adapter_diff"] = (_logits(peft_ref, x) - sharded).abs().max().item()
        merged_ref = PeftModel.from_pretrained(_dequantized(base()), adapter_dir).merge_and_unload()
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager")
        out["merged_equal"] = torch.equal(_logits(merged, x), _logits(merged_ref, x))
        out["merged_diff"] = (_logits(merged, x) - _logits(merged_ref, x)).abs().max().item()
        out["merged_vs_sharded"] = (_logits(merged, x) - sharded).abs().max().item()
    return out


def run_load(case: Case) -> dict:
    """load_pretrained of a plain base checkpoint into a sharded PEFT model, real and meta."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf_dir = Path(case.tmp) / f"base-w{dist.get_world_size()}"
    if dist.get_rank() == 0:
        torch.manual_seed(5)
        tiny_llama().save_pretrained(hf_dir)
    dist.barrier()
    file_model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    want = dict(file_model.named_parameters())
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out = {"label": case.label}
    for meta in (False, True):
        if meta:
            with torch.device("meta"):
                model = get_peft_model(tiny_llama(), lora_config(init_lora_weights=True))
        else:
            torch.manual_seed(0)
            model = peft_llama()
        start = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        fk.shard_model(model, _mesh(case))
        fk.load_pretrained(model, hf_dir)
        base_bad, adapter_bad, b_zero = [], [], True
        for name, p in model.named_parameters():
            full = gather_full(p).detach()
            if "lora_" in name:
                if meta:
                    b_zero &= bool((full == 0).all()) if "lora_B" in name else bool(full.abs().sum() > 0)
                elif not torch.equal(full, start[name]):
                    adapter_bad.append(name)
            else:
                key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
                if not torch.equal(full, want[key].detach()):
                    base_bad.append(name)
        tag = "meta" if meta else "real"
        out[f"{tag}_base_bad"], out[f"{tag}_adapter_bad"] = base_bad, adapter_bad
        if meta:
            out["meta_init_ok"] = b_zero  # B zero (the adapted model starts as the base), A drawn
            out["meta_logits_diff"] = (_logits(model, x) - _logits(file_model, x)).abs().max().item()
    return out


def run_ckpt(case: Case) -> dict:
    """A LoRA run saved by the Checkpointer (trainable only, by default) and resumed into a model
    sharded another way (NO_SHARD): adapters, optimizer state and the next step all match."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(case.tmp) / f"ckpt-w{dist.get_world_size()}"
    torch.manual_seed(0)
    model = peft_llama()
    fk.shard_model(model, _mesh(case))
    opt = _optimizer(model)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(3)]
    for tokens in batches[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    ck = fk.Checkpointer(root)
    ck.save(2, model, optimizer=opt, extra={"note": "lora"})
    saved = [k for k in FileSystemReader(str(root / "step_00000002")).read_metadata().state_dict_metadata]
    frozen = sum(not p.requires_grad for p in model.parameters())

    torch.manual_seed(0)
    other = peft_llama(seed=41)  # the same base, other adapter values: the load must replace them
    fk.shard_model(other, _mesh(case), strategy="NO_SHARD")
    other_opt = _optimizer(other)
    step = fk.Checkpointer(root).load(other, optimizer=other_opt)
    same_adapters = all(
        torch.equal(gather_full(a).detach(), gather_full(b).detach())
        for (_, a), (_, b) in zip(model.named_parameters(), other.named_parameters())
        if a.requires_grad
    )
    losses = []
    for m, o in ((model, opt), (other, other_opt)):
        loss = lm_loss(m, batches[2])
        loss.backward()
        o.step()
        losses.append(loss.item())
    after = max(
        (gather_full(a).detach() - gather_full(b).detach()).abs().max().item()
        for (_, a), (_, b) in zip(model.named_parameters(), other.named_parameters())
        if a.requires_grad
    )
    return {
        "label": case.label,
        "step": step,
        "model_keys": sorted(k for k in saved if k.startswith("model.")),
        "frozen": frozen,
        "trainable": sum(p.requires_grad for p in model.parameters()),
        "same_adapters": same_adapters,
        "losses": losses,
        "after_step_diff": after,
    }


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def run_offline(case: Case) -> dict:
    """A LoRA / QLoRA run's checkpoint (adapters only) exported offline, in one process, from the
    step and the base model directory (`fsdp2kit export-hf --base`), against `export_hf` of the
    sharded model itself: the same files, tensor for tensor."""
    from fsdp2kit.cli import main

    qlora = case.kind == "offline-qlora"
    root = Path(case.tmp) / f"{case.kind}-w{dist.get_world_size()}"
    base_dir = root / "base"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        (qlora_base(quantize=False) if qlora else tiny_llama()).save_pretrained(base_dir)
    model, opt = _trained_two_steps(case, qlora, seed=13)
    fk.Checkpointer(root / "ckpt").save(2, model, optimizer=opt)
    fk.export_hf(model, root / "online-adapter")
    fk.export_hf(model, root / "online-merged", merge=True)
    out: dict = {"label": case.label}
    if dist.get_rank() == 0:
        ckpt = str(root / "ckpt")
        out["no_base_status"] = main(["export-hf", ckpt, str(root / "nobase")])
        out["adapter_status"] = main(["export-hf", ckpt, str(root / "offline-adapter"), "--base", str(base_dir)])
        fk.dcp_to_hf(ckpt, root / "offline-merged", base=base_dir, merge=True)
        for kind in ("adapter", "merged"):
            online, offline = _files(root / f"online-{kind}"), _files(root / f"offline-{kind}")
            out[f"{kind}_keys"] = (len(online), sorted(set(online) ^ set(offline)))
            out[f"{kind}_unequal"] = sorted(
                k for k in online.keys() & offline.keys() if not torch.equal(online[k], offline[k])
            )
    return out
