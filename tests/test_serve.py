"""`mars serve`: continuous batching, the threshold policies and the OpenAI-compatible API.

Tiny float32 models (tests/tiny.py) initialised at a large scale, so greedy argmax does
not depend on the shape of the forward: exact token equality between a request decoded in
a busy batch and the same prompt decoded alone by `generate()` is a fair test. Servers run
on loopback (uvicorn in a background thread) and are driven with the `openai` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from tiny import PROMPTS, feed_of, make_model, make_plan, make_tokenizer, spell_records, train_spelling  # noqa: E402

from mars.backends.torch.decode import TorchDecoder  # noqa: E402
from mars.backends.torch.load import TorchModel  # noqa: E402
from mars.core.acceptance import accept_counts  # noqa: E402
from mars.core.config import MarsConfig  # noqa: E402
from mars.core.decode.drafts.tree import TreeDrafts  # noqa: E402
from mars.core.decode.loop import ContinuousBatch, generate  # noqa: E402
from mars.core.tokens import encode_prompt  # noqa: E402
from mars.serve import EngineLimits, ServeLimits, build  # noqa: E402
from mars.serve.api import TextStream  # noqa: E402
from mars.serve.policy import PolicyError, PolicySettings, ThresholdPolicy  # noqa: E402
from mars.session import Session  # noqa: E402

MASK, EOS = 3, 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tm(tok):
    """A random tiny model that claims MARS training (so thresholds below 1 are allowed)."""
    mars = MarsConfig(block_size=4, mask_token="<unused0>", mask_token_id=MASK, default_threshold=1.0)
    return TorchModel(make_model("llama", len(tok), seed=1), tok, mars, "", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def plain_tm(tok):
    """The same kind of model without mars.json: never MARS-trained."""
    return TorchModel(make_model("llama", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)


HTTP_TIMEOUT = 120  # seconds a request may take: httpx's default, 5 s, is short on a busy machine


def http_get(url, **kw):
    return httpx.get(url, **{"timeout": HTTP_TIMEOUT, **kw})


def http_post(url, **kw):
    return httpx.post(url, **{"timeout": HTTP_TIMEOUT, **kw})


def decode_settings(tm, **kw):
    base = dict(mask_id=MASK, eos_ids=tm.eos_ids, block_size=4, max_tokens=24, block_cache=8)
    return make_plan(**{**base, **kw})


def reference(tm, prompt_ids, max_tokens):
    """`mars generate --threshold 1.0` for one prompt: tokens, text, finish."""
    result = generate(
        TorchDecoder(tm), [prompt_ids], decode_settings(tm, threshold=1.0, max_tokens=max_tokens, cache="window")
    )
    tokens = result.tokens[0]
    return (
        tokens,
        tm.tokenizer.decode(tokens, skip_special_tokens=True),
        {"eos": "stop", "length": "length"}[result.finish[0]],
    )


class Live:
    """A server on a free loopback port, in a background thread."""

    def __init__(
        self, tm, decoder_cls=TorchDecoder, *, policy=None, engine_limits=None, serve_limits=None, name="tiny"
    ):
        self.app, self.engine = build(
            Session.from_loaded(tm, decoder_cls),
            name=name,
            policy=policy,
            engine_limits=engine_limits or EngineLimits(max_batch=8, block_cache=8),
            serve_limits=serve_limits,
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120  # seconds on an idle machine; generous for a busy one
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT, **kw)

    def async_client(self, **kw):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT, **kw)

    def metric(self, name: str) -> float:
        for line in http_get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def close(self):
        self.server.should_exit = True
        self.thread.join(20)


@contextlib.contextmanager
def live(*args, **kw):
    server = Live(*args, **kw)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def server(tm):
    with live(tm) as s:
        yield s


def wait_for(condition, timeout=120.0, what="condition"):
    """Poll `condition` until it holds; `timeout` only bounds how long a failing test hangs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- the core: per-row thresholds and the continuous batch ----------------------------------------


def test_per_row_thresholds_equal_one_threshold_per_row():
    rng = np.random.default_rng(0)
    conf = rng.uniform(size=(6, 5))
    limits = np.array([5, 5, 3, 0, 5, 1])
    for metric in ("probability", "margin", "entropy"):
        thresholds = np.array([1.0, 0.5, 0.2, 0.7, 0.0, 0.3])
        per_row = accept_counts(conf, metric, thresholds, limits)
        one_by_one = [
            accept_counts(conf[i : i + 1], metric, float(t), limits[i : i + 1])[0] for i, t in enumerate(thresholds)
        ]
        assert per_row.tolist() == one_by_one, metric


def staggered(decoder, prompts, s, *, thresholds=None, keep_keys=None, every=3, cancel=None):
    """Rows ask to join one every `every` steps (they join at the next block boundary), each
    with its own threshold and max_tokens; `cancel` = (row, n) removes a row once it has n tokens.
    Returns each row's output and the widest cache seen."""
    batch = ContinuousBatch(decoder, s, keep_keys=keep_keys)
    pending = list(enumerate(prompts))
    rows, widest, step = {}, 0, 0
    while pending or batch.rows:
        if pending and pending[0][0] * every <= step and batch.can_join:
            i, p = pending.pop(0)
            threshold = 1.0 if thresholds is None else thresholds[i % len(thresholds)]
            rows[i] = batch.join(p, threshold=threshold, max_tokens=s.max_tokens - 4 * (i % 3))
        gone = rows.get(cancel[0]) if cancel else None
        if gone in batch.rows and len(gone.out) >= cancel[1]:
            batch.leave([gone])
        batch.step()
        widest = max(widest, batch.cache_width)
        step += 1
    return {i: r.out for i, r in rows.items()}, widest


