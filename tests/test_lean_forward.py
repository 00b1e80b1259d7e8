"""mars's own torch forward (mars/backends/torch/models/) against transformers' forward, per
architecture it covers, in float32: the same logits bit for bit under the same masks, for a
prompt, a cached one-token step and a cached multi-token step, batched, with a sliding window
that cuts where the architecture has one; and the decoder on it against the decoder on
transformers' modules (lean=False): the same tokens in every mode.

transformers' forward runs with the attention function the decoder gave it until now
(attention.use_grouped_sdpa: torch's kernel under the 4D mask, each key/value head shared by its
query heads, bit for bit transformers' own `sdpa` for several query rows). For one query row
transformers 5.25 folds the query heads of a group into rows of one problem (`pack_gqa`), which
gives other last bits; earlier versions do not."""

import numpy as np
import pytest
import torch
from tiny import make_model, make_plan

from mars.backends.torch import models
from mars.backends.torch.attention import use_grouped_sdpa
from mars.backends.torch.cache import cache_argument, full_cache
from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.forward import attention_masks, body_and_head, model_windows, window_cut
from mars.backends.torch.load import TorchModel
from mars.core.decode.loop import generate
from mars.core.masks import decode_mask

# (architecture, window): each family of models/, and the sliding ones with a window that cuts.
CASES = [(a, None) for a in models.FAMILIES] + [("mistral", 5)]
VOCAB = 85


def case_id(case):
    return case[0] if case[1] is None else f"{case[0]}-window{case[1]}"


