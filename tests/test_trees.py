"""Token trees from the masks' ranked guesses (mars.core.decode.drafts.tree): the nodes chosen by path
probability, greedy lossless output identical to AR with trees on (both backends, window cache and
none, batched rows), the tree's tokens counted under its source, and the feed sizing the tree from
the cost curve."""

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
from mars.core.decode.drafts.tree import branches
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", ["window", "none"])
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
    result = generate(MlxDecoder(m), prompts, plan(lossless=True, tree=8))
    assert result.tokens == ar.tokens and result.stats.by_source().get(TREE, 0) > 0


def test_the_feed_sizes_the_tree_from_the_cost_curve():
    """Flat costs: every node pays; steep costs: a node of small probability does not."""
    s = plan(lossless=True, tree=6)
    row = Row([5, 6], 5, threshold=1.0, max_tokens=20)
    row.drafts, row.source = [7, 8, 9], "masks"
    row.branches = [(0, [11], 0.4), (1, [12], 0.05), (2, [13], 0.01)]

    def nodes(points):
        drafting = Drafting(s, LosslessFeed(CostCurve(points, refresh=0.0), 4, 0))
        drafting._keys = ["masks"]
        return drafting._tree_nodes([row], 4, 0, 0, 1)

    assert nodes({1: 1.0, 64: 1.0}) == 3
    assert nodes({1: 1.0, 64: 64.0}) == 0
    assert 0 < nodes({1: 1.0, 8: 1.0, 13: 1.2, 64: 12.0}) < 3
    assert Drafting(s, None)._tree_nodes([row], 4, 0, 0, 1) == 6  # no curve: the plan's budget


def test_the_trees_benchmark_reports_each_size_and_the_speed(tiny, tmp_path):
    import json

    from tiny import load_script

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    report = load_script("benchmarks/trees.py").main(
        ["--model", str(tiny), "--prompts", str(prompts), "--limit", "2", "--max-tokens", "6", "--trees", "2,4"]
        + ["--speed-tree", "4", "--repeats", "1"]
    )
    rows = report["masks_only"]["test"]
    assert [r["tree"] for r in rows] == [0, 2, 4] and all(r["identical_to_ar"] == 2 for r in rows)
    speed = report["speed"]["rows"]
    assert [r["mode"] for r in speed] == ["ar", "default", "default, tree 4"]
    assert all(r["identical_to_ar"] == 2 and r["tok_s"] > 0 for r in speed)
