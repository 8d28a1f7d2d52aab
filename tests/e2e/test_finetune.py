"""Fine-tuning as a user runs it: pre-train and export, fine-tune on chat data with held-out eval and
export, then load the export with plain transformers; and a bad record stops the launch naming its line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_recipes import DEMO, ROOT, records, run

CHAT = str(ROOT / "recipes" / "configs" / "demo_chat.toml")
CHAT_DATA = str(ROOT / "recipes" / "data" / "demo_chat.jsonl")
QUICK = ["--data.seq_len", "64", "--log.every", "2", "--log.progress", "false"]


# Three torchrun launches (a minute and more here): make test-all. make test covers the pieces
# (tests/unit/test_finetune_data.py, tests/dist/test_finetune_loss.py) and the bad-record launch below.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pretrain_finetune_eval_export(tmp_path):
    base, chat = tmp_path / "base", tmp_path / "chat"
    run(["--config", DEMO, *QUICK, "--train.steps", "6", "--export.hf_dir", str(base)], tmp_path)
    assert (base / "tokenizer.json").is_file() and (base / "config.json").is_file()

    args = ["--config", CHAT, *QUICK, "--model.name", str(base), "--data.tokenizer", str(base)]
    args += ["--data.files", CHAT_DATA, "--train.steps", "8", "--train.grad_accum", "2", "--eval.every", "4"]
    args += ["--export.hf_dir", str(chat), "--log.jsonl", str(tmp_path / "chat.jsonl")]
    _, out = run(args, tmp_path)
    assert re.search(r"data train: 360 records -> 360 examples -> \d+ rows of 64", out), out[-3000:]
    assert "data eval: 40 records" in out
    log = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in log if "eval_loss" in r}
    assert sorted(evals) == [4, 8]
    assert evals[8]["eval_ppl"] == pytest.approx(math.exp(evals[8]["eval_loss"]))
    train = records(tmp_path / "chat.jsonl")
    assert train[8]["loss"] < train[1]["loss"]

    # the export is an ordinary HF model: loaded by transformers, its held-out loss is the recipe's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.evaluate import evaluate
    from support.rows import load_rows

    model = AutoModelForCausalLM.from_pretrained(chat, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(chat, local_files_only=True)
    assert tok.chat_template and model.config.eos_token_id == tok.eos_token_id
    cache = Path(re.search(r"data cache: (\S+)", out).group(1))
    held_out = load_rows(cache if cache.is_absolute() else tmp_path / cache).eval
    again = evaluate(model, held_out, 8, rank=0, world_size=1, device="cpu")
    assert again["eval_tokens"] == evals[8]["eval_tokens"]
    assert again["eval_loss"] == pytest.approx(evals[8]["eval_loss"], rel=1e-4)
    question = [{"role": "user", "content": "Where does the cat sleep?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(prompt["input_ids"], max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.slow  # make test: test_recipe_errors's data-bad-record case checks the same block, line for line
@pytest.mark.timeout(300)
def test_a_bad_record_stops_every_rank_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = Path(CHAT_DATA).read_text().splitlines()[:20]
    lines[12] = json.dumps({"conversation": [{"role": "user", "content": "hi"}]})
    bad.write_text("\n".join(lines) + "\n")
    args = ["--config", DEMO, *QUICK, "--data.format", "chat", "--data.files", str(bad), "--train.steps", "2"]
    code, out = run(args, tmp_path, check=False)
    assert code != 0
    assert f"data error: {bad}:13: record has no field 'messages' (fields: conversation)" in out, out[-3000:]
