"""Cost-aware lossless decoding (mars.core.decode.cost), n-gram drafts (mars.core.decode.drafts.ngram) and the
cache width of lossless window decoding.

The feed-width tests run the real decoding loop on a fake backend: an "oracle" text where
the token at position p is a fixed function of p, masks that guess right for the first
`good` masks of a run, and a cost curve given by the test (not timed). A flat curve must
make the loop feed wide, a steep one like AR, with the output the oracle's either way.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import settings as settings_hypothesis
from hypothesis import strategies as st
from tiny import PROMPTS, feed_of, make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode.cost import BatchCosts, CostCurve
from mars.core.decode.drafts import ngram
from mars.core.decode.feed import DraftStats, LosslessFeed, ThresholdFeed, block_cache_pays, steady_state
from mars.core.decode.loop import generate
from mars.core.decode.types import StepOutput

MASK, EOS = 3, 2


def oracle(p: int, period: int = 0) -> int:
    """The fake model's text: the token at position p (never EOS or MASK)."""
    return 10 + ((p % period) if period else (p * 7 + p // 5) % 40)


class OracleBackend:
    """A StepBackend over the oracle text: a real token's output is the oracle's next token
    (what greedy AR would take); mask j of a run of masks is right for j < good, else wrong.
    The cache is only its width, so tests can check what the loop keeps."""

    def __init__(self, good: int, period: int = 0):
        self.good, self.period = good, period
        self.widths: list[int] = []  # cache width after every crop

    def new_cache(self, batch):
        return {"width": 0}

    def crop(self, cache, length):
        cache["width"] = min(cache["width"], length)
        self.widths.append(cache["width"])

    def keep_rows(self, cache, rows):
        pass

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None):
        if cache is not None:
            cache["width"] += input_ids.shape[1]
        b, q = input_ids.shape
        assert read.min() >= 0 and read.max() < q, (
            f"read {read.tolist()} outside the {q} fed columns"
        )  # as a real gather
        out = np.zeros((b, q), dtype=np.int64)
        for r in range(b):
            run = 0
            for c in range(q):
                nxt = oracle(int(positions[r, c]) + 1, self.period)
                if input_ids[r, c] == MASK:
                    out[r, c] = nxt if run < self.good else 11 + (nxt - 9) % 40
                    run += 1
                else:
                    out[r, c] = nxt
                    run = 0
        ids = np.take_along_axis(out, read, axis=1)
        return StepOutput(ids, np.ones(ids.shape))


def settings(**kw):
    # No tree (the feed of masks, groups and lookup drafts is what these tests weigh; tests/test_trees.py
    # checks the trees the default "auto" feeds).
    base = dict(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=40, lossless=True, tree=0)
    base.update(kw)
    return make_plan(**base)


PROMPT = [oracle(p) for p in range(6)]
ORACLE_REPLY = [oracle(p) for p in range(6, 46)]


def fixed(points: dict) -> CostCurve:
    return CostCurve(points, refresh=0.0)  # a given curve: the loop's own timings do not move it


FLAT = {1: 1.0, 64: 1.0}
STEEP = {1: 1.0, 64: 64.0}  # cost grows with every fed token


# -- the cost curve and the steady-state model ----------------------------------------------------


def test_cost_curve_interpolates_extrapolates_and_never_falls():
    c = CostCurve({1: 1.0, 4: 2.0, 8: 1.5, 16: 4.0}, refresh=0.5)
    # A point out of order is pooled with its neighbour (least squares): wider is never cheaper.
    assert c.seconds(4) == c.seconds(8) == pytest.approx(1.75)
    assert c.seconds(1) == 1.0 and c.seconds(2) == pytest.approx(1.25)
    assert c.seconds(32) == pytest.approx(4.0 + (4.0 - 1.75) / 8 * 16)
    # A noisy spike does not lift every wider point to its height.
    spiky = CostCurve({1: 1.0, 2: 1.3, 3: 1.05, 4: 1.05, 8: 1.2})
    assert spiky.seconds(8) == pytest.approx(1.2) and spiky.seconds(2) == pytest.approx((1.3 + 1.05 + 1.05) / 3)
    c.observe(16, 2.0)
    assert c.points[16] == pytest.approx(3.0)
    c.observe(3, 1.2)
    assert 3 in c.points and list(c.points) == sorted(c.points)
    # Kept as its non-decreasing fit (what `seconds` reads), the timings beside it.
    kept = c.to_dict()
    assert kept["measured"] == list(c.points.values()) and kept["seconds"] == sorted(kept["seconds"])
    back = CostCurve.from_dict(kept)
    assert all(back.seconds(k) == pytest.approx(c.seconds(k)) for k in range(1, 40))
    with pytest.raises(ValueError):
        CostCurve({1: 0.0})


def test_steady_state_by_hand():
    # One mask, no spare groups, keep rate a: M -> M with a, M -> N otherwise, N -> M.
    # pi_M = 1 / (2 - a); tokens = pi_M (1 + a) + pi_N.
    a = 0.5
    tokens, width, drafting = steady_state([a], [a], masks=1, groups=0)
    pi_m = 1 / (2 - a)
    assert tokens == pytest.approx(pi_m * (1 + a) + (1 - pi_m))
    assert width == pytest.approx(pi_m * 3 + (1 - pi_m) * 2)
    assert drafting == pytest.approx(pi_m)
    # Spare groups for every draft: a step always has drafts.
    _, _, drafting = steady_state([0.5] * 4, [0.5] * 4, masks=4, groups=4)
    assert drafting == pytest.approx(1.0)
    assert steady_state([0.9] * 4, [0.9] * 4, masks=0, groups=0) == (1.0, 1.0, 0.0)


def test_steady_state_matches_the_chain_run_to_convergence():
    # The closed form against the (M, S, N) chain iterated from M until it settles.
    rng = np.random.default_rng(7)
    for _ in range(50):
        masks = int(rng.integers(1, 6))
        groups = int(rng.integers(0, masks + 1))
        batch = int(rng.integers(1, 9))
        mask_rates, spare_rates = list(rng.uniform(0.05, 0.95, masks)), list(rng.uniform(0.05, 0.95, masks))

        def outcome(rates):
            reach = np.concatenate([[1.0], np.cumprod(rates)])
            exact = reach[:-1] * (1 - np.asarray(rates))
            return reach[1:].sum(), [reach[-1], exact[:groups].sum(), 1 - reach[-1] - exact[:groups].sum()]

        km, from_m = outcome(mask_rates)
        ks, from_s = outcome(spare_rates)
        p = np.array([from_m, from_s, [1.0, 0.0, 0.0]])
        pi = np.array([1.0, 0.0, 0.0])
        for _ in range(5000):
            pi = pi @ p
        pi = (pi + pi @ p) / 2  # a chain that alternates settles in the mean of two steps
        tokens, width, drafting = steady_state(mask_rates, spare_rates, masks, groups, batch)
        assert tokens == pytest.approx(pi[0] * (1 + km) + pi[1] * (1 + ks) + pi[2], rel=1e-6)
        assert drafting == pytest.approx(pi[0] + pi[1], rel=1e-6)
        narrow, wide = 1 + masks, 1 + 2 * masks + groups * masks
        assert width == pytest.approx(narrow + (wide - narrow) * (1 - (1 - pi[0] - pi[1]) ** batch), rel=1e-6)


def test_policy_feeds_wide_on_a_flat_curve_and_like_ar_on_a_steep_one():
    stats = DraftStats(slots=4)
    for _ in range(50):  # the masks' drafts: all kept half the time, one kept otherwise
        stats.record("masks", 4, 4)
        stats.record("masks", 4, 1)
        stats.record("spare", 4, 2)
    assert LosslessFeed(fixed(FLAT), 4, 4, stats=stats).choose() == (4, 4)
    assert LosslessFeed(fixed(STEEP), 4, 4, stats=stats).choose() == (0, 0)
    # A curve like a packed CPU's: wide feeds cost a little more, masks that are often
    # right pay, but not every spare group.
    m, g = LosslessFeed(fixed({1: 1.0, 4: 1.25, 8: 1.4, 16: 1.85, 32: 2.7}), 4, 4, stats=stats).choose()
    assert m >= 2 and g < 4


def test_the_feed_ranks_its_candidates_by_rate_exactly():
    """LosslessFeed sums each mask count's outcomes once for all its group counts: the ranking it
    chooses from is the candidates sorted by `rate`, every score the same float."""
    rng = random.Random(3)
    for trial in range(40):
        stats = DraftStats(slots=6)
        for _ in range(rng.randrange(0, 30)):
            source, fed = rng.choice(("masks", "spare")), rng.randrange(1, 7)
            stats.record(source, fed, rng.randrange(0, fed + 1))
        curve = {1: 1.0, 4: 1.0 + rng.random(), 16: 3.0 + rng.random(), 64: 9.0}
        feed = LosslessFeed(fixed(curve), rng.randrange(1, 7), rng.randrange(0, 5), stats=stats)
        for again in range(3):  # the same feed again, after more steps (what it keeps between steps is redone)
            if again:
                source, fed = rng.choice(("masks", "spare", "ngram2")), rng.randrange(1, 7)
                stats.record(source, fed, rng.randrange(0, fed + 1))
            feed.mask_use = [rng.randrange(0, 5), 5]
            batch = rng.choice((1, 2, 8))
            want = sorted(feed.candidates(), key=lambda c: (feed.rate(*c, batch=batch), -c[0], -c[1]), reverse=True)
            assert feed._ranked(batch) == want, (trial, again)
            scores = {c: key[0] for key, c in feed._scored(batch)}
            assert scores == {c: feed.rate(*c, batch=batch) for c in feed.candidates()}, (trial, again)
            assert feed.choose(batch) == want[0], (trial, again)  # no probe this early: the best
        rates = (stats.rates("masks", feed.max_masks), stats.rates("spare", feed.max_masks))
        for m, g in want:
            assert steady_state(rates[0][:m], rates[1][:m], m, g, batch) == steady_state(
                rates[0], rates[1], m, g, batch
            )


def test_expected_kept_is_numpys_running_product_and_sum():
    rng = random.Random(1)
    for _ in range(300):
        stats = DraftStats(slots=8)
        for _ in range(rng.randrange(0, 40)):
            fed = rng.randrange(1, 17)
            stats.record("x", fed, rng.randrange(0, fed + 1))
        n = rng.randrange(1, 17)
        want = np.cumsum(np.cumprod(stats.rates("x", n)))
        assert stats.expected_kept_each("x", n) == want.tolist()
        assert stats.expected_kept("x", n) == float(want[-1])


def test_batches_are_costed_on_their_own_curve():
    """With a measure, a batch runs on the curve measured at its bucket: a device where one
    row's wide feeds are cheap but a batch's are not feeds wide at batch 1 and like AR at 8."""
    measured = []

    def measure(batch):
        measured.append(batch)
        return CostCurve({batch: 1.0, 64 * batch: 64.0}, refresh=1.0)  # every fed token costs, in a batch

    costs = BatchCosts(fixed(FLAT), measure=measure)
    stats = DraftStats(slots=4)
    for _ in range(50):
        stats.record("masks", 4, 4)
    policy = LosslessFeed(costs, 4, 4, stats=stats)
    assert policy.choose(batch=1)[0] == 4 and measured == []  # wide (all masks kept: no spare group needed)
    assert policy.choose(batch=8) == (0, 0) and measured == [8]
    assert costs.bucket(5) == 8 and costs.bucket(3) == 4 and costs.bucket(40) == 8
    assert costs.seconds(5, 2) == costs.curves[8].seconds(16)  # 5 rows: the 8-row curve's shape at width 2
    policy.choose(batch=5)
    assert measured == [8]  # measured once per bucket
    costs.observe(8, 2, 30.0)  # a timed forward of the bucket's own batch moves its curve
    assert costs.curves[8].points[16] == 30.0
    costs.observe(5, 2, 99.0)  # another batch's does not
    assert 10 not in costs.curves[8].points
    fresh = BatchCosts(fixed(FLAT), measure=measure)
    measured.clear()
    fresh.prepare(3)  # what a batch of 3 may need as its rows finish: the 2- and 4-row curves
    assert measured == [2, 4]
    # Without a measure every batch runs on the one-row curve at batch x width tokens (as before).
    plain = BatchCosts(fixed({1: 1.0, 64: 64.0}))
    assert plain.bucket(8) == 1 and plain.seconds(8, 2) == 16.0


def test_a_batch_pays_for_its_widest_row():
    """At batch b a step is as wide as its widest row: the policy costs a feed at the width
    of a step where some row drafts (chance 1 - (1 - f)^b), not at the rows' mean width."""
    stats = DraftStats(slots=4)
    for _ in range(20):
        stats.record("masks", 2, 0)
        stats.record("masks", 2, 2)
    curve = fixed({1: 1.0, 64: 64.0})
    policy = LosslessFeed(curve, 4, 4, stats=stats)
    tokens, mean_width, f = steady_state(stats.rates("masks", 2), stats.rates("spare", 2), 2, 0)
    assert 0 < f < 1
    tokens = 1 + policy.used() * (tokens - 1)  # the masks' drafts count where they are taken
    assert policy.rate(2, 0, batch=1) == pytest.approx(tokens / curve.seconds(round(mean_width)))
    widest = 3 + 2 * (1 - (1 - f) ** 8)
    assert policy.rate(2, 0, batch=8) == pytest.approx(tokens / curve.seconds(round(8 * widest)))
    assert policy.rate(2, 0, batch=8) < tokens / curve.seconds(round(8 * mean_width))


def test_masks_whose_drafts_other_sources_displace_count_for_less():
    """The masks' drafts add tokens only where a row takes them: where n-gram or corpus drafts
    win most steps, feeding masks pays less (LosslessFeed.used), and the loop counts it."""
    stats = DraftStats(slots=4)
    for _ in range(20):
        stats.record("masks", 1, 1)
    policy = LosslessFeed(fixed({1: 1.0, 4: 1.2, 64: 64.0}), 4, 0, stats=stats)
    assert policy.used() == 0.5
    taken = policy.rate(1, 0)
    policy.mask_use = [98, 98]
    assert policy.choose() == (1, 0) and policy.rate(1, 0) > taken
    policy.mask_use = [0, 98]
    assert policy.rate(1, 0) < taken and policy.choose() == (0, 0)
    # In the loop: the oracle text repeats, lookup's drafts win, and the masks' are seldom taken.
    period = 5
    prompt = [oracle(p, period) for p in range(12)]
    feed = feed_of(fixed(FLAT))
    result = generate(OracleBackend(0, period), [prompt], settings(hedge=0, ngram=6), controller=feed)
    assert result.tokens == [[oracle(p, period) for p in range(12, 52)]]
    (fresh,) = feed.feeds.values()  # hedge 0: no spare groups
    assert fresh.max_groups == 0
    used, offered = fresh.mask_use
    assert offered > 3 and used < offered / 2, fresh.mask_use


def test_the_policy_probes_the_masks_after_a_long_run_of_ar_steps():
    policy = LosslessFeed(fixed(STEEP), 4, 4, explore=5)
    picks = [policy.choose() for _ in range(40)]
    probes = [i for i, p in enumerate(picks) if p != (0, 0)]
    assert picks[:5] == [(0, 0)] * 5
    assert probes[:2] == [5, 6]  # two steps: one proposes, one verifies
    # Each probe that leaves AR the best doubles the wait for the next: 10, then 20 AR steps.
    assert probes[2:] == [17, 18, 39]
    assert {picks[i] for i in probes} == {policy._ranked(1)[1]}  # a probe feeds the runner-up candidate
    # Once the masks pay, probes come at the base rate again.
    policy.curve.points = {1: 1.0, 64: 1.0}
    policy.curve._arrays = None
    assert policy.choose() != (0, 0) and policy._interval == 5


# -- the loop on the fake backend -----------------------------------------------------------------


@pytest.mark.parametrize("good", [0, 2, 4])
def test_a_flat_curve_feeds_wide_a_steep_one_like_ar_output_unchanged(good):
    flat = generate(OracleBackend(good), [PROMPT], settings(), controller=feed_of(fixed(FLAT)))
    steep = generate(OracleBackend(good), [PROMPT], settings(), controller=feed_of(fixed(STEEP), explore=10**6))
    fixed_feed = generate(OracleBackend(good), [PROMPT], settings())
    for result in (flat, steep, fixed_feed):
        assert result.tokens == [ORACLE_REPLY]
    steep_choices = steep.stats.feed_choices
    assert set(steep_choices) == {(0, 0)}
    # Like AR: after the prompt, one token fed and one taken per forward.
    assert steep.stats.forwards == len(ORACLE_REPLY)
    assert steep.stats.fed_tokens == len(PROMPT) + len(ORACLE_REPLY) - 1
    flat_choices = flat.stats.feed_choices
    assert max(flat_choices, key=flat_choices.get)[0] >= 1
    if good:
        assert flat.stats.forwards < len(ORACLE_REPLY) // 2
        assert flat.stats.tokens_per_forward > 2


class RunnerUpBackend(OracleBackend):
    """The oracle, with masks that guess wrong for even target positions and rank the
    oracle's token second there (`runners_up`): a wrong first draft's runner-up is AR's token."""

    def __init__(self):
        super().__init__(good=0)

    def step(
        self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None, runners_up=0, runners_up_from=0
    ):
        if cache is not None:
            cache["width"] += input_ids.shape[1]
        truth = np.vectorize(oracle)(positions + 1)
        wrong = (input_ids == MASK) & ((positions + 1) % 2 == 0)
        out = np.where(wrong, 11 + (truth - 9) % 40, truth)
        ids = np.take_along_axis(out, read, axis=1)
        if not runners_up:
            return StepOutput(ids, np.ones(ids.shape))
        right = np.take_along_axis(truth, read, axis=1)
        second = np.where(ids != right, right, 70)[..., None] + np.arange(runners_up)[None, None, :]
        return StepOutput(ids, np.ones(ids.shape), second)


@pytest.mark.parametrize("curve", ["flat", "costly"])
def test_alternative_groups_are_fed_where_they_pay(curve):
    """A flat curve feeds the runner-up groups, and half the first drafts, wrong, are saved by
    them; a curve where they double a step's cost feeds none. The output is the oracle's."""
    points = FLAT if curve == "flat" else {1: 1.0, 9: 1.0, 14: 3.0, 64: 20.0}
    s = settings(hedge=0, alternatives=1)
    res = generate(RunnerUpBackend(), [PROMPT], s, controller=feed_of(fixed(points)))
    assert res.tokens == [ORACLE_REPLY]
    taken = res.stats.by_source().get("alt", 0)
    stats = DraftStats(slots=4, reached=res.stats.draft_reached, kept=res.stats.draft_kept)
    if curve == "flat":
        assert taken >= 5 and stats.rate("runner_up", 0) > 0.7, (res.stats.by_source(), stats.kept)
        without = generate(RunnerUpBackend(), [PROMPT], settings(hedge=0), controller=feed_of(fixed(points)))
        assert without.tokens == [ORACLE_REPLY] and res.stats.forwards < without.stats.forwards
    else:
        assert taken == 0 and not sum(stats.reached.get("runner_up", []))  # none fed


def test_the_default_feed_is_unchanged_without_a_cost_curve():
    result = generate(OracleBackend(4), [PROMPT], settings(hedge=0))
    assert not result.stats.feed_choices
    # Perfect masks: the first step takes one token, every later one B drafts and one AR token.
    assert result.stats.forwards == 1 + -(-(len(ORACLE_REPLY) - 1) // 5)


# -- n-gram drafts --------------------------------------------------------------------------------


def test_lookup_takes_the_longest_latest_match():
    assert ngram.match([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], max_drafts=3)[1] == [7, 8, 1]
    assert ngram.match([5, 6, 1, 2, 4, 2], max_drafts=2)[1] == [4, 2]  # only the 1-gram "2" matches
    assert ngram.match([1, 2, 3], max_drafts=4)[1] == []
    assert ngram.match([4, 4], max_drafts=4)[1] == [4]
    assert ngram.match([1, 2, 1, 2], max_drafts=0)[1] == []
    # Matches longer than 3 tokens count: the 5-gram [3, 4, 5, 6, 7] beats the later 1-gram 7.
    seq = [3, 4, 5, 6, 7, 8, 9, 7, 0, 3, 4, 5, 6, 7]
    assert ngram.match(seq, max_drafts=2) == (5, [8, 9])
    assert ngram.match(seq, max_drafts=2, max_ngram=3) == (3, [8, 9])
    assert ngram.match(seq, max_drafts=2, min_ngram=6) == (0, [])
    assert ngram.match([1, 2, 3], max_drafts=2) == (0, [])


@settings_hypothesis(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=40),
    st.lists(st.integers(0, 7), max_size=10),
    st.integers(0, 8),
    st.integers(0, 10**6),
)
def test_the_lookup_source_keeps_an_index_that_answers_as_a_whole_scan(start, growth, drafts, seed):
    """NgramLookup indexes each row's sequence as it grows (a step's lookup does not rescan the
    prompt and reply): at every length its answer is `match`'s over the whole sequence; a
    second row, another list, has an index of its own."""
    rng = random.Random(seed)
    lookup, seq, other = ngram.NgramLookup(), list(start), list(start)
    for g in [0] + growth:
        for row in (seq, other):
            row.extend(rng.randrange(6) for _ in range(g))
            n, want = ngram.match(row, max_drafts=drafts)
            assert lookup.propose(row, drafts) == ((ngram.source(n), want) if want else None)


def test_lookup_equals_a_search_over_every_window():
    # The incremental search against the plain one: for the longest n, the latest window
    # equal to the last n tokens (the last window excluded).
    rng = np.random.default_rng(3)
    for _ in range(500):
        seq = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(0, 30)))]
        max_ngram, max_drafts = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        want = (0, [])
        for n in range(min(max_ngram, len(seq) - 1), 0, -1):
            hits = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[len(seq) - n :]]
            if hits:
                want = (n, seq[hits[-1] + n : hits[-1] + n + max_drafts])
                break
        assert ngram.match(seq, max_drafts=max_drafts, max_ngram=max_ngram) == want


