"""Tensor parallelism (alone, and under FSDP / HSDP) inside `run_world` ranks: parity and composition.

Parity: the reference is the unsharded model trained in one process on the concatenation of
every data-parallel group's batch; the ranks of one TP group share their group's batch.
Composition: materialize, load_pretrained, Checkpointer, export_hf, clip_grad_norm_, no_sync and
activation checkpointing, each on a TP x FSDP model, compared with the unsharded equivalent.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from comm_check import counted_calls, predicted_calls
from models import lm_loss, tiny_llama, worst_relative
from torch.distributed.tensor.parallel import loss_parallel

import fsdp2kit as fk

VOCAB, SEQ, BATCH = 96, 12, 2


def tiny_qwen3(layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=56,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=10,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(cfg)


def build(kind: str, seed: int = 0, meta: bool = False):
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if kind == "llama":
            return tiny_llama()
        if kind == "llama-tied":
            return tiny_llama(tied=True)
        if kind == "qwen3":
            return tiny_qwen3()
    raise ValueError(kind)


@dataclass(frozen=True)
class TPCase:
    model: str = "llama"
    optim: str = "adamw"
    shard: int = 1
    replicate: int = 1
    tp: int = 2
    accum: int = 1
    clip: float | None = None
    ac: str | None = None
    loss_parallel: bool = False
    compile: str | None = None  # compile_blocks with this torch.compile backend ("aot_eager", "inductor")
    steps: int = 3

    @property
    def label(self) -> str:
        dp = f"replicate {self.replicate} x shard {self.shard}" if self.replicate > 1 else f"shard {self.shard}"
        parts = [self.model, self.optim, f"{dp} x tp {self.tp}"]
        if self.accum > 1:
            parts.append(f"no_sync x{self.accum}")
        if self.clip:
            parts.append(f"clip {self.clip}")
        if self.ac:
            parts.append(f"AC {self.ac}")
        if self.loss_parallel:
            parts.append("loss parallel")
        if self.compile:
            parts.append(f"compiled ({self.compile})")
        return ", ".join(parts)


_meshes: dict[tuple[int, int, int], object] = {}


def mesh_for(shard: int, replicate: int = 1, tp: int = 1):
    if (shard, replicate, tp) not in _meshes:
        _meshes[(shard, replicate, tp)] = fk.make_mesh(shard=shard, replicate=replicate, tp=tp)
    return _meshes[(shard, replicate, tp)]


def dp_rank(mesh) -> tuple[int, int]:
    """(this rank's data-parallel group index, how many groups): the TP ranks of a group share it."""
    names = mesh.mesh_dim_names
    coord = dict(zip(names, mesh.get_coordinate()))
    sizes = dict(zip(names, mesh.shape))
    return coord.get("replicate", 0) * sizes["shard"] + coord["shard"], sizes.get("replicate", 1) * sizes["shard"]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-5)


def run_parity(case: TPCase) -> dict:
    mesh = mesh_for(case.shard, case.replicate, case.tp)
    ref = build(case.model)
    model = copy.deepcopy(ref)
    predicted = None
    if not case.compile:  # the FSDP collectives over the data-parallel groups, from the unsharded model
        accumulation = "no_sync" if case.accum > 1 else "regather"
        plan_kw = dict(shard=case.shard, replicate=case.replicate, tp=case.tp, micro_batches=case.accum)
        predicted = predicted_calls(fk.plan_comm(ref, **plan_kw, accumulation=accumulation))
    fk.apply_tensor_parallel(model, mesh, loss_parallel=case.loss_parallel)
    if case.ac:
        fk.apply_activation_checkpointing(model, case.ac)
    if case.compile:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # graphs counted per case
        counters.clear()
        model.config.use_cache = False  # no KV cache in training: see compile_blocks
        fk.compile_blocks(model, backend=case.compile)
    plan = fk.shard_model(model, mesh)
    opt, ref_opt = _optimizer(case.optim, model.parameters()), _optimizer(case.optim, ref.parameters())
    group, groups = dp_rank(mesh)
    gen = torch.Generator().manual_seed(1234)
    norms, ref_norms, losses = [], [], []
    counted = None
    for step in range(case.steps):
        counting = fk.count_collectives(mesh) if predicted is not None and step == 0 else contextlib.nullcontext()
        with counting as counts:
            for micro in range(case.accum):
                tokens = torch.randint(0, VOCAB, (groups * BATCH, SEQ + 1), generator=gen)
                local = tokens[group * BATCH : (group + 1) * BATCH]
                sync = micro == case.accum - 1
                # loss parallel: the logits stay split over the vocabulary, the loss is computed on the split
                split_loss = loss_parallel() if case.loss_parallel else contextlib.nullcontext()
                with contextlib.nullcontext() if sync else fk.no_sync(model), split_loss:
                    loss = lm_loss(model, local) / case.accum
                    loss.backward()
                (lm_loss(ref, tokens) / case.accum).backward()
                losses.append(loss.item())
        if counts is not None:
            counted = counted_calls(counts)
            tp_calls = sum(1 for e in counts.events if e.group == "tp")
        if case.clip:
            norms.append(fk.clip_grad_norm_(model.parameters(), case.clip).item())
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip).item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    worst, worst_name = worst_relative(model, ref)
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    graphs = None
    if case.compile:
        from torch._dynamo.utils import counters

        graphs = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    return {
        "label": case.label,
        "worst_rel": worst,
        "worst_param": worst_name,
        "norms": norms,
        "ref_norms": ref_norms,
        "plan_bytes": plan.param_bytes_per_rank,
        "local_bytes": local_bytes,
        "plan_text": str(plan),
        "tied": tied,
        "dtensor_meshes": sorted({p.device_mesh.mesh_dim_names for p in model.parameters()}),
        "graphs": graphs,  # compiled cases: (graphs dynamo compiled, graph breaks)
        "counted": counted,  # the first step's FSDP collectives (data-parallel groups), and predicted
        "predicted": predicted,
        "tp_calls": tp_calls if counted is not None else None,  # TP's own: counted, not predicted
    }


