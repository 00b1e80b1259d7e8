"""The draft sources a loop that verifies drafts (lossless and verified threshold mode) may
feed, as vLLM's proposers are: a source proposes tokens to follow a row, the loop feeds them
as real ids after the row's last verified token and verifies them by the one rule
(mars.core.decode.verify), so the output stays AR's whatever a source proposes.

Two kinds:

- Lookup sources find a row's drafts in what it has seen or in text the model wrote before,
  at no cost to the forward: n-gram lookup in the prompt and reply (`ngram.py`) and the draft
  corpus (`corpus.py`). Each is a `Proposer`; `SOURCES` registers them, in the order a row
  prefers them on a tie. A new lookup source is one file and one line in `SOURCES`.
- In-forward sources are the model's own proposals, read from columns of the forward that
  verifies the last drafts: the masks after the drafts, the spare groups (masks after each
  draft, for when it fails) and the runner-up alternatives (a first draft's runners-up, each
  followed by masks). Their columns are laid out by mars.core.decode.layout.Columns and the
  window strategy, and `verify` reads their proposals; their names are `IN_FORWARD`.

`mars.core.decode.drafting.Drafting` chooses per step, per row, among what the sources offer
(expected drafts kept, `DraftStats`, per source and match length), and how wide a step is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .corpus import DraftCorpus
from .ngram import NgramLookup

if TYPE_CHECKING:
    from ..plan import DecodeSettings


class Proposer(Protocol):
    """A lookup source: `name` (how its tokens are counted, `RowStats.by_source`) and
    `propose`."""

    name: str

    def propose(self, seq: list[int], max_drafts: int) -> tuple[str, list[int]] | None:
        """Up to `max_drafts` drafts to follow `seq` (prompt and reply so far) and the
        statistics key they count under (DraftStats: one per source and match length), or None."""
        ...


# The lookup sources, each built for a plan (None: not in this plan): name -> factory.
SOURCES: dict[str, Callable[[DecodeSettings], Proposer | None]] = {
    NgramLookup.name: lambda plan: NgramLookup(),
    DraftCorpus.name: lambda plan: plan.drafts.corpus,
}
LOOKUP = tuple(SOURCES)  # draft sources found by lookup, not proposed by the model
IN_FORWARD = ("masks", "spare", "alt")  # the model's own proposals, read from the verifying forward


def lookup_sources(plan: DecodeSettings) -> list[Proposer]:
    """The lookup sources a plan drafts from, up to `plan.lookup_drafts` drafts a step each:
    greedy, where drafts are verified (a sampled draft needs the distribution it came from)."""
    if not plan.lookup_drafts:
        return []
    return [p for p in (make(plan) for make in SOURCES.values()) if p is not None]
