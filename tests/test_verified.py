"""Verified threshold mode (docs/method.md §9): lossless mode's loop, which also takes the
leading next drafts whose confidence passes the threshold, unverified.

The loop is checked against a reference written here from the rule alone (no cache, every
step feeds the whole sequence, its drafts and B masks; fixed feed, no spare groups, no
n-gram lookup) on a real tiny model, for single rows and batches; on a fake backend with
honest confidences its text is the oracle's with fewer forwards than lossless mode; at
threshold 1.0 it is plain greedy AR.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_cost import PROMPT, ConfidentOracle, OracleBackend, RunnerUpBackend, fixed, oracle
from test_lossless import EOS, MASK, prompts_of
from tiny import PROMPTS, feed_of, make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode.cost import BatchCosts, CostCurve
from mars.core.decode.loop import generate
from mars.core.decode.plan import Sampling
from mars.core.decode.types import StepOutput


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def dec(request, tok):
    return TorchDecoder(
        TorchModel(make_model(request.param, len(tok), seed=3), tok, None, "", torch.device("cpu"), torch.float32)
    )


def settings(**kw):
    base = dict(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=24, verify=True, feed="fixed", hedge=0)
    base.update(kw)
    return make_plan(**base)


def reference(dec, prompt, B: int, tau: float, max_tokens: int, metric: str = "probability"):
    """The rule, step by step, uncached: feed seq + drafts + B masks; keep the drafts AR
    agrees with, take the AR token after them; if every draft was kept, the masks propose:
    take the leading proposals whose confidence passes tau, the rest are the next drafts."""
    seq, drafts, out, forwards, taken = list(prompt), [], [], 0, 0
    while len(out) < max_tokens:
        d = drafts[: max_tokens - len(out) - 1]
        fed = seq + d + [MASK] * B
        last = len(seq) - 1
        read = [last + j for j in range(len(d) + 1)] + [last + len(d) + 1 + j for j in range(B)]
        ids, conf = dec.step(
            None,
            np.asarray([fed]),
            np.arange(len(fed))[None],
            None,
            np.asarray([read]),
            metric=metric,
            sampling=Sampling(),
        )
        ids, conf = ids[0].tolist(), conf[0]
        forwards += 1
        kept = 0
        while kept < len(d) and d[kept] == ids[kept]:
            kept += 1
        new = d[:kept] + [ids[kept]]
        drafts = ids[len(d) + 1 :] if kept == len(d) else []
        pconf = conf[len(d) + 1 :] if kept == len(d) else []
        room = max_tokens - len(out) - len(new)
        c = 0
        while c < min(len(drafts), room) and pconf[c] >= tau:
            c += 1
        taken += c
        new, drafts = new + drafts[:c], drafts[c:]
        if EOS in new:
            new = new[: new.index(EOS) + 1]
            out += new
            break
        out += new
        seq += new
    return out, forwards, taken


@pytest.mark.parametrize("cache", ["none", "window"])
@pytest.mark.parametrize("tau", [0.2, 0.5, 0.9])
def test_the_loop_follows_the_rule(dec, tok, cache, tau):
    prompts = prompts_of(tok, PROMPTS[:5])
    s = settings(threshold=tau, cache=cache)
    refs = [reference(dec, p, 4, tau, s.max_tokens) for p in prompts]
    for batch in (1, 5):
        out, taken = [], 0
        for start in range(0, len(prompts), batch):
            result = generate(dec, prompts[start : start + batch], s)
            out += result.tokens
            taken += result.stats.by_source().get("threshold", 0)
            if batch == 1:
                assert result.stats.forwards == refs[start][1], (cache, tau)
        assert out == [r[0] for r in refs], (cache, tau, batch)
        assert taken == sum(r[2] for r in refs)


def test_the_reference_takes_unverified_tokens_somewhere(dec, tok):
    """The check above covers confident tokens taken, not only verified ones."""
    prompts = prompts_of(tok, PROMPTS[:5])
    assert sum(reference(dec, p, 4, 0.2, 24)[2] for p in prompts) > 0


@pytest.mark.parametrize("cache", ["none", "window", "block"])
@pytest.mark.parametrize("tree", [0, 8])
def test_at_threshold_one_it_is_greedy_ar(dec, tok, cache, tree):
    prompts = prompts_of(tok, PROMPTS[:4])
    ar = generate(dec, prompts, make_plan(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=24)).tokens
    assert (
        generate(
            dec,
            prompts,
            settings(threshold=1.0, cache=cache, feed="auto", hedge=None, tree=tree),
            controller=feed_of(fixed({1: 1.0, 64: 1.0})),
        ).tokens
        == ar
    )


def test_with_trees_batched_rows_equal_rows_alone(dec, tok):
    """Verified threshold mode with tree nodes (drafts/tree.py): a node's masks may propose the next
    drafts, some taken unverified; a row's text is the same alone or in a batch."""
    prompts = prompts_of(tok, PROMPTS[:5])
    s = settings(threshold=0.5, tree=8)
    alone = [generate(dec, [p], s) for p in prompts]
    together = generate(dec, prompts, s)
    assert together.tokens == [r.tokens[0] for r in alone]
    assert sum(r.stats.by_source().get("tree", 0) for r in alone) > 0, "no tree node was taken"