def run_parity_cases(cases: list[TPCase]) -> list[dict]:
    return [run_parity(c) for c in cases]


# ----------------------------------------------------------------------------------------------
# Composition


def _tp_fsdp(kind: str, mesh, *, meta: bool, seed: int = 0):
    model = build(kind, seed=seed, meta=meta)
    if "tp" in (mesh.mesh_dim_names or ()):
        fk.apply_tensor_parallel(model, mesh)
    fk.shard_model(model, mesh)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _optim_full(opt) -> dict[str, torch.Tensor]:
    out = {}
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            for k, v in opt.state[p].items():
                t = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"{i}.{j}.{k}"] = t.detach().clone()
    return out


def _train(model, mesh, steps: int = 2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group, groups = dp_rank(mesh) if "shard" in (mesh.mesh_dim_names or ()) else (0, 1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (groups * BATCH, SEQ + 1), generator=gen)
        lm_loss(model, tokens[group * BATCH : (group + 1) * BATCH]).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]


def run_composition(work: str) -> dict:
    """At 4 ranks (FSDP 2 x TP 2) unless said otherwise; returns booleans and lists of differing names."""
    work = Path(work)
    rank = dist.get_rank()
    mesh = mesh_for(2, 1, 2)
    out: dict = {}

    # materialize: a meta model, TP, FSDP, then materialize equals one process's materialize of the same seed.
    for kind in ("llama-tied", "qwen3"):
        model = _tp_fsdp(kind, mesh, meta=True)
        torch.manual_seed(1234 + rank)  # ranks start apart on purpose: materialize must agree on one state
        fk.materialize(model)
        single = build(kind, meta=True)
        torch.manual_seed(1234)
        fk.materialize(single)
        out[f"materialize_{kind}"] = _equal(_full(model), {n: p.detach() for n, p in single.named_parameters()})

    # load_pretrained: each rank reads only its TP x FSDP slice.
    model = _tp_fsdp("llama", mesh, meta=True)
    result = fk.load_pretrained(model, work / "hf-llama")
    ref = build("llama")
    out["load_differs"] = _equal(_full(model), {n: p.detach() for n, p in ref.named_parameters()})
    out["load_bytes_read"] = result.bytes_read
    out["load_local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    out["load_total_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())

    # Checkpointer: save at TP 2 x FSDP 2 (the loads at other shapes run in other worlds).
    model = _tp_fsdp("llama-tied", mesh, meta=False)
    opt = _train(model, mesh)
    fk.Checkpointer(work / "ckpt").save(2, model, optimizer=opt)
    saved, saved_opt = _full(model), _optim_full(opt)
    if rank == 0:
        torch.save({"params": saved, "optim": saved_opt}, work / "saved.pt")
    # ... and load at FSDP 4 in this world.
    fsdp4 = _tp_fsdp("llama-tied", mesh_for(4), meta=False, seed=5)
    opt4 = torch.optim.AdamW(fsdp4.parameters(), lr=1e-2)
    step = fk.Checkpointer(work / "ckpt").load(fsdp4, optimizer=opt4)
    out["ckpt_fsdp4"] = (step, _equal(_full(fsdp4), saved), _equal(_optim_full(opt4), saved_opt))

    # export_hf from the live TP x FSDP model (the test loads it back in transformers).
    fk.export_hf(model, work / "export-live")
    dist.barrier()
    return out