def test_ngram_sources_by_match_length():
    assert [ngram.source(n) for n in (1, 2, 3, 4, 5, 6, 10)] == [
        "ngram1",
        "ngram2",
        "ngram3",
        "ngram3",
        "ngram3",
        "ngram6",
        "ngram6",
    ]


@pytest.mark.parametrize("cost", [None, fixed({1: 1.0, 64: 4.0})])
def test_ngram_drafts_keep_the_output_and_report_their_source(cost):
    period = 5
    prompt = [oracle(p, period) for p in range(12)]
    reply = [oracle(p, period) for p in range(12, 52)]
    plain = generate(OracleBackend(0, period), [prompt], settings(hedge=0), controller=feed_of(cost))
    looked = generate(OracleBackend(0, period), [prompt], settings(hedge=0, ngram=6), controller=feed_of(cost))
    assert plain.tokens == looked.tokens == [reply]
    sources = looked.stats.by_source()
    assert sources.get("ngram", 0) > len(reply) // 2  # the text repeats: lookup drafts it
    assert sources.get("masks", 0) == 0  # these masks are always wrong
    assert sum(sources.values()) == len(reply)
    assert looked.stats.forwards < plain.stats.forwards // 2
    assert looked.stats.to_dict()["rows"][0]["by_source"] == sources
    # The drafting statistics count lookup's drafts per match length (the text repeats every
    # 5 tokens, so once 5 tokens in, every match is 6 or more tokens long).
    kept = looked.stats.draft_kept
    assert sum(kept.get("ngram6", [0])) > len(reply) // 2
    assert "ngram" not in kept and sum(kept.get("masks", [0])) == 0


