"""Fine-tuning data: each format's labels against masks worked out by hand, packing without leaks,
clear errors naming file and line, the cache, resuming mid-epoch, and eval sharding."""

from __future__ import annotations

import json

import pytest
import torch

from support.demo_data import demo_chat, write_demo_chat
from support.evaluate import eval_batches, eval_shard, evaluate
from support.formats import IGNORE, FormatSpec, encode_record
from support.loader import ResumableLoader, to_batch
from support.loss import answer_loss_sum
from support.rows import DataError, load_rows, pack_examples, prepare_data
from support.tokenizer import CHAT_TEMPLATE, train_demo_tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


@pytest.fixture
def tok_plain(tok):
    """The same tokenizer with a template that has no {% generation %} markers (like most released ones)."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return t


def hand_chat_mask(tokens: list[str]) -> list[bool]:
    """By hand: a token is an answer from the one after '<|assistant|>', '\\n' up to and including '<|end|>'."""
    mask, inside = [], False
    for i, t in enumerate(tokens):
        if inside:
            mask.append(True)
            inside = t != "<|end|>"
        else:
            mask.append(False)
            inside = i >= 1 and tokens[i - 1] == "<|assistant|>" and t == "\n"
    return mask


CHAT = {
    "messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Where does the cat sleep?"},
        {"role": "assistant", "content": "The cat sleeps under the bridge."},
        {"role": "user", "content": "What colour is the fox?"},
        {"role": "assistant", "content": "The fox is orange."},
    ]
}


@pytest.mark.parametrize("which", ["markers", "plain"])
def test_chat_labels_are_the_assistant_turns(tok, tok_plain, which):
    t = tok if which == "markers" else tok_plain
    ids, labels, err = encode_record(t, CHAT, FormatSpec("chat"))
    assert err == ""
    assert t.decode(ids) == t.apply_chat_template(CHAT["messages"], tokenize=False)
    tokens = [t.decode([i]) for i in ids]
    assert [lab != IGNORE for lab in labels] == hand_chat_mask(tokens)
    assert all(lab in (IGNORE, i) for lab, i in zip(labels, ids))
    answer = t.decode([lab for lab in labels if lab != IGNORE])
    assert answer == "The cat sleeps under the bridge.<|end|>The fox is orange.<|end|>"


def test_completion_and_text_labels(tok):
    spec = FormatSpec("completion", template="Question: {prompt}\nAnswer:")
    ids, labels, err = encode_record(tok, {"prompt": "What is 2 and 3?", "completion": " 5."}, spec)
    assert err == ""
    n_prompt = labels.index(next(lab for lab in labels if lab != IGNORE))
    assert tok.decode(ids[:n_prompt]) == "Question: What is 2 and 3?\nAnswer:"
    assert tok.decode(labels[n_prompt:]) == " 5.<|end|>" and labels[n_prompt:] == ids[n_prompt:]
    assert all(lab == IGNORE for lab in labels[:n_prompt])
    # without a template the prompt field is the prompt; other fields can fill a template
    ids2, labels2, _ = encode_record(tok, {"prompt": "Hi", "completion": " there"}, FormatSpec("completion"))
    assert tok.decode(ids2) == "Hi there<|end|>" and tok.decode([x for x in labels2 if x != IGNORE]) == " there<|end|>"
    spec3 = FormatSpec("completion", template="{instruction} / {input} =")
    ids3, _, err3 = encode_record(tok, {"instruction": "add", "input": "1 1", "completion": " 2"}, spec3)
    assert err3 == "" and tok.decode(ids3) == "add / 1 1 = 2<|end|>"
    _, _, err4 = encode_record(tok, {"instruction": "add", "completion": " 2"}, spec3)
    assert "names field 'input'" in err4
    # text: every token is trained, the document ends with EOS
    ids5, labels5, _ = encode_record(tok, {"text": "The cat sees the red ball."}, FormatSpec("text"))
    assert labels5 == ids5 and ids5[-1] == tok.eos_token_id and tok.decode(ids5[:-1]) == "The cat sees the red ball."


def test_packing_restarts_positions_and_shifts_within_each_example():
    examples = {"ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "labels": [[IGNORE, 2, 3], [4, IGNORE, 6, 7], [8, 9]]}
    packed = pack_examples(examples, seq_len=8, pad_id=0, packing=True)
    assert packed["input_ids"] == [[1, 2, 4, 5, 6, 8, 0, 0]]
    assert packed["labels"] == [[2, 3, IGNORE, 6, 7, 9, IGNORE, IGNORE]]  # 3 never predicts 4
    assert packed["position_ids"] == [[0, 1, 0, 1, 2, 0, 1, 2]]
    padded = pack_examples(examples, seq_len=4, pad_id=0, packing=False)
    assert padded["input_ids"] == [[1, 2, 0, 0], [4, 5, 6, 0], [8, 0, 0, 0]]
    assert padded["position_ids"] == [[0, 1, 2, 3]] * 3
    assert padded["labels"][1] == [IGNORE, 6, 7, IGNORE]


def _tiny_llama(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        attn_implementation=attn,
    )
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_example_in_a_packed_row_has_its_loss_alone(attn):
    model = _tiny_llama(attn)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 14, 6, 3)]
    labels = [[IGNORE if i < len(x) // 3 else t for i, t in enumerate(x)] for x in ids]
    examples = {"ids": ids, "labels": labels}
    packed = to_batch(pack_examples(examples, seq_len=32, pad_id=0, packing=True))
    assert packed["input_ids"].shape == (1, 32)
    # per-example sums from the packed row: mask every other example's labels
    segment = torch.cat([torch.full((len(x) - 1,), k) for k, x in enumerate(ids)] + [torch.full((4,), -1)])
    for k in range(len(ids)):
        only_k = {**packed, "labels": torch.where(segment == k, packed["labels"], IGNORE)}
        alone = to_batch(pack_examples({"ids": [ids[k]], "labels": [labels[k]]}, seq_len=32, pad_id=0, packing=False))
        with torch.no_grad():
            a, b = answer_loss_sum(model, only_k), answer_loss_sum(model, alone)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the whole packed row's sum is the sum of the examples alone, and gradients flow
    padded = to_batch(pack_examples(examples, seq_len=32, pad_id=0, packing=False))
    torch.testing.assert_close(answer_loss_sum(model, packed), answer_loss_sum(model, padded), rtol=1e-5, atol=1e-5)


def _jsonl(path, records, blank_after: int | None = None):
    lines = [json.dumps(r) for r in records]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _prepare(tok, tmp_path, files, fmt="chat", seq_len=64, **kw):
    return prepare_data(
        files=files,
        tokenizer=tok,
        spec=FormatSpec(fmt),
        seq_len=seq_len,
        packing=True,
        cache_dir=tmp_path / "cache",
        num_proc=1,
        **kw,
    )


def test_errors_name_the_file_and_line(tok, tmp_path):
    recs = demo_chat(6)
    bad = [*recs[:3], {"conversation": []}, *recs[3:]]
    f = _jsonl(tmp_path / "bad.jsonl", bad, blank_after=1)  # a blank line: line numbers are the file's
    with pytest.raises(DataError, match=r"bad.jsonl:5: record has no field 'messages' \(fields: conversation\)"):
        _prepare(tok, tmp_path, [f])
    f2 = _jsonl(tmp_path / "other.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"other.jsonl: records have no field 'messages' \(fields: text\)"):
        _prepare(tok, tmp_path, [f2])
    ok = _jsonl(tmp_path / "ok.jsonl", recs)
    with pytest.raises(DataError, match="eval file .*nope.jsonl does not exist"):
        _prepare(tok, tmp_path, [ok], eval_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="data file .*missing.jsonl does not exist"):
        _prepare(tok, tmp_path, [str(tmp_path / "missing.jsonl")])
    no_template = train_demo_tokenizer()
    no_template.chat_template = None
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        _prepare(no_template, tmp_path, [ok])
    users_only = _jsonl(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(DataError, match="training split .*users.jsonl.* has no answer tokens"):
        _prepare(tok, tmp_path, [users_only])
    wrong = _jsonl(tmp_path / "wrong.jsonl", [*recs[:2], {"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"wrong.jsonl:3: record messages\[0\] needs string fields"):
        _prepare(tok, tmp_path, [wrong])


def test_answers_cut_off_by_seq_len_are_counted_and_dropped(tok, tmp_path):
    long_q = {"role": "user", "content": "Where does the cat sleep? " * 12}
    recs = [*demo_chat(5), {"messages": [long_q, {"role": "assistant", "content": "Under the bridge."}]}]
    _, stats = _prepare(tok, tmp_path, [_jsonl(tmp_path / "d.jsonl", recs)], seq_len=40)
    assert stats["train"]["cut_off"] == 1 and stats["train"]["examples"] == 5


def test_cache_is_reused_and_keyed_on_what_rows_depend_on(tok, tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", demo_chat(40))
    path, stats = _prepare(tok, tmp_path, [f], eval_fraction=0.25)
    assert (path / "stats.json").is_file()
    assert _prepare(tok, tmp_path, [f], eval_fraction=0.25)[0] == path  # found, not rebuilt
    assert _prepare(tok, tmp_path, [f], eval_fraction=0.25, seq_len=80)[0] != path
    splits = load_rows(path)
    assert stats["train"]["records"] == 30 and stats["eval"]["records"] == 10
    assert len(splits.train) == stats["train"]["rows"] and len(splits.eval) == stats["eval"]["rows"]
    n_answer = sum(sum(x != IGNORE for x in r) for r in splits.train["labels"])
    assert n_answer == stats["train"]["answer_tokens"]

    # held-out records are not in the training split
    def convs(rows):
        return {tuple(r) for r in rows["input_ids"]}

    assert not convs(splits.train) & convs(splits.eval)


def test_loader_resumes_mid_epoch_and_reshuffles(tmp_path):
    import datasets

    n = 37
    rows = datasets.Dataset.from_dict(
        {"input_ids": [[i, i] for i in range(n)], "labels": [[i, i] for i in range(n)], "position_ids": [[0, 1]] * n}
    )

    def take(loader, k):
        it = iter(loader)
        return [next(it)["input_ids"][:, 0].tolist() for _ in range(k)]

    ranks = [ResumableLoader(rows, 4, rank=r, world_size=2, seed=3) for r in range(2)]
    epoch0 = [[x for b in take(ResumableLoader(rows, 4, rank=r, world_size=2, seed=3), 4) for x in b] for r in range(2)]
    assert not set(epoch0[0]) & set(epoch0[1]) and len(set(epoch0[0] + epoch0[1])) == 32
    full = take(ranks[0], 11)  # crosses two epoch ends (4 batches per epoch)
    assert full[:4] != full[4:8]  # each epoch reshuffled
    first = ResumableLoader(rows, 4, rank=0, world_size=2, seed=3)
    part = take(first, 6)
    state = first.state_dict()
    assert state == {"epoch": 1, "index": 2}
    resumed = ResumableLoader(rows, 4, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(state)
    assert part + take(resumed, 5) == full


@pytest.mark.parametrize("n,world,batch", [(7, 3, 2), (10, 4, 3), (3, 4, 1), (12, 2, 5)])
def test_eval_shards_see_every_row_once(n, world, batch):
    import datasets

    rows = datasets.Dataset.from_dict(
        {"input_ids": [[i] for i in range(n)], "labels": [[i] for i in range(n)], "position_ids": [[0]] * n}
    )
    seen, counts = [], set()
    for r in range(world):
        batches = list(eval_batches(rows, batch, rank=r, world_size=world))
        counts.add(len(batches))
        seen += [int(i) for b in batches for i, lab in zip(b["input_ids"][:, 0], b["labels"][:, 0]) if lab != IGNORE]
        assert list(eval_shard(n, r, world)) == [x for x in range(n) if x % world == r]
    assert sorted(seen) == list(range(n))  # exactly once each
    assert len(counts) == 1  # the same number of forward passes on every rank


def test_evaluate_is_the_token_mean_over_the_split():
    model = _tiny_llama("sdpa")
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 14, 6, 11, 5)]
    import datasets

    rows = datasets.Dataset.from_dict(pack_examples({"ids": ids, "labels": ids}, seq_len=16, pad_id=0, packing=True))
    out = evaluate(model, rows, 2, rank=0, world_size=1, device="cpu")
    batch = to_batch(rows[:])
    with torch.no_grad():
        ref = answer_loss_sum(model, batch) / (batch["labels"] != IGNORE).sum()
    assert out["eval_tokens"] == sum(len(x) - 1 for x in ids)
    assert out["eval_loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert model.training  # put back as it was


def test_demo_tokenizer_and_chat_file(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path / "tk")
    again = AutoTokenizer.from_pretrained(tmp_path / "tk", local_files_only=True)
    msgs = CHAT["messages"]
    assert again.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert again("The fox is orange.")["input_ids"] == tok("The fox is orange.")["input_ids"]
    assert train_demo_tokenizer().get_vocab() == tok.get_vocab()  # deterministic
    write_demo_chat(tmp_path / "chat.jsonl")
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "recipes" / "data" / "demo_chat.jsonl"
    assert shipped.read_text() == (tmp_path / "chat.jsonl").read_text(), "regenerate: make demo-data"


def test_records_without_answers_are_counted_and_settings_checked(tok, tmp_path):
    from types import SimpleNamespace

    from support.data import check_vocab, setup_data

    users_only = {"messages": [{"role": "user", "content": "hi"}]}
    _, stats = _prepare(tok, tmp_path, [_jsonl(tmp_path / "d.jsonl", [*demo_chat(4), users_only])])
    assert stats["train"]["no_answer"] == 1 and stats["train"]["examples"] == 4
    no_split = SimpleNamespace(every=5, files="", fraction=0.0)
    with pytest.raises(DataError, match="every is set but there is no held-out split"):
        setup_data(SimpleNamespace(), no_split, tok, seed=0, rank=0, local_rank=0, world_size=1)
    with pytest.raises(DataError, match=r"has \d+ tokens but the model's vocabulary has 256"):
        check_vocab(tok, SimpleNamespace(config=SimpleNamespace(vocab_size=256)))


def test_a_template_that_rewrites_earlier_turns_is_refused(tok_plain):
    # e.g. templates that drop earlier assistant turns' reasoning: the prefix rendering no longer matches
    tok_plain.chat_template = "{% for m in messages %}{{ m['content'] if loop.last else '' }}{% endfor %}"
    _, _, err = encode_record(tok_plain, CHAT, FormatSpec("chat"))
    assert "add {% generation %} markers" in err


def test_export_loads_in_transformers_with_its_tokenizer(tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from support.export import export_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tok)
    )
    model = AutoModelForCausalLM.from_config(cfg)
    export_model(model, tok, tmp_path / "hf", is_main=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    again = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompt = again.apply_chat_template(CHAT["messages"][:2], add_generation_prompt=True, return_dict=True)
    x = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)
    assert loaded.config.eos_token_id == again.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
    assert loaded.generation_config.eos_token_id == again.eos_token_id  # generate() stops at the end of a turn
