"""benchmarks/recipes.py, the comparison of training recipes, dry-run on the CPU with a tiny
model: the grown adapter starts as the one it grew from, the data mix draws the named kinds
more often, and the whole comparison trains, measures, reports and resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from clitools import invoke, ok
from safetensors.numpy import load_file
from tiny import load_script, spell_records

from mars.backends.torch.load import load as torch_load

QUIET = dict(announce=lambda m: None)


@pytest.fixture(scope="module")
def gated(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipes-init") / "adapter"
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--gate",
            "masks",
            "--iters",
            5,
            "--lora-rank",
            4,
            "--lora-alpha",
            8,
            "--backend",
            "torch",
            "--default-mode",
            "lossless",
            "--learning-rate",
            1e-2,
        )
    )
    return out


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/recipes.py")


def test_a_grown_adapter_computes_what_it_grew_from(gated, script, tmp_path):
    grown = script.grow_adapter(gated, tmp_path / "grown", 8)
    config = json.loads((grown / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0  # the scale alpha / r kept at 2
    old, new = load_file(str(gated / "adapter_model.safetensors")), load_file(str(grown / "adapter_model.safetensors"))
    for name, t in new.items():
        if ".lora_A." in name:
            np.testing.assert_array_equal(t[:4], old[name])
            assert t.shape[0] == 8 and np.abs(t[4:]).min() > 0  # new directions drawn as a fresh A is
        elif ".lora_B." in name:
            np.testing.assert_array_equal(t[:, :4], old[name])
            assert t.shape[1] == 8 and not t[:, 4:].any()  # and switched off by a zero B
    a, b = torch_load(gated, **QUIET), torch_load(grown, **QUIET)
    mask = json.loads((gated / "mars.json").read_text())["mask_token_id"]
    ids = torch.tensor([[5, 9, 14, 20, mask, mask, mask]])  # masks: where the gated deltas act
    with torch.no_grad():
        for tm in (a, b):
            tm.gate.set(ids)
        ours, theirs = a.model(input_ids=ids).logits, b.model(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    with pytest.raises(SystemExit, match="not above"):
        script.grow_adapter(gated, tmp_path / "smaller", 4)


def test_the_data_mix_draws_the_named_kinds_more_often(script, tmp_path):
    data, categories = tmp_path / "data", tmp_path / "prompts.jsonl"
    data.mkdir()
    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(6)
    ]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (data / "valid.jsonl").write_text(json.dumps(records[0]) + "\n")
    kinds = ["code", "facts", "multi_turn", "facts", "list", "code"]
    categories.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "category": k}) + "\n"
            for i, k in enumerate(kinds)
        )
    )
    counts = script.mixed_data(data, categories, tmp_path / "mix", 3)
    assert counts == {"records": 6, "drawn_more": 3}
    lines = [json.loads(line) for line in (tmp_path / "mix" / "train.jsonl").read_text().splitlines()]
    drawn = {f"q{i}": sum(r["messages"][0]["content"] == f"q{i}" for r in lines) for i in range(6)}
    assert drawn == {"q0": 3, "q1": 1, "q2": 3, "q3": 1, "q4": 1, "q5": 3}
    assert (tmp_path / "mix" / "valid.jsonl").read_text() == (data / "valid.jsonl").read_text()


def test_the_comparison_dry_runs_and_goes_on_where_it_stopped(tiny, gated, script, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    records = spell_records()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (data / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:4]))
    prompts, categories = tmp_path / "test.jsonl", tmp_path / "categories.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}]}) + "\n" for r in records[:3])
    )
    categories.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "category": "code" if i % 2 else "facts"}) + "\n"
            for i, r in enumerate(records)
        )
    )
    work, report = tmp_path / "work", tmp_path / "report.json"
    argv = [
        "--work",
        str(work),
        "--recipes",
        "rank-32,code-multiturn",
        "--model",
        str(tiny),
        "--init-adapter",
        str(gated),
        "--data",
        str(data),
        "--categories",
        str(categories),
        "--valid-data",
        str(data / "valid.jsonl"),
        "--prompts",
        str(prompts),
        "--limit",
        "3",
        "--max-tokens",
        "6",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--json",
        str(report),
    ]
    assert script.main(argv) == 0
    printed = capsys.readouterr().out
    rows = json.loads(report.read_text())["recipes"]
    assert [r["name"] for r in rows] == ["start", "rank-32", "code-multiturn"]
    for r in rows:
        m = r["measured"]
        assert len(m["slot_agreement"]) == 4 and len(m["lossless_slot_acceptance"]) == 4
        assert m["lossless_identical"] == 1.0  # lossless is AR's output, whatever the masks
        assert m["lossless_tokens_per_forward"] >= 1.0 and m["t95_tokens_per_forward"] >= 1.0
        assert f"| {r['name']} |" in printed
    for r in rows[1:]:
        assert r["train"]["steps"] == 2 and r["train"]["val_noisy"] is not None
    assert json.loads((work / "rank-32" / "adapter_config.json").read_text())["r"] == 32
    # A rerun finds every recipe done: nothing trains or decodes again.
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    assert script.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
