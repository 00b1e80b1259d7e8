"""Steps under torch.compile (models.CompiledStep): the tokens of the eager steps in every mode,
batch and cache, a few graphs compiled once and not again as the cache grows, and the switch on the
session. Tiny models: compiling one takes seconds here."""

from __future__ import annotations

import pytest
import torch
from tiny import (
    COMPILED_BASE,
    COMPILED_MODES,
    chat_prompts,
    eager_and_compiled,
    make_model,
    make_plan,
    make_tokenizer,
    save_model,
)

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode import cost
from mars.core.decode.loop import generate
from mars.core.decode.plan import Sampling

BASE, MODES = COMPILED_BASE, COMPILED_MODES


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


prompts_of = chat_prompts


decoders = eager_and_compiled


@pytest.fixture(scope="module")
def llama(tok):
    return decoders(tok, "llama")


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_steps_give_the_eager_tokens_in_every_mode(llama, tok, mode, monkeypatch):
    eager, compiled = llama
    graph, ran = compiled.compiled._graph, []
    monkeypatch.setattr(compiled.compiled, "_graph", lambda *args: ran.append(1) or graph(*args))
    plan = make_plan(**BASE, **MODES[mode])
    both, one = prompts_of(tok), prompts_of(tok)[:1]
    assert generate(compiled, both, plan).tokens == generate(eager, both, plan).tokens  # a batch
    assert generate(compiled, one, plan).tokens == generate(eager, one, plan).tokens  # a row alone
    assert ran  # the steps after the prompt's ran the compiled graph


def test_compiled_sampling_draws_what_the_eager_steps_draw(llama, tok):
    eager, compiled = llama
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**BASE, **asked, sampling=Sampling(temperature=0.8, seed=5))
        assert generate(compiled, prompts_of(tok), plan).tokens == generate(eager, prompts_of(tok), plan).tokens


def test_no_graph_is_compiled_after_the_warm_up(tok):
    # A shape no other test compiles (graphs are shared by models of one shape, each with its own
    # weights, which another seed checks: a graph that kept the first model's would give its tokens).
    eager, compiled = decoders(tok, "llama", hidden=48, seed=7)
    prompts = prompts_of(tok)
    for asked in (dict(threshold=1.0), dict(lossless=True)):  # one-token and wider steps, one and two rows
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens
        generate(compiled, prompts[:1], plan)
    warm = compiled.compiled.compiles
    assert 1 <= warm <= 4  # (one row, several) x (one token, several)
    longer = prompts_of(tok, ("a much longer prompt than before, " * 4, "and another one"))
    for asked in (dict(threshold=1.0), dict(lossless=True)):  # other lengths, other widths
        plan = make_plan(**dict(BASE, max_tokens=20), **asked)
        assert generate(compiled, longer, plan).tokens == generate(eager, longer, plan).tokens
        generate(compiled, longer[1:], plan)
    # The cache grows past its first room (256 positions).
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**dict(BASE, eos_ids=(), max_tokens=300), **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens
    # Forwards of 1, 2 and 4 rows at the widths a cost curve is measured at.
    for batch in (1, 2, 4):
        cost.calibrate(compiled, [3] * 32, widths=cost.PROBE_WIDTHS, repeats=1, filler=3, ar_filler=2, batch=batch)
    assert compiled.compiled.compiles == warm
    other_eager, other = decoders(tok, "llama", hidden=48, seed=8)  # the same graphs, other weights
    plan = make_plan(**BASE, lossless=True)
    assert generate(other, prompts, plan).tokens == generate(other_eager, prompts, plan).tokens
    assert generate(other, prompts, plan).tokens != generate(eager, prompts, plan).tokens
    assert other.compiled.compiles == 0


@pytest.mark.parametrize("fixed", [None, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("arch", "kw"), [("qwen3", {}), ("granite", {}), ("mistral", {"window": 5})])
def test_compiled_steps_of_other_families_give_the_eager_tokens(tok, arch, kw, fixed):
    """Per-head norms (qwen3), multipliers (granite), a sliding window that cuts (mistral); the graph
    over the cached length and the fixed-shape one (tests/test_compiled_fixed.py), whose window cuts
    over the room's key positions."""
    eager, compiled = decoders(tok, arch, fixed=fixed, **kw)
    prompts = prompts_of(tok, ("Hello there, how are you today? " * 2, "x"))
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**dict(BASE, max_tokens=16), **asked)
        assert generate(compiled, prompts, plan).tokens == generate(eager, prompts, plan).tokens, (arch, asked)


