"""The MLX decoding step crosses between host and device once each way: every host input of a step
(ids, positions, masks, reads, drafts, tree) goes to the device in one `mx.array`, and every result
comes back in one `np.array`, whatever the step's kind (greedy AR, greedy lossless with runners-up
and log-probabilities, sampled lossless with and without a tree, a sliding window that cuts).

The copies are counted, not timed: mars's modules see an `mx` whose `array`/`asarray` count what
they make of host data, and an `np` whose `array`/`asarray` count what they read from an mx.array;
an mx.array's own read-backs (`item`, `tolist`, `__bool__`, `__int__`, `__float__`) count wherever
they are called during a step.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from tiny import make_plan, save_model  # noqa: E402

from mars.backends.mlx.decode import MlxDecoder  # noqa: E402
from mars.backends.mlx.load import load  # noqa: E402
from mars.core.decode.loop import generate  # noqa: E402
from mars.core.decode.plan import Sampling  # noqa: E402
from mars.core.tokens import encode_prompt  # noqa: E402

PROMPTS = ["Hello there", "What is 2+2? Tell me now.", "x", "Write a short poem about the sea, please"]
SAMPLED = Sampling(temperature=1.0, seed=0)
READ_BACKS = ("item", "tolist", "__bool__", "__int__", "__float__")


@contextmanager
def counting(monkeypatch):
    """Count host-to-device copies ("h2d") and device-to-host reads ("d2h") while active."""
    counts = Counter()
    state = {"on": False}

    class Counting(type):
        def __call__(cls, data, *args, **kwargs):
            if state["on"] and not isinstance(data, mx.array):
                counts["h2d"] += 1
            return mx.array(data, *args, **kwargs)

        def __instancecheck__(cls, obj):
            return isinstance(obj, mx.array)

    class array(metaclass=Counting):
        pass

    def uploading(fn):
        def upload(data, *args, **kwargs):
            if state["on"] and not isinstance(data, mx.array):
                counts["h2d"] += 1
            return fn(data, *args, **kwargs)

        return upload

    def reading(fn):
        def read(obj, *args, **kwargs):
            if state["on"] and isinstance(obj, mx.array):
                counts["d2h"] += 1
            return fn(obj, *args, **kwargs)

        return read

    counted_mx = types.ModuleType(mx.__name__)
    counted_mx.__dict__.update(mx.__dict__)
    counted_mx.array = array
    counted_mx.asarray = uploading(mx.asarray)
    counted_np = types.ModuleType(np.__name__)
    counted_np.__dict__.update(np.__dict__)
    counted_np.array = reading(np.array)
    counted_np.asarray = reading(np.asarray)
    for name, module in list(sys.modules.items()):
        if name.startswith("mars."):
            if getattr(module, "mx", None) is mx:
                monkeypatch.setattr(module, "mx", counted_mx)
            if getattr(module, "np", None) is np:
                monkeypatch.setattr(module, "np", counted_np)
    for method in READ_BACKS:
        monkeypatch.setattr(mx.array, method, reading(getattr(mx.array, method)))
    yield counts, state


def per_step(monkeypatch, decoder, prompts, plan) -> list[tuple[str, dict, Counter]]:
    """Decode `prompts` with `plan`; per call of `decoder.step` or `.speculate`: its name, the
    keywords it was called with, and the copies it made."""
    calls = []
    with counting(monkeypatch) as (counts, state):

        def counted(name):
            method = getattr(decoder, name)

            def call(*args, **kwargs):
                counts.clear()
                state["on"] = True
                try:
                    return method(*args, **kwargs)
                finally:
                    state["on"] = False
                    calls.append((name, kwargs, Counter(counts)))

            return call

        for name in ("step", "speculate"):
            monkeypatch.setattr(decoder, name, counted(name))
        generate(decoder, prompts, plan)
    return calls


def plan(**kw):
    return make_plan(**dict(dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=12, block_cache=8), **kw))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(save_model(tmp_path_factory.mktemp("llama") / "m", "llama", seed=1)), announce=lambda m: None)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A model whose every layer slides over a window shorter than the prompts: the window cuts."""
    path = save_model(tmp_path_factory.mktemp("mistral") / "m", "mistral", seed=1, window=6)
    return load(str(path), announce=lambda m: None)


KINDS = {
    "greedy AR": (dict(threshold=1.0), "step"),
    "greedy threshold": (dict(threshold=0.5), "step"),
    "greedy lossless, runners-up and logprobs": (dict(lossless=True, alternatives=2, hedge=1, logprobs=2), "step"),
    "sampled lossless": (dict(lossless=True, sampling=SAMPLED, logprobs=2), "speculate"),
    "sampled lossless, tree": (dict(lossless=True, sampling=SAMPLED, tree=8, logprobs=2), "speculate"),
}


@pytest.mark.parametrize("model", ["tiny", "sliding"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cache", ["none", "window", "block"])
def test_a_step_copies_once_each_way(request, monkeypatch, model, kind, cache):
    m = request.getfixturevalue(model)
    asked, method = KINDS[kind]
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    s = plan(cache=cache, **asked)
    calls = per_step(monkeypatch, MlxDecoder(m), prompts, s)
    assert calls and {name for name, _, _ in calls} == {method}
    if s.alternative_groups:  # (the block cache has none)
        assert any(kw.get("runners_up") and kw.get("logprobs") for _, kw, _ in calls)
    if s.tree_nodes:
        assert any(kw.get("tree") is not None for _, kw, _ in calls)
    for name, kw, counts in calls:
        assert counts["h2d"] == 1 and counts["d2h"] == 1, (name, counts)


def test_runners_up_from_a_read_on(tiny):
    """Runners-up asked from read j on: the same as asked for every read there; before, none (-1) or the same."""
    dec = MlxDecoder(tiny)
    p = encode_prompt(tiny.tokenizer, PROMPTS[1])
    n = len(p)
    both, positions = np.asarray([p, p]), np.tile(np.arange(n), (2, 1))
    reads = np.array([[n - 3, n - 2, n - 1], [n - 1, n - 1, n - 2]])
    full = dec.step(None, both, positions, None, reads, metric=None, sampling=Sampling(), runners_up=2)
    part = dec.step(
        None, both, positions, None, reads, metric=None, sampling=Sampling(), runners_up=2, runners_up_from=1
    )
    assert part.ids.tolist() == full.ids.tolist()
    assert part.runners_up[:, 1:].tolist() == full.runners_up[:, 1:].tolist()
    before, every = part.runners_up[:, 0], full.runners_up[:, 0]  # none, or the same
    assert ((before == -1) | (before == every)).all() and (every >= 0).all() and (before == -1).any()
