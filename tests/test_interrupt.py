"""Ctrl-C and kills: exit status 130 with the line to go on, checkpoints never half-written,
and a resumed fine-tune ending with the weights of an uninterrupted one."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clitools import invoke, ok, write_jsonl
from safetensors.torch import load_file

from mars.core.files import atomic_dir, restore_swapped_dir

ITERS = 400  # long enough (seconds) that a signal sent after the first checkpoint lands mid-training
SAVE_EVERY = 10


def mars_exe() -> str:
    return str(Path(sys.executable).parent / "mars")


def finetune_args(tiny, data, out):
    return [
        "finetune",
        "--model",
        str(tiny),
        "--data",
        str(data),
        "--output",
        str(out),
        "--iters",
        str(ITERS),
        "--batch-size",
        "2",
        "--learning-rate",
        "1e-3",
        "--save-every",
        str(SAVE_EVERY),
        "--device",
        "cpu",
        "--backend",
        "torch",
    ]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start(args):
    # Ctrl-C's default action, as in a terminal: a shell that runs the tests in the background
    # (`cmd &`) starts them with SIGINT ignored, and a child inherits that.
    return subprocess.Popen(
        [mars_exe(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_checkpoint(out: Path, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not (out / "checkpoint" / "state.pt").is_file():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


def run(args):
    done = subprocess.run([mars_exe(), *args], capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def weights(out: Path) -> dict:
    return {**load_file(str(out / "adapter_model.safetensors")), **load_file(str(out / "mask_embedding.safetensors"))}


@pytest.fixture(scope="module")
def uninterrupted(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "out"
    run(finetune_args(tiny, data, out))
    return weights(out)


def assert_same_weights(out: Path, expected: dict):
    got = weights(out)
    assert set(got) == set(expected)
    for name, w in expected.items():
        assert torch.equal(got[name], w), name  # one thread, same batches: bit for bit


def test_sigint_exits_130_with_the_resume_command_and_resumes_to_the_same_adapter(tiny, data, tmp_path, uninterrupted):
    out = tmp_path / "out"
    proc = start(finetune_args(tiny, data, out))
    wait_for_checkpoint(out, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Aborted" not in err and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"interrupted at step (\d+)/{ITERS}; the checkpoint of step (\d+) is in (.+); resume with: (.+)", line
    )
    assert found, line
    step, saved = int(found[1]), int(found[2])
    assert step == saved < ITERS  # the first Ctrl-C stops after its step and saves it
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint"]
    assert torch.load(out / "checkpoint" / "state.pt", weights_only=False)["step"] == step
    command = shlex.split(found[4])
    assert command[0] == "mars" and command[1:] == finetune_args(tiny, data, out) + ["--resume"]
    resumed = run(command[1:])
    assert f"at step {step}/{ITERS}" in resumed.stderr
    assert_same_weights(out, uninterrupted)


def test_sigkill_leaves_a_whole_checkpoint_that_resumes_to_the_same_adapter(tiny, data, tmp_path, uninterrupted):
    out = tmp_path / "out"
    proc = start(finetune_args(tiny, data, out))
    wait_for_checkpoint(out, proc)
    time.sleep(0.2)  # a few steps on, possibly mid-save
    proc.kill()
    proc.communicate()
    restore_swapped_dir(out / "checkpoint")
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)  # whole: both files read
    assert SAVE_EVERY <= state["step"] < ITERS and state["step"] % SAVE_EVERY == 0
    assert load_file(str(out / "checkpoint" / "trainable.safetensors"))
    run(finetune_args(tiny, data, out) + ["--resume"])
    assert_same_weights(out, uninterrupted)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_write_cut_short_keeps_the_previous_directory(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint"
    atomic_dir(target, lambda d: (d / "state.json").write_text('{"step": 3}'))

    def half_write(d):
        (d / "state.json").write_text('{"st')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_dir(target, half_write)
    assert json.loads((target / "state.json").read_text()) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]

    # A kill between the two renames: the old version is aside, the new one not yet in place.
    real_replace = os.replace
    calls = []

    def killed_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        atomic_dir(target, lambda d: (d / "state.json").write_text('{"step": 6}'))
    monkeypatch.setattr(os, "replace", real_replace)
    assert not target.exists()
    restore_swapped_dir(target)
    assert json.loads((target / "state.json").read_text()) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_ctrl_c_in_distill_exits_130_and_the_same_command_continues(tiny, tmp_path, monkeypatch):
    from mars import distill

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Spell from {c}"} for c in "abcdef"])
    args = [
        "distill",
        "--model",
        tiny,
        "--prompts",
        prompts,
        "--output",
        tmp_path / "out",
        "--max-tokens",
        "6",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--backend",
        "torch",
    ]
    whole = ok(invoke(*args[:6], tmp_path / "whole", *args[7:]))
    real_batch = distill.Distiller.batch
    calls = []

    def interrupted_on_the_second_batch(self, records):
        calls.append(len(records))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_batch(self, records)

    monkeypatch.setattr(distill.Distiller, "batch", interrupted_on_the_second_batch)
    result = invoke(*args)
    assert result.exit_code == 130, result.output[-2000:]
    line = result.output.strip().splitlines()[-1]
    assert (
        line.startswith("interrupted; the replies written so far are kept in") and "continue with: mars distill" in line
    )
    assert shlex.split(line.split("continue with: ")[1])[1:] == [str(a) for a in args]
    assert len((tmp_path / "out" / "train.jsonl.partial").read_text().splitlines()) == 2
    monkeypatch.setattr(distill.Distiller, "batch", real_batch)
    ok(invoke(*args))
    assert (tmp_path / "out" / "train.jsonl").read_text() == (tmp_path / "whole" / "train.jsonl").read_text()
    assert whole.exit_code == 0


def test_ctrl_c_in_eval_exits_130_and_writes_no_report(tiny, tmp_path, monkeypatch):
    from mars import evaluate

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Spell from a"}])
    report = tmp_path / "report.json"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "sweep", interrupted)
    result = invoke(
        "eval",
        "--model",
        tiny,
        "--prompts",
        prompts,
        "--no-nll",
        "--force",
        "--threshold",
        "1.0",
        "--output",
        report,
        "--device",
        "cpu",
        "--backend",
        "torch",
    )
    assert result.exit_code == 130, result.output[-2000:]
    assert result.output.strip().splitlines()[-1] == "interrupted"
    assert not report.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
