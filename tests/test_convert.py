"""`mars convert`: HF <-> MLX models (float, quantized), PEFT <-> mlx-lm adapters, fusing, GGUF
import, and one-line errors that leave nothing behind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from tiny import make_model, make_tokenizer

from mars.checkpoint.hf_config import rope_overrides
from mars.checkpoint.tensors import Tensor, from_float32, to_float32, write_safetensors
from mars.cli.main import cli
from mars.convert import ConvertError, convert_adapter, convert_model, read_safetensors

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

IDS = [1, 10, 20, 30, 40, 50, 60, 70, 11, 12, 13]


def invoke(*args):
    return CliRunner().invoke(cli, ["convert", *[str(a) for a in args]])


def save_hf(path, arch="llama", dtype=torch.float32, seed=0, hidden=64):
    tok = make_tokenizer()
    model = make_model(arch, len(tok), seed=seed, hidden=hidden).to(dtype)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model


def tensors_of(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        if f.name != "mask_embedding.safetensors":
            out.update(read_safetensors(f)[0])
    return out


def same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].array.tobytes() == b[k].array.tobytes(), k


def hf_logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float().numpy()


def mlx_logits(path, adapter=None, float32=False):
    from mlx_lm.utils import load

    # an HF directory needs its rope_parameters spelled out for mlx-lm (as the MLX backend does)
    overrides = rope_overrides(json.loads((path / "config.json").read_text()))
    model, _ = load(str(path), adapter_path=str(adapter) if adapter else None, model_config=overrides)
    if float32:  # half-precision weights computed in float32, as hf_logits does
        model.set_dtype(mx.float32)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


# -- models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("qwen3", torch.float16)])
def test_hf_mlx_hf_bit_exact_and_loadable(tmp_path, arch, dtype):
    src = tmp_path / "hf"
    save_hf(src, arch, dtype)
    ok = invoke(src, "--to", "mlx", "--output", tmp_path / "mlx")
    assert ok.exit_code == 0, ok.output
    mlx_t = tensors_of(tmp_path / "mlx")
    assert ("lm_head.weight" in mlx_t) == (arch == "qwen2")  # tied embeddings: mlx-lm keeps no head
    assert json.loads((tmp_path / "mlx/config.json").read_text()).get("rope_theta") is not None
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "mlx" / f).is_file()
    assert invoke(tmp_path / "mlx", "--to", "hf", "--output", tmp_path / "back").exit_code == 0
    same_tensors(tensors_of(src), tensors_of(tmp_path / "back"))
    # the same config, plus the RoPE keys mlx-lm reads beside transformers 5's rope_parameters
    src_config = json.loads((src / "config.json").read_text())
    assert {**src_config, **rope_overrides(src_config)} == json.loads((tmp_path / "back/config.json").read_text())
    assert rope_overrides(src_config) and "rope_theta" in json.loads((tmp_path / "back/config.json").read_text())
    # real clients: mlx_lm on the MLX output and transformers on the HF output of that MLX model
    # mlx_lm reads the MLX output as it reads the HF source; transformers reads the HF output of
    # that MLX model like the source, and both agree across frameworks (in float32 arithmetic)
    np.testing.assert_array_equal(mlx_logits(tmp_path / "mlx"), mlx_logits(src))
    np.testing.assert_array_equal(hf_logits(tmp_path / "back"), hf_logits(src))
    np.testing.assert_allclose(
        hf_logits(tmp_path / "back"), mlx_logits(tmp_path / "mlx", float32=True), atol=1e-4, rtol=0
    )


def test_dtype_cast_matches_torch(tmp_path):
    model = save_hf(tmp_path / "hf", "qwen2")
    convert_model(tmp_path / "hf", tmp_path / "bf", "mlx", dtype="bfloat16", announce=lambda m: None)
    out = tensors_of(tmp_path / "bf")
    assert json.loads((tmp_path / "bf/config.json").read_text())["dtype"] == "bfloat16"
    for name, p in model.state_dict().items():
        want = p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert out[name].dtype == "BF16" and (out[name].array == want).all(), name
    x = np.array([1.0, -2.5, 3.14159, 1e-30, np.inf, -np.inf, 65504.0, 1.00390625, 1.01171875], np.float32)
    assert (to_float32(from_float32(x, "BF16")) == torch.tensor(x).to(torch.bfloat16).float().numpy()).all()
    assert np.isnan(to_float32(from_float32(np.array([np.nan], np.float32), "BF16"))).all()


def mlx_quantized(src, dst, bits, group):
    """An mlx-lm quantized model written by mlx-lm itself."""
    from mlx_lm.utils import load, quantize_model, save_config, save_model

    model, tok = load(str(src))
    model, config = quantize_model(model, json.loads((src / "config.json").read_text()), group, bits)
    save_model(dst, model)
    save_config(config, dst / "config.json")
    tok.save_pretrained(str(dst))


@pytest.mark.parametrize("arch,bits,group", [("llama", 4, 64), ("qwen2", 8, 32), ("qwen3", 4, 32)])
def test_dequantize_matches_mlx_quantized_forward(tmp_path, arch, bits, group):
    save_hf(tmp_path / "hf", arch)
    mlx_quantized(tmp_path / "hf", tmp_path / "q", bits, group)
    assert invoke(tmp_path / "q", "--to", "hf", "--output", tmp_path / "deq").exit_code == 0
    config = json.loads((tmp_path / "deq/config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    deq = tensors_of(tmp_path / "deq")
    assert all(t.dtype == "F32" for t in deq.values())
    # each dequantized tensor equals mx.dequantize of the packed one, bit for bit
    q = tensors_of(tmp_path / "q")
    w = "model.layers.0.mlp.down_proj"
    ref = mx.dequantize(
        mx.array(q[w + ".weight"].array),
        mx.array(q[w + ".scales"].array),
        mx.array(q[w + ".biases"].array),
        group_size=group,
        bits=bits,
    )
    assert (np.array(ref) == deq[w + ".weight"].array).all()
    np.testing.assert_allclose(hf_logits(tmp_path / "deq"), mlx_logits(tmp_path / "q"), atol=1e-4, rtol=0)


def test_quantize_writes_what_mlx_lm_writes(tmp_path):
    save_hf(tmp_path / "hf", "qwen2")
    mlx_quantized(tmp_path / "hf", tmp_path / "ref", 4, 32)
    r = invoke(tmp_path / "hf", "--to", "mlx", "--output", tmp_path / "q", "-q", "--q-bits", 4, "--q-group-size", 32)
    assert r.exit_code == 0, r.output
    same_tensors(tensors_of(tmp_path / "ref"), tensors_of(tmp_path / "q"))
    config = json.loads((tmp_path / "q/config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    np.testing.assert_array_equal(mlx_logits(tmp_path / "q"), mlx_logits(tmp_path / "ref"))


# -- adapters --------------------------------------------------------------------------------


def peft_adapter(base, out, *, rank=4, alpha=8):
    from peft import LoraConfig, get_peft_model

    from mars.core.config import MarsConfig, write_config

    model = get_peft_model(
        base,
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"),
    )
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    row = torch.randn(base.config.hidden_size)
    write_safetensors(out / "mask_embedding.safetensors", {"mask_embedding": Tensor("F32", row.numpy())})
    write_config(MarsConfig(block_size=4, mask_token="<unused0>", mask_token_id=3), out)
    model.eval()
    return model, row


def test_peft_mlx_peft_round_trip_and_logits(tmp_path):
    base = save_hf(tmp_path / "hf", "llama")
    peft_model, _ = peft_adapter(base, tmp_path / "peft")
    assert invoke(tmp_path / "peft", "--to", "mlx", "--output", tmp_path / "mlxa").exit_code == 0
    cfg = json.loads((tmp_path / "mlxa/adapter_config.json").read_text())
    assert cfg["num_layers"] == 2 and cfg["lora_parameters"]["scale"] == 2.0
    assert cfg["lora_parameters"]["keys"] == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert (tmp_path / "mlxa/mask_embedding.safetensors").read_bytes() == (
        tmp_path / "peft/mask_embedding.safetensors"
    ).read_bytes()
    assert (tmp_path / "mlxa/mars.json").is_file()
    with torch.no_grad():
        ref = peft_model(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(mlx_logits(tmp_path / "hf", tmp_path / "mlxa"), ref, atol=1e-4, rtol=0)
    assert invoke(tmp_path / "mlxa", "--to", "hf", "--output", tmp_path / "back").exit_code == 0
    assert (
        read_safetensors(tmp_path / "peft/adapter_model.safetensors")[0].keys()
        == read_safetensors(tmp_path / "back/adapter_model.safetensors")[0].keys()
    )
    same_tensors(
        read_safetensors(tmp_path / "peft/adapter_model.safetensors")[0],
        read_safetensors(tmp_path / "back/adapter_model.safetensors")[0],
    )
    assert json.loads((tmp_path / "peft/adapter_config.json").read_text()) == json.loads(
        (tmp_path / "back/adapter_config.json").read_text()
    )


def test_mlx_adapter_to_peft_logits(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load
    from peft import PeftModel

    save_hf(tmp_path / "hf", "qwen2")
    model, _ = load(str(tmp_path / "hf"))
    model.freeze()
    params = {"rank": 4, "scale": 2.5, "dropout": 0.0, "keys": ["self_attn.k_proj", "mlp.up_proj"]}
    linear_to_lora_layers(model, 1, params)  # the last layer only
    mx.random.seed(0)
    adapted = dict(tree_flatten(model.trainable_parameters()))
    adapted = {k: mx.random.normal(v.shape) * 0.2 for k, v in adapted.items()}
    (tmp_path / "mlxa").mkdir()
    mx.save_safetensors(str(tmp_path / "mlxa/adapters.safetensors"), adapted)
    (tmp_path / "mlxa/adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": params})
    )
    ref = mlx_logits(tmp_path / "hf", tmp_path / "mlxa")
    convert_adapter(tmp_path / "mlxa", tmp_path / "peft", "hf")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        got = pm(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # and back to mlx-lm: the same tensors and layer placement (the base gives the layer count)
    convert_adapter(tmp_path / "peft", tmp_path / "again", "mlx", base=tmp_path / "hf")
    same_tensors(
        read_safetensors(tmp_path / "mlxa/adapters.safetensors")[0],
        read_safetensors(tmp_path / "again/adapters.safetensors")[0],
    )
    assert json.loads((tmp_path / "again/adapter_config.json").read_text())["num_layers"] == 1


@pytest.mark.parametrize("to", ["hf", "mlx"])
def test_fuse(tmp_path, to):
    from mars.core.decode.drafts import corpus

    base = save_hf(tmp_path / "hf", "llama")
    (tmp_path / "hf" / "README.md").write_text("the base model's own card")
    peft_model, row = peft_adapter(base, tmp_path / "peft")
    corpus.DraftCorpus([[5, 6, 7, 8, 9]]).save(tmp_path / "peft" / corpus.FILE)
    (tmp_path / "peft" / "training_log.jsonl").write_text(
        json.dumps({"step": 7, "noisy": 2.5, "clean": 1.25, "val_noisy": 3.5}) + "\n"
    )
    r = invoke(tmp_path / "hf", "--to", to, "--output", tmp_path / "fused", "--adapter", tmp_path / "peft", "--fuse")
    assert r.exit_code == 0, r.output
    with torch.no_grad():
        merged = peft_model.merge_and_unload()
        merged.get_input_embeddings().weight[3] = row
        ref = merged(torch.tensor([IDS])).logits[0].numpy()
    got = hf_logits(tmp_path / "fused") if to == "hf" else mlx_logits(tmp_path / "fused")
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert (tmp_path / "fused/mars.json").read_text() == (tmp_path / "peft/mars.json").read_text()
    assert to_float32(tensors_of(tmp_path / "fused")["model.embed_tokens.weight"])[3].tolist() == row.tolist()
    # what it needs to decode as the adapter did, and a model card of its own
    assert (tmp_path / "fused" / corpus.FILE).read_bytes() == (tmp_path / "peft" / corpus.FILE).read_bytes()
    card = (tmp_path / "fused/README.md").read_text()
    assert "base model's own card" not in card
    for needle in (
        "MARS objective",
        "| `block_size` | `4` |",
        "| `mask_token_id` | `3` |",
        "step 7",
        "noisy 2.5000",
        "val_noisy 3.5000",
        "AutoModelForCausalLM.from_pretrained",
        "mlx_lm generate --model",
        "python -m vllm.entrypoints.openai.api_server --model",
        "--dtype float32",
        "--to vllm",
    ):
        assert needle in card, needle


# -- bad input -------------------------------------------------------------------------------


def one_line_failure(result, out, *needles):
    assert result.exit_code != 0
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()
    assert not out.parent.exists() or not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def edit_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


def test_bad_inputs(tmp_path):
    src = tmp_path / "hf"
    save_hf(src, "llama")
    out = tmp_path / "out" / "model"

    bad = tmp_path / "arch"
    shutil.copytree(src, bad)
    edit_config(bad, model_type="gpt2")
    one_line_failure(invoke(bad, "--to", "mlx", "--output", out), out, "config.json", "'gpt2'")

    bad = tmp_path / "shape"
    shutil.copytree(src, bad)
    edit_config(bad, intermediate_size=96)
    one_line_failure(
        invoke(bad, "--to", "mlx", "--output", out), out, "shape mismatch", "model.layers.0.mlp.down_proj.weight"
    )

    bad = tmp_path / "notok"
    shutil.copytree(src, bad)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).unlink()
    one_line_failure(invoke(bad, "--to", "mlx", "--output", out), out, "no tokenizer files")

    q = tmp_path / "q"
    mlx_quantized(src, q, 4, 64)
    bad = tmp_path / "bits"
    shutil.copytree(q, bad)
    edit_config(bad, quantization={"group_size": 64, "bits": 7}, quantization_config={"group_size": 64, "bits": 7})
    one_line_failure(invoke(bad, "--to", "hf", "--output", out), out, "7-bit quantization is not supported")
    edit_config(bad, quantization=None, quantization_config={"quant_method": "gptq", "bits": 4})
    one_line_failure(invoke(bad, "--to", "hf", "--output", out), out, "'gptq'")

    one_line_failure(invoke(tmp_path / "nope", "--to", "hf", "--output", out), out, "no such file")
    one_line_failure(invoke(src, "--to", "hf", "--output", out, "-q"), out, "--to mlx")
    # an existing output survives a failed conversion untouched, even one asked to replace it
    out.mkdir(parents=True)
    (out / "keep").write_text("x")
    with pytest.raises(ConvertError):
        convert_model(tmp_path / "arch", out, "hf", overwrite=True)
    assert (out / "keep").read_text() == "x" and len(list(out.parent.iterdir())) == 1


def test_bad_adapter(tmp_path):
    base = save_hf(tmp_path / "hf", "llama")
    peft_adapter(base, tmp_path / "peft")
    f = tmp_path / "peft/adapter_model.safetensors"
    t = read_safetensors(f)[0]
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    t[key] = Tensor("F32", np.zeros((3, 64), np.float32))
    write_safetensors(f, t)
    out = tmp_path / "o"
    one_line_failure(
        invoke(tmp_path / "peft", "--to", "mlx", "--output", out),
        out,
        "shape mismatch",
        "model.layers.1.self_attn.q_proj",
    )
    one_line_failure(invoke(tmp_path / "peft", "--to", "hf", "--output", out), out, "already a PEFT adapter")


@pytest.mark.slow
def test_gguf_import(tmp_path):
    from mars.checkpoint.default_model import default_gguf

    gguf = default_gguf()
    r = invoke(gguf, "--to", "mlx", "--output", tmp_path / "mlx")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "mlx/config.json").read_text())
    assert config["model_type"] == "llama" and (tmp_path / "mlx/tokenizer.json").is_file()
    assert invoke(tmp_path / "mlx", "--to", "hf", "--output", tmp_path / "hf").exit_code == 0
    np.testing.assert_allclose(mlx_logits(tmp_path / "mlx"), hf_logits(tmp_path / "hf"), atol=1e-3, rtol=0)
