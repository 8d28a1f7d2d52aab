"""Rows for training and evaluation through Hugging Face `datasets`: read, tokenize once, pack, cache, load.

    files ──load_dataset──> records ──map(encode)──> examples (ids, labels) ──split / fit to seq_len──>
    ──map(pack)──> rows (input_ids, labels, position_ids) ──save_to_disk──> cache/<key>/{train,eval}

The cache key hashes everything the rows depend on (files' paths, sizes and mtimes; the tokenizer;
the format; seq_len; packing; the split), so a second launch, and every rank of this one, loads
the rows memory-mapped instead of tokenizing again. Only local rank 0 of each node builds them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from support.errors import UsageError
from support.formats import IGNORE, FormatSpec, encode_record

__all__ = ["DataError", "DataSplits", "check_source", "load_rows", "pack_examples", "prepare_data", "read_records"]

_VERSION = 1  # bump when the row layout changes: old caches then stop matching
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text", ".md": "text"}


class DataError(UsageError):
    """Bad data or data settings, with the file and line (or field) at fault."""

    kind = "data"


@dataclass
class DataSplits:
    train: object  # datasets.Dataset of rows
    eval: object | None
    stats: dict = field(default_factory=dict)


def _quiet_datasets() -> None:
    import datasets

    datasets.disable_progress_bars()  # one summary line instead of a bar per map and per process
    datasets.logging.set_verbosity_error()


def check_source(path: str | Path, role: str = "data") -> str | None:
    """The `datasets` builder that reads ``path`` (None: a dataset saved with save_to_disk), or `DataError`.
    Reads nothing, so the recipe checks its files before any process group starts."""
    p = Path(path)
    if p.is_dir() and (p / "dataset_info.json").is_file():
        return None
    if p.is_dir():
        raise DataError(f"{role} path {p} is a directory but not a dataset saved with save_to_disk")
    if not p.is_file():
        raise DataError(f"{role} file {p} does not exist")
    builder = _BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise DataError(f"{role} file {p}: unknown type {p.suffix!r}; use one of {', '.join(sorted(_BUILDERS))}")
    return builder


def read_records(path: str | Path, cache_dir: str | Path):
    """One local file as a `datasets.Dataset` of records (JSONL/JSON, Parquet, Arrow, or a text file = one record)."""
    import datasets

    p = Path(path)
    builder = check_source(p)
    if builder is None:
        ds = datasets.load_from_disk(str(p))
        return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    kw = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(
            builder, data_files=str(p.resolve()), split="train", cache_dir=str(Path(cache_dir) / "raw"), **kw
        )
    except Exception as e:  # pyarrow's parse errors say what, not where: add the file
        raise DataError(f"could not read {p}: {e}") from e


def _line_of(path: Path, row: int) -> str:
    """'path:line' for a JSONL row (blank lines are skipped by the reader), else 'path, row N'."""
    if path.suffix.lower() == ".jsonl":
        seen = -1
        with path.open() as f:
            for n, line in enumerate(f, 1):
                seen += bool(line.strip())
                if seen == row:
                    return f"{path}:{n}"
    return f"{path}, row {row + 1}"


def _encode_batch(batch: dict, indices: list[int], *, tokenizer, spec: FormatSpec) -> dict:
    n = len(indices)
    out = {"ids": [], "labels": [], "error": [], "row": indices}
    for i in range(n):
        ids, labels, error = encode_record(tokenizer, {k: v[i] for k, v in batch.items()}, spec)
        out["ids"].append(ids)
        out["labels"].append(labels)
        out["error"].append(error)
    return out


def _fit_batch(batch: dict, *, seq_len: int, chunk: bool) -> dict:
    """Each example to at most seq_len + 1 tokens (seq_len training positions): text is cut into chunks
    that overlap by one token (nothing is lost), chat/completion examples are truncated."""
    out = {"ids": [], "labels": [], "cut": [], "truncated": [], "no_answer": []}
    for ids, labels in zip(batch["ids"], batch["labels"]):
        full = sum(t != IGNORE for t in labels[1:])
        if full == 0:  # nothing to learn from (e.g. a chat with no assistant turn): counted, then dropped
            out["ids"].append(ids[:2])
            out["labels"].append(labels[:2])
            out["cut"].append(False)
            out["truncated"].append(False)
            out["no_answer"].append(True)
            continue
        if chunk:
            starts = range(0, max(1, len(ids) - 1), seq_len)
            pieces = [(ids[s : s + seq_len + 1], labels[s : s + seq_len + 1]) for s in starts]
        else:
            pieces = [(ids[: seq_len + 1], labels[: seq_len + 1])]
        for pid, plab in pieces:
            kept = sum(t != IGNORE for t in plab[1:])
            out["ids"].append(pid)
            out["labels"].append(plab)
            out["cut"].append(full > 0 and kept == 0 and not chunk)
            out["truncated"].append(not chunk and len(ids) > seq_len + 1)
            out["no_answer"].append(False)
    return out


def pack_examples(batch: dict, *, seq_len: int, pad_id: int, packing: bool) -> dict:
    """Examples to rows of seq_len positions. An example of n tokens gives n - 1 positions (inputs
    ids[:-1], targets labels[1:]), with positions 0..n-2: restarting positions are what tells the
    model's attention (transformers' packed-sequence detection, or flash-attention's varlen path)
    that examples in a row must not see each other. Shifting per example means the last token of
    one example is never trained to predict the first of the next. Padding takes target -100 and
    continues the last example's positions (it is after every real token, so causal attention
    keeps real tokens from seeing it)."""
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    cur_ids: list[int] = []
    cur_tgt: list[int] = []
    cur_pos: list[int] = []

    def flush():
        if not cur_ids:
            return
        pad = seq_len - len(cur_ids)
        rows["input_ids"].append(cur_ids + [pad_id] * pad)
        rows["labels"].append(cur_tgt + [IGNORE] * pad)
        last = cur_pos[-1] + 1
        rows["position_ids"].append(cur_pos + list(range(last, last + pad)))
        cur_ids.clear(), cur_tgt.clear(), cur_pos.clear()

    for ids, labels in zip(batch["ids"], batch["labels"]):
        m = len(ids) - 1
        if m < 1:
            continue
        if cur_ids and (not packing or len(cur_ids) + m > seq_len):
            flush()
        cur_ids += ids[:-1]
        cur_tgt += labels[1:]
        cur_pos += range(m)
    flush()
    return rows


def _procs(num_proc: int, n_records: int) -> int | None:
    """Processes for a map: as asked, or (0) one per core up to 8 once there is enough work to pay
    for starting them (below 10k records one process is faster)."""
    if num_proc == 0:
        num_proc = 1 if n_records < 10_000 else min(8, os.cpu_count() or 1)
    return num_proc if num_proc > 1 and n_records >= 2 * num_proc else None


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        backend.to_str() if backend is not None else repr(tokenizer),
        tokenizer.chat_template or "",
        json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _file_fingerprint(path: str) -> list:
    p = Path(path)
    if p.is_dir():
        return [str(p.resolve()), *[(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.iterdir())]]
    st = p.stat() if p.exists() else None
    return [str(p.resolve()), st.st_size if st else -1, st.st_mtime_ns if st else -1]


def _encoded(sources, tokenizer, spec: FormatSpec, cache_dir: Path, num_proc: int, role: str):
    """Every record of every source, encoded; the first bad record raises, naming its file and line."""
    import datasets

    parts = []
    for src in sources:
        ds, path = (src, None) if isinstance(src, datasets.Dataset) else (read_records(src, cache_dir), Path(src))
        where = str(path) if path else "the embedded demo data"
        if len(ds) == 0:
            raise DataError(f"{role} data {where} has no records")
        missing = [f for f in spec.fields() if f not in ds.column_names]
        if missing:
            raise DataError(
                f"{where}: records have no field {missing[0]!r} (fields: {', '.join(ds.column_names)}); "
                f"set [data] {_field_option(spec, missing[0])}"
            )
        enc = ds.map(
            _encode_batch,
            batched=True,
            with_indices=True,
            remove_columns=ds.column_names,
            fn_kwargs={"tokenizer": tokenizer, "spec": spec},
            num_proc=_procs(num_proc, len(ds)),
            desc=f"tokenizing {where}",
        )
        bad = enc.filter(lambda e: bool(e), input_columns="error")
        if len(bad):
            first = bad[0]
            place = _line_of(path, first["row"]) if path else f"{where}, record {first['row'] + 1}"
            more = f" ({len(bad) - 1} more bad records)" if len(bad) > 1 else ""
            raise DataError(f"{place}: record {first['error']}{more}")
        parts.append(enc.remove_columns(["error", "row"]))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _field_option(spec: FormatSpec, name: str) -> str:
    for opt in ("text_field", "messages_field", "prompt_field", "completion_field"):
        if getattr(spec, opt) == name:
            return f"{opt} (now {name!r}) to the field that holds it"
    return "template to use only fields the records have"


def _rows(examples, *, seq_len: int, pad_id: int, packing: bool, chunk: bool, num_proc: int, role: str, where: str):
    n_records = len(examples)
    fit = examples.map(
        _fit_batch,
        batched=True,
        remove_columns=examples.column_names,
        fn_kwargs={"seq_len": seq_len, "chunk": chunk},
        num_proc=_procs(num_proc, n_records),
    )
    cut = sum(fit["cut"])
    truncated = sum(fit["truncated"])
    no_answer = sum(fit["no_answer"])
    fit = fit.filter(lambda labels: any(t != IGNORE for t in labels[1:]), input_columns="labels")
    answer_tokens = sum(sum(t != IGNORE for t in lab[1:]) for lab in fit["labels"])
    if answer_tokens == 0:
        raise DataError(
            f"the {role} split ({where}) has no answer tokens: every label is -100"
            + (f" ({cut} records had their whole answer cut off by seq_len={seq_len})" if cut else "")
            + "; check the format, the chat template's assistant turns, or raise seq_len"
        )
    rows = fit.map(
        pack_examples,
        batched=True,
        batch_size=1000,
        remove_columns=fit.column_names,
        fn_kwargs={"seq_len": seq_len, "pad_id": pad_id, "packing": packing},
    )
    used = sum(sum(t != IGNORE for t in lab) for lab in rows["labels"])
    stats = {
        "records": n_records,
        "examples": len(fit),
        "rows": len(rows),
        "answer_tokens": answer_tokens,
        "cut_off": cut,
        "truncated": truncated,
        "no_answer": no_answer,
        "fill": sum(len(e) - 1 for e in fit["ids"]) / max(1, len(rows) * seq_len),
    }
    assert used == answer_tokens
    return rows, stats


def prepare_data(
    *,
    files: list[str],
    tokenizer,
    spec: FormatSpec,
    seq_len: int,
    packing: bool,
    cache_dir: str | Path,
    eval_files: list[str] = (),
    eval_fraction: float = 0.0,
    seed: int = 0,
    num_proc: int = 0,
    default_records=None,
) -> tuple[Path, dict]:
    """Build (or find) the cached rows; returns the cache directory and its stats. Not collective."""
    import datasets

    _quiet_datasets()
    if spec.format == "chat" and not tokenizer.chat_template:
        raise DataError(
            "[data] format = 'chat' needs a tokenizer with a chat template; "
            f"{tokenizer.name_or_path or 'this tokenizer'} has none "
            "(set tokenizer.chat_template and save it, or use format = 'completion')"
        )
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"[eval] fraction = {eval_fraction} must be in [0, 1)")
    for f in eval_files:
        if not Path(f).exists():
            raise DataError(f"eval file {f} does not exist")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has neither a pad nor an EOS token to pad rows with")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    key = hashlib.sha256(
        json.dumps(
            {
                "v": _VERSION,
                "files": [_file_fingerprint(f) for f in files] or "demo",
                "eval_files": [_file_fingerprint(f) for f in eval_files],
                "eval_fraction": eval_fraction,
                "seed": seed,
                "tokenizer": _tokenizer_fingerprint(tokenizer),
                "spec": spec.key(),
                "seq_len": seq_len,
                "packing": packing,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    out = Path(cache_dir) / f"rows-{key}"
    if (out / "stats.json").is_file():
        return out, json.loads((out / "stats.json").read_text())

    sources = files or [default_records]
    train = _encoded(sources, tokenizer, spec, Path(cache_dir), num_proc, "training")
    evals = None
    if eval_files:
        evals = _encoded(eval_files, tokenizer, spec, Path(cache_dir), num_proc, "eval")
    elif eval_fraction > 0:
        split = train.train_test_split(test_size=eval_fraction, seed=seed, shuffle=True)
        train, evals = split["train"], split["test"]
    chunk = spec.format == "text"
    common = {"seq_len": seq_len, "pad_id": pad_id, "packing": packing, "chunk": chunk, "num_proc": num_proc}
    where = ", ".join(map(str, files)) or "the embedded demo data"
    rows, stats = _rows(train, role="training", where=where, **common)
    all_stats = {"train": stats, "cache": str(out)}
    result = datasets.DatasetDict({"train": rows})
    if evals is not None:
        ewhere = ", ".join(eval_files) or f"{eval_fraction:g} of the training records"
        erows, estats = _rows(evals, role="eval", where=ewhere, **common)
        result["eval"] = erows
        all_stats["eval"] = estats
    # Written under a unique name, then renamed: a reader never sees half a cache, and two nodes
    # building into one shared directory at once both succeed.
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}"
    result.save_to_disk(str(tmp))
    (tmp / "stats.json").write_text(json.dumps(all_stats, indent=1))
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another builder won the race; its copy is identical
    return out, all_stats


def load_rows(path: Path) -> DataSplits:
    import datasets

    _quiet_datasets()
    dd = datasets.load_from_disk(str(path))
    stats = json.loads((path / "stats.json").read_text())
    return DataSplits(dd["train"], dd.get("eval"), stats)
