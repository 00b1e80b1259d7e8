"""Data-parallel fine-tuning on the launchers users already have: `torchrun` for the torch
backend (gloo on the CPU) and `mlx.launch` (ring) for MLX, two processes each.

Two processes with --batch-size b take every other batch of the same epoch order, so their
global batch is one process's --batch-size b --grad-accumulation-steps 2. Each distributed
run is killed once its first checkpoint exists and finished with --resume; its loss at every
step and its saved weights must equal the single process's within 1e-6 (on this CPU they are
equal bit for bit: halving and summing two gradients is exact either way)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil  # accelerate's dependency
import pytest
from safetensors.numpy import load_file

BIN = Path(sys.executable).parent
ITERS = 24
TOLERANCE = 1e-6


def args(tiny, data, out, backend, *extra):
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
        "3",
        "--val-batches",
        "2",
        "--backend",
        backend,
        *extra,
    ]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def launcher(backend: str, port: int) -> list[str]:
    if backend == "torch":
        return [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), str(BIN / "mars")]
    return [
        str(BIN / "mlx.launch"),
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(port),
        "--python",
        sys.executable,
        "--",
        str(BIN / "mars"),
    ]


def run(command):
    done = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def killed_after_first_checkpoint(command, out: Path):
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.monotonic() + 300
    while not (out / "checkpoint").is_dir():
        assert proc.poll() is None, f"ended before its first checkpoint: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    launched = psutil.Process(proc.pid)
    for p in [*launched.children(recursive=True), launched]:  # both ranks, then the launcher
        p.kill()
    proc.communicate()
    assert not (out / "mars.json").exists(), "the run finished before it could be killed"


def weights(out: Path) -> dict:
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return found


def losses(out: Path) -> list:
    return [
        (r["step"], r["noisy"], r["clean"], r["lr"])
        for r in map(json.loads, (out / "training_log.jsonl").read_text().splitlines())
    ]


@pytest.mark.parametrize("backend,port", [("torch", 29511), ("mlx", 32511)])
def test_distributed_two_processes_match_one_with_the_same_global_batch(tiny, data, tmp_path, backend, port):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    one = tmp_path / "one"
    run([str(BIN / "mars"), *args(tiny, data, one, backend, "--grad-accumulation-steps", "2")])

    two = tmp_path / "two"
    killed_after_first_checkpoint([*launcher(backend, port), *args(tiny, data, two, backend)], two)
    resumed = run([*launcher(backend, port + 10), *args(tiny, data, two, backend, "--resume")])
    assert "resumed from" in resumed.stderr
    assert resumed.stderr.count("resumed from") == 1 and resumed.stdout.count("saved ") == 1  # rank 0 alone speaks

    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())  # rank 0 alone wrote
    a, b = losses(one), losses(two)
    assert [r[0] for r in b] == list(range(1, ITERS + 1))
    np.testing.assert_allclose(np.array(b)[:, 1:], np.array(a)[:, 1:], rtol=0, atol=TOLERANCE)
    wa, wb = weights(one), weights(two)
    assert sorted(wa) == sorted(wb) and wa
    for name in wa:
        np.testing.assert_allclose(wb[name], wa[name], rtol=0, atol=TOLERANCE, err_msg=name)
