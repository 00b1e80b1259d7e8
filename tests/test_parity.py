"""mars.parity: the first divergence of a reply from AR's, AR's top-2 logit gap there (equal to
the gap of a plain forward computed here without mars, torch and MLX), the format's name, and
the parity fields `mars eval` writes (none in float32, where lossless is AR's output bit for bit)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from tiny import save_model

from mars import evaluate as ev
from mars import parity as pa
from mars.backends import base
from mars.cli.evaluate import evaluate_command
from mars.core.config import MarsConfig, write_config
from mars.core.tokens import encode_prompt

QUIET = dict(announce=lambda m: None)
PROMPTS = ["Hello there", "What is 2+2?", "x"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_model(tmp_path_factory.mktemp("parity") / "mars", "llama", seed=1)
    write_config(MarsConfig(block_size=4, mask_token="<unused0>", mask_token_id=3, default_threshold=0.9), path)
    return path


@pytest.mark.parametrize(
    "ar, other, expected",
    [
        ([5, 6, 7], [5, 6, 7], None),  # equal
        ([], [], None),
        ([5, 6, 7, 2], [5, 6, 7], 3),  # the other stopped earlier: the shorter length
        ([5, 6], [5, 6, 9, 2], 2),  # AR stopped earlier
        ([5, 6, 7, 8], [5, 1, 7, 8], 1),  # differing in the middle
        ([5, 6, 7], [4, 6, 7], 0),
        ([], [3], 0),
    ],
)
def test_first_divergence(ar, other, expected):
    assert pa.first_divergence(ar, other) == expected
    assert pa.common_prefix(ar, other) == (len(ar) if expected is None else expected)


def test_ulp_is_the_formats_step_at_the_logit():
    assert (
        pa.ulp(10.0, "bfloat16") == 0.0625 and pa.ulp(-16.0, "bfloat16") == 0.125 and pa.ulp(15.9, "bfloat16") == 0.0625
    )
    assert pa.ulp(1.0, "float32") == 2.0**-23 and pa.ulp(3.0, "float16") == 2.0**-9
    assert pa.ulp(1.0, None) is None and pa.ulp(1.0, "int8") is None


def hand_made(tok):
    """Prompts, 'AR' replies and other replies (any tokens: the gap is read off AR's replies
    whatever produced them) that are equal, a prefix of each other and differ in the middle."""
    prompts = [encode_prompt(tok, p) for p in PROMPTS]
    ar = [[10, 11, 12, 2], [20, 21, 22, 23], [30, 31]]
    other = [[10, 11, 12, 2], [20, 21, 40, 41], [30, 31, 32]]
    return prompts, ar, other


def check_gaps(report, prompts, ar, other, plain_logits):
    """The report's divergences against `plain_logits(ids)`: the last position's logits of a
    plain forward computed by the test."""
    assert report["identical"] == 1 and report["replies"] == 3
    divergences = {d["prompt"]: d for d in report["divergences"]}
    assert sorted(divergences) == [1, 2]
    assert {k: divergences[1][k] for k in ("position", "ar_token", "token")} == {
        "position": 2,
        "ar_token": 22,
        "token": 40,
    }
    assert {k: divergences[2][k] for k in ("position", "ar_token", "token")} == {
        "position": 2,
        "ar_token": None,
        "token": 32,
    }
    for i, d in divergences.items():
        logits = plain_logits(prompts[i] + ar[i][: d["position"]])
        top2 = np.sort(logits)[-2:]
        assert d["ar_gap"] == pytest.approx(float(top2[1] - top2[0]), abs=1e-4)
        assert d["token_gap"] == pytest.approx(float(top2[1] - logits[d["token"]]), abs=1e-4)
        assert d["token_gap"] >= d["ar_gap"] - 1e-6 and d["ulp"] == pa.ulp(float(top2[1]), "float32")
    assert report["max_ar_gap"] == max(d["ar_gap"] for d in divergences.values())


def test_torch_gap_is_a_plain_forwards_top2(model):
    import torch
    from transformers import AutoModelForCausalLM

    session = ev.load_model(model, "torch", **QUIET)
    prompts, ar, other = hand_made(session.loaded.tokenizer)
    report = pa.parity(session.decoder, session.loaded, prompts, ar, other)
    assert report["format"] == "torch float32" and report["logits_dtype"] == "float32"
    plain = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def plain_logits(ids):
        with torch.no_grad():
            return plain(torch.tensor([ids])).logits[0, -1].numpy()

    check_gaps(report, prompts, ar, other, plain_logits)
    assert "1/3 identical to AR (torch float32); 2 differ" in pa.summary(report)
    with pytest.raises(ValueError, match="one reply of each per prompt"):
        pa.parity(session.decoder, session.loaded, prompts, ar, other[:2])


def test_mlx_gap_is_a_plain_forwards_top2_and_a_quantized_model_says_its_bits(model):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    session = ev.load_model(model, "mlx", **QUIET)
    prompts, ar, other = hand_made(session.loaded.tokenizer)
    report = pa.parity(session.decoder, session.loaded, prompts, ar, other)
    assert report["format"] == "mlx float32"
    plain, _ = load(str(model))  # mlx-lm's own model and forward, untouched by mars

    def plain_logits(ids):
        return np.array(plain(mx.array([ids]))[0, -1].astype(mx.float32))

    check_gaps(report, prompts, ar, other, plain_logits)
    nn.quantize(session.loaded.model, group_size=32, bits=4)
    assert pa.number_format(session.loaded) == ("mlx 4-bit (float32)", "float32")
    assert pa.parity(session.decoder, session.loaded, prompts, ar, other)["format"] == "mlx 4-bit (float32)"
    lossless = base.plan_for_model(session.loaded, lossless=True, force=True)
    assert lossless.name == "lossless greedy (4-bit: AR's up to near-ties)"


def test_a_torch_model_names_the_dtype_it_loaded_in(model):
    session = ev.load_model(model, "torch", dtype="bfloat16", **QUIET)
    assert pa.number_format(session.loaded) == ("torch bfloat16", "bfloat16")
    # Where a forward of several tokens may round otherwise, lossless mode's name says what it keeps.
    lossless = base.plan_for_model(session.loaded, lossless=True, force=True)
    assert lossless.name == "lossless greedy (bfloat16: AR's up to near-ties)"
    float32 = ev.load_model(model, "torch", **QUIET).loaded
    assert base.plan_for_model(float32, lossless=True, force=True).name == "lossless greedy"


def test_eval_lossless_reports_parity_with_no_divergence_in_float32(model, tmp_path):
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(
        evaluate_command,
        [
            str(a)
            for a in (
                "--backend",
                "torch",
                "--model",
                model,
                "--prompts",
                _prompt_file(tmp_path),
                "--threshold",
                "1.0,0.3",
                "--force",
                "--max-tokens",
                10,
                "--no-nll",
                "--lossless",
                "--verify",
                "--output",
                out,
                "--outputs",
            )
        ],
    )
    assert r.exit_code == 0, r.output
    assert "parity lossless/h4: 3/3 identical to AR (torch float32)" in r.output and "ar_gap: AR's largest" in r.output
    rows = {row["name"]: row for row in json.loads(out.read_text())["models"][0]["sweep"]["thresholds"]}
    assert "parity" not in rows["AR greedy"] and "parity" not in rows["threshold 0.3 (probability)"]
    lossless = rows["lossless greedy"]["parity"]
    assert lossless == {
        "identical": 3,
        "replies": 3,
        "format": "torch float32",
        "logits_dtype": "float32",
        "max_ar_gap": None,
        "max_ar_gap_ulps": None,
        "divergences": [],
    }
    # The verified row at 0.3 takes unverified mask guesses: where it left AR, the divergence
    # is where the outputs first differ, and AR's own token there is the plain forward's argmax.
    verified, ar = rows["verified threshold 0.3 (probability)"], rows["AR greedy"]["outputs"]
    p = verified["parity"]
    assert p["identical"] + len(p["divergences"]) == p["replies"] == 3 and p["divergences"]
    for d in p["divergences"]:
        mine, theirs = verified["outputs"][d["prompt"]], ar[d["prompt"]]
        assert d["position"] == pa.first_divergence(theirs, mine)
        assert (d["ar_token"], d["token"]) == (theirs[d["position"]], mine[d["position"]])
        assert d["token_gap"] > 0 and d["token_gap"] >= d["ar_gap"] >= 0
    assert p["max_ar_gap"] == max(d["ar_gap"] for d in p["divergences"])


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path
