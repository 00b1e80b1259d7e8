"""`mars distill` on a tiny model, and how training reads a reply cut by the length cap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tiny import make_plan, make_tokenizer, save_model

from mars.cli.main import cli
from mars.core.train.data import IGNORE, DataError, load_split

PROMPTS = [
    {"messages": [{"role": "user", "content": "abc"}]},
    {"prompt": "hello there", "follow_ups": ["again", "once more"]},
    {"messages": [{"role": "user", "content": "zz"}]},
    {"prompt": "say q"},
    {"prompt": "xyz"},
]


def write(path: Path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(*args):
    return CliRunner().invoke(cli, ["distill", *map(str, args)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("m") / "model")


def greedy(model_dir, conversation, max_tokens):
    """Reference: the reply plain greedy decoding gives, one conversation alone."""
    from mars.core.decode.loop import generate
    from mars.core.tokens import encode_prompt
    from mars.evaluate import load_model

    session = load_model(model_dir, "torch")
    s = make_plan(
        mask_id=session.mask_id(), eos_ids=session.loaded.eos_ids, threshold=1.0, max_tokens=max_tokens, cache="none"
    )
    r = generate(session.decoder, [encode_prompt(session.loaded.tokenizer, conversation)], s)
    body = [t for t in r.tokens[0] if t not in session.loaded.eos_ids]
    return session.loaded.tokenizer.decode(body, skip_special_tokens=True), r.finish[0]


def test_distill_writes_the_models_own_replies_and_resumes(model, tmp_path):
    prompts = write(tmp_path / "p" / "train.jsonl", PROMPTS)
    write(tmp_path / "p" / "valid.jsonl", PROMPTS[:2])
    out = tmp_path / "data"
    r = run(
        "--model",
        model,
        "--prompts",
        prompts.parent,
        "--output",
        out,
        "--max-tokens",
        12,
        "--batch-size",
        2,
        "--backend",
        "torch",
    )
    assert r.exit_code == 0, r.output
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(train) == len(PROMPTS) and not list(out.glob("*.partial"))
    for rec, p in zip(train, PROMPTS):
        msgs = rec["messages"]
        assert msgs[-1]["role"] == "assistant" and rec["finish"] in ("eos", "length")
        first = p.get("messages") or [{"role": "user", "content": p["prompt"]}]
        assert msgs[: len(first)] == first
        # The reply equals plain greedy decoding of that conversation alone (batching changes nothing).
        assert (msgs[-1]["content"], rec["finish"]) == greedy(model, msgs[:-1], 12)
    # Follow-ups: every user turn in order, each answered by the model.
    follow = train[1]["messages"]
    assert [m["role"] for m in follow] == ["user", "assistant"] * 3
    assert [m["content"] for m in follow[2::2]] == ["again", "once more"]
    meta = json.loads((out / "distill.json").read_text())
    assert meta["splits"]["train"]["records"] == len(PROMPTS)

    # Resume: a run killed after two records (and mid-line) continues to the same file.
    expected = (out / "train.jsonl").read_text()
    lines = expected.splitlines(keepends=True)
    (out / "train.jsonl").unlink()
    (out / "train.jsonl.partial").write_text("".join(lines[:2]) + lines[2][:7])
    r = run(
        "--model",
        model,
        "--prompts",
        prompts.parent,
        "--output",
        out,
        "--max-tokens",
        12,
        "--batch-size",
        2,
        "--backend",
        "torch",
    )
    assert r.exit_code == 0, r.output
    assert "resuming after 2 of 5" in r.output
    assert (out / "train.jsonl").read_text() == expected

    # A finished output distilled with a smaller --limit grows to a larger one, the same file.
    small = tmp_path / "small"
    args = ("--model", model, "--prompts", prompts.parent, "--max-tokens", 12, "--batch-size", 2, "--backend", "torch")
    assert run(*args, "--output", small, "--limit", 2).exit_code == 0
    assert len((small / "train.jsonl").read_text().splitlines()) == 2
    r = run(*args, "--output", small, "--limit", 2)
    assert r.exit_code == 0 and "already complete" in r.output
    r = run(*args, "--output", small, "--limit", 5)
    assert r.exit_code == 0, r.output
    assert "resuming after 2 of 5" in r.output
    assert (small / "train.jsonl").read_text() == expected
    assert json.loads((small / "distill.json").read_text())["splits"]["train"]["prompts"] == 5

    # The output is a training set the data loader accepts as it is.
    split = load_split(out, "train", make_tokenizer(), block_size=4, max_seq_length=512)
    assert len(split.examples) == len(PROMPTS)


def test_resume_with_other_settings_is_refused(model, tmp_path):
    prompts = write(tmp_path / "train.jsonl", PROMPTS[:2])
    out = tmp_path / "data"
    assert (
        run("--model", model, "--prompts", prompts, "--output", out, "--max-tokens", 4, "--backend", "torch").exit_code
        == 0
    )
    r = run("--model", model, "--prompts", prompts, "--output", out, "--max-tokens", 8, "--backend", "torch")
    assert r.exit_code == 1 and "max_tokens = 4" in r.output and "--output" in r.output


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"messages": []}', "no 'prompt' string"),
        ('{"prompt": "a", "follow_ups": "b"}', "'follow_ups' must be an array"),
        ('{"messages": [{"role": "system", "content": "a"}]}', "end the prompt with a user turn"),
        ("{oops", "malformed JSON"),
    ],
)
def test_bad_prompts_fail_before_loading_with_file_and_line(tmp_path, line, needle):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    r = run("--model", tmp_path / "no-model", "--prompts", prompts, "--output", tmp_path / "out", "--backend", "torch")
    assert r.exit_code == 1 and f"{prompts}:2" in r.output and needle in r.output
    assert not (tmp_path / "out").exists()


def test_a_cut_reply_labels_neither_eos_nor_padding(tmp_path):
    tok = make_tokenizer()
    eos = tok.eos_token_id
    base = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cdefg"}]}
    write(tmp_path / "ended" / "train.jsonl", [base])
    write(tmp_path / "cut" / "train.jsonl", [dict(base, finish="length")])
    ended = load_split(tmp_path / "ended", "train", tok, block_size=4, max_seq_length=64).examples[0]
    cut = load_split(tmp_path / "cut", "train", tok, block_size=4, max_seq_length=64).examples[0]
    labelled_ended = ended.labels[ended.labels != IGNORE]
    labelled_cut = cut.labels[cut.labels != IGNORE]
    # The ended reply learns its EOS (and its EOS padding); the cut one learns the same text, no EOS.
    assert labelled_ended[-1] == eos and eos not in labelled_cut
    assert np.array_equal(labelled_cut, labelled_ended[labelled_ended != eos])
    assert len(cut.ids) % 4 == 0


def test_finish_must_be_eos_or_length(tmp_path):
    write(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b", "finish": "stop"}])
    with pytest.raises(DataError, match=r'train.jsonl:1: .*"eos" or "length"'):
        load_split(tmp_path, "train", make_tokenizer(), block_size=4, max_seq_length=64)
