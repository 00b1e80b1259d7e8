"""How each mode takes tokens from a step (docs/method.md §5, §8).

Threshold mode keeps the leading slots whose confidence passes each row's threshold.
Lossless mode verifies the drafts it fed against the AR predictions read before them (or
lets the backend's `speculate` do it when sampling), always takes one AR token after the
kept drafts, and picks the next drafts: the masks', a spare group's or none."""

from __future__ import annotations

import numpy as np

from .acceptance import accept_counts, ar_mode_rows
from .decode_types import DecodeSettings, Row, Sampling
from .feed import Feed


def accept_by_threshold(backend, cache, feed: Feed, mask, rows: list[Row], s: DecodeSettings) -> list[list[int]]:
    """Threshold step: per row, the leading slots the acceptance rule keeps at the row's own
    threshold (none for a waiting row)."""
    thresholds = np.asarray([r.threshold for r in rows], dtype=np.float64)
    # Greedy AR accepts slot 0 by rule: no confidence is needed (every row in AR mode, or no
    # mask fed this step), so none is computed.
    no_masks = ar_mode_rows(s.metric, thresholds).all() or feed.columns.masks == 0
    step_metric = None if no_masks and s.sampling.greedy else s.metric
    ids, conf = backend.step(cache, feed.ids, feed.positions, mask, feed.read, metric=step_metric, sampling=s.sampling,
                             valid=feed.valid)
    counts = accept_counts(conf, s.metric, thresholds, feed.limit)
    return [[int(t) for t in ids[i, : counts[i]]] for i in range(len(rows))]


def verify(backend, cache, feed: Feed, mask, sampling: Sampling) -> tuple[list[list[int]], list[tuple[str, list[int]]]]:
    """Lossless step: per row, the tokens it takes (kept drafts, then one AR token; none for
    a waiting row) and its next drafts, (source, ids): the masks' proposals if every draft
    passed, else those of the spare group after the last kept draft if there is one, else
    none. Sets `feed.kept`."""
    columns, width = feed.columns, feed.columns.draft_slots
    spare = None
    if sampling.greedy:
        ids, _ = backend.step(cache, feed.ids, feed.positions, mask, feed.read, metric=None, sampling=sampling, valid=feed.valid)
        ar, proposals = ids[:, columns.ar_reads], ids[:, columns.mask_reads]
        spare = ids[:, columns.spare_reads].reshape(len(ids), columns.spare_groups, columns.masks)
        same = (feed.drafts == ar[:, :width]) & (np.arange(width)[None, :] < feed.n_drafts[:, None])
        kept = np.cumprod(same, axis=1).sum(axis=1).astype(np.int64)
        token = ar[np.arange(len(ar)), kept]
    else:
        kept, token, proposals = backend.speculate(
            cache, feed.ids, feed.positions, mask, feed.read, feed.drafts, feed.n_drafts, sampling=sampling
        )
        kept = np.asarray(kept, dtype=np.int64)
    feed.kept = np.where(feed.limit > 0, kept, 0)
    accepted = [
        [int(t) for t in feed.drafts[i, : kept[i]]] + [int(token[i])] if feed.limit[i] > 0 else [] for i in range(len(kept))
    ]
    # The masks' proposals were conditioned on every draft: wrong once one failed.
    nxt = []
    for i in range(len(kept)):
        if kept[i] == feed.n_drafts[i]:
            nxt.append(("masks", [int(t) for t in proposals[i]]))
        elif spare is not None and kept[i] < columns.spare_groups:
            nxt.append(("spare", [int(t) for t in spare[i, kept[i]]]))
        else:
            nxt.append(("masks", []))
    return accepted, nxt


def count_drafts(r: Row, verified: int, kept: int, nxt: tuple[str, list[int]], masks: int) -> None:
    """Lossless bookkeeping, per draft slot: drafts fed, verified and kept, and the tokens
    taken per source; `nxt` (source, drafts) are the next step's (see `verify`), which the
    row takes on."""
    st = r.stats
    source, drafts = nxt
    width = max(masks, verified, len(drafts))
    for counts in ("drafted_per_slot", "verified_per_slot", "kept_per_slot"):
        row = getattr(st, counts)
        row.extend([0] * (width - len(row)))
    if kept:
        st.by_source[r.source] = st.by_source.get(r.source, 0) + kept
    st.by_source["ar"] = st.by_source.get("ar", 0) + 1
    r.source = source
    for j in range(verified):
        st.verified_per_slot[j] += 1
    for j in range(kept):
        st.kept_per_slot[j] += 1
    r.drafts = list(drafts)
    for j in range(len(r.drafts)):
        st.drafted_per_slot[j] += 1