# -- the cache keeps committed tokens only --------------------------------------------------------


@pytest.mark.parametrize("good,hedge", [(2, 0), (2, None), (0, None), (4, 0)])
def test_rejected_drafts_leave_the_cache_at_once(good, hedge):
    """After each step the cache holds the prompt and every output token but the last (the
    AR token, fed next step): no rejected draft and no mask stays."""
    backend = OracleBackend(good)
    out, seen = 0, []

    def check(row, new):
        nonlocal out
        out += len(new)
        seen.append((backend.widths[-1], len(PROMPT) + out - 1))

    result = generate(backend, [PROMPT], settings(hedge=hedge), on_tokens=check)
    assert len(seen) == result.stats.forwards
    assert all(w == committed for w, committed in seen), seen[:5]


def test_torch_cache_width_equals_the_committed_length_every_step():
    tok = make_tokenizer()
    tm = TorchModel(make_model("llama", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)

    class Recording(TorchDecoder):
        def new_cache(self, batch):
            self.cache = super().new_cache(batch)
            return self.cache

    dec = Recording(tm)
    rejected = 0
    for text in PROMPTS[:3]:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
        out, seen = [], []

        def check(row, new):
            out.extend(new)
            seen.append((dec.cache.length, len(prompt) + len(out) - 1))

        result = generate(dec, [prompt], settings(max_tokens=24), on_tokens=check)
        totals = result.stats.draft_totals()
        rejected += sum(totals["verified_per_slot"]) - sum(totals["kept_per_slot"])
        assert seen and all(w == committed for w, committed in seen), seen
    assert rejected > 0  # the untrained masks' drafts were rejected, and left the cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", ["window", "none"])
@pytest.mark.parametrize("curve", [FLAT, STEEP, {1: 1.0, 4: 1.2, 8: 1.5, 32: 3.0}])
def test_cost_aware_lossless_with_ngram_drafts_equals_ar_on_a_real_model(arch, cache, curve):
    tok = make_tokenizer()
    tm = TorchModel(make_model(arch, len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS
    ]
    ar = generate(dec, prompts, settings(threshold=1.0, lossless=False, cache=cache, max_tokens=24)).tokens
    feed = feed_of(fixed(curve), explore=3)  # one policy across calls, probing often
    for batch in (1, 3, 8):
        out = []
        for start in range(0, len(prompts), batch):
            s = settings(cache=cache, max_tokens=24, ngram=5)
            out += generate(dec, prompts[start : start + batch], s, controller=feed).tokens
        assert out == ar, (arch, cache, batch)
    (policy,) = feed.feeds.values()
    assert len(policy.choices) > 1  # the feed changed from step to step (probes included)


@pytest.mark.parametrize("curve,ran", [(FLAT, "block"), (STEEP, "window"), (None, "block")])
def test_the_block_cache_gives_way_to_the_window_cache_where_it_does_not_pay(curve, ran):
    """Greedy lossless decoding asked for the block cache keeps it where the cost curve says
    it pays (wide feeds cost nothing) and decodes with the window cache where it does not
    (every fed token costs); without a curve it runs as asked. The output is AR's either way."""
    cost = fixed(curve) if curve else None
    if cost is not None:
        assert block_cache_pays(cost, 4, 8, 4, 3) == (ran == "block")
    prompts = [[oracle(p) for p in range(n)] for n in (6, 9, 4)]
    result = generate(OracleBackend(2), prompts, settings(cache="block", block_cache=8), controller=feed_of(cost))
    assert result.stats.cache == ran and result.stats.to_dict()["cache"] == ran
    assert result.tokens == [[oracle(p) for p in range(n, n + 40)] for n in (6, 9, 4)]
    assert bool(result.stats.draft_reached) == (ran == "window")  # the window's drafting ran, and learned


@pytest.mark.parametrize("curve", [FLAT, STEEP])
def test_lossless_block_cache_with_a_cost_curve_equals_ar_on_a_real_model(curve):
    tok = make_tokenizer()
    tm = TorchModel(make_model("qwen2", len(tok), seed=2), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS[:4]
    ]
    ar = generate(dec, prompts, settings(threshold=1.0, lossless=False, max_tokens=20)).tokens
    result = generate(
        dec, prompts, settings(cache="block", block_cache=8, max_tokens=20, ngram=5), controller=feed_of(fixed(curve))
    )
    assert result.tokens == ar
    assert result.stats.cache == ("block" if curve is FLAT else "window")


class EndsAt(OracleBackend):
    """The oracle text, except that the token at position `end` is EOS: a row whose prompt
    is shorter than `end` finishes there, longer ones never meet it."""

    def __init__(self, good: int, end: int):
        super().__init__(good)
        self.end = end

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None):
        out = super().step(cache, input_ids, positions, mask, read, metric=metric, sampling=sampling)
        at = np.take_along_axis(positions, read, axis=1) + 1
        return StepOutput(np.where(at == self.end, EOS, out.ids), out.conf)


@pytest.mark.parametrize("good", [0, 2, 4])
def test_block_lossless_with_a_finished_row_still_in_the_batch(good):
    """A row that finished stays in the batch while finished rows are under a quarter of
    it; its reads must stay inside the fed columns when a new block starts (they once
    pointed at column -1 and the step failed)."""
    short = [oracle(p) for p in range(4)]
    long_prompts = [[oracle(p) for p in range(20 + 2 * i)] for i in range(5)]
    prompts = [short] + long_prompts
    s = settings(cache="block", block_cache=4, max_tokens=24)
    result = generate(EndsAt(good, 7), prompts, s)
    assert result.finish[0] == "eos" and result.tokens[0] == [oracle(4), oracle(5), oracle(6), EOS]
    for i, p in enumerate(long_prompts, 1):
        assert result.tokens[i] == [oracle(q) for q in range(len(p), len(p) + 24)]


def test_draft_totals_sum_rows_whose_slot_lists_differ_in_length():
    """At batch > 1 a row whose n-gram drafts outnumbered the masks counts more draft slots
    than the others; the totals pad the shorter lists instead of failing."""
    from mars.core.decode.types import DecodeStats, RowStats, sum_ragged

    long = RowStats(
        accepted_per_slot=[5, 3, 2, 1, 1, 1, 1],
        drafted_per_slot=[4, 4, 4, 4, 2, 2],
        verified_per_slot=[4, 4, 3, 3, 2, 2],
        kept_per_slot=[3, 2, 1, 1, 1, 1],
    )
    short = RowStats(
        accepted_per_slot=[6, 2], drafted_per_slot=[5, 5, 5], verified_per_slot=[5, 4, 1], kept_per_slot=[2, 1, 0]
    )
    stats = DecodeStats(rows=[short, long, RowStats()])
    assert stats.draft_totals() == {
        "drafted_per_slot": [9, 9, 9, 4, 2, 2],
        "verified_per_slot": [9, 8, 4, 3, 2, 2],
        "kept_per_slot": [5, 3, 1, 1, 1, 1],
    }
    assert sum_ragged([short.accepted_per_slot, long.accepted_per_slot]) == [11, 5, 2, 1, 1, 1, 1]
    assert sum_ragged([]) == []


# -- threshold mode: how many masks to feed -------------------------------------------------------


class ConfidentOracle(OracleBackend):
    """The oracle with honest confidences: 1 where a slot's guess is the oracle's next token,
    0.1 where it is not, so threshold mode accepts exactly the right guesses."""

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None):
        ids = super().step(cache, input_ids, positions, mask, read, metric=metric, sampling=sampling).ids
        at = np.take_along_axis(positions, read, axis=1)
        truth = np.vectorize(lambda p: oracle(int(p) + 1, self.period))(at)
        return StepOutput(ids, np.where(ids == truth, 1.0, 0.1))


