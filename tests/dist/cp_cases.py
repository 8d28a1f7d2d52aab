"""Context parallelism (under FSDP / HSDP) inside `run_world` ranks: parity with one process on the whole sequence.

The reference is the unsharded model trained in one process on every data-parallel group's
whole sequences, with the token-mean loss over the global batch; the ranks of one cp group read
their group's sequences and each keeps its head and tail chunks (`split_for_context_parallel`).
Rows are packed: several documents each, positions restarting at 0, the target after a
document's last token ignored, so any attention across documents (on any rank) shows.
"""

from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import tiny_llama, worst_relative
from tp_cases import tiny_qwen3

import fsdp2kit as fk
from fsdp2kit.dist import mesh_device
from fsdp2kit.parallel.cp_inputs import chunk_order, sub_mesh

VOCAB, SEQ, BATCH, IGNORE = 96, 16, 2, -100


@dataclass(frozen=True)
class CPCase:
    model: str = "llama"
    kernel: str = "sdpa"
    shard: int = 1
    replicate: int = 1
    cp: int = 2
    packed: bool = True
    ac: str | None = None
    compile: str | None = None  # a torch.compile backend for compile_blocks
    tp: int = 1
    mixed_precision: str | None = None
    lora: bool = False  # peft adapters on the model (and the reference)
    style: str = "all_to_all"
    steps: int = 3
    seq: int = SEQ  # ring's CUDA kernels need seq % (64 x cp) == 0

    @property
    def label(self) -> str:
        mesh = (f"replicate {self.replicate} x " if self.replicate > 1 else "") + f"shard {self.shard} x cp {self.cp}"
        mesh += f" x tp {self.tp}" if self.tp > 1 else ""
        parts = [self.model, self.kernel, mesh, "packed" if self.packed else "one doc per row"]
        for name in ("ac", "compile", "mixed_precision"):
            if getattr(self, name):
                parts.append(f"{name} {getattr(self, name)}")
        if self.lora:
            parts.append("lora")
        if self.style != "all_to_all":
            parts.append(self.style)
        return ", ".join(parts)


def _qwen3_mha():
    """Qwen3 with 4 KV heads: cp 4 splits its KV heads too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sizes = {"hidden_size": 40, "intermediate_size": 56, "num_hidden_layers": 2, "head_dim": 10}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4}
    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=64, **heads, **sizes)
    return Qwen3ForCausalLM(cfg)


def build(kind: str, kernel: str, seed: int = 0):
    torch.manual_seed(seed)
    makers = {"llama": tiny_llama, "qwen3": lambda: tiny_qwen3(layers=2), "qwen3-mha": _qwen3_mha}
    if kind not in makers:
        raise ValueError(kind)
    model = makers[kind]()
    model.config._attn_implementation = kernel
    return model


def packed_rows(rows: int, gen: torch.Generator, packed: bool, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Rows of ``seq`` tokens; labels already shifted (label i is the target of token i), as the recipe's rows."""
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    positions = torch.empty(rows, seq, dtype=torch.long)
    for r in range(rows):
        cuts = sorted(torch.randperm(seq - 2, generator=gen)[:2].add(1).tolist()) if packed else []
        start = 0
        for end in [*cuts, seq]:
            positions[r, start:end] = torch.arange(end - start)
            labels[r, end - 1] = IGNORE if end < seq else labels[r, end - 1]  # no target across documents
            start = end
    labels[torch.rand(labels.shape, generator=gen) < 0.2] = IGNORE  # prompt-like tokens without a target
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": positions}


