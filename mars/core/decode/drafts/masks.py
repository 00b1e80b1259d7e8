"""The masks' own drafts (docs/method.md §5, §8): the B masks after a row's drafts.

They are the window's own columns (mars.core.decode.layout.Columns: after the drafts, read
at `mask_reads`), not a group: every step of a plan below AR mode feeds them. Their
proposals, conditioned on every draft the row fed, become the next drafts where every draft
was kept (mars.core.decode.verify)."""

from __future__ import annotations

NAME = "masks"
