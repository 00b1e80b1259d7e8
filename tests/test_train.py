"""The training loop's arithmetic: accumulation, epochs, the schedule."""

import pytest
import torch
from tiny import make_model, make_plan, make_tokenizer

from mars.backends.torch.load import TorchModel, ensure_mask_token
from mars.backends.torch.train import TorchTrainer
from mars.core.train.data import Example, encode_record, pad_to_block
from mars.core.train.loop import TrainSettings, lr_lambda

RECORDS = [
    {"prompt": "Say a", "completion": "aaaa aaaa"},
    {"prompt": "Say bb", "completion": "bb bb bb"},
    {"prompt": "Hi", "completion": "Hello there, friend."},
    {"prompt": "Count", "completion": "1 2 3 4 5 6 7"},
]


def setup(tmp_path, **kw):
    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=0, scale=0.1)
    tm = TorchModel(model, tok, None, "", torch.device("cpu"), torch.float32)
    mars = ensure_mask_token(model, tok, None, block_size=4, announce=lambda m: None)
    examples = []
    for rec in RECORDS:
        ids, labels = encode_record(rec, tok, eos_id=tok.eos_token_id)
        ids, labels = pad_to_block(ids, labels, 4, tok.eos_token_id, ended=True)
        examples.append(Example(ids, labels, "x", False))
    settings = TrainSettings(fine_tune_type="full", learning_rate=1e-2, warmup=0.0, steps_per_save=10**9, **kw)
    return TorchTrainer(tm, mars, settings, tmp_path / "out"), examples, model


def test_accumulating_two_half_batches_equals_one_whole_batch(tmp_path, monkeypatch):
    # Plain SGD: Adam's normalised first step would amplify float noise in near-zero gradients.
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    whole, examples, model_a = setup(tmp_path / "a", iters=3, batch_size=4, max_grad_norm=0)
    whole.train(examples, progress=False)
    halves, examples, model_b = setup(tmp_path / "b", iters=3, batch_size=2, grad_accumulation=2, max_grad_norm=0)
    halves.train(examples, progress=False)
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_epochs_set_the_step_count(tmp_path):
    trainer, examples, _ = setup(tmp_path, epochs=2, batch_size=2)
    assert trainer.train(examples, progress=False)["steps"] == 4  # 2 batches per epoch


def test_warmup_then_cosine():
    f = lr_lambda(total=10, warmup=2)
    assert [round(f(s), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert f(6) == pytest.approx(0.5)
    assert f(10) == pytest.approx(0.0)


def test_fused_lora_equals_adapter_plus_mask_row(tmp_path):
    from tiny import save_model

    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import load
    from mars.core.decode.loop import generate
    from mars.core.tokens import encode_prompt

    base = save_model(tmp_path / "base", "llama", seed=0, scale=0.1)
    tm = load(base, announce=lambda m: None)
    mars = ensure_mask_token(tm.model, tm.tokenizer, None, block_size=4, announce=lambda m: None)
    examples = []
    for rec in RECORDS:
        ids, labels = encode_record(rec, tm.tokenizer, eos_id=tm.tokenizer.eos_token_id)
        examples.append(Example(*pad_to_block(ids, labels, 4, tm.tokenizer.eos_token_id, ended=True), "x", False))
    s = TrainSettings(
        fine_tune_type="lora", iters=8, batch_size=4, learning_rate=1e-2, warmup=0.0, steps_per_save=10**9
    )
    trainer = TorchTrainer(tm, mars, s, tmp_path / "adapter")
    trainer.train(examples, progress=False)
    trainer.save(tm.tokenizer, str(base))
    trainer.output = tmp_path / "fused"
    trainer.save(tm.tokenizer, str(base), fuse=True)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "fused" / "model.safetensors").is_file()
    assert not (tmp_path / "fused" / "adapter_config.json").exists()

    adapter = load(tmp_path / "adapter", announce=lambda m: None)  # its base comes from mars.json
    fused = load(tmp_path / "fused", announce=lambda m: None)
    mask_id = mars.mask_token_id
    torch.testing.assert_close(
        adapter.model.get_input_embeddings().weight[mask_id], fused.model.get_input_embeddings().weight[mask_id]
    )
    prompts = [encode_prompt(fused.tokenizer, r["prompt"]) for r in RECORDS]
    for tau in (1.0, 0.5):
        settings = make_plan(mask_id=mask_id, eos_ids=(2,), threshold=tau, max_tokens=16)
        assert (
            generate(TorchDecoder(adapter), prompts, settings).tokens
            == generate(TorchDecoder(fused), prompts, settings).tokens
        )
