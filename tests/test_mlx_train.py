"""MARS fine-tuning on MLX: it learns, its LoRA output is a plain mlx-lm adapter, a resumed run
ends where an uninterrupted one does, and a fused model decodes like the adapter.

MLX on Linux runs on the CPU with a reference BLAS: tiny models and few steps only.
"""

import json
import string

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from tiny import make_plan, save_model

from mars.backends.mlx.decode import MlxDecoder
from mars.backends.mlx.load import ensure_mask_token, load
from mars.backends.mlx.train import MlxTrainer
from mars.checkpoint.paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY
from mars.core.decode.loop import generate
from mars.core.tokens import encode_prompt
from mars.core.train.data import Example, encode_record, pad_to_block
from mars.core.train.loop import CHECKPOINT, TrainSettings

QUIET = {"announce": lambda m: None}


def spell_records():
    return [
        {"prompt": f"Say {c}" + "!" * k, "completion": c * 12} for k in range(2) for c in string.ascii_lowercase[:20]
    ]


def examples_of(records, tokenizer, block_size=4):
    out = []
    for rec in records:
        ids, labels = encode_record(rec, tokenizer, eos_id=tokenizer.eos_token_id)
        ids, labels = pad_to_block(ids, labels, block_size, tokenizer.eos_token_id, ended=True)
        out.append(Example(ids, labels, "spell", False))
    return out


def trainer_for(base, out, **kw):
    loaded = load(base, **QUIET)
    mars = ensure_mask_token(loaded.model, loaded.tokenizer, None, block_size=4, **QUIET)
    settings = TrainSettings(**{"block_size": 4, "steps_per_save": 10**9, **kw})
    return MlxTrainer(loaded, mars, settings, out), loaded, mars


def decode(loaded, mars, prompts, threshold, max_tokens=24):
    settings = make_plan(
        mask_id=mars.mask_token_id,
        eos_ids=loaded.eos_ids,
        block_size=mars.block_size,
        max_tokens=max_tokens,
        threshold=threshold,
    )
    return generate(MlxDecoder(loaded), prompts, settings)


