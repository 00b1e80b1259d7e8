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
from safetensors.torch import load_file

from clitools import invoke, ok
from mars.backends.torch.model import load as torch_load
from mars.backends.torch.train import TorchTrainer
from mars.core.data import Example, batches, encode_record, pad_to_block
from mars.core.training import TrainSettings
from tiny import load_script, spell_records, train_spelling

ROOT = Path(__file__).resolve().parent.parent
QUIET = dict(announce=lambda m: None)


@pytest.fixture(scope="module")
def gated(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-init") / "adapter"
    ok(invoke("finetune", "--model", tiny, "--data", data, "--output", out, "--gate", "masks", "--iters", 5,
              "--lora-rank", 4, "--backend", "torch", "--default-mode", "lossless", "--default-threshold", 0.8))
    return out


def test_the_gpu_script_dry_runs_on_the_cpu_and_returns_a_usable_adapter(tiny, gated, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_gpu.py"), "--out", str(out), "--work", str(work), "--model", str(tiny),
           "--init-adapter", str(gated), "--device", "cpu", "--minutes", "0.35", "--template-prompts", "24",
           "--sampled-prompts", "8", "--valid", "4", "--gen-batch", "8", "--max-tokens", "8", "--batch-size", "4",
           "--save-seconds", "2", "--reserve-seconds", "3"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("snapshot at step") >= 2  # periodic snapshots, then the final one

    # Only what may come back from a device call: at most 8 plain files, no folders.
    returned = sorted(p.name for p in out.iterdir())
    assert len(returned) <= 8 and all(p.is_file() for p in out.iterdir()), returned
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"] is True
    assert summary["distil"]["replies"] > 0 and summary["distil"]["valid"] == 4
    steps = summary["train"]["steps"]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps >= 3 and [r["step"] for r in log] == list(range(1, steps + 1))
    assert summary["train"]["valid_after"]["val_noisy"] < summary["train"]["valid_before"]["val_noisy"]

    script = load_script("scripts/train_gpu.py")
    (out / summary["adapter"]["parts"][0]).write_bytes((out / summary["adapter"]["parts"][0]).read_bytes() + b"x")
    with pytest.raises(SystemExit, match="sha256"):
        script.unpack(out, tmp_path / "torn")
    (out / summary["adapter"]["parts"][0]).write_bytes((out / summary["adapter"]["parts"][0]).read_bytes()[:-1])
    adapter = script.unpack(out, tmp_path / "adapter")

    # It continues the init adapter: same checkpoint settings, trained LoRA weights.
    new, init = json.loads((adapter / "mars.json").read_text()), json.loads((gated / "mars.json").read_text())
    assert {k: new[k] for k in ("gate", "default_mode", "default_threshold", "block_size", "mask_token_id")} == \
           {k: init[k] for k in ("gate", "default_mode", "default_threshold", "block_size", "mask_token_id")}
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
        trainer = TorchTrainer(tm, tm.mars, TrainSettings(fine_tune_type="full", block_size=4, grad_accumulation=parts), tmp_path / str(parts))
        trainer.loss_module = trainer.loss
        losses = script.accumulate(trainer, batch, {})
        grads = [p.grad.clone() for p in trainer.loss.parameters() if p.grad is not None]
        trainer.opt.zero_grad(set_to_none=True)
        results.append((losses, grads))
    (l1, g1), (l2, g2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert len(g1) == len(g2) > 0 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))
    assert np.isfinite(l1).all()
