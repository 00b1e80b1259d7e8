"""MLX steps under mx.compile (mars.backends.mlx.compiled): the eager steps' tokens in every mode,
batch and cache, sampled too; few graphs, traced once and not again as the cache grows; the AR step
started ahead taken when the loop asks for it and dropped when it does not. Tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from tiny import COMPILED_BASE, COMPILED_MODES, make_plan, save_model

mx = pytest.importorskip("mlx.core")

from mars.backends.mlx import lean  # noqa: E402
from mars.backends.mlx.compiled import room_mask  # noqa: E402
from mars.backends.mlx.decode import MlxDecoder  # noqa: E402
from mars.backends.mlx.forward import step_mask  # noqa: E402
from mars.backends.mlx.load import load  # noqa: E402
from mars.backends.mlx.static_cache import ROOM, StaticCache  # noqa: E402
from mars.core.decode import cost  # noqa: E402
from mars.core.decode.loop import generate  # noqa: E402
from mars.core.decode.plan import Sampling  # noqa: E402
from mars.core.masks import StepMask  # noqa: E402

BASE, MODES = COMPILED_BASE, COMPILED_MODES


def prompts_of(tok, texts=("Hello there, how are you today?", "x")):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def loaded(tmp_path_factory, arch="llama", seed=1, **kw):
    path = save_model(tmp_path_factory.mktemp(arch) / "m", arch, seed=seed, **kw)
    return load(str(path), announce=lambda m: None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = loaded(tmp_path_factory)
    return m, MlxDecoder(m), MlxDecoder(m, compile=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_steps_give_the_eager_tokens_in_every_mode(llama, mode, monkeypatch):
    m, eager, compiled = llama
    graph, ran = compiled.compiled._graph, []
    monkeypatch.setattr(compiled.compiled, "_graph", lambda *args: ran.append(1) or graph(*args))
    plan = make_plan(**BASE, **MODES[mode])
    both, one = prompts_of(m.tokenizer), prompts_of(m.tokenizer)[:1]
    assert generate(compiled, both, plan).tokens == generate(eager, both, plan).tokens  # a batch
    assert generate(compiled, one, plan).tokens == generate(eager, one, plan).tokens  # a row alone
    assert ran  # the steps after the prompt's ran the compiled graph


def test_compiled_sampling_draws_what_the_eager_steps_draw(llama):
    m, eager, compiled = llama
    for asked in (dict(threshold=1.0), dict(lossless=True), dict(lossless=True, tree=8)):
        plan = make_plan(**BASE, **asked, sampling=Sampling(temperature=0.8, seed=5))
        prompts = prompts_of(m.tokenizer)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens, asked


@pytest.mark.parametrize("fails", ["called", "read"])
def test_a_failing_compiled_step_gives_way_to_eager_steps_where_told(llama, fails, monkeypatch):
    """`on_compile_error` (what --compile auto gives): a compiled step that raises, when its graph is
    called or only when its results are read back (MLX evaluates lazily, so the cache already holds
    the step's lazy buffers then), is dropped, the message says why, and that step and the rest run
    eager on mlx-lm caches holding the cached keys: the eager tokens, greedy and sampled. Without it
    (--compile on) the error stops the call."""
    from mars.backends.mlx import decode as mlx_decode

    m = llama[0]
    prompts = prompts_of(m.tokenizer)

    def broken(dec):
        graph = dec.compiled._graph
        if fails == "called":

            def fail(*args):
                raise RuntimeError("no Metal here\nthe rest of the trace")

            dec.compiled._graph = fail
            return
        ran = []
        dec.compiled._graph = lambda *args: ran.append(1) or graph(*args)
        read = mlx_decode.to_host

        def to_host(*arrays):
            if ran and dec.compiled is not None:
                raise RuntimeError("no Metal here\nthe rest of the trace")
            return read(*arrays)

        monkeypatch.setattr(mlx_decode, "to_host", to_host)

    for asked in (dict(lossless=True), dict(lossless=True, sampling=Sampling(temperature=0.8, seed=5))):
        plan = make_plan(**BASE, **asked)
        heard = []
        dec = MlxDecoder(m, compile=True, on_compile_error=heard.append)
        broken(dec)
        # A fresh eager decoder: a sampled decoder's random stream goes on across calls.
        assert generate(dec, prompts, plan).tokens == generate(MlxDecoder(m), prompts, plan).tokens
        assert dec.compiled is None and "compiled" not in dec.cost_key()
        assert len(heard) == 1 and "RuntimeError: no Metal here)" in heard[0]
        monkeypatch.undo()
    strict = MlxDecoder(m, compile=True)
    broken(strict)
    with pytest.raises(RuntimeError, match="no Metal here"):
        generate(strict, prompts, make_plan(**BASE, lossless=True))


def test_few_graphs_and_none_after_the_warm_up(tmp_path_factory):
    m = loaded(tmp_path_factory, seed=7)
    eager, compiled = MlxDecoder(m), MlxDecoder(m, compile=True)
    prompts = prompts_of(m.tokenizer)
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens
        generate(compiled, prompts[:1], plan)
    warm = compiled.compiled.traces
    assert 1 <= warm <= 10  # (one row, two) x (a few width buckets)
    longer = prompts_of(m.tokenizer, ("a much longer prompt than before, " * 4, "and another one"))
    for asked in (dict(threshold=1.0), dict(lossless=True)):  # other lengths, the same buckets
        plan = make_plan(**dict(BASE, max_tokens=20), **asked)
        assert generate(compiled, longer, plan).tokens == generate(eager, longer, plan).tokens
        generate(compiled, longer[1:], plan)
    assert compiled.compiled.traces == warm
    # Past the first room the cache grows: one more graph per shape, the tokens unchanged.
    plan = make_plan(**dict(BASE, eos_ids=(), max_tokens=ROOM + 20), threshold=1.0)
    assert generate(compiled, prompts[:1], plan).tokens == generate(eager, prompts[:1], plan).tokens
    # The cost curve's probes: 1, 2 and 4 rows at its widths (buckets), each shape traced once.
    for batch in (1, 2):
        cost.calibrate(compiled, [3] * 32, widths=cost.PROBE_WIDTHS, repeats=1, filler=3, ar_filler=2, batch=batch)
    traced = compiled.compiled.traces
    for batch in (1, 2):
        cost.calibrate(compiled, [3] * 32, widths=cost.PROBE_WIDTHS, repeats=1, filler=3, ar_filler=2, batch=batch)
    assert compiled.compiled.traces == traced


def test_the_step_started_ahead_is_taken_in_ar_and_dropped_otherwise(llama):
    m, eager, compiled = llama
    step = compiled.compiled
    step.start_ahead = True  # (on a GPU by default; on this CPU only where asked)
    plan = make_plan(**BASE, threshold=1.0)
    one = prompts_of(m.tokenizer)[:1]
    step.ahead = 0
    out = generate(compiled, one, plan)
    assert out.tokens == generate(eager, one, plan).tokens
    assert len(out.tokens[0]) - 2 <= step.ahead < len(out.tokens[0])  # every AR step after the first two
    # A step started ahead and then not asked for (the loop fed another token) leaves nothing behind.
    ids = np.array(one)
    at = ids.shape[1]

    def steps(decoder, tokens):
        cache, outs = decoder.new_cache(1), []
        read = np.array([[at - 1]])
        outs.append(decoder.step(cache, ids, np.arange(at)[None], None, read, metric=None, sampling=Sampling()))
        for i, token in enumerate(tokens):
            fed, pos = np.array([[token]]), np.array([[at + i]])
            outs.append(decoder.step(cache, fed, pos, None, np.array([[0]]), metric=None, sampling=Sampling()))
        return [int(o.ids[0, 0]) for o in outs]

    chosen = steps(eager, [5])
    other = (chosen[1] + 1) % 50  # not the argmax: the step started from the argmax is dropped
    step.ahead = 0
    assert steps(compiled, [5, other, 7]) == steps(eager, [5, other, 7])
    assert step.ahead == 0


FAMILIES = [("qwen2", {}), ("qwen3", {}), ("granite", {}), ("smollm3", {}), ("olmo2", {}), ("phi3", {})]


@pytest.mark.parametrize(("arch", "kw"), FAMILIES + [("mistral", {"window": 5})])
def test_compiled_steps_of_other_families_give_the_eager_tokens(tmp_path_factory, arch, kw):
    """Biases (qwen2), per-head norms (qwen3), multipliers (granite), layers without RoPE (smollm3):
    mars's own forward (lean.py); olmo2 and phi3: mlx-lm's modules, compiled; a sliding window
    that cuts (mistral): the eager step (compiled is None)."""
    m = loaded(tmp_path_factory, arch, **kw)
    eager, compiled = MlxDecoder(m), MlxDecoder(m, compile=True)
    assert (compiled.compiled is None) == ("window" in kw)
    if compiled.compiled is not None:
        assert (compiled.compiled.lean is not None) == (arch in lean.FAMILIES)
    prompts = prompts_of(m.tokenizer, ("Hello there, how are you today? " * 2, "x"))
    for asked in (dict(threshold=1.0), dict(lossless=True), dict(lossless=True, tree=8)):
        plan = make_plan(**dict(BASE, max_tokens=16), **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens, (arch, asked)


def test_joining_the_projections_changes_no_weight(tmp_path_factory):
    """The lean forward's joined weights are views the modules read: every parameter keeps its
    value bit for bit, and the eager step its tokens."""
    from mlx.utils import tree_flatten

    m = loaded(tmp_path_factory, "qwen2", seed=3)  # with biases
    prompts = prompts_of(m.tokenizer)
    plan = make_plan(**BASE, lossless=True)
    before = {k: np.array(v) for k, v in tree_flatten(m.model.parameters())}
    tokens = generate(MlxDecoder(m), prompts, plan).tokens
    compiled = MlxDecoder(m, compile=True)
    assert compiled.compiled.lean is not None
    after = dict(tree_flatten(m.model.parameters()))
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)
    assert generate(MlxDecoder(m), prompts, plan).tokens == tokens
    assert generate(compiled, prompts, plan).tokens == tokens


def test_quantized_projections_run_the_modules_compiled(tmp_path_factory):
    import mlx.nn as nn

    m = loaded(tmp_path_factory, "llama", seed=4)
    nn.quantize(m.model, group_size=32, bits=4)
    assert "quantized" in lean.supports(m.model)
    eager, compiled = MlxDecoder(m), MlxDecoder(m, compile=True)
    assert compiled.compiled.lean is None
    prompts = prompts_of(m.tokenizer)
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens, asked


def test_the_room_mask_is_the_step_mask_where_the_room_is_filled():
    rng = np.random.default_rng(0)
    cached, width, b, room = 5, 4, 2, 16
    keys = rng.random((b, cached + width)) > 0.3
    see = np.array([[0, 1, 0, 3], [0, 0, 2, 3]])
    start = np.array([[0, 1, 2, 3], [0, 1, 2, 2]])
    for mask in (StepMask(cached, width), StepMask(cached, width, keys, see, start)):
        want = mask.dense(b)
        k = None if mask.keys is None else mx.array(np.pad(mask.keys, ((0, 0), (0, room - cached - width))))
        valid = None if mask.keys is None else mx.array(mask.keys[:, cached:])
        s = None if mask.see is None else mx.array(mask.see)
        st = None if mask.start is None else mx.array(mask.start)
        got = np.array(room_mask(mx.array(np.array([cached])), width, room, b, k, valid, s, st))
        assert np.array_equal(got[:, :, : cached + width], want)
        assert not got[:, :, cached + width :].any()  # nothing past the fed keys
        eager = np.array(step_mask(cached, width, b, k[:, : cached + width] if k is not None else None, s, st))
        assert np.array_equal(eager, want)


def test_the_cache_grows_keeps_rows_and_keys():
    cache = StaticCache()
    assert cache.reserve(10) == ROOM and cache.keys is None
    cache.keys = [mx.arange(2 * 1 * ROOM * 2).reshape(2, 1, ROOM, 2).astype(mx.float32)] * 2
    cache.values = [-x for x in cache.keys]
    cache.length = 7
    first = np.array(cache.keys[0])
    assert cache.reserve(ROOM + 1) == 2 * ROOM and cache.room == 2 * ROOM
    assert np.array_equal(np.array(cache.keys[1])[:, :, :ROOM], first)
    assert not np.array(cache.keys[1])[:, :, ROOM:].any()
    cache.keep_rows([1])
    assert np.array_equal(np.array(cache.keys[0])[0, :, :ROOM], first[1])
    cache.keep_keys([0, 2, 5])
    assert cache.length == 3 and cache.room == 2 * ROOM
    assert np.array_equal(np.array(cache.values[0])[0, :, :3], -first[1][:, [0, 2, 5]])
    cache.crop(2)
    assert cache.length == 2
    cache.crop(9)
    assert cache.length == 2


def test_a_gated_adapter_runs_the_modules_compiled(tmp_path_factory):
    """A gated adapter's deltas act at mask tokens only: the compiled step sets the gate from its
    own ids inside the graph, as the eager step does before its forward."""
    import dataclasses

    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mars.backends.mlx.gate import MlxMaskGate

    m = loaded(tmp_path_factory, "llama", seed=5)
    prompts = prompts_of(m.tokenizer)
    plan = make_plan(**BASE, threshold=0.5)
    base = generate(MlxDecoder(m), prompts, plan).tokens
    linear_to_lora_layers(m.model, len(m.model.model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.0})
    for _, layer in m.model.named_modules():  # deltas that change the tokens
        if hasattr(layer, "lora_b"):
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(1)) * 0.5
    m.model.eval()
    gated = dataclasses.replace(m, gate=MlxMaskGate(m.model, 3))
    eager, compiled = MlxDecoder(gated), MlxDecoder(gated, compile=True)
    assert compiled.compiled.lean is None and "adapted" in lean.supports(m.model)
    for asked in (dict(threshold=0.5), dict(lossless=True)):
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens, asked
    plan = make_plan(**BASE, threshold=0.5)
    assert generate(compiled, prompts, plan).tokens != base  # the masks' deltas changed what they propose


@pytest.mark.parametrize("cache", ["window", "block"])
def test_a_served_batch_compiled_gives_the_eager_tokens(llama, cache):
    """Rows join a served batch (the cache gains rows) and leave it (rows and keys dropped) on the
    way: the compiled step's static cache gives every row the eager step's tokens."""
    from mars.core.decode.loop import ContinuousBatch

    m, eager, compiled = llama
    prompts = prompts_of(m.tokenizer, ("Hello there, how are you today?", "x", "Tell me about the sea, please."))
    plan = make_plan(**dict(BASE, max_tokens=10, eos_ids=()), lossless=True, cache=cache)

    def served(decoder):
        batch = ContinuousBatch(decoder, plan, keep_keys=decoder.keep_keys)
        pending, rows, step = list(enumerate(prompts)), {}, 0
        while pending or batch.rows:
            if pending and pending[0][0] * 3 <= step and batch.can_join:
                i, p = pending.pop(0)
                rows[i] = batch.join(p, max_tokens=10 - 2 * i)
            batch.step()
            step += 1
        return {i: r.out for i, r in rows.items()}

    assert served(compiled) == served(eager)


def test_decoders_over_one_model_share_its_joined_weights(tmp_path_factory):
    """A server makes several decoders over one model: they share one lean forward (the joined
    weights are not made twice), and one made after the weights changed joins the new ones."""
    m = loaded(tmp_path_factory, "llama", seed=6)
    first, second = MlxDecoder(m, compile=True), MlxDecoder(m, compile=True)
    assert first.compiled.lean is second.compiled.lean
    prompts = prompts_of(m.tokenizer)
    plan = make_plan(**BASE, threshold=1.0)
    before = generate(second, prompts, plan).tokens
    up = m.model.model.layers[0].mlp.up_proj
    up.weight = up.weight * 3.0  # (as a training step would: a new array)
    third = MlxDecoder(m, compile=True)
    assert third.compiled.lean is not first.compiled.lean
    after = generate(third, prompts, plan).tokens
    assert after == generate(MlxDecoder(m), prompts, plan).tokens and after != before