def mlx_lm_greedy(model, prompt, eos_ids, max_tokens=24):
    """Plain greedy decoding with mlx-lm's own forward and KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = []
    x = mx.array([prompt])
    while len(out) < max_tokens:
        token = int(mx.argmax(model(x, cache=cache)[0, -1]).item())
        out.append(token)
        if token in eos_ids:
            break
        x = mx.array([[token]])
    return out


# -- 1. it learns ------------------------------------------------------------------------------


def test_learns_several_tokens_per_forward_at_the_same_output(tmp_path):
    base = save_model(tmp_path / "base", "llama", seed=0, scale=0.1)
    trainer, loaded, mars = trainer_for(
        base, tmp_path / "out", fine_tune_type="full", iters=80, batch_size=8, learning_rate=5e-3
    )
    examples = examples_of(spell_records(), loaded.tokenizer)
    result = trainer.train(examples, progress=False)
    first, last = result["history"][0], result["history"][-1]
    assert result["steps"] == 80 and len(result["history"]) == 80
    assert set(first) == {"step", "noisy", "clean", "lr", "tok_s"}
    assert last["noisy"] < 0.2 * first["noisy"] and last["clean"] < 0.2 * first["clean"]
    prompts = [encode_prompt(loaded.tokenizer, r["prompt"]) for r in spell_records()]
    ar = decode(loaded, mars, prompts, 1.0, max_tokens=40)
    fast = decode(loaded, mars, prompts, 0.9, max_tokens=40)
    assert fast.tokens == ar.tokens
    assert fast.stats.tokens_per_forward > 2.0, fast.stats.tokens_per_forward
    assert ar.stats.tokens_per_forward == 1.0
    assert loaded.tokenizer.decode(ar.tokens[0]) == "a" * 12 + "<|im_end|>"


# -- 2 and 4. LoRA output: an mlx-lm adapter, and a fused model ------------------------------

PROMPTS = ["Say c", "Say q!", "Hello there"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_model(root / "base", "llama", seed=1, hidden=32)
    trainer, loaded, _ = trainer_for(
        base,
        root / "adapter",
        fine_tune_type="lora",
        iters=12,
        batch_size=8,
        learning_rate=2e-2,
        lora_rank=4,
        lora_alpha=8.0,
    )
    records = spell_records()[:16]
    trainer.train(examples_of(records, loaded.tokenizer), examples_of(records[:4], loaded.tokenizer), progress=False)
    trainer.save(loaded.tokenizer, str(base))
    trainer.output = root / "fused"
    trainer.save(loaded.tokenizer, str(base), fuse=True)
    return base, root / "adapter", root / "fused", trainer


def test_lora_output_is_an_mlx_lm_adapter(lora):
    from mlx_lm import load as mlx_lm_load

    base, adapter, _, trainer = lora
    names = sorted(p.name for p in adapter.iterdir())
    assert {
        "adapters.safetensors",
        "adapter_config.json",
        MASK_EMBEDDING_FILE,
        "mars.json",
        "training_log.jsonl",
        "tokenizer.json",
    } <= set(names)
    assert not [n for n in names if n.startswith(".") or n == CHECKPOINT]
    weights = mx.load(str(adapter / "adapters.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2
    lp = config["lora_parameters"]
    assert (lp["rank"], lp["scale"], lp["dropout"]) == (4, 2.0, 0.0)
    assert set(lp["keys"]) == {f"self_attn.{p}_proj" for p in "qkvo"} | {
        f"mlp.{p}_proj" for p in ("gate", "up", "down")
    }
    # Exactly the LoRA matrices, under mlx-lm's names.
    assert len(weights) == 2 * 7 * 2 and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in weights)
    row = mx.load(str(adapter / MASK_EMBEDDING_FILE))[MASK_EMBEDDING_KEY]
    assert row.shape == (32,)
    assert trainer.trainable == sum(w.size for w in weights.values()) + 32
    log = [json.loads(line) for line in (adapter / "training_log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in log] == list(range(1, 13)) and "val_loss" in log[-1]

    plain, _ = mlx_lm_load(str(base), adapter_path=str(adapter))
    untouched, _ = mlx_lm_load(str(base))
    ours = load(adapter, **QUIET)
    assert ours.mars is not None and ours.mars.base_model == str(base)
    prompts = [encode_prompt(ours.tokenizer, p) for p in PROMPTS]
    mars_out = decode(ours, ours.mars, prompts, 1.0).tokens
    assert mars_out == [mlx_lm_greedy(plain, p, ours.eos_ids) for p in prompts]
    # The adapter really changed the model.
    assert mars_out != [mlx_lm_greedy(untouched, p, ours.eos_ids) for p in prompts]


def test_fused_model_loads_everywhere_and_decodes_like_the_adapter(lora):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.tuner.lora import LoRALinear

    _, adapter, fused, trainer = lora
    assert (fused / "config.json").is_file() and (fused / "mars.json").is_file()
    assert not (fused / "adapters.safetensors").exists()
    # Fusing for the save left the trainer's own model as it was.
    assert any(isinstance(m, LoRALinear) for _, m in trainer.model.named_modules())
    plain, _ = mlx_lm_load(str(fused))
    assert not any(isinstance(m, LoRALinear) for _, m in plain.named_modules())
    full, from_adapter = load(fused, **QUIET), load(adapter, **QUIET)
    row = mx.load(str(adapter / MASK_EMBEDDING_FILE))[MASK_EMBEDDING_KEY]
    mask_id = full.mars.mask_token_id
    assert np.allclose(np.array(full.model.model.embed_tokens.weight[mask_id]), np.array(row))
    prompts = [encode_prompt(full.tokenizer, p) for p in PROMPTS]
    tokens = decode(full, full.mars, prompts, 1.0).tokens
    assert tokens == decode(from_adapter, from_adapter.mars, prompts, 1.0).tokens
    assert tokens == [mlx_lm_greedy(plain, p, full.eos_ids) for p in prompts]


# -- 3. checkpoints and resume -----------------------------------------------------------------


class Crash(Exception):
    pass


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_resumed_run_ends_with_the_uninterrupted_weights(tmp_path, kind):
    from mlx.utils import tree_flatten

    base = save_model(tmp_path / "base", "llama", seed=2, hidden=32)
    kw = {
        "fine_tune_type": kind,
        "iters": 5,
        "batch_size": 4,
        "grad_accumulation": 2,
        "learning_rate": 1e-2,
        "steps_per_save": 2,
        "steps_per_eval": 2,
        "lora_dropout": 0.1 if kind == "lora" else 0.0,
        "warmup": 0.2,
    }
    records = spell_records()[::2][:8] + spell_records()[1::2][:8]  # 16 records: 2 steps per epoch

    whole, loaded, _ = trainer_for(base, tmp_path / "whole", **kw)
    train, valid = examples_of(records, loaded.tokenizer), examples_of(records[:3], loaded.tokenizer)
    expected = whole.train(train, valid, progress=False)

    out = tmp_path / "resumed"
    first, _, _ = trainer_for(base, out, **kw)
    real_save = first.save_checkpoint

    def save_then_crash():
        real_save()
        if first.step == 4:  # end of epoch 1: the resumed run starts a new epoch
            raise Crash

    first.save_checkpoint = save_then_crash
    with pytest.raises(Crash):
        first.train(train, valid, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT]  # no temporary directory left behind
    state = json.loads((out / CHECKPOINT / "state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (4, 1, 4)

    second, loaded2, _ = trainer_for(base, out, **kw)
    logs = []
    result = second.train(train, valid, resume=True, log=logs.append, progress=False)
    assert result["steps"] == 5 and logs and "step 4/5" in logs[0]
    assert [h["step"] for h in result["history"]] == [1, 2, 3, 4, 5]
    for a, b in zip(expected["history"], result["history"]):
        for key in ("noisy", "clean", "lr", "val_loss"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
    want = dict(tree_flatten(whole.net.trainable_parameters()))
    got = dict(tree_flatten(second.net.trainable_parameters()))
    assert set(want) == set(got)
    for name, w in want.items():
        assert np.abs(np.array(w) - np.array(got[name])).max() <= 1e-5, name

    second.save(loaded2.tokenizer, str(base))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["base", "resumed", "whole"]
    inside = [p.name for p in out.iterdir()]
    assert CHECKPOINT not in inside and not [n for n in inside if n.startswith(".")]
    assert "mars.json" in inside
    if kind == "full":
        reloaded = load(out, **QUIET)
        assert reloaded.mars is not None


# -- the same loop as the torch trainer ----------------------------------------------------------


def test_same_history_as_the_torch_trainer(tmp_path):
    """Full fine-tuning: same batches, accumulation, clipping, schedule and AdamW (bias-corrected,
    as torch's) give the same losses, step by step, on both backends."""
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from mars.backends.torch.load import ensure_mask_token as torch_mask_token
    from mars.backends.torch.load import load as torch_load
    from mars.backends.torch.train import TorchTrainer

    base = save_model(tmp_path / "base", "llama", seed=3, hidden=32)
    kw = {
        "fine_tune_type": "full",
        "iters": 6,
        "batch_size": 4,
        "grad_accumulation": 2,
        "learning_rate": 1e-2,
        "warmup": 0.3,
        "max_grad_norm": 0.5,
        "steps_per_eval": 3,
    }
    ours, loaded, _ = trainer_for(base, tmp_path / "mlx", **kw)
    # Long prompts: every batch leaves out noisy blocks no loss reads (masks.noisy_start).
    records = [{**r, "prompt": "Now, please: " * 2 + r["prompt"]} for r in spell_records()[:12]]
    train, valid = examples_of(records, loaded.tokenizer), examples_of(records[:4], loaded.tokenizer)
    assert min(int(np.argmax(np.asarray(e.labels) != -100)) for e in train) > 8
    got = ours.train(train, valid, progress=False)["history"]

    tm = torch_load(base, **QUIET)
    mars = torch_mask_token(tm.model, tm.tokenizer, None, block_size=4, **QUIET)
    # The tiny config sets pad_token_id = EOS (nn.Embedding(padding_idx=EOS)); the torch trainer
    # must still train the EOS row, as MLX does, or the two part after the first step.
    assert tm.model.model.embed_tokens.padding_idx == 2
    theirs = TorchTrainer(tm, mars, TrainSettings(block_size=4, steps_per_save=10**9, **kw), tmp_path / "torch")
    want = theirs.train(train, valid, progress=False)["history"]

    assert [sorted(h) for h in got] == [sorted(h) for h in want]
    for a, b in zip(got, want):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        for key in ("noisy", "clean", "val_noisy", "val_clean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-4), (a["step"], key)


def test_cli_finetune_and_generate_with_the_mlx_backend(tmp_path):
    from click.testing import CliRunner

    from mars.cli.main import cli

    base = save_model(tmp_path / "base", "llama", seed=0, hidden=32)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spell_records()[:8]))
    out = tmp_path / "out"
    run = CliRunner().invoke(
        cli,
        [
            "finetune",
            "--backend",
            "mlx",
            "--model",
            str(base),
            "--data",
            str(data),
            "--output",
            str(out),
            "--iters",
            "3",
            "--batch-size",
            "4",
        ],
    )
    assert run.exit_code == 0, run.output
    assert (out / "adapters.safetensors").is_file() and (out / "mask_embedding.safetensors").is_file()
    assert json.loads((out / "mars.json").read_text())["base_model"] == str(base.resolve())
    gen = CliRunner().invoke(
        cli, ["generate", "--backend", "mlx", "--model", str(out), "--prompt", "Say c", "--max-tokens", "6"]
    )
    assert gen.exit_code == 0, gen.output
    assert "tokens/forward" in gen.output


