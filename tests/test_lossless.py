"""Lossless mode (docs/method.md §8): the masks draft, the next forward verifies.

Greedy: the output equals threshold-1.0 (plain greedy AR) output token for token, for every
cache strategy, block size and batch size. Sampling: the distribution of the first tokens
equals plain AR sampling's (a chi-square test against the exact distribution computed from
the model), and the same test fails when the acceptance rule is broken.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny import PROMPTS, feed_of, make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder, sampling_probs
from mars.backends.torch.load import TorchModel
from mars.core.decode.drafts import ALT, SPARE
from mars.core.decode.layout import layout_mask
from mars.core.decode.loop import generate
from mars.core.decode.plan import Sampling
from mars.core.decode.strategies import WindowStrategy
from mars.core.decode.types import Row

MASK, EOS = 3, 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tm(request, tok):
    return TorchModel(make_model(request.param, len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)


def prompts_of(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def settings(**kw):
    base = dict(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=24, block_cache=8)
    base.update(kw)
    return make_plan(**base)


# -- greedy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "window", "block"])
@pytest.mark.parametrize("B", [2, 3, 5, 8])
def test_greedy_lossless_equals_ar_for_every_batch_size(tm, tok, cache, B):
    dec = TorchDecoder(tm)
    prompts = prompts_of(tok, PROMPTS)
    ar = generate(dec, prompts, settings(threshold=1.0, cache=cache, block_size=B)).tokens
    for batch in (1, 3, 8):
        s = settings(lossless=True, cache=cache, block_size=B)
        out, kept = [], 0
        for start in range(0, len(prompts), batch):
            result = generate(dec, prompts[start : start + batch], s)
            out += result.tokens
            kept += sum(result.stats.draft_totals()["kept_per_slot"])
        assert out == ar, (cache, B, batch)
        assert kept > 0  # some drafts passed verification: the check covers kept drafts, not only AR steps


@pytest.mark.parametrize("cache", ["none", "window"])
@pytest.mark.parametrize("B,hedge", [(2, 1), (4, 0), (4, 1), (4, None), (3, 9)])
def test_spare_groups_keep_the_output_of_ar(tm, tok, cache, B, hedge):
    dec = TorchDecoder(tm)
    prompts = prompts_of(tok, PROMPTS)
    ar = generate(dec, prompts, settings(threshold=1.0, cache=cache, block_size=B)).tokens
    for batch in (1, 3):
        s = settings(lossless=True, cache=cache, block_size=B, hedge=hedge)
        assert s.spare_groups == (B if hedge is None else min(hedge, B))
        out = []
        for start in range(0, len(prompts), batch):
            out += generate(dec, prompts[start : start + batch], s).tokens
        assert out == ar, (cache, B, hedge, batch)


def check_spare_groups(dec, prompts, cached: bool) -> None:
    """Spare group g (after the g-th draft) predicts what the masks of a plain window ending
    at that draft predict: same ids, same probabilities, whatever the drafts after it are."""
    B = 4
    s = settings(lossless=True, cache="window" if cached else "none", block_size=B, hedge=B)
    rows = [Row(p, B + 1, threshold=1.0, max_tokens=24) for p in prompts]
    drafts = [[5, 6, 7, 8], [9, 10], []]  # arbitrary ids: group g exists where a row fed > g drafts
    for r, d in zip(rows, drafts):
        r.drafts = list(d)
    strategy = WindowStrategy(s, cached=cached)
    cache = dec.new_cache(len(rows)) if cached else None
    if cached:  # commit all but each prompt's last token first, as the loop would have
        head = [Row(p[:-1], B + 1, threshold=1.0, max_tokens=24) for p in prompts]
        feed = strategy.lay_out(head)  # no drafts yet: the heads and B masks, which the commit crops
        dec.step(
            cache,
            feed.ids,
            feed.positions,
            layout_mask(strategy.keys(feed), feed),
            feed.read,
            metric=None,
            sampling=Sampling(),
        )
        # The rows start with the heads: committing records on them what the cache now holds.
        strategy.commit(dec, cache, rows, feed, [len(h.seq) for h in head])
    feed = strategy.lay_out(rows)
    assert feed.columns.count(SPARE) == B
    ids, conf = dec.step(
        cache,
        feed.ids,
        feed.positions,
        layout_mask(strategy.keys(feed), feed),
        feed.read,
        metric="probability",
        sampling=Sampling(),
    )
    spare_ids = ids[:, 1 + feed.drafts.shape[1] + B :].reshape(len(rows), B, B)
    spare_conf = conf[:, 1 + feed.drafts.shape[1] + B :].reshape(len(rows), B, B)
    cases = [(i, g, p + d[:g] + [MASK] * B, B) for i, (p, d) in enumerate(zip(prompts, drafts)) for g in range(len(d))]
    assert check_windows(dec, spare_ids, spare_conf, cases) == 6


def check_windows(dec, ids, conf, cases) -> int:
    """Each case (row, group, window, reads): the group's outputs `ids[row, group]` and
    `conf[row, group]` equal those of a plain uncached forward of `window` read at its last
    `reads` columns (ids exactly, probabilities to 1e-5). Returns how many were checked."""
    for i, g, window, reads in cases:
        n = len(window)
        ref_ids, ref_conf = dec.step(
            None,
            np.asarray([window]),
            np.arange(n)[None],
            None,
            np.arange(n - reads, n)[None],
            metric="probability",
            sampling=Sampling(),
        )
        assert ids[i, g].tolist() == ref_ids[0].tolist(), (i, g)
        np.testing.assert_allclose(conf[i, g], ref_conf[0], atol=1e-5)
    return len(cases)


@pytest.mark.parametrize("cached", [False, True])
def test_a_spare_group_sees_only_what_precedes_it(tm, tok, cached):
    check_spare_groups(TorchDecoder(tm), prompts_of(tok, PROMPTS[:3]), cached)


@pytest.mark.parametrize("cache", ["none", "window"])
@pytest.mark.parametrize("alternatives,hedge,ngram", [(1, 0, 0), (2, None, 0), (3, 1, 8)])
def test_alternative_groups_keep_the_output_of_ar(tm, tok, cache, alternatives, hedge, ngram):
    """Runners-up of the first draft, fed as alternative groups: where AR's token is one of
    them the step takes the token after it too (counted as "alt"); the output stays AR's."""
    dec = TorchDecoder(tm)
    prompts = prompts_of(tok, PROMPTS)
    ar = generate(dec, prompts, settings(threshold=1.0, cache=cache)).tokens
    for batch in (1, 3):
        s = settings(lossless=True, cache=cache, hedge=hedge, alternatives=alternatives, ngram=ngram)
        assert s.alternative_groups == alternatives
        out, taken = [], 0
        for start in range(0, len(prompts), batch):
            res = generate(dec, prompts[start : start + batch], s)
            out += res.tokens
            taken += res.stats.by_source().get("alt", 0)
        assert out == ar, (cache, alternatives, hedge, batch)
        assert taken > 0  # some runner-up was AR's token: the check covers the extra token, not only AR steps


