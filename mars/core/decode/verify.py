"""How each mode takes tokens from a step (docs/method.md §5, §8, §9): threshold mode keeps the
leading slots whose confidence passes each row's threshold; a plan that verifies drafts keeps each
draft while it equals AR's prediction before it (or passes speculative sampling), always takes one
AR token after them, and picks the next drafts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..acceptance import accept_counts, ar_mode_rows
from .drafts import MASKS, TREE
from .drafts.masks import Masks
from .layout import Layout
from .plan import Plan, Sampling
from .types import Row, SampledTree, TokenLogprob


def step(backend, cache, layout: Layout, mask, **options):
    """One backend step over a step's layout (StepBackend.step): its ids, positions, reads and holes
    (none marked where the layout knows it has none), as lists of rows to a backend that `takes_rows`
    (what the host made them as), else as arrays."""
    if getattr(backend, "takes_rows", False):
        v = layout.lists
        valid = None if layout.holes is False else v("valid")
        return backend.step(cache, v("ids"), v("positions"), mask, v("read"), valid=valid, **options)
    valid = None if layout.holes is False else layout.valid
    return backend.step(cache, layout.ids, layout.positions, mask, layout.read, valid=valid, **options)


def accept_by_threshold(
    backend, cache, layout: Layout, mask, rows: list[Row], s: Plan
) -> tuple[list[list[int]], list[list[TokenLogprob]] | None]:
    """Threshold step: per row, the leading slots kept at the row's own threshold (none if it waits),
    and with the plan's `logprobs` each one's under the distribution it was read from (slot 0 the
    model's next-token distribution, a mask's its own)."""
    thresholds = np.asarray([r.threshold for r in rows], dtype=np.float64)
    # Greedy AR accepts slot 0 by rule: without masks to judge, no confidence is computed.
    no_masks = ar_mode_rows(s.metric, thresholds).all() or layout.columns.masks == 0
    step_metric = None if no_masks and s.sampling.greedy else s.metric
    asked = {"logprobs": s.logprobs} if s.logprobs is not None else {}
    out = step(backend, cache, layout, mask, metric=step_metric, sampling=s.sampling, **asked)
    counts = accept_counts(out.conf, s.metric, thresholds, layout.limit)
    accepted = [[int(t) for t in out.ids[i, : counts[i]]] for i in range(len(rows))]
    if s.logprobs is None:
        return accepted, None
    lp = out.logprobs
    return accepted, [[lp.entry(i, j) for j in range(counts[i])] for i in range(len(rows))]


@dataclass
class Verdict:
    """What a step that verifies drafts decided, per row (see `verify`)."""

    accepted: list[list[int]]  # the tokens it takes: kept drafts, one AR token (none for a waiting row)
    nxt: list[tuple[str, list[int]]]  # its next drafts, (source, ids)
    kept: list[int]  # per row, drafts that passed verification
    group: list[int]  # per row, the group (index into layout.columns.groups) whose proposals follow (-1: none)
    next_alts: list[list[list[int]]]  # per next draft, its runners-up (greedy, runners-up asked for)
    conf: list | None = None  # with a metric: per row, the confidence of each next draft
    # With logprobs asked for: per row, each accepted token's (under the model's distribution where the
    # forward verified or computed it), and each next draft's (under the distribution that proposed it).
    logprobs: list[list[TokenLogprob]] | None = None
    next_logprobs: list[list[TokenLogprob]] | None = None
    # With ranks asked for: per row, (ids, log-probabilities), each (next drafts, k), most likely first, and
    # the next drafts' own log-probabilities (next drafts,).
    next_top: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    matched: list[int] | None = None  # per row, prefix tokens AR confirmed in `group` (greedy)


def matched(group, i: int, kept: int, token: int, ar: list[int], *, fields: tuple) -> int:
    """How many of group `group`'s prefix tokens AR confirmed for row i, -1 where the group does not
    apply: it must be live there and anchored after the `kept` drafts kept; its first prefix token
    must be AR's token after them, and each next one AR's token after the one before (`ar`: AR's
    predictions read at the group's prefix columns). `fields`: the group's (live, anchor, prefix) as
    lists, made once for every row."""
    live, anchor, prefix = fields
    if not live[i] or anchor[i] != kept:
        return -1
    own = prefix[i]
    if not own:
        return 0
    if own[0] != token:
        return -1
    m = 1
    while m < len(own) and own[m] == ar[m - 1]:
        m += 1
    return m


def sampled_tree(layout: Layout) -> SampledTree | None:
    """A sampled step's tree nodes, from its groups (None where it feeds none): where drafts are sampled,
    tree nodes are the only groups."""
    groups = layout.columns.groups
    if not groups:
        return None
    if any(g.source != TREE or g.prefix.shape[1] != 1 for g in groups):
        raise ValueError("a sampled step feeds tree nodes alone, one id each (no other draft groups)")
    return SampledTree(
        nodes=np.stack([g.prefix[:, 0] for g in groups], axis=1),
        anchors=np.stack([g.anchor for g in groups], axis=1),
        live=np.stack([g.live for g in groups], axis=1),
        masks=groups[0].masks,
    )


def verify(
    backend,
    cache,
    layout: Layout,
    mask,
    sampling: Sampling,
    metric: str | None = None,
    runners_up: int = 0,
    logprobs: int | None = None,
    ranks: int = 0,
) -> Verdict:
    """A step that verifies drafts: per row, the tokens it takes (kept drafts, then one AR token; none
    for a waiting row) and its next drafts, (source, ids).

    Greedy: where every draft was kept the masks after them propose; otherwise the `matched` group
    that takes the most does (a whole prefix counting a token more, since its masks propose next; a
    part of one proposes nothing), a confirmed prefix also adding AR's token after it (read at the
    prefix, where the group was AR's own window); else there are no next drafts. Sampling: the
    backend's `speculate` verifies (the chain, then any tree nodes where it failed), and the masks after
    every draft kept, or those of the node taken, propose. Greedy, `runners_up` n adds each next
    draft's n runners-up (`next_alts`) and `metric` their confidences (`conf`); `logprobs` n keeps
    log-probabilities with n most likely ids (`logprobs`, `next_logprobs`); `ranks` k keeps each next
    draft's k most likely ids with their log-probabilities, and its own (`next_top`, for trees)."""
    columns, width = layout.columns, layout.columns.draft_slots
    b = layout.batch
    # The step's few values as plain lists: a row's verdict is a few comparisons.
    limit, n_drafts, drafts = layout.lists("limit"), layout.lists("n_drafts"), layout.lists("drafts")
    chosen, matches = [-1] * b, [0] * b  # the group whose proposals follow, and its prefix tokens AR confirmed
    conf = second = ids = lp = None
    wanted = max(logprobs or 0, ranks if sampling.greedy else 0)
    asked = {"logprobs": wanted} if logprobs is not None or wanted else {}
    if sampling.greedy:
        if runners_up:  # wanted at the next drafts' reads alone: the masks' and the groups'
            asked["runners_up"], asked["runners_up_from"] = runners_up, columns.mask_reads.start
        out = step(backend, cache, layout, mask, metric=metric, sampling=sampling, **asked)
        ids, lp = out.ids.tolist(), out.logprobs
        second = out.runners_up.tolist() if out.runners_up is not None else None
        conf = np.asarray(out.conf, dtype=np.float64) if metric is not None else None
        reads = Masks.reads(columns)
        proposals = [row[reads] for row in ids]
        kept, token = [], []
        for i in range(b):  # drafts kept while each equals AR's token before it (AR's reads come first)
            row, own, k = ids[i], drafts[i], 0
            while k < n_drafts[i] and own[k] == row[k]:
                k += 1
            kept.append(k)
            token.append(row[k])
        fields = None
        for i in range(b):
            if limit[i] <= 0 or kept[i] == n_drafts[i]:
                continue  # waiting, or every draft kept: the masks after them propose
            if fields is None:
                fields = [(g.lists("live"), g.lists("anchor"), g.lists("prefix")) for g in columns.groups]
            fits = []
            for k, g in enumerate(columns.groups):
                start = columns.group_reads(k).start
                p = g.prefix_width
                m = matched(g, i, kept[i], token[i], ar=ids[i][start : start + p], fields=fields[k])
                if m >= 0:  # a whole prefix also has its masks propose: worth about a token more
                    full = m == p
                    fits.append((m + full, full, m, -k))
            if fits:
                best = max(fits)
                chosen[i], matches[i] = -best[3], best[2]
    else:
        tree = sampled_tree(layout)
        asked = {"logprobs": logprobs} if logprobs is not None else {}
        if ranks:
            asked["ranks"] = ranks
        if tree is not None:
            asked["tree"] = tree
        out = backend.speculate(
            cache,
            layout.ids,
            layout.positions,
            mask,
            layout.read,
            layout.drafts,
            layout.n_drafts,
            sampling=sampling,
            **asked,
        )
        token, proposals = np.asarray(out.token).tolist(), np.asarray(out.proposals).tolist()
        kept = np.asarray(out.kept, dtype=np.int64).tolist()
        if tree is not None:  # a node taken: it is the token, `after` the token drawn after it
            # Node k is group k (a sampled step's groups are its tree's nodes alone).
            chosen, after = np.asarray(out.node, dtype=np.int64).tolist(), np.asarray(out.after).tolist()
            matches = [int(c >= 0) for c in chosen]
        lp, ranked = out.logprobs, out.ranks
    accepted, nxt, nxt_conf, nxt_alts, nxt_top = [], [], [], [], []
    took_lp, nxt_lp = ([], []) if logprobs is not None else (None, None)
    trim = (lambda e: replace(e, top=e.top[:logprobs])) if logprobs is not None and logprobs < wanted else (lambda e: e)
    for i in range(b):
        reads: list[int] = []  # the reads of the tokens row i takes
        if limit[i] <= 0:
            accepted.append([])
        else:
            took = drafts[i][: kept[i]] + [token[i]]
            reads = list(range(kept[i] + 1))
            if chosen[i] >= 0 and not sampling.greedy:  # the node taken, then the token drawn at its read
                took.append(after[i])
                reads.append(width + 1)
            elif chosen[i] >= 0:  # AR's tokens after the confirmed prefix, read in the group: AR's window there
                start, m = columns.group_reads(chosen[i]).start, matches[i]
                took += ids[i][start : start + m]
                reads += list(range(start, start + m))
            accepted.append(took)
        # The masks' proposals were conditioned on every draft: wrong once one failed.
        if chosen[i] >= 0 and not sampling.greedy:  # the taken node's masks drew them
            nxt.append((columns.groups[chosen[i]].source, list(proposals[i])))
            nxt_conf.append(None)
            read = None  # drawn on the device, not read here
        elif chosen[i] >= 0 and matches[i] == columns.groups[chosen[i]].prefix_width:
            group = columns.groups[chosen[i]]
            read = columns.group_reads(chosen[i]).start + group.prefix_width
            nxt.append((group.source, ids[i][read : read + group.masks]))
            nxt_conf.append(None if conf is None else conf[i, read : read + group.masks])
        elif kept[i] == n_drafts[i]:
            nxt.append((MASKS, list(proposals[i])))
            nxt_conf.append(None if conf is None else conf[i, columns.mask_reads])
            read = columns.mask_reads.start
        else:
            nxt.append((MASKS, []))
            nxt_conf.append(None)
            read = None
        n = len(nxt[-1][1])  # per next draft, its runners-up (their reads follow one another)
        if logprobs is not None:
            took_lp.append([trim(lp.entry(i, j)) for j in reads])
            # A sampled step's next drafts were drawn from the masks' tempered distributions: none kept here.
            nxt_lp.append(
                [trim(lp.entry(i, read + j)) for j in range(n)] if read is not None and sampling.greedy else []
            )
        if ranks and sampling.greedy:
            rows_at = [read + j for j in range(n)] if read is not None else []
            nxt_top.append((lp.top_ids[i, rows_at, :ranks], lp.top[i, rows_at, :ranks], lp.chosen[i, rows_at]))
        elif ranks:
            nxt_top.append((ranked.top_ids[i, :n], ranked.top[i, :n], ranked.chosen[i, :n]))
        nxt_alts.append(second[i][read : read + n] if second is not None and read is not None else [])
    return Verdict(
        accepted,
        nxt,
        [k if lim > 0 else 0 for k, lim in zip(kept, limit)],
        chosen,
        nxt_alts,
        nxt_conf if metric is not None else None,
        took_lp,
        nxt_lp,
        nxt_top if ranks else None,
        matches,
    )


def take_confident(
    accepted: list[list[int]], nxt: list[tuple[str, list[int]]], conf, rows: list[Row], metric: str, verdict=None
) -> list[int]:
    """Verified threshold mode (docs/method.md §9): after a lossless step each row also takes,
    unverified, the leading next drafts whose confidence passes its threshold (`accept_counts`, the
    step's tokens as slot 0), within its max_tokens; the rest stay drafts. A row in AR mode takes
    none, so at threshold 1.0 the output is AR's. Updates `accepted` and `nxt` in place (and `verdict`'s
    log-probabilities, when given and kept); returns how many each row took."""
    width = max((len(d) for _, d in nxt), default=0)
    slots = np.full((len(rows), 1 + width), np.nan)  # NaN passes no threshold: rows with fewer drafts stop there
    for i, (_, drafts) in enumerate(nxt):
        if drafts:
            slots[i, 1 : 1 + len(drafts)] = conf[i][: len(drafts)]
    # A row that took nothing (finished, or waiting) takes no more: limit 0.
    limits = [r.max_tokens - r.produced - len(accepted[i]) + 1 if accepted[i] else 0 for i, r in enumerate(rows)]
    counts = accept_counts(
        slots, metric, np.asarray([r.threshold for r in rows], dtype=np.float64), np.maximum(limits, 0)
    )
    taken = [max(int(c) - 1, 0) for c in counts]
    for i, c in enumerate(taken):
        if c:
            source, drafts = nxt[i]
            accepted[i] = accepted[i] + drafts[:c]
            nxt[i] = (source, drafts[c:])
            if verdict is not None and verdict.logprobs is not None:
                verdict.logprobs[i] = verdict.logprobs[i] + verdict.next_logprobs[i][:c]
                verdict.next_logprobs[i] = verdict.next_logprobs[i][c:]
    return taken


def count_drafts(r: Row, verified: int, kept: int, nxt: tuple[str, list[int]], masks: int) -> None:
    """Lossless bookkeeping: drafts fed, verified and kept per slot, and tokens per source; the row
    takes on `nxt`, the next step's (source, drafts)."""
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