def decoded_alone(decoder, prompt, s, i, threshold=1.0, **changes):
    """Row i decoded by itself in AR or plain threshold mode at `threshold`, with the same
    settings otherwise (the block cache, its max_tokens) but `changes`: the DecodeResult."""
    from mars.core.decode.plan import replan

    plan = replan(
        s,
        None,
        threshold=threshold,
        lossless=False,
        verify=False,
        force=True,
        max_tokens=s.max_tokens - 4 * (i % 3),
        **changes,
    )
    return generate(decoder, [prompt], plan)


def alone(decoder, prompt, s, i, threshold=1.0, **changes):
    """The tokens of `decoded_alone`."""
    return decoded_alone(decoder, prompt, s, i, threshold, **changes).tokens[0]


@pytest.mark.parametrize("lossless", [False, True])
def test_rows_joining_and_leaving_decode_as_alone(tm, tok, lossless):
    prompts = [encode_prompt(tok, p) for p in PROMPTS] * 2
    s = decode_settings(tm, threshold=1.0, max_tokens=20, lossless=lossless, cache="block")
    dec = TorchDecoder(tm)
    out, widest = staggered(dec, prompts, s, keep_keys=dec.keep_keys, cancel=(5, 4))
    _, unbounded = staggered(dec, prompts, s, cancel=(5, 4))
    for i, p in enumerate(prompts):
        expected = alone(dec, p, s, i, cache="window")  # what `mars generate` says
        if i == 5:  # cancelled midway: what it had is the start of what it would have said
            assert expected[: len(out[i])] == out[i] and len(out[i]) < len(expected)
        else:
            assert out[i] == expected, i
    # Rows that left had their cache entries dropped: the cache stays well below what it grows to without.
    assert widest < 0.6 * unbounded, (widest, unbounded)


def test_rows_at_any_threshold_decode_as_alone(tm, tok):
    """Rows with different thresholds share the batch; each one's tokens are those it gets
    alone on the block cache (its blocks start where its prompt ends, whoever else is there)."""
    prompts = [encode_prompt(tok, p) for p in PROMPTS] * 2
    thresholds = [1.0, 0.3, 0.6, 0.1, 0.9]
    s = decode_settings(tm, threshold=1.0, max_tokens=20, cache="block")
    dec = TorchDecoder(tm)
    out, _ = staggered(dec, prompts, s, thresholds=thresholds, keep_keys=dec.keep_keys, every=2)
    accepted_masks = 0
    for i, p in enumerate(prompts):
        t = thresholds[i % len(thresholds)]
        single = decoded_alone(dec, p, s, i, t)
        assert out[i] == single.tokens[0], (i, t)
        accepted_masks += single.stats.accepted - single.stats.row_forwards
    assert accepted_masks > 0  # the low thresholds really took several tokens per forward


def test_a_row_alone_after_the_others_left_before_its_first_step(tm, tok):
    prompts = [encode_prompt(tok, p) for p in PROMPTS[:3]]
    s = decode_settings(tm, threshold=1.0, max_tokens=12, cache="block")
    dec = TorchDecoder(tm)
    batch = ContinuousBatch(dec, s, keep_keys=dec.keep_keys)
    first = batch.join(prompts[0])
    while first in batch.rows and len(first.out) < s.block_cache:
        batch.step()
    assert batch.can_join and len(first.out) == s.block_cache
    second = batch.join(prompts[1])  # at the boundary
    batch.leave([first])  # the only row with cache entries goes: the cache starts afresh
    assert batch.cache_width == 0
    third = batch.join(prompts[2])
    while batch.rows:
        batch.step()
    assert second.out == alone(dec, prompts[1], s, 0) and third.out == alone(dec, prompts[2], s, 0)


@pytest.mark.parametrize("cost", [False, True])
def test_window_batch_rows_joining_at_any_step_decode_as_ar(tm, tok, cost):
    """Greedy lossless serving on the window cache: rows join at any step (their prompts fed
    beside the others' drafts and masks), leave when done or removed, and each takes exactly
    its greedy AR tokens; with a cost curve the feed is chosen per step. Dead keys of rows
    that left are dropped."""
    from mars.core.decode.cost import CostCurve

    prompts = [encode_prompt(tok, p) for p in PROMPTS] * 2
    s = decode_settings(tm, threshold=1.0, max_tokens=20, lossless=True, cache="window", ngram=8)
    dec = TorchDecoder(tm)
    feed = feed_of(CostCurve({1: 1.0, 8: 1.1, 32: 1.6})) if cost else None

    def serve(keep_keys):
        batch = ContinuousBatch(dec, s, keep_keys=keep_keys, controller=feed)
        assert batch.can_join  # the window cache takes rows at any step
        rows, widest, step, pending = {}, 0, 0, list(enumerate(prompts))
        while pending or batch.rows:
            while pending and pending[0][0] * 3 <= step:  # a row every third step, even mid-draft
                i, p = pending.pop(0)
                rows[i] = batch.join(p, max_tokens=s.max_tokens - 4 * (i % 3))
            gone = rows.get(5)
            if gone in batch.rows and len(gone.out) >= 4:
                batch.leave([gone])
            batch.step()
            widest = max(widest, batch.cache_width)
            step += 1
        return batch, rows, widest, step

    _, _, unbounded, _ = serve(None)
    batch, rows, widest, step = serve(dec.keep_keys)
    kept = 0
    for i, p in enumerate(prompts):
        expected = alone(dec, p, s, i, cache="window")
        if i == 5:
            assert expected[: len(rows[i].out)] == rows[i].out and len(rows[i].out) < len(expected)
        else:
            assert rows[i].out == expected, i
        kept += sum(v for k, v in rows[i].stats.by_source.items() if k != "ar")
    assert kept > 0  # drafts were kept: more than one token per forward somewhere
    assert batch.stats.forwards < step + 1
    # Rows that left had their keys dropped: the cache stays well below what it grows to without.
    assert widest < 0.6 * unbounded, (widest, unbounded)
    if cost:
        (policy,) = feed.feeds.values()
        assert sum(policy.choices.values()) >= batch.stats.forwards


