"""How each mode takes tokens from a step (docs/method.md §5, §8).

Threshold mode keeps the leading slots whose confidence passes each row's threshold.
Lossless mode verifies the drafts it fed against the AR predictions read before them (or
lets the backend's `speculate` do it when sampling), always takes one AR token after the
kept drafts, and picks the next drafts: the masks', a spare group's or none."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..acceptance import accept_counts, ar_mode_rows
from .types import Row
from .plan import DecodeSettings, Sampling
from .layout import Feed


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


@dataclass
class Verdict:
    """What a lossless step decided, per row (see `verify`)."""

    accepted: list[list[int]]  # the tokens it takes: kept drafts, one AR token (none for a waiting row)
    nxt: list[tuple[str, list[int]]]  # its next drafts, (source, ids)
    kept: np.ndarray  # (b,) drafts that passed verification
    alt_hit: np.ndarray  # (b,) the alternative group whose runner-up was AR's token (-1: none)
    next_alts: list[list[list[int]]]  # per next draft, its runners-up (greedy, runners-up asked for)
    conf: list | None = None  # with a metric: per row, the confidence of each next draft


def verify(backend, cache, feed: Feed, mask, sampling: Sampling, metric: str | None = None, runners_up: int = 0) -> Verdict:
    """Lossless step: per row, the tokens it takes (kept drafts, then one AR token; none for
    a waiting row) and its next drafts, (source, ids): the masks' proposals if every draft
    passed, else those of the spare group after the last kept draft if there is one, else
    none.

    With alternative groups fed (`feed.alts`): a row whose first draft was rejected and whose
    AR token there is one of its runners-up also takes the AR token its group read after it,
    and the group's proposals become its next drafts (`alt_hit`: which group, -1 none).
    With `runners_up` n (greedy) each row's next drafts come with the n runners-up of each
    (`next_alts`), for the next step's alternative groups.

    With `metric` (greedy only) also gives, per row, the confidence of each next draft
    (`conf`, see `take_confident`)."""
    columns, width = feed.columns, feed.columns.draft_slots
    b = len(feed.ids)
    spare = conf_masks = conf_spare = conf_alt = alt = second = None
    hit = np.full(b, -1, dtype=np.int64)
    if sampling.greedy:
        out = backend.step(cache, feed.ids, feed.positions, mask, feed.read, metric=metric, sampling=sampling, valid=feed.valid,
                           **({"runners_up": runners_up} if runners_up else {}))
        ids, conf = out[0], out[1]
        second = out[2] if runners_up else None
        ar, proposals = ids[:, columns.ar_reads], ids[:, columns.mask_reads]
        spare = ids[:, columns.spare_reads].reshape(b, columns.spare_groups, columns.masks)
        if metric is not None:
            conf = np.asarray(conf, dtype=np.float64)
            conf_masks = conf[:, columns.mask_reads]
            conf_spare = conf[:, columns.spare_reads].reshape(b, columns.spare_groups, columns.masks)
        same = (feed.drafts == ar[:, :width]) & (np.arange(width)[None, :] < feed.n_drafts[:, None])
        kept = np.cumprod(same, axis=1).sum(axis=1).astype(np.int64)
        token = ar[np.arange(b), kept]
        if feed.alts is not None:
            alt = ids[:, columns.alt_reads].reshape(b, columns.alt_groups, 1 + columns.masks)
            if metric is not None:
                conf_alt = conf[:, columns.alt_reads].reshape(b, columns.alt_groups, 1 + columns.masks)
            for i in range(b):
                if feed.limit[i] > 0 and kept[i] == 0 and feed.n_drafts[i] > 0:
                    found = np.flatnonzero(feed.alts[i, : feed.n_alts[i]] == token[i])
                    if found.size:
                        hit[i] = found[0]
    else:
        kept, token, proposals = backend.speculate(
            cache, feed.ids, feed.positions, mask, feed.read, feed.drafts, feed.n_drafts, sampling=sampling
        )
        kept = np.asarray(kept, dtype=np.int64)
    accepted = []
    for i in range(b):
        if feed.limit[i] <= 0:
            accepted.append([])
            continue
        took = [int(t) for t in feed.drafts[i, : kept[i]]] + [int(token[i])]
        if hit[i] >= 0:  # AR's token after the runner-up, read in its group: the group was AR's window there
            took.append(int(alt[i, hit[i], 0]))
        accepted.append(took)
    # The masks' proposals were conditioned on every draft: wrong once one failed.
    nxt, nxt_conf, nxt_alts = [], [], []
    for i in range(b):
        if hit[i] >= 0:
            nxt.append(("alt", [int(t) for t in alt[i, hit[i], 1:]]))
            nxt_conf.append(None if conf_alt is None else conf_alt[i, hit[i], 1:])
            read = columns.alt_reads.start + hit[i] * (1 + columns.masks) + 1
        elif kept[i] == feed.n_drafts[i]:
            nxt.append(("masks", [int(t) for t in proposals[i]]))
            nxt_conf.append(None if conf_masks is None else conf_masks[i])
            read = columns.mask_reads.start
        elif spare is not None and kept[i] < columns.spare_groups:
            nxt.append(("spare", [int(t) for t in spare[i, kept[i]]]))
            nxt_conf.append(None if conf_spare is None else conf_spare[i, kept[i]])
            read = columns.spare_reads.start + kept[i] * columns.masks
        else:
            nxt.append(("masks", []))
            nxt_conf.append(None)
            read = None
        n = len(nxt[-1][1])  # per next draft, its runners-up (their reads follow one another)
        nxt_alts.append([[int(t) for t in second[i, read + j]] for j in range(n)] if second is not None and read is not None else [])
    return Verdict(accepted, nxt, np.where(feed.limit > 0, kept, 0), hit, nxt_alts, nxt_conf if metric is not None else None)


def take_confident(accepted: list[list[int]], nxt: list[tuple[str, list[int]]], conf, rows: list[Row], metric: str) -> list[int]:
    """Verified threshold mode (docs/method.md §9): after a lossless step, each row also takes
    the leading next drafts whose confidence passes its threshold, unverified, as threshold
    mode takes leading masks (the same rule, `accept_counts`, the step's tokens standing in
    for its slot 0), within what is left of its max_tokens; the drafts after them stay
    drafts, verified next step. A row in AR mode takes none, so at threshold 1.0 the output
    is lossless mode's, AR's. Updates `accepted` and `nxt` in place; returns how many each
    row took so."""
    width = max((len(d) for _, d in nxt), default=0)
    slots = np.full((len(rows), 1 + width), np.nan)  # NaN passes no threshold: rows with fewer drafts stop there
    for i, (_, drafts) in enumerate(nxt):
        if drafts:
            slots[i, 1 : 1 + len(drafts)] = conf[i][: len(drafts)]
    # A row that took nothing (finished, or waiting) takes no more: limit 0.
    limits = [r.max_tokens - r.produced - len(accepted[i]) + 1 if accepted[i] else 0 for i, r in enumerate(rows)]
    counts = accept_counts(slots, metric, np.asarray([r.threshold for r in rows], dtype=np.float64), np.maximum(limits, 0))
    taken = [max(int(c) - 1, 0) for c in counts]
    for i, c in enumerate(taken):
        if c:
            source, drafts = nxt[i]
            accepted[i] = accepted[i] + drafts[:c]
            nxt[i] = (source, drafts[c:])
    return taken


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
