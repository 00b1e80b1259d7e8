"""mars.core.train.data: JSONL shapes, labels, block padding, length limits, batching."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny import make_tokenizer

from mars.core.train.data import (
    IGNORE,
    DataError,
    Example,
    batches,
    encode_record,
    find_split_file,
    load_split,
    pad_to_block,
    read_jsonl,
)

B = 4


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def write(path, *records):
    """Write records (dicts, or raw strings for malformed lines) one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def load(tok, path, **kw):
    kw.setdefault("block_size", B)
    kw.setdefault("max_seq_length", 512)
    return load_split(path, "train", tok, **kw)


def text_of(tok, ids):
    return tok.decode([int(i) for i in ids])


# --- shapes and labels ---------------------------------------------------------------


def check_chat_example(tok, ex, response):
    eos = tok.eos_token_id
    ids, labels = ex.ids, ex.labels
    assert ids.dtype == labels.dtype == np.int64
    assert len(ids) % B == 0 and len(ids) == len(labels)
    labelled = labels != IGNORE
    first = int(np.argmax(labelled))
    assert not labelled[:first].any()  # prompt: no loss
    assert labelled[first:].all()  # response, its EOS and the padding after it
    n_resp = len(tok(response)["input_ids"]) + 1
    end = first + n_resp
    assert (labels[first:end] == ids[first:end]).all()
    assert text_of(tok, ids[first:end]) == response + tok.eos_token
    assert (ids[end:] == eos).all() and (labels[end:] == eos).all()
    assert len(ids) - end < B  # minimal padding
    # the prompt ends with the generation prompt, so the model learns to answer after it
    assert text_of(tok, ids[:first]).endswith("<|im_start|>assistant\n")


def test_prompt_completion(tok, tmp_path):
    data = load(tok, write(tmp_path / "train.jsonl", {"prompt": "hi", "completion": "hello!"}))
    (ex,) = data.examples
    assert data.skipped == 0 and not ex.truncated
    assert ex.source.endswith("train.jsonl:1")
    check_chat_example(tok, ex, "hello!")
    assert "<|im_start|>user\nhi<|im_end|>" in text_of(tok, ex.ids)


def test_messages_multi_turn_labels_only_last_assistant(tok, tmp_path):
    rec = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "second"},
        ]
    }
    (ex,) = load(tok, write(tmp_path / "train.jsonl", rec)).examples
    check_chat_example(tok, ex, "second")
    labelled_text = text_of(tok, ex.ids[ex.labels != IGNORE])
    assert "first answer" not in labelled_text
    assert "first answer" in text_of(tok, ex.ids)


def test_text_shape_labels_all_but_position_zero(tok, tmp_path):
    (ex,) = load(tok, write(tmp_path / "train.jsonl", {"text": "abcdef"})).examples
    eos = tok.eos_token_id
    n = len("abcdef") + 1  # char-level tokenizer, plus EOS
    assert len(ex.ids) == 8
    assert text_of(tok, ex.ids[:n]) == "abcdef" + tok.eos_token
    assert ex.labels[0] == IGNORE
    assert (ex.labels[1:n] == ex.ids[1:n]).all()
    assert (ex.ids[n:] == eos).all() and (ex.labels[n:] == eos).all()


def test_encode_record_unpadded(tok):
    eos = tok.eos_token_id
    ids, labels = encode_record({"prompt": "q", "completion": "ans"}, tok, eos_id=eos)
    assert len(ids) == len(labels)
    k = labels.index(next(x for x in labels if x != IGNORE))
    assert ids[-1] == eos and labels[k:] == ids[k:]
    assert text_of(tok, ids[k:]) == "ans" + tok.eos_token  # template's trailing newline dropped


def test_explicit_eos_id(tok, tmp_path):
    other = tok.convert_tokens_to_ids("<unused1>")
    (ex,) = load(tok, write(tmp_path / "train.jsonl", {"text": "ab"}), eos_id=other).examples
    assert list(ex.ids[2:]) == [other, other] and list(ex.labels[2:]) == [other, other]


def test_pad_to_block():
    ids, labels = pad_to_block([5, 6, 7, 8, 9], [IGNORE, IGNORE, 7, 8, 9], 4, 2, ended=True)
    assert ids.tolist() == [5, 6, 7, 8, 9, 2, 2, 2]
    assert labels.tolist() == [IGNORE, IGNORE, 7, 8, 9, 2, 2, 2]
    _, labels = pad_to_block([5, 6, 7, 8, 9], [IGNORE, IGNORE, 7, 8, 9], 4, 2, ended=False)
    assert labels.tolist() == [IGNORE, IGNORE, 7, 8, 9, IGNORE, IGNORE, IGNORE]
    ids, labels = pad_to_block([1, 2, 3, 4], [IGNORE, 2, 3, 4], 4, 2, ended=True)
    assert ids.tolist() == [1, 2, 3, 4] and ids.dtype == np.int64


