"""Draft sources as proposers (mars.core.decode.drafts): a new lookup source is one class and
one registration; its drafts are verified like every other source's, so the output is
unchanged, and its tokens are counted under its name."""

from __future__ import annotations

from mars.core.decode import drafts
from mars.core.decode.loop import generate
from test_cost import ORACLE_REPLY, PROMPT, OracleBackend, oracle, settings


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
