"""Back to Hugging Face: a sharded model, or a DCP checkpoint of one, as safetensors + config (docs/internals.md)."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import save_file

from fsdp2kit._internal.agree import raise_agreed
from fsdp2kit._internal.dtensor import gather_full, is_first_rank, reshard_all
from fsdp2kit._internal.fmt import key_problems
from fsdp2kit.checkpoint import read_metadata, resolve_step_dir
from fsdp2kit.weights.adapter_checkpoint import load_alone, peft_model_from_checkpoint, read_info
from fsdp2kit.weights.adapters import adapter_keys, is_peft_model, lora_merges, merged_weight, peft_view
from fsdp2kit.weights.hf_layout import model_tensors, save_layout
from fsdp2kit.weights.nf4 import is_nf4

DEFAULT_MAX_SHARD_SIZE = "5GB"


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"500MB"``, ``"5GB"`` (powers of 1000) or ``"4GiB"``
    (transformers' reading of them)."""
    from transformers.utils.hub import convert_file_size_to_int

    n = convert_file_size_to_int(size)
    if n <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return n


def _export_names(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, list[str]]:
    """Each tensor once (a tied weight under its source name, ignored ones left out) -> all of its names."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[str, list[str]] = {}
    for name in tensors:
        groups.setdefault(aliases.get(name, name), []).append(name)
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    kept = {next((n for n in members if n not in tied_targets), members[0]): members for members in groups.values()}
    return {name: members for name, members in kept.items() if name not in skip}


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a tokenizer (one of the files `AutoTokenizer` reads)."""
    return any(Path(directory, f).is_file() for f in ("tokenizer_config.json", "tokenizer.json", "tokenizer.model"))


def _resolve_tokenizer(tokenizer: Any, model: nn.Module):
    """The tokenizer object to write (see `export_hf`'s ``tokenizer``), or None."""
    if tokenizer is False:
        return None
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    if tokenizer is None:  # the local directory the model's config was read from, if it holds one
        tokenizer = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not (isinstance(tokenizer, str) and tokenizer and has_tokenizer(tokenizer)):
            return None
    elif not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer: expected a tokenizer, a directory or None, got {type(tokenizer).__name__}")
    elif not has_tokenizer(tokenizer):
        raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} is not a directory holding a tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)


def _save_config(model: nn.Module, directory: Path, dtype: torch.dtype | None, tokenizer=None) -> None:
    """Copies of the config and generation config with ``dtype`` and the tokenizer's BOS/EOS/PAD ids (PAD: EOS
    when it has none; ``generate`` stops at the tokenizer's EOS), and the tokenizer beside them."""
    ids = {}
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        if dtype is not None:
            config.dtype = dtype
        generation = copy.deepcopy(getattr(model, "generation_config", None))
        for c in (config, generation) if generation is not None else (config,):
            for key, value in ids.items():
                if not (isinstance(getattr(c, key, None), list) and value in getattr(c, key)):  # keep a list of EOS ids
                    setattr(c, key, value)
            c.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.detach().to("cpu", dtype=dtype if t.is_floating_point() else None)


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    merge: bool = False,
    tokenizer: Any = None,
) -> Path | None:
    """Write a (sharded) model as a Hugging Face checkpoint that ``from_pretrained`` loads, with its tokenizer.

    Collective: call it on every rank of the mesh. Tensors are gathered one at a time; the mesh's first
    rank alone writes them, in the model's usual layout as ``save_pretrained`` does (docs/internals.md).
    A peft ``PeftModel`` is written as peft writes it (its adapters), or with ``merge=True`` as the
    wrapped model with the active LoRA adapters folded in, as ``merge_and_unload`` does (docs/lora.md).

    Args:
        dtype: cast floating tensors (e.g. ``torch.bfloat16``); default: as held (the master dtype).
        max_shard_size: bytes per file (int or ``"5GB"``); one file ``model.safetensors`` when
            everything fits, else ``model-0000i-of-0000n.safetensors`` plus the index.
        overwrite: replace an existing non-empty ``out_dir`` (else ``FileExistsError``).
        tokenizer: written beside the weights, its BOS/EOS/PAD ids set in the saved configs: a
            tokenizer object or a directory holding one; by default the tokenizer of the local
            directory the model's config came from, if any; ``False``: none.

    Returns the output directory on the writing rank, None on the others.
    """
    reshard_all(model)
    tensors, aliases = model_tensors(model)
    full_of = lambda name: gather_full(tensors[name])
    if merge:
        if not is_peft_model(model):
            raise ValueError(f"export_hf(merge=True) merges peft adapters: {type(model).__name__} is not a PeftModel")
        merges = lora_merges(model)
        model, tensors, aliases = peft_view(model, tensors, aliases)  # the wrapped model

        def full_of(name: str) -> torch.Tensor:  # the base weight with the active adapters folded in
            weight = gather_full(tensors[name])
            return merged_weight(weight, merges.get(name, [])) if name in merges or is_nf4(weight) else weight

    out = FirstRankWriter(model, out_dir, overwrite, "export_hf", max_shard_size)
    tok = out.do(lambda: _resolve_tokenizer(tokenizer, model))  # None on the other ranks
    if is_peft_model(model):  # peft's adapter directory, from the full adapter tensors on the writing rank's CPU
        with torch.no_grad():
            for adapter in list(model.peft_config):
                fulls = {}  # this adapter's (the last one's freed before these gathers)
                for n in adapter_keys(model, adapter, tensors):
                    full = gather_full(tensors[n])  # collective: every rank gathers each tensor, in order
                    if out.writes:
                        fulls[n] = _cast(full, dtype).contiguous()
                save = functools.partial(model.save_pretrained, str(out.dir), save_embedding_layers=False)
                out.do(functools.partial(save, selected_adapters=[adapter], state_dict=fulls))
        out.do(lambda: tok is not None and tok.save_pretrained(str(out.dir)))
        return out.finish()
    held = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    return _write(model, out, _export_names(model, tensors, aliases), full_of, dtype, dtype or held, tok)


