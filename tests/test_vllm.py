"""The shipped weights in vLLM, for real, in the venv mars runs in (`scripts/setup.sh --vllm`
installs vLLM beside mars): the README's own commands (export, then the OpenAI server with the
MARS drafter) answer chat requests with `mars generate --threshold 1.0`'s replies, and vLLM's
offline API (benchmarks/vllm_drafter.py) gives its greedy replies with the drafter and more
than 1.5 tokens per target step."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from clitools import invoke, ok

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed beside mars (scripts/setup.sh --dev --vllm installs it)",
    ),
]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]
MAX_TOKENS = 48


def readme_commands() -> list[str]:
    """The shell lines of README.md's code block that serves the export with vLLM."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    block = next(b for b in blocks if "vllm.entrypoints.openai.api_server" in b)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def test_the_readme_serve_command_answers_with_the_targets_greedy_replies(tmp_path):
    """The README's lines run as written, in a directory where `weights` is the shipped weights
    and the venv's commands come first on PATH; the port is the one thing added (a free one, so
    a server already on 8000 cannot answer in its place)."""
    convert, serve = readme_commands()
    assert convert.startswith("mars convert weights --to vllm")
    (tmp_path / "weights").symlink_to(ROOT / "weights")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", convert], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        ["bash", "-c", f"{serve} --port {port}"],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 1200  # vLLM's CPU start-up on a busy 2-core machine takes minutes
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
                    served = json.loads(r.read())["data"][0]["id"]
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-4000:]
                time.sleep(2)
        replies = [
            post(
                f"{base}/v1/chat/completions",
                {
                    "model": served,
                    "messages": [{"role": "user", "content": p}],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                },
            )["choices"][0]["message"]["content"]
            for p in PROMPTS
        ]
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=60).read().decode()
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    result = ok(invoke("generate", *args, "--threshold", "1.0", "--max-tokens", MAX_TOKENS, "--json"))
    ours = [json.loads(line)["text"] for line in result.output.splitlines() if line.startswith("{")]
    assert [r.strip() for r in replies] == [o.strip() for o in ours]
    drafted = re.search(r"^vllm:spec_decode_num_drafts_total\S* (\S+)", metrics, flags=re.M)
    assert drafted and float(drafted.group(1)) > 0, "the server ran without the MARS drafter"


def test_shipped_weights_draft_for_vllm_with_the_targets_greedy_replies(tmp_path):
    from mars.checkpoint.default_model import shipped_weights

    export = tmp_path / "vllm"
    ok(invoke("convert", shipped_weights(), "--to", "vllm", "-o", export))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "vllm_drafter.py"),
            str(export),
            "--methods",
            "none",
            "mars",
            "--limit",
            "6",
            "--max-tokens",
            "48",
            "--batch",
            "1",
            "--output",
            "-",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = {r["method"]: r["batches"]["1"] for r in json.loads(done.stdout.strip().splitlines()[-1])["runs"]}
    assert runs["mars"]["replies"] == runs["none"]["replies"]
    assert runs["mars"]["tokens_per_target_step"] > 1.5, runs["mars"]
    assert runs["none"]["drafts"] == 0 and runs["mars"]["drafts"] > 0
