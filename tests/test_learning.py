"""MARS fine-tuning really teaches a tiny model to emit several tokens per forward."""

import pytest
from tiny import load_script, make_plan, spell_records, train_spelling

from mars.backends.torch.decode import TorchDecoder
from mars.core.decode.loop import generate
from mars.core.tokens import encode_prompt


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
    ar = generate(dec, prompts, make_plan(threshold=1.0, **common))
    fast = generate(dec, prompts, make_plan(threshold=0.9, **common))
    assert fast.tokens == ar.tokens
    assert fast.stats.tokens_per_forward > 2.0, fast.stats.tokens_per_forward
    assert ar.stats.tokens_per_forward == 1.0


@pytest.mark.parametrize("cache", ["window", "block"])
def test_lossless_keeps_trained_drafts_and_equals_ar(trained, cache):
    tm, mars, _ = trained
    dec = TorchDecoder(tm)
    prompts = [encode_prompt(tm.tokenizer, r["prompt"]) for r in spell_records()]
    common = dict(
        mask_id=mars.mask_token_id, eos_ids=tm.eos_ids, block_size=4, max_tokens=40, cache=cache, block_cache=8
    )
    ar = generate(dec, prompts, make_plan(threshold=1.0, **common))
    for batch in (1, 8):
        out, kept, forwards = [], 0, 0
        for start in range(0, len(prompts), batch):
            res = generate(dec, prompts[start : start + batch], make_plan(lossless=True, **common))
            out += res.tokens
            kept += sum(res.stats.draft_totals()["kept_per_slot"])
            forwards += res.stats.row_forwards
        assert out == ar.tokens
        # Drafts were really accepted: the verification path ran and paid off.
        assert kept > 0 and sum(map(len, out)) / forwards > 2.0, (kept, forwards)


def test_slot_precision_reads_the_decoding_window(trained):
    """benchmarks/slot_precision.py's slots are the decoding window's: at each block start t, the
    model fed the true text before t plus B masks (plain causal attention) predicts the same
    tokens with the same probabilities; its reference is the model's own AR prediction."""
    import numpy as np
    import torch

    from mars.core.train.data import Example, encode_record, pad_to_block
    from mars.evaluate import response_labels
    from mars.session import Session

    tm, mars, _ = trained
    sp = load_script("benchmarks/slot_precision.py")
    em = Session.from_loaded(tm, TorchDecoder, label="tiny")
    tok, B = tm.tokenizer, mars.block_size
    for rec in spell_records()[:3]:
        ids, labels = encode_record(rec, tok, eos_id=tok.eos_token_id)
        ids, labels = pad_to_block(ids, labels, B, tok.eos_token_id, ended=True)
        confs, pred, ref = sp.slot_records(em, [Example(ids, labels, "spell", False)], metrics=sp.METRICS)
        prob = confs["probability"]
        labels = response_labels(labels[None], tok.eos_token_id)[0]  # the reply's first EOS is its last label
        starts = [t for t in range(B, len(ids), B) if labels[t] != -100]
        assert len(starts) == len(prob) > 0
        with torch.no_grad():
            full = tm.model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)
            for k, t in enumerate(starts):
                window = torch.tensor([list(ids[:t]) + [mars.mask_token_id] * B])
                p = tm.model(input_ids=window).logits[0, t - 1 :].softmax(-1)  # slots 0..B
                read = ref[k] >= 0  # slots whose token is labelled (past the reply's end: no mask was fed)
                assert read[0]
                np.testing.assert_allclose(prob[k][read], p.max(-1).values.numpy()[read], rtol=1e-4, atol=1e-5)
                top2 = p.topk(2, -1).values.numpy()
                np.testing.assert_allclose(
                    confs["margin"][k][read], (top2[:, 0] - top2[:, 1])[read], rtol=1e-4, atol=1e-5
                )
                entropy = -(p * p.clamp(min=1e-30).log()).sum(-1).numpy()
                np.testing.assert_allclose(confs["entropy"][k][read], entropy[read], rtol=1e-3, atol=1e-4)
                assert pred[k][read].tolist() == p.argmax(-1).numpy()[read].tolist()
                for s in range(B + 1):
                    j = t + s
                    expected = int(full[j - 1].argmax()) if j < len(ids) and labels[j] != -100 else -1
                    assert ref[k, s] == expected
    # The trained masks agree with AR and the replayed rule accepts several tokens precisely.
    examples = []
    for rec in spell_records():
        ids, labels = encode_record(rec, tok, eos_id=tok.eos_token_id)
        examples.append(Example(*pad_to_block(ids, labels, B, tok.eos_token_id, ended=True), "spell", False))
    confs, pred, ref = sp.slot_records(em, examples, metrics=sp.METRICS)
    rep = sp.summarise(confs["probability"], pred, ref, thresholds=[1.0, 0.9])
    assert all(s["agree_with_ar"] > 0.9 for s in rep["slots"]), rep["slots"]
    at1, at09 = rep["thresholds"]
    assert at1["tokens_per_step"] == 1.0 and at1["precision"] is None
    assert at09["tokens_per_step"] > 2.0 and at09["precision"] > 0.95, at09
    # Each metric's direction: AR mode accepts nothing extra; the loosest setting accepts every slot.
    B = mars.block_size
    for m, (ar_tau, loose) in {"probability": (1.0, 0.0), "margin": (1.0, 0.0), "entropy": (0.0, 1e9)}.items():
        assert sp.replay(confs[m], pred, ref, m, ar_tau)["tokens_per_step"] == 1.0
        full = (ref[:, 1:] >= 0).cumprod(1).sum(1).mean() + 1
        assert sp.replay(confs[m], pred, ref, m, loose)["tokens_per_step"] == pytest.approx(full)
    # The budget table: more budget never buys fewer tokens, and every pick keeps within its budget.
    rep["metrics"] = sp.compare_metrics(confs, pred, ref, budgets=(0.0, 0.05, 1.0))
    for m, best in rep["metrics"].items():
        assert [b["budget"] for b in best] == [0.0, 0.05, 1.0]
        assert all(b["steps_with_error"] <= b["budget"] for b in best)
        assert best[0]["tokens_per_step"] <= best[1]["tokens_per_step"] <= best[2]["tokens_per_step"]
        assert best[2]["tokens_per_step"] > 2.0, (m, best)
    text = sp.format_report(rep)
    assert "tok/step" in text and "entropy" in text and "<= 0.05" in text