def loss_sum(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"].flatten()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels, ignore_index=IGNORE, reduction="sum")


def run_parity(case: CPCase) -> dict:
    mesh = fk.make_mesh(shard=case.shard, replicate=case.replicate, cp=case.cp, tp=case.tp)
    dev = mesh_device(mesh.device_type)
    ref = build(case.model, case.kernel).to(dev)
    if case.lora:
        from lora_cases import lora_config
        from peft import get_peft_model

        torch.manual_seed(1)
        ref = get_peft_model(ref, lora_config())
    model = copy.deepcopy(ref)
    if case.tp > 1:
        fk.apply_tensor_parallel(model, mesh)
    if case.cp > 1:  # cp 1: the same run without context parallelism, a baseline
        fk.apply_context_parallel(model, mesh, style=case.style)
    if case.ac:
        fk.apply_activation_checkpointing(model, mode=case.ac)
    if case.compile:
        fk.compile_blocks(model, backend=case.compile)
    fk.shard_model(model, mesh, mixed_precision=case.mixed_precision)
    # The parity tests' AdamW (tp_cases): an eps above fp32 noise, so a near-zero gradient's rounding
    # is not normalised up to a full step
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, eps=1e-5)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1, eps=1e-5)
    # the cp and tp ranks are innermost: one data-parallel group per cp x tp group. The TP ranks of a group
    # compute the same loss, so the world's sums below count it tp times, and its count too: the ratios hold.
    groups = dist.get_world_size() // (case.cp * case.tp)
    group = dist.get_rank() // (case.cp * case.tp)
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses = [], []
    for _ in range(case.steps):
        rows = {k: v.to(dev) for k, v in packed_rows(groups * BATCH, gen, case.packed, case.seq).items()}
        mine = fk.split_for_context_parallel({k: v[group * BATCH : (group + 1) * BATCH] for k, v in rows.items()}, mesh)
        count = (mine["labels"] != IGNORE).sum().float()
        dist.all_reduce(count)  # every rank's targets: the global count
        s = loss_sum(model, mine)
        # FSDP averages gradients over the replicate x shard x cp ranks (world / tp): the sum back up to a sum.
        (s * dist.get_world_size() / count).backward()
        total = s.detach().clone()
        dist.all_reduce(total)
        losses.append((total / count).item())
        ref_loss = loss_sum(ref, rows) / (rows["labels"] != IGNORE).sum()
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    worst, worst_name = worst_relative(model, ref)
    return {
        "label": case.label,
        "worst_rel": worst,
        "worst_param": worst_name,
        "losses": losses,
        "ref_losses": ref_losses,
        "meshes": sorted({p.device_mesh.mesh_dim_names for p in model.parameters()}),
        "attn": model.config._attn_implementation,
    }


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def run_errors() -> dict:
    """The clear errors, raised before any collective (a collective on one rank only would hang the others)."""
    out = {}
    # meshes are made on every rank (their sub-groups are collectives)
    mesh4, flat4, mesh22 = fk.make_mesh(shard=1, cp=4), fk.make_mesh(shard=4), fk.make_mesh(shard=2, cp=2)
    # tiny Llama: 4 heads, 2 KV heads; cp 4 cannot split the KV heads. Raised on rank 0 only: no collective ran.
    if dist.get_rank() == 0:
        out["heads"] = _error(lambda: fk.apply_context_parallel(build("llama", "sdpa"), mesh4))
        out["ring"] = _error(lambda: fk.apply_context_parallel(build("llama", "sdpa"), mesh4, style="ring"))
        out["no_cp"] = _error(lambda: fk.apply_context_parallel(build("llama", "sdpa"), flat4))
        out["odd_seq"] = _error(lambda: fk.split_for_context_parallel(torch.zeros(1, 12), mesh4))
        flex = build("llama", "sdpa")
        flex.config._attn_implementation = "flex_attention"
        out["kernel"] = _error(lambda: fk.apply_context_parallel(flex, mesh22))
    dist.barrier()
    # forgetting position_ids: every rank raises together (after the positions' all-gather)
    model = build("llama", "sdpa")
    fk.apply_context_parallel(model, mesh22)
    ids = fk.split_for_context_parallel(torch.zeros(1, 16, dtype=torch.long), mesh22)
    out["no_positions"] = _error(lambda: model(input_ids=ids, use_cache=False))
    # ring refuses packed rows (its mask is causal over the whole row) before its CUDA kernel: on every rank
    from fsdp2kit.parallel.context_parallel import _ring

    part = fk.split_for_context_parallel(packed_rows(1, torch.Generator().manual_seed(3), True), mesh22)
    qkv = torch.zeros(1, 4, SEQ // 2, 10)
    causal = torch.nn.Module()  # an attention module, as transformers' are: is_causal
    causal.is_causal = True
    ring = _ring(mesh22["cp"], 2)
    out["ring_packed"] = _error(lambda: ring(causal, qkv, qkv, qkv, None, position_ids=part["position_ids"]))
    return out


def run_registry() -> dict:
    """The registered attention function is this model's alone and goes with it."""
    import gc

    from transformers import AttentionInterface

    model = build("qwen3", "sdpa")
    other = build("qwen3", "sdpa")
    fk.apply_context_parallel(model, fk.make_mesh(shard=2, cp=2))
    name = model.config._attn_implementation
    out = {"registered": name in AttentionInterface._global_mapping, "other": other.config._attn_implementation}
    del model
    gc.collect()
    out["after_gc"] = name in AttentionInterface._global_mapping
    return out


def run_checkpoint(work: str) -> dict:
    """A checkpoint saved at FSDP 2 x cp 2 loads at cp 1 (FSDP 4), parameters and optimizer state alike."""
    mesh = fk.make_mesh(shard=2, cp=2)
    model = build("llama", "sdpa")
    fk.apply_context_parallel(model, mesh)
    fk.shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = packed_rows(BATCH, torch.Generator().manual_seed(5), True)
    loss_sum(model, fk.split_for_context_parallel(rows, mesh)).backward()
    opt.step()
    ck = fk.Checkpointer(f"{work}/ckpt")
    ck.save(1, model, optimizer=opt)
    saved = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    saved_avg = {n: opt.state[p]["exp_avg"].full_tensor().clone() for n, p in model.named_parameters()}

    flat = fk.make_mesh(shard=4)
    plain = build("llama", "sdpa", seed=1)
    fk.shard_model(plain, flat)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    step = fk.Checkpointer(f"{work}/ckpt").load(plain, optimizer=plain_opt)
    params = all(torch.equal(p.full_tensor(), saved[n]) for n, p in plain.named_parameters())
    named = list(plain.named_parameters())
    state = all(torch.equal(plain_opt.state[p]["exp_avg"].full_tensor(), saved_avg[n]) for n, p in named)
    return {"step": step, "params": params, "state": state, "export": _export(model, mesh, f"{work}/export")}


def _export(model, mesh, out: str) -> dict:
    """export_hf from a trained cp model: transformers loads it, and its logits on the whole rows equal the cp
    model's (each cp rank's chunks gathered and put back in order)."""
    from transformers import AutoModelForCausalLM

    fk.export_hf(model, out)
    dist.barrier()
    rows = packed_rows(BATCH, torch.Generator().manual_seed(6), True)
    with torch.no_grad():
        mine = fk.split_for_context_parallel(rows, mesh)
        local = model(input_ids=mine["input_ids"], position_ids=mine["position_ids"], use_cache=False).logits
        cp = mesh["cp"].size()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=mesh["cp"].get_group())
        chunks = torch.cat(parts, dim=1).unflatten(1, (2 * cp, -1))  # chunks in the ranks' layout order
        layout = chunk_order(cp)
        trained = chunks[:, sorted(range(2 * cp), key=layout.__getitem__)].flatten(1, 2)
        back = AutoModelForCausalLM.from_pretrained(out)
        logits = back(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
    rel = ((logits - trained).abs().max() / trained.abs().max()).item()
    return {"rel": rel, "attn": back.config._attn_implementation}


def run_world4(cases: list[CPCase], work: str) -> dict:
    return {
        "parity": [run_parity(c) for c in cases],
        "errors": run_errors(),
        "registry": run_registry(),
        "checkpoint": run_checkpoint(work),
        # GQA: k and v repeated to the query heads for the kernel
        "ring": run_ring_emulated(CPCase(model="qwen3", kernel="sdpa", shard=2, packed=False, style="ring")),
        "counted": [run_counted(c) for c in COUNTED],
    }


COUNTED = [
    CPCase(model="llama", kernel="sdpa", shard=2),
    CPCase(model="llama", kernel="sdpa", shard=2, ac="full"),
    CPCase(model="qwen3", kernel="sdpa", shard=2, packed=False, style="ring"),
]


def run_counted(case: CPCase) -> dict:
    """One step's collectives on the cp group, as `fk.count_collectives` counts them (the positions' int64
    all-gather left out), beside the step-time model's prediction for the same step (bytes by kind; with full
    checkpointing the recompute repeats the forward ones, as planner/steptime.py's _predict counts them)."""
    from fsdp2kit.planner.api import Settings
    from fsdp2kit.planner.steptime import activation_collectives

    mesh = fk.make_mesh(shard=case.shard, cp=case.cp)
    model = build(case.model, case.kernel)
    names = [[f"model.layers.{i}"] for i in range(model.config.num_hidden_layers)] + [[""]]
    # not Settings.check(): the ring's 64 x cp tokens are the CUDA kernel's, stood in for here
    s = Settings(shard=case.shard, batch=BATCH, seq=SEQ, cp=case.cp, cp_style=case.style)
    predicted: dict[str, int] = {}
    for phase, kind, _, nbytes in (c for unit in activation_collectives(model, names, s, 4) for c in unit):
        kind = "all_to_all" if kind == "permute" else kind  # torch's permute_tensor is an all_to_all_single
        times = 2 if phase == "forward" and case.ac == "full" else 1
        predicted[kind] = predicted.get(kind, 0) + times * nbytes
    with ring_on_cpu() if case.style == "ring" else contextlib.nullcontext():
        fk.apply_context_parallel(model, mesh, style=case.style)
        if case.ac:
            fk.apply_activation_checkpointing(model, mode=case.ac)
        fk.shard_model(model, mesh)
        batch = fk.split_for_context_parallel(packed_rows(BATCH, torch.Generator().manual_seed(7), case.packed), mesh)
        with fk.count_collectives(mesh) as counts:
            loss_sum(model, batch).backward()
    counted: dict[str, int] = {}
    for e in counts.events:
        if e.group == "cp" and e.dtype != "int64":
            counted[e.kind] = counted.get(e.kind, 0) + e.nbytes
    return {"label": case.label, "counted": counted, "predicted": predicted}


def run_ring_emulated(case: CPCase) -> dict:
    with ring_on_cpu():
        return run_parity(case)


@contextlib.contextmanager
def ring_on_cpu():
    """style="ring" on CPU ranks: fsdp2kit's glue around torch's ring driver, with the CUDA kernel the ring calls
    (memory-efficient attention, forward and backward) stood in for by the CPU flash ops (the same outputs and
    gradients); the refusal of CPU meshes bypassed for this call only. The kernels themselves: tests/cuda."""
    from unittest import mock

    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    import fsdp2kit.parallel.context_parallel as cpmod

    aten = torch.ops.aten

    def forward(q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False, *, scale=None):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, bool(is_causal), scale=scale)
        return out, lse, torch.tensor(0), torch.tensor(0)

    def backward(*, grad_out_, query, key, value, out, logsumexp, dropout_p, is_causal, scale, **bias_and_seeds):
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out_, query, key, value, out, logsumexp, dropout_p, bool(is_causal), scale=scale
        )
        return (*grads, None)

    kernels = types.SimpleNamespace(
        _scaled_dot_product_efficient_attention=forward,
        _scaled_dot_product_efficient_attention_backward=types.SimpleNamespace(default=backward),
    )

    def on_cuda(mesh, what, **kw):  # a copy of the cp mesh that says cuda, for apply_context_parallel's check
        sub = copy.copy(sub_mesh(mesh, what, **kw))
        sub.__class__ = type("OnCuda", (type(sub),), {"device_type": "cuda"})
        return sub

    with mock.patch.object(ring, "aten", kernels), mock.patch.object(cpmod, "sub_mesh", on_cuda):
        yield
