"""The CPU fast paths of the torch decoder: packed linear weights for multi-token forwards
and grouped-query attention without copied keys. Both must leave what the model computes
as it was (the packed product up to float rounding, the attention bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mars.backends.torch import packed
from mars.backends.torch.attention import NAME, use_grouped_sdpa
from mars.backends.torch.model import TorchDecoder, TorchModel, additive_mask
from mars.core.masks import decode_mask
from tiny import make_model, make_tokenizer

pytestmark = pytest.mark.skipif(not packed.can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch build")


def test_packed_linear_matches_f_linear_and_falls_back_when_the_weight_changes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    block = torch.nn.Sequential(layer)
    assert packed.pack_linears(block) == 1
    one = torch.randn(1, 48)
    with torch.no_grad(), packed.active():
        assert torch.equal(layer(one), F.linear(one, layer.weight, layer.bias))  # one row (an AR step): F.linear itself
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(2, rows, 48)
        with torch.no_grad(), packed.active():
            got, want = layer(x), F.linear(x, layer.weight, layer.bias)
        if rows * 2 < packed.MIN_ROWS:
            assert torch.equal(got, want)  # few rows: F.linear itself
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(8, 48)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # outside the decoder's steps: F.linear
    with torch.no_grad(), packed.active():
        layer.weight.mul_(2.0)  # trained or edited after packing: the stale pack is not used
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad(), packed.active(), packed.disabled():
        packed.pack_linears(block)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    packed.unpack_linears(block)
    assert "forward" not in layer.__dict__ and not hasattr(layer, "_mars_packed")


def test_the_packed_path_runs_for_wide_feeds(monkeypatch):
    import types

    rows_seen = []

    def spy(x, w, b=None):
        rows_seen.append(x.numel() // x.shape[-1])
        return F.linear(x, w, b)

    monkeypatch.setattr(packed, "F", types.SimpleNamespace(linear=spy))
    layer = torch.nn.Linear(16, 16)
    packed.pack_linears(layer)
    with torch.no_grad():
        layer(torch.randn(5, 16))  # outside the decoder's steps
        with packed.active():
            layer(torch.randn(1, 16))
            layer(torch.randn(6, 16))  # the packed product: F.linear is not called
            with packed.disabled():
                layer(torch.randn(7, 16))
    assert rows_seen == [5, 1, 7]


def test_grouped_attention_is_bit_identical_to_sdpa_with_a_mask():
    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=3)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    ids = torch.randint(5, len(tok), (2, 12))
    valid = np.ones((2, 12), dtype=bool)
    valid[1, :3] = False  # holes: a real mask
    mask = additive_mask(decode_mask(valid, 12), torch.float32, "cpu")
    pos = torch.from_numpy(np.where(valid, np.cumsum(valid, 1) - 1, 0))
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        assert use_grouped_sdpa(model) and model.config._attn_implementation == NAME
        got = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_the_decoder_turns_both_on_for_the_cpu():
    tok = make_tokenizer()
    tm = TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    assert dec.packed > 0 and dec.grouped
    assert dec.cost_key()["packed"] is True
    plain = TorchDecoder(TorchModel(make_model("qwen2", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32), pack=False)
    assert plain.packed == 0
