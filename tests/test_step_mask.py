"""A step's attention mask as few numbers (mars.core.masks.StepMask): the host's dense mask equals
the rule it states, a layout's groups give the mask they are meant to see, padding changes nothing
for the real columns, and the devices build it bit for bit as the host does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import make_model

from mars.backends.torch import models
from mars.backends.torch.forward import body_and_head, model_windows, window_cut
from mars.core.decode.layout import Columns, Group, Layout, layout_mask, with_groups
from mars.core.masks import StepMask, decode_mask


def rule(m: StepMask, batch: int) -> np.ndarray:
    """The mask StepMask's docstring states, one query and key at a time."""
    c, q = m.cached, m.width
    out = np.zeros((batch, q, c + q), dtype=bool)
    for r in range(batch):
        for j in range(q):
            for k in range(c + q):
                real = m.keys is None or (m.keys[r, c + j] and m.keys[r, k])
                col = k - c
                view = m.see is None or col <= m.see[r, j] or col >= m.start[r, j]
                out[r, j, k] = (real and k <= c + j and view) or k == c + j
    return out


def as_tensor(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def random_masks(seed: int, count: int = 30):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        b, c, q = int(rng.integers(1, 4)), int(rng.integers(0, 7)), int(rng.integers(1, 7))
        keys = rng.random((b, c + q)) < 0.8 if rng.random() < 0.7 else None
        see = start = None
        if rng.random() < 0.7:
            see = rng.integers(0, q, (b, q))
            start = rng.integers(0, np.arange(1, q + 1), (b, q))  # start <= j: a query sees itself
        yield b, StepMask(c, q, keys, see, start)


def test_the_dense_mask_is_the_rule_it_states():
    for b, m in random_masks(0):
        assert np.array_equal(m.dense(b), rule(m, b))
    # Without holes or groups: plain causal over the cache, as decode_mask makes it.
    assert np.array_equal(StepMask(3, 4).dense(2), decode_mask(np.ones((2, 7), dtype=bool), 4))
    keys = np.array([[True, False, True, True, False, True]])
    assert np.array_equal(StepMask(3, 3, keys).dense(), decode_mask(keys, 3))


def test_a_layouts_groups_see_the_chain_up_to_their_anchor_and_their_own_block():
    rng = np.random.default_rng(1)
    for _ in range(40):
        b, w0, c = int(rng.integers(1, 4)), int(rng.integers(3, 7)), int(rng.integers(0, 5))
        n = rng.integers(0, 3, b)
        last = w0 - 2 - n  # one mask after each row's drafts
        groups = tuple(
            Group(
                "spare", rng.integers(0, 3, b), rng.integers(4, 9, (b, int(rng.integers(0, 2)))), rng.random(b) < 0.7, 1
            )
            for _ in range(int(rng.integers(1, 4)))
        )
        groups = tuple(Group(g.source, np.minimum(g.anchor, n), g.prefix, g.live, g.masks) for g in groups)
        columns = Columns(
            last=last, n_drafts=n, draft_slots=int(n.max()), masks=1, width=w0, keep=w0 - 1, groups=groups
        )
        ids = rng.integers(4, 9, (b, w0))
        valid = rng.random((b, w0)) < 0.9
        positions = np.cumsum(valid, axis=1)
        wide_ids, wide_valid, wide_pos, see, start = with_groups(ids, valid, positions, columns, 3)
        layout = Layout(wide_ids, wide_pos, wide_valid, np.ones(b), columns, see=see, start=start)
        keys = np.concatenate([rng.random((b, c)) < 0.8, wide_valid], axis=1)
        # What each fed column may see among the fed ones, group by group, as the layout means it.
        width = columns.total
        attend = np.tril(np.ones((width, width), dtype=bool))[None].repeat(b, 0)
        attend[:, w0:] = False
        for k, g in enumerate(groups):
            cols = columns.group_columns(k)
            for r in range(b):
                anchor = last[r] + g.anchor[r]
                for x, col in enumerate(cols):
                    attend[r, col, : anchor + 1] = True
                    attend[r, col, cols[: x + 1]] = True
        want = decode_mask(keys, width)
        want[:, :, c:] &= attend
        assert np.array_equal(layout_mask(keys, layout).dense(b), want)


def test_a_layouts_values_read_as_lists_and_as_arrays_alike():
    """A layout's, a group's and the columns' values, given as lists or as arrays, read the same
    either way (`lists`, the attributes), without making an array to say whether one was given; a
    StepMask whose views are lists is the one whose views are arrays."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        b, w, p = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(0, 3))
        values = dict(
            ids=rng.integers(0, 9, (b, w)),
            positions=rng.integers(0, 9, (b, w)),
            valid=rng.random((b, w)) < 0.7,
            limit=rng.integers(0, 3, b),
            drafts=rng.integers(0, 9, (b, int(rng.integers(0, 3)))),
            see=rng.integers(0, w, (b, w)),
            start=rng.integers(0, w, (b, w)),
        )
        n = rng.integers(0, 3, b)
        group = dict(anchor=rng.integers(0, 3, b), prefix=rng.integers(0, 9, (b, p)), live=rng.random(b) < 0.5)
        made = []
        for given in (lambda a: a, lambda a: a.tolist()):
            g = Group("spare", *(given(group[k]) for k in ("anchor", "prefix", "live")), 1)
            columns = Columns(given(n + 1), given(n), int(n.max()), 1, w, w - 1, (g,))
            v = {k: given(a) for k, a in values.items()}
            layout = Layout(
                v["ids"], v["positions"], v["valid"], v["limit"], columns, v["drafts"], v["see"], v["start"]
            )
            # given lists, no array is made to say whether a value was given, nor to read it as lists
            assert layout.given("drafts") and layout.lists("drafts") is not None
            assert (layout._arrays["drafts"] is None) == isinstance(v["drafts"], list)
            assert (layout.batch, layout.width) == (b, w) and g.prefix_width == p and g.width == p + 1
            made.append((layout, g, columns))
        for (one, g1, c1), (two, g2, c2) in zip(made, made[1:]):
            for k, a in values.items():
                assert one.lists(k) == two.lists(k) == a.tolist(), k
                assert getattr(two, k).dtype == a.dtype and np.array_equal(getattr(two, k), a), k
            for k, a in group.items():
                assert g1.lists(k) == g2.lists(k) == a.tolist() and np.array_equal(getattr(g2, k), a), k
            assert c1.lists("n_drafts") == c2.lists("n_drafts") == n.tolist()
            assert np.array_equal(two.read, one.read) and two.lists("read") == one.read.tolist()
            assert two.lists("n_drafts") == n.tolist() and np.array_equal(two.n_drafts, n)
        keys = rng.random((b, 2 + w)) < 0.8
        as_lists = StepMask(2, w, keys, values["see"].tolist(), values["start"].tolist())
        assert np.array_equal(as_lists.dense(b), StepMask(2, w, keys, values["see"], values["start"]).dense(b))
        assert np.array_equal(
            as_lists.padded(w + 2, b).dense(b),
            StepMask(2, w, keys, values["see"], values["start"]).padded(w + 2, b).dense(b),
        )
    empty = Layout([[1]], [[0]], [[True]], [1], Columns([0], [0], 0, 0, 1, 1))
    assert not empty.given("drafts") and empty.lists("n_drafts") is None and empty.n_drafts is None
    assert not empty._arrays.get("drafts") and empty.lists("see") is None


def test_padding_leaves_the_real_columns_their_mask_and_makes_holes():
    for b, m in random_masks(2):
        wide = m.padded(m.width + 3, b).dense(b)
        c, q = m.cached, m.width
        assert np.array_equal(wide[:, :q, : c + q], m.dense(b))
        assert not wide[:, :q, c + q :].any()  # nobody sees a hole
        for j in range(q, q + 3):  # a hole sees itself alone
            assert np.array_equal(np.flatnonzero(wide[0, j]), [c + j])


@pytest.mark.parametrize("window", [None, 3])
@torch.inference_mode()  # the cache's buffers are inference tensors
def test_the_torch_forward_builds_the_hosts_mask(window):
    model = make_model("mistral" if window else "llama", 64, seed=4, window=window)
    body, head = body_and_head(model)
    lean = models.build(body, head, model_windows(model))
    rng = np.random.default_rng(3)
    for b, m in random_masks(4):
        cache = models.KVCache(lean.args, b, 16, torch.float32, torch.device("cpu"))
        cache.length = m.cached
        key_positions = rng.integers(0, 12, (b, m.cached + m.width))
        if window:
            cache.positions[:b, : m.cached] = torch.from_numpy(key_positions[:, : m.cached])
        positions = key_positions[:, m.cached :]
        inputs = models.StepInputs(
            ids=torch.zeros(b * m.width, dtype=torch.long),
            positions=torch.from_numpy(positions),
            reads=torch.zeros(1, dtype=torch.long),
            batch=b,
            width=m.width,
            keys=as_tensor(m.keys),
            see=as_tensor(m.see),
            start=as_tensor(m.start),
        )
        full, sliding = lean.attention_masks(cache, inputs)
        dense = m.dense(b)
        cut = window_cut(dense, positions, key_positions, model_windows(model))
        for built, host in zip((full, sliding), cut):
            assert built.shape == (b, 1, m.width, m.cached + m.width)
            assert torch.equal(built[:, 0] == 0, torch.from_numpy(host))
            assert torch.equal(
                built[:, 0][~torch.from_numpy(host)], torch.full((int((~host).sum()),), torch.finfo(torch.float32).min)
            )


def test_mlx_builds_the_hosts_mask():
    mx = pytest.importorskip("mlx.core")
    from mars.backends.mlx.forward import step_mask

    for b, m in random_masks(5):
        sent = [None if a is None else mx.array(a) for a in (m.keys, m.see, m.start)]
        built = np.array(step_mask(m.cached, m.width, b, *sent))
        assert np.array_equal(built, m.dense(b))


@torch.inference_mode()
def test_the_cached_keys_positions_follow_the_cache_rows_columns_and_growth():
    model = make_model("mistral", 64, seed=4, window=3)
    body, head = body_and_head(model)
    lean = models.build(body, head, model_windows(model))
    cache = models.KVCache(lean.args, 3, 8, torch.float32, torch.device("cpu"))
    cache.positions.copy_(torch.arange(24).view(3, 8))
    cache.length = 6
    before = cache.positions.clone()
    cache.keep_rows(torch.tensor([2, 0, 0, 1]))
    assert torch.equal(cache.positions[:4, :6], before[[2, 0, 0, 1], :6])
    cache.keep_columns(torch.tensor([0, 3, 5]))
    assert torch.equal(cache.positions[:4, :3], before[[2, 0, 0, 1]][:, [0, 3, 5]])
    kept = cache.positions[:4, :3].clone()
    cache.reserve(20, 4)  # past the capacity: new buffers, the cached part copied
    assert cache.capacity >= 23 and torch.equal(cache.positions[:4, :3], kept)


def _read_by_arrays(c: Columns) -> np.ndarray:
    """Columns.read as array formulas (the reference its plain-list build must give)."""
    top = c.width - 1
    ar = c.last[:, None] + np.minimum(np.arange(c.draft_slots + 1)[None, :], c.n_drafts[:, None])
    mk = np.minimum(c.first_mask[:, None] + np.arange(c.masks)[None, :], top)
    read = np.clip(np.concatenate([ar, mk], axis=1), 0, top)
    groups = c.width + np.arange(c.total - c.width)
    return np.concatenate([read, np.broadcast_to(groups, (len(read), groups.size))], axis=1)


def _groups_by_arrays(ids, valid, positions, c: Columns, mask_id: int):
    """with_groups as array operations, one group at a time (the reference)."""
    b, w0 = ids.shape
    out_ids = np.concatenate([ids, np.full((b, c.total - w0), mask_id)], axis=1)
    out_valid = np.concatenate([valid, np.zeros((b, c.total - w0), dtype=bool)], axis=1)
    out_pos = np.concatenate([positions, np.zeros((b, c.total - w0), dtype=np.int64)], axis=1)
    see = np.tile(np.arange(c.total), (b, 1))
    start = see.copy()
    for k, g in enumerate(c.groups):
        first = c.width + c.group_start(k)
        cols = slice(first, first + g.width)
        anchor = c.last + g.anchor
        out_ids[:, first : first + g.prefix.shape[1]] = np.where(g.live[:, None], g.prefix, mask_id)
        out_valid[:, cols] = g.live[:, None]
        after = positions[np.arange(b), anchor][:, None] + 1 + np.arange(g.width)[None, :]
        out_pos[:, cols] = np.where(g.live[:, None], after, 0)
        see[:, cols], start[:, cols] = anchor[:, None], first
    return out_ids, out_valid, out_pos, see, start


def test_the_layouts_plain_list_builds_give_the_array_formulas():
    """The window feed, the drafts' padding, the reads and the groups' columns, built row by row in
    plain Python, equal their array formulas in values, shapes and dtypes, over random layouts."""
    from mars.core.decode.layout import consecutive_positions, pad_drafts, window_feed

    rng = np.random.default_rng(0)
    mask_id = 99
    for _ in range(400):
        b = int(rng.integers(1, 5))
        parts = [rng.integers(0, 50, int(rng.integers(0, 7))).tolist() for _ in range(b)]
        n_masks = rng.integers(0, 4, b).tolist()
        width = max(len(p) + m for p, m in zip(parts, n_masks)) + int(rng.integers(1, 3))
        first = rng.integers(0, 20, b).tolist()
        ids, valid, positions = window_feed(parts, width, mask_id, n_masks, first)
        assert (ids.dtype, valid.dtype, positions.dtype) == (np.int64, np.bool_, np.int64)
        for r, (p, m) in enumerate(zip(parts, n_masks)):
            holes = width - len(p) - m
            assert ids[r].tolist() == [mask_id] * holes + p + [mask_id] * m
            assert valid[r].tolist() == [False] * holes + [True] * (len(p) + m)
        assert (positions == consecutive_positions(valid, first)).all()
        drafts = [rng.integers(0, 50, int(rng.integers(0, 4))).tolist() for _ in range(b)]
        padded, n = pad_drafts(drafts, mask_id)
        assert padded.shape == (b, max(len(d) for d in drafts)) and n.tolist() == [len(d) for d in drafts]
        assert all(
            padded[r, : len(d)].tolist() == d and (padded[r, len(d) :] == mask_id).all() for r, d in enumerate(drafts)
        )
        last = rng.integers(0, width, b)
        groups = tuple(
            Group(
                "x",
                np.minimum(rng.integers(0, 3, b), width - 1 - last),
                rng.integers(0, 50, (b, p)),
                rng.random(b) < 0.6,
                int(rng.integers(1, 3)),
            )
            for p in rng.integers(0, 3, int(rng.integers(0, 4)))
        )
        n_drafts = rng.integers(0, 3, b)
        c = Columns(
            last, n_drafts, int(n_drafts.max()) + int(rng.integers(0, 2)), int(rng.integers(0, 3)), width, width, groups
        )
        got = c.read()
        assert got.dtype == np.int64 and got.shape == _read_by_arrays(c).shape and (got == _read_by_arrays(c)).all()
        for got, want in zip(
            with_groups(ids, valid, positions, c, mask_id), _groups_by_arrays(ids, valid, positions, c, mask_id)
        ):
            assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all()


def test_a_layouts_holes_and_the_mask_decided_without_keys_are_the_keys():
    """WindowStrategy.lay_out says whether any fed column is a hole (`Layout.holes`: rows of other
    lengths, groups not live in a row), and the mask it decides without the keys where there is
    none (`mask`) is `layout_mask` over them: random rows, drafts and groups, cached or not."""
    import random

    from tiny import make_plan

    from mars.core.decode.drafts import ALT, SPARE
    from mars.core.decode.strategies import WindowStrategy
    from mars.core.decode.types import Row

    rng = random.Random(0)
    plan = make_plan(mask_id=99, eos_ids=(2,), block_size=3, max_tokens=64, lossless=True, tree=0, hedge=2)
    seen = set()
    for _ in range(400):
        rows = []
        for _ in range(rng.randint(1, 3)):
            r = Row([rng.randrange(5, 50) for _ in range(rng.randint(1, 5))], 4, threshold=1.0, max_tokens=64)
            r.cached = rng.randint(0, len(r.seq) - 1)
            r.drafts = [rng.randrange(5, 50) for _ in range(rng.randint(0, 3))]
            r.alts = [rng.randrange(5, 50) for _ in range(rng.randint(0, 2))]
            rows.append(r)
        strategy = WindowStrategy(plan, cached=rng.random() < 0.5)
        strategy.masks = rng.randint(0, 3)
        strategy.group_counts.update({SPARE: rng.randint(0, 2), ALT: rng.randint(0, 2)})
        layout = strategy.lay_out(rows)
        assert layout.holes == (not layout.valid.all())
        got, want = strategy.mask(layout), layout_mask(strategy.keys(layout), layout)
        if want is None:
            assert got is None
        else:
            assert (got.cached, got.width) == (want.cached, want.width)
            for a, b in ((got.keys, want.keys), (got.see, want.see), (got.start, want.start)):
                assert (a is None and b is None) or np.array_equal(a, b)
        groups = layout.columns.groups
        seen.add((layout.holes, bool(groups) and not all(g.live.all() for g in groups), len(rows) == 1))
    # Steps with and without holes, holes from groups alone among them, and rows alone.
    assert {(False, False, True), (True, True, False), (False, False, False)} <= seen, seen
