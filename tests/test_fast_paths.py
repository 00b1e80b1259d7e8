"""The CPU fast paths of the torch decoder: packed linear weights for multi-token forwards
and grouped-query attention without copied keys. Both must leave what the model computes
as it was (the packed product up to float rounding, the attention bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import make_model, make_plan, make_tokenizer

from mars.backends.torch import packed
from mars.backends.torch.attention import NAME, use_grouped_sdpa
from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.forward import additive_mask
from mars.backends.torch.load import TorchModel
from mars.core.masks import decode_mask

pytestmark = pytest.mark.skipif(
    not packed.can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch build"
)


def test_packed_linear_matches_f_linear_and_falls_back_when_the_weight_changes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    block = torch.nn.Sequential(layer)
    assert packed.pack_linears(block) == 1
    one = torch.randn(1, 48)
    with torch.no_grad():
        # one row (an AR step): F.linear itself
        assert torch.equal(packed.linear(layer, one), F.linear(one, layer.weight, layer.bias))
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(rows, 48)
        with torch.no_grad():
            got, want = packed.linear(layer, x), F.linear(x, layer.weight, layer.bias)
        if rows < packed.MIN_ROWS:
            assert torch.equal(got, want)  # few rows: F.linear itself
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(8, 48)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # the layer's own forward: F.linear
        layer.weight.mul_(2.0)  # trained or edited after packing: the stale pack is not used
        assert torch.equal(packed.linear(layer, x), F.linear(x, layer.weight, layer.bias))
    packed.unpack_linears(block)
    assert not hasattr(layer, "_mars_packed")
    with torch.no_grad():  # unpacked: F.linear
        assert torch.equal(packed.linear(layer, x), F.linear(x, layer.weight, layer.bias))


def test_the_packed_path_runs_for_wide_feeds(monkeypatch):
    import types

    rows_seen = []

    def spy(x, w, b=None):
        rows_seen.append(x.numel() // x.shape[-1])
        return F.linear(x, w, b)

    monkeypatch.setattr(packed, "F", types.SimpleNamespace(linear=spy))
    layer = torch.nn.Linear(16, 16)
    packed.pack_linears(layer)
    with torch.no_grad():
        packed.linear(layer, torch.randn(1, 16))
        packed.linear(layer, torch.randn(6, 16))  # the packed product: F.linear is not called
        packed.linear(torch.nn.Linear(16, 16), torch.randn(7, 16))  # a layer without a pack
    assert rows_seen == [1, 7]


def test_grouped_attention_is_bit_identical_to_sdpa_with_a_mask():
    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=3)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    ids = torch.randint(5, len(tok), (2, 12))
    valid = np.ones((2, 12), dtype=bool)
    valid[1, :3] = False  # holes: a real mask
    mask = additive_mask(decode_mask(valid, 12), torch.float32, "cpu")
    pos = torch.from_numpy(np.where(valid, np.cumsum(valid, 1) - 1, 0))
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        assert use_grouped_sdpa(model) and model.config._attn_implementation == NAME
        got = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_the_decoder_turns_both_on_for_the_cpu():
    tok = make_tokenizer()
    tm = TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    assert dec.packed > 0 and dec.grouped
    assert dec.cost_key()["packed"] is True
    plain = TorchDecoder(
        TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32), pack=False
    )
    assert plain.packed == 0


def test_a_packed_products_rows_do_not_depend_on_how_many_rows_it_runs():
    # What lets a batch's step compute its real positions alone (models.StepInputs.real): each
    # row of the packed product is the same number whatever the other rows are.
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160)
    packed.pack_linears(layer)
    x = torch.randn(40, 96)
    with torch.no_grad():
        full = packed.linear(layer, x)
        for rows in (2, 3, 4, 5, 8, 9, 17, 33):
            assert torch.equal(packed.linear(layer, x[:rows]), full[:rows])
            pick = torch.randperm(40)[:rows].sort().values
            assert torch.equal(packed.linear(layer, x[pick]), full[pick])


def _decoder(pack: bool = True):
    tok = make_tokenizer()
    tm = TorchModel(make_model("qwen2", len(tok), seed=5), tok, None, "", torch.device("cpu"), torch.float32)
    return TorchDecoder(tm, pack=pack), len(tok)


def test_a_step_with_holes_reads_what_the_full_step_reads():
    from mars.core.decode.plan import Sampling

    dec, vocab = _decoder()
    assert dec.skips_holes
    rng = np.random.default_rng(0)
    b, n, q = 3, 9, 6
    greedy = Sampling()
    valid = np.ones((b, q), dtype=bool)
    valid[0, :4] = False  # row 0 feeds 2 tokens, row 1 all 6, row 2 3
    valid[2, :3] = False
    ids = rng.integers(5, vocab, (b, q))
    positions = np.where(valid, n + np.cumsum(valid, 1) - 1, 0)
    mask = decode_mask(np.concatenate([np.ones((b, n), dtype=bool), valid], 1), q)
    # Reads as a lossless step lays them out: repeats for rows with fewer drafts, one at a hole.
    read = np.array([[4, 5, 5, 5, 2], [0, 1, 2, 3, 5], [3, 4, 5, 5, 5]])
    out = {}
    for use_valid in (False, True):
        cache = dec.new_cache(b)
        prompt = rng.integers(5, vocab, (b, n)) if not out else out["prompt"]
        out["prompt"] = prompt
        dec.step(
            cache, prompt, np.tile(np.arange(n), (b, 1)), None, np.full((b, 1), n - 1), metric=None, sampling=greedy
        )
        out[use_valid] = dec.step(
            cache, ids, positions, mask, read, metric="probability", sampling=greedy, valid=valid if use_valid else None
        )
    (ids_full, conf_full), (ids_real, conf_real) = out[False], out[True]
    used = np.take_along_axis(valid, read, axis=1)  # a read at a hole is never used
    assert np.array_equal(ids_real[used], ids_full[used])
    assert np.array_equal(conf_real[used], conf_full[used])


def test_a_batch_decodes_alike_with_and_without_its_holes_computed(monkeypatch):
    from mars.backends.torch import models
    from mars.core.decode.loop import generate

    dec, vocab = _decoder()
    assert dec.lean is not None
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, vocab, n).tolist() for n in (7, 12, 4)]  # different lengths: left padding, holes
    entered = []
    step_inputs = models.StepInputs

    def spy(**kw):  # mars's own forward is given the real positions alone
        if kw.get("real") is not None:
            entered.append(len(kw["real"]) / (kw["batch"] * kw["width"]))
        return step_inputs(**kw)

    monkeypatch.setattr(models, "StepInputs", spy)
    out = {}
    for skip in (True, False):
        dec.skips_holes = skip
        for mode in ("ar", "lossless", "threshold"):
            s = make_plan(
                mask_id=3,
                eos_ids=(2,),
                block_size=4,
                max_tokens=20,
                cache="window",
                threshold={"ar": 1.0, "lossless": 1.0, "threshold": 0.6}[mode],
                lossless=mode == "lossless",
            )
            out[skip, mode] = generate(dec, prompts, s).tokens
    for mode in ("ar", "lossless", "threshold"):
        assert out[True, mode] == out[False, mode], mode
    assert out[True, "lossless"] == out[True, "ar"]
    assert entered and min(entered) < 1.0  # the prompts' and the drafts' holes were skipped


def test_row_counts_chosen_for_f_linear_run_it(monkeypatch):
    """Where the CPU computes a few rows faster with F.linear (packed.use_linear_rows), those
    row counts run F.linear itself; the others stay packed."""
    import types

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 24)
    packed.pack_linears(layer)
    packed.use_linear_rows(layer, [2, 3])
    rows_seen = []

    def spy(x, w, b=None):
        rows_seen.append(x.numel() // x.shape[-1])
        return F.linear(x, w, b)

    with torch.no_grad():
        for rows in (2, 3):
            x = torch.randn(rows, 32)
            assert torch.equal(packed.linear(layer, x), F.linear(x, layer.weight, layer.bias))
        monkeypatch.setattr(packed, "F", types.SimpleNamespace(linear=spy))
        for rows in (1, 2, 3, 4, 6):
            packed.linear(layer, torch.randn(rows, 32))
    assert rows_seen == [1, 2, 3]
    timings = packed.time_row_paths(layer, rows=(2, 4), repeats=1)
    assert set(timings) == {2, 4} and all(a > 0 and b > 0 for a, b in timings.values())
    assert layer._mars_linear_rows == frozenset({2, 3})  # timing leaves the choice as it was
    assert packed.faster_on_linear({2: (1.0, 2.0), 3: (0.97, 1.0), 4: (3.0, 1.0)}) == [2]
    # Counts between the measured ones take the next measured count's choice, above them all the largest's.
    assert packed.row_choices({2: (1.0, 2.0), 3: (0.97, 1.0), 4: (3.0, 1.0)}) == [2]
    assert packed.row_choices({2: (2.0, 1.0), 4: (1.0, 2.0), 8: (2.0, 1.0), 16: (1.0, 2.0)}) == [3, 4] + list(
        range(9, packed.CHOSEN_ROWS + 1)
    )
    assert packed.row_choices({}) == []


def test_the_decoder_measures_the_row_paths_once_per_cpu_and_shape(monkeypatch, tmp_path):
    from mars.backends.torch import decode as torch_model

    monkeypatch.setenv("MARS_HOME", str(tmp_path))
    tok = make_tokenizer()

    def new():
        return TorchDecoder(
            TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
        )

    assert new().linear_rows == []  # a tiny model: not measured, every product of 2 rows or more packed
    monkeypatch.setattr(torch_model, "ROW_PATHS_MIN_BYTES", 0)
    calls = []
    monkeypatch.setattr(
        packed, "time_row_paths", lambda module: calls.append(1) or {2: (1.0, 2.0), 3: (2.0, 1.0), 4: (3.0, 3.0)}
    )
    dec = new()
    assert dec.linear_rows == [2] and dec.cost_key()["linear_rows"] == [2]
    layers = packed.packed_layers(dec.tm.body)
    assert layers and all(layer._mars_linear_rows == frozenset({2}) for layer in layers)
    assert dec.head._mars_linear_rows == frozenset()  # the head keeps its own path (packed.pack_head)
    assert new().linear_rows == [2] and calls == [1]  # the second decoder read the kept choice
    assert list((tmp_path / "paths").glob("*.json"))


def test_lossless_decoding_is_ar_with_small_products_on_f_linear():
    from mars.core.decode.loop import generate

    dec, vocab = _decoder()
    packed.use_linear_rows(dec.tm.model, [2, 3])
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, vocab, n).tolist() for n in (7, 12, 4)]
    base = dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=20, cache="window")
    ar = generate(dec, prompts, make_plan(**base)).tokens
    for hedge in (0, None):
        s = make_plan(**base, lossless=True, hedge=hedge)
        assert generate(dec, prompts, s).tokens == ar
        assert [generate(dec, [p], s).tokens[0] for p in prompts] == ar
    packed.use_linear_rows(dec.tm.model, [])


def test_a_read_only_cache_does_not_stop_the_decoder(monkeypatch, tmp_path):
    from mars.backends.torch import decode as torch_model
    from mars.core import files

    def refuse(*args, **kw):
        raise OSError("read-only")

    monkeypatch.setenv("MARS_HOME", str(tmp_path))
    monkeypatch.setattr(torch_model, "ROW_PATHS_MIN_BYTES", 0)
    monkeypatch.setattr(packed, "time_row_paths", lambda module: {2: (1.0, 2.0), 3: (2.0, 1.0)})
    monkeypatch.setattr(files, "atomic_write_text", refuse)
    tok = make_tokenizer()
    dec = TorchDecoder(
        TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    )
    assert dec.linear_rows == [2] and not (tmp_path / "paths").exists()


def test_the_growing_cache_holds_what_the_concatenating_one_holds():
    """mars.backends.torch.cache: appends in place, crops by shortening a view, and starts a
    new buffer when the decoder selects rows or positions; what attention reads is what
    transformers' DynamicCache (torch.cat) would hold after the same calls."""
    from transformers import DynamicCache

    from mars.backends.torch.cache import SPARE, GrowingLayer, growing_cache

    dec, _ = _decoder()
    config = dec.tm.model.config
    grow, ref = growing_cache(config), DynamicCache(config=config)
    assert all(type(layer) is GrowingLayer for layer in grow.layers)
    rng = torch.Generator().manual_seed(0)
    heads, dim = 2, 8

    def append(n, batch=2):
        k, v = torch.randn(batch, heads, n, dim, generator=rng), torch.randn(batch, heads, n, dim, generator=rng)
        got, want = grow.layers[0].update(k, v), ref.layers[0].update(k, v)
        for g, w in zip(got, want):
            assert torch.equal(g, w)

    def same():
        g, w = grow.layers[0], ref.layers[0]
        assert torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
        assert grow.get_seq_length() == ref.get_seq_length()

    append(5)
    buffer = grow.layers[0]._kbuf
    append(3)
    assert grow.layers[0]._kbuf is buffer  # appended in place
    for cache in (grow, ref):
        dec.crop(cache, 6)  # rejected drafts leave
    same()
    append(4)
    assert grow.layers[0]._kbuf is buffer
    same()
    append(SPARE + 20)  # past the buffer's room: a larger one, the positions kept
    assert grow.layers[0]._kbuf is not buffer and grow.layers[0]._kbuf.shape[-2] >= 10 + SPARE + 20
    same()
    for cache in (grow, ref):
        dec.keep_keys(cache, [0, 2, 3, 7])  # a served batch drops the keys of rows that left
    same()
    append(2)
    same()
    for cache in (grow, ref):
        dec.keep_rows(cache, [1])  # a finished row leaves the batch
    append(3, batch=1)
    same()
    for cache in (grow, ref):
        dec.crop(cache, 0)
    append(2, batch=1)
    same()


