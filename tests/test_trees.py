"""Token trees from the masks' ranked guesses (mars.core.decode.drafts.tree): the nodes chosen by path
probability, greedy lossless output identical to AR with trees on (both backends, the window and block
caches and none, batched rows), sampled lossless output distributed as AR sampling's (the speculative
rule over the tree, chi-square), the tree's tokens counted under its source, and the feed sizing the
tree from the cost curve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import PROMPTS, make_model, make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode.cost import CostCurve
from mars.core.decode.drafting import Drafting
from mars.core.decode.drafts import TREE
from mars.core.decode.drafts.tree import TreeDrafts, branches, paths
from mars.core.decode.feed import LosslessFeed
from mars.core.decode.loop import generate
from mars.core.decode.types import Row

MASK, EOS = 3, 2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def prompts_of(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def plan(**kw):
    return make_plan(**{"mask_id": MASK, "eos_ids": (EOS,), "block_size": 4, "max_tokens": 30, **kw})


def test_nodes_are_chosen_by_path_probability():
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    p = np.log(np.array([[0.5, 0.3, 0.2], [0.9, 0.06, 0.04], [0.6, 0.3, 0.1]]))
    got = branches(ids, p, 4)
    # Path probabilities: anchor 0: 0.3, 0.2; anchor 1: 0.5 * 0.06, 0.5 * 0.04; anchor 2: 0.45 * 0.3, 0.45 * 0.1.
    assert [(a, path) for a, path, _ in got] == [(0, [11]), (0, [12]), (2, [31]), (2, [32])]
    assert [round(q, 4) for _, _, q in got] == [0.3, 0.2, 0.135, 0.045]
    assert branches(ids, p, 0) == [] and len(branches(ids, p, 100)) == 6


def test_paths_join_the_tree_off_the_chain_fed():
    """Paths become groups off the chain fed: anchored where they leave it, their tokens from there (at
    most `longest`), most weight first; a path the chain holds, or one met before, is left out.
    Sampled trees take single nodes alone."""
    chain = [7, 8, 9]
    candidates = [
        ([7, 11], 0.4),  # a node at the chain's second slot
        ([7, 8, 5, 6, 4, 3, 2], 0.3),  # a path that leaves the chain after two drafts
        ([7, 8], 0.9),  # held by the chain
        ([7, 11], 0.1),  # met before, with less weight
        ([12, 13], 0.2),  # a node after a draft the chain does not share (the masks' chain, a lookup's fed)
    ]
    assert paths(chain, candidates, longest=4) == [(1, [11], 0.4), (2, [5, 6, 4, 3], 0.3), (0, [12, 13], 0.2)]
    assert paths(chain, candidates, longest=4, single=True) == [(1, [11], 0.4)]
    assert paths([], [([5], 0.5)], longest=4) == [(0, [5], 0.5)]


def test_the_drafting_tree_leaves_the_chain_fed_and_the_runner_up_groups_out():
    """On the window cache the tree is laid off the chain a row feeds: a node the runner-up groups feed
    already is left out, and where a lookup's chain leaves the masks' chain before a node's slot the
    node joins as a path of the masks' drafts from there (greedy) or not at all (sampled)."""
    row = Row([5, 6], 5, threshold=1.0, max_tokens=20)
    row.drafts = row.tree_chain = [7, 8, 9]
    row.branches = [(0, [11], 0.4), (0, [12], 0.3), (1, [13], 0.2)]
    Drafting(plan(lossless=True, tree=6, alternatives=2), None)._tree(row, [11])
    assert row.paths == [(0, [12], 0.3), (1, [13], 0.2)]
    row.drafts, row.branches = [7, 20], [(2, [14], 0.1), (1, [15], 0.05)]  # a lookup's chain fed
    Drafting(plan(lossless=True, tree=6), None)._tree(row, [])
    assert row.paths == [(1, [8, 14], 0.1), (1, [15], 0.05)]
    from mars.core.decode.plan import Sampling

    Drafting(plan(lossless=True, tree=6, sampling=Sampling(temperature=0.7, seed=0)), None)._tree(row, [])
    assert row.paths == [(1, [15], 0.05)]


