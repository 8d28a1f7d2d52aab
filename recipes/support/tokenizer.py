"""A small local tokenizer for the demo and the tests: byte-level BPE trained here, with a chat template.

Nothing is downloaded: the BPE is trained with the `tokenizers` library on the embedded demo text
and chat data in a second, and wrapped as a transformers ``PreTrainedTokenizerFast`` that saves,
loads with ``AutoTokenizer`` and renders chats with ``apply_chat_template``.

    python recipes/support/tokenizer.py OUT_DIR      # writes the demo tokenizer
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "load_tokenizer", "train_demo_tokenizer"]

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# Each turn is <|role|>\n content <|end|>\n. The {% generation %} markers tell transformers which
# characters are the assistant's (return_assistant_tokens_mask); <|end|> is inside them, so the model
# learns to end its turn, and it is the EOS that stops generate(). Newlines are written as {{ '\n' }}
# because transformers renders with trim_blocks, which would eat a newline after a block tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _demo_texts() -> Iterable[str]:
    from support.demo_data import demo_chat, demo_corpus

    yield from demo_corpus()
    for record in demo_chat():
        for m in record["messages"]:
            yield m["content"]


def train_demo_tokenizer(
    out_dir: str | Path | None = None, *, vocab_size: int = 1024, texts: Iterable[str] | None = None
):
    """Train a byte-level BPE on ``texts`` (default: the demo corpus and demo chats) and return it
    as a ``PreTrainedTokenizerFast`` (saved to ``out_dir`` when given). Deterministic: the same texts
    give the same tokenizer, on every rank and every launch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no text is ever unknown
        show_progress=False,
    )
    bpe.train_from_iterator(texts if texts is not None else _demo_texts(), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE
    )
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def load_tokenizer(path: str | Path):
    """A local tokenizer directory (never the hub), with a clear error when it is not one."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {p} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{p} does not hold a tokenizer that transformers can load: {e}") from None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if len(sys.argv) != 2:
        sys.exit("usage: python recipes/support/tokenizer.py OUT_DIR")
    tok = train_demo_tokenizer(sys.argv[1])
    print(f"demo tokenizer ({len(tok)} tokens) written to {sys.argv[1]}")