def test_blank_lines_are_skipped_and_line_numbers_kept(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", "", {"text": "a b"}, "   ", {"text": "c"})
    assert [n for n, _ in read_jsonl(path)] == [2, 4]
    data = load(tok, path)
    assert [e.source.rsplit(":", 1)[1] for e in data.examples] == ["2", "4"]


# --- bad data: DataError naming file and line --------------------------------------------

GOOD = {"text": "fine"}
BAD = [
    ('{"text": "unterminated', "malformed JSON"),
    ({"text": "x", "foo": 1}, "unknown field 'foo'; expected 'text'"),
    ({"prompt": "q", "completion": "x", "extra": 1}, "unknown field 'extra'"),
    ({"prompt": "q", "completion": "   "}, "empty 'completion'"),
    ({"text": ""}, "empty 'text'"),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n"}]},
        "empty final assistant",
    ),
    ({"prompt": "q", "completion": 3}, "must be a string, got number"),
    ({"text": ["a"]}, "must be a string, got array"),
    ({"messages": "hi"}, "must be a non-empty array"),
    ({"messages": []}, "must be a non-empty array"),
    ({"messages": [{"role": "user", "content": "q"}]}, "not 'assistant'"),
    ({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}, "has no 'role'"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "has no 'content'"),
    ({"prompt": "q"}, "missing field 'completion'"),
    ({"completion": "a"}, "no 'messages', 'prompt' or 'text' field"),
    ("[1, 2]", "expected a JSON object, got array"),
]


@pytest.mark.parametrize("bad,message", BAD)
def test_bad_line_names_file_and_line(tok, tmp_path, bad, message):
    path = write(tmp_path / "train.jsonl", GOOD, "", bad, GOOD)
    with pytest.raises(DataError) as e:
        load(tok, path)
    text = str(e.value)
    assert "train.jsonl:3: " in text
    assert message in text
    assert "\n" not in text and "(" in text  # one line, with a hint


def test_shape_errors_come_before_any_encoding(tok, tmp_path):
    # an over-long line 1 and a malformed line 2: validation of the whole file comes first
    path = write(tmp_path / "train.jsonl", {"text": "x" * 100}, "{oops")
    with pytest.raises(DataError, match=r"train.jsonl:2: malformed JSON"):
        load(tok, path, max_seq_length=16)


