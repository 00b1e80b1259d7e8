"""Lossless decoding in bfloat16 and float16 on the CPU (mars.backends.torch.attention, row-exact
attention): a row of a multi-token forward computes, bit for bit, what a one-token forward at
its place computes, so the verification of drafts reads AR's own predictions and lossless output
is greedy AR's token for token.

Bit-for-bit equality of logits does not depend on near-ties (equal logits give equal argmaxes),
so these tests hold on tiny random models without any margin. torch's own CPU attention kernel
fails them in these dtypes: it computes a row differently with more query rows or more keys in
the call (see the attention module's docstring).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import PROMPTS, make_model, make_plan, make_tokenizer

from mars.backends.torch import attention
from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.forward import additive_mask
from mars.backends.torch.load import TorchModel
from mars.core.decode.loop import generate
from mars.core.masks import decode_mask

MASK, EOS = 3, 2
REDUCED = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def decoder(tok, arch: str, dtype, seed: int = 1) -> TorchDecoder:
    model = make_model(arch, len(tok), seed=seed).to(dtype)
    return TorchDecoder(TorchModel(model, tok, None, "", torch.device("cpu"), dtype))


@torch.inference_mode()
def forward(dec: TorchDecoder, cache, ids, start: int) -> torch.Tensor:
    """The float32 logits of every fed position, as a decoding step reads them."""
    q = len(ids)
    return dec.logits(cache, np.asarray([ids]), np.arange(start, start + q)[None], None, np.arange(q)[None])[0]


@REDUCED
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # phi3: transformers' modules, the keyword path
def test_a_wide_forward_gives_each_row_what_a_one_token_forward_gives(tok, arch, dtype):
    # Context lengths on both sides of the key-padding blocks (64) and of the vector widths
    # (8, 16), feeds of 2 to 13 tokens (a lossless step's AR token, drafts and masks).
    dec = decoder(tok, arch, dtype)
    rng = np.random.default_rng(0)
    for context, width in [(5, 2), (13, 6), (37, 5), (58, 9), (61, 13), (120, 4), (130, 11)]:
        ids = [int(t) for t in rng.integers(5, len(tok), context + width)]
        cache = dec.new_cache(1)
        forward(dec, cache, ids[:context], 0)
        one = torch.stack([forward(dec, cache, [t], context + j)[0] for j, t in enumerate(ids[context:])])
        dec.crop(cache, context)
        wide = forward(dec, cache, ids[context:], context)
        assert torch.equal(wide, one), (context, width, (wide - one).abs().max().item())
        # The keys the wide forward left in the cache are those the one-token forwards left.
        after_wide = forward(dec, cache, ids[-1:], context + width)
        dec.crop(cache, context)
        for j, t in enumerate(ids[context:]):
            forward(dec, cache, [t], context + j)
        assert torch.equal(forward(dec, cache, ids[-1:], context + width), after_wide)


@REDUCED
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_lossless_equals_ar_in_reduced_precision(tok, arch, dtype):
    # AR one prompt at a time; AR in one batch (left padding); lossless alone and in batches,
    # whose rows keep different numbers of tokens a step (holes in the cache).
    dec = decoder(tok, arch, dtype)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS
    ]
    common = dict(mask_id=MASK, eos_ids=(EOS,), block_size=4, max_tokens=40, cache="window")
    ar = [generate(dec, [p], make_plan(threshold=1.0, **common)).tokens[0] for p in prompts]
    assert generate(dec, prompts, make_plan(threshold=1.0, **common)).tokens == ar
    # n-gram drafts beside the masks and spare groups; runner-up groups (whose output at the
    # runner-up is taken as AR's token).
    for batch, drafts in ((1, dict(ngram=4)), (3, dict(ngram=4)), (1, dict(alternatives=2)), (3, dict(alternatives=2))):
        out, kept, alt = [], 0, 0
        for start in range(0, len(prompts), batch):
            result = generate(dec, prompts[start : start + batch], make_plan(lossless=True, **drafts, **common))
            out += result.tokens
            kept += sum(result.stats.draft_totals()["kept_per_slot"])
            alt += result.stats.by_source().get("alt", 0)
        assert out == ar, (batch, drafts)
        assert kept > 0  # kept drafts are covered, not only AR steps
        assert alt > 0 or "alternatives" not in drafts  # and AR tokens read in a runner-up's group


@REDUCED
def test_row_exact_attention_is_attention(dtype):
    # Against float32 attention on the same (rounded) inputs: masks with holes, grouped query
    # heads, two batch rows, a float mask and a boolean one; within the dtype's rounding.
    torch.manual_seed(0)
    b, heads, kv_heads, q, n, dim = 2, 6, 2, 7, 75, 16
    query = torch.randn(b, heads, q, dim).to(dtype)
    key, value = torch.randn(b, kv_heads, n, dim).to(dtype), torch.randn(b, kv_heads, n, dim).to(dtype)
    valid = np.ones((b, n), dtype=bool)
    valid[1, :9] = False  # left padding
    valid[0, 40:44] = False  # a hole
    allowed = decode_mask(valid, q)
    fq, fk, fv = query.float(), key.float(), value.float()
    bool_mask = torch.from_numpy(allowed)[:, None]
    want = F.scaled_dot_product_attention(fq, fk, fv, attn_mask=bool_mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    tolerance = 4 * torch.finfo(dtype).eps
    real = torch.from_numpy(valid[:, -q:])
    some = np.zeros((b, q), dtype=bool)
    some[:, ::2] = True  # the other rows attend within the keys as they lie
    for mask in (additive_mask(allowed, dtype, "cpu"), bool_mask):
        for exact in (None, some):
            got = attention.row_exact_attention(query, key, value, mask, 0.3, exact_rows=exact)
            assert got.dtype == dtype and got.shape == (b, q, heads, dim)
            assert torch.allclose(got.float()[real], want[real], atol=tolerance, rtol=tolerance)
    # No mask: causal over the new rows (a prompt without a cache), or every key.
    causal = torch.ones(q, n, dtype=torch.bool).tril(n - q)
    want = F.scaled_dot_product_attention(fq, fk, fv, attn_mask=causal, scale=0.3, enable_gqa=True)
    got = attention.row_exact_attention(query, key, value, None, 0.3, causal=True)
    assert torch.allclose(got.float(), want.transpose(1, 2), atol=tolerance, rtol=tolerance)
    want = F.scaled_dot_product_attention(fq, fk, fv, scale=0.3, enable_gqa=True)
    got = attention.row_exact_attention(query, key, value, None, 0.3, causal=False)
    assert torch.allclose(got.float(), want.transpose(1, 2), atol=tolerance, rtol=tolerance)


def test_a_bias_is_left_to_the_plain_kernel():
    # A float mask with values other than 0 and "never" is a bias: the row-exact path declines.
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, 3, 8).to(torch.bfloat16) for _ in range(3))
    bias = torch.randn(1, 1, 3, 3).to(torch.bfloat16)
    assert attention.row_exact_attention(query, key, value, bias, None) is None


def test_float32_and_training_keep_the_plain_kernel(tok, monkeypatch):
    # Float32 decoding, and any forward that builds a graph, never take the row-exact path.
    calls = []
    monkeypatch.setattr(attention, "row_exact_attention", lambda *a, **k: calls.append(1))
    dec = decoder(tok, "llama", torch.float32)
    forward(dec, dec.new_cache(1), [5, 6, 7, 8], 0)
    bf16 = decoder(tok, "llama", torch.bfloat16)
    # gradients on: a training forward, row-exact attention asked all the same
    bf16.body(input_ids=torch.tensor([[5, 6, 7]]), **{attention.ROW_EXACT: (None, {})})
    assert calls == []
    forward(bf16, bf16.new_cache(1), [5, 6, 7, 8], 0)
    assert calls  # the decoder's bfloat16 forwards do take it