def test_window_batch_rows_at_any_threshold_decode_as_alone(tm, tok):
    """Threshold mode on a window batch: each row at its own threshold takes what it takes
    alone with the window cache (B masks a step), whoever else is in the batch."""
    prompts = [encode_prompt(tok, p) for p in PROMPTS] * 2
    thresholds = [1.0, 0.3, 0.6, 0.1, 0.9]
    s = decode_settings(tm, threshold=1.0, max_tokens=20, cache="window")
    dec = TorchDecoder(tm)
    batch = ContinuousBatch(dec, s, keep_keys=dec.keep_keys)
    rows, step, pending = {}, 0, list(enumerate(prompts))
    while pending or batch.rows:
        while pending and pending[0][0] * 3 <= step:
            i, p = pending.pop(0)
            rows[i] = batch.join(p, threshold=thresholds[i % 5], max_tokens=s.max_tokens - 4 * (i % 3))
        batch.step()
        step += 1
    extra = 0
    for i, p in enumerate(prompts):
        single = decoded_alone(dec, p, s, i, thresholds[i % 5])
        assert rows[i].out == single.tokens[0], i
        extra += single.stats.accepted - single.stats.row_forwards
    assert extra > 0


def test_a_served_batch_needs_a_cache(tm):
    with pytest.raises(ValueError, match="cache"):
        ContinuousBatch(TorchDecoder(tm), decode_settings(tm, cache="none"))


@pytest.mark.parametrize("cache,lossless", [("block", False), ("window", False), ("window", True)])
def test_continuous_batch_on_mlx(tmp_path, cache, lossless):
    pytest.importorskip("mlx.core")
    from tiny import save_model

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load as mlx_load

    loaded = mlx_load(save_model(tmp_path / "model", "llama", seed=1), announce=lambda m: None)
    prompts = [encode_prompt(loaded.tokenizer, p) for p in PROMPTS]
    s = make_plan(
        mask_id=MASK,
        eos_ids=(EOS,),
        block_size=4,
        max_tokens=16,
        block_cache=8,
        cache=cache,
        lossless=lossless,
        ngram=8 if lossless else 0,
    )
    dec = MlxDecoder(loaded)
    thresholds = [1.0, 0.5]
    out, _ = staggered(dec, prompts, s, thresholds=thresholds, keep_keys=dec.keep_keys, every=2, cancel=(2, 4))
    for i, p in enumerate(prompts):
        if i != 2:
            # lossless: AR's tokens (threshold 1.0 alone); else what the row gets alone at its threshold
            expected = alone(dec, p, s, i, 1.0 if lossless else thresholds[i % 2])
            assert out[i] == expected, i


# -- the policy --------------------------------------------------------------------------------------


def test_adaptive_policy_loosens_at_once_and_tightens_after_the_hold():
    p = ThresholdPolicy(
        "probability", PolicySettings(policy="adaptive", min_threshold=0.6, max_threshold=1.0, full_load=9, hold=1.0)
    )
    assert p.update(1, 0.0) == 1.0
    assert p.update(9, 0.1) == pytest.approx(0.6)  # full load: the loose end at once
    assert p.update(5, 0.2) == pytest.approx(0.6)  # lower load: held...
    assert p.update(0, 0.9) == pytest.approx(0.6)
    assert p.update(0, 1.25) == pytest.approx(0.8)  # ...then the loosest level asked for during the hold
    assert p.update(0, 1.3) == pytest.approx(0.8)
    assert p.update(0, 2.4) == 1.0
    # A request's threshold bounds its strictness; pinned requests and lossless keep theirs.
    p.update(9, 3.0)
    assert p.for_request(None) == pytest.approx(0.6)
    assert p.for_request(0.5) == 0.5 and p.for_request(0.9) == pytest.approx(0.6)
    assert p.for_request(0.9, pinned=True) == 0.9


def test_entropy_policy_loosens_upwards_and_fixed_policy_keeps_the_default():
    p = ThresholdPolicy("entropy", PolicySettings.for_metric("entropy", policy="adaptive", full_load=3, hold=0.0))
    assert p.update(0, 0.0) == 0.0  # AR mode for entropy
    assert p.update(3, 0.1) == 1.0
    assert p.for_request(2.0) == 2.0 and p.for_request(0.5) == 1.0
    fixed = ThresholdPolicy("probability", PolicySettings(default_threshold=0.9))
    assert fixed.update(100, 0.0) == 0.9 and fixed.for_request(None) == 0.9 and fixed.for_request(0.8) == 0.8


def test_policy_refuses_what_an_untrained_model_cannot_do():
    with pytest.raises(PolicyError, match="adaptive"):
        ThresholdPolicy("probability", PolicySettings(policy="adaptive"), trained=False)
    p = ThresholdPolicy("probability", PolicySettings(), trained=False)
    with pytest.raises(PolicyError, match="mars.json"):
        p.configure(default_threshold=0.8)
    with pytest.raises(PolicyError, match="min_threshold"):
        ThresholdPolicy("probability", PolicySettings(min_threshold=0.9, max_threshold=0.5))
    assert not p.allowed(0.9) and p.allowed(1.0)


