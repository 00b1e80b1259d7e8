"""The shipped weights in vLLM, for real: exported by `mars convert --to vllm` and run through
vLLM's offline API (benchmarks/vllm_drafter.py) in the vLLM venv that `scripts/setup.sh --vllm`
builds. Greedy replies with the MARS drafter must be vLLM's own without speculation, and the
drafter must bring more than 1.5 tokens per target step."""

import json
import subprocess
from pathlib import Path

import pytest

from clitools import invoke, ok

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (.venv-vllm); scripts/setup.sh --vllm builds it"),
]


def test_shipped_weights_draft_for_vllm_with_the_targets_greedy_replies(tmp_path):
    from mars.default_model import shipped_weights

    export = tmp_path / "vllm"
    ok(invoke("convert", shipped_weights(), "--to", "vllm", "-o", export))
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_drafter.py"), str(export), "--methods", "none", "mars",
         "--limit", "6", "--max-tokens", "48", "--batch", "1", "--output", "-"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = {r["method"]: r["batches"]["1"] for r in json.loads(done.stdout.strip().splitlines()[-1])["runs"]}
    assert runs["mars"]["replies"] == runs["none"]["replies"]
    assert runs["mars"]["tokens_per_target_step"] > 1.5, runs["mars"]
    assert runs["none"]["drafts"] == 0 and runs["mars"]["drafts"] > 0
