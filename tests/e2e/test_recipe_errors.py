"""Every class of user mistake, launched as a user launches it (`fsdp2kit launch`, 2 processes): one block from
rank 0, a non-zero exit, no Python traceback, and the launcher's one line naming the failed rank, nothing more
(issue 27). Under plain torchrun (one case) the block is followed by torchrun's own summary of one failed worker.
The exact text and the exact number of lines the user sees are checked.

Most of these mistakes are found before any process group starts, so a launch is a few seconds; the rarer
variants of a class already covered are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "recipes" / "train.py")
DEMO = str(ROOT / "recipes" / "configs" / "demo.toml")
# Before each case's own arguments, which override them; should a mistake go unnoticed, the run is one short step.
QUICK = [
    "--log.progress",
    "false",
    "--log.jsonl",
    "",
    "--export.hf_dir",
    "",
    "--data.seq_len",
    "32",
    "--train.steps",
    "1",
]
# What torchrun (torch 2.13) prints when one worker exits 1 and the others 0: its "failed (exitcode: 1)" log
# line, the traceback of its own ChildFailedError (19 lines) and the failure table (14 lines). Every worker
# failing instead, or one still alive when rank 0 exits, adds a table entry per rank and a SIGTERM line.
TORCHRUN_SUMMARY = 34
# What `fsdp2kit launch` prints instead.
LAUNCHED = "fsdp2kit launch: rank 0 exited with status 1"
FSDP2KIT = str(Path(sys.executable).with_name("fsdp2kit"))  # the installed command, as a user runs it


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    tmp = tmp_path_factory.mktemp("mistakes")
    LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1024, max_position_embeddings=256,
    ).save_pretrained(tmp / "pos256")  # fmt: skip
    (tmp / "badmodel").mkdir()
    (tmp / "badmodel" / "config.json").write_text("{not json")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({"conversation": []}) + "\n")
    (tmp / "data.csv").write_text("a,b\n")
    (tmp / "format.toml").write_text('[data]\nformat = "chats"\n')
    (tmp / "precision.toml").write_text('[parallel]\nmixed_precision = "bfloat16"\n')
    (tmp / "typo.toml").write_text("[train]\nstpes = 2\n")
    return tmp


def launch(
    args: list[str], cwd: Path, *, launcher: str = "torchrun", debug: bool = False
) -> subprocess.CompletedProcess:
    """``launcher``: "torchrun", "fsdp2kit" (fsdp2kit launch) or "" (one process, no launcher)."""
    launcher = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
        "fsdp2kit": [FSDP2KIT, "launch", "--nproc_per_node", "2"],
        "": [sys.executable],
    }[launcher]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FSDP2KIT_DEBUG", None)
    if debug:
        env["FSDP2KIT_DEBUG"] = "1"
    return subprocess.run([*launcher, TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


PRECISIONS = "expected one of fp32, bf16, fp16, pure_bf16; did you mean bf16?"
FORMATS = "expected one of text, chat, completion; did you mean chat?"
# (case, command-line arguments after --config demo.toml, the block); {w} is the work directory
CASES = [
    ("typo", ["--train.stpes", "2"], "config error: unknown option --train.stpes; did you mean --train.steps?"),
    (
        "enum-cli",
        ["--parallel.mixed_precision", "bfloat16"],
        f"config error: parallel.mixed_precision = 'bfloat16' (from the command line): {PRECISIONS}",
    ),
    (
        "data-bad-record",
        ["--data.files", "{w}/bad.jsonl", "--data.format", "chat"],
        "data error: {w}/bad.jsonl:2: record has no field 'messages' (fields: conversation)",
    ),
    (
        "lora-targets",
        ["--lora.r", "8", "--lora.targets", "q_proj,qproj"],
        "config error: lora.targets = 'q_proj,qproj': LoRA targets ['qproj'] match no nn.Linear of LlamaForCausalLM; "
        "its Linear layers are named ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', "
        "'v_proj'] (targets match a module name or its last parts, e.g. 'q_proj' or 'self_attn.q_proj')",
    ),
    (
        "lora-replicate-without-r",
        ["--lora.replicate_adapters", "true"],
        "config error: lora.replicate_adapters = true replicates LoRA adapters: set lora.r (> 0) too",
    ),
    (
        "mesh",
        ["--parallel.shard", "3"],
        "config error: [parallel] shard=3, replicate=1 does not fit the world size 2; sizes that work: "
        "(shard=2, replicate=1), (shard=1, replicate=2), (shard=1, replicate=1, tp=2)",
    ),
]
# Rarer variants of the classes above: make test-all. Each message keeps a default-tier test elsewhere (named).
SLOW_CASES = [
    # an abbreviated option: tests/unit/test_config_data.py (--a.step); launched: the typo case, torchrun
    ("abbreviation", ["--train.step", "2"], "config error: unknown option --train.step; did you mean --train.steps?"),
    # a TOML file's value named with its file: tests/unit/test_config_data.py (b.mode from the file)
    (
        "enum-toml",
        ["--config", "{w}/format.toml"],
        f"config error: data.format = 'chats' (from {{w}}/format.toml): {FORMATS}",
    ),
    # tests/unit/test_finetune_data.py (data file ... does not exist), rendered: tests/unit/test_usage_errors.py
    ("data-missing", ["--data.files", "{w}/nope.jsonl"], "data error: data file {w}/nope.jsonl does not exist"),
    # the same recipe and block, exact stderr: tests/e2e/test_recipe_plans.py (one process)
    (
        "seq-len-over-positions",
        ["--model.name", "{w}/pos256", "--data.seq_len", "512"],
        "config error: data.seq_len 512 exceeds the model's max_position_embeddings 256 ({w}/pos256): lower "
        "--data.seq_len, or raise the limit explicitly with --model.max_position_embeddings 512",
    ),
    (
        "enum-cli-format",
        ["--data.format", "chats"],
        f"config error: data.format = 'chats' (from the command line): {FORMATS}",
    ),
    (
        "enum-toml-precision",
        ["--config", "{w}/precision.toml"],
        f"config error: parallel.mixed_precision = 'bfloat16' (from {{w}}/precision.toml): {PRECISIONS}",
    ),
    (
        "typo-toml",
        ["--config", "{w}/typo.toml"],
        "config error: {w}/typo.toml: unknown key train.stpes; did you mean train.steps?",
    ),
    (
        "not-an-int",
        ["--train.steps", "many"],
        "config error: train.steps = 'many' (from the command line): not a valid int",
    ),
    (
        "data-type",
        ["--data.files", "{w}/data.csv"],
        "data error: data file {w}/data.csv: unknown type '.csv'; use one of .arrow, .json, .jsonl, .md, .parquet, "
        ".txt",
    ),
    (
        "tokenizer-missing",
        ["--data.tokenizer", "{w}/notok"],
        "data error: data.tokenizer = '{w}/notok': no such directory (a local Hugging Face tokenizer)",
    ),
    (
        "model-config",
        ["--model.name", "{w}/badmodel"],
        "model error: model.name = '{w}/badmodel': It looks like the config file at '{w}/badmodel/config.json' is "
        "not a valid JSON file.",
    ),
]


def _params(cases, *marks):
    return [pytest.param(args, block, id=name, marks=marks) for name, args, block in cases]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, block", _params(CASES[1:]) + _params(CASES[:1] + SLOW_CASES, pytest.mark.slow)
)  # fmt: skip
def test_a_mistake_is_one_block_from_rank_0(work, args, block):
    proc = launch_mistake(work, args, "fsdp2kit")
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout[-3000:]  # nothing on stdout, from any rank
    assert proc.stderr.splitlines() == [block.format(w=work), LAUNCHED], proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_under_torchrun_the_block_comes_before_its_summary(work):
    """Plain torchrun (make test's one launch of CASES[0]): the same block, then torchrun's summary naming rank 0 as
    the one failure (its ChildFailedError traceback and table, which a worker cannot suppress), nothing of ours."""
    _, args, block = CASES[0]
    proc = launch_mistake(work, args, "torchrun")
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 1 and proc.stdout == "", "\n".join(lines[-60:])
    assert lines[0] == block.format(w=work), "\n".join(lines[:40])
    assert proc.stderr.count(lines[0]) == 1 and "[rank" not in proc.stderr and TRAIN not in lines[1]
    assert "failed (exitcode: 1) local_rank: 0" in lines[1] and "<NO_OTHER_FAILURES>" in proc.stderr
    assert len(lines) == 1 + TORCHRUN_SUMMARY, "\n".join(lines)


def launch_mistake(work: Path, args: list[str], launcher: str) -> subprocess.CompletedProcess:
    args = [a.format(w=work) for a in args]
    # the case's own --config FILE (a whole config), or the demo's; then QUICK, then the case's arguments
    config, args = (args[:2], args[2:]) if args[0] == "--config" else (["--config", DEMO], args)
    args = [*config, *QUICK, "--data.cache_dir", str(work / "cache"), "--checkpoint.dir", str(work / "ckpt"), *args]
    return launch(args, work, launcher=launcher)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("debug", ["--debug", "FSDP2KIT_DEBUG=1"])
def test_debug_shows_the_traceback(work, debug):
    """The switch for the cases where the block is not enough: the mistake as a Python exception, traceback and all
    (one process: the switch is the same under torchrun)."""
    args = ["--config", DEMO, *QUICK, "--data.format", "chats"] + (["--debug"] if debug == "--debug" else [])
    proc = launch(args, work, launcher="", debug=debug != "--debug")
    assert proc.returncode == 1 and proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr[-3000:]
    assert proc.stderr.endswith(
        f"support.errors.ConfigError: data.format = 'chats' (from the command line): {FORMATS}\n"
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_model_directory_without_weights_is_one_block(work):
    """Found after the process group starts (every rank alike): the start-up lines on stdout, then the one block."""
    model = work / "pos256"  # a config.json and no weights
    args = ["--config", DEMO, *QUICK, "--data.cache_dir", str(work / "cache"), "--checkpoint.dir", str(work / "ckpt")]
    proc = launch([*args, "--model.pretrained", "true", "--model.name", str(model)], work)
    errors = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert errors[0] == (
        f"model error: model.name = '{model}': load_pretrained: no model.safetensors, model.safetensors.index.json "
        f"or *.safetensors in {model} (found ['config.json']); .bin / .pt checkpoints are not read (they unpickle "
        "code): convert them first"
    ), proc.stderr[-3000:]
    assert "[rank" not in proc.stderr and len(errors) == 1 + TORCHRUN_SUMMARY, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_corrupt_checkpoint_is_one_block_naming_the_file(work, tmp_path):
    args = ["--config", DEMO, *QUICK, "--data.cache_dir", str(work / "cache"), "--checkpoint.dir", str(tmp_path)]
    assert launch(args, work).returncode == 0  # one step, saved at the end
    (data,) = (tmp_path / "step_00000001").glob("__0_*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte inside a record
    data.write_bytes(bytes(raw))
    proc = launch([*args, "--train.steps", "2"], work)
    errors = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert errors[:3] == [
        f"checkpoint error: cannot load {tmp_path / 'step_00000001'}:",
        errors[1],
        f"Move that step out of {tmp_path} to resume from an older one, or start afresh with --checkpoint.resume false",
    ], errors[:3]
    assert errors[1].startswith(f"  [rank 0] data file {data} is corrupt: the record at bytes "), errors[1]
    assert "fails its CRC-32 check" in errors[1], errors[1]
    assert "[rank" not in "".join(errors[3:]) and len(errors) == 3 + TORCHRUN_SUMMARY, proc.stderr
