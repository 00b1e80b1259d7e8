"""Runner-up alternatives (docs/method.md §9, `--alternatives`): in-forward drafts for when the
first draft fails. Group k feeds the first draft's runner-up k at its position, then B masks, as a
plain window ending at the runner-up; where AR's token there is runner-up k, the step also takes
AR's token after it and the group's proposals become the next drafts."""

from __future__ import annotations

from ..layout import Group


class Alternatives:
    """The runner-up alternatives source: up to `count` groups, for rows that feed a draft."""

    name = "alt"
    label = "alternative groups"

    @staticmethod
    def count(plan) -> int:
        """The most alternative groups a step of the plan feeds (Plan.alternative_groups)."""
        return plan.alternative_groups

    def groups(self, rows, n_drafts, count: int, masks: int, mask_id: int) -> list[Group]:
        alts = [r.alts[:count] if k else [] for r, k in zip(rows, n_drafts)]
        zero = [0] * len(rows)  # (lists: the group makes arrays where asked for them)
        return [
            Group(
                self.name,
                zero,
                [[a[k] if k < len(a) else mask_id] for a in alts],
                [k < len(a) and not r.done for r, a in zip(rows, alts)],
                masks,
            )
            for k in range(max((len(a) for a in alts), default=0))
        ]