def _write(model, out: FirstRankWriter, names, full_of, dtype, config_dtype, tok):
    """``names`` by conversion group in the model's layout (``full_of`` runs on every rank), then the configs."""
    groups, to_hf = save_layout(model, list(names))
    with torch.no_grad():
        for group in groups:
            fulls = {n: full_of(n) for n in group}  # gathered on every rank, in order
            out.do(lambda fulls=fulls: out.add(to_hf({n: _cast(v, dtype) for n, v in fulls.items()})))
    out.do(out.write_index)
    out.do(lambda: _save_config(model, out.dir, config_dtype, tok))
    return out.finish()


def dcp_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    base: str | os.PathLike | None = None,
    merge: bool = False,
    tokenizer: Any = None,
) -> Path:
    """Convert a DCP checkpoint of a transformers model to Hugging Face safetensors, in one process.

    ``checkpoint`` is a step directory or a Checkpointer root (its newest complete step). The state
    under "model" is read a tensor at a time, without a process group, and written as `export_hf` writes
    it. The config comes from ``config`` (a transformers config, or a path), else the ``config.json`` in
    the step directory, else in the root; a checkpoint that does not match the model built from it is a
    ``ValueError`` naming the keys. A LoRA / QLoRA step (saved
    ``trainable_only``) needs ``base``, the pretrained directory the run started from: the PEFT
    model is rebuilt around it in memory (``merge`` as for `export_hf`). ``tokenizer`` as for
    `export_hf`; by default the one in ``base``, else in the ``config`` directory, else in the
    step directory.
    """
    step_dir = resolve_step_dir(checkpoint)
    if read_info(step_dir).get("trainable_only"):
        if base is None:
            raise ValueError(
                f"{step_dir} holds only the trainable parameters (a LoRA / QLoRA run saves its adapters, not the "
                "frozen base): pass base= (--base) the pretrained model directory the run started from"
            )
        model = peft_model_from_checkpoint(step_dir, base)
        kwargs = dict(dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, merge=merge, tokenizer=tokenizer)
        return export_hf(model, out_dir, **kwargs)
    if merge:
        raise ValueError(f"merge=True folds LoRA adapters into their base; {step_dir} is a full model's checkpoint")
    import transformers

    if not isinstance(config, transformers.PretrainedConfig):  # a path, or the step's / the root's config.json
        where = config or next((d for d in (step_dir, step_dir.parent) if (d / "config.json").is_file()), None)
        if where is None:
            raise FileNotFoundError(
                f"no config.json in {step_dir} or {step_dir.parent}: pass config= (a transformers config, or a "
                "directory / file holding config.json)"
            )
        config = transformers.AutoConfig.from_pretrained(str(where), local_files_only=True)
    classes = [getattr(transformers, a, None) for a in (getattr(config, "architectures", None) or [])]
    with torch.device("meta"):  # the first class of its architectures
        model = next((c for c in classes if isinstance(c, type)), transformers.AutoModelForCausalLM.from_config)(config)
    tok = _resolve_tokenizer(tokenizer, model)
    metadata = read_metadata(step_dir)
    stored = {  # the model's tensors, under the Checkpointer's "model" key
        k.removeprefix("model."): v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    if not stored:
        first_keys = sorted(metadata.state_dict_metadata)[:3]
        raise ValueError(f"{step_dir} holds no tensors under 'model' (keys start with {first_keys})")
    tensors, aliases = model_tensors(model)
    names = _export_names(model, tensors, aliases)
    # name to write -> key to read (any of its tied names)
    source = {name: next((n for n in members if n in stored), None) for name, members in names.items()}
    missing = [name for name, found in source.items() if found is None]
    mismatched = [
        f"{found}: checkpoint {tuple(stored[found].size)}, {type(model).__name__} {tuple(tensors[name].shape)}"
        for name, found in source.items()
        if found is not None and tuple(stored[found].size) != tuple(tensors[name].shape)
    ]
    if problems := key_problems(missing, sorted(set(stored) - set(tensors)), mismatched):
        raise ValueError(f"{step_dir} does not match {type(model).__name__} from its config: " + "; ".join(problems))

    dtypes = {n: stored[source[n]].properties.dtype for n in names}
    held = next((d for d in dtypes.values() if d.is_floating_point), None)
    out = FirstRankWriter(model, out_dir, overwrite, "dcp_to_hf", max_shard_size, alone=True)

    def read(name: str) -> torch.Tensor:  # one dcp.load a tensor: ~6 ms each, against seconds of reading
        state = {source[name]: torch.empty(stored[source[name]].size, dtype=dtypes[name])}
        load_alone({"model": state}, step_dir, metadata)  # the metadata read above, not unpickled again
        return state[source[name]]

    full_of = lambda name: out.do(functools.partial(read, name))  # an error is kept for out.finish
    return _write(model, out, names, full_of, dtype, dtype or held, tok)


class FirstRankWriter:
    """The mesh's first rank (``alone``: this process) writes safetensors files of at most ``max_shard_size`` into a
    hidden sibling of ``out_dir``, renamed into place by `finish`; errors are kept and raised there on every rank."""

    def __init__(self, model: nn.Module, out_dir, overwrite: bool, what: str, max_shard_size, *, alone=False):
        self.model, self.out, self.what, self.max = model, Path(out_dir), what, parse_size(max_shard_size)
        self.writes = alone or is_first_rank(model)
        self.error: BaseException | None = None
        self.dir: Path | None = None
        self.pending: dict[str, torch.Tensor] = {}  # safetensors files: a new one each time self.max would be passed
        self.total = self.files = 0
        self.file_of: dict[str, int] = {}  # tensor name -> its file's number
        self.do(lambda: self._stage(overwrite))

    def _stage(self, overwrite: bool) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"{self.out} exists and is not a directory")
        if self.out.is_dir() and any(self.out.iterdir()) and not overwrite:
            raise FileExistsError(f"{self.out} exists and is not empty; pass overwrite=True to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.dir = self.out.parent / f".{self.out.name}.partial-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()

    def _commit(self) -> None:
        old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
        if self.out.exists():
            self.out.rename(old)
        self.dir.rename(self.out)
        shutil.rmtree(old, ignore_errors=True)  # nothing there when there was no old directory

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name in self.file_of:
                raise ValueError(f"two tensors would be saved as {name!r}")
            if self.pending and sum(t.nbytes for t in self.pending.values()) + tensor.nbytes > self.max:
                self.flush()
            self.pending[name] = tensor.contiguous()
            self.total += tensor.nbytes
            self.file_of[name] = self.files

    def flush(self) -> None:
        if self.pending:
            save_file(self.pending, str(self.dir / f".part-{self.files}"), metadata={"format": "pt"})
            self.files += 1
            self.pending = {}

    def write_index(self) -> None:
        """The pending tensors, then the files under their final names, with the index when there are several."""
        self.flush()
        if not self.files:
            raise ValueError("nothing to write: the model has no parameters or persistent buffers")
        n = self.files
        names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] if n > 1 else ["model.safetensors"]
        for i, name in enumerate(names):
            (self.dir / f".part-{i}").rename(self.dir / name)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {k: names[i] for k, i in sorted(self.file_of.items())},
            }
            (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def do(self, fn: Callable[[], Any]) -> Any:
        """``fn()``'s result on the writing rank; None elsewhere, after an error or if it raised (kept for `finish`)."""
        if self.writes and self.error is None:
            try:
                return fn()
            except BaseException as exc:
                self.error = exc
        return None

    def finish(self) -> Path | None:
        """Publish; the output directory on the writing rank, None elsewhere."""
        if self.dir is not None:
            self.do(self._commit)
            if self.error is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
        raise_agreed(self.error, self.model, self.what)
        return self.out if self.writes else None
