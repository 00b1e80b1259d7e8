"""What `mars finetune` leaves for its user on both backends: files as readable as the umask
allows, and validation passes capped by --val-batches with a progress bar."""

import math
import os
import stat

import pytest
from clitools import invoke, ok, spell_records, write_jsonl

from mars.core.train import loop as training
from mars.core.train.loop import TrainSettings, validation_losses

BACKENDS = [
    "torch",
    pytest.param(
        "mlx",
        marks=pytest.mark.skipif(__import__("importlib").util.find_spec("mlx") is None, reason="mlx is not installed"),
    ),
]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_outputs_are_world_readable(tiny, data, tmp_path, backend, umask_022):
    out = tmp_path / "out"
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            2,
            "--batch-size",
            4,
            "--device",
            "cpu",
            "--backend",
            backend,
        )
    )
    weights = "adapter_model.safetensors" if backend == "torch" else "adapters.safetensors"
    assert (out / weights).is_file() and (out / "mask_embedding.safetensors").is_file()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and all(mode == 0o644 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_validation_takes_the_same_capped_batches_every_pass():
    examples = [type("E", (), {"ids": [1] * n, "labels": [1] * n})() for n in range(4, 44)]
    seen = []

    def losses(batch):
        seen.append(tuple(batch[2]))
        return 1.0, 2.0

    capped = TrainSettings(batch_size=4, val_batches=3)
    result = validation_losses(examples, capped, 0, losses, 1.0)
    assert len(seen) == 3 and result == {"val_noisy": 1.0, "val_clean": 2.0, "val_loss": 3.0}
    first = list(seen)
    validation_losses(examples, capped, 0, losses, 1.0)
    assert seen[3:] == first  # the same batches at every pass
    assert max(max(b) for b in first) > 16  # not the shortest rows alone (the length-sorted order's first batches)
    seen.clear()
    validation_losses(examples, TrainSettings(batch_size=4, val_batches=-1), 0, losses, 1.0)
    assert len(seen) == math.ceil(len(examples) / 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_val_batches_caps_each_validation_pass_with_a_progress_bar(tiny, tmp_path, backend, monkeypatch):
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", spell_records(8))
    write_jsonl(data / "valid.jsonl", spell_records(40))  # 10 batches of 4
    passes = []
    real = training.validation_losses

    def counted(examples, s, pad_id, losses, ar_weight, *, progress=False):
        calls = []
        result = real(examples, s, pad_id, lambda b: calls.append(1) or losses(b), ar_weight, progress=progress)
        passes.append((len(calls), progress))
        return result

    module = "mars.backends.torch.train" if backend == "torch" else "mars.backends.mlx.train"
    monkeypatch.setattr(f"{module}.validation_losses", counted)
    result = ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            tmp_path / "out",
            "--iters",
            2,
            "--batch-size",
            4,
            "--steps-per-eval",
            1,
            "--val-batches",
            3,
            "--device",
            "cpu",
            "--backend",
            backend,
        )
    )
    assert passes == [(3, True), (3, True)]
    assert "validation:" in result.output and "/3 [" in result.output  # the bar, drawn over 3 batches
    passes.clear()
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            tmp_path / "all",
            "--iters",
            1,
            "--batch-size",
            4,
            "--val-batches",
            -1,
            "--device",
            "cpu",
            "--backend",
            backend,
        )
    )
    assert passes == [(10, True)]


def test_val_batches_zero_is_refused(tiny, data, tmp_path):
    result = invoke(
        "finetune", "--model", tiny, "--data", data, "--output", tmp_path / "out", "--iters", 1, "--val-batches", 0
    )
    assert result.exit_code == 2 and "--val-batches" in result.output and "-1" in result.output
    assert not (tmp_path / "out").exists()