def test_tree_groups_put_paths_of_one_length_side_by_side():
    """A group per path, rows' paths of one length together (a shorter path is never padded with
    masks), only paths that leave the chain among the drafts a row feeds."""
    a, b = (Row([1], 4, threshold=1.0, max_tokens=9) for _ in range(2))
    a.paths = [(0, [11], 0.5), (1, [12, 13], 0.4), (2, [14], 0.3)]
    b.paths = [(1, [21, 22], 0.6), (0, [23], 0.2), (3, [24], 0.1)]
    groups = TreeDrafts().groups([a, b], np.array([3, 3]), 3, 2, MASK)
    assert [g.prefix.shape[1] for g in groups] == [1, 1, 2]
    assert [g.masks for g in groups] == [2, 2, 2]
    one, two, pair = groups
    assert one.live.tolist() == [True, True] and one.anchor.tolist() == [0, 0]
    assert one.prefix.tolist() == [[11], [23]]
    assert two.live.tolist() == [True, False] and two.anchor[0] == 2 and two.prefix[0].tolist() == [14]
    assert pair.live.tolist() == [True, True] and pair.anchor.tolist() == [1, 1]
    assert pair.prefix.tolist() == [[12, 13], [21, 22]]  # b's anchor-3 node lies past its 3 drafts
    assert TreeDrafts().groups([a, b], np.array([3, 3]), 1, 2, MASK)[0].prefix.tolist() == [[11], [MASK]]
    assert TreeDrafts().groups([a, b], np.array([3, 3]), 2, 0, MASK) == []  # no masks: no groups
    # Near its max_tokens a row's path is cut to what it may still take: its drafts, AR's token, the path.
    c = Row([1], 4, threshold=1.0, max_tokens=3)
    c.paths = [(0, [31, 32, 33], 0.5), (2, [34], 0.4), (1, [35, 36], 0.3)]
    cut = TreeDrafts().groups([c], np.array([2]), 3, 2, MASK)
    assert [(g.anchor[0], g.prefix[0].tolist()) for g in cut] == [(1, [35]), (0, [31, 32])]