def check_alternative_groups(dec, prompts, cached: bool) -> None:
    """Alternative group k (a runner-up at the first draft's position, then B masks) predicts
    what a plain window ending at that runner-up predicts: the same ids and probabilities at
    the runner-up (AR's next token after it) and at its masks, whatever the drafts are."""
    B = 3
    s = settings(lossless=True, cache="window" if cached else "none", block_size=B, hedge=1, alternatives=2)
    rows = [Row(p, B + 1, threshold=1.0, max_tokens=24) for p in prompts]
    drafts, alts = [[5, 6, 7], [9], []], [[11, 12], [13], [14, 15]]  # a row without drafts feeds no group
    for r, d, a in zip(rows, drafts, alts):
        r.drafts, r.alts = list(d), list(a)
    strategy = WindowStrategy(s, cached=cached)
    cache = dec.new_cache(len(rows)) if cached else None
    if cached:
        head = [Row(p[:-1], B + 1, threshold=1.0, max_tokens=24) for p in prompts]
        feed = strategy.lay_out(head)
        dec.step(
            cache,
            feed.ids,
            feed.positions,
            layout_mask(strategy.keys(feed), feed),
            feed.read,
            metric=None,
            sampling=Sampling(),
        )
        strategy.commit(dec, cache, rows, feed, [len(h.seq) for h in head])
    feed = strategy.lay_out(rows)
    assert feed.columns.count(ALT) == 2 and feed.live_groups(ALT) == [2, 1, 0]
    ids, conf = dec.step(
        cache,
        feed.ids,
        feed.positions,
        layout_mask(strategy.keys(feed), feed),
        feed.read,
        metric="probability",
        sampling=Sampling(),
    )
    group_ids = ids[:, feed.columns.reads(ALT)].reshape(len(rows), 2, B + 1)
    group_conf = conf[:, feed.columns.reads(ALT)].reshape(len(rows), 2, B + 1)
    cases = [
        (i, k, p + [alts[i][k]] + [MASK] * B, B + 1)
        for i, p in enumerate(prompts)
        for k in range(feed.live_groups(ALT)[i])
    ]
    assert check_windows(dec, group_ids, group_conf, cases) == 3


