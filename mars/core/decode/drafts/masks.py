"""The masks' own drafts (docs/method.md §5, §8): the B masks after a row's drafts.

They are the window's own columns (mars.core.decode.layout.Columns, read at `mask_reads`), not
a group: every step of a plan below AR mode feeds them. Their proposals, conditioned on every
draft the row fed, become the next drafts where every draft was kept (mars.core.decode.verify)."""

from __future__ import annotations


class Masks:
    """The masks source: B masks a step below AR mode feeds after each row's drafts."""

    name = "masks"
    label = "mask drafts"

    @staticmethod
    def count(plan) -> int:
        """The masks a step of the plan feeds (DecodeSettings.masks_per_step)."""
        return plan.masks_per_step

    @staticmethod
    def reads(columns) -> slice:
        """The output slots of the masks' proposals (mars.core.decode.layout.Columns.mask_reads)."""
        return columns.mask_reads
