"""`mars eval`'s prompts: {"text"} records decode as raw prompts (never silently dropped), and
the table's legend explains only the columns it shows."""

import copy
import json

import pytest
from clitools import invoke, ok, write_jsonl

from mars import evaluate
from mars.core.train.data import DataError
from mars.prompts import RawText, read_prompts

RECORDS = [{"text": "abc abc abc"}, {"prompt": "Spell from a"}, {"messages": [{"role": "user", "content": "Hi"}]}]


def test_text_records_are_raw_prompts_where_asked_and_named_errors_elsewhere(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    prompts = read_prompts(path, text=True)
    assert prompts == ["abc abc abc", "Spell from a", [{"role": "user", "content": "Hi"}]]
    assert isinstance(prompts[0], RawText) and not isinstance(prompts[1], RawText)
    with pytest.raises(DataError, match=rf"{path}:1: expected"):
        read_prompts(path)
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, {"txt": "y"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected .*\{\"text\": \.\.\.\}"):
        read_prompts(tmp_path / "bad.jsonl", text=True)


@pytest.fixture
def encoded(monkeypatch):
    """(prompt, chat) of every prompt the sweep encodes."""
    from mars.core import tokens

    seen = []
    real = tokens.encode_prompt

    def recording(tokenizer, prompt, *, chat=True):
        seen.append((prompt, chat))
        return real(tokenizer, prompt, chat=chat)

    monkeypatch.setattr(tokens, "encode_prompt", recording)
    return seen


def eval_args(tiny, *extra):
    return (
        "eval",
        "--model",
        tiny,
        "--no-nll",
        "--force",
        "--threshold",
        "1.0,0.5",
        "--max-tokens",
        4,
        "--device",
        "cpu",
        "--backend",
        "torch",
        *extra,
    )


def test_eval_prompts_decodes_text_records_raw(tiny, tmp_path, encoded):
    prompts = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    report = tmp_path / "r.json"
    ok(invoke(*eval_args(tiny, "--prompts", prompts, "--output", report)))
    assert json.loads(report.read_text())["models"][0]["sweep"]["prompts"] == 3
    assert ("abc abc abc", False) in encoded and ("Spell from a", True) in encoded


def test_eval_data_says_which_records_it_does_not_decode(tiny, tmp_path, encoded):
    data = write_jsonl(
        tmp_path / "data" / "test.jsonl", RECORDS[:1] + [{"prompt": "Spell from b", "completion": "b c d"}]
    )
    report = tmp_path / "r.json"
    result = ok(invoke(*eval_args(tiny, "--data", data.parent, "--output", report)))
    assert f'note: {data}: 1 {{"text"}} record without a prompt' in result.output
    assert json.loads(report.read_text())["models"][0]["sweep"]["prompts"] == 1


def test_legend_lines_only_for_the_columns_shown(tiny, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", RECORDS[1:])
    report = tmp_path / "r.json"
    result = ok(invoke(*eval_args(tiny, "--prompts", prompts, "--output", report)))
    assert "  tok/fwd: " in result.output and "pass@1" not in result.output
    with_humaneval = json.loads(report.read_text())
    model = with_humaneval["models"][0]
    model["humaneval"] = copy.deepcopy(model["sweep"]) | {"problems": ["HumanEval/0"]}
    for row in model["humaneval"]["thresholds"]:
        row["passed"] = 1
    table = evaluate.format_table(with_humaneval)
    assert "  pass@1: " in table and " pass@1  slot" in table
