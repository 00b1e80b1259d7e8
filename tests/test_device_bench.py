"""scripts/device_bench.py, the GPU benchmark call, dry-run on the CPU with a tiny MARS
checkpoint: every configuration in every part, float32 lossless identical to our AR, the
masks' share computed from the sources, and the call's budget honoured (the first part always
runs; what does not fit is skipped and said so), whatever the machine's speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import invoke, ok

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_bench.py"
CONFIGS = {
    "ar-kv-cache",
    "transformers.generate",
    "transformers lookup 3",
    "lossless (default)",
    "verified t=0.5",
    "mars-window t=0.5",
}


@pytest.fixture(scope="module")
def checkpoint(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "adapter"
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
            3,
            "--batch-size",
            4,
            "--learning-rate",
            1e-2,
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--no-draft-corpus",
        )
    )
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Spell from c", "Spell from f", "hello")))
    return out, prompts


def dry_run(checkpoint, out, *extra):
    adapter, prompts = checkpoint
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--model",
        str(adapter),
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "--limit",
        "3",
        "--max-tokens",
        "6",
        "--threshold",
        "0.5",
        "--prompt-lookup",
        "3",
        "--forward-ks",
        "1,2",
        "--repeats",
        "1",
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "device_bench.json").read_text()), done


def test_the_device_benchmark_dry_runs_on_the_cpu(checkpoint, tmp_path):
    report, done = dry_run(checkpoint, tmp_path / "out", "--batches", "1,2", "--minutes", "600", "--compile", "off")
    assert [(p["dtype"], p["batch"]) for p in report["parts"]] == [
        ("float32", 1),
        ("float32", 2),
        ("bfloat16", 1),
        ("bfloat16", 2),
    ]
    assert report["skipped"] == []
    for part in report["parts"]:
        rows = {r["name"]: r for r in part["rows"]}
        assert set(rows) == CONFIGS, set(rows)
        near_ties = "" if part["dtype"] == "float32" else f" ({part['dtype']}: AR's up to near-ties)"
        assert rows["lossless (default)"]["mode"] == "lossless greedy" + near_ties
        assert rows["verified t=0.5"]["mode"].startswith("verified threshold 0.5")
        assert rows["mars-window t=0.5"]["mode"].startswith("threshold 0.5")
        for r in part["rows"]:
            assert r["tokens"] > 0 and r["tokens_per_s"] > 0
        sources = rows["lossless (default)"]["tokens_by_source"]
        extra = sum(n for k, n in sources.items() if k != "ar")
        share = rows["lossless (default)"]["masks_share"]
        assert (
            share is None
            if extra == 0
            else share == round(sum(sources.get(k, 0) for k in ("masks", "spare")) / extra, 4)
        )
        if part["dtype"] == "float32":  # lossless is exact in float32, and our AR is transformers' greedy
            assert rows["lossless (default)"]["replies_equal_to_ar"] == 1.0
            assert part["ar_matches_transformers_generate"] is True
    assert report["parts"][0]["forward_cost"] and not report["parts"][1]["forward_cost"]  # the cost curve once
    verdict = report["verdict"]
    assert verdict["lossless_every_reply_identical"] is True
    assert verdict["lossless_target_met"] == (verdict["lossless_x_ar"] >= 1.6)
    assert json.loads(done.stdout.strip().splitlines()[-1])["verdict"] == verdict
    assert "float32, batch 1" in done.stdout and "lossless (default)" in done.stdout
    # After the parts, where a step's time goes on this device, beside device_bench.json.
    parts = report["step_parts"]
    assert parts["replies_equal_to_ar"] == 3 and (tmp_path / "out" / parts["file"]).is_file()
    for mode in ("AR", "lossless"):
        m = parts["modes"][mode]
        assert m["ms_per_step"] > 0 and set(m["parts_ms_per_step"]) == {"forward", "reduce + D2H", "host"}
        assert m["d2h_per_step"] == 1.0 and m["h2d_per_step"] == 1.0


def test_a_spent_budget_runs_the_first_part_and_says_what_it_skipped(checkpoint, tmp_path):
    report, _ = dry_run(
        checkpoint, tmp_path / "out", "--batches", "1,8", "--dtypes", "float32,bfloat16", "--minutes", "0",
        "--compile", "off",
    )  # fmt: skip
    assert [(p["dtype"], p["batch"]) for p in report["parts"]] == [("float32", 1)]
    # step_parts comes right after the first part, where the budget leaves it time
    assert [s.get("part") or (s["dtype"], s["batch"]) for s in report["skipped"]] == [
        "step_parts",
        ("float32", 8),
        ("bfloat16", 1),
        ("bfloat16", 8),
    ]
    assert all("left of --minutes 0" in s["why"] for s in report["skipped"]) and "step_parts" not in report


def test_each_part_runs_eager_then_compiled_and_says_what_compiling_bought(checkpoint, tmp_path):
    report, done = dry_run(
        checkpoint, tmp_path / "out", "--batches", "1", "--dtypes", "float32", "--minutes", "600", "--step-parts", "off"
    )
    assert [(p["dtype"], p["batch"], p["compiled"]) for p in report["parts"]] == [
        ("float32", 1, False),
        ("float32", 1, True),
    ]
    eager, compiled = report["parts"]
    assert set(compiled["x_eager"]) == {r["name"] for r in eager["rows"]}
    assert all(x > 0 for x in compiled["x_eager"].values())
    rows = {r["name"]: r for r in compiled["rows"]}
    assert rows["lossless (default)"]["replies_equal_to_ar"] == 1.0  # compiled, still AR's
    assert report["verdict"]["compiled_x_eager"] == compiled["x_eager"]
    assert "float32, batch 1, compiled" in done.stdout


def test_a_part_that_fails_is_recorded_and_the_other_kinds_still_run(checkpoint, tmp_path, monkeypatch, capsys):
    """A compiled step this device cannot run must not cost the call the parts after it: the part's
    error is kept under "failed", the rest of its kind (the same session) is not run, the other kinds
    are, and the call exits 1 with the JSON written."""
    import importlib.util

    import mars.bench

    spec = importlib.util.spec_from_file_location("device_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    real = mars.bench.run_benchmark

    def run_benchmark(session, ids, settings):
        if session.compile:
            raise RuntimeError("no working compiler on this device\nthe rest of the trace")
        return real(session, ids, settings)

    monkeypatch.setattr(mars.bench, "run_benchmark", run_benchmark)
    adapter, prompts = checkpoint
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(adapter), "--device", "cpu", "--prompts", str(prompts), "--limit", "2",
            "--max-tokens", "4", "--threshold", "0.5", "--prompt-lookup", "3", "--forward-ks", "1,2", "--repeats", "1",
            "--batches", "1,2", "--dtypes", "float32,bfloat16", "--minutes", "600", "--compile", "both",
            "--step-parts", "off"]  # fmt: skip
    assert bench.main(argv) == 1
    report = json.loads((out / "device_bench.json").read_text())
    assert [(p["dtype"], p["batch"], p["compiled"]) for p in report["parts"]] == [
        ("float32", 1, False),
        ("float32", 2, False),
        ("bfloat16", 1, False),
        ("bfloat16", 2, False),
    ]
    assert [(f["dtype"], f["batch"], f["compiled"]) for f in report["failed"]] == [
        ("float32", 1, True),
        ("bfloat16", 1, True),
    ]
    assert all(f["error"] == "RuntimeError: no working compiler on this device" for f in report["failed"])
    assert "run_benchmark" in report["failed"][0]["traceback"]
    assert "failed: float32, batch 1, compiled: RuntimeError" in capsys.readouterr().err


def test_bad_options_stop_before_any_work(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "o"), "--dtypes", "float64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--dtypes takes float32 and/or bfloat16" in done.stderr
    assert not (tmp_path / "o").exists()