def run_ckpt_load(work: str, shard: int, tp: int) -> tuple:
    """Load the TP 2 x FSDP 2 checkpoint at another shape; compare with what was saved, bit for bit."""
    work = Path(work)
    mesh = mesh_for(shard, 1, tp)
    model = _tp_fsdp("llama-tied", mesh, meta=False, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = fk.Checkpointer(work / "ckpt").load(model, optimizer=opt)
    saved = torch.load(work / "saved.pt")
    return step, _equal(_full(model), saved["params"]), _equal(_optim_full(opt), saved["optim"])


def run_world2(cases: list[TPCase], work: str) -> dict:
    """World 2: TP 2 parity cases, then the checkpoint loaded at TP 2 x FSDP 1."""
    return {
        "parity": run_parity_cases(cases),
        "ckpt_tp2": run_ckpt_load(work, 1, 2),
        "errors": run_errors(),
        "float8": run_float8_tp(),
    }


def run_world4(cases: list[TPCase], work: str) -> dict:
    return {"parity": run_parity_cases(cases), "composition": run_composition(work)}


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_errors() -> dict:
    """Bad inputs at TP 2 fail on every rank with a sentence, before any collective."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = mesh_for(1, 1, 2)
    out = {}
    odd = LlamaConfig(
        vocab_size=VOCAB, hidden_size=30, intermediate_size=56, num_hidden_layers=1, num_attention_heads=3
    )
    out["heads"] = _error(lambda: fk.apply_tensor_parallel(LlamaForCausalLM(odd), mesh))
    out["pattern"] = _error(lambda: fk.apply_tensor_parallel(build("llama"), mesh, {"model.layers.*.nope": "colwise"}))
    out["style"] = _error(
        lambda: fk.apply_tensor_parallel(build("llama"), mesh, {"model.layers.*.mlp.up_proj": "packed_colwise"})
    )
    out["tied"] = _error(lambda: fk.apply_tensor_parallel(build("llama-tied"), mesh, {"lm_head": "colwise"}))
    out["not_linear"] = _error(lambda: fk.apply_tensor_parallel(build("llama"), mesh, {"model.norm": "colwise"}))

    after_ac = build("llama")
    fk.apply_activation_checkpointing(after_ac, "full")
    out["after_ac"] = _error(lambda: fk.apply_tensor_parallel(after_ac, mesh))
    twice = fk.apply_tensor_parallel(build("llama"), mesh)
    out["twice"] = _error(lambda: fk.apply_tensor_parallel(twice, mesh))
    out["float8_after"] = _error(lambda: fk.enable_float8(twice))
    out["no_tp_model"] = _error(lambda: fk.shard_model(build("llama"), mesh))
    out["no_tp_mesh"] = _error(lambda: fk.apply_tensor_parallel(build("llama"), mesh_for(2)))
    out["no_shard_strategy"] = _error(lambda: fk.shard_model(twice, mesh, strategy="NO_SHARD"))
    out["tp3"] = _error(lambda: fk.make_mesh(shard=1, tp=3))
    sharded = _tp_fsdp("llama", mesh, meta=True)
    out["after_shard"] = _error(lambda: fk.apply_tensor_parallel(sharded, mesh))
    ac_ok = fk.apply_tensor_parallel(build("llama"), mesh)
    out["ac_after_tp"] = _error(lambda: fk.apply_activation_checkpointing(ac_ok, "full"))
    out["compile_after_tp"] = _error(lambda: fk.compile_blocks(ac_ok))
    out["mesh_names"] = [tuple(fk.make_mesh(**kw).mesh_dim_names) for kw in ({"tp": 2}, {"shard": 2})]
    return out


def run_float8_tp() -> dict:
    """enable_float8 -> apply_tensor_parallel -> shard_model at TP 2 against the same float8 model in one process."""
    mesh = mesh_for(1, 1, 2)
    torch.manual_seed(0)
    ref = tiny_llama(hidden=32, intermediate=64)  # float8 matmuls need multiples of 16
    model = copy.deepcopy(ref)
    fk.enable_float8(ref)
    fk.enable_float8(model)
    fk.apply_tensor_parallel(model, mesh)
    fk.shard_model(model, mesh)
    opt, ref_opt = _optimizer("sgd", model.parameters()), _optimizer("sgd", ref.parameters())
    gen = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        loss, ref_loss = lm_loss(model, tokens), lm_loss(ref, tokens)
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    kinds = {type(m).__name__ for m in model.modules()}
    return {"losses": losses, "ref_losses": ref_losses, "float8_layers": "Float8Linear" in kinds}
