"""scripts/train_gpu.py, the one-sitting GPU training run, dry-run on the CPU with a tiny model:
prompts, self-distillation and training all run, snapshots and the log land in --out, and
the adapter rebuilt from its parts continues the gated one it started from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from clitools import invoke, ok
from safetensors.torch import load_file
from tiny import load_script, spell_records, train_spelling

from mars.backends.torch.load import load as torch_load
from mars.backends.torch.train import TorchTrainer
from mars.core.train.data import Example, batches, encode_record, pad_to_block
from mars.core.train.loop import TrainSettings

ROOT = Path(__file__).resolve().parent.parent
QUIET = dict(announce=lambda m: None)


@pytest.fixture(scope="module")
def gated(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-init") / "adapter"
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
            "--backend",
            "torch",
            "--default-mode",
            "lossless",
            "--default-threshold",
            0.8,
        )
    )
    return out


def test_the_gpu_script_dry_runs_on_the_cpu_and_returns_a_usable_adapter(tiny, gated, tmp_path):
    # A budget of 0 minutes: every phase does its minimum (one distillation batch, --min-steps
    # steps, a snapshot after each), so the run is the same on a fast machine and a busy one.
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train_gpu.py"),
        "--out",
        str(out),
        "--work",
        str(work),
        "--model",
        str(tiny),
        "--init-adapter",
        str(gated),
        "--device",
        "cpu",
        "--minutes",
        "0",
        "--min-steps",
        "10",
        "--template-prompts",
        "24",
        "--sampled-prompts",
        "8",
        "--valid",
        "4",
        "--gen-batch",
        "8",
        "--max-tokens",
        "8",
        "--batch-size",
        "4",
        "--save-seconds",
        "0",
        "--reserve-seconds",
        "0",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("snapshot at step") == 11  # one after each step, then the final one
    assert "distil: time's up after 1 of 3 batches" in run.stdout

    # Only what may come back from a device call: at most 8 plain files, no folders.
    returned = sorted(p.name for p in out.iterdir())
    assert len(returned) <= 8 and all(p.is_file() for p in out.iterdir()), returned
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"] is True
    assert summary["distil"]["replies"] > 0 and summary["distil"]["valid"] == 4
    steps = summary["train"]["steps"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == 10 and [r["step"] for r in log] == list(range(1, steps + 1))
    # The steps outlast the clock, so they pace the schedule: the rate (logged as set for the
    # next step) decays over them to zero at the last.
    lrs = [r["lr"] for r in log]
    assert lrs == sorted(lrs, reverse=True) and lrs[-2] > 0 and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert summary["train"]["valid_after"]["val_noisy"] < summary["train"]["valid_before"]["val_noisy"]

    script = load_script("scripts/train_gpu.py")
    (out / summary["adapter"]["parts"][0]).write_bytes((out / summary["adapter"]["parts"][0]).read_bytes() + b"x")
    with pytest.raises(SystemExit, match="sha256"):
        script.unpack(out, tmp_path / "torn")
    (out / summary["adapter"]["parts"][0]).write_bytes((out / summary["adapter"]["parts"][0]).read_bytes()[:-1])
    adapter = script.unpack(out, tmp_path / "adapter")

    # It continues the init adapter: same checkpoint settings, trained LoRA weights.
    new, init = json.loads((adapter / "mars.json").read_text()), json.loads((gated / "mars.json").read_text())
    assert {k: new[k] for k in ("gate", "default_mode", "default_threshold", "block_size", "mask_token_id")} == {
        k: init[k] for k in ("gate", "default_mode", "default_threshold", "block_size", "mask_token_id")
    }
    a, b = load_file(str(adapter / "adapter_model.safetensors")), load_file(str(gated / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    assert len((adapter / "training_log.jsonl").read_text().splitlines()) == steps

    # Gated: every real token still runs the base, so the adapter's real-token logits are the base's
    # (but the mask token's own column: with tied embeddings its trained row is that output row).
    tm, base = torch_load(adapter, **QUIET), torch_load(tiny, **QUIET)
    ids = torch.tensor([[5, 9, 14, 20, 31, 7, 12]])
    tm.gate.set(ids)
    keep = [i for i in range(len(tm.tokenizer)) if i != new["mask_token_id"]]
    with torch.no_grad():
        ours, theirs = tm.model(input_ids=ids).logits[..., keep], base.model(input_ids=ids).logits[..., keep]
    assert torch.allclose(ours, theirs, atol=1e-5)


class SlowClock:
    """A clock on a machine so busy that an hour passes between any two looks at it."""

    def __init__(self):
        self.t = 1.7e9

    def __call__(self) -> float:
        self.t += 3600.0
        return self.t


def dry_run_args(tiny, gated, tmp_path, *extra) -> list[str]:
    return [
        "--out",
        str(tmp_path / "out"),
        "--work",
        str(tmp_path / "work"),
        "--model",
        str(tiny),
        "--init-adapter",
        str(gated),
        "--device",
        "cpu",
        "--template-prompts",
        "24",
        "--sampled-prompts",
        "8",
        "--valid",
        "4",
        "--gen-batch",
        "8",
        "--max-tokens",
        "8",
        "--batch-size",
        "4",
        *map(str, extra),
    ]


def test_every_phase_runs_one_batch_however_late_it_starts(tiny, gated, tmp_path, monkeypatch, capsys):
    """Each deadline has passed by the time its phase first looks: sampling prompts still does
    one round, distillation one batch (it used to do none, and training then failed on an empty
    train.jsonl), training one step, and the run returns its adapter."""
    script = load_script("scripts/train_gpu.py")
    monkeypatch.setattr(script, "now", SlowClock())
    calls = []
    generate = script.generate_rows
    monkeypatch.setattr(script, "generate_rows", lambda *a, **kw: calls.append(kw["sample"]) or generate(*a, **kw))

    assert (
        script.main(
            dry_run_args(tiny, gated, tmp_path, "--minutes", 10, "--slot-weights", "1,2,2,3", "--consistency", 0.5)
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "distil: time's up after 1 of 3 batches" in printed
    assert calls.count(True) == 1  # sampling user turns: one round
    assert calls.count(False) == 2  # greedy replies: one batch for validation, one for training
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final"] is True and summary["train"]["steps"] == 1
    assert summary["train"]["slot_weights"] == [1, 2, 2, 3] and summary["train"]["consistency"] == 0.5
    assert 0 < summary["distil"]["replies"] <= 8 and summary["distil"]["valid"] == 4
    assert (tmp_path / "out" / "train_log.jsonl").read_text().count("\n") == 1
    assert (script.unpack(tmp_path / "out", tmp_path / "adapter") / "adapter_model.safetensors").is_file()


def test_slot_weights_that_do_not_fit_the_adapter_are_refused_before_any_work(tiny, gated, tmp_path, capsys):
    script = load_script("scripts/train_gpu.py")
    with pytest.raises(SystemExit) as stop:
        script.main(dry_run_args(tiny, gated, tmp_path, "--slot-weights", "1,2"))
    assert stop.value.code == 2 and "one weight per mask slot: 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sampling_prompts_runs_one_round_however_late_it_starts(monkeypatch):
    script = load_script("scripts/train_gpu.py")
    monkeypatch.setattr(script, "now", SlowClock())
    monkeypatch.setattr(script, "user_prefix", lambda tokenizer: [1, 2])
    rounds = []

    def generate_rows(model, tokenizer, prompts_ids, **kw):
        rounds.append(kw["seed"])
        return [([len(rounds), i], True) for i in range(len(prompts_ids))]

    monkeypatch.setattr(script, "generate_rows", generate_rows)

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return f"Write a short poem number {ids[0]}.{ids[1]}"

    found = script.sampled_prompts(None, Tokenizer(), 100, batch=3, eos=(0,), held_out=set(), deadline=0.0, seed=5)
    assert rounds == [5] and len(found) == 3


def test_a_run_left_with_nothing_to_train_on_stops_with_one_line_naming_the_option(tiny, gated, tmp_path):
    script = load_script("scripts/train_gpu.py")
    with pytest.raises(SystemExit) as stop:
        script.main(
            dry_run_args(tiny, gated, tmp_path, "--minutes", 0, "--template-prompts", 0, "--sampled-prompts", 0)
        )
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("train_gpu.py: no training prompts")
    assert "--template-prompts" in message and "--sampled-prompts" in message
    assert not (tmp_path / "out" / "summary.json").exists()

    # Replies, but none short enough to train on.
    with pytest.raises(SystemExit) as stop:
        script.main(dry_run_args(tiny, gated, tmp_path, "--minutes", 0, "--max-seq-length", 8))
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith(
        "train_gpu.py: no distilled train example fits in --max-seq-length 8"
    )
    assert message.endswith("pass a larger --max-seq-length")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_replies_all_empty_stop_with_one_line(tiny, gated, tmp_path, monkeypatch):
    """Past its deadline, distillation goes on through every batch while none has a reply; with
    none at all the run stops with one line."""
    script = load_script("scripts/train_gpu.py")
    greedy = []

    def empty_replies(model, tokenizer, prompts_ids, **kw):
        greedy.extend([len(prompts_ids)] if not kw["sample"] else [])
        return [([], True) for _ in prompts_ids]

    monkeypatch.setattr(script, "generate_rows", empty_replies)
    with pytest.raises(SystemExit) as stop:
        script.main(dry_run_args(tiny, gated, tmp_path, "--minutes", 0))
    assert greedy == [4, 8, 8, 8]  # the 4 validation prompts, then every batch of the 24 training ones
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("train_gpu.py: distillation gave no training replies"), message
    assert "its 24 prompts" in message and "--model" in message


def test_the_learning_rate_warms_up_then_decays_to_zero_with_the_clock():
    script = load_script("scripts/train_gpu.py")
    assert script.lr_factor(0.0, 0.1) == pytest.approx(0.01)
    assert script.lr_factor(0.05, 0.1) == pytest.approx(0.5)
    assert script.lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert script.lr_factor(0.55, 0.1) == pytest.approx(0.5)
    assert script.lr_factor(1.0, 0.1) == pytest.approx(0.0, abs=1e-12)


def test_a_batch_split_in_chunks_gives_the_whole_batchs_losses_and_gradient(tmp_path):
    """What the script falls back to when a batch does not fit in memory."""
    tm, _ = train_spelling(tmp_path / "t", steps=1)
    script = load_script("scripts/train_gpu.py")

    examples = []
    for rec in spell_records()[:8]:
        ids, labels = encode_record(rec, tm.tokenizer, eos_id=tm.tokenizer.eos_token_id)
        examples.append(Example(*pad_to_block(ids, labels, 4, tm.tokenizer.eos_token_id, ended=True), "spell", False))
    batch = next(batches(examples, 8, pad_id=tm.tokenizer.eos_token_id, shuffle=False))
    results = []
    for parts in (1, 2):
        trainer = TorchTrainer(
            tm,
            tm.mars,
            TrainSettings(fine_tune_type="full", block_size=4, grad_accumulation=parts),
            tmp_path / str(parts),
        )
        trainer.loss_module = trainer.loss
        losses = script.accumulate(trainer, batch, {})
        grads = [p.grad.clone() for p in trainer.loss.parameters() if p.grad is not None]
        trainer.opt.zero_grad(set_to_none=True)
        results.append((losses, grads))
    (l1, g1), (l2, g2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert len(g1) == len(g2) > 0 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))
    assert np.isfinite(l1).all()


def test_a_second_run_reuses_the_replies_of_the_first_and_distils_only_new_prompts(tiny, gated, tmp_path):
    """The campaign compounds: a run's store of the base's replies (token ids) comes back in
    parts, is rebuilt by --unpack, and the next run given it trains on every stored reply and
    distils only prompts the store does not hold; its own store is the union."""
    script = load_script("scripts/train_gpu.py")
    first, second, store = tmp_path / "first", tmp_path / "second", tmp_path / "store.npz"
    base = ["--minutes", 0, "--min-steps", 1, "--save-seconds", 0, "--reserve-seconds", 0]
    assert script.main(dry_run_args(tiny, gated, first, *base, "--store", tmp_path / "none.npz")) == 0
    summary = json.loads((first / "out" / "summary.json").read_text())
    assert summary["distil"]["reused"] == 0 and summary["distil"]["stored_before"] == 0
    assert summary["distil"]["share"] == 0.3  # an empty store: the default share of the time for distillation
    assert summary["store"]["replies"] == 8 and summary["store"]["parts"] == [
        "distilled.npz.00"
    ]  # one batch of --gen-batch 8
    script.unpack(first / "out", tmp_path / "adapter1", store=store)
    from mars.checkpoint.paths import load_tokenizer

    key = script.store_key(str(tiny.resolve()), load_tokenizer(tiny), 8)
    kept = script.read_store(store, key)
    assert len(kept) == 8 and all(len(ids) <= 8 for _, ids, _ in kept)

    assert script.main(dry_run_args(tiny, gated, second, *base, "--store", store, "--enough-replies", 8)) == 0
    summary = json.loads((second / "out" / "summary.json").read_text())
    assert summary["distil"]["share"] == 0.1  # the store holds enough: more of the call for the optimizer
    usable = sum(script.record(load_tokenizer(tiny), *r) is not None for r in kept)
    assert summary["distil"]["stored_before"] == 8 and summary["distil"]["reused"] == usable
    assert (
        summary["distil"]["distilled"] > 0 and summary["distil"]["replies"] == usable + summary["distil"]["distilled"]
    )
    grown = tmp_path / "grown.npz"
    script.unpack(second / "out", tmp_path / "adapter2", store=grown)
    union = script.read_store(grown, key)
    assert union[:8] == kept  # the first run's replies carried over as they were
    assert len(union) == 16 and not {p for p, _, _ in union[8:]} & {p for p, _, _ in kept}  # only new prompts distilled
    # Another base (or reply limit) reuses nothing.
    assert script.read_store(grown, {**key, "max_tokens": 9}) == []