def test_the_session_switch(tmp_path):
    from mars.session import Session

    path = save_model(tmp_path / "m")
    eager = Session(str(path), backend="torch", device="cpu", announce=lambda m: None)
    compiled = Session(str(path), backend="torch", device="cpu", announce=lambda m: None, compile=True)
    assert eager.decoder.compiled is None and compiled.decoder.compiled is not None
    assert compiled.decoder.cost_key() != eager.decoder.cost_key()  # a compiled step's costs are its own
    auto = Session(str(path), backend="torch", device="cpu", announce=lambda m: None, compile="auto")
    assert auto.compile is False and auto.decoder.compiled is None  # auto compiles on CUDA only
    heard = []
    mlx = Session(str(path), backend="mlx", announce=heard.append, compile="on")
    assert mlx.compile is True and mlx.decoder.compiled is not None and any("mx.compile" in h for h in heard)
    assert Session(str(path), backend="mlx", announce=heard.append).decoder.compiled is None
    with pytest.raises(TypeError, match="'on', 'off' or 'auto'"):
        Session(str(path), backend="torch", compile="yes")


def test_models_whose_weights_differ_in_shape_get_their_own_graphs(tok):
    """Graphs are shared by models whose every weight has the same shape (the signature guard): one
    whose MLP alone is wider must not run another's graph."""
    import transformers

    from mars.backends.torch import models

    first = make_model("llama", len(tok), seed=1)
    config = first.config.to_dict()
    config["intermediate_size"] *= 3
    torch.manual_seed(2)
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    tms = [TorchModel(m, tok, None, "", torch.device("cpu"), torch.float32) for m in (first, wider)]
    steps = [models.CompiledStep(TorchDecoder(tm).lean) for tm in tms]
    assert steps[0].signature != steps[1].signature
    eager, compiled = TorchDecoder(tms[1]), TorchDecoder(tms[1], compile=True)
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts_of(tok), plan).tokens == generate(eager, prompts_of(tok), plan).tokens


def test_wide_graphs_run_the_packed_products_the_eager_step_runs(llama):
    """On the CPU the eager step's products of 2 rows or more are packed (packed.py); a compiled wide
    graph calls the same packs through one custom op, which gives the eager packed product bit for
    bit at every row count."""
    from mars.backends.torch import packed

    eager, compiled = llama
    assert eager.packed and compiled.packed and compiled.compiled.packs
    layer = compiled.compiled.model.blocks[0].mlp.up.base
    assert "_mars_packed" in layer.__dict__
    with torch.no_grad():  # (as decoding runs: a weight that wants a gradient runs F.linear)
        for rows in (2, 3, 5, 9, 17):
            x = torch.randn(rows, layer.in_features)
            want = torch.ops.mkldnn._linear_pointwise(x, layer._mars_packed, layer.bias, "none", [None], "")
            got = packed.packed_product(x, layer._mars_packed, layer.bias, layer.out_features)
            assert torch.equal(got, want)
            assert torch.equal(packed.linear(layer, x), want)  # the eager step's path


