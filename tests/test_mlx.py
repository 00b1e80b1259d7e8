"""MLX backend: the same weights as the torch backend give the same training forward, the
same loss and the same decoded tokens; and the MLX decoding loop is exact on its own terms.

Tolerance across backends: float32 logits agree within 1e-4 absolute (seen: about 1e-5).
"""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from tiny import feed_of, make_plan, save_model  # noqa: E402

from mars.backends.mlx.decode import MlxDecoder  # noqa: E402
from mars.backends.mlx.decode import slot_predictions as mlx_slots  # noqa: E402
from mars.backends.mlx.forward import head, hidden_states  # noqa: E402
from mars.backends.mlx.load import load as mlx_load  # noqa: E402
from mars.backends.mlx.loss import loss_inputs as mlx_loss_inputs
from mars.backends.mlx.loss import mars_losses  # noqa: E402
from mars.backends.torch.decode import TorchDecoder  # noqa: E402
from mars.backends.torch.load import load as torch_load  # noqa: E402
from mars.backends.torch.loss import MarsLoss, loss_inputs  # noqa: E402
from mars.core.acceptance import confidence_from_logits  # noqa: E402
from mars.core.decode.loop import generate  # noqa: E402
from mars.core.decode.plan import Sampling  # noqa: E402
from mars.core.tokens import encode_prompt  # noqa: E402

PROMPTS = ["Hello there", "What is 2+2? Tell me now.", "x", "Write a short poem about the sea, please"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    path = save_model(tmp_path_factory.mktemp(request.param) / "model", request.param, seed=1)
    quiet = dict(announce=lambda m: None)
    return mlx_load(path, **quiet), torch_load(path, **quiet)


def settings(**kw):
    return make_plan(**dict(dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=24, block_cache=8), **kw))


def batch_of_two():
    ids = np.array([[5, 9, 12, 7, 30, 31, 32, 33, 34, 35, 2, 2], [8, 6, 40, 41, 42, 43, 2, 2, 2, 2, 2, 2]])
    labels = np.full(ids.shape, -100)
    labels[0, 3:12] = ids[0, 3:12]
    labels[1, 2:8] = ids[1, 2:8]
    return ids, labels, np.array([12, 8])


def test_training_forward_and_loss_agree_across_backends(pair):
    m, t = pair
    ids, labels, lengths = batch_of_two()
    L = ids.shape[1]
    mb = mlx_loss_inputs(ids, labels, lengths, 4, 3)
    tb = loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu")
    mlx_logits = np.array(head(m.model, hidden_states(m.model, mb["input_ids"], [(L, 0), (L, 0)], mb["mask"])))
    loss = MarsLoss(t.model)
    with torch.no_grad():
        torch_logits = loss.head(loss.hidden(tb["input_ids"], tb["positions"], tb["attn"])).numpy()
        tn, tc = loss(**tb)
    real = np.concatenate([np.arange(L)[None] < lengths[:, None]] * 2, axis=1)  # both streams, padding out
    np.testing.assert_allclose(mlx_logits[real], torch_logits[real], atol=ATOL, rtol=0)
    mn, mc = mars_losses(m.model, mb)
    assert float(mn) == pytest.approx(float(tn), abs=ATOL)
    assert float(mc) == pytest.approx(float(tc), abs=ATOL)