def test_text_stream_holds_back_stop_prefixes_and_cuts_at_the_stop(tok):
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    stream = TextStream(tok, ["END"])
    got = stream.add(ids("abc E"))
    assert got == "abc "  # "E" may start "END"
    got += stream.add(ids("Nx"))
    assert got == "abc ENx"
    got += stream.add(ids("yEN")) + stream.add(ids("Dzz"))
    assert got == "abc ENxy" and stream.stopped


# -- the server: exactness --------------------------------------------------------------------------


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    assert http_get(server.url + "/health").json() == {"status": "ok"}
    assert http_get(server.url + "/v1/models/tiny").json()["id"] == "tiny"
    assert http_get(server.url + "/v1/models/other").status_code == 404


def test_chat_equals_generate_at_threshold_one(server, tm, tok):
    client = server.client()
    for text in PROMPTS[:4]:
        tokens, ref, finish = reference(tm, encode_prompt(tok, text), 20)
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=20,
            temperature=0,
            extra_body={"threshold": 1.0},
        )
        assert r.choices[0].message.content == ref and r.choices[0].finish_reason == finish
        u = r.usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
            len(encode_prompt(tok, text)),
            len(tokens),
            len(encode_prompt(tok, text)) + len(tokens),
        )
        assert u.model_extra["tokens_per_forward"] == 1.0 and u.model_extra["threshold"] == 1.0


def test_streaming_chat_with_usage(server, tm, tok):
    text = PROMPTS[1]
    tokens, ref, finish = reference(tm, encode_prompt(tok, text), 20)
    chunks = list(
        server.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_completions_streaming_and_not(server, tm, tok):
    client = server.client()
    ids = encode_prompt(tok, "The sea is", chat=False)
    tokens, ref, finish = reference(tm, ids, 16)
    r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=16)
    assert r.choices[0].text == ref and r.choices[0].finish_reason == finish and r.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model="tiny", prompt="The sea is", max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == ref
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=16)
    assert by_ids.choices[0].text == ref


def test_per_request_threshold_and_lossless(server, tm, tok):
    client = server.client()
    msg = [{"role": "user", "content": PROMPTS[3]}]
    fast = client.chat.completions.create(model="tiny", messages=msg, max_tokens=20, extra_body={"threshold": 0.2})
    assert fast.usage.model_extra["threshold"] == 0.2
    assert fast.usage.completion_tokens >= 1 and fast.usage.model_extra["tokens_per_forward"] >= 1.0
    _, ref, _ = reference(tm, encode_prompt(tok, PROMPTS[3]), 20)
    lossless = client.chat.completions.create(
        model="tiny", messages=msg, max_tokens=20, extra_body={"lossless": True, "threshold": 0.2}
    )
    assert lossless.choices[0].message.content == ref and lossless.usage.model_extra["threshold"] is None


@pytest.mark.parametrize("cache", ["window", "block"])
def test_requests_run_on_the_cache_asked(tm, tok, cache):
    """Requests decode on the window cache by default, greedy lossless ones with their feed
    chosen per step by the engine's one cost-aware policy; --cache block puts them all on
    the block cache. Either way a lossless reply is greedy AR's."""
    _, ref, _ = reference(tm, encode_prompt(tok, PROMPTS[2]), 20)
    with live(tm, engine_limits=EngineLimits(max_batch=8, block_cache=8, cache=cache)) as srv:
        msg = [{"role": "user", "content": PROMPTS[2]}]
        job_kinds = []
        make = srv.engine._plan

        def planned(job, *at):  # a job's plan when admitted (`at`: its name at another threshold)
            plan = make(job, *at)
            if not at:
                job_kinds.append(plan.cache)
            return plan

        srv.engine._plan = planned
        r = srv.client().chat.completions.create(
            model="tiny", messages=msg, max_tokens=20, extra_body={"lossless": True}
        )
        t = srv.client().chat.completions.create(
            model="tiny", messages=msg, max_tokens=20, extra_body={"threshold": 0.5}
        )
        policies = list(srv.engine.session.controller.feeds.values())
    assert r.choices[0].message.content == ref
    assert t.usage.model_extra["threshold"] == 0.5
    assert job_kinds == [cache, "window"]  # verified threshold mode runs on the window cache
    if cache == "window":
        forwards = round(r.usage.completion_tokens / r.usage.model_extra["tokens_per_forward"])
        (policy,) = policies
        assert sum(policy.choices.values()) >= forwards > 0  # it chose every step's feed
    else:
        assert policies == []


def test_sampling_requests_are_seeded_and_batched_apart(server):
    client = server.client()
    kw = dict(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=12, temperature=0.9, top_p=0.95
    )
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    unseeded = client.chat.completions.create(extra_body={"lossless": True}, **kw)
    assert unseeded.usage.completion_tokens >= 1 and unseeded.usage.model_extra["threshold"] is None


def test_serves_on_mlx(tmp_path, tok):
    pytest.importorskip("mlx.core")
    from tiny import save_model

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.torch.load import load as torch_load

    path = save_model(tmp_path / "model", "llama", seed=1)
    loaded = mlx_load(path, announce=lambda m: None)
    _, ref, finish = reference(torch_load(path, announce=lambda m: None), encode_prompt(tok, PROMPTS[1]), 16)
    with live(loaded, MlxDecoder) as srv:
        r = srv.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16
        )
    assert r.choices[0].message.content == ref and r.choices[0].finish_reason == finish


