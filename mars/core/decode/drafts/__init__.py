"""The draft sources of a loop that verifies drafts (docs/method.md §9): a source proposes tokens
to follow a row, fed as real ids after its last verified token and verified by one rule
(mars.core.decode.verify), so the output stays AR's whatever a source proposes.

Lookup sources (`Proposer`, in `SOURCES`) find drafts in what a row has seen or in the model's
earlier text, at no cost to the forward. In-forward sources (`GroupSource`, in `GROUP_SOURCES`) are
the model's own proposals, read from the verifying forward's columns as `Group`s that the layout
places and the verifier confirms alike. A new source is one file and one line in its registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .alternatives import Alternatives
from .corpus import DraftCorpus
from .masks import Masks
from .ngram import NgramLookup
from .spare import SpareGroups
from .tree import TreeDrafts

if TYPE_CHECKING:
    from ..layout import Group
    from ..plan import Plan


class Proposer(Protocol):
    """A lookup source: `name` (how its tokens count, `RowStats.by_source`) and `propose`."""

    name: str

    def propose(self, seq: list[int], max_drafts: int) -> tuple[str, list[int]] | None:
        """Up to `max_drafts` drafts to follow `seq` (prompt and reply so far) and the
        statistics key they count under (DraftStats: one per source and match length), or None."""
        ...


# The lookup sources, each built for a plan (None: not in this plan), in the order a row prefers them on a tie.
SOURCES: dict[str, Callable[[Plan], Proposer | None]] = {
    NgramLookup.name: lambda plan: NgramLookup(),
    DraftCorpus.name: lambda plan: plan.drafts.corpus,
}
LOOKUP = tuple(SOURCES)  # draft sources found by lookup, not proposed by the model


class GroupSource(Protocol):
    """An in-forward source: `name` (how its tokens count) and the groups it adds to a step."""

    name: str

    def count(self, plan: Plan) -> int:
        """The most groups a step of `plan` feeds (0: none); the cost-aware feed may narrow it."""
        ...

    def groups(self, rows, n_drafts, count: int, masks: int, mask_id: int) -> list[Group]:
        """Up to `count` groups for the step's rows (`n_drafts[r]` drafts fed by row r, a list), each
        with `masks` masks; ids of rows where a group is not live are `mask_id`."""
        ...


# The in-forward sources beside the masks, in the order their groups follow the window.
GROUP_SOURCES: dict[str, GroupSource] = {
    SpareGroups.name: SpareGroups(),
    Alternatives.name: Alternatives(),
    TreeDrafts.name: TreeDrafts(),
}
IN_FORWARD = (Masks.name, *GROUP_SOURCES)  # the model's own proposals, read from the verifying forward
MASKS, SPARE, ALT, TREE = Masks.name, SpareGroups.name, Alternatives.name, TreeDrafts.name
# How a report names each source's tokens.
LABELS = {s.name: s.label for s in (Masks, SpareGroups, NgramLookup, DraftCorpus, Alternatives, TreeDrafts)}


def lookup_sources(plan: Plan) -> list[Proposer]:
    """The lookup sources a plan drafts from, up to `plan.lookup_drafts` drafts a step each."""
    if not plan.lookup_drafts:
        return []
    return [p for p in (make(plan) for make in SOURCES.values()) if p is not None]