def threshold(**kw):
    return settings(**{"lossless": False, "threshold": 0.9, **kw})


def test_threshold_policy_rate_by_hand():
    policy = ThresholdFeed(fixed({1: 1.0, 2: 1.5, 5: 3.0}), 4)
    for _ in range(98):  # slot 0 passes 3 times in 4, slot 1 (once reached) half the time
        policy.record(2, 2)
        policy.record(2, 1)
        policy.record(2, 2)
        policy.record(2, 0)
    r0 = (3 * 98 + 1) / (4 * 98 + 2)
    r1 = (2 * 98 + 1) / (3 * 98 + 2)
    curve = fixed({1: 1.0, 2: 1.5, 5: 3.0})  # costed at whole fed tokens (BatchCosts.seconds)
    assert policy.rate(0) == pytest.approx(1.0)
    assert policy.rate(1) == pytest.approx((1 + r0) / curve.seconds(round(2 + r0)))
    both = 1 + r0 + r0 * r1
    assert policy.rate(2) == pytest.approx(both / curve.seconds(round(3 + r0 + r0 * r1)))
    # A batch is as wide as its widest row: the expected longest run of two rows.
    widest = (1 - (1 - r0) ** 2) + (1 - (1 - r0 * r1) ** 2)
    assert policy.rate(2, batch=2) == pytest.approx(both / curve.seconds(round(2 * (3 + widest))))