def test_decoding_on_the_preallocated_and_growing_caches_equals_decoding_on_transformers_cache(monkeypatch):
    from transformers import DynamicCache

    from mars.core.decode.loop import generate

    dec, vocab = _decoder()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, vocab, n).tolist() for n in (7, 12, 4)]
    decoders = {"preallocated": dec, "growing": TorchDecoder(dec.tm, lean=False)}
    decoders["dynamic"] = TorchDecoder(dec.tm, lean=False)
    assert dec.lean is not None and decoders["growing"].lean is None
    monkeypatch.setattr(decoders["dynamic"], "new_cache", lambda batch: DynamicCache(config=dec.tm.model.config))
    out = {}
    for kind in ("preallocated", "growing", "dynamic"):
        for cache in ("window", "block"):
            for mode in ("ar", "lossless", "threshold"):
                s = make_plan(
                    mask_id=3,
                    eos_ids=(2,),
                    block_size=4,
                    max_tokens=24,
                    cache=cache,
                    block_cache=8,
                    threshold={"ar": 1.0, "lossless": 1.0, "threshold": 0.6}[mode],
                    lossless=mode == "lossless",
                )
                for batch in (prompts, prompts[:1]):
                    out[kind, cache, mode, len(batch)] = generate(decoders[kind], batch, s).tokens
    for key in [k for k in out if k[0] == "growing"]:
        assert out[key] == out[("dynamic",) + key[1:]] == out[("preallocated",) + key[1:]], key


def test_the_head_reads_two_rows_or_more_through_its_pack():
    """packed.pack_head: a float32 decoder packs its LM head; one read runs the head as the model
    does (bit for bit), more reads run the pack (the same logits up to the last bits); a bfloat16
    head is not packed."""
    from mars.backends.torch.models.base import head_logits

    dec, _ = _decoder()
    head = dec.head
    assert "_mars_packed" in head.__dict__
    h = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = head(h[None])[0]
        assert torch.equal(head_logits(head, h[:1]), head(h[:1][None])[0])
        for rows in (2, 3, 5):
            got = head_logits(head, h[:rows])
            assert got.shape == (rows, head.out_features)
            assert torch.allclose(got, plain[:rows], atol=1e-5, rtol=1e-5)
    assert not packed.pack_head(torch.nn.Linear(8, 16, dtype=torch.bfloat16))
    assert packed.pack_head(torch.nn.Linear(8, 16))