def steps():
    """(ids, positions, bool mask) of three forwards of a batch of 2 on one cache: a prompt whose
    first row has 2 holes in front, one token, then 4 tokens."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, VOCAB, (2, 9))
    valid = np.ones((2, 9), dtype=bool)
    valid[0, :2] = False
    positions = np.stack([np.clip(np.arange(9) - 2, 0, None), np.arange(9)])
    out = [(prompt, positions, valid)]
    seen = positions[:, -1:] + 1
    for width in (1, 4):
        out.append((rng.integers(4, VOCAB, (2, width)), seen + np.arange(width), np.ones((2, width), dtype=bool)))
        seen = seen + width
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_lean_forward_equals_transformers_bit_for_bit(case):
    arch, window = case
    model = make_model(arch, VOCAB, seed=2, window=window)
    assert use_grouped_sdpa(model)
    body, head = body_and_head(model)
    windows = model_windows(model)
    lean = models.build(body, head, windows)
    assert lean is not None
    cache = models.KVCache(lean.args, 2, 4, torch.float32, torch.device("cpu"))  # grows on the way
    hf_cache = full_cache(model.config)
    key_valid = np.zeros((2, 0), dtype=bool)
    key_positions = np.zeros((2, 0), dtype=np.int64)
    cut = False
    with torch.inference_mode():
        for ids, positions, valid in steps():
            b, q = ids.shape
            key_valid = np.concatenate([key_valid, valid], axis=1)
            key_positions = np.concatenate([key_positions, positions], axis=1)
            mask = decode_mask(key_valid, q)
            full, sliding = window_cut(mask, positions, key_positions, windows)
            cut |= bool((full != sliding).any())
            # The bool mask alone: the forward cuts the window itself, by the positions it caches.
            inputs = models.StepInputs(
                ids=torch.from_numpy(ids.reshape(-1)),
                positions=torch.from_numpy(positions),
                reads=torch.arange(b * q),
                batch=b,
                width=q,
                allowed=torch.from_numpy(mask),
            )
            mine = lean(cache, inputs)
            for m, host in zip(lean.attention_masks(cache, inputs), (full, sliding)):  # as the forward built them
                assert torch.equal(m[:, 0] == 0, torch.from_numpy(host))
            cache.length += q
            theirs = model(
                input_ids=torch.from_numpy(ids),
                position_ids=torch.from_numpy(positions),
                attention_mask=attention_masks(mask, positions, key_positions, windows, torch.float32, "cpu"),
                use_cache=True,
                **cache_argument(model, hf_cache),
            ).logits
            assert torch.equal(mine, theirs.reshape(b * q, -1)), (arch, q)
    assert cut == (window is not None)


@pytest.mark.parametrize("arch", list(models.FAMILIES))
def test_the_decoder_on_the_lean_forward_gives_the_tokens_of_transformers_modules(arch):
    from tiny import make_tokenizer

    tok = make_tokenizer()
    tm = TorchModel(make_model(arch, len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    lean, plain = TorchDecoder(tm), TorchDecoder(tm, lean=False)
    assert lean.lean is not None and plain.lean is None
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in ("Hello there, how are you today?", "x")
    ]
    base = dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=12, block_cache=8)
    for asked in (dict(threshold=1.0), dict(threshold=0.5), dict(lossless=True), dict(threshold=0.5, cache="block")):
        plan = make_plan(**base, **asked)
        assert generate(lean, prompts, plan).tokens == generate(plain, prompts, plan).tokens, asked


def test_the_lean_cache_keeps_rows_and_columns_in_place():
    model = make_model("llama", VOCAB, seed=3)
    body, head = body_and_head(model)
    lean = models.build(body, head, model_windows(model))
    cache = models.KVCache(lean.args, 3, 8, torch.float32, torch.device("cpu"))
    with torch.inference_mode():  # the cache's buffers are inference tensors
        cache.keys.copy_(torch.randn(cache.keys.shape))
        cache.values.copy_(torch.randn(cache.values.shape))
    cache.length = 6
    before_k, before_v = cache.keys.clone(), cache.values.clone()
    cache.keep_rows(torch.tensor([2, 0, 0, 1]))  # grows by one row: a served batch gains one
    assert cache.batch == 4
    for buf, old in ((cache.keys, before_k), (cache.values, before_v)):
        assert torch.equal(buf[:, :4, :, :6], old[:, [2, 0, 0, 1], :, :6])
    cache.keep_columns(torch.tensor([0, 3, 5]))
    assert cache.length == 3
    assert torch.equal(cache.keys[:, :4, :, :3], before_k[:, [2, 0, 0, 1]][:, :, :, [0, 3, 5]])
    cache.crop(2)
    assert cache.length == 2
    cache.crop(5)  # a crop never lengthens
    assert cache.length == 2


@pytest.mark.parametrize("case", [("llama", None), ("qwen3", None), ("mistral", 5)], ids=case_id)
def test_padded_widths_give_the_unpadded_outputs(case):
    """A decoder that pads every step to WIDTH_BUCKETS reads the same predictions as one that does
    not: the same tokens in every mode, batches and both caches included, lossless and threshold 1.0
    equal to AR; the logits of one step agree to float rounding (torch's attention kernel gives
    other last bits with more query rows and keys), the same argmax at every read."""
    from tiny import make_tokenizer

    from mars.backends.torch.decode import WIDTH_BUCKETS, bucket

    assert [bucket(w) for w in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, 128]
    assert WIDTH_BUCKETS[0] == 1  # an AR step is never padded
    tok = make_tokenizer()
    tm = TorchModel(
        make_model(case[0], len(tok), seed=1, window=case[1]), tok, None, "", torch.device("cpu"), torch.float32
    )
    plain, padded = TorchDecoder(tm), TorchDecoder(tm, buckets=True)
    assert padded.buckets and not plain.buckets
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in ("Hello there, how are you today?", "x", "Write a short poem about the sea")
    ]
    base = dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=14, block_cache=8)
    ar = generate(plain, prompts, make_plan(**base, threshold=1.0)).tokens
    for asked in (
        dict(threshold=1.0),
        dict(lossless=True),
        dict(lossless=True, cache="none"),
        dict(threshold=0.5),
        dict(threshold=0.5, cache="block"),
    ):
        plan = make_plan(**base, **asked)
        got = generate(padded, prompts, plan).tokens
        assert got == generate(plain, prompts, plan).tokens, asked
        assert [generate(padded, [p], plan).tokens[0] for p in prompts] == got, asked
        if asked.get("lossless") or asked.get("threshold") == 1.0:
            assert got == ar, asked
    # One step of 5 tokens (padded to 8) on a cached prompt: the same argmax, the logits to rounding.
    prompt = np.asarray(prompts[0])[None]
    n = prompt.shape[1]
    ids = np.random.default_rng(1).integers(4, len(tok), (1, 5))
    out = []
    for dec in (plain, padded):
        cache = dec.new_cache(1)
        dec.logits(cache, prompt, np.arange(n)[None], None, np.array([[n - 1]]))
        out.append(dec.logits(cache, ids, n + np.arange(5)[None], None, np.arange(5)[None]))
        assert cache.length == n + 5
    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
    assert float((out[0] - out[1]).abs().max()) < 1e-3


def test_a_step_given_lists_of_rows_is_the_step_given_arrays():
    """The decoder `takes_rows`: a step whose ids, positions, reads, holes and StepMask views come as
    lists of rows (what the loop lays a step out in) reads what the same step given as arrays reads,
    bit for bit, and leaves the same cache; a prompt with holes, then a step with a group's view."""
    from mars.core.decode.plan import Sampling
    from mars.core.masks import StepMask

    tm = TorchModel(make_model("llama", VOCAB, seed=3), None, None, "", torch.device("cpu"), torch.float32)
    decoder = TorchDecoder(tm)
    assert decoder.takes_rows
    (prompt, positions, valid), (ids, _, _) = steps()[:2]
    ids = np.random.default_rng(4).integers(4, VOCAB, (2, 5))
    at = positions[:, -1:] + 1 + np.arange(5)
    keys = np.ones((2, 9 + 5), dtype=bool)
    keys[0, :2] = False  # the first row's holes, cached
    keys[1, -1] = False  # a hole fed
    see = np.tile(np.arange(5), (2, 1))
    see[:, 3:] = 1  # the last two columns: a group anchored after column 1
    start = np.tile(np.arange(5), (2, 1))
    start[:, 3:] = 3
    read = np.array([[0, 1, 2, 3], [1, 2, 3, 4]])
    step_valid = keys[:, 9:]
    outs, caches = [], []
    for given in (lambda a: a, lambda a: a.tolist()):
        cache = decoder.new_cache(2)
        first = decoder.step(
            cache,
            given(prompt),
            given(positions),
            decode_mask(valid, 9),
            given(np.array([[8], [8]])),
            metric=None,
            sampling=Sampling(),
            valid=given(valid),
        )
        mask = StepMask(9, 5, keys, given(see), given(start))
        out = decoder.step(
            cache,
            given(ids),
            given(at),
            mask,
            given(read),
            metric="probability",
            sampling=Sampling(),
            valid=given(step_valid),
            runners_up=2,
            runners_up_from=1,
        )
        outs.append((first.ids, out.ids, out.conf, out.runners_up))
        caches.append(cache)
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
    assert caches[0].length == caches[1].length == 14
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
