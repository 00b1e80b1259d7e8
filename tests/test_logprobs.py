"""Log-probabilities of generated tokens (the plan's `logprobs`): asking for them changes neither the
tokens nor the mode; AR and lossless tokens carry the model's own next-token log-probability, taken
from the forward that produced or verified them (equal, in float32, to a plain forward of the prompt
and reply); a threshold token taken from a mask carries that mask's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import PROMPTS, make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode.loop import generate
from mars.core.decode.plan import Mode, Sampling

MASK, EOS = 3, 2
TOP = 3


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tm(tok):
    return TorchModel(make_model("llama", len(tok), seed=3), tok, None, "", torch.device("cpu"), torch.float32)


def prompts_of(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def plan(**kw):
    return make_plan(**{"mask_id": MASK, "eos_ids": (EOS,), "block_size": 3, "max_tokens": 20, **kw})


def plain_logprobs(tm, prompt, reply) -> np.ndarray:
    """(len(reply), vocab): log-softmax of a plain causal forward at each reply token's place."""
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logits = tm.model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + len(reply) - 1].numpy()


PLANS = {
    "ar": dict(threshold=1.0),
    "lossless": dict(lossless=True, ngram=6, alternatives=2),
    "lossless-block": dict(lossless=True, cache="block", block_cache=6),
    "lossless-none": dict(lossless=True, cache="none", ngram=6),
    "threshold": dict(threshold=0.3),
    "verified": dict(threshold=0.3, verify=True, ngram=6),
    "sampled-lossless": dict(lossless=True, sampling=Sampling(temperature=0.8, seed=5)),
    "sampled-ar": dict(threshold=1.0, sampling=Sampling(temperature=0.8, seed=5)),
    "lossless-tree": dict(lossless=True, tree=8),
    "sampled-lossless-tree": dict(lossless=True, tree=8, sampling=Sampling(temperature=1.0, top_k=4, seed=5)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_logprobs_change_neither_tokens_nor_mode(tm, tok, name):
    prompts = prompts_of(tok, PROMPTS[:3])
    without = plan(**PLANS[name])
    asked = plan(**PLANS[name], logprobs=TOP)
    assert asked.name == without.name and asked.mode is without.mode
    a = generate(TorchDecoder(tm), prompts, without)
    b = generate(TorchDecoder(tm), prompts, asked)
    assert a.tokens == b.tokens and a.logprobs is None
    assert [len(lp) for lp in b.logprobs] == [len(t) for t in b.tokens]
    for row in b.logprobs:
        for entry in row:
            assert entry.logprob <= 0.0 and len(entry.top) == TOP
            assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


@pytest.mark.parametrize(
    "name",
    ["ar", "lossless", "lossless-block", "lossless-none", "sampled-lossless", "sampled-ar"]
    + ["lossless-tree", "sampled-lossless-tree"],
)
def test_ar_and_lossless_logprobs_equal_a_plain_forward(tm, tok, name):
    """Every token's log-probability (and the top ids') as a plain forward of prompt + reply computes
    them, in float32, to 1e-5, drafts kept by verification included."""
    prompts = prompts_of(tok, PROMPTS[:4])
    result = generate(TorchDecoder(tm), prompts, plan(**PLANS[name], logprobs=TOP))
    for prompt, reply, entries in zip(prompts, result.tokens, result.logprobs):
        want = plain_logprobs(tm, prompt, reply)
        got = np.array([e.logprob for e in entries])
        np.testing.assert_allclose(got, want[np.arange(len(reply)), reply], atol=1e-5)
        for j, e in enumerate(entries):
            np.testing.assert_allclose([v for _, v in e.top], np.sort(want[j])[::-1][:TOP], atol=1e-5)
    if name.startswith("lossless"):
        kept = sum(sum(r.kept_per_slot) for r in result.stats.rows)
        assert kept > 0, "no draft was kept: the verified tokens' path went untested"
    if name.endswith("tree"):
        assert result.stats.by_source().get("tree", 0) > 0, "no tree node was taken: its path went untested"


@pytest.mark.parametrize("name", ["threshold", "verified"])
def test_a_token_taken_from_a_mask_carries_the_masks_distribution(tm, tok, name):
    """Greedy threshold tokens are each the most likely id of the distribution they were read from, so
    each carries that distribution's top entry; tokens from masks are among them."""
    prompts = prompts_of(tok, PROMPTS[:4])
    s = plan(**PLANS[name], logprobs=TOP)
    assert s.mode is (Mode.VERIFIED if name == "verified" else Mode.THRESHOLD)
    result = generate(TorchDecoder(tm), prompts, s)
    from_masks = 0
    for prompt, reply, entries in zip(prompts, result.tokens, result.logprobs):
        want = plain_logprobs(tm, prompt, reply)
        for j, (token, e) in enumerate(zip(reply, entries)):
            assert e.top[0] == (token, pytest.approx(e.logprob, abs=1e-6))
            from_masks += abs(e.logprob - want[j, token]) > 1e-4  # not the model's own distribution there
    assert from_masks > 0, "no token came from a mask: the masks' path went untested"


def test_logprobs_bounds():
    with pytest.raises(ValueError, match="logprobs"):
        plan(threshold=1.0, logprobs=21)
    assert plan(threshold=1.0, logprobs=0).logprobs == 0


@pytest.mark.parametrize("name", ["lossless", "sampled-lossless-tree"])
def test_mlx_lossless_logprobs_equal_a_plain_forward(tok, tmp_path, name):
    pytest.importorskip("mlx_lm")
    from tiny import save_model

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load

    path = save_model(tmp_path / "m", "llama", seed=3)
    m = load(str(path), announce=lambda s: None)
    prompts = prompts_of(m.tokenizer, PROMPTS[:2])
    result = generate(MlxDecoder(m), prompts, plan(**PLANS[name], logprobs=2))
    if name.endswith("tree"):
        assert result.stats.by_source().get("tree", 0) > 0, "no tree node was taken: its path went untested"
    tm = TorchModel(make_model("llama", len(tok), seed=3), tok, None, "", torch.device("cpu"), torch.float32)
    for prompt, reply, entries in zip(prompts, result.tokens, result.logprobs):
        want = plain_logprobs(tm, prompt, reply)
        np.testing.assert_allclose([e.logprob for e in entries], want[np.arange(len(reply)), reply], atol=1e-4)


def test_the_same_logprobs_from_python_and_the_cli(tmp_path, tok):
    """One code path: Session (Python) and `mars generate --json --logprobs N` give a reply's tokens the
    same log-probabilities (the server's equal a plain forward's, as these do: tests/test_serve.py)."""
    import json

    from clitools import invoke, ok
    from tiny import save_model

    from mars.session import Session, token_logprobs

    path = save_model(tmp_path / "m", "llama", seed=3)
    session = Session(str(path), backend="torch", device="cpu", announce=lambda m: None)
    s = session.plan(threshold=1.0, max_tokens=12, logprobs=2)
    ids = session.encode([PROMPTS[1]])
    decoded = session.decode(ids, s)
    py = token_logprobs(session.tokenizer, decoded.tokens[0], decoded.logprobs[0])
    out = ok(
        invoke(
            "generate",
            "--model",
            path,
            "--prompt",
            PROMPTS[1],
            "--max-tokens",
            12,
            "--threshold",
            1.0,
            "--device",
            "cpu",
            "--json",
            "--logprobs",
            2,
        )
    )
    cli = json.loads(out.stdout.strip().splitlines()[-1])["logprobs"]
    assert [t["token"] for t in cli] == [t["token"] for t in py]
    assert [t["logprob"] for t in cli] == pytest.approx([t["logprob"] for t in py], abs=1e-6)
    assert [len(t["top_logprobs"]) for t in cli] == [2] * len(cli)
    assert invoke("generate", "--model", path, "--prompt", "x", "--logprobs", 2).exit_code != 0  # needs --json


def test_the_logprobs_benchmark_runs_both_plans_with_and_without(tiny, tmp_path):
    import json

    from tiny import load_script

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    script = load_script("benchmarks/logprobs_cost.py")
    report = script.main(
        ["--model", str(tiny), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "6", "--repeats", "2"]
        + ["--feed", "fixed", "--top", "3"]
    )
    assert [r["plan"] for r in report["rows"]] == ["ar", "default"]
    assert all(r["same_tokens"] and r["tok_s_with"] > 0 and r["tok_s_without"] > 0 for r in report["rows"])
