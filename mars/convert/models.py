"""Whole models between Hugging Face and mlx-lm directories (llama, qwen2, qwen3), and GGUF import.

For these architectures both sides use the same tensor names; the differences are that mlx-lm
drops `lm_head.weight` under tied embeddings and `rotary_emb.inv_freq`, may store affine-quantized
layers (`X.weight` packed uint32, `X.scales`, `X.biases`, config `quantization`), and reads RoPE
settings from `rope_theta` rather than transformers 5's `rope_parameters`: every output carries both.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..checkpoint.adapters import Lora, read_adapter, safe_output
from ..checkpoint.architectures import CONVERT, refusal
from ..checkpoint.hf_config import add_rope_keys, rope_overrides
from ..checkpoint.paths import MASK_EMBEDDING_FILE, MASK_EMBEDDING_KEY
from ..checkpoint.tensors import (
    DTYPE_NAMES,
    DTYPES,
    ConvertError,
    Tensor,
    cast,
    from_float32,
    read_safetensors,
    read_weights,
    to_float32,
    write_weights,
)
from ..core.files import atomic_dir
from .quant import BITS, GROUP_SIZES, dequantize, quantize

SUPPORTED = CONVERT  # mars.checkpoint.architectures: the table, as tests/test_architectures.py checks it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_SKIP = ("config.json", "model.safetensors.index.json")  # rewritten, never copied


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: unreadable JSON ({str(e).splitlines()[0]})") from None


def read_config(src: Path) -> dict:
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src}: no config.json (not a model directory)")
    config = _json(src / "config.json")
    arch = config.get("model_type", "?")
    refused = refusal(arch, f"{src}/config.json", "convert")
    if refused:
        raise ConvertError(refused)
    return config


def quantization_of(config: dict, where: Path) -> dict | None:
    """mlx-lm's {"group_size", "bits", "mode"} or None for a float model."""
    q = config.get("quantization")
    if q is None:
        qc = config.get("quantization_config")
        if qc is None:
            return None
        if "quant_method" in qc or "bits" not in qc:
            raise ConvertError(
                f"{where}/config.json: quantization method {qc.get('quant_method', '?')!r} is not supported (mlx-lm "
                f"affine only); dequantize the model first"
            )
        q = qc
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise ConvertError(f"{where}/config.json: quantization mode {mode!r} is not supported (affine only)")
    return q


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of a SUPPORTED architecture holds, with its shape."""
    try:
        h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        vocab = config["vocab_size"]
    except KeyError as e:
        raise ConvertError(f"config.json: missing {e.args[0]}") from None
    hd = config.get("head_dim") or h // heads
    arch = config["model_type"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    llama_like = arch in ("llama", "mistral", "granite", "smollm3", "qwen3_moe", "mixtral")
    attn_bias = arch == "qwen2" or (llama_like and config.get("attention_bias"))
    for i in range(layers):
        p = f"model.layers.{i}."
        norms = {
            "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
            "gemma3_text": (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
        }
        shapes.update(
            {f"{p}{n}.weight": (h,) for n in norms.get(arch, ("input_layernorm", "post_attention_layernorm"))}
        )
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if arch == "phi3":  # fused projections
            shapes[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * kv) * hd, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
            continue
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * hd, h),
                p + "self_attn.k_proj.weight": (kv * hd, h),
                p + "self_attn.v_proj.weight": (kv * hd, h),
            }
        )
        experts = expert_layer(config, i)
        if experts:
            del shapes[p + "mlp.down_proj.weight"]
            shapes.update(expert_shapes(config, i, experts, h))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)})
        if attn_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (heads * hd,),
                    p + "self_attn.k_proj.bias": (kv * hd,),
                    p + "self_attn.v_proj.bias": (kv * hd,),
                }
            )
        if llama_like and config.get("attention_bias"):
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if llama_like and config.get("mlp_bias"):
            shapes.update(
                {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,), p + "mlp.down_proj.bias": (h,)}
            )
        if arch in ("qwen3", "gemma3_text", "qwen3_moe"):  # per-head norms
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if arch == "olmo2":  # norms over all heads
            shapes.update({p + "self_attn.q_norm.weight": (heads * hd,), p + "self_attn.k_norm.weight": (kv * hd,)})
    return shapes


# A mixture of experts: (the block's name, each expert's projections in Hugging Face names ->
# mlx-lm's). Hugging Face checkpoints hold one tensor per expert; mlx-lm stacks them into one
# `switch_mlp` tensor per projection (experts first), as its `sanitize` does on loading.
EXPERTS = {
    "qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}


def expert_count(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def expert_layer(config: dict, i: int) -> int:
    """How many experts layer `i` holds (0: a dense MLP)."""
    arch = config["model_type"]
    if arch == "mixtral":
        return expert_count(config)
    if arch != "qwen3_moe" or i in (config.get("mlp_only_layers") or []):
        return 0
    step = int(config.get("decoder_sparse_step") or 1)
    return expert_count(config) if (i + 1) % step == 0 else 0


def expert_shapes(config: dict, i: int, experts: int, h: int) -> dict:
    block, names = EXPERTS[config["model_type"]]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    p = f"model.layers.{i}.{block}."
    shapes = {p + "gate.weight": (experts, h)}
    for e in range(experts):
        for hf, mlx in names.items():
            shapes[f"{p}experts.{e}.{hf}.weight"] = (h, inter) if mlx == "down_proj" else (inter, h)
    return shapes


def expert_projections(config: dict):
    """Per projection of every layer with experts: (the Hugging Face names of its experts'
    tensors, expert by expert, mlx-lm's name of them stacked)."""
    block, names = EXPERTS[config["model_type"]]
    for i in range(config["num_hidden_layers"]):
        experts = expert_layer(config, i)
        for hf, mlx in names.items() if experts else ():
            yield (
                [f"model.layers.{i}.{block}.experts.{e}.{hf}.weight" for e in range(experts)],
                f"model.layers.{i}.{block}.switch_mlp.{mlx}.weight",
            )


def stack_experts(tensors: dict[str, Tensor], config: dict) -> dict[str, Tensor]:
    """Hugging Face names -> mlx-lm's: each projection's experts stacked into one tensor."""
    if config["model_type"] not in EXPERTS:
        return tensors
    out = dict(tensors)
    for names, stacked in expert_projections(config):
        parts = [out.pop(name) for name in names]
        out[stacked] = Tensor(parts[0].dtype, np.stack([t.array for t in parts]))
    return out


def unstack_experts(tensors: dict[str, Tensor], config: dict, where: Path) -> dict[str, Tensor]:
    """mlx-lm names -> Hugging Face's (a directory in Hugging Face names is returned as it is)."""
    if config["model_type"] not in EXPERTS or not any(".switch_mlp." in k for k in tensors):
        return tensors
    out = dict(tensors)
    for names, name in expert_projections(config):
        if name not in out:
            raise ConvertError(f"{where}: tensor {name} is missing")
        stacked = out.pop(name)
        if stacked.array.ndim != 3 or stacked.shape[0] != len(names):
            raise ConvertError(f"{where}: {name} has shape {list(stacked.shape)}, expected {len(names)} experts first")
        for e, expert in enumerate(names):
            out[expert] = Tensor(stacked.dtype, np.ascontiguousarray(stacked.array[e]))
    return out


def check_shapes(tensors: dict[str, Tensor], config: dict, where: Path) -> None:
    shapes = expected_shapes(config)
    tied = config.get("tie_word_embeddings", False)
    for name, t in tensors.items():
        if name not in shapes:
            raise ConvertError(f"{where}: unexpected tensor {name} for a {config['model_type']} model")
        if t.shape != shapes[name]:
            raise ConvertError(
                f"{where}: shape mismatch for {name}: {list(t.shape)} in the weights, {list(shapes[name])} from "
                f"config.json"
            )
        if not t.is_float:
            raise ConvertError(f"{where}: tensor {name} has non-float type {t.dtype}")
    for name in shapes:
        if name not in tensors and not (name == "lm_head.weight" and tied):
            raise ConvertError(f"{where}: tensor {name} is missing")


def load_tensors(src: Path, config: dict) -> dict[str, Tensor]:
    """The model's float tensors in Hugging Face / mlx-lm names (dequantized, sanitized as mlx-lm does)."""
    tensors = read_weights(src, exclude=(MASK_EMBEDDING_FILE,))
    q = quantization_of(config, src)
    if q is not None:
        bits, group = q.get("bits"), q.get("group_size")
        for name in sorted(n for n in tensors if n.endswith(".scales")):
            prefix = name[: -len(".scales")]
            per = q.get(prefix) if isinstance(q.get(prefix), dict) else {}
            b, g = per.get("bits", bits), per.get("group_size", group)
            if f"{prefix}.weight" not in tensors or f"{prefix}.biases" not in tensors:
                raise ConvertError(f"{src}: {name} without {prefix}.weight and {prefix}.biases")
            weight, scales, biases = tensors[f"{prefix}.weight"], tensors.pop(name), tensors.pop(f"{prefix}.biases")
            lead = weight.shape[:-1]  # stacked experts quantize row by row like any other matrix
            rows = [Tensor(t.dtype, t.array.reshape(-1, t.shape[-1])) for t in (weight, scales, biases)]
            flat = dequantize(prefix, *rows, b, g)
            tensors[f"{prefix}.weight"] = Tensor(flat.dtype, flat.array.reshape(*lead, flat.shape[-1]))
    tensors = unstack_experts({k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}, config, src)
    if config.get("tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def fuse(tensors: dict[str, Tensor], config: dict, lora: Lora, adapter: Path) -> None:
    """W += scale * B A for every adapted linear (float32 arithmetic, rounded back to W's type),
    and the trained mask-token row into the embedding."""
    for path in sorted(lora.a):
        name = f"{path}.weight"
        if name not in tensors:
            raise ConvertError(f"{adapter}: the adapter changes {path}, which the base model does not have")
        w = tensors[name]
        if lora.a[path].shape[1] != w.shape[1] or lora.b[path].shape[0] != w.shape[0]:
            raise ConvertError(
                f"{adapter}: shape mismatch for {path}: LoRA {lora.b[path].shape[0]}x{lora.a[path].shape[1]}, base "
                f"weight {list(w.shape)}"
            )
        tensors[name] = from_float32(to_float32(w) + lora.delta(path), w.dtype)
    row_file = adapter / MASK_EMBEDDING_FILE
    if not row_file.is_file():
        return
    from ..core.config import has_config
    from ..core.config import read_config as read_mars

    if not has_config(adapter):
        raise ConvertError(f"{adapter}: {MASK_EMBEDDING_FILE} without mars.json (the mask token id)")
    mask_id = read_mars(adapter).mask_token_id
    row = read_safetensors(row_file)[0].get(MASK_EMBEDDING_KEY)
    emb = tensors["model.embed_tokens.weight"]
    if row is None or row.shape != (emb.shape[1],):
        raise ConvertError(f"{row_file}: expected tensor {MASK_EMBEDDING_KEY} of shape [{emb.shape[1]}]")
    e = to_float32(emb)
    if mask_id >= e.shape[0]:  # the mask token was added: grow as the backends do (mean rows; zero head rows)
        grow = mask_id + 1 - e.shape[0]
        e = np.concatenate([e, np.broadcast_to(e.mean(0, keepdims=True), (grow, e.shape[1]))])
        if "lm_head.weight" in tensors:
            head = tensors["lm_head.weight"]
            tensors["lm_head.weight"] = from_float32(
                np.concatenate([to_float32(head), np.zeros((grow, e.shape[1]), np.float32)]), head.dtype
            )
        config["vocab_size"] = e.shape[0]
    e = np.array(e)
    e[mask_id] = to_float32(row)
    tensors["model.embed_tokens.weight"] = from_float32(e, emb.dtype)


def output_config(config: dict, to: str, dtype: str | None, quant: dict | None) -> dict:
    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if dtype is not None:
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = dtype
    config.update(rope_overrides(config))  # both layouts: mlx-lm reads either kind of directory
    if quant is not None:
        config["quantization"] = dict(quant)
        config["quantization_config"] = dict(quant)
    return config


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def refuse_gated(adapter: Path) -> None:
    """A gated adapter (mars.json gate: masks) cannot be fused: see core.config.GATED_FUSE_REFUSED."""
    from ..core.config import GATED_FUSE_REFUSED, has_config
    from ..core.config import read_config as read_mars

    if adapter.is_dir() and has_config(adapter) and read_mars(adapter).gate == "masks":
        raise ConvertError(f"{adapter}: {GATED_FUSE_REFUSED}")


def convert_model(
    src,
    output,
    to: str,
    *,
    dtype: str | None = None,
    q_bits: int | None = None,
    q_group_size: int = 64,
    adapter=None,
    overwrite: bool = False,
    announce=print,
    fuse_gated: bool = False,
) -> Path:
    """Convert a model directory (HF or mlx-lm, float or mlx-quantized) or a .gguf file into a
    Hugging Face (to='hf') or mlx-lm (to='mlx') directory at `output`, optionally fusing an adapter
    (PEFT or mlx-lm), casting float tensors (dtype 'float32'|'float16'|'bfloat16') and quantizing
    (to='mlx', q_bits). Nothing is written unless the whole conversion succeeds; an existing
    non-empty `output` is refused unless `overwrite`, and the sources never are one. A gated
    adapter is refused unless `fuse_gated` (a drafter's use: it runs the deltas everywhere)."""
    src, output = Path(src), Path(output)
    safe_output(output, (src, adapter), overwrite)
    if to not in ("hf", "mlx"):
        raise ConvertError(f"--to must be hf or mlx, got {to!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if q_bits is not None and to != "mlx":
        raise ConvertError("quantization (-q) writes mlx-lm layers; use --to mlx")
    if q_bits is not None and (q_bits not in BITS or q_group_size not in GROUP_SIZES):
        raise ConvertError(
            f"quantization takes {', '.join(map(str, BITS))} bits and groups of {', '.join(map(str, GROUP_SIZES))}, "
            f"got {q_bits} bits in groups of {q_group_size}"
        )
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    if src.is_file():
        if src.suffix != ".gguf":
            raise ConvertError(f"{src}: a model file must be .gguf (or give a model directory)")
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.gguf.") as tmp:
            imported = import_gguf(src, Path(tmp) / "hf", announce=announce)
            return convert_model(
                imported,
                output,
                to,
                dtype=dtype,
                q_bits=q_bits,
                q_group_size=q_group_size,
                adapter=adapter,
                overwrite=overwrite,
                announce=announce,
                fuse_gated=fuse_gated,
            )
    config = read_config(src)
    if not _has_tokenizer(src) and not (adapter is not None and _has_tokenizer(Path(adapter))):
        raise ConvertError(
            f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy them in from the original model"
        )
    tensors = load_tensors(src, config)
    check_shapes(tensors, config, src)
    lora = None
    if adapter is not None:
        adapter = Path(adapter)
        if not fuse_gated:
            refuse_gated(adapter)
        lora = read_adapter(adapter)
        fuse(tensors, config, lora, adapter)
    if dtype is not None:
        tensors = {k: cast(t, DTYPES[dtype]) for k, t in tensors.items()}
    quant = None
    if q_bits is not None and config["model_type"] in EXPERTS:
        raise ConvertError(
            f"{src}: quantizing a mixture of experts is not supported here (mlx-lm keeps its router at other "
            "settings); convert without -q, then quantize with mlx_lm.convert"
        )
    if q_bits is not None:
        quant = {"group_size": q_group_size, "bits": q_bits, "mode": "affine"}
        out = {}
        for name, t in tensors.items():
            if t.array.ndim == 2 and name.endswith(".weight") and t.shape[-1] % q_group_size == 0:
                prefix = name[: -len(".weight")]
                out[name], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = quantize(prefix, t, q_bits, q_group_size)
            else:
                out[name] = t
        tensors = out
    new_config = output_config(config, to, dtype, quant)
    if dtype is None and quantization_of(config, src) is not None:
        floats = {t.dtype for t in tensors.values() if t.is_float}
        if len(floats) == 1:
            new_config["dtype"] = DTYPE_NAMES.get(floats.pop(), new_config.get("dtype"))

    def write(d: Path):
        for p in sorted(src.iterdir()):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in _SKIP:
                shutil.copy2(p, d / p.name)
        if adapter is not None:  # the adapter's tokenizer (it may have added the mask token) and mars.json
            for p in sorted(adapter.iterdir()):
                if p.is_file() and (
                    p.name in TOKENIZER_FILES
                    or p.name in ("special_tokens_map.json", "chat_template.jinja", "added_tokens.json", "mars.json")
                ):
                    shutil.copy2(p, d / p.name)
        write_weights(d, stack_experts(tensors, config) if to == "mlx" else tensors, to)
        (d / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        if adapter is not None:
            _carry_fused(src, adapter, d, output)

    return atomic_dir(output, write)


def _carry_fused(src: Path, adapter: Path, d: Path, output: Path) -> None:
    """What a fused model needs to decode as the adapter did (its draft corpus; mars.json came
    with the tokenizer files), and a model card in place of the base's."""
    from ..checkpoint.card import fused_card
    from ..checkpoint.default_model import model_ref
    from ..core.config import has_config
    from ..core.config import read_config as read_mars
    from ..core.decode.drafts import corpus

    if (adapter / corpus.FILE).is_file():
        shutil.copy2(adapter / corpus.FILE, d / corpus.FILE)
    mars = read_mars(adapter) if has_config(adapter) else None
    card = fused_card(Path(os.path.abspath(output)), base=model_ref(src), adapter=adapter, mars=mars)
    (d / "README.md").write_text(card)


def import_gguf(gguf: Path, target: Path, announce=print) -> Path:
    """A GGUF file dequantized (by transformers) into a float32 Hugging Face directory."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ConvertError(
            "GGUF import uses transformers and torch; install them (pip install torch transformers gguf)"
        ) from None
    announce(f"importing {gguf.name} (dequantizing through transformers)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as e:
        raise ConvertError(
            f"{gguf}: cannot import this GGUF ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    add_rope_keys(target)
    return target