def test_threshold_policy_decides_on_a_snapshot_of_the_curves():
    curve = CostCurve({1: 1.0, 8: 2.0}, refresh=0.5)
    costs = BatchCosts(curve)
    policy = ThresholdFeed(costs, 4)
    before = policy.costs.seconds(1, 8)
    costs.observe(1, 8, 100.0)  # the shared curve learns from another loop's forwards
    assert curve.points[8] > 2.0
    assert policy.costs.seconds(1, 8) == before
    policy.costs.observe(1, 8, 100.0)  # nor does the policy's own copy move
    assert policy.costs.seconds(1, 8) == before


@pytest.mark.parametrize("good", [1, 4])
def test_threshold_mode_feeds_masks_on_a_flat_curve_and_like_ar_on_a_steep_one(good):
    flat = generate(ConfidentOracle(good), [PROMPT], threshold(), controller=feed_of(fixed(FLAT)))
    steep = generate(ConfidentOracle(good), [PROMPT], threshold(), controller=feed_of(fixed(STEEP)))
    fixed_feed = generate(ConfidentOracle(good), [PROMPT], threshold())
    # Confident guesses are right here, so every feed gives the oracle's text.
    for result in (flat, steep, fixed_feed):
        assert result.tokens == [ORACLE_REPLY]
    choices = steep.stats.feed_choices
    assert max(choices, key=choices.get) == (0, 0)  # AR's feed but for a probe
    assert steep.stats.forwards >= len(ORACLE_REPLY) - 4
    flat_choices = flat.stats.feed_choices
    assert max(flat_choices, key=flat_choices.get)[0] >= 1
    # What each step fed, as the policy chose it.
    assert flat.stats.masks_fed == {m: n for (m, _), n in flat_choices.items()}
    assert sum(steep.stats.masks_fed.values()) == steep.stats.forwards
    assert flat.stats.tokens_per_forward > 1 + 0.5 * good
    assert (
        generate(
            ConfidentOracle(good), [PROMPT], threshold(feed="fixed"), controller=feed_of(fixed(FLAT))
        ).stats.feed_choices
        == {}
    )


