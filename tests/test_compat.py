"""What mars writes, read by other tools: Hugging Face folders load alike in mlx-lm and
transformers, adapter outputs name no local base path, sampling leaves torch's global RNG
alone, and MLX training on the CPU says that it is slow."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import make_plan, make_tokenizer

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel, ensure_mask_token, load
from mars.backends.torch.train import TorchTrainer
from mars.core.decode.loop import generate
from mars.core.decode.plan import Sampling
from mars.core.train.data import Example, encode_record, pad_to_block
from mars.core.train.loop import TrainSettings

QUIET = {"announce": lambda m: None}
IDS = [1, 30, 12, 7, 44, 9, 60, 5, 18, 71, 26, 33, 40, 13, 55, 21]
# A theta unlike mlx-lm's default (10000), with and without llama3 frequency scaling.
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
RECORDS = [{"prompt": "Say a", "completion": "aaaa aaaa"}, {"prompt": "Hi", "completion": "Hello there."}]


def save_rope_model(path: Path, rope: str = "default") -> Path:
    """A tiny llama whose config.json carries RoPE settings only as transformers 5 writes them."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        rope_parameters=dict(ROPES[rope]),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    written = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in written and written["rope_parameters"]["rope_theta"] == 500000.0
    return path


def hf_logits(path: Path) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().numpy()