def test_stop_strings_are_cut_and_not_included(server, tm, tok):
    _, ref, _ = reference(tm, encode_prompt(tok, PROMPTS[0]), 20)
    stop = ref[5:7]
    expected = ref[: ref.index(stop)]
    client = server.client()
    msg = [{"role": "user", "content": PROMPTS[0]}]
    r = client.chat.completions.create(model="tiny", messages=msg, max_tokens=20, stop=[stop, "never-seen"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=msg, max_tokens=20, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("cache", ["window", "block"])
def test_many_requests_in_flight_equal_generate(server, tm, tok, cache):
    """Greedy requests decoded among others (mixed thresholds, lossless, streaming or not)
    equal the same prompts decoded alone: at threshold 1.0 and lossless, `mars generate
    --threshold 1.0`; at 0.3 in plain threshold mode, `generate()` on the cache the server
    uses, B masks a step."""
    refs = {t: reference(tm, encode_prompt(tok, t), 18)[1] for t in PROMPTS}
    fast = decode_settings(tm, threshold=0.3, max_tokens=18, cache=cache, block_cache=8)
    fast_refs = {
        t: tok.decode(generate(TorchDecoder(tm), [encode_prompt(tok, t)], fast).tokens[0], skip_special_tokens=True)
        for t in PROMPTS
    }

    async def one(client, i):
        text = PROMPTS[i % len(PROMPTS)]
        extra = [{"threshold": 1.0}, {"threshold": 0.3, "verify": False}, {"lossless": True}][i % 3]
        kw = dict(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=18, extra_body=extra)
        if i % 2:
            stream = await client.chat.completions.create(stream=True, **kw)
            out = "".join([c.choices[0].delta.content or "" async for c in stream])
        else:
            out = (await client.chat.completions.create(**kw)).choices[0].message.content
        return text, extra, out

    async def main(srv):
        async with srv.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    if cache == "window":  # the module's server
        results = asyncio.run(main(server))
    else:
        with live(tm, engine_limits=EngineLimits(max_batch=8, block_cache=8, cache="block")) as srv:
            results = asyncio.run(main(srv))
    for text, extra, out in results:
        assert out == (fast_refs if extra.get("threshold") == 0.3 else refs)[text], (text, extra)
    assert any(fast_refs[t] != refs[t] for t in PROMPTS)  # threshold 0.3 is not AR on this model


def test_load_no_lost_or_truncated_responses(tm, tok):
    """48 concurrent streaming clients, 3 requests each, at threshold 1.0: every response
    arrives whole and equals the reference."""
    refs = {t: reference(tm, encode_prompt(tok, t), 12) for t in PROMPTS}
    clients, per_client = 48, 3

    async def worker(client, c):
        out = []
        for k in range(per_client):
            text = PROMPTS[(c + k) % len(PROMPTS)]
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": text}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"threshold": 1.0},
            )
            chunks = [ch async for ch in stream]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            out.append((text, content, finish, chunks[-1].usage.completion_tokens))
        return out

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
            client = openai.AsyncOpenAI(
                base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120, http_client=http
            )
            return await asyncio.gather(*(worker(client, c) for c in range(clients)))

    with live(tm, engine_limits=EngineLimits(max_batch=16, max_queue=64, block_cache=8)) as srv:
        t0 = time.perf_counter()
        results = [r for rs in asyncio.run(main()) for r in rs]
        seconds = time.perf_counter() - t0
        assert srv.engine.in_flight == 0 and srv.engine.queue_depth == 0
    assert len(results) == clients * per_client
    for text, content, finish, n in results:
        tokens, ref, ref_finish = refs[text]
        assert (content, finish, n) == (ref, [ref_finish], len(tokens)), text
    print(f"\nload: {len(results)} responses in {seconds:.1f}s")


# -- the adaptive policy under load -------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model MARS-trained a few steps, so its masks are accepted."""
    return train_spelling(tmp_path_factory.mktemp("serve-learn") / "out")[0]


def test_adaptive_threshold_follows_load_and_beats_fixed(trained):
    """Under a burst the threshold in force falls to the loose end and comes back once the
    load is gone; the same burst takes fewer of the engine's forwards than at a fixed 1.0
    (counted, not timed: speed claims are measured in benchmarks). Each forward is padded to
    >= 20 ms, as a real model's would take, so that requests pile up as they would."""
    prompts = [r["prompt"] for r in spell_records()]
    policy = dict(policy="adaptive", min_threshold=0.6, max_threshold=1.0, full_load=8, hold=0.3)
    limits = EngineLimits(max_batch=8, max_queue=64, block_cache=16)

    async def burst(srv, clients=16, each=2):
        async def worker(client, c):
            usages = []
            for k in range(each):
                r = await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": prompts[(c * each + k) % len(prompts)]}],
                    max_tokens=24,
                )
                usages.append(r.usage)
            return usages

        async with srv.async_client() as client:
            t0 = time.perf_counter()
            usages = [u for us in await asyncio.gather(*(worker(client, c) for c in range(clients))) for u in us]
            return usages, time.perf_counter() - t0

    def admin(srv, **body):
        r = http_post(srv.url + "/admin/policy", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    trajectory = []

    def watch(srv, stop):
        while not stop.is_set():
            trajectory.append((time.perf_counter(), srv.metric("mars_threshold")))
            time.sleep(0.02)

    with live(trained, gated(delay=0.02), policy=policy, engine_limits=limits) as srv:
        alone = srv.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompts[0]}], max_tokens=24
        )
        assert alone.usage.model_extra["threshold"] == 1.0  # one request: no load, the strict end

        admin(srv, policy="fixed", default_threshold=1.0)
        before = srv.engine.tokens_total, srv.engine.forwards_total
        fixed_usages, fixed_seconds = asyncio.run(burst(srv))
        fixed_engine = srv.engine.tokens_total - before[0], srv.engine.forwards_total - before[1]
        admin(srv, policy="adaptive")
        wait_for(lambda: srv.metric("mars_threshold") == 1.0, what="an idle adaptive server at the strict end")
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(srv, stop))
        watcher.start()
        before = srv.engine.tokens_total, srv.engine.forwards_total
        adaptive_usages, adaptive_seconds = asyncio.run(burst(srv))
        adaptive_engine = srv.engine.tokens_total - before[0], srv.engine.forwards_total - before[1]
        burst_end = time.perf_counter()
        wait_for(lambda: srv.metric("mars_threshold") == 1.0, what="the threshold to return after the load")
        stop.set()
        watcher.join()

    fixed_tps = sum(u.completion_tokens for u in fixed_usages) / fixed_seconds
    adaptive_tps = sum(u.completion_tokens for u in adaptive_usages) / adaptive_seconds
    fixed_tpf = np.mean([u.model_extra["tokens_per_forward"] for u in fixed_usages])
    adaptive_tpf = np.mean([u.model_extra["tokens_per_forward"] for u in adaptive_usages])
    during = [t for when, t in trajectory if when <= burst_end]
    changes = [
        (round(when - trajectory[0][0], 2), t)
        for k, (when, t) in enumerate(trajectory)
        if k == 0 or t != trajectory[k - 1][1]
    ]
    print(
        f"\nfixed 1.0: {fixed_tps:.0f} tok/s, {fixed_tpf:.2f} tok/fwd; adaptive: {adaptive_tps:.0f} tok/s, "
        f"{adaptive_tpf:.2f} tok/fwd; threshold (s, tau): {changes}; burst ended at {burst_end - trajectory[0][0]:.2f}s"
    )
    assert all(u.model_extra["threshold"] == 1.0 for u in fixed_usages) and fixed_tpf == 1.0
    assert min(during) == pytest.approx(0.6)  # full load reached the loose end
    assert min(u.model_extra["threshold"] for u in adaptive_usages) < 1.0
    assert adaptive_tpf > 1.3
    # The engine's own counts: every token of each burst, and fewer batch forwards for them.
    assert fixed_engine[0] == sum(u.completion_tokens for u in fixed_usages)
    assert adaptive_engine[0] == sum(u.completion_tokens for u in adaptive_usages)
    assert adaptive_engine[0] / adaptive_engine[1] > 1.2 * fixed_engine[0] / fixed_engine[1], (
        adaptive_engine,
        fixed_engine,
    )


