"""The fixed-shape compiled step (models.CompiledStep with `fixed`: what CUDA captures as graphs,
asked for here on the CPU): every step, the prompt's too, padded to a width bucket, its reads to the
width, attending over the cache's whole room under a mask that hides the room past the cached
length. The tokens of the eager steps in every kind of step, a graph per shape and none after the
warm-up, the room mask against the StepMask's (other families: tests/test_compiled.py). Tiny
models: a graph compiles in seconds here; the tests that make many graphs are `slow`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import COMPILED_BASE, COMPILED_MODES, chat_prompts, eager_and_compiled, make_plan, make_tokenizer

from mars.backends.torch import models
from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.models.base import room_allowed, step_allowed
from mars.core.decode.loop import generate
from mars.core.masks import StepMask

BASE, MODES = COMPILED_BASE, COMPILED_MODES


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


prompts_of = chat_prompts


def decoders(tok, arch: str, seed: int = 1, **kw):
    return eager_and_compiled(tok, arch, seed, fixed=True, **kw)


@pytest.fixture(scope="module")
def llama(tok):
    return decoders(tok, "llama")


def watch(monkeypatch, decoder) -> list[int]:
    """The cached length of every step the fixed graph ran."""
    graph, lengths = decoder.compiled._graph, []

    def run(*args):
        lengths.append(int(args[6][0]))
        return graph(*args)

    monkeypatch.setattr(decoder.compiled, "_graph", run)
    return lengths


# AR and trees in the fast suite; the other kinds of step (a graph or two each) with the slow tests.
SLOW_MODES = ("threshold", "lossless_groups_logprobs", "lossless_block")


@pytest.mark.parametrize(
    "mode", ["ar", "lossless_trees"] + [pytest.param(m, marks=pytest.mark.slow) for m in SLOW_MODES]
)
def test_fixed_steps_give_the_eager_tokens(llama, tok, mode, monkeypatch):
    eager, fixed = llama
    lengths = watch(monkeypatch, fixed)
    plan = make_plan(**BASE, **MODES[mode])
    both, one = prompts_of(tok), prompts_of(tok)[:1]
    assert generate(fixed, both, plan).tokens == generate(eager, both, plan).tokens  # a batch
    assert generate(fixed, one, plan).tokens == generate(eager, one, plan).tokens  # a row alone
    assert 0 in lengths and max(lengths) > 0  # the prompts' steps and the later ones ran the graph


def test_the_room_mask_is_the_step_mask_where_the_cache_is_live():
    rng = np.random.default_rng(0)
    for cached, width, room in [(0, 4, 8), (5, 1, 8), (7, 4, 16), (3, 8, 256)]:
        b = 3
        keys = rng.random((b, cached + width)) < 0.8
        see = np.stack([rng.integers(-1, width, width) for _ in range(b)])
        see = np.minimum(see, np.arange(width))
        start = np.maximum(see + 1 + rng.integers(0, 3, see.shape), 0)
        start = np.minimum(start, np.arange(width))
        for parts in [(None, None, None), (keys, None, None), (None, see, start), (keys, see, start)]:
            k, s, st = parts
            want = StepMask(cached, width, k, s, st).dense(b)
            on = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
            laid = None if k is None else models.room_layout(k, cached, room)
            got = room_allowed(torch.tensor([cached]), room, width, b, on(laid), on(s), on(st)).numpy()
            assert got.shape == (b, width, room + width)
            assert (got[..., :cached] == want[..., :cached]).all()
            assert (got[..., room:] == want[..., cached:]).all()
            assert not got[..., cached:room].any()  # the room past the cached length: never seen
            device = step_allowed(cached, width, b, on(k), on(s), on(st), "cpu").numpy()
            assert (device == want).all()


def test_graph_widths():
    assert [models.graph_width(w) for w in (1, 3, 5, 9, 33, 64, 65, 129, 300)] == [1, 4, 8, 16, 64, 64, 128, 256, 512]


@pytest.mark.slow  # (a minute and a half: many shapes, each a graph)
def test_a_graph_per_shape_and_none_after_the_warm_up(tok, monkeypatch):
    # A shape no other test compiles (graphs are shared by models of one shape).
    eager, fixed = decoders(tok, "llama", hidden=40, seed=7)
    lengths = watch(monkeypatch, fixed)
    prompts = prompts_of(tok)
    plans = [make_plan(**BASE, **MODES[m]) for m in ("ar", "lossless")]
    for plan in plans:
        assert generate(fixed, prompts, plan).tokens == generate(eager, prompts, plan).tokens
        generate(fixed, prompts[:1], plan)
    warm = fixed.compiled.compiles
    assert warm >= 2
    ran = len(lengths)
    for plan in plans:  # the same shapes again: no graph more
        generate(fixed, prompts, plan)
        generate(fixed, prompts[:1], plan)
    assert fixed.compiled.compiles == warm and len(lengths) > ran
    # A prompt past the widest bucket: its step padded to a power of two, one graph for that length.
    longer = prompts_of(tok, ("a much longer prompt than before, " * 12,))
    assert len(longer[0]) > 64
    plan = make_plan(**BASE, threshold=1.0)
    assert generate(fixed, longer, plan).tokens == generate(eager, longer, plan).tokens
    # The cache grows past its first room: graphs of the larger room, the same tokens.
    plan = make_plan(**dict(BASE, eos_ids=(), max_tokens=300), threshold=1.0)
    assert generate(fixed, prompts[:1], plan).tokens == generate(eager, prompts[:1], plan).tokens
    assert fixed.compiled.compiles <= warm + 4


def test_fixed_shapes_are_for_cuda_unless_asked(llama):
    eager, fixed = llama
    assert fixed.fixed and fixed.buckets and fixed.cost_key()["fixed"] == 1
    cpu = TorchDecoder(eager.tm, compile=True)
    assert not cpu.fixed and not cpu.buckets  # the CPU's compiled graph follows the cached length