def test_branches_off_a_lookup_chain_keep_the_output_of_ar(tok, monkeypatch):
    """The default mode's sources with trees (n-gram drafts, runner-up groups, the masks' branches): on
    a flat curve the replies are AR's, and where a lookup's chain left the masks' chain before a
    branch's node, the branch joined as a path of several tokens, and one was confirmed whole."""
    from tiny import feed_of

    from mars.core.decode import verify

    dec = TorchDecoder(
        TorchModel(make_model("llama", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    )
    prompts = prompts_of(tok, PROMPTS)
    ar = generate(dec, prompts, plan(threshold=1.0, max_tokens=64)).tokens
    confirmed = []
    real = verify.matched

    def watched(group, i, kept, token, ar, **lists):
        m = real(group, i, kept, token, ar, **lists)
        if group.source == TREE and m >= 2 and m == group.prefix.shape[1]:
            confirmed.append(m)
        return m

    monkeypatch.setattr(verify, "matched", watched)
    flat = feed_of(CostCurve({1: 1.0, 256: 1.0}, refresh=0.0))
    got = generate(dec, prompts, plan(lossless=True, max_tokens=64, ngram=8, alternatives=2), controller=flat)
    assert got.tokens == ar
    assert confirmed, "no path of several tokens off the chain was confirmed: such paths went untested"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", ["window", "none", "block"])
def test_lossless_with_trees_equals_ar(tok, arch, cache):
    tm = TorchModel(make_model(arch, len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    prompts = prompts_of(tok, PROMPTS)
    ar = generate(TorchDecoder(tm), prompts, plan(threshold=1.0))
    taken = 0
    for tree in (2, 8, 24):
        for batch in (1, 4):
            out = []
            for start in range(0, len(prompts), batch):
                s = plan(lossless=True, tree=tree, cache=cache, hedge=1, alternatives=1)
                result = generate(TorchDecoder(tm), prompts[start : start + batch], s)
                out += result.tokens
                taken += result.stats.by_source().get(TREE, 0)
            assert out == ar.tokens, (tree, batch)
    assert taken > 0, "no tree node was taken: the tree's path went untested"


def test_mlx_lossless_with_trees_equals_ar(tok, tmp_path):
    pytest.importorskip("mlx_lm")
    from tiny import save_model

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load

    m = load(str(save_model(tmp_path / "m", "llama", seed=1)), announce=lambda s: None)
    prompts = prompts_of(m.tokenizer, PROMPTS[:4])
    ar = generate(MlxDecoder(m), prompts, plan(threshold=1.0))
    for cache in ("window", "block"):
        result = generate(MlxDecoder(m), prompts, plan(lossless=True, tree=8, cache=cache, block_cache=8))
        assert result.tokens == ar.tokens and result.stats.by_source().get(TREE, 0) > 0, cache


def test_the_feed_sizes_the_tree_from_the_cost_curve():
    """Flat costs: every node pays; steep costs: a node of small probability does not."""
    s = plan(lossless=True, tree=6)
    row = Row([5, 6], 5, threshold=1.0, max_tokens=20)
    row.drafts, row.source = [7, 8, 9], "masks"
    row.paths = [(0, [11], 0.4), (1, [12], 0.05), (2, [13], 0.01)]

    def nodes(points):
        drafting = Drafting(s, LosslessFeed(CostCurve(points, refresh=0.0), 4, 0))
        drafting._keys = ["masks"]
        return drafting._tree_nodes([row], 4, 0, 0, 1)

    assert nodes({1: 1.0, 64: 1.0}) == 3
    assert nodes({1: 1.0, 64: 64.0}) == 0
    assert 0 < nodes({1: 1.0, 8: 1.0, 13: 1.2, 64: 12.0}) < 3
    assert Drafting(s, None)._tree_nodes([row], 4, 0, 0, 1) == 6  # no curve: the plan's budget


@pytest.mark.parametrize("arch", ["llama"])
def test_auto_trees_are_sized_by_the_feed_and_keep_the_output_of_ar(tok, arch):
    """--tree auto (the default): lossless with a cost-aware feed feeds up to AUTO_TREE nodes, sized per
    step, where a node's group costs little on the curve (a flat curve: nodes taken, the replies AR's),
    none on a steep curve or with a fixed feed; other modes feed none."""
    from tiny import feed_of

    from mars.core.decode.cost import CostCurve
    from mars.core.decode.execution import execution
    from mars.core.decode.plan import AUTO_TREE

    dec = TorchDecoder(
        TorchModel(make_model(arch, len(tok), seed=3), tok, None, "", torch.device("cpu"), torch.float32)
    )
    prompts = prompts_of(tok, ["Hello there, how are you today?", "Count: 1 2 3 4 5 6 7 8"])
    ar = generate(dec, prompts, plan(threshold=1.0)).tokens
    auto = plan(lossless=True)
    assert auto.drafts.tree == "auto" and auto.tree_nodes == 0  # decided per run
    flat, steep = feed_of(CostCurve({1: 1.0, 64: 1.0})), feed_of(CostCurve({1: 1.0, 64: 64.0}))
    assert execution(auto, flat, 1).plan.tree_nodes == AUTO_TREE
    assert execution(auto, None, 1).plan.tree_nodes == 0  # no measured feed: the chain alone
    assert execution(auto, steep, 1).plan.tree_nodes == 0  # nodes' groups cost more than TREE_GROUP_COST each
    assert execution(plan(lossless=True, feed="fixed"), flat, 1).plan.tree_nodes == 0
    assert execution(plan(threshold=0.5, verify=True, force=True), flat, 1).plan.tree_nodes == 0
    wide = generate(dec, prompts, auto, controller=flat)
    assert wide.tokens == ar
    assert wide.stats.by_source().get("tree", 0) > 0, "no tree node was taken on a flat curve"
    narrow = generate(dec, prompts, auto, controller=steep)
    assert narrow.tokens == ar and narrow.stats.by_source().get("tree", 0) == 0


def test_the_trees_benchmark_reports_each_size_and_the_speed(tiny, tmp_path):
    import json

    from tiny import load_script

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    report = load_script("benchmarks/trees.py").main(
        ["--model", str(tiny), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "6", "--trees", "2,4"]
        + ["--speed-tree", "4", "--repeats", "1", "--sampled", "0.7", "--flat"]
    )
    rows = report["masks_only"]["test"]
    assert [r["tree"] for r in rows] == [0, 2, 4] and all(r["identical_to_ar"] == 2 for r in rows)
    sampled = report["masks_only"]["test, sampled (temperature 0.7)"]
    assert [r["tree"] for r in sampled] == [0, 2, 4] and all(r["tokens_per_forward"] >= 1 for r in sampled)
    speed = report["speed"]["rows"]
    assert [r["mode"] for r in speed] == ["ar", "default", "default, tree 0", "default, tree 4"]
    assert all(r["identical_to_ar"] == 2 and r["tok_s"] > 0 for r in speed)
    on_flat = report["flat_curve"]
    assert [r["mode"] for r in on_flat] == ["default (trees auto)", "default, tree 0"]
    assert all(r["identical_to_ar"] == 2 and r["tokens_per_forward"] >= 1 for r in on_flat)


# -- sampling over a tree: exact in distribution ------------------------------------------------


def test_the_tree_rule_on_exact_cases():
    """mars.core.acceptance.tree_sampling: a node is taken with its probability under what the chain's
    rejection left, tried in order, each one not taken removed from what is left; nodes not anchored
    where the chain failed, or not live, are not tried; a row where a node was taken tries no other."""
    from test_lossless import NumpyOps

    from mars.core.acceptance import tree_sampling

    dist = np.array([[0.5, 0.3, 0.2, 0.0]] * 4)
    nodes = np.array([[1, 0]] * 4)
    anchors = np.array([[0, 0], [0, 0], [1, 0], [0, 0]])
    live = np.array([[True, True], [True, True], [True, True], [False, True]])
    kept = np.zeros(4, dtype=np.int64)
    u = np.array([[0.29, 0.0], [0.31, 0.7], [0.0, 0.71], [0.0, 0.49]])
    chosen, left = tree_sampling(NumpyOps(), dist, kept, nodes, anchors, live, u)
    # row 0: node 1 taken (u 0.29 < 0.3); row 1: node 1 not, then node 0 under (0.5, 0, 0.2) / 0.7:
    # 0.714 > u 0.7, taken; row 2: node 0 is anchored at 1 (not tried), node 1 at 0: u 0.71 > 0.5, not taken;
    # row 3: node 0 not live, node 1 taken (0.49 < 0.5).
    assert chosen.tolist() == [0, 1, -1, 1]
    np.testing.assert_allclose(left[2], [0.0, 0.6, 0.4, 0.0])
    np.testing.assert_allclose(left[0], dist[0])
    # Over many draws the step's token keeps the distribution: P(node) = dist(node), the rest as dist.
    n = 200_000
    chosen, left = tree_sampling(
        NumpyOps(),
        np.repeat(dist[:1], n, 0),
        np.zeros(n, dtype=np.int64),
        np.repeat(nodes[:1], n, 0),
        np.zeros((n, 2), dtype=np.int64),
        np.ones((n, 2), dtype=bool),
        np.random.default_rng(0).random((n, 2)),
    )
    freq = (chosen < 0).mean() * left[chosen < 0][0]  # what is left is the same wherever no node was taken
    freq[nodes[0]] = [(chosen == j).mean() for j in range(2)]
    np.testing.assert_allclose(freq, dist[0], atol=0.005)


SAMPLED_N = 4000


@pytest.fixture(scope="module")
def sampler(tok):
    """test_lossless's sampling model (AR and masks differ), a prompt, and AR sampling's exact distribution."""
    from test_lossless import exact_distribution

    model = make_model("llama", len(tok), seed=3, scale=0.15)
    prompt = prompts_of(tok, ["Hi"])[0]
    tm = TorchModel(model, tok, None, "", torch.device("cpu"), torch.float32)
    return tm, prompt, exact_distribution(model, prompt)


def sampled_tree_counts(decoder, prompt, cache="window", tree=8, rows=500):
    from collections import Counter

    from test_lossless import N_TOKENS, SAMPLING, settings

    s = settings(lossless=True, max_tokens=N_TOKENS, cache=cache, block_size=3, sampling=SAMPLING, tree=tree)
    assert s.tree_nodes == tree
    counts, taken = Counter(), 0
    for _ in range(SAMPLED_N // rows):
        result = generate(decoder, [prompt] * rows, s)
        counts.update(tuple(t) for t in result.tokens)
        taken += result.stats.by_source().get(TREE, 0)
    return counts, taken


@pytest.mark.parametrize("cache", ["window", "none", "block"])
def test_sampled_lossless_with_trees_matches_ar_sampling(sampler, cache):
    """The speculative rule over a tree: samples follow AR sampling's distribution (chi-square), with
    tree nodes taken (the test model's masks and AR differ, so the chain is often rejected)."""
    from test_lossless import chi_square_p

    tm, prompt, expected = sampler
    counts, taken = sampled_tree_counts(TorchDecoder(tm), prompt, cache)
    assert taken > 100, "too few tree nodes taken: the tree's path went untested"
    assert chi_square_p(counts, expected, SAMPLED_N) > 1e-3


def always_take(ops, dist, kept, nodes, anchors, live, u):
    """A broken rule: a node tried is taken wherever it has any probability."""
    from mars.core.acceptance import tree_sampling

    return tree_sampling(ops, dist, kept, nodes, anchors, live, u * 0)


def never_remove(ops, dist, kept, nodes, anchors, live, u):
    """A subtly broken rule: a node not taken stays in the distribution the token is drawn from."""
    from mars.core.acceptance import tree_sampling

    return tree_sampling(ops, dist, kept, nodes, anchors, live, u)[0], dist


@pytest.mark.parametrize("broken", [always_take, never_remove])
def test_the_tree_sampling_test_fails_when_the_rule_is_broken(sampler, broken, monkeypatch):
    from test_lossless import chi_square_p

    import mars.backends.torch.decode as torch_decode

    tm, prompt, expected = sampler
    monkeypatch.setattr(torch_decode, "tree_sampling", broken)
    counts, _ = sampled_tree_counts(TorchDecoder(tm), prompt)
    assert chi_square_p(counts, expected, SAMPLED_N) < 1e-3


def test_mlx_sampled_lossless_with_trees_matches_ar_sampling(tmp_path):
    pytest.importorskip("mlx_lm")
    from test_lossless import chi_square_p, exact_distribution
    from tiny import save_model

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load
    from mars.backends.torch.load import load as torch_load

    path = save_model(tmp_path / "m", "llama", seed=3, scale=0.15)
    m = load(str(path), announce=lambda s: None)
    prompt = prompts_of(m.tokenizer, ["Hi"])[0]
    expected = exact_distribution(torch_load(str(path), announce=lambda s: None).model, prompt)
    counts, taken = sampled_tree_counts(MlxDecoder(m), prompt)
    assert taken > 100 and chi_square_p(counts, expected, SAMPLED_N) > 1e-3


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_sampled_trees_with_steps_that_feed_no_masks(tmp_path, backend):
    """On a steep cost curve most sampled steps feed AR's feed alone (no masks, so nothing to rank or
    branch from), a few probe with masks and tree nodes: both backends run it."""
    from test_lossless import SAMPLING, settings
    from tiny import feed_of, save_model

    path = str(save_model(tmp_path / "m", "llama", seed=3, scale=0.15))
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
        from mars.backends.mlx.decode import MlxDecoder
        from mars.backends.mlx.load import load

        model = load(path, announce=lambda s: None)
        decoder = MlxDecoder(model)
    else:
        from mars.backends.torch.load import load

        model = load(path, announce=lambda s: None)
        decoder = TorchDecoder(model)
    prompt = prompts_of(model.tokenizer, ["Hi"])[0]
    feed = feed_of(CostCurve({1: 1.0, 2: 2.0, 64: 64.0}, refresh=0.0), explore=1)
    s = settings(lossless=True, max_tokens=8, block_size=3, sampling=SAMPLING, tree=8, logprobs=1)
    result = generate(decoder, [prompt] * 20, s, controller=feed)
    (policy,) = feed.feeds.values()
    assert policy.choices.get((0, 0), 0) > 0 and any(m for m, _ in policy.choices)
    assert all(len(t) == len(lp) for t, lp in zip(result.tokens, result.logprobs))
