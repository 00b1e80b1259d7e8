"""The masks' own drafts (docs/method.md §5, §8): the B masks after a row's drafts, the window's own
columns rather than a group; conditioned on every draft, they propose where every draft was kept."""

from __future__ import annotations


class Masks:
    name = "masks"
    label = "mask drafts"

    @staticmethod
    def count(plan) -> int:
        """The masks a step of the plan feeds (Plan.masks_per_step)."""
        return plan.masks_per_step

    @staticmethod
    def reads(columns) -> slice:
        """The output slots of the masks' proposals (mars.core.decode.layout.Columns.mask_reads)."""
        return columns.mask_reads