def test_over_long_is_an_error_by_default(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", GOOD, {"text": "x" * 39})  # 40 tokens with EOS
    with pytest.raises(DataError) as e:
        load(tok, path, max_seq_length=16)
    msg = str(e.value)
    assert "train.jsonl:2: 40 tokens exceed max_seq_length=16" in msg
    assert "on_long=truncate|skip" in msg  # the CLI turns settings into flags (test_cli)


def test_limit_counts_block_padding(tok, tmp_path):
    # 8 tokens pad to 8; a limit of 10 rounds down to 8 whole blocks: fits.
    path = write(tmp_path / "train.jsonl", {"text": "abcdefg"})
    assert len(load(tok, path, max_seq_length=10).examples[0].ids) == 8
    # 9 tokens pad to 12 > 8
    path = write(tmp_path / "train.jsonl", {"text": "abcdefgh"})
    with pytest.raises(DataError, match="9 tokens \\(12 padded"):
        load(tok, path, max_seq_length=10)


def test_truncate(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", {"prompt": "q", "completion": "y" * 50}, {"text": "short"})
    data = load(tok, path, max_seq_length=30, on_long="truncate")
    long, short = data.examples
    assert long.truncated and not short.truncated
    assert data.truncated == 1 and data.skipped == 0
    assert len(long.ids) == 28  # 30 rounded down to whole blocks of 4
    assert tok.eos_token_id not in long.labels.tolist()  # cut: never taught to stop here
    assert (long.labels[long.labels != IGNORE] == long.ids[long.labels != IGNORE]).all()


def test_truncate_text_shape(tok, tmp_path):
    # the cut lands on a block boundary (the limit is whole blocks), so no padding is added
    path = write(tmp_path / "train.jsonl", {"text": "z" * 30})
    (ex,) = load(tok, path, max_seq_length=16, on_long="truncate").examples
    assert ex.truncated and len(ex.ids) == 16
    assert ex.labels[0] == IGNORE and (ex.labels[1:] == ex.ids[1:]).all()


def test_truncate_prompt_too_long(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", GOOD, {"prompt": "p" * 60, "completion": "a"})
    with pytest.raises(DataError, match=r"train.jsonl:2: the prompt alone fills"):
        load(tok, path, max_seq_length=32, on_long="truncate")


def test_skip(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", GOOD, {"text": "x" * 40}, {"text": "ok"})
    data = load(tok, path, max_seq_length=16, on_long="skip")
    assert data.skipped == 1
    assert [e.source.rsplit(":", 1)[1] for e in data.examples] == ["1", "3"]
    path = write(tmp_path / "train.jsonl", {"text": "x" * 40})
    with pytest.raises(DataError, match="skipped"):
        load(tok, path, max_seq_length=16, on_long="skip")


def test_bad_options(tok, tmp_path):
    path = write(tmp_path / "train.jsonl", GOOD)
    with pytest.raises(ValueError, match="on_long"):
        load(tok, path, on_long="drop")
    with pytest.raises(ValueError, match="shorter than one block"):
        load(tok, path, max_seq_length=3)


def test_no_chat_template(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = None
    path = write(tmp_path / "train.jsonl", {"prompt": "q", "completion": "a"})
    with pytest.raises(DataError, match=r"train.jsonl:1: .*no chat template.*\"text\""):
        load(tok, path)
    assert load(tok, write(tmp_path / "train.jsonl", {"text": "still fine"})).examples


def test_template_that_does_not_extend_prompt(tmp_path):
    tok = make_tokenizer()
    # the generation prompt says "bot", the conversation says "assistant"
    tok.chat_template = tok.chat_template.replace("'<|im_start|>assistant\n'", "'<|im_start|>bot\n'")
    assert "bot" in tok.chat_template
    path = write(tmp_path / "train.jsonl", {"prompt": "q", "completion": "a"})
    with pytest.raises(DataError, match=r"train.jsonl:1: the chat template does not extend the prompt"):
        load(tok, path)


# --- files and splits ----------------------------------------------------------------------


def test_find_split_file(tmp_path):
    write(tmp_path / "train.jsonl", GOOD)
    write(tmp_path / "valid.jsonl", GOOD)
    assert find_split_file(tmp_path, "train") == tmp_path / "train.jsonl"
    assert find_split_file(tmp_path, "valid") == tmp_path / "valid.jsonl"
    assert find_split_file(tmp_path, "test") is None
    single = write(tmp_path / "mine.jsonl", GOOD)
    assert find_split_file(single, "train") == single
    assert find_split_file(single, "valid") is None
    assert find_split_file(tmp_path / "nope", "train") is None


def test_missing_and_empty_splits(tok, tmp_path):
    with pytest.raises(DataError, match=r"no train.jsonl.*valid.jsonl"):
        load_split(tmp_path, "train", tok, block_size=B, max_seq_length=64)
    with pytest.raises(DataError, match="no such file"):
        load_split(tmp_path / "nope", "train", tok, block_size=B, max_seq_length=64)
    write(tmp_path / "train.jsonl", "", "  ")
    with pytest.raises(DataError, match=r"train.jsonl: no records"):
        load_split(tmp_path, "train", tok, block_size=B, max_seq_length=64)
    write(tmp_path / "valid.jsonl", GOOD)
    assert load_split(tmp_path, "valid", tok, block_size=B, max_seq_length=64).path == tmp_path / "valid.jsonl"


# --- batches -------------------------------------------------------------------------------


def fake(n, k):
    """An example of length n (a multiple of B) whose ids all equal k, to trace it."""
    return Example(ids=np.full(n, k, np.int64), labels=np.full(n, k, np.int64), source=f"f:{k}", truncated=False)


LENGTHS = [8, 4, 20, 12, 4, 16, 8, 24, 4, 12, 8]
EXAMPLES = [fake(n, k) for k, n in enumerate(LENGTHS)]


def test_batches_shapes_padding_lengths():
    out = list(batches(EXAMPLES, 3, pad_id=0, shuffle=False))
    assert [len(lens) for _, _, lens in out] == [3, 3, 3, 2]  # last partial batch kept
    seen = []
    for ids, labels, lens in out:
        assert ids.shape == labels.shape == (len(lens), int(lens.max()))
        assert ids.dtype == labels.dtype == lens.dtype == np.int64
        for row_ids, row_labels, n in zip(ids, labels, lens):
            k = row_ids[0]
            assert n == LENGTHS[k]
            assert (row_ids[:n] == k).all() and (row_labels[:n] == k).all()
            assert (row_ids[n:] == 0).all() and (row_labels[n:] == IGNORE).all()
            seen.append(int(k))
    assert sorted(seen) == list(range(len(LENGTHS)))


def test_batches_are_length_buckets():
    for shuffle in (False, True):
        out = list(batches(EXAMPLES, 3, pad_id=0, shuffle=shuffle, seed=1))
        spans = sorted((int(lens.min()), int(lens.max())) for _, _, lens in out)
        # consecutive chunks of the sorted lengths: batches never overlap in length
        for (_, hi), (lo, _) in zip(spans, spans[1:]):
            assert hi <= lo
    out = list(batches(EXAMPLES, 3, pad_id=0, shuffle=False))
    flat = np.concatenate([lens for _, _, lens in out])
    assert flat.tolist() == sorted(LENGTHS)


def test_batches_deterministic_with_seed():
    def run(seed):
        return [ids[:, 0].tolist() for ids, _, _ in batches(EXAMPLES, 2, pad_id=0, seed=seed)]

    assert run(3) == run(3)
    assert any(run(3) != run(s) for s in (4, 5, 6))
    assert list(batches([], 2, pad_id=0)) == []