def test_init_adapter_from_an_mlx_adapter_on_both_backends(lora, tmp_path):
    """`--init-adapter` starts both trainers from the same mlx-lm adapter: at learning rate 0 they
    save it unchanged (the torch run as PEFT, which converts back bit for bit)."""
    from click.testing import CliRunner

    from mars.checkpoint.adapters import convert_adapter
    from mars.cli.main import cli

    base, adapter, _, _ = lora
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spell_records()[:8]))
    outs = {}
    for backend in ("mlx", "torch"):
        outs[backend] = tmp_path / backend
        run = CliRunner().invoke(
            cli,
            [
                "finetune",
                "--backend",
                backend,
                "--model",
                str(base),
                "--data",
                str(data),
                "--output",
                str(outs[backend]),
                "--init-adapter",
                str(adapter),
                "--iters",
                "1",
                "--batch-size",
                "4",
                "--learning-rate",
                "0",
            ],
        )
        assert run.exit_code == 0, run.output
    back = convert_adapter(outs["torch"], tmp_path / "back", "mlx", base=base)
    source = mx.load(str(adapter / "adapters.safetensors"))
    for got in (mx.load(str(outs["mlx"] / "adapters.safetensors")), mx.load(str(back / "adapters.safetensors"))):
        assert got.keys() == source.keys()
        for k in source:
            assert mx.array_equal(got[k], source[k]).item(), k
    row = mx.load(str(adapter / "mask_embedding.safetensors"))["mask_embedding"]
    for out in (outs["mlx"], outs["torch"]):
        got = mx.load(str(out / "mask_embedding.safetensors"))["mask_embedding"]
        assert mx.array_equal(got.astype(mx.float32), row.astype(mx.float32)).item(), out