def test_threshold_mode_without_a_curve_or_in_ar_mode_feeds_as_asked():
    result = generate(ConfidentOracle(4), [PROMPT], threshold())
    assert result.stats.feed_choices == {}
    assert result.stats.forwards == -(-len(ORACLE_REPLY) // 5)  # B + 1 tokens every step
    ar = generate(ConfidentOracle(4), [PROMPT], threshold(threshold=1.0), controller=feed_of(fixed(FLAT)))
    assert ar.stats.feed_choices == {} and ar.stats.forwards == len(ORACLE_REPLY)


@pytest.mark.parametrize("curve,ran", [(FLAT, "block"), (STEEP, "window")])
def test_threshold_mode_leaves_the_block_cache_where_it_does_not_pay(curve, ran):
    prompts = [[oracle(p) for p in range(n)] for n in (6, 9, 4)]
    result = generate(
        ConfidentOracle(2), prompts, threshold(cache="block", block_cache=8), controller=feed_of(fixed(curve))
    )
    assert result.stats.cache == ran
    assert result.tokens == [[oracle(p) for p in range(n, n + 40)] for n in (6, 9, 4)]


def test_cost_aware_threshold_mode_on_a_steep_curve_equals_ar_on_a_real_model():
    """Where no mask pays, threshold mode feeds AR's feed: on a real (untrained) model its
    text is then exactly greedy AR's, batch and block cache included."""
    tok = make_tokenizer()
    tm = TorchModel(make_model("qwen2", len(tok), seed=2), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS[:3]
    ]
    ar = generate(dec, prompts, threshold(threshold=1.0, max_tokens=20)).tokens
    for cache in ("window", "block"):
        result = generate(
            dec,
            prompts,
            threshold(threshold=0.5, max_tokens=20, cache=cache, block_cache=8),
            controller=feed_of(fixed(STEEP)),
        )
        assert result.tokens == ar
        assert set(result.stats.feed_choices) == {(0, 0)}


def test_a_batch_decides_its_drafts_together():
    """A step is as wide as its widest row: one row's draft widens it for all 8 rows and
    does not pay alone, the 8 rows' drafts together do (mars.core.decode.drafting)."""
    from mars.core.decode.drafting import Drafting

    s = make_plan(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=8, threshold=1.0, lossless=True, cache="window")
    # 8 rows: 16 tokens (1 mask a row, no drafts) cost 1.0, 24 (a draft a row) 1.3
    curve = CostCurve({1: 0.2, 16: 1.0, 24: 1.3, 64: 4.0})
    drafting = Drafting(s, LosslessFeed(curve, 4, 0))
    kept = drafting.stats.expected_kept("masks", 1)  # the prior: 0.5
    assert (8 + kept) / 1.3 < 8 / 1.0 < (8 + 8 * kept) / 1.3
    every = [[("masks", "masks", [5, 6])]] * 8
    assert drafting._pick_all(every, 1, 0, 8) == [("masks", "masks", [5])] * 8
    one = [[("masks", "masks", [5])]] + [[]] * 7
    assert drafting._pick_all(one, 1, 0, 8) == [("masks", "masks", [])] * 8
    # Without a cost curve every row feeds its option expected to keep the most.
    plain = Drafting(s, None)
    assert plain._pick_all([[("masks", "masks", [5]), ("ngram", "ngram", [7, 8, 9])], []], 1, 0, 2) == [
        ("ngram", "ngram", [7, 8, 9]),
        ("masks", "masks", []),
    ]


def test_the_drafts_common_length_is_the_best_over_every_length():
    """Drafting._pick_all stops trying longer common lengths once even every row's best option whole
    could not beat the best so far at the next length's cost: its picks are those of trying every
    length (random statistics, options, batches and rising curves), and it stops early on a steep curve."""
    from mars.core.decode.drafting import Drafting
    from mars.core.decode.layout import lossless_width

    s = make_plan(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=8, threshold=1.0, lossless=True, cache="window")
    rng = random.Random(3)
    stopped = 0
    for _ in range(300):
        steep = rng.random() < 0.5
        points = {1: 1.0, 8: 1.0 + rng.random() * (4 if steep else 0.2), 64: 30.0 if steep else 2.0}
        drafting = Drafting(s, LosslessFeed(CostCurve(points), 4, 1))
        for source in ("masks", "ngram3", "corpus4"):  # keep rates of every kind, deep slots often kept for some
            whole = rng.random()
            for _ in range(rng.randrange(0, 40)):
                fed = rng.randrange(1, 33)
                drafting.stats.record(source, fed, fed if rng.random() < whole else rng.randrange(0, fed + 1))
        batch, masks, spare = rng.randrange(1, 4), rng.randrange(0, 4), rng.randrange(0, 2)
        sources = ("masks", "ngram3", "corpus4")
        options = [
            [(src, src, [7] * rng.randrange(1, 33)) for src in rng.sample(sources, rng.randrange(0, 4))]
            for _ in range(batch)
        ]
        asked = []
        seconds = drafting.feed.costs.seconds
        drafting.feed.costs.seconds = lambda b, w: asked.append(w) or seconds(b, w)
        got = drafting._pick_all(options, masks, spare, batch)
        # Every length tried: each row's option keeping the most of its first d (ties: the first).
        kept = [[drafting.stats.expected_kept_each(key, len(d)) for _, key, d in o] for o in options]

        def pick(o, k, d):
            top = None
            for j, ((_, _, drafts), each) in enumerate(zip(o, k)):
                n = min(d, len(drafts))
                if top is None or each[n - 1] > top[2]:
                    top = (j, n, each[n - 1])
            return top

        longest = max((len(d) for o in options for _, _, d in o), default=0)
        best_d, best = 0, batch / seconds(batch, lossless_width(0, masks, spare))
        for d in range(1, longest + 1):
            picks = [pick(o, k, d) for o, k in zip(options, kept)]
            total = 0
            for p in picks:
                total += p[2] if p is not None else 0
            widest = max((p[1] for p in picks if p is not None), default=0)
            score = (batch + total) / seconds(batch, lossless_width(widest, masks, spare))
            if score > best:
                best_d, best = d, score
        want = []
        for o, k in zip(options, kept):
            p = pick(o, k, best_d) if best_d and o else None
            want.append(("masks", "masks", []) if p is None else (o[p[0]][0], o[p[0]][1], o[p[0]][2][: p[1]]))
        assert got == want
        stopped += len(set(asked)) < len({lossless_width(w, masks, spare) for w in range(longest + 1)})
    assert stopped > 20, stopped


# -- the kept cost curve ------------------------------------------------------------------------


def test_a_kept_curve_that_falls_is_measured_again(tmp_path, monkeypatch):
    """With MARS_HOME set, a lossless `mars generate` keeps its cost curve there, said in one
    line before it is measured (what, about how long, where, how to measure again); a kept
    curve whose seconds fall (here: reversed, as a busy machine can leave it) is measured
    again by the same command, and every kept curve is non-decreasing; --remeasure-cost
    measures it again on demand."""
    import json

    from clitools import invoke, ok
    from tiny import save_model

    monkeypatch.setenv("MARS_HOME", str(tmp_path / "home"))
    model = save_model(tmp_path / "model", "llama", seed=0)
    command = ("generate", "--model", model, "--prompt", "hi", "--max-tokens", 4, "--lossless", "--device", "cpu")

    def kept():
        return {p: json.loads(p.read_text()) for p in sorted((tmp_path / "home" / "cost").glob("*.json"))}

    first = ok(invoke(*command))
    said = [line for line in first.stderr.splitlines() if line.startswith("measuring what a forward costs")]
    assert len(said) == 1 and "once, about " in said[0] and "; kept in " in said[0] and "--remeasure-cost" in said[0]
    curves = kept()
    assert curves and all(str(path) in said[0] for path in curves)
    for path, curve in curves.items():
        assert curve["seconds"] == sorted(curve["seconds"]) and len(curve["measured"]) == len(curve["seconds"])
        curve["seconds"] = curve["seconds"][::-1]  # a wider forward now cheaper than a narrower one
        if curve["seconds"] == sorted(curve["seconds"]):  # a flat curve (a busy machine can measure one): make it fall
            curve["seconds"][-1] /= 2
        path.write_text(json.dumps(curve))
    falling = kept()
    again = ok(invoke(*command))
    assert "again (the kept curve was not non-decreasing)" in again.stderr
    # Measured again: every kept curve rewritten, non-decreasing (not a claim about how much
    # wider forwards cost, which depends on how busy the machine is).
    assert kept().keys() == falling.keys()
    for path, curve in kept().items():
        assert curve["seconds"] == sorted(curve["seconds"]) and curve != falling[path]
    assert "measuring" not in ok(invoke(*command)).stderr  # a good curve is read, not measured
    assert "measuring what a forward costs" in ok(invoke(*command, "--remeasure-cost")).stderr


def test_calibration_keeps_each_widths_fastest_round_and_times_more_when_noisy():
    """Load only adds time: each width keeps its fastest round; rounds that disagree much
    (a busy machine) make calibration time as many rounds again; before the rounds it says
    about how long they take."""
    from mars.core.decode import cost

    class Clocked:
        """A backend whose forward of k tokens takes k ms, plus 5 ms on two calls of every three when `busy`."""

        def __init__(self, busy):
            self.busy, self.calls, self.now = busy, 0, 0.0

        def new_cache(self, batch):
            return None

        def crop(self, cache, length):
            pass

        def step(self, cache, ids, positions, mask, read, **kw):
            self.calls += 1
            self.now += ids.shape[1] * 1e-3 + (5e-3 if self.busy and self.calls % 3 else 0.0)
            return StepOutput(np.zeros(read.shape, dtype=np.int64), np.zeros(read.shape))

    widths = (1, 2, 4, 8)
    for busy, passes in ((False, 1), (True, 2)):
        backend, heard = Clocked(busy), []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cost.time, "perf_counter", lambda: backend.now)
            curve = cost.calibrate(backend, [1, 2, 3], widths=widths, repeats=3, before=heard.append)
        assert curve.points == pytest.approx({k: k * 1e-3 for k in widths})  # the fastest rounds, not the slow ones
        assert len(heard) == 1  # said before the rounds: 4 rounds of 15 ms, more when busy
        assert heard[0] == pytest.approx(4 * sum(widths) * 1e-3) if not busy else heard[0] >= 4 * sum(widths) * 1e-3
        # per pass: a prefill and a warm-up round before the 3 timed rounds; the first pass's estimate, 4
        # forwards (both ends warmed, then timed)
        assert backend.calls == passes * (1 + 4 * len(widths)) + 4, (busy, backend.calls)

    class FirstSlow(Clocked):
        """A first forward of each width that pays 10 s more (a graph compiled, a kernel made)."""

        def step(self, cache, ids, positions, mask, read, **kw):
            if ids.shape[1] not in self.seen:
                self.seen.add(ids.shape[1])
                self.now += 10.0
            return super().step(cache, ids, positions, mask, read, **kw)

    backend, heard = FirstSlow(False), []
    backend.seen = set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost.time, "perf_counter", lambda: backend.now)
        cost.calibrate(backend, [1, 2, 3], widths=widths, repeats=3, before=heard.append)
    assert heard[0] < 1.0  # the estimate leaves out what a first forward of a shape pays


