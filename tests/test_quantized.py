"""MARS on mlx-lm quantized models (4 and 8 bit): adapters trained on a float base or on the
quantized base itself (QLoRA) decode there in every mode and through every entry point, and
QLoRA's output converts to PEFT (for the dequantized weights) and fuses back into a quantized model.

The mask token's trained row is kept beside a quantized embedding as a float vector of its own
(mars.backends.mlx.load.MaskRowEmbedding); the quantized table stays the base's, bit for bit.
A token equal to the mask id fed back as input is a mask to a MARS model: where the base's own
greedy reply contains the (tiny tokenizer's) mask id, a gated adapter's AR cannot equal the
base's, so the comparisons with mlx-lm skip those prompts and say how many are left.
"""

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from clitools import invoke, ok, one_line_error, spell_records, write_jsonl  # noqa: E402
from test_mlx_train import examples_of, mlx_lm_greedy  # noqa: E402
from tiny import PROMPTS, make_plan, save_model  # noqa: E402

from mars.backends.mlx.decode import MlxDecoder  # noqa: E402
from mars.backends.mlx.load import MaskRowEmbedding, ensure_mask_token, load  # noqa: E402
from mars.backends.mlx.train import MlxTrainer  # noqa: E402
from mars.checkpoint.paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY  # noqa: E402
from mars.convert import convert_model  # noqa: E402
from mars.core.decode.loop import generate  # noqa: E402
from mars.core.tokens import encode_prompt  # noqa: E402
from mars.core.train.loop import TrainSettings  # noqa: E402