def test_never_past_max_tokens(dec, tok):
    prompts = prompts_of(tok, PROMPTS[:3])
    for n in (1, 2, 5):
        result = generate(dec, prompts, settings(threshold=0.0, max_tokens=n))
        assert all(len(t) <= n for t in result.tokens)
        assert [t for t in result.tokens] == [reference(dec, p, 4, 0.0, n)[0] for p in prompts]


class SpareOracle(ConfidentOracle):
    """ConfidentOracle whose masks count their run from the real token they follow by
    position, so a spare group guesses as the masks right after that token would."""

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None):
        if cache is not None:
            cache["width"] += input_ids.shape[1]
        b, q = input_ids.shape
        out = np.zeros((b, q), dtype=np.int64)
        for r in range(b):
            for c in range(q):
                p = int(positions[r, c])
                nxt = oracle(p + 1, self.period)
                if input_ids[r, c] != MASK:
                    out[r, c] = nxt
                    continue
                before = [int(positions[r, k]) for k in range(c) if input_ids[r, k] != MASK and positions[r, k] < p]
                run = p - max(before) - 1
                out[r, c] = nxt if run < self.good else 11 + (nxt - 9) % 40
        ids = np.take_along_axis(out, read, axis=1)
        at = np.take_along_axis(positions, read, axis=1)
        truth = np.vectorize(lambda p: oracle(int(p) + 1, self.period))(at)
        return StepOutput(ids, np.where(ids == truth, 1.0, 0.1))


@pytest.mark.parametrize("good", [1, 2, 4])
def test_honest_confidences_give_the_oracle_text_in_no_more_forwards(good):
    """Right guesses are confident, wrong ones not: the text is the oracle's, in no more
    forwards than lossless mode (which verifies the right guesses a step later) or threshold
    mode (which drops the guesses it does not take)."""
    s = settings(threshold=0.9, max_tokens=40, hedge=None)
    verified = generate(SpareOracle(good), [PROMPT], s)
    lossless = generate(SpareOracle(good), [PROMPT], settings(lossless=True, verify=False, max_tokens=40, hedge=None))
    threshold = generate(SpareOracle(good), [PROMPT], settings(verify=False, threshold=0.9, max_tokens=40))
    reply = [oracle(p) for p in range(len(PROMPT), len(PROMPT) + 40)]
    assert verified.tokens == lossless.tokens == threshold.tokens == [reply]
    assert verified.stats.by_source()["threshold"] > 0
    assert verified.stats.forwards <= min(lossless.stats.forwards, threshold.stats.forwards)


class HonestRunnerUp(RunnerUpBackend):
    """RunnerUpBackend (wrong masks rank the right token second) with honest confidences."""

    def step(
        self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None, runners_up=0, runners_up_from=0
    ):
        out = super().step(
            cache,
            input_ids,
            positions,
            mask,
            read,
            metric=metric,
            sampling=sampling,
            valid=valid,
            runners_up=runners_up,
        )
        truth = np.vectorize(lambda p: oracle(int(p) + 1))(np.take_along_axis(positions, read, axis=1))
        return replace(out, conf=np.where(out.ids == truth, 1.0, 0.1))


def test_alternative_groups_in_verified_threshold_mode():
    """With runners-up fed, a step whose first draft failed may take AR's next token from an
    alternative group, then confident proposals of that group: the text is still the
    oracle's when only right guesses are confident."""
    s = settings(threshold=0.9, max_tokens=40, hedge=None, alternatives=1)
    result = generate(HonestRunnerUp(), [PROMPT], s)
    assert result.tokens == [[oracle(p) for p in range(len(PROMPT), len(PROMPT) + 40)]]
    sources = result.stats.by_source()
    assert sources.get("alt", 0) > 0 and sources.get("threshold", 0) > 0, sources
    without = generate(HonestRunnerUp(), [PROMPT], settings(threshold=0.9, max_tokens=40, hedge=None))
    assert without.tokens == result.tokens and result.stats.forwards <= without.stats.forwards


def test_confident_wrong_guesses_change_the_text():
    """The unverified tokens are the ones threshold mode would take: a confidently wrong
    mask changes the text (OracleBackend is confident everywhere)."""
    s = settings(threshold=0.9, max_tokens=40)
    result = generate(OracleBackend(1), [PROMPT], s)
    reply = [oracle(p) for p in range(len(PROMPT), len(PROMPT) + 40)]
    assert result.tokens[0] != reply
    assert result.stats.by_source()["threshold"] > 0


def test_the_feed_policy_decides_on_a_frozen_copy_of_the_curves():
    """What a verified step feeds changes the text: the run's timings must not move the
    curves it decides on (nor the caller's)."""
    curve = CostCurve({1: 1.0, 64: 1.0}, refresh=0.5)
    costs = BatchCosts(curve)
    before = dict(curve.points)
    result = generate(
        ConfidentOracle(2),
        [PROMPT],
        settings(threshold=0.9, max_tokens=40, feed="auto", hedge=None),
        controller=feed_of(costs),
    )
    assert curve.points == before
    assert result.stats.feed_choices  # the cost-aware feed chose every step, on its own copy
    assert result.tokens == [[oracle(p) for p in range(len(PROMPT), len(PROMPT) + 40)]]


def test_block_cache_runs_the_window_cache(dec, tok):
    prompts = prompts_of(tok, PROMPTS[:3])
    block = generate(dec, prompts, settings(threshold=0.5, cache="block", block_cache=8))
    window = generate(dec, prompts, settings(threshold=0.5, cache="window"))
    assert block.stats.cache == "window" and block.tokens == window.tokens