def test_trimmed_noisy_stream_gives_the_same_losses_on_both_backends(pair):
    m, t = pair
    ids = np.array([list(range(10, 24)) + [2, 2], list(range(30, 42)) + [2] * 4])
    labels = np.full(ids.shape, -100)
    labels[0, 9:14] = ids[0, 9:14]
    labels[1, 10:12] = ids[1, 10:12]
    lengths = np.array([16, 12])
    full, trimmed = (mlx_loss_inputs(ids, labels, lengths, 4, 3, trim=trim) for trim in (False, True))
    assert trimmed["start"] == 8 and trimmed["input_ids"].shape[1] == 32 - 8
    fn, fc = mars_losses(m.model, full)
    tn, tc = mars_losses(m.model, trimmed)
    assert float(tn) == pytest.approx(float(fn), rel=1e-5) and float(tc) == pytest.approx(float(fc), rel=1e-5)
    with torch.no_grad():
        torch_n, torch_c = MarsLoss(t.model)(**loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu"))
    assert float(tn) == pytest.approx(float(torch_n), abs=ATOL) and float(tc) == pytest.approx(float(torch_c), abs=ATOL)


@pytest.mark.parametrize("threshold", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_decoding_agrees_across_backends(pair, threshold, cache):
    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    s = settings(threshold=threshold, cache=cache)
    assert generate(MlxDecoder(m), prompts, s).tokens == generate(TorchDecoder(t), prompts, s).tokens


def mlx_lm_greedy(model, prompt, max_tokens):
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] == 2:
            break
    return out


@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_threshold_one_equals_mlx_lm_greedy(pair, cache):
    m, _ = pair
    for p in PROMPTS:
        prompt = encode_prompt(m.tokenizer, p)
        ours = generate(MlxDecoder(m), [prompt], settings(threshold=1.0, cache=cache)).tokens[0]
        assert ours == mlx_lm_greedy(m.model, prompt, 24)


@pytest.mark.parametrize("threshold", [1.0, 0.5, 0.1])
def test_mlx_cached_equals_uncached_and_batch_equals_single(pair, threshold):
    m, _ = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    dec = MlxDecoder(m)
    for cache in ("window", "block"):
        s = settings(threshold=threshold, cache=cache)
        batch = generate(dec, prompts, s).tokens
        singles = [generate(dec, [p], s).tokens[0] for p in prompts]
        assert batch == singles
        if cache == "window":
            assert singles == [
                generate(dec, [p], settings(threshold=threshold, cache="none")).tokens[0] for p in prompts
            ]


def test_mlx_confidences_match_the_reference():
    logits = np.random.default_rng(0).normal(size=(3, 5, 40)).astype(np.float32) * 3
    for metric in ("probability", "entropy", "margin"):
        ids, conf = mlx_slots(mx.array(logits), metric, Sampling())
        ref_ids, ref_conf = confidence_from_logits(logits, metric)
        assert np.array(ids).tolist() == ref_ids.tolist()
        np.testing.assert_allclose(np.array(conf), ref_conf, rtol=1e-5, atol=1e-6)


def test_mlx_sampling_is_seeded_and_top_k_one_is_greedy(pair):
    m, _ = pair
    prompt = [encode_prompt(m.tokenizer, "Hello there")]
    greedy = generate(MlxDecoder(m), prompt, settings(threshold=1.0)).tokens
    top1 = generate(
        MlxDecoder(m), prompt, settings(threshold=1.0, sampling=Sampling(temperature=1.0, top_k=1, seed=0))
    ).tokens
    assert top1 == greedy
    for lossless in (False, True):  # a vanishing temperature is greedy, not a NaN distribution
        tiny = Sampling(temperature=1e-69, seed=0)
        assert (
            generate(MlxDecoder(m), prompt, settings(threshold=0.5, lossless=lossless, sampling=tiny)).tokens
            == generate(MlxDecoder(m), prompt, settings(threshold=1.0 if lossless else 0.5)).tokens
        )
    s = settings(threshold=0.5, sampling=Sampling(temperature=1.5, top_p=0.9, seed=7))
    assert generate(MlxDecoder(m), prompt, s).tokens == generate(MlxDecoder(m), prompt, s).tokens


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from mars.backends.mlx.load import MlxModelError

    path = save_model(tmp_path / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlxModelError, match="'gpt2' is not supported .*llama, qwen2, qwen3"):
        mlx_load(path, announce=lambda m: None)


def test_quantized_mlx_lm_model_decodes_like_mlx_lm(tmp_path):
    from mlx_lm import convert

    src = save_model(tmp_path / "hf", "llama", seed=1)
    quantized = tmp_path / "q4"
    convert(str(src), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    m = mlx_load(quantized, announce=lambda m: None)
    assert "QuantizedLinear" in type(m.model.model.layers[0].self_attn.q_proj).__name__
    for p in PROMPTS[:2]:
        prompt = encode_prompt(m.tokenizer, p)
        ours = generate(MlxDecoder(m), [prompt], settings(threshold=1.0)).tokens[0]
        assert ours == mlx_lm_greedy(m.model, prompt, 24)
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    s = settings(threshold=0.3)
    assert generate(MlxDecoder(m), prompts, s).tokens == [generate(MlxDecoder(m), [p], s).tokens[0] for p in prompts]


def test_both_backends_choose_the_same_mask_token(pair):
    from mars.backends.mlx.load import ensure_mask_token as mlx_mask
    from mars.backends.torch.load import ensure_mask_token as torch_mask

    m, t = pair
    a = mlx_mask(m.model, m.tokenizer, None, block_size=4, exclude=m.eos_ids, announce=lambda x: None)
    b = torch_mask(t.model, t.tokenizer, None, block_size=4, exclude=t.eos_ids, announce=lambda x: None)
    assert a == b and not a.mask_token_added


@pytest.mark.parametrize("cache", ["none", "window", "block"])
@pytest.mark.parametrize("B", [2, 4, 7])
def test_mlx_lossless_equals_ar_on_both_backends(pair, cache, B):
    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    ar = generate(TorchDecoder(t), prompts, settings(threshold=1.0, cache=cache, block_size=B)).tokens
    for hedge in (0, None):  # without and with spare mask groups (window and no cache)
        s = settings(lossless=True, cache=cache, block_size=B, hedge=hedge)
        out = generate(MlxDecoder(m), prompts, s)
        assert out.tokens == ar
        assert [generate(MlxDecoder(m), [p], s).tokens[0] for p in prompts] == ar
        # the same drafts on both backends: the same forwards
        assert out.stats.row_forwards == generate(TorchDecoder(t), prompts, s).stats.row_forwards


@pytest.mark.parametrize("cached", [False, True])
def test_mlx_spare_groups_see_only_what_precedes_them(pair, cached):
    from test_lossless import check_spare_groups

    m, _ = pair
    check_spare_groups(MlxDecoder(m), [encode_prompt(m.tokenizer, p) for p in PROMPTS[:3]], cached)


@pytest.mark.parametrize("cached", [False, True])
def test_mlx_alternative_groups_see_only_what_precedes_them(pair, cached):
    from test_lossless import check_alternative_groups

    m, _ = pair
    check_alternative_groups(MlxDecoder(m), [encode_prompt(m.tokenizer, p) for p in PROMPTS[:3]], cached)


def test_mlx_alternative_groups_equal_torch_and_ar(pair):
    """Runners-up on the device (a partition and a sort) are torch's (a top-k): the same
    alternative groups, the same tokens taken from them, AR's output."""
    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    ar = generate(TorchDecoder(t), prompts, settings(threshold=1.0)).tokens
    s = settings(lossless=True, alternatives=2, hedge=1)
    out = generate(MlxDecoder(m), prompts, s)
    ref = generate(TorchDecoder(t), prompts, s)
    assert out.tokens == ar == ref.tokens
    assert out.stats.by_source() == ref.stats.by_source() and out.stats.by_source().get("alt", 0) > 0


@pytest.mark.parametrize("steep", [False, True])
def test_mlx_lossless_sampling_matches_ar_sampling(tmp_path, steep):
    """Also with the cost-aware feed on a steep curve: most steps feed no mask (AR's feed,
    where the backend draws no proposals), a few probe with masks."""
    from collections import Counter

    import test_lossless
    from test_lossless import N_TOKENS, chi_square_p, exact_distribution

    from mars.core.decode.cost import CostCurve

    path = save_model(tmp_path / "model", "llama", seed=3, scale=0.15)
    m, t = mlx_load(path, announce=lambda m: None), torch_load(path, announce=lambda m: None)
    prompt = encode_prompt(m.tokenizer, "Hi")
    expected = exact_distribution(t.model, prompt)
    s = settings(lossless=True, max_tokens=N_TOKENS, block_size=3, sampling=test_lossless.SAMPLING)
    dec, counts, kept, verified, n = MlxDecoder(m), Counter(), 0, 0, 3000
    feed = feed_of(CostCurve({1: 1.0, 2: 2.0, 64: 64.0}, refresh=0.0), explore=1) if steep else None
    for _ in range(n // 500):
        res = generate(dec, [prompt] * 500, s, controller=feed)
        counts.update(tuple(x) for x in res.tokens)
        kept += res.stats.draft_totals()["kept_per_slot"][0]
        verified += res.stats.draft_totals()["verified_per_slot"][0]
    if steep:  # steps with and without masks; at 500 rows no draft pays for widening the step
        (policy,) = feed.feeds.values()
        probes = sum(n for (m, _), n in policy.choices.items() if m)
        assert 0 < probes < policy.choices[(0, 0)], policy.choices
    else:
        assert 0 < kept < verified
    assert chi_square_p(counts, expected, n) > 1e-3


@pytest.mark.parametrize("curve", [{1: 1.0, 64: 1.0}, {1: 1.0, 64: 64.0}, {1: 1.0, 4: 1.2, 16: 2.0}])
def test_cost_aware_lossless_with_ngram_drafts_is_ar_on_both_backends(pair, curve):
    from mars.core.decode.cost import CostCurve

    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    ar = generate(MlxDecoder(m), prompts, settings(threshold=1.0)).tokens
    s = settings(lossless=True, ngram=6)
    for dec in (MlxDecoder(m), TorchDecoder(t)):
        for batch in (1, 3):
            out = []
            for start in range(0, len(prompts), batch):
                out += generate(
                    dec, prompts[start : start + batch], s, controller=feed_of(CostCurve(dict(curve), refresh=0.0))
                ).tokens
            assert out == ar, (type(dec).__name__, batch)


def test_lossless_with_corpus_drafts_is_ar_on_both_backends(pair):
    from mars.core.decode.cost import CostCurve
    from mars.core.decode.drafts.corpus import DraftCorpus

    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    ar = generate(MlxDecoder(m), prompts, settings(threshold=1.0)).tokens
    shifted = [p[1:] for p in prompts]  # what the model says after a few tokens it has said before
    book = DraftCorpus(
        [p + r for p, r in zip(shifted, generate(MlxDecoder(m), shifted, settings(threshold=1.0)).tokens)]
    )
    s = settings(lossless=True, ngram=6, corpus=book)
    sources = []
    for dec in (MlxDecoder(m), TorchDecoder(t)):
        result = generate(dec, prompts, s, controller=feed_of(CostCurve({1: 1.0, 64: 1.0}, refresh=0.0)))
        assert result.tokens == ar, type(dec).__name__
        sources.append(result.stats.by_source())
    assert sources[0] == sources[1] and sources[0].get("corpus", 0) > 0


@pytest.mark.parametrize("cache", ["none", "window"])
def test_verified_threshold_mode_is_the_same_on_both_backends(pair, cache):
    m, t = pair
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    unverified = 0
    for tau in (0.2, 0.5, 0.9):
        s = settings(threshold=tau, cache=cache, verify=True, ngram=6)
        mlx_out = generate(MlxDecoder(m), prompts, s)
        torch_out = generate(TorchDecoder(t), prompts, s)
        assert mlx_out.tokens == torch_out.tokens, tau
        assert mlx_out.stats.by_source() == torch_out.stats.by_source()
        assert [generate(MlxDecoder(m), [p], s).tokens[0] for p in prompts] == mlx_out.tokens
        unverified += mlx_out.stats.by_source().get("threshold", 0)
    assert unverified > 0  # confident tokens were taken unverified, not only verified ones