QUIET = {"announce": lambda m: None}
TEXTS = PROMPTS + [f"Say {c}" for c in "abcdef"]
FORMATS = {4: 32, 8: 64}  # bits: group size (mlx-lm writes 64 by default; 32 and 128 are its others)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny float llama, its 4- and 8-bit mlx-lm versions, and MARS adapters trained on the
    float base: gated (as the shipped weights are) and not."""
    root = tmp_path_factory.mktemp("quantized")
    base = save_model(root / "hf", "llama", seed=1)
    out = {"hf": base}
    for bits, group in FORMATS.items():
        out[bits] = convert_model(base, root / f"q{bits}", "mlx", q_bits=bits, q_group_size=group, **QUIET)
    for gate in ("none", "masks"):
        loaded = load(base, **QUIET)
        mars = ensure_mask_token(loaded.model, loaded.tokenizer, None, block_size=4, **QUIET)
        settings = TrainSettings(
            block_size=4, steps_per_save=10**9, iters=30, batch_size=8, learning_rate=3e-3, gate=gate
        )
        trainer = MlxTrainer(loaded, mars, settings, root / f"adapter-{gate}", **QUIET)
        trainer.train(examples_of(spell_records(), loaded.tokenizer), progress=False)
        out[gate] = trainer.save(loaded.tokenizer, str(base))
    return out


def json_line(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def plan_for(m, **asked):
    return make_plan(
        **{"mask_id": m.mars.mask_token_id, "eos_ids": m.eos_ids, "block_size": 4, "max_tokens": 24, **asked}
    )


@pytest.mark.parametrize("bits", sorted(FORMATS))
def test_the_mask_row_is_kept_beside_a_quantized_embedding(models, bits):
    m = load(models[bits], adapter_path=models["masks"], **QUIET)
    plain = load(models[bits], **QUIET)
    emb, table = m.model.model.embed_tokens, plain.model.model.embed_tokens
    assert isinstance(emb, MaskRowEmbedding) and emb.bits == bits
    for name in ("weight", "scales", "biases"):  # the table is the base's, bit for bit
        assert np.array_equal(np.array(emb[name]), np.array(table[name]))
    row = mx.load(str(models["masks"] / MASK_EMBEDDING_FILE))[MASK_EMBEDDING_KEY]
    mask_id = m.mars.mask_token_id
    ids = mx.array([[5, mask_id, 9, mask_id]])
    got = np.array(emb(ids))
    assert np.array_equal(got[0, 1], np.array(row.astype(mx.float32))) and np.array_equal(got[0, 3], got[0, 1])
    assert np.array_equal(got[0, [0, 2]], np.array(table(ids))[0, [0, 2]])
    x = mx.random.normal((1, 3, emb.dims))
    assert np.array_equal(np.array(emb.as_linear(x)), np.array(table.as_linear(x)))  # the tied head: the base's


@pytest.mark.parametrize("gate", ["none", "masks"])
@pytest.mark.parametrize("bits", sorted(FORMATS))
def test_every_mode_decodes_on_a_quantized_base(models, bits, gate):
    """An adapter trained on the float base, on the quantized one: threshold 1.0 is mlx-lm's own
    greedy decoding of that quantized model (with the adapter's deltas where they act on real
    tokens), lossless equals it, batch = single, and a loose threshold takes several tokens a forward
    (tiny LoRA adapters barely learn: their masks are seldom confident at 0.8)."""
    m = load(models[bits], adapter_path=models[gate], **QUIET)
    prompts = [encode_prompt(m.tokenizer, p) for p in TEXTS]
    ar = generate(MlxDecoder(m), prompts, plan_for(m, threshold=1.0)).tokens
    # Gated: real tokens run the base alone, so AR is the plain quantized model's.
    reference_model = m.model if gate == "none" else load(models[bits], **QUIET).model
    references = [mlx_lm_greedy(reference_model, p, m.eos_ids) for p in prompts]
    kept = [i for i, r in enumerate(references) if m.mars.mask_token_id not in r]
    assert len(kept) >= 7, kept
    assert [ar[i] for i in kept] == [references[i] for i in kept]
    for cache in ("window", "block"):
        lossless = generate(MlxDecoder(m), prompts, plan_for(m, lossless=True, cache=cache))
        assert lossless.tokens == ar
        fast = generate(MlxDecoder(m), prompts, plan_for(m, threshold=0.8, cache=cache))
        assert fast.tokens == [
            generate(MlxDecoder(m), [p], plan_for(m, threshold=0.8, cache=cache)).tokens[0] for p in prompts
        ]
    loose = generate(MlxDecoder(m), prompts, plan_for(m, threshold=0.3))
    assert loose.stats.tokens_per_forward > 1.2  # the masks' guesses are taken on the quantized base


def test_the_entry_points_decode_a_quantized_base_with_an_adapter(models, tmp_path):
    """generate, chat, eval and bench on the 4-bit base with the gated adapter: the mode each
    prints, and lossless = AR where they report it."""
    q4, adapter = models[4], models["masks"]
    common = ("--backend", "mlx", "--model", q4, "--adapter-path", adapter, "--max-tokens", 12, "--feed", "fixed")
    outs = {}
    for mode in (("--threshold", "1.0"), ("--lossless",), ("--threshold", "0.8")):
        result = ok(invoke("generate", *common, *mode, "--prompt", "Say c", "--json"))
        outs[mode] = json_line(result.output)
    assert outs[("--lossless",)]["text"] == outs[("--threshold", "1.0")]["text"]
    assert outs[("--lossless",)]["mode"] == "lossless greedy (4-bit: AR's up to near-ties)"
    assert outs[("--threshold", "0.8")]["mode"].startswith("verified threshold 0.8")
    chat = ok(invoke("chat", *common, "--threshold", "0.8", input="Say c\n/quit\n"))
    assert "verified threshold 0.8" in chat.output
    # eval and bench read the adapter's recorded base: an adapter directory that names the 4-bit model.
    moved = tmp_path / "adapter"
    moved.mkdir()
    for f in adapter.iterdir():
        if f.is_file():
            (moved / f.name).write_bytes(f.read_bytes())
    mars = json.loads((moved / "mars.json").read_text())
    (moved / "mars.json").write_text(json.dumps({**mars, "base_model": str(q4)}))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in TEXTS[:4]])
    report = tmp_path / "eval.json"
    ok(
        invoke(
            "eval",
            "--backend",
            "mlx",
            "--model",
            moved,
            "--prompts",
            prompts,
            "--no-nll",
            "--max-tokens",
            12,
            "--threshold",
            "1.0,0.8",
            "--lossless",
            "--output",
            report,
        )
    )
    rows = json.loads(report.read_text())["models"][0]["sweep"]["thresholds"]
    lossless = [r for r in rows if r["mode"] == "lossless"]
    assert lossless and lossless[0]["exact_match"] == 1.0
    bench = ok(
        invoke(
            "bench",
            "--backend",
            "mlx",
            "--model",
            moved,
            "--prompts",
            prompts,
            "--batch-sizes",
            1,
            "--repeats",
            1,
            "--max-tokens",
            8,
            "--threshold",
            "0.8",
            "--block-cache",
            0,
            "--prompt-lookup",
            0,
            "--forward-k",
            1,
        )
    )
    assert "mlx_lm" in bench.output


def test_qlora_end_to_end(models, tmp_path):
    """finetune on the 4-bit model -> generate / chat at 0.8 -> convert --to hf (a PEFT adapter whose
    card names the dequantized weights it fits) -> convert --fuse --to mlx -q (a quantized model
    that carries its masks); finetune --fuse writes such a model too."""
    q4, hf = models[4], models["hf"]
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", spell_records())
    out = tmp_path / "qlora"
    ok(
        invoke(
            "finetune",
            "--backend",
            "mlx",
            "--model",
            q4,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            4,
            "--batch-size",
            2,
        )
    )
    assert (out / "adapters.safetensors").is_file() and (out / MASK_EMBEDDING_FILE).is_file()
    gen = ok(
        invoke(
            "generate",
            "--backend",
            "mlx",
            "--model",
            out,
            "--threshold",
            "0.8",
            "--prompt",
            "Say c",
            "--max-tokens",
            8,
            "--json",
        )
    )
    assert json_line(gen.output)["mode"].startswith("verified threshold 0.8")
    chat = ok(
        invoke(
            "chat", "--backend", "mlx", "--model", out, "--threshold", "0.8", "--max-tokens", 8, input="Say c\n/quit\n"
        )
    )
    assert "verified threshold 0.8" in chat.output
    m = load(out, **QUIET)
    ar = generate(MlxDecoder(m), [encode_prompt(m.tokenizer, t) for t in TEXTS[:4]], plan_for(m, threshold=1.0)).tokens

    peft = tmp_path / "peft"
    ok(invoke("convert", out, "--to", "hf", "--output", peft))
    card = (peft / "README.md").read_text()
    assert str(q4) in card and "4-bit" in card and f"mars convert {q4} --to hf" in card
    # torch reads the PEFT adapter on the dequantized weights, and decodes as MLX did on the 4-bit model.
    one_line_error(
        invoke("generate", "--backend", "torch", "--model", peft, "--prompt", "x"), "4-bit", "mars convert", "--to hf"
    )
    dequantized = tmp_path / "q4-hf"
    ok(invoke("convert", q4, "--to", "hf", "--output", dequantized))
    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import load as torch_load

    t = torch_load(dequantized, adapter_path=peft, **QUIET)
    assert (
        generate(TorchDecoder(t), [encode_prompt(t.tokenizer, x) for x in TEXTS[:4]], plan_for(t, threshold=1.0)).tokens
        == ar
    )

    fused = tmp_path / "fused"
    ok(
        invoke(
            "convert",
            q4,
            "--adapter",
            out,
            "--fuse",
            "--to",
            "mlx",
            "-q",
            "--q-bits",
            4,
            "--q-group-size",
            32,
            "--output",
            fused,
        )
    )
    from mlx_lm import load as mlx_lm_load

    plain, _ = mlx_lm_load(str(fused))  # mlx-lm reads it as it is, the mask row inside its quantized table
    f = load(fused, **QUIET)
    assert f.mars is not None and type(f.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    row = np.array(mx.load(str(out / MASK_EMBEDDING_FILE))[MASK_EMBEDDING_KEY].astype(mx.float32))
    got = np.array(f.model.model.embed_tokens(mx.array([f.mars.mask_token_id])))[0]
    step = np.abs(row).max() / 7  # a 4-bit group's step is at most its range / 15
    assert np.abs(got - row).max() <= step
    prompts = [encode_prompt(f.tokenizer, x) for x in TEXTS[:4]]
    assert generate(MlxDecoder(f), prompts, plan_for(f, threshold=1.0)).tokens == [
        mlx_lm_greedy(plain, p, f.eos_ids) for p in prompts
    ]
    ok(
        invoke(
            "generate",
            "--backend",
            "mlx",
            "--model",
            fused,
            "--threshold",
            "0.8",
            "--prompt",
            "Say c",
            "--max-tokens",
            8,
        )
    )

    fused_by_training = tmp_path / "qlora-fused"
    ok(
        invoke(
            "finetune",
            "--backend",
            "mlx",
            "--model",
            q4,
            "--data",
            data,
            "--output",
            fused_by_training,
            "--iters",
            2,
            "--batch-size",
            2,
            "--fuse",
        )
    )
    g = load(fused_by_training, **QUIET)
    assert type(g.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert json.loads((fused_by_training / "config.json").read_text())["quantization"]["bits"] == 4
    ok(
        invoke(
            "generate",
            "--backend",
            "mlx",
            "--model",
            fused_by_training,
            "--threshold",
            "0.8",
            "--prompt",
            "Say c",
            "--max-tokens",
            8,
        )
    )
    assert hf.is_dir()


@pytest.mark.slow
def test_the_default_model_at_4_bit_end_to_end(tmp_path):
    """The embedded default quantized as Mac users get their models: the shipped weights decode on
    it losslessly and at 0.8 (generate and chat), threshold 1.0 is mlx-lm's greedy output; a QLoRA
    fine-tune of it chats at 0.8, converts to PEFT and fuses back into a 4-bit model."""
    from mlx_lm import load as mlx_lm_load

    from mars.checkpoint.default_model import DEFAULT_REF, shipped_weights

    q4 = tmp_path / "q4"
    ok(invoke("convert", DEFAULT_REF, "--to", "mlx", "-q", "--q-bits", 4, "--output", q4))
    weights = shipped_weights()
    common = ("--backend", "mlx", "--model", q4, "--adapter-path", weights, "--max-tokens", 16, "--feed", "fixed")
    question = "What is the capital of France?"
    replies = {}
    for mode in (("--threshold", "1.0"), ("--lossless",), ("--threshold", "0.8")):
        replies[mode] = json_line(ok(invoke("generate", *common, *mode, "--prompt", question, "--json")).output)
    assert replies[("--lossless",)]["text"] == replies[("--threshold", "1.0")]["text"]
    assert replies[("--threshold", "0.8")]["mode"].startswith("verified threshold 0.8")
    m = load(q4, adapter_path=weights, **QUIET)
    prompt = encode_prompt(m.tokenizer, question)
    ours = generate(MlxDecoder(m), [prompt], plan_for(m, threshold=1.0, max_tokens=16)).tokens[0]
    model, _ = mlx_lm_load(str(q4))
    assert ours == mlx_lm_greedy(model, prompt, m.eos_ids, max_tokens=16)
    assert m.tokenizer.decode(ours, skip_special_tokens=True) == replies[("--threshold", "1.0")]["text"]
    assert (
        "verified threshold 0.8"
        in ok(invoke("chat", *common, "--threshold", "0.8", input=question + "\n/quit\n")).output
    )

    data = tmp_path / "data"
    write_jsonl(
        data / "train.jsonl", [{"prompt": f"Spell {w}.", "completion": " ".join(w)} for w in ("cat", "house", "river")]
    )
    out = tmp_path / "qlora"
    ok(
        invoke(
            "finetune",
            "--backend",
            "mlx",
            "--model",
            q4,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            1,
            "--batch-size",
            1,
        )
    )
    chat = ok(
        invoke(
            "chat",
            "--backend",
            "mlx",
            "--model",
            out,
            "--threshold",
            "0.8",
            "--max-tokens",
            8,
            "--feed",
            "fixed",
            input="Spell dog.\n/quit\n",
        )
    )
    assert "verified threshold 0.8" in chat.output
    ok(invoke("convert", out, "--to", "hf", "--output", tmp_path / "peft"))
    assert f"mars convert {q4} --to hf" in (tmp_path / "peft" / "README.md").read_text()
    fused = tmp_path / "fused"
    ok(invoke("convert", q4, "--adapter", out, "--fuse", "--to", "mlx", "-q", "--q-bits", 4, "--output", fused))
    reply = json_line(
        ok(
            invoke(
                "generate",
                "--backend",
                "mlx",
                "--model",
                fused,
                "--threshold",
                "0.8",
                "--prompt",
                "Spell dog.",
                "--max-tokens",
                8,
                "--feed",
                "fixed",
                "--json",
            )
        ).output
    )
    assert reply["mode"].startswith("verified threshold 0.8") and reply["tokens"] > 0


def test_a_quantized_base_keeps_its_own_cost_curve(models):
    """The cost curve's key names the number format: a 4-bit base and the float one read through
    the same adapter directory, and their forwards cost differently on a GPU."""
    keys = {b: MlxDecoder(load(models[b], adapter_path=models["masks"], **QUIET)).cost_key() for b in ("hf", 4)}
    assert keys["hf"]["format"] == "float32" and keys[4]["format"] == "4-bit"
