"""Runner-up alternatives (docs/method.md §9, `--alternatives`): in-forward drafts for when the
first draft fails.

A row's first draft came with its runners-up (the next most likely tokens where it was
proposed). Alternative group k feeds runner-up k at the first draft's position, then B masks,
seeing only the verified tokens before it: a plain window ending at the runner-up. When the
first draft is rejected and AR's token there is runner-up k, the step also takes AR's token
after it (read at the runner-up) and the group's proposals become the next drafts."""

from __future__ import annotations

import numpy as np

from ..layout import Group, pad_drafts


class Alternatives:
    """The runner-up alternatives source: up to `count` groups, for rows that feed a draft."""

    name = "alt"
    label = "alternative groups"

    @staticmethod
    def count(plan) -> int:
        """The most alternative groups a step of the plan feeds (DecodeSettings.alternative_groups)."""
        return plan.alternative_groups

    def groups(self, rows, n_drafts: np.ndarray, count: int, masks: int, mask_id: int) -> list[Group]:
        alts = [r.alts[:count] if n else [] for r, n in zip(rows, n_drafts)]
        ids, n = pad_drafts(alts, mask_id)
        running = np.asarray([not r.done for r in rows], dtype=bool)
        zero = np.zeros(len(rows), dtype=np.int64)
        return [Group(self.name, zero, ids[:, k : k + 1], (k < n) & running, masks) for k in range(ids.shape[1])]
