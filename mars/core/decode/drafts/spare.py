"""Spare mask groups (docs/method.md §9, `--hedge`): in-forward drafts for when a draft fails.

Spare group g sits after a row's g-th draft (group 0 right after its last verified token),
B masks that see only what precedes them. When draft g + 1 is the first one rejected, the
step still takes AR's token there, which group g's first mask stood for, and the group's
proposals (conditioned on verified tokens only) become the next drafts instead of none."""

from __future__ import annotations

import numpy as np

from ..layout import Group


class SpareGroups:
    """The spare groups source: up to `count` groups, no more than the most drafts a row
    feeds (a spare group follows a draft), and only where masks are fed."""

    name = "spare"
    label = "spare-group drafts"

    @staticmethod
    def count(plan) -> int:
        """The most spare groups a step of the plan feeds (DecodeSettings.spare_groups)."""
        return plan.spare_groups

    def groups(self, rows, n_drafts: np.ndarray, count: int, masks: int, mask_id: int) -> list[Group]:
        count = min(count, int(n_drafts.max(initial=0))) if masks else 0
        running = np.asarray([not r.done for r in rows], dtype=bool)
        empty = np.zeros((len(rows), 0), dtype=np.int64)
        return [Group(self.name, np.full(len(rows), g, dtype=np.int64), empty, (g < n_drafts) & running, masks) for g in range(count)]
