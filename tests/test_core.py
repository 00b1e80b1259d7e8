"""Backend-neutral core: the attention rule, alignment, acceptance, mars.json, mask-token choice."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_tokenizer

from mars.core.acceptance import accept_counts, confidence_from_logits, is_ar_mode, loosen
from mars.core.config import ConfigError, MarsConfig, read_config, write_config
from mars.core.loss import IGNORE, align, slots
from mars.core.masks import decode_mask, noisy_start, training_inputs, training_mask
from mars.core.tokens import NEW_MASK_TOKEN, choose_mask_token


def brute_force_mask(lengths, L, B):
    """docs/method.md §3 transcribed literally, one (row, query, key) at a time."""
    out = np.zeros((len(lengths), 2 * L, 2 * L), dtype=bool)
    for r, n in enumerate(lengths):
        for q in range(2 * L):
            for k in range(2 * L):
                q_clean, k_clean = q >= L, k >= L
                pq, pk = q - L * q_clean, k - L * k_clean
                if pq >= n:  # a padding query attends only to itself
                    out[r, q, k] = q == k
                    continue
                if pk >= n:  # padding is attended by no real query
                    continue
                bq, bk = pq // B, pk // B
                if q_clean and k_clean:
                    out[r, q, k] = pk <= pq
                elif not q_clean and not k_clean:
                    out[r, q, k] = bk == bq and pk <= pq
                elif not q_clean and k_clean:
                    out[r, q, k] = bk < bq
                else:
                    out[r, q, k] = False
    return out


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 5), blocks=st.integers(1, 4), data=st.data())
def test_training_mask_matches_the_rule(B, blocks, data):
    L = B * blocks
    lengths = data.draw(st.lists(st.integers(1, blocks).map(lambda b: b * B), min_size=1, max_size=3))
    np.testing.assert_array_equal(training_mask(lengths, L, B), brute_force_mask(lengths, L, B))


def test_training_mask_every_row_has_a_key_and_rejects_bad_lengths():
    m = training_mask([4, 8], 8, 4)
    assert m.any(axis=-1).all()
    with pytest.raises(ValueError):
        training_mask([4], 6, 4)
    with pytest.raises(ValueError):
        training_mask([12], 8, 4)


def test_training_inputs_streams_and_positions():
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    labels = np.array([[IGNORE, IGNORE, IGNORE, 8, 9, 10, 11, 12]])
    input_ids, positions, mask = training_inputs(ids, labels, [8], 4, mask_id=99)
    assert input_ids.tolist() == [[5, 6, 7, 99, 99, 99, 99, 99, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert positions.tolist() == [list(range(8)) * 2]
    assert mask.shape == (1, 16, 16)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 5), blocks=st.integers(1, 5), data=st.data())
def test_trimmed_noisy_stream_is_the_full_layout_less_unread_blocks(B, blocks, data):
    """Leaving out the noisy blocks before noisy_start keeps every kept query's keys, and the
    alignment points at the same (stream, position) outputs as in the full layout."""
    L = B * blocks
    rows = data.draw(st.lists(st.tuples(st.integers(1, blocks), st.integers(0, L)), min_size=1, max_size=3))
    lengths = [b * B for b, _ in rows]
    labels = np.full((len(rows), L), IGNORE)
    for r, (b, first) in enumerate(rows):
        labels[r, min(first, b * B) : b * B] = 7
    if not (labels[:, 1:] != IGNORE).any():
        assert noisy_start(labels, B) == 0
        return
    ids = np.arange(L)[None].repeat(len(rows), 0)
    start = noisy_start(labels, B)
    usable = labels != IGNORE
    usable[:, 0] = False
    first = min(int(np.argmax(r)) for r in usable if r.any())
    assert start % B == 0 and start <= first - 1 < start + B  # the block of the first prediction
    full_ids, full_pos, full_mask = training_inputs(ids, labels, lengths, B, mask_id=99)
    ids_t, pos_t, mask_t = training_inputs(ids, labels, lengths, B, mask_id=99, start=start)
    keep = np.r_[start:L, L : 2 * L]
    np.testing.assert_array_equal(ids_t, full_ids[:, keep])
    np.testing.assert_array_equal(pos_t, full_pos[:, keep])
    np.testing.assert_array_equal(mask_t, full_mask[:, keep][:, :, keep])
    # No kept query that carries a loss attends a left-out key.
    full, trimmed = align(labels), align(labels, start=start)
    dropped = np.r_[0:start]
    assert not full_mask[full.rows[:, None], full.noisy_index[:, None], dropped[None]].any()
    np.testing.assert_array_equal(keep[trimmed.noisy_index], full.noisy_index)
    np.testing.assert_array_equal(keep[trimmed.clean_index], full.clean_index)


def test_noisy_start_examples():
    labels = np.full((2, 12), IGNORE)
    labels[0, 9:] = 1  # predicted from position 8: block 2 of B = 4
    labels[1, 6:] = 1  # from position 5: block 1
    assert noisy_start(labels, 4) == 4
    assert noisy_start(labels[:1], 4) == 8
    assert noisy_start(labels[:1], 3) == 6
    labels[1, 1] = 1  # predicted from position 0
    assert noisy_start(labels, 4) == 0
    with pytest.raises(ValueError):
        training_mask([8], 8, 4, start=2)


def test_alignment_right_shift_and_row_mean():
    labels = np.array(
        [
            [IGNORE, IGNORE, 3, 4],
            [7, IGNORE, IGNORE, 9],  # position 0 is never a target
        ]
    )
    al = align(labels)
    assert al.rows.tolist() == [0, 0, 1]
    assert al.targets.tolist() == [3, 4, 9]
    assert al.noisy_index.tolist() == [1, 2, 2]  # output at t-1 in the noisy stream
    assert al.clean_index.tolist() == [5, 6, 6]  # L + t - 1 in the clean stream
    np.testing.assert_allclose(al.weights, [0.25, 0.25, 0.5])  # mean per row, then over rows
    np.testing.assert_allclose(align(labels, "token").weights, [1 / 3] * 3)
    with pytest.raises(ValueError):
        align(np.full((1, 4), IGNORE))


def test_slots_count_the_masks_a_query_has_fed_in_its_block():
    # B = 4. Row 0: a prompt of 6, then a response: positions 6.. are masked in the noisy stream.
    labels = np.full((2, 12), IGNORE)
    labels[0, 6:] = 1
    labels[1, 1:] = 1
    got = slots(labels, 4)
    # row 0, block 1 (positions 4-7): 4, 5 real, 6, 7 masks; block 2 all masks
    assert got[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 1, 2, 3, 4]
    assert got[1].tolist() == [0, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        slots(labels[:, :10], 4)


def test_slot_weights_trade_weight_between_slots_within_each_row():
    labels = np.full((2, 12), IGNORE)
    labels[0, 6:] = 5
    labels[1, 2:10] = 7
    plain = align(labels, block_size=4)
    assert plain.noisy_weights is plain.weights
    # the slot of each target is the slot of the query before it
    np.testing.assert_array_equal(plain.slots, slots(labels, 4)[plain.rows, np.r_[6:12, 2:10] - 1])
    same = align(labels, block_size=4, slot_weights=(1, 1, 1, 1))
    w = (1.0, 1.0, 3.0, 0.5)
    al = align(labels, block_size=4, slot_weights=w)
    for row in (0, 1):
        at = al.rows == row
        # each row's noisy total is its plain total
        assert al.noisy_weights[at].sum() == pytest.approx(plain.weights[at].sum(), rel=1e-6)
        # and inside the row, targets weigh as their slot's weight (slot 0, a real query: 1)
        scale = np.array([1.0, *w])[al.slots[at]]
        np.testing.assert_allclose(
            al.noisy_weights[at] / plain.weights[at],
            scale / scale[0] * (al.noisy_weights[at][0] / plain.weights[at][0]),
            rtol=1e-6,
        )
    # the slots of a query after a real token (slot 0) exist: row 1's first target follows the prompt
    assert 0 in al.slots.tolist()
    np.testing.assert_allclose(same.noisy_weights, plain.weights, rtol=1e-6)  # weights of 1 change nothing
    np.testing.assert_array_equal(al.weights, plain.weights)  # the clean stream keeps its weights
    for bad in ((1, 1), (1, 1, 1, -1), (0, 0, 0, 0), (1, 1, float("nan"), 1)):
        with pytest.raises(ValueError):
            align(labels, block_size=4, slot_weights=bad)
    with pytest.raises(ValueError):
        align(labels, slot_weights=w)  # the block size is needed


def test_decode_mask_holes_and_causality():
    valid = np.array([[False, True, True, True], [True, True, True, True]])
    m = decode_mask(valid, 2)
    assert m.shape == (2, 2, 4)
    assert m[0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert m[1].tolist() == [[True, True, True, False], [True, True, True, True]]
    hole_query = decode_mask(np.array([[True, False]]), 1)
    assert hole_query[0, 0].tolist() == [False, True]  # a hole attends only to itself


def test_confidence_metrics_reference():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    ids, p = confidence_from_logits(logits, "probability")
    assert ids.tolist() == [0, 0]
    np.testing.assert_allclose(p, [0.7, 0.4])
    _, m = confidence_from_logits(logits, "margin")
    np.testing.assert_allclose(m, [0.5, 0.05])
    _, h = confidence_from_logits(logits, "entropy")
    expect = [-(np.array(r) * np.log(r)).sum() for r in ([0.7, 0.2, 0.1], [0.4, 0.35, 0.25])]
    np.testing.assert_allclose(h, expect)


def test_prefix_acceptance():
    conf = np.array([[0.1, 0.95, 0.97, 0.5, 0.99], [0.2, 0.5, 0.99, 0.99, 0.99], [0.0, 0.99, 0.99, 0.99, 0.99]])
    # slot 0 always; then while every earlier slot passed
    assert accept_counts(conf, "probability", 0.9, [5, 5, 5]).tolist() == [3, 1, 5]
    assert accept_counts(conf, "probability", 0.9, [2, 5, 0]).tolist() == [2, 1, 0]
    # AR mode by rule: even a confidence of exactly 1.0 is not accepted at tau = 1
    ones = np.ones((1, 4))
    assert accept_counts(ones, "probability", 1.0, [4]).tolist() == [1]
    ent = np.array([[9.0, 0.1, 0.2, 3.0]])
    assert accept_counts(ent, "entropy", 0.5, [4]).tolist() == [3]
    assert accept_counts(ent, "entropy", 0.0, [4]).tolist() == [1]
    assert is_ar_mode("margin", 1.0) and not is_ar_mode("margin", 0.99)
    assert loosen("probability", 0.9, 0.1) < 0.9 and loosen("entropy", 0.5, 0.1) > 0.5


def test_mars_json_round_trip_and_validation(tmp_path):
    cfg = MarsConfig(block_size=8, mask_token="<m>", mask_token_id=4, base_model="x", default_threshold=0.9)
    write_config(cfg, tmp_path)
    assert read_config(tmp_path) == cfg
    assert not list(tmp_path.glob(".mars.*"))  # the temp file was renamed into place
    bad = dict(cfg.to_dict(), block_size=0)
    (tmp_path / "mars.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="block_size"):
        read_config(tmp_path)
    (tmp_path / "mars.json").write_text(json.dumps(dict(cfg.to_dict(), colour="red")))
    with pytest.raises(ConfigError, match="unknown field 'colour'"):
        read_config(tmp_path)
    (tmp_path / "mars.json").write_text(json.dumps(dict(cfg.to_dict(), metric="vibes")))
    with pytest.raises(ConfigError, match="metric"):
        read_config(tmp_path)
    (tmp_path / "mars.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "mars.json").write_text(json.dumps(dict(cfg.to_dict(), default_mode="fast")))
    with pytest.raises(ConfigError, match="default_mode"):
        read_config(tmp_path)
    # default_mode is optional: a mars.json written before it existed means threshold mode
    older = {k: v for k, v in cfg.to_dict().items() if k != "default_mode"}
    (tmp_path / "mars.json").write_text(json.dumps(older))
    assert read_config(tmp_path).default_mode == "threshold"
    write_config(dataclasses.replace(cfg, default_mode="lossless"), tmp_path)
    assert read_config(tmp_path).default_mode == "lossless"


def test_mask_token_choice():
    tok = make_tokenizer()
    token, token_id, added = choose_mask_token(tok)
    assert not added and token_id == tok.convert_tokens_to_ids(token)
    assert token_id not in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
    assert token not in tok.chat_template
    assert choose_mask_token(tok, exclude=[token_id])[1] != token_id
    # Only reserved / template tokens: a new token must be added.
    bare = make_tokenizer(with_unused=False)
    token, token_id, added = choose_mask_token(bare, exclude=[0])
    assert added and token == NEW_MASK_TOKEN and token_id == len(bare)