def test_auto_compiles_a_cpu_step_where_the_kept_curves_say_it_pays(tmp_path, monkeypatch):
    from mars.backends import base
    from mars.checkpoint.default_model import keyed_cache_file
    from mars.session import Session

    monkeypatch.setenv("MARS_HOME", str(tmp_path / "home"))
    path = str(save_model(tmp_path / "m"))

    def session(heard=None, setting="auto"):
        heard = [] if heard is None else heard
        return Session(path, backend="torch", device="cpu", announce=heard.append, compile=setting)

    first = session()
    assert first.compile is False and first.decoder.compiled is None  # nothing measured yet: eager
    key = first.decoder.cost_key()

    def keep(decoder_key, one, wide):
        cost.CostCurve({1: one, 8: wide}).save(keyed_cache_file("cost", base.curve_key(first.loaded, decoder_key)))

    keep(key, 0.010, 0.020)  # an eager run's kept curve
    assert session().compile is False  # no compiled curve: eager
    keep({**key, "compiled": 1}, 0.0095, 0.019)  # a run with --compile on kept 0.95x: too little
    assert session().compile is False
    keep({**key, "compiled": 1}, 0.006, 0.018)
    heard = []
    chosen = session(heard)
    assert chosen.compile is True and chosen.decoder.compiled is not None
    assert any("kept cost curves say it pays" in h and "0.60x" in h for h in heard)
    assert session(setting="off").compile is False
    keep({**key, "compiled": 1}, 0.006, 0.025)  # dearer at the widest width both measured
    assert session().compile is False
    assert chosen.decoder.on_compile_error is not None  # "auto": a failing compiled step gives way
    assert session(setting="on").decoder.on_compile_error is None  # asked for: its error stops the call


@pytest.mark.parametrize("fixed", [None, True])
def test_a_failing_compiled_step_gives_way_to_eager_steps_where_told(llama, tok, fixed):
    """`on_compile_error` (what --compile auto gives): a compiled step that raises is dropped, the
    message says why, and that step and the rest run eager on the same cache, with the eager tokens
    (the graph over the cached length fails at the step after the prompt's, the fixed-shape one at
    the prompt's). Without it (--compile on) the error stops the call."""
    eager, _ = llama

    def broken(*args):
        raise RuntimeError("no working compiler here\nthe rest of the trace")

    plan = make_plan(**BASE, lossless=True)
    prompts = prompts_of(tok)
    heard = []
    dec = TorchDecoder(eager.tm, compile=True, fixed=fixed, on_compile_error=heard.append)
    dec.compiled._graph = broken
    assert generate(dec, prompts, plan).tokens == generate(eager, prompts, plan).tokens
    assert dec.compiled is None and dec.forward is dec.lean and "compiled" not in dec.cost_key()
    assert len(heard) == 1 and "RuntimeError: no working compiler here)" in heard[0]
    strict = TorchDecoder(eager.tm, compile=True, fixed=fixed)
    strict.compiled._graph = broken
    with pytest.raises(RuntimeError, match="no working compiler"):
        generate(strict, prompts, plan)


def test_inductor_keeps_its_work_under_the_cache_directory(llama):
    """Building a transformers model makes inductor name its default (a temporary directory) in the
    environment before any step is compiled; a compiled step puts mars's back (the user's own
    TORCHINDUCTOR_CACHE_DIR, where set before mars was imported, wins)."""
    import os

    from mars.backends.torch import models
    from mars.backends.torch.models import compiled
    from mars.checkpoint.default_model import cache_root

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/elsewhere"
    models.CompiledStep(llama[0].lean)
    want = compiled.USER_INDUCTOR_DIR or str(cache_root() / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == want != "/tmp/elsewhere"


def test_models_alike_in_shape_but_not_in_activation_get_their_own_graphs(tok):
    """The signature stands for dynamo's dropped checks of the model's objects: a model whose every
    weight has another's shape but whose MLP activates otherwise must not run the other's graph."""
    import transformers

    silu_eager, silu = decoders(tok, "llama", seed=1)
    plan = make_plan(**BASE, threshold=1.0)
    assert generate(silu, prompts_of(tok), plan).tokens == generate(silu_eager, prompts_of(tok), plan).tokens
    config = silu.tm.model.config.to_dict()
    config["hidden_act"] = "gelu"
    torch.manual_seed(3)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    tm = TorchModel(other, tok, None, "", torch.device("cpu"), torch.float32)
    eager, compiled = TorchDecoder(tm), TorchDecoder(tm, compile=True)
    from mars.backends.torch.models.compiled import signature

    assert "GELU" in compiled.compiled.signature and compiled.compiled.signature != signature(silu.lean, False)
    for asked in (dict(threshold=1.0), dict(lossless=True)):
        plan = make_plan(**BASE, **asked)
        assert generate(compiled, prompts_of(tok), plan).tokens == generate(eager, prompts_of(tok), plan).tokens