# -- protection ----------------------------------------------------------------------------------------


def gated(gate: threading.Event | None = None, delay: float = 0.0):
    """A decoder whose steps wait for `gate` and take at least `delay` seconds."""

    class Gated(TorchDecoder):
        def step(self, *args, **kw):
            if gate is not None:
                gate.wait(30)
            time.sleep(delay)
            return super().step(*args, **kw)

    return Gated


def test_queue_bound_answers_429_with_retry_after(tm):
    gate = threading.Event()
    with live(tm, gated(gate), engine_limits=EngineLimits(max_batch=1, max_queue=1, block_cache=8)) as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        results = []
        senders = [
            threading.Thread(target=lambda: results.append(http_post(srv.url + "/v1/chat/completions", json=body)))
            for _ in range(2)
        ]
        senders[0].start()
        wait_for(lambda: srv.engine.in_flight == 1, what="the first request in flight")
        senders[1].start()
        wait_for(lambda: srv.engine.queue_depth == 1, what="the second request queued")
        r = http_post(srv.url + "/v1/chat/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            srv.client().chat.completions.create(**body)
        gate.set()
        for t in senders:
            t.join(HTTP_TIMEOUT)
        assert [x.status_code for x in results] == [200, 200]
        assert 'mars_requests_total{status="429"} 2' in http_get(srv.url + "/metrics").text


@pytest.fixture(scope="module")
def limited_server(tm):
    with live(tm, serve_limits=ServeLimits(max_prompt_tokens=64, max_tokens_limit=32)) as srv:
        yield srv


@pytest.mark.parametrize(
    "case",
    [
        ({"max_tokens": 100}, "max_tokens", "max_tokens_limit"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_tokens_limit"),
        ({"messages": [{"role": "user", "content": "a" * 200}]}, "messages", "context_length_exceeded"),
        ({"n": 2}, "n", None),
        ({"model": "gpt-4"}, "model", "model_not_found"),
        ({"temperature": "hot"}, "temperature", None),
        ({"temperature": 5}, "temperature", None),
        ({"stop": [1, 2]}, "stop", None),
        ({"stream": "yes"}, "stream", None),
        ({"threshold": "fast"}, "threshold", None),
        ({"messages": []}, "messages", None),
        ({"messages": [{"content": "no role"}]}, "messages[0].role", None),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
        ({"messages": [{"role": "assitant", "content": "hi"}]}, "messages[0].role", None),
        ({"messages": [{"role": "user"}]}, "messages[0].content", None),
        (
            {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]},
            "messages[0].content",
            None,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
            None,
        ),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", None),
        ({"messages": ["hi"]}, "messages[0]", None),
        ({"logprobs": "yes"}, "logprobs", None),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
    ],
)
def test_limits_and_bad_fields_answer_400(limited_server, case):
    fields, param, code = case
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    srv = limited_server
    r = http_post(srv.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code and error["message"]
    bad_json = http_post(
        srv.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    assert http_post(srv.url + "/v1/completions", json=[1, 2]).status_code == 400
    assert http_get(srv.url + "/v1/nothing").status_code == 404


def test_a_model_without_mars_json_decodes_only_as_ar(plain_tm, tok):
    with live(plain_tm) as srv:
        msg = [{"role": "user", "content": PROMPTS[0]}]
        r = http_post(srv.url + "/v1/chat/completions", json={"messages": msg, "max_tokens": 8, "threshold": 0.5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_mars_trained"
        client = srv.client()
        ar = client.chat.completions.create(model="tiny", messages=msg, max_tokens=8)
        assert ar.usage.model_extra["threshold"] == 1.0
        lossless = client.chat.completions.create(
            model="tiny", messages=msg, max_tokens=8, extra_body={"lossless": True}
        )
        assert lossless.choices[0].message.content == ar.choices[0].message.content
        r = http_post(srv.url + "/admin/policy", json={"policy": "adaptive"})
        assert r.status_code == 400 and "mars.json" in r.json()["error"]["message"]


def test_admin_policy_is_live_and_loopback_only(server):
    r = http_post(
        server.url + "/admin/policy", json={"policy": "adaptive", "min_threshold": 0.5, "max_threshold": 0.95}
    )
    try:
        assert r.status_code == 200 and r.json()["policy"] == "adaptive"
        assert 'mars_policy_info{policy="adaptive"' in http_get(server.url + "/metrics").text
        assert http_post(server.url + "/admin/policy", json={"min_threshold": 2.0}).status_code == 400
        assert http_post(server.url + "/admin/policy", json={"bogus": 1}).status_code == 400
        assert http_post(server.url + "/admin/policy", json={"policy": 3}).status_code == 400
    finally:
        assert http_post(server.url + "/admin/policy", json={"policy": "fixed"}).status_code == 200

    async def from_elsewhere():
        transport = httpx.ASGITransport(app=server.app, client=("203.0.113.9", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://mars") as c:
            return await c.post("/admin/policy", json={"policy": "adaptive"})

    r = asyncio.run(from_elsewhere())
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_loopback_only"
    assert server.engine.policy.settings.policy == "fixed"


def test_disconnect_frees_the_row_at_once(tm):
    """A client that goes away mid-stream (or mid-wait) frees its row within a few steps, long
    before the request would have finished (300 tokens: this model writes no EOS before then).
    Counted in the engine's steps, not timed: a busy machine slows the steps and the
    disconnect alike."""
    steps = 300
    assert reference(tm, encode_prompt(tm.tokenizer, "hi"), steps)[2] == "length"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": steps}
    with live(tm, gated(delay=0.01), engine_limits=EngineLimits(max_batch=1, block_cache=8)) as srv:
        engine = srv.engine
        with httpx.stream(
            "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=HTTP_TIMEOUT
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            wait_for(lambda: engine.in_flight == 1 and engine.forwards_total >= 5, what="the stream 5 steps in")
            left_at = engine.forwards_total
        wait_for(lambda: engine.in_flight == 0, what="the streaming row to be freed")
        streamed = (engine.forwards_total - left_at, engine.forwards_total)

        start = engine.forwards_total
        raw = socket.create_connection(("127.0.0.1", srv.port))
        payload = json.dumps(body).encode()
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(
            lambda: engine.in_flight == 1 and engine.forwards_total >= start + 5, what="the plain request 5 steps in"
        )
        left_at = engine.forwards_total
        raw.close()
        wait_for(lambda: engine.in_flight == 0, what="the plain request's row to be freed")
        plain = (engine.forwards_total - left_at, engine.forwards_total - start)
        # The place is free: a new request is served at once.
        r = srv.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        assert r.usage.completion_tokens == 3
    print(f"\nsteps after the disconnect, and in all: streamed {streamed}, plain {plain}")
    # Cut short (fewer than its 300 steps), a few steps after the client left.
    for after, total in (streamed, plain):
        assert total < steps and after <= 30, (streamed, plain)


def test_cli_registers_serve_and_refuses_adaptive_without_mars_json(tmp_path):
    from click.testing import CliRunner
    from tiny import save_model

    from mars.cli import cli

    runner = CliRunner()
    help_text = runner.invoke(cli, ["serve", "--help"]).output
    assert "--policy [fixed|adaptive]" in help_text and "--max-queue" in help_text
    path = save_model(tmp_path / "plain", "llama", seed=1)
    result = runner.invoke(cli, ["serve", "--model", str(path), "--policy", "adaptive", "--backend", "torch"])
    assert result.exit_code == 1 and "needs a MARS-trained model" in result.output


# -- fuzz ---------------------------------------------------------------------------------------------


FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "threshold",
    "lossless",
    "adaptive",
    "logprobs",
    "presence_penalty",
    "response_format",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
plausible = {  # values a client would send, so validation passes and requests decode
    "model": st.sampled_from(["tiny", "tiny", "other"]),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=12)}
        ),
        min_size=1,
        max_size=3,
    ),
    "prompt": st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 84), min_size=1, max_size=4),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.1, 1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "threshold": st.floats(0, 1),
    "lossless": st.booleans(),
}
# Plausible fields with a little noise on top (any JSON value in any known field); now and
# then not a JSON object at all, or not JSON.
bodies = st.builds(
    lambda good, noise: {**good, **noise},
    st.fixed_dictionaries(
        {k: plausible[k] for k in ("messages", "prompt")},
        optional={k: v for k, v in plausible.items() if k not in ("messages", "prompt")},
    ),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=2),
)
as_bytes = bodies.map(lambda b: json.dumps(b).encode())
payloads = st.one_of(
    as_bytes, as_bytes, as_bytes, as_bytes, json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=16)
)


