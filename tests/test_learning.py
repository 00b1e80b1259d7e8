"""MARS fine-tuning really teaches a tiny model to emit several tokens per forward."""

import pytest

from mars.backends.torch.model import TorchDecoder
from mars.core.decoding import DecodeSettings, generate
from mars.core.tokens import encode_prompt
from tiny import spell_records, train_spelling


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tm, result = train_spelling(tmp_path_factory.mktemp("learn") / "out")
    return tm, tm.mars, result


def test_losses_fall(trained):
    _, _, result = trained
    first, last = result["history"][0], result["history"][-1]
    assert last["noisy"] < 0.5 * first["noisy"]
    assert last["clean"] < 0.5 * first["clean"]


def test_several_tokens_per_forward_at_the_same_output(trained):
    tm, mars, _ = trained
    dec = TorchDecoder(tm)
    prompts = [encode_prompt(tm.tokenizer, r["prompt"]) for r in spell_records()]
    common = dict(mask_id=mars.mask_token_id, eos_ids=tm.eos_ids, block_size=4, max_tokens=40)
    ar = generate(dec, prompts, DecodeSettings(threshold=1.0, **common))
    fast = generate(dec, prompts, DecodeSettings(threshold=0.9, **common))
    assert fast.tokens == ar.tokens
    assert fast.stats.tokens_per_forward > 2.0, fast.stats.tokens_per_forward
    assert ar.stats.tokens_per_forward == 1.0


@pytest.mark.parametrize("cache", ["window", "block"])
def test_lossless_keeps_trained_drafts_and_equals_ar(trained, cache):
    tm, mars, _ = trained
    dec = TorchDecoder(tm)
    prompts = [encode_prompt(tm.tokenizer, r["prompt"]) for r in spell_records()]
    common = dict(mask_id=mars.mask_token_id, eos_ids=tm.eos_ids, block_size=4, max_tokens=40, cache=cache, block_cache=8)
    ar = generate(dec, prompts, DecodeSettings(threshold=1.0, **common))
    for batch in (1, 8):
        out, kept, forwards = [], 0, 0
        for start in range(0, len(prompts), batch):
            res = generate(dec, prompts[start : start + batch], DecodeSettings(lossless=True, **common))
            out += res.tokens
            kept += sum(res.stats.draft_totals()["kept_per_slot"])
            forwards += res.stats.row_forwards
        assert out == ar.tokens
        # Drafts were really accepted: the verification path ran and paid off.
        assert kept > 0 and sum(map(len, out)) / forwards > 2.0, (kept, forwards)