@pytest.mark.parametrize("cached", [False, True])
def test_an_alternative_group_sees_only_what_precedes_it(tm, tok, cached):
    check_alternative_groups(TorchDecoder(tm), prompts_of(tok, PROMPTS[:3]), cached)


def test_runners_up_are_the_next_most_likely_ids(tm, tok):
    from mars.core.decode.types import runners_up_of

    dec = TorchDecoder(tm)
    p = prompts_of(tok, PROMPTS[:1])[0]
    n = len(p)
    read = np.arange(n - 3, n)[None]
    out = dec.step(
        None, np.asarray([p]), np.arange(n)[None], None, read, metric=None, sampling=Sampling(), runners_up=3
    )
    ids, second = out.ids, out.runners_up
    logits = dec.logits(None, np.asarray([p]), np.arange(n)[None], None, read)[0]
    order = torch.argsort(logits, dim=-1, descending=True).numpy()
    assert ids[0].tolist() == order[:, 0].tolist()
    assert second.shape == (1, 3, 3) and second[0].tolist() == order[:, 1:4].tolist()
    # Asked from read 1 on (the next drafts' reads), the top-k runs on those rows alone: the
    # same runners-up there, none (-1) before; two rows, one read twice.
    both = np.asarray([p, p])
    reads = np.array([[n - 3, n - 2, n - 1], [n - 1, n - 1, n - 2]])
    full = dec.step(
        None, both, np.tile(np.arange(n), (2, 1)), None, reads, metric=None, sampling=Sampling(), runners_up=3
    )
    part = dec.step(
        None,
        both,
        np.tile(np.arange(n), (2, 1)),
        None,
        reads,
        metric=None,
        sampling=Sampling(),
        runners_up=3,
        runners_up_from=1,
    )
    assert part.ids.tolist() == full.ids.tolist()
    assert part.runners_up[:, 1:].tolist() == full.runners_up[:, 1:].tolist()
    before, every = part.runners_up[:, 0], full.runners_up[:, 0]  # none, or the same
    assert ((before == -1) | (before == every)).all() and (every >= 0).all() and (before == -1).any()
    # A tie that puts the chosen id second in `top` still leaves it out.
    top = np.array([[[7, 5, 9]]])
    assert runners_up_of(top, np.array([[5]]), 2).tolist() == [[[7, 9]]]


def test_lossless_ignores_the_threshold_and_reports_drafts(tm, tok):
    dec = TorchDecoder(tm)
    prompts = prompts_of(tok, PROMPTS[:4])
    a = generate(dec, prompts, settings(lossless=True, threshold=0.1))
    b = generate(dec, prompts, settings(lossless=True, threshold=1.0))
    assert a.tokens == b.tokens
    totals = a.stats.draft_totals()
    assert len(totals["verified_per_slot"]) == 4
    # Every verified draft was proposed first, every kept one verified; per slot, fewer further out.
    for drafted, verified, kept in zip(
        totals["drafted_per_slot"], totals["verified_per_slot"], totals["kept_per_slot"]
    ):
        assert drafted >= verified >= kept
    assert totals["verified_per_slot"][0] > 0
    row = a.stats.to_dict()["rows"][0]
    assert {"drafted_per_slot", "verified_per_slot", "kept_per_slot"} <= set(row)


def test_max_tokens_is_never_overshot(tm, tok):
    dec = TorchDecoder(tm)
    for n in (1, 2, 5):
        for cache in ("window", "block"):
            res = generate(dec, prompts_of(tok, PROMPTS[:3]), settings(lossless=True, max_tokens=n, cache=cache))
            ar = generate(dec, prompts_of(tok, PROMPTS[:3]), settings(threshold=1.0, max_tokens=n, cache=cache))
            assert res.tokens == ar.tokens and all(len(t) <= n for t in res.tokens)


