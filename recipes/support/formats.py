"""Turn one data record into token ids and labels for each `[data] format`: text, chat, completion.

A label is the token id where the loss is taken (the answer) and -100 everywhere else. Labels are
aligned with the ids, as in Hugging Face (``labels[i]`` belongs to ``ids[i]``); the packer shifts
them. Problems are returned as strings, not raised, so that `datasets.map` workers in other
processes report them and the caller can name the file and line.
"""

from __future__ import annotations

from typing import Any

IGNORE = -100  # the label of every token that is not an answer (torch's cross_entropy default ignore_index)
FORMATS = ("text", "chat", "completion")

__all__ = ["FORMATS", "IGNORE", "FormatSpec", "encode_record", "has_generation_markers"]


class FormatSpec:
    """How records are read: the format and the names of the fields it uses (plain values, picklable)."""

    def __init__(
        self,
        format: str,
        *,
        text_field: str = "text",
        messages_field: str = "messages",
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        template: str = "",
    ):
        if format not in FORMATS:
            raise ValueError(f"[data] format {format!r} is not one of {', '.join(FORMATS)}")
        self.format, self.text_field, self.messages_field = format, text_field, messages_field
        self.prompt_field, self.completion_field, self.template = prompt_field, completion_field, template

    def fields(self) -> list[str]:
        """The record fields this format needs."""
        if self.format == "text":
            return [self.text_field]
        if self.format == "chat":
            return [self.messages_field]
        return [self.completion_field, *([] if self.template else [self.prompt_field])]

    def key(self) -> dict[str, str]:
        return dict(vars(self))


def has_generation_markers(tokenizer) -> bool:
    """Whether the chat template marks assistant text with {% generation %} (then transformers finds it)."""
    return "{% generation %}" in (tokenizer.chat_template or "").replace("{%-", "{%").replace("-%}", "%}")


def _text(tokenizer, record: dict, spec: FormatSpec) -> tuple[list[int], list[int]]:
    text = record[spec.text_field]
    if not isinstance(text, str):
        raise _Bad(f"field {spec.text_field!r} is not a string: {type(text).__name__}")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)  # documents end with EOS, so the model learns where one ends
    return ids, list(ids)


def _completion(tokenizer, record: dict, spec: FormatSpec) -> tuple[list[int], list[int]]:
    completion = record[spec.completion_field]
    if spec.template:
        try:
            prompt = spec.template.format(**record)
        except KeyError as e:
            raise _Bad(f"the template names field {e.args[0]!r}, which the record lacks") from None
    else:
        prompt = record[spec.prompt_field]
    for name, value in ((spec.prompt_field, prompt), (spec.completion_field, completion)):
        if not isinstance(value, str):
            raise _Bad(f"field {name!r} is not a string: {type(value).__name__}")
    # Tokenized apart, so the boundary is exact; BOS (if the tokenizer adds one) goes on the prompt.
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if prompt_ids and prompt_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id != tokenizer.bos_token_id:
        prompt_ids = prompt_ids[:-1]  # tokenizers that append EOS to every text: the prompt must not end there
    answer = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer.append(tokenizer.eos_token_id)  # the model learns to stop
    return prompt_ids + answer, [IGNORE] * len(prompt_ids) + answer


def _render(tokenizer, messages: list, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def _chat(tokenizer, record: dict, spec: FormatSpec) -> tuple[list[int], list[int]]:
    messages = record[spec.messages_field]
    if not isinstance(messages, list) or not messages:
        raise _Bad(f"field {spec.messages_field!r} is not a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad(f"{spec.messages_field}[{i}] needs string fields 'role' and 'content', got {m!r}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), out["assistant_masks"]
        return ids, [t if a else IGNORE for t, a in zip(ids, mask)]
    # No markers (most released templates): each assistant turn is the text that rendering the
    # conversation up to it adds after rendering the conversation before it with the generation
    # prompt. That holds when the template renders a prefix of the conversation as a prefix of the
    # whole, which is checked (templates that rewrite earlier turns fail it and need markers).
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise _Bad(
                f"the chat template does not render messages[:{i + 1}] as a prefix of the whole conversation, so "
                "the assistant turns cannot be located: add {% generation %} markers around them in the template"
            )
        # The turn's text, less the whitespace the template puts after it (as {% generation %} would end)
        spans.append((len(before), len(upto.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [
        t if any(s <= start < e for s, e in spans) and end > start else IGNORE
        for t, (start, end) in zip(ids, enc["offset_mapping"])
    ]
    return ids, labels


class _Bad(Exception):
    pass


_ENCODERS = {"text": _text, "chat": _chat, "completion": _completion}


def encode_record(tokenizer, record: dict[str, Any], spec: FormatSpec) -> tuple[list[int], list[int], str]:
    """(ids, labels, error): the record's tokens and labels, or empty lists and what is wrong with it."""
    for name in spec.fields():
        if record.get(name) is None:
            present = sorted(k for k, v in record.items() if v is not None)
            return [], [], f"has no field {name!r} (fields: {', '.join(present) or 'none'})"
    try:
        ids, labels = _ENCODERS[spec.format](tokenizer, record, spec)
    except _Bad as e:
        return [], [], str(e)
    return ids, labels, ""
