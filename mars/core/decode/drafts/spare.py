"""Spare mask groups (docs/method.md §9, `--hedge`): in-forward drafts for when a draft fails. Group
g, B masks after a row's g-th draft seeing only what precedes them, proposes the next drafts where
draft g + 1 is the first rejected (conditioned on verified tokens only), instead of none."""

from __future__ import annotations

from ..layout import Group


class SpareGroups:
    """The spare groups source: at most one group per draft fed, and none without masks."""

    name = "spare"
    label = "spare-group drafts"

    @staticmethod
    def count(plan) -> int:
        """The most spare groups a step of the plan feeds (Plan.spare_groups)."""
        return plan.spare_groups

    def groups(self, rows, n_drafts, count: int, masks: int, mask_id: int) -> list[Group]:
        count = min(count, max(n_drafts, default=0)) if masks else 0
        b = len(rows)
        empty = [[]] * b  # (lists: the group makes arrays where asked for them)
        return [
            Group(self.name, [g] * b, empty, [g < k and not r.done for r, k in zip(rows, n_drafts)], masks)
            for g in range(count)
        ]