# -- sampling: the output distribution is exactly AR sampling's --------------------------------

SAMPLING = Sampling(temperature=1.0, top_k=4, seed=0)
N_TOKENS = 3


def chi_square_p(observed: Counter, expected: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells expected < 5 are pooled. The p-value uses
    the Wilson-Hilferty normal approximation (plenty for a pass/fail at 1e-3)."""
    cells, pool_obs, pool_exp = [], 0, 0.0
    for key, prob in expected.items():
        e = prob * n
        if e < 5:
            pool_obs, pool_exp = pool_obs + observed.get(key, 0), pool_exp + e
        else:
            cells.append((observed.get(key, 0), e))
    if any(k not in expected for k in observed):
        return 0.0  # a sample AR sampling can never produce
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    k = len(cells) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_distribution(model, prompt: list[int]) -> dict:
    """P(first N_TOKENS tokens) under AR sampling (tempered, top-k), sequences that end in EOS
    stopping there, from direct forwards of the model."""
    out = {}

    @torch.no_grad()
    def walk(prefix: tuple, prob: float):
        if len(prefix) == N_TOKENS or (prefix and prefix[-1] == EOS):
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
        p = sampling_probs(logits, SAMPLING)
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(prefix + (t,), prob * float(p[t]))

    walk((), 1.0)
    return out


def lossless_samples(decoder, prompt, n: int, cache: str, rows: int = 500, feed=None) -> tuple[Counter, dict]:
    counts: Counter = Counter()
    totals = None
    s = settings(lossless=True, max_tokens=N_TOKENS, cache=cache, block_size=3, sampling=SAMPLING)
    for _ in range(n // rows):
        res = generate(decoder, [prompt] * rows, s, controller=feed)
        counts.update(tuple(t) for t in res.tokens)
        d = res.stats.draft_totals()
        totals = d if totals is None else {k: [a + b for a, b in zip(totals[k], d[k])] for k in d}
    return counts, totals


class AcceptEveryDraft(TorchDecoder):
    """A broken verifier: keeps every draft whatever p says."""

    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling):
        out = super().speculate(cache, input_ids, positions, mask, read, drafts, n_drafts, sampling=sampling)
        return replace(out, kept=np.asarray(n_drafts))


class ResampleFromP(TorchDecoder):
    """A subtly broken verifier: after a rejection it draws from p, not from norm(max(0, p - q))."""

    def logits(self, *args):
        self.last = super().logits(*args)
        return self.last

    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling):
        out = super().speculate(cache, input_ids, positions, mask, read, drafts, n_drafts, sampling=sampling)
        p = sampling_probs(self.last[:, : drafts.shape[1] + 1], sampling)
        at = p[torch.arange(p.shape[0]), torch.from_numpy(np.asarray(out.kept))]
        redrawn = torch.multinomial(at, 1, generator=self.rng(sampling))[:, 0].numpy()
        return replace(out, token=np.where(out.kept < n_drafts, redrawn, out.token))


@pytest.fixture(scope="module")
def sampler(tok):
    # A model whose AR and mask distributions differ (random weights), top-k 4: few cells.
    model = make_model("llama", len(tok), seed=3, scale=0.15)
    tm = TorchModel(model, tok, None, "", torch.device("cpu"), torch.float32)
    prompt = prompts_of(tok, ["Hi"])[0]
    return tm, prompt, exact_distribution(model, prompt)


@pytest.mark.parametrize("cache", ["window", "block"])
def test_lossless_sampling_matches_ar_sampling(sampler, cache):
    tm, prompt, expected = sampler
    n = 4000
    counts, totals = lossless_samples(TorchDecoder(tm), prompt, n, cache)
    # The verification path really ran: drafts were kept and drafts were rejected.
    assert 0 < totals["kept_per_slot"][0] < totals["verified_per_slot"][0], totals
    assert chi_square_p(counts, expected, n) > 1e-3


@pytest.mark.parametrize("curve", ["flat", "steep"])
def test_lossless_sampling_with_the_cost_aware_feed_matches_ar_sampling(sampler, curve):
    """Sampled lossless decoding with a cost curve chooses per step how many masks to feed
    (and how many drafts to verify); a flat curve feeds them, a steep one mostly feeds none
    (AR's feed, with probes). Either way the samples follow AR sampling's distribution."""
    from mars.core.decode.cost import CostCurve

    tm, prompt, expected = sampler
    n = 4000
    points = {1: 1.0, 10**6: 1.0} if curve == "flat" else {1: 1.0, 2: 2.0, 64: 64.0}  # 500 rows a forward
    feed = feed_of(CostCurve(points, refresh=0.0))  # given costs: the run's timings do not move them
    counts, totals = lossless_samples(TorchDecoder(tm), prompt, n, "window", feed=feed)
    (policy,) = feed.feeds.values()
    fed_none = policy.choices.get((0, 0), 0) / sum(policy.choices.values())
    if curve == "flat":
        assert fed_none < 0.2 and 0 < totals["kept_per_slot"][0] < totals["verified_per_slot"][0], (
            policy.choices,
            totals,
        )
    else:
        assert fed_none > 0.5, policy.choices
    assert chi_square_p(counts, expected, n) > 1e-3


def test_plain_ar_sampling_passes_the_same_test(sampler):
    tm, prompt, expected = sampler
    n = 4000
    s = settings(threshold=1.0, max_tokens=N_TOKENS, sampling=SAMPLING)
    counts, decoder = Counter(), TorchDecoder(tm)  # one decoder: its generator runs on across calls
    for _ in range(n // 500):
        counts.update(tuple(t) for t in generate(decoder, [prompt] * 500, s).tokens)
    assert chi_square_p(counts, expected, n) > 1e-3


@pytest.mark.parametrize("broken", [AcceptEveryDraft, ResampleFromP])
def test_the_test_fails_when_the_rule_is_broken(sampler, broken):
    tm, prompt, expected = sampler
    n = 4000
    counts, _ = lossless_samples(broken(tm), prompt, n, "window")
    assert chi_square_p(counts, expected, n) < 1e-3


class NumpyOps:
    """mars.core.acceptance.DeviceOps on numpy arrays: the rule checked on the host."""

    arange = staticmethod(np.arange)
    where = staticmethod(np.where)
    minimum = staticmethod(np.minimum)
    at_least = staticmethod(np.maximum)

    def zeros_int(self, n):
        return np.zeros(n, dtype=np.int64)

    def zeros_like(self, x):
        return np.zeros_like(x)

    def take(self, x, ids):
        return np.take_along_axis(x, ids[..., None], axis=-1)[..., 0]

    def leading(self, ok):
        return np.cumprod(ok, axis=1).sum(axis=1)

    def row_sum(self, x):
        return x.sum(-1, keepdims=True)


def test_the_speculative_sampling_rule_both_backends_run():
    """The rule of mars.core.acceptance, on exact cases: a draft from p itself is always kept;
    a draft p never gives is rejected, and the token is then drawn from p less q; a draft
    kept with chance p/q is kept exactly when the uniform draw falls below it; a row keeps
    none of the drafts it did not feed; after the last kept draft the token comes from p."""
    from mars.core.acceptance import speculative_sampling

    p = np.array([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]] * 3)  # (3 rows, D + 1 = 3 slots, V = 3)
    q = np.array([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]] * 3)  # slot 1's drafts always token 2, where p gives 0.5
    drafts = np.array([[0, 2], [2, 2], [1, 2]])  # row 1's first draft is a token p never gives at slot 0
    n_drafts = np.array([2, 2, 1])
    u = np.array([[0.99, 0.49], [0.0, 0.0], [0.99, 0.0]])
    kept, dist = speculative_sampling(NumpyOps(), p, q, drafts, n_drafts, u)
    # row 0: draft 0 kept (p = q), draft 1 kept (u 0.49 < p/q = 0.5): the token comes from p after the last draft
    # row 1: draft 0 rejected (p = 0): the token from norm(max(0, p - q)) at slot 0 (q there has nothing on token 2)
    # row 2: fed one draft, kept: its second draft slot is not verified, the token comes from slot 1's p
    assert kept.tolist() == [2, 0, 1]
    np.testing.assert_allclose(dist, [[0.1, 0.1, 0.8], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    u_above = u.copy()
    u_above[0, 1] = 0.51  # above p/q: rejected, and the token from norm(max(0, p - q)) at slot 1
    kept, dist = speculative_sampling(NumpyOps(), p, q, drafts, n_drafts, u_above)
    assert kept.tolist() == [1, 0, 1]
    np.testing.assert_allclose(dist[0], [0.4, 0.6, 0.0])
