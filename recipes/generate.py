"""Load an exported model with plain transformers and answer one question (the last step of `make demo`).

    python recipes/generate.py outputs/demo/chat "Where does the cat sleep?"

Nothing from fsdp2kit is used here on purpose: it shows the export is an ordinary Hugging Face
model directory. With a chat template the question is a user turn; without, it is the prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    # Checked before loading: on a directory without a tokenizer, AutoTokenizer fails with an error
    # that names something else (a missing sentencepiece backend; or it builds an empty tokenizer
    # whose prompt of 0 tokens fails in generate: issue 27). The files fsdp2kit.weights.export checks.
    if not Path(args.model_dir).is_dir():
        sys.exit(f"error: {args.model_dir} is not a directory")
    if not any(
        (Path(args.model_dir) / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
    ):
        sys.exit(
            f"error: {args.model_dir} has no tokenizer: export it with one (fsdp2kit export-hf ... --tokenizer DIR, "
            "or fsdp2kit.export_hf(..., tokenizer=...)) or copy a tokenizer's files there"
        )

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # no "Loading weights" bar in the demo's output

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True).eval()
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
    else:
        ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"user:      {args.prompt}\nassistant: {answer.strip()}")


if __name__ == "__main__":
    from fsdp2kit._internal.quiet import quiet_imports

    with quiet_imports():  # torchao's import-time lines on a CPU build: this script owns the process
        sys.exit(main())
