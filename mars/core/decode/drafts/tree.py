"""Token trees from the masks' ranked guesses (Medusa's trees, docs/method.md §8): in-forward drafts
for when a draft of the chain fails, greedy or sampled (acceptance.tree_sampling).

The masks of a step rank the whole vocabulary at each slot; the chain of drafts is their first
guesses (or, sampled, their draws). A node leaves the chain after its first `anchor` drafts with
another of slot anchor + 1's guesses; its path's probability under the masks is the chain's first
`anchor` drafts' times the node's. The tree is the chain and the `budget` nodes of highest path
probability, one group each: anchored after its `anchor` drafts, the node as a real id (seeing its
ancestors alone), then masks. Where the chain fails at a node's place and AR's token there is the
node (sampled: the node passes the speculative rule), verification takes it and AR's token after it,
and the node's masks propose the next drafts. (Paths of two or more nodes off the chain kept fewer
tokens per forward here: a path AR confirms only in part leaves no proposals for the next step; the
masks after a node propose its continuation instead.)"""

from __future__ import annotations

import numpy as np

from ..layout import Group

# The ranked guesses per slot a tree draws on (the first is the chain's). 12 against 8 took the flat
# curve's default mode from 2.781 to 2.853 tokens per forward (benchmarks/README.md, "Token trees").
RANKS = 12


class TreeDrafts:
    """The tree source: per row, the paths off its chain (`paths`: the nodes `branches` chose), one group each."""

    name = "tree"
    label = "tree drafts"

    @staticmethod
    def count(plan) -> int:
        """The most tree nodes a step of the plan feeds (Plan.tree_nodes)."""
        return plan.tree_nodes

    def groups(self, rows, n_drafts: np.ndarray, count: int, masks: int, mask_id: int) -> list[Group]:
        if not count or not masks:
            return []
        # A path applies where it leaves the chain among the drafts fed (`paths`: off the chain fed), cut
        # to the row's room: its `a` drafts, AR's token and the path's tokens at most what it may still take.
        chosen = [
            [
                (a, prefix[: r.max_tokens - r.produced - 1 - a])
                for a, prefix, _ in r.paths[:count]
                if a < n_drafts[i] and a + 1 < r.max_tokens - r.produced
            ]
            if not r.done and n_drafts[i]
            else []
            for i, r in enumerate(rows)
        ]
        # One group per path, paths of one length side by side across rows (a shorter path padded with
        # masks would stop its match there and propose nothing).
        lengths = sorted({len(prefix) for row_paths in chosen for _, prefix in row_paths})
        out = []
        for length in lengths:
            of_length = [[(a, p) for a, p in row_paths if len(p) == length] for row_paths in chosen]
            for k in range(max(len(row_paths) for row_paths in of_length)):
                anchor = np.zeros(len(rows), dtype=np.int64)
                prefix = np.full((len(rows), length), mask_id, dtype=np.int64)
                live = np.zeros(len(rows), dtype=bool)
                for i, row_paths in enumerate(of_length):
                    if len(row_paths) > k:
                        anchor[i], prefix[i], live[i] = row_paths[k][0], row_paths[k][1], True
                out.append(Group(self.name, anchor, prefix, live, masks))
        return out


def row_paths(r, *, longest: int, single: bool, fed=()) -> list[tuple[int, list[int], float]]:
    """Row r's tree off the drafts it feeds (`paths`): its branches as paths from its last token (the
    chain they leave up to their anchor, then the node), less the single nodes in `fed` (ids the
    runner-up groups feed already)."""
    fed = {(t,) for t in fed}
    candidates = [(r.tree_chain[:a] + node, p) for a, node, p in r.branches]
    return paths(r.drafts, [c for c in candidates if tuple(c[0]) not in fed], longest=longest, single=single)


def paths(chain: list[int], candidates, *, longest: int, single: bool = False) -> list[tuple[int, list[int], float]]:
    """A row's tree as groups off the chain it feeds: `candidates` are paths from the row's last token
    with a weight (what each is expected to add; the masks' branches: their path probability). Each
    becomes (anchor, prefix, weight): anchored where it leaves `chain`, its tokens from there (at most
    `longest`), most weight first (ties: first given); a path the chain holds, or one met before, is
    left out. With `single` (sampled trees), only paths that leave the chain at their last token."""
    out: dict[tuple[int, tuple[int, ...]], tuple[float, int]] = {}
    for order, (path, weight) in enumerate(candidates):
        common = 0
        for x, y in zip(path, chain):
            if x != y:
                break
            common += 1
        if common >= len(path) or (single and common != len(path) - 1):
            continue
        key = (common, tuple(path[common : common + longest]))
        if key not in out or out[key][0] < weight:
            out[key] = (float(weight), out[key][1] if key in out else order)
    ranked = sorted(out.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
    return [(a, list(prefix), w) for (a, prefix), (w, _) in ranked]


def branches(top_ids: np.ndarray, top_logp: np.ndarray, budget: int, chain=None, chain_logp=None) -> list:
    """The tree's branches off the chain of drafts, as (anchor, [node], path probability), most probable
    first: `top_ids`, `top_logp` (n, k) the masks' k most likely ids per slot with their log-probabilities,
    most likely first; `budget` the most branches; `chain` (n,) the drafts (default: the first guesses,
    greedy's chain) with their log-probabilities `chain_logp` (a sampled chain's drafts need not be
    first guesses). A node is a guess at slot a + 1 other than the chain's draft there, its path's
    probability the chain's first `a` drafts' times the node's."""
    n, k = top_ids.shape
    if chain is None:
        chain, chain_logp = top_ids[:, 0], top_logp[:, 0]
    chain, chain_logp = np.asarray(chain)[:n], np.asarray(chain_logp, dtype=np.float64)[:n]
    if not budget or not n or len(chain) < n:
        return []
    path = np.concatenate([[0.0], np.cumsum(chain_logp)])[:n]  # the chain's first a drafts
    score = np.where(top_ids == chain[:, None], -np.inf, path[:, None] + top_logp)  # (n, k): anchor a, guess j
    flat = score.reshape(-1)
    order = [i for i in np.lexsort((np.arange(flat.size), -flat))[:budget] if np.isfinite(flat[i])]
    return [(int(i // k), [int(top_ids[i // k, i % k])], float(np.exp(flat[i]))) for i in order]
