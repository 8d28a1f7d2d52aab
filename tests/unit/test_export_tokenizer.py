"""Exports are complete: the tokenizer is written beside the weights by `fk.export_hf`, `dcp_to_hf` and
`fsdp2kit export-hf` (given, or from the directory the model came from), and recipes/generate.py says
in one line when a directory has none (issue 27). The tokenizer is trained here (no download)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import fsdp2kit as fk
from fsdp2kit.cli import main
from fsdp2kit.weights.export import has_tokenizer
from support.tokenizer import train_demo_tokenizer

TEXT = "Where does the cat sleep?"


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


def tiny(tok) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tok)
    )
    return AutoModelForCausalLM.from_config(config)


def loads_as(directory, tok) -> None:
    """``directory``'s tokenizer loads with AutoTokenizer and encodes as ``tok`` does."""
    again = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert again(TEXT)["input_ids"] == tok(TEXT)["input_ids"] and len(again) == len(tok)
    assert again.chat_template == tok.chat_template and again.eos_token == tok.eos_token


def test_export_hf_writes_the_tokenizer_given_or_the_models_own(tok, tmp_path):
    model = tiny(tok)
    fk.export_hf(model, tmp_path / "object", tokenizer=tok)
    loads_as(tmp_path / "object", tok)
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "object").config
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id != tok.eos_token_id  # the saved config is aligned, the live model unchanged

    tok.save_pretrained(tmp_path / "tok")
    fk.export_hf(model, tmp_path / "path", tokenizer=tmp_path / "tok")
    loads_as(tmp_path / "path", tok)
    with pytest.raises(FileNotFoundError, match="is not a directory holding a tokenizer"):
        fk.export_hf(model, tmp_path / "bad", tokenizer=tmp_path / "object" / "nothing")

    # A model built from a local directory: that directory's tokenizer, unless told otherwise.
    model.config.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    from_dir = fk.models.build_causal_lm(str(tmp_path / "base"), meta=False)
    fk.export_hf(from_dir, tmp_path / "implicit")
    loads_as(tmp_path / "implicit", tok)
    fk.export_hf(from_dir, tmp_path / "none", tokenizer=False)
    assert not has_tokenizer(tmp_path / "none") and (tmp_path / "none" / "model.safetensors").is_file()


def test_peft_exports_carry_the_tokenizer(tok, tmp_path):
    model = fk.apply_lora(tiny(tok), r=4, targets=["q_proj", "v_proj"])
    fk.export_hf(model, tmp_path / "adapter", tokenizer=tok)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loads_as(tmp_path / "adapter", tok)
    fk.export_hf(model, tmp_path / "merged", merge=True, tokenizer=tok)
    loads_as(tmp_path / "merged", tok)


def _save_step(model, root) -> None:
    path = root / "step_00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path), no_dist=True)
    model.config.save_pretrained(path)


def test_cli_export_hf_writes_the_tokenizer_or_says_it_did_not(tok, tmp_path, capsys):
    model = tiny(tok)
    _save_step(model, tmp_path / "ck")
    tok.save_pretrained(tmp_path / "tok")

    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "bare")]) == 0
    assert "without a tokenizer" in capsys.readouterr().out and not has_tokenizer(tmp_path / "bare")

    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok")]) == 0
    assert "(with its tokenizer)" in capsys.readouterr().out
    loads_as(tmp_path / "out", tok)

    # --config names the model's Hugging Face directory: its tokenizer comes with it.
    model.config.save_pretrained(tmp_path / "tok")
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "cfg"), "--config", str(tmp_path / "tok")]) == 0
    loads_as(tmp_path / "cfg", tok)


@pytest.mark.timeout(120)
def test_generate_names_a_missing_tokenizer_in_one_line(tok, tmp_path, capsys):
    import generate

    model = tiny(tok)
    fk.export_hf(model, tmp_path / "bare", tokenizer=False)
    with pytest.raises(SystemExit) as exit:
        generate.main([str(tmp_path / "bare"), TEXT])
    message = str(exit.value.code)
    assert message == (
        f"error: {tmp_path / 'bare'} has no tokenizer: export it with one (fsdp2kit export-hf ... --tokenizer DIR, "
        "or fsdp2kit.export_hf(..., tokenizer=...)) or copy a tokenizer's files there"
    )
    # With the tokenizer beside the weights, the same directory answers.
    fk.export_hf(model, tmp_path / "full", tokenizer=tok)
    generate.main([str(tmp_path / "full"), TEXT, "--max-new-tokens", "2"])
    assert f"user:      {TEXT}\nassistant:" in capsys.readouterr().out


def test_recipe_export_dtype(tok, tmp_path):
    """`[export] dtype`: "auto" is the dtype the config says the checkpoint was stored in (bf16 here,
    the model held in fp32 as fp32 masters are), as held without one; a name casts; a typo is refused."""
    from support.export import export_dtype, export_model

    model = tiny(tok)
    model.config.dtype = torch.bfloat16  # as from_pretrained of a bf16 checkpoint leaves it
    assert next(model.parameters()).dtype == torch.float32
    assert export_dtype("auto", model) == torch.bfloat16 and export_dtype("fp32", model) == torch.float32
    assert export_dtype("auto", model, adapters=True) is None and export_dtype("auto", torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="export.dtype='float32'; one of auto, fp32, bf16, fp16"):
        export_dtype("float32", model)
    export_model(model, tok, tmp_path / "auto", is_main=True)  # the recipe's default: "auto"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "auto", local_files_only=True, dtype="auto")
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}


def test_the_librarys_from_pretrained_leaves_device_contexts_whole(tok, tmp_path):
    """transformers' from_pretrained, when it is the first to use a torch.device(...) context in the
    process, leaves torch.linspace outside every later one (see fsdp2kit/_internal/hf_load.py); the
    library's own calls of it must not."""
    import torch.utils._device as device_contexts

    from fsdp2kit._internal.hf_load import from_pretrained

    tiny(tok).save_pretrained(tmp_path)
    device_contexts._device_constructors.cache_clear()  # as in a process that has used no device context yet
    try:
        from_pretrained(AutoModelForCausalLM, tmp_path, local_files_only=True)
        with torch.device("meta"):
            assert torch.linspace(0, 1, 3).is_meta
    finally:
        device_contexts._device_constructors.cache_clear()
        with torch.device("meta"):  # refilled here, as tests/conftest.py does, not by whichever test comes next
            torch.empty(0)
