"""PyTorch backend: the training forward against plain causal forwards, and decoding exactness.

Tiny random float32 models (llama and qwen2 shapes) initialised at a large scale so
their logits are peaked: greedy argmax then does not depend on the shape of the
forward that produced it, and exact token equality is a fair test.
"""

import numpy as np
import pytest
import torch
from tiny import make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder, slot_predictions
from mars.backends.torch.load import TorchModel
from mars.backends.torch.loss import MarsLoss, loss_inputs
from mars.core.acceptance import confidence_from_logits
from mars.core.decode.loop import generate
from mars.core.decode.plan import Sampling
from mars.core.loss import IGNORE
from mars.core.masks import training_inputs

ARCHS = ["llama", "qwen2"]
MASK = 3
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module", params=ARCHS)
def tm(request, tok):
    model = make_model(request.param, len(tok), seed=1)
    return TorchModel(model, tok, None, "", torch.device("cpu"), torch.float32)


def prompts_of(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


PROMPTS = ["Hello there", "What is 2+2? Tell me now.", "x", "Write a short poem about the sea, please"]


def settings(**kw):
    base = dict(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=24, block_cache=8)
    base.update(kw)
    return make_plan(**base)


def hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return out[0, len(prompt) :].tolist()


# -- training forward --------------------------------------------------------------------------


def training_batch(tok, B=4):
    rows = [([5, 9, 12, 7, 30, 31, 32, 33, 34, 35], 3), ([8, 6, 40, 41, 42, 43], 2)]
    L = max(-(-len(r) // B) * B for r, _ in rows)
    ids = np.full((len(rows), L), EOS)
    labels = np.full((len(rows), L), IGNORE)
    lengths = []
    for i, (r, prompt_len) in enumerate(rows):
        n = -(-len(r) // B) * B
        ids[i, : len(r)] = r
        labels[i, prompt_len : len(r)] = r[prompt_len:]
        labels[i, len(r) : n] = EOS  # EOS block padding is labelled
        lengths.append(n)
    return ids, labels, np.array(lengths)


def plain_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


def test_training_forward_streams_equal_plain_causal_forwards(tm, tok):
    B = 4
    ids, labels, lengths = training_batch(tok, B)
    input_ids, positions, _ = training_inputs(ids, labels, lengths, B, MASK)
    inputs = loss_inputs(ids, labels, lengths, B, MASK, torch.float32, "cpu")
    loss = MarsLoss(tm.model)
    with torch.no_grad():
        hidden = loss.hidden(inputs["input_ids"], inputs["positions"], inputs["attn"])
        logits = loss.head(hidden)
    L = ids.shape[1]
    for r in range(len(ids)):
        n = lengths[r]
        # Clean stream: exactly the plain causal forward of the row.
        ref = plain_logits(tm.model, ids[r, :n].tolist())
        torch.testing.assert_close(logits[r, L : L + n], ref, atol=2e-5, rtol=1e-4)
        # Noisy stream: at index q, the plain forward of clean earlier blocks + its own block's noisy prefix.
        for q in range(n):
            start = (q // B) * B
            seq = ids[r, :start].tolist() + input_ids[r, start : q + 1].tolist()
            torch.testing.assert_close(logits[r, q], plain_logits(tm.model, seq)[-1], atol=2e-5, rtol=1e-4)


def test_mars_loss_matches_a_direct_computation(tm, tok):
    B, alpha = 4, 0.7
    ids, labels, lengths = training_batch(tok, B)
    inputs = loss_inputs(ids, labels, lengths, B, MASK, torch.float32, "cpu")
    loss = MarsLoss(tm.model)
    with torch.no_grad():
        noisy, clean = loss(**inputs)
        logits = torch.log_softmax(loss.head(loss.hidden(inputs["input_ids"], inputs["positions"], inputs["attn"])), -1)
    L = ids.shape[1]
    per_row_noisy, per_row_clean = [], []
    for r in range(len(ids)):
        t = [i for i in range(1, L) if labels[r, i] != IGNORE]
        per_row_noisy.append(np.mean([-float(logits[r, i - 1, labels[r, i]]) for i in t]))
        per_row_clean.append(np.mean([-float(logits[r, L + i - 1, labels[r, i]]) for i in t]))
    assert float(noisy) == pytest.approx(np.mean(per_row_noisy), rel=1e-5)
    assert float(clean) == pytest.approx(np.mean(per_row_clean), rel=1e-5)
    assert float(noisy + alpha * clean) == pytest.approx(
        np.mean(per_row_noisy) + alpha * np.mean(per_row_clean), rel=1e-5
    )


def long_prompt_batch(B=4):
    """Two rows whose prompts fill the first two blocks: the noisy stream can start at 8."""
    rows = [(list(range(10, 24)), 9), (list(range(30, 42)), 10)]
    L = max(-(-len(r) // B) * B for r, _ in rows)
    ids = np.full((len(rows), L), EOS)
    labels = np.full((len(rows), L), IGNORE)
    for i, (r, prompt_len) in enumerate(rows):
        ids[i, : len(r)] = r
        labels[i, prompt_len : len(r)] = r[prompt_len:]
    return ids, labels, np.array([-(-len(r) // B) * B for r, _ in rows])


def test_trimmed_noisy_stream_gives_the_same_losses_and_gradients(tm):
    ids, labels, lengths = long_prompt_batch()
    loss = MarsLoss(tm.model)
    results = []
    for trim in (False, True):
        inputs = loss_inputs(ids, labels, lengths, 4, MASK, torch.float32, "cpu", trim=trim)
        tm.model.zero_grad()
        noisy, clean = loss(**inputs)
        (noisy + clean).backward()
        grads = [p.grad.clone() for p in tm.model.parameters() if p.grad is not None]
        results.append((inputs["input_ids"].shape[1], float(noisy), float(clean), grads))
    tm.model.zero_grad()
    (n_full, *full), (n_trim, *trimmed) = results
    assert (n_full, n_trim) == (2 * 16, 2 * 16 - 8)
    assert trimmed[0] == pytest.approx(full[0], rel=1e-5) and trimmed[1] == pytest.approx(full[1], rel=1e-5)
    for a, b in zip(full[2], trimmed[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# -- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_threshold_one_is_greedy_ar(tm, tok, cache):
    dec = TorchDecoder(tm)
    for prompt in prompts_of(tok, PROMPTS):
        ours = generate(dec, [prompt], settings(threshold=1.0, cache=cache)).tokens[0]
        assert ours == hf_greedy(tm.model, prompt, 24)


@pytest.mark.parametrize("threshold", [1.0, 0.9, 0.5, 0.1])
def test_cached_window_equals_uncached(tm, tok, threshold):
    dec = TorchDecoder(tm)
    masks_taken = 0
    for prompt in prompts_of(tok, PROMPTS):
        plain = generate(dec, [prompt], settings(threshold=threshold, cache="none"))
        cached = generate(dec, [prompt], settings(threshold=threshold, cache="window"))
        assert cached.tokens == plain.tokens
        assert cached.stats.forwards == plain.stats.forwards
        masks_taken += sum(cached.stats.rows[0].accepted_per_slot[1:])
    # At 0.5 and 0.1 the comparison covers accepted mask slots, not only plain AR steps (this
    # untrained model's masks never reach 0.9; 1.0 takes none by rule).
    if threshold <= 0.5:
        assert masks_taken > 0
    elif threshold == 1.0:
        assert masks_taken == 0


@pytest.mark.parametrize("cache", ["none", "window", "block"])
@pytest.mark.parametrize("threshold", [1.0, 0.5, 0.1])
def test_batch_rows_equal_single_rows(tm, tok, cache, threshold):
    dec = TorchDecoder(tm)
    prompts = prompts_of(tok, PROMPTS)
    s = settings(threshold=threshold, cache=cache)
    batch = generate(dec, prompts, s)
    # Below 1.0 the rows compared took mask slots, not only plain AR steps.
    assert (sum(sum(r.accepted_per_slot[1:]) for r in batch.stats.rows) > 0) == (threshold < 1.0)
    for i, prompt in enumerate(prompts):
        alone = generate(dec, [prompt], s)
        assert batch.tokens[i] == alone.tokens[0]
        assert batch.stats.rows[i].accepted == alone.stats.rows[0].accepted
        if cache != "block":  # in the block cache a row may wait for the others
            assert batch.stats.rows[i].forwards == alone.stats.rows[0].forwards


def test_low_threshold_accepts_several_tokens_and_counts_them(tm, tok):
    dec = TorchDecoder(tm)
    s = settings(threshold=0.0, max_tokens=20)  # accepts every slot: B + 1 tokens per forward
    res = generate(dec, prompts_of(tok, ["Hello there"]), s)
    row = res.stats.rows[0]
    assert row.accepted == len(res.tokens[0])
    assert row.forwards == res.stats.forwards
    # Every forward but the last takes all B + 1 slots (the last may stop at EOS or the limit):
    # checked whether the reply ran to the limit or ended on EOS, so the test cannot pass idly.
    assert row.forwards >= 2
    assert all(n >= row.forwards - 1 for n in row.accepted_per_slot)
    assert row.accepted >= 5 * (row.forwards - 1) + 1
    if res.finish[0] == "length":
        assert len(res.tokens[0]) == 20  # never overshoots max_tokens
        assert row.forwards == 4  # 5 + 5 + 5 + 5
    else:
        assert res.finish[0] == "eos"
    assert row.accepted_per_slot[0] == row.forwards


def test_block_cache_counts_waiting_apart(tm, tok):
    dec = TorchDecoder(tm)
    res = generate(dec, prompts_of(tok, PROMPTS), settings(threshold=0.3, cache="block", block_cache=8))
    for r, out in zip(res.stats.rows, res.tokens):
        assert r.accepted == len(out)
        assert r.forwards + r.waited <= res.stats.forwards
    # Waiting is counted: some row filled its block before the others and waited, and the row
    # that finished last was in every forward, each one either taking tokens or waiting.
    assert sum(r.waited for r in res.stats.rows) > 0
    assert max(r.forwards + r.waited for r in res.stats.rows) == res.stats.forwards


def test_eos_stops_and_drops_what_follows(tok):
    model = make_model("llama", len(tok), seed=3)
    # Unpacked: a packed head's product (packed.pack_head) does not run the module's forward hooks.
    dec = TorchDecoder(TorchModel(model, tok, None, "", torch.device("cpu"), torch.float32), pack=False)

    # Every slot after the first predicts EOS, confidently; slot 0 predicts its usual token.
    def favour_eos(module, args, out):
        out = out.clone()
        out[:, 1:, EOS] += 1000.0
        return out

    handle = model.lm_head.register_forward_hook(favour_eos)
    try:
        res = generate(dec, prompts_of(tok, ["hi"]), settings(threshold=0.5))
    finally:
        handle.remove()
    assert len(res.tokens[0]) == 2 and res.tokens[0][-1] == EOS and res.finish == ["eos"]
    assert res.stats.rows[0].accepted == 2 and res.stats.forwards == 1


def test_device_confidences_match_the_reference(tm):
    logits = torch.randn(3, 5, 40) * 3
    for metric in ("probability", "entropy", "margin"):
        ids, conf = slot_predictions(logits, metric, Sampling())
        ref_ids, ref_conf = confidence_from_logits(logits.numpy(), metric)
        assert ids.tolist() == ref_ids.tolist()
        np.testing.assert_allclose(conf.numpy(), ref_conf, rtol=1e-5, atol=1e-6)


def test_sampling_is_seeded_and_top_k_one_is_greedy(tm, tok):
    dec = TorchDecoder(tm)
    prompt = prompts_of(tok, ["Hello there"])
    greedy = generate(dec, prompt, settings(threshold=1.0)).tokens
    top1 = generate(dec, prompt, settings(threshold=1.0, sampling=Sampling(temperature=1.0, top_k=1, seed=0))).tokens
    assert top1 == greedy
    # A vanishing temperature is greedy too, not a NaN distribution (1e-69 once overflowed to inf).
    for lossless in (False, True):
        tiny = Sampling(temperature=1e-69, seed=0)
        assert (
            generate(dec, prompt, settings(threshold=0.5, lossless=lossless, sampling=tiny)).tokens
            == generate(dec, prompt, settings(threshold=1.0 if lossless else 0.5)).tokens
        )
    a = generate(TorchDecoder(tm), prompt, settings(threshold=0.5, sampling=Sampling(temperature=1.5, seed=7))).tokens
    b = generate(TorchDecoder(tm), prompt, settings(threshold=0.5, sampling=Sampling(temperature=1.5, seed=7))).tokens
    assert a == b


def test_float_mask_path_with_eager_attention(tok):
    """Holes (left padding) go through an additive float mask; eager attention must agree with sdpa."""
    sdpa = make_model("llama", len(tok), seed=1)
    eager = make_model("llama", len(tok), seed=1)
    eager.config._attn_implementation = "eager"
    prompts = prompts_of(tok, PROMPTS)
    s = settings(threshold=0.3)
    a = generate(TorchDecoder(TorchModel(sdpa, tok, None, "", torch.device("cpu"), torch.float32)), prompts, s)
    b = generate(TorchDecoder(TorchModel(eager, tok, None, "", torch.device("cpu"), torch.float32)), prompts, s)
    assert a.tokens == b.tokens


def test_the_cache_goes_under_the_keyword_the_models_forward_takes(tm):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache`; an unknown keyword
    would vanish into `**kwargs` and the model would decode with no cache at all, so the
    backend reads the name off the forward's signature (mars supports 5.17 and later)."""
    import inspect

    from mars.backends.torch.cache import cache_argument
    from mars.backends.torch.forward import body_and_head

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return cache

    class Neither(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs):
            return None

    marker = object()
    assert Old()(**cache_argument(Old(), marker)) is marker
    assert New()(**cache_argument(New(), marker)) is marker
    with pytest.raises(TypeError, match="neither"):
        cache_argument(Neither(), marker)
    body, _ = body_and_head(tm.model)  # the installed transformers' own model takes it by that name
    assert (
        list(cache_argument(body, marker))
        == [name for name in ("cache", "past_key_values") if name in inspect.signature(type(body).forward).parameters][
            :1
        ]
    )


def test_a_steps_results_cross_to_the_host_in_one_copy_bit_for_bit():
    """On a device, `step` and `speculate` pack their results (ids, confidences, runners-up)
    into one int64 tensor, a float32 by its bits, and copy it once; unpacked, every value and
    dtype is what a copy of each would give."""
    from mars.backends.torch.decode import to_host

    conf = torch.tensor([[0.1, -2.5e-38, float("inf")], [float("-inf"), 1.0, 3.4e38]], dtype=torch.float32)
    ids = torch.tensor([[0, 49151, 2**40], [-1, 7, 3]], dtype=torch.int64)
    flags, small = torch.tensor([True, False, True]), torch.tensor([5, -6], dtype=torch.int32)
    packed = to_host(ids, conf, flags, small, pack=True)
    for got, want in zip(packed, (ids, conf, flags, small)):
        assert got.dtype == want.numpy().dtype and got.shape == tuple(want.shape)
        assert got.tobytes() == want.numpy().tobytes()
    nan = to_host(torch.tensor([float("nan")]), pack=True)[0]
    assert np.isnan(nan).all() and nan.dtype == np.float32


def test_a_decoding_gate_reads_the_masks_places_off_the_host(tm):
    """The decoding gate set from the host's ids equals the one set from the device's, so a
    step needs no copy back to find its masks."""
    from mars.backends.torch.gate import DecodeGate

    ids = np.array([[5, 3, 3, 9], [3, 1, 2, 3]])
    for rows in (ids, ids[:1]):
        a, b = DecodeGate(3), DecodeGate(3)
        a.set(torch.from_numpy(rows))
        b.set_host(rows, torch.device("cpu"))
        assert a.rows == b.rows and torch.equal(a.column, b.column) and b.column.dtype == torch.float32
    none = DecodeGate(3)
    none.set_host(np.array([[1, 2]]), torch.device("cpu"))
    assert none.column is None and none.rows is None


def test_decoding_is_the_same_when_every_step_packs_its_results(tm, tok, monkeypatch):
    """The packed copy a device makes, forced here on the CPU: AR, threshold mode with its
    confidences, lossless with runners-up and lossless sampling decode the same tokens."""
    import mars.backends.torch.decode as torch_model
    from mars.core.decode.plan import Sampling

    prompts = prompts_of(tok, PROMPTS)
    plans = [
        settings(threshold=1.0),
        settings(threshold=0.3),
        settings(lossless=True, alternatives=2, ngram=4),
        settings(lossless=True, sampling=Sampling(temperature=0.8, seed=3)),
    ]
    plain = [generate(TorchDecoder(tm), prompts, s).tokens for s in plans]
    real = torch_model.to_host
    calls = []
    monkeypatch.setattr(torch_model, "to_host", lambda *a, **kw: calls.append(len(a)) or real(*a, pack=True))
    assert [generate(TorchDecoder(tm), prompts, s).tokens for s in plans] == plain
    assert calls and max(calls) == 3  # ids, confidences and runners-up (or kept, token, proposals) in one copy