@pytest.fixture(scope="module")
def fuzz_server(tm):
    with live(tm, serve_limits=ServeLimits(max_prompt_tokens=64, max_tokens_limit=6, default_max_tokens=6)) as srv:
        yield srv


@hsettings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(payload=payloads, chat=st.booleans())
def test_fuzzed_requests_never_answer_5xx(fuzz_server, payload, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = http_post(fuzz_server.url + path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code < 500, (payload, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
    elif r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http_get(fuzz_server.url + "/health").json() == {"status": "ok"}


# -- logprobs -------------------------------------------------------------------------------------


def plain_logprobs(tm, prompt, reply):
    """(len(reply), vocab): log-softmax of a plain causal forward at each reply token's place."""
    with torch.no_grad():
        logits = tm.model(input_ids=torch.tensor([prompt + reply])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + len(reply) - 1].numpy()


@pytest.mark.parametrize("mode", [{"threshold": 1.0}, {"lossless": True}, {"threshold": 0.2}])
def test_openai_client_chat_logprobs_streaming_and_not(server, tm, tok, mode):
    """The openai client parses the logprobs of a chat reply, streamed or not; asking for them leaves
    the text and the mode as they are; AR and lossless ones are a plain forward's (float32)."""
    client = server.client()
    msg = [{"role": "user", "content": PROMPTS[3]}]
    kw = dict(model="tiny", messages=msg, max_tokens=20, extra_body=mode)
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    choice = r.choices[0]
    assert choice.message.content == plain.choices[0].message.content
    assert r.usage.model_extra["mode"] == plain.usage.model_extra["mode"] and plain.choices[0].logprobs is None
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    from_masks = "threshold" in mode and mode["threshold"] < 1
    assert choice.model_extra["logprobs_from"] == ("model and masks" if from_masks else "model")
    prompt = encode_prompt(tok, PROMPTS[3])
    if not from_masks:
        tokens, _, _ = reference(tm, prompt, 20)
        want = plain_logprobs(tm, prompt, tokens)
        np.testing.assert_allclose([t.logprob for t in content], want[np.arange(len(tokens)), tokens], atol=1e-5)
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_openai_client_completions_logprobs_streaming_and_not(server, tm, tok):
    client = server.client()
    ids = encode_prompt(tok, "The sea is", chat=False)
    tokens, ref, _ = reference(tm, ids, 16)
    r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=16, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref and len(lp.tokens) == len(tokens) == len(lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    want = plain_logprobs(tm, ids, tokens)
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(len(tokens)), tokens], atol=1e-5)
    streamed = list(
        client.completions.create(model="tiny", prompt="The sea is", max_tokens=16, logprobs=2, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == ref
    assert [
        x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_logprobs_stop_at_a_stop_string(server, tm, tok):
    """Tokens past a stop string are not returned, nor are their log-probabilities."""
    client = server.client()
    msg = [{"role": "user", "content": PROMPTS[1]}]
    full = client.chat.completions.create(model="tiny", messages=msg, max_tokens=20, logprobs=True)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model="tiny", messages=msg, max_tokens=20, logprobs=True, stop=[stop])
    kept = cut.choices[0].logprobs.content
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert len(kept) < len(full.choices[0].logprobs.content)
    assert [t.logprob for t in kept] == [t.logprob for t in full.choices[0].logprobs.content[: len(kept)]]


@pytest.mark.parametrize("cache", ["window", "block"])
def test_a_server_with_trees_answers_lossless_requests_as_ar(tm, tok, monkeypatch, cache):
    """`mars serve --tree N`: greedy lossless requests also feed tree nodes; the replies stay AR's. Sampled
    lossless requests feed them too."""
    fed = []
    speculate = TorchDecoder.speculate

    def spy(self, *args, tree=None, **kw):
        fed.append(tree is not None and bool(tree.live.any()))
        return speculate(self, *args, tree=tree, **kw)

    monkeypatch.setattr(TorchDecoder, "speculate", spy)
    nodes = []  # tree nodes each step laid out
    groups = TreeDrafts.groups

    def count(self, *args, **kw):
        out = groups(self, *args, **kw)
        nodes.append(sum(int(g.live.sum()) for g in out))
        return out

    monkeypatch.setattr(TreeDrafts, "groups", count)
    from mars.core.decode.cost import CostCurve

    with live(tm, engine_limits=EngineLimits(max_batch=4, block_cache=8, tree=8, cache=cache)) as srv:
        assert srv.engine.limits.tree == 8
        # Flat costs: the feed takes every node that may pay (a measured CPU curve may take none).
        srv.engine.session.controller = feed_of(CostCurve({1: 1.0, 10**6: 1.0}, refresh=0.0))
        client = srv.client()
        for text in PROMPTS[:3]:
            _, ref, _ = reference(tm, encode_prompt(tok, text), 20)
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": text}], max_tokens=20, extra_body={"lossless": True}
            )
            assert r.choices[0].message.content == ref
        assert sum(nodes) > 0, "no greedy step fed a tree node"
        # Sampled lossless requests feed trees too (the speculative rule over the tree, tests/test_trees.py).
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=20,
            temperature=1.0,
            seed=3,
            extra_body={"lossless": True},
        )
        assert r.usage.completion_tokens > 0 and r.usage.model_extra["mode"].startswith("lossless sampling")
        assert any(fed), "no sampled step fed a tree node"