def test_the_curves_plain_interpolation_is_numpys_to_the_bit():
    """CostCurve reads its points in plain Python: the same floats as np.interp over the pooled
    (non-decreasing) points, at the points, between them and past the last (its slope extended)."""
    from mars.core.decode.cost import interpolated, non_decreasing

    rng = random.Random(3)
    for _ in range(2000):
        ks = sorted(rng.sample(range(1, 80), rng.randint(1, 12)))
        points = {k: rng.uniform(1e-4, 0.1) * (1 + k * rng.random()) for k in ks}
        curve = CostCurve(points)
        xs, ys = [float(k) for k in ks], non_decreasing(list(points.values()))
        for t in [rng.uniform(ks[0], ks[-1]) for _ in range(3)] + ks:
            assert interpolated(float(t), xs, ys.tolist()) == float(np.interp(float(t), xs, ys))
        for t in [rng.randint(1, 100) for _ in range(4)] + ks:
            t = float(max(t, 1))
            if t <= ks[-1]:
                want = float(np.interp(t, xs, ys))
            else:
                slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
                want = float(ys[-1] + max(slope, 0.0) * (t - xs[-1]))
            assert curve.seconds(t) == want


def test_a_curve_answers_after_each_timing_as_a_fresh_one_would():
    """A timed forward moves one point of the curve (`observe`); what was asked before keeps its answer
    only outside the segments the move changed: after every timing, each width costs the same float
    as on a curve made afresh from the same points (random curves, timings at old and new widths)."""
    rng = random.Random(4)
    kept = 0
    for _ in range(300):
        ks = sorted(rng.sample(range(1, 70), rng.randint(1, 8)))
        curve = CostCurve({k: rng.uniform(0.01, 0.1) * (1 + k / 20) for k in ks}, refresh=rng.choice([0.1, 0.5]))
        asked = [rng.randint(1, 90) for _ in range(12)] + ks
        for _ in range(25):
            for t in asked:
                curve.seconds(t)
            known = dict(curve._arrays[2])
            width = rng.choice(list(curve.points)) if rng.random() < 0.8 else rng.randint(1, 90)
            curve.observe(width, rng.uniform(0.005, 0.15))
            kept += curve._arrays is not None and any(t in curve._arrays[2] for t in known)
            fresh = CostCurve(dict(curve.points))
            assert curve.seconds_of(asked) == [fresh.seconds(t) for t in asked], curve.points  # many at once
            for t in asked:
                assert curve.seconds(t) == fresh.seconds(t), (t, curve.points)
            rows = rng.randint(1, 9)
            costs = BatchCosts(curve, measure=lambda b: CostCurve({k * b: v * b for k, v in curve.points.items()}))
            widths = [rng.uniform(0.5, 40) for _ in range(6)]
            assert costs.seconds_of(rows, widths) == [costs.seconds(rows, w) for w in widths]
    assert kept > 100, kept  # most timings kept some answers