def mlx_lm_logits(path: Path) -> np.ndarray:
    """Plain mlx-lm, given nothing but the folder."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(path))
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def assert_same_in_both(path: Path) -> np.ndarray:
    hf = hf_logits(path)
    np.testing.assert_allclose(mlx_lm_logits(path), hf, atol=1e-4, rtol=0)
    return hf


def examples_of(tokenizer) -> list:
    out = []
    for rec in RECORDS:
        ids, labels = encode_record(rec, tokenizer, eos_id=tokenizer.eos_token_id)
        out.append(Example(*pad_to_block(ids, labels, 4, tokenizer.eos_token_id, ended=True), "x", False))
    return out


def torch_trainer(base: Path, out: Path, kind: str) -> tuple:
    tm = load(base, **QUIET)
    mars = ensure_mask_token(tm.model, tm.tokenizer, None, block_size=4, **QUIET)
    s = TrainSettings(fine_tune_type=kind, iters=1, batch_size=2, learning_rate=1e-3, steps_per_save=10**9)
    trainer = TorchTrainer(tm, mars, s, out)
    trainer.train(examples_of(tm.tokenizer), progress=False, log=lambda m: None)
    return trainer, tm


# -- 1. RoPE settings both libraries read --------------------------------------------------------


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_converted_hf_folder_loads_alike_in_mlx_lm_and_transformers(tmp_path, rope):
    from mars.convert.models import convert_model

    src = save_rope_model(tmp_path / "src", rope)
    want = hf_logits(src)
    convert_model(src, tmp_path / "hf", "hf", **QUIET)
    np.testing.assert_array_equal(assert_same_in_both(tmp_path / "hf"), want)
    # through mlx-lm's layout and back: the way back keeps what mlx-lm reads
    convert_model(src, tmp_path / "mlx", "mlx", **QUIET)
    convert_model(tmp_path / "mlx", tmp_path / "back", "hf", **QUIET)
    np.testing.assert_array_equal(assert_same_in_both(tmp_path / "back"), want)


@pytest.mark.parametrize("kind,fuse", [("full", False), ("lora", True)])
def test_torch_trained_whole_model_loads_alike_in_mlx_lm_and_transformers(tmp_path, kind, fuse):
    base = save_rope_model(tmp_path / "base")
    trainer, tm = torch_trainer(base, tmp_path / "out", kind)
    trainer.save(tm.tokenizer, str(base), fuse=fuse)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert_same_in_both(tmp_path / "out")


def test_cached_default_model_from_an_older_version_is_repaired(tmp_path, monkeypatch):
    from mars.checkpoint.default_model import DEFAULT_NAME, default_model_dir

    monkeypatch.setenv("MARS_HOME", str(tmp_path / "home"))
    cached = save_rope_model(tmp_path / "home" / "models" / DEFAULT_NAME, "llama3")
    want = hf_logits(cached)
    assert default_model_dir(**QUIET) == cached
    assert json.loads((cached / "config.json").read_text())["rope_theta"] == 500000.0
    assert not [p.name for p in cached.parent.iterdir() if p.name != DEFAULT_NAME]  # no temporary left behind
    np.testing.assert_array_equal(assert_same_in_both(cached), want)
    before = (cached / "config.json").stat().st_mtime_ns
    default_model_dir(**QUIET)  # already repaired: left as it is
    assert (cached / "config.json").stat().st_mtime_ns == before


@pytest.mark.slow
def test_default_model_and_gguf_import_load_alike_in_mlx_lm_and_transformers(tmp_path, monkeypatch):
    """The real default (SmolLM2, RoPE theta 100000): both ways mars dequantizes a GGUF."""
    from mars.checkpoint.default_model import default_gguf, default_model_dir
    from mars.convert.models import import_gguf

    monkeypatch.setenv("MARS_HOME", str(tmp_path / "home"))
    for path in (default_model_dir(**QUIET), import_gguf(default_gguf(), tmp_path / "imported", **QUIET)):
        config = json.loads((path / "config.json").read_text())
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
        np.testing.assert_allclose(mlx_lm_logits(path), hf_logits(path), atol=1e-3, rtol=0)


# -- 2. no local base path in an adapter's files -------------------------------------------------


def text_files_naming(directory: Path, needle: str) -> list[str]:
    out = []
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.suffix in (".md", ".json", ".jsonl", ".txt", ".jinja") and needle in p.read_text():
            out.append(p.name)
    return out


def test_torch_lora_output_names_no_local_base_path(tmp_path):
    from huggingface_hub import ModelCard

    from mars.checkpoint.default_model import DEFAULT_REF

    base = save_rope_model(tmp_path / "base")
    trainer, tm = torch_trainer(base, tmp_path / "adapter", "lora")
    trainer.save(tm.tokenizer, str(base.resolve()))
    out = tmp_path / "adapter"
    # mars.json keeps the base: it is what loading the adapter resolves
    assert text_files_naming(out, str(base.resolve())) == ["mars.json"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and not [t for t in card.data.tags or () if t.startswith("base_model:")]
    again = load(out, **QUIET)
    assert Path(again.path) == out and again.mars.base_model == str(base.resolve())
    keep = [
        i for i in range(len(tm.tokenizer)) if i != trainer.mars.mask_token_id
    ]  # tied: the trained mask row moves its logit
    with torch.no_grad():
        torch.testing.assert_close(
            again.model(torch.tensor([IDS])).logits[..., keep],
            trainer.model(torch.tensor([IDS])).logits[..., keep],
            atol=1e-4,
            rtol=1e-4,
        )

    # a portable reference is recorded as given
    trainer.output = tmp_path / "named"
    trainer.save(tm.tokenizer, DEFAULT_REF)
    card = ModelCard.load(tmp_path / "named" / "README.md")
    assert card.data.base_model == DEFAULT_REF and f"base_model:adapter:{DEFAULT_REF}" in card.data.tags
    assert (
        json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == DEFAULT_REF
    )


def mlx_trainer(base: Path, out: Path, kind: str = "lora", announce=None):
    pytest.importorskip("mlx.core")
    from mars.backends.mlx.load import ensure_mask_token as mlx_mask_token
    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.mlx.train import MlxTrainer

    loaded = mlx_load(base, **QUIET)
    mars = mlx_mask_token(loaded.model, loaded.tokenizer, None, block_size=4, **QUIET)
    s = TrainSettings(fine_tune_type=kind, iters=1, batch_size=2, learning_rate=1e-3, steps_per_save=10**9, lora_rank=4)
    return MlxTrainer(loaded, mars, s, out, **({} if announce is None else {"announce": announce})), loaded


def test_mlx_lora_output_names_no_local_base_path(tmp_path):
    from mars.backends.mlx.load import load as mlx_load
    from mars.checkpoint.default_model import DEFAULT_REF

    base = save_rope_model(tmp_path / "base")
    trainer, loaded = mlx_trainer(base, tmp_path / "adapter")
    trainer.train(examples_of(loaded.tokenizer), progress=False, log=lambda m: None)
    trainer.save(loaded.tokenizer, str(base.resolve()))
    out = tmp_path / "adapter"
    assert text_files_naming(out, str(base.resolve())) == ["mars.json"]
    assert "model" not in json.loads((out / "adapter_config.json").read_text())
    again = mlx_load(out, **QUIET)
    assert again.mars.base_model == str(base.resolve())
    trainer.output = tmp_path / "named"
    trainer.save(loaded.tokenizer, DEFAULT_REF)
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["model"] == DEFAULT_REF


# -- 3. sampling without a seed ------------------------------------------------------------------


@pytest.mark.parametrize("lossless", [False, True])
def test_unseeded_sampling_leaves_the_global_torch_rng_alone(lossless):
    from tiny import make_model

    tok = make_tokenizer()
    tm = TorchModel(make_model("llama", len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    prompt = [
        tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)["input_ids"]
    ]
    settings = make_plan(
        mask_id=3,
        eos_ids=(2,),
        max_tokens=8,
        threshold=0.5,
        lossless=lossless,
        sampling=Sampling(temperature=1.0, seed=None),
    )
    torch.manual_seed(123)
    state = torch.get_rng_state()
    generate(TorchDecoder(tm), prompt, settings)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    generate(TorchDecoder(tm), prompt, settings)
    assert torch.equal(torch.rand(4), expected)


# -- 4. MLX training on the CPU ------------------------------------------------------------------


def test_mlx_training_on_the_cpu_says_it_is_slow(tmp_path, capsys):
    mx = pytest.importorskip("mlx.core")
    from mars.backends.mlx.load import ensure_mask_token as mlx_mask_token
    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.mlx.train import MlxTrainer

    base = save_rope_model(tmp_path / "base")
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    # as `mars finetune` builds it: the warning goes to stderr, where the command reports progress
    loaded = mlx_load(base, **QUIET)
    mars = mlx_mask_token(loaded.model, loaded.tokenizer, None, block_size=4, **QUIET)
    capsys.readouterr()
    MlxTrainer(loaded, mars, TrainSettings(fine_tune_type="lora", lora_rank=4), tmp_path / "out")
    captured = capsys.readouterr()
    assert ("MLX is running on the CPU" in captured.err) == on_cpu and "MLX is running" not in captured.out
    # or to the callback given
    lines = []
    mlx_trainer(base, tmp_path / "out2", announce=lines.append)
    assert len(lines) == on_cpu
    if on_cpu:
        assert (
            lines[0].startswith("warning: MLX is running on the CPU")
            and "--backend torch" in lines[0]
            and "\n" not in lines[0]
        )
