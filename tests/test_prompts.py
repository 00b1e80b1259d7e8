"""scripts/make_prompts.py: the project's prompt set is deterministic, disjoint and well formed (no model)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_prompts.py"


@pytest.fixture(scope="module")
def mp():
    spec = importlib.util.spec_from_file_location("make_prompts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def splits(mp):
    return mp.build(0, 150, 150)


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.jsonl"))}


def test_deterministic_bytes(mp, tmp_path):
    mp.write(tmp_path / "a", mp.build(0, 150, 150))
    mp.write(tmp_path / "b", mp.build(0, 150, 150))
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert sorted(a) == ["test.jsonl", "train.jsonl", "valid.jsonl"]
    assert a == b
    mp.write(tmp_path / "c", mp.build(1, 150, 150))
    assert _files(tmp_path / "c") != a  # the seed matters


def test_sizes_and_disjoint_splits(mp, splits):
    assert len(splits["test"]) == 150 and len(splits["valid"]) == 150
    total = sum(len(v) for v in splits.values())
    assert total >= 1500
    keys = {name: [mp.normalise(r["messages"][0]["content"]) for r in recs] for name, recs in splits.items()}
    assert sum(len(set(k)) for k in keys.values()) == total  # no duplicates within a split
    assert not set(keys["train"]) & set(keys["valid"])
    assert not set(keys["train"]) & set(keys["test"])
    assert not set(keys["valid"]) & set(keys["test"])


def test_records_well_formed(mp, splits, tmp_path):
    mp.write(tmp_path, splits)
    categories = set()
    for name in ("train", "valid", "test"):
        data = (tmp_path / f"{name}.jsonl").read_bytes()
        assert b"\r" not in data and data.endswith(b"\n")
        for line in data.decode("utf-8").splitlines():
            rec = json.loads(line)
            msgs = rec["messages"]
            assert len(msgs) == 1 and msgs[0]["role"] == "user"
            assert isinstance(msgs[0]["content"], str) and msgs[0]["content"].strip()
            assert isinstance(rec["category"], str) and rec["category"]
            categories.add(rec["category"])
            if rec["category"] == "multi_turn":
                follow = rec["follow_ups"]
                assert isinstance(follow, list) and 1 <= len(follow) <= 2
                assert all(isinstance(t, str) and t.strip() for t in follow)
            else:
                assert "follow_ups" not in rec
    assert categories == set(mp.CATEGORIES)


def test_refuses_impossible_splits(mp):
    with pytest.raises(ValueError):
        mp.build(0, 5000, 150)
    assert mp.main(["--out", "/nonexistent-unused", "--test", "5000"]) == 1


def test_shipped_distilled_data_answers_the_first_prompts_in_order():
    """data/distilled (the training data of weights/) holds, per split, one reply to each of the
    first N prompts of data/prompts in file order, follow-ups asked in turn."""
    root = Path(__file__).resolve().parent.parent / "data"
    for split, at_least in (("train", 1600), ("valid", 150)):
        prompts = [json.loads(line) for line in (root / "prompts" / f"{split}.jsonl").read_text().splitlines()]
        records = [json.loads(line) for line in (root / "distilled" / f"{split}.jsonl").read_text().splitlines()]
        assert len(records) >= at_least
        for prompt, rec in zip(prompts, records):
            users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
            assert users == [prompt["messages"][0]["content"], *prompt.get("follow_ups", [])]
            assert rec["messages"][-1]["role"] == "assistant" and rec["finish"] in ("eos", "length")
