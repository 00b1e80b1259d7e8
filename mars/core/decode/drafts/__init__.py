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
  verifies the last drafts: the masks after the drafts (`masks.py`, the window's own
  columns), the spare groups (`spare.py`: masks after each draft, for when it fails) and the
  runner-up alternatives (`alternatives.py`: a first draft's runners-up, each followed by
  masks). A `GroupSource` says which groups it adds to a step (mars.core.decode.layout.Group:
  where it is anchored among the row's drafts, the ids it feeds before its masks); the
  layout places and masks every group alike, and the one verifier (mars.core.decode.verify)
  takes, per row, the group whose anchor and prefix AR confirmed. `GROUP_SOURCES` registers
  them, in feed order. A new in-forward source is one file, one line there, and its
  setting in the plan (DraftSources): three files.

`mars.core.decode.drafting.Drafting` chooses per step, per row, among what the sources offer
(expected drafts kept, `DraftStats`, per source and match length), and how wide a step is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .alternatives import Alternatives
from .corpus import DraftCorpus
from .masks import Masks
from .ngram import NgramLookup
from .spare import SpareGroups

if TYPE_CHECKING:
    from ..layout import Group
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


class GroupSource(Protocol):
    """An in-forward source: `name` (how its tokens count) and the groups it adds to a step."""

    name: str

    def count(self, plan: DecodeSettings) -> int:
        """The most groups a step of `plan` feeds (0: none); the cost-aware feed may narrow it."""
        ...

    def groups(self, rows, n_drafts: np.ndarray, count: int, masks: int, mask_id: int) -> list[Group]:
        """Up to `count` groups for the step's rows (`n_drafts[r]` drafts fed by row r), each
        with `masks` masks; ids of rows where a group is not live are `mask_id`."""
        ...


# The in-forward sources beside the masks, in the order their groups follow the window.
GROUP_SOURCES: dict[str, GroupSource] = {SpareGroups.name: SpareGroups(), Alternatives.name: Alternatives()}
IN_FORWARD = (Masks.name, *GROUP_SOURCES)  # the model's own proposals, read from the verifying forward
# Every source's name, for the code that counts tokens by source or sizes a source's groups.
MASKS, SPARE, ALT = Masks.name, SpareGroups.name, Alternatives.name
# How a report names each source's tokens.
LABELS = {s.name: s.label for s in (Masks, SpareGroups, NgramLookup, DraftCorpus, Alternatives)}


def lookup_sources(plan: DecodeSettings) -> list[Proposer]:
    """The lookup sources a plan drafts from, up to `plan.lookup_drafts` drafts a step each:
    greedy, where drafts are verified (a sampled draft needs the distribution it came from)."""
    if not plan.lookup_drafts:
        return []
    return [p for p in (make(plan) for make in SOURCES.values()) if p is not None]
