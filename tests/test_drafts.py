"""Draft sources as proposers (mars.core.decode.drafts): a new lookup source is one class and
one registration; its drafts are verified like every other source's, so the output is
unchanged, and its tokens are counted under its name."""

from __future__ import annotations

import numpy as np
from test_cost import MASK, ORACLE_REPLY, PROMPT, OracleBackend, oracle, settings

from mars.core.decode import drafts
from mars.core.decode.loop import generate
from mars.core.decode.types import StepOutput


class Future:
    """Proposes the oracle's own next tokens (it knows the text), counted as "future"."""

    name = "future"

    def propose(self, seq, max_drafts):
        return "future", [oracle(p) for p in range(len(seq), len(seq) + max_drafts)]


class Wrong:
    """Proposes tokens the oracle never says."""

    name = "wrong"

    def propose(self, seq, max_drafts):
        return "wrong", [1] * max_drafts


def test_a_new_lookup_source_is_one_registration(monkeypatch):
    plain = generate(OracleBackend(0), [PROMPT], settings(hedge=0, ngram=6))  # masks always wrong here
    monkeypatch.setitem(drafts.SOURCES, "future", lambda plan: Future())
    drafted = generate(OracleBackend(0), [PROMPT], settings(hedge=0, ngram=6))
    assert plain.tokens == drafted.tokens == [ORACLE_REPLY]
    sources = drafted.stats.by_source()
    assert sources.get("future", 0) > len(ORACLE_REPLY) // 2 and sum(sources.values()) == len(ORACLE_REPLY)
    assert drafted.stats.forwards < plain.stats.forwards // 2
    # Where drafts are not verified (plain threshold mode) no lookup source is asked.
    assert drafts.lookup_sources(settings(lossless=False, threshold=0.9, ngram=6)) == []


def test_a_source_that_is_always_wrong_changes_nothing(monkeypatch):
    monkeypatch.setitem(drafts.SOURCES, "wrong", lambda plan: Wrong())
    result = generate(OracleBackend(2), [PROMPT], settings(hedge=0, ngram=6))
    assert result.tokens == [ORACLE_REPLY] and result.stats.by_source().get("wrong", 0) == 0


class Twin:
    """An in-forward source for the test: spare groups under a name of its own, as many as
    the plan's block size."""

    name = "twin"

    def count(self, plan):
        return plan.block_size

    def groups(self, rows, n_drafts, count, masks, mask_id):
        return [
            g.__class__(self.name, g.anchor, g.prefix, g.live, g.masks)
            for g in drafts.GROUP_SOURCES["spare"].groups(rows, n_drafts, count, masks, mask_id)
        ]


class PositionOracle(OracleBackend):
    """The oracle text, with masks wrong exactly where they stand for a position p with
    (p + 1) % 5 == 0, wherever they sit among the fed columns (a group's too)."""

    def __init__(self):
        super().__init__(0)

    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None):
        nxt = np.vectorize(lambda p: oracle(int(p) + 1))(positions)
        out = np.where((input_ids == MASK) & ((positions + 1) % 5 == 0), nxt + 1, nxt)
        ids = np.take_along_axis(out, read, axis=1)
        return StepOutput(ids, np.ones(ids.shape))


def test_a_new_in_forward_source_is_one_registration(monkeypatch):
    """Registered beside the others, its groups are laid out, masked and verified by the one
    rule: with the spare groups off (hedge 0) the twin does their work, token for token, and
    its proposals count under its name. (A draft fails now and then, and a group's proposals
    follow.)"""
    spare = generate(PositionOracle(), [PROMPT], settings())
    bare = generate(PositionOracle(), [PROMPT], settings(hedge=0))
    monkeypatch.setitem(drafts.GROUP_SOURCES, "twin", Twin())
    twin = generate(PositionOracle(), [PROMPT], settings(hedge=0))
    assert twin.tokens == spare.tokens == bare.tokens == [ORACLE_REPLY]
    sources = spare.stats.by_source()
    assert sources.get("spare", 0) > 0 and "spare" not in bare.stats.by_source()
    assert twin.stats.by_source() == {("twin" if k == "spare" else k): n for k, n in sources.items()}
    assert twin.stats.forwards == spare.stats.forwards < bare.stats.forwards