def _same_mask(a, b) -> bool:
    if a is None or b is None:
        return a is b
    parts = [(x, y) for x, y in zip((a.keys, a.see, a.start), (b.keys, b.see, b.start))]
    return (a.cached, a.width) == (b.cached, b.width) and all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y)) for x, y in parts
    )


@pytest.mark.parametrize("mode", ["lossless", "threshold"])
def test_a_row_alone_keeps_the_masks_and_keys_that_its_keys_give(monkeypatch, mode):
    """A row alone on the window cache keeps only the count of its cached keys (all real) and decides
    each step's mask without them (WindowStrategy.mask, .commit): every mask is `layout_mask` over
    the keys, and every commit keeps the keys and crops the cache as the path over the keys does."""
    import copy

    from mars.core.decode import strategies
    from mars.core.decode.layout import layout_mask

    mask, commit = strategies.WindowStrategy.mask, strategies.WindowStrategy.commit
    shortcuts = {"mask": 0, "commit": 0}

    def stored(strategy):  # the keys as the strategy holds them, made without changing it
        if strategy._every is not None:
            return np.ones(strategy._every, dtype=bool)
        return None if strategy._key_valid is None else strategy._key_valid.copy()

    def checked_mask(self, layout):
        got = mask(self, layout)
        twin = copy.copy(self)
        twin.key_valid = stored(self)
        keys = layout.keys
        want = layout_mask(twin.keys(layout), layout)
        layout.keys = keys
        assert _same_mask(got, want), (got, want)
        shortcuts["mask"] += layout.holes is False
        return got

    class Crops:
        def __init__(self):
            self.lengths = []

        def crop(self, cache, length):
            self.lengths.append(length)

    def checked_commit(self, backend, cache, rows, layout, before, kept=None):
        twin, twin_rows, crops = copy.copy(self), [copy.copy(r) for r in rows], Crops()
        held = stored(self)
        twin.key_valid = np.zeros((len(rows), 0), dtype=bool) if held is None else held  # the path over the keys
        keys = layout.keys
        commit(twin, crops, cache, twin_rows, layout, before, kept)
        layout.keys = keys
        before_width = len(backend.widths)
        commit(self, backend, cache, rows, layout, before, kept)
        shortcuts["commit"] += self._every is not None
        assert np.array_equal(stored(self), twin.key_valid)
        assert backend.widths[before_width:] and crops.lengths == [self_width(self)]
        assert [r.cached for r in rows] == [r.cached for r in twin_rows]

    def self_width(strategy):
        return stored(strategy).shape[1]

    monkeypatch.setattr(strategies.WindowStrategy, "mask", checked_mask)
    monkeypatch.setattr(strategies.WindowStrategy, "commit", checked_commit)
    if mode == "lossless":
        s = settings(hedge=1, alternatives=1, cache="window")
        backend, prompt, want = RunnerUpBackend(), PROMPT, ORACLE_REPLY
    else:
        s = make_plan(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=40, threshold=0.5, cache="window")
        backend, prompt, want = OracleBackend(good=2), PROMPT, None
    res = generate(backend, [prompt], s, controller=feed_of(fixed(FLAT)) if mode == "lossless" else None)
    if want is not None:
        assert res.tokens == [want]
    assert shortcuts["mask"] > 5 and shortcuts["commit"] > 5, shortcuts
