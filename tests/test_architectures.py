"""The architecture table, tested: every architecture mars names as supported, as a tiny random
model built here, on both backends.

- The MARS training mask is the attention the model really applies: the training forward's
  outputs equal plain causal forwards computed by transformers with its own masks (its own
  sliding windows included), for windows larger and smaller than the sequence.
- torch: threshold 1.0 equals transformers' greedy `generate`; lossless equals AR; cached
  equals uncached; batched rows (holes, per-row positions) equal the rows alone.
- MLX (mars.backends.mlx.load.SUPPORTED): the same tokens as torch on the same weights, the
  same training losses, lossless equal to AR.
- `mars convert` HF -> MLX -> HF bit for bit (mars.convert.SUPPORTED), and `--to vllm` writes a
  drafter transformers loads with the checkpoint's logits.
"""

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from tiny import ARCHITECTURES, make_model, make_plan, make_tokenizer, save_model

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.forward import model_windows
from mars.backends.torch.load import TorchModel
from mars.backends.torch.loss import MarsLoss, loss_inputs
from mars.core.decode.loop import generate
from mars.core.loss import IGNORE

MASK, EOS, B = 3, 2, 4
SMALL_WINDOW = 6  # smaller than every sequence below: the window cuts
SLIDING = ("mistral", "gemma3_text")  # on both backends
# (architecture, window): every architecture at its own settings, and the sliding ones with a small window.
CASES = [(a, None) for a in ARCHITECTURES] + [(a, SMALL_WINDOW) for a in SLIDING + ("ministral",)]
PROMPTS = ["Hello there, how are you today?", "x", "Write a short poem about the sea"]


def case_id(case):
    arch, window = case
    return arch if window is None else f"{arch}-window{window}"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


_MODELS = {}


def tiny_torch(tok, arch, window):
    key = (arch, window)
    if key not in _MODELS:
        _MODELS[key] = TorchModel(
            make_model(arch, len(tok), seed=1, window=window), tok, None, "", torch.device("cpu"), torch.float32
        )
    return _MODELS[key]


def prompts_of(tok):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS
    ]


def settings(**kw):
    return make_plan(**dict(dict(mask_id=MASK, eos_ids=(EOS,), block_size=B, max_tokens=20, block_cache=8), **kw))


# -- the training mask is what the model applies -----------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_forward_is_the_method_rule_under_the_models_own_attention(tok, case):
    """Each output of the MARS training forward equals the output of a plain causal forward by
    transformers (its own masks, its own sliding windows) on exactly what the METHOD §3 rule
    lets that query see: a clean query, the clean prefix; a noisy query of block b, the clean
    tokens of blocks < b followed by its own block's noisy tokens up to itself."""
    tm = tiny_torch(tok, *case)
    model = tm.model
    L = 16
    rng = np.random.default_rng(0)
    ids = rng.integers(10, len(tok) - 1, size=(1, L))
    labels = ids.copy()
    labels[0, :3] = IGNORE  # a prompt of 3 tokens: the noisy stream keeps them as they are
    inputs = loss_inputs(
        ids, labels, np.array([L]), B, MASK, torch.float32, "cpu", trim=False, windows=model_windows(model)
    )
    rule = loss_inputs(ids, labels, np.array([L]), B, MASK, torch.float32, "cpu", trim=False)["attn"]  # no window
    if case[1] is not None:  # a window smaller than the sequence: the sliding layers' mask is cut
        cut = inputs["attn"]["sliding_attention"] if isinstance(inputs["attn"], dict) else inputs["attn"]
        assert not torch.equal(cut, rule)
    else:  # a window past the sequence (or none) changes nothing
        assert isinstance(inputs["attn"], torch.Tensor) and torch.equal(inputs["attn"], rule)
    with torch.no_grad():
        hidden = MarsLoss(model).hidden(inputs["input_ids"], inputs["positions"], inputs["attn"])
        ours = MarsLoss(model).head(hidden)[0]
        noisy = inputs["input_ids"][0, :L]
        clean = torch.from_numpy(ids[0])
        reference = model(clean[None]).logits[0]
        torch.testing.assert_close(ours[L:], reference, atol=1e-4, rtol=1e-4)
        for block in range(L // B):
            seen = torch.cat([clean[: block * B], noisy[block * B : (block + 1) * B]])
            reference = model(seen[None]).logits[0, -B:]
            torch.testing.assert_close(ours[block * B : (block + 1) * B], reference, atol=1e-4, rtol=1e-4)


# -- torch decoding ------------------------------------------------------------------------------


def hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_decoding_is_exact(tok, case):
    tm = tiny_torch(tok, *case)
    prompts = prompts_of(tok)
    dec = TorchDecoder(tm)
    if case[1] is not None:  # the window really cuts: prompt and reply run past it
        assert len(prompts[0]) > case[1]
    for prompt in prompts:
        expected = hf_greedy(tm.model, prompt, 20)
        for cache in ("window", "none"):
            assert generate(dec, [prompt], settings(threshold=1.0, cache=cache)).tokens[0] == expected, cache
        assert generate(dec, [prompt], settings(lossless=True)).tokens[0] == expected
        assert generate(dec, [prompt], settings(lossless=True, cache="none")).tokens[0] == expected
    for threshold in (0.9, 0.3):  # forced thresholds on an untrained model: run, cached equal to uncached
        assert (
            generate(dec, prompts[:1], settings(threshold=threshold)).tokens
            == generate(dec, prompts[:1], settings(threshold=threshold, cache="none")).tokens
        )
    # A batch (holes, per-row positions and windows) gives each row its own output.
    for s in (settings(threshold=0.5), settings(threshold=0.5, cache="block"), settings(lossless=True)):
        assert generate(dec, prompts, s).tokens == [generate(dec, [p], s).tokens[0] for p in prompts], s


# -- MLX -----------------------------------------------------------------------------------------


def mlx_cases():
    from mars.backends.mlx.load import SUPPORTED

    return [c for c in CASES if c[0] in SUPPORTED]


_PAIRS = {}


def pair(tmp_path_factory, case):
    """(directory, MLX-loaded, torch-loaded) of a tiny model, built once per test session."""
    if case not in _PAIRS:
        from mars.backends.mlx.load import load as mlx_load
        from mars.backends.torch.load import load as torch_load

        arch, window = case
        path = save_model(tmp_path_factory.mktemp(case_id(case)) / "model", arch, seed=1, window=window)
        quiet = dict(announce=lambda m: None)
        _PAIRS[case] = (path, mlx_load(path, **quiet), torch_load(path, **quiet))
    return _PAIRS[case]


@pytest.mark.parametrize("case", mlx_cases(), ids=case_id)
def test_mlx_equals_torch_and_is_exact(tmp_path_factory, case):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.loss import loss_inputs as mlx_loss_inputs
    from mars.backends.mlx.loss import mars_losses

    path, m, t = pair(tmp_path_factory, case)
    prompts = prompts_of(t.tokenizer)
    ar = generate(TorchDecoder(t), prompts, settings(threshold=1.0)).tokens
    dec = MlxDecoder(m)
    for s in (
        settings(threshold=1.0),
        settings(threshold=1.0, cache="none"),
        settings(lossless=True),
        settings(lossless=True, cache="none"),
    ):
        assert generate(dec, prompts, s).tokens == ar, s
    for s in (settings(threshold=0.5), settings(threshold=0.5, cache="block")):
        assert generate(dec, prompts, s).tokens == generate(TorchDecoder(t), prompts, s).tokens, s
    # The training forward and loss agree across backends (the windows cut the same way).
    ids = np.array(
        [
            [5, 9, 12, 7, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41],
            [8, 6, 40, 41, 42, 43, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
        ]
    )
    labels = np.full(ids.shape, IGNORE)
    labels[0, 3:] = ids[0, 3:]
    labels[1, 2:8] = ids[1, 2:8]
    lengths = np.array([16, 8])
    torch_inputs = loss_inputs(ids, labels, lengths, B, MASK, torch.float32, "cpu", windows=model_windows(t.model))
    mlx_inputs = mlx_loss_inputs(ids, labels, lengths, B, MASK)
    theirs = MarsLoss(t.model)(**torch_inputs)
    ours = mars_losses(m.model, mlx_inputs)
    # Under LoRA the mask row is a parameter of its own, fed as embeddings: set to the model's
    # own row, it must change nothing on either backend (the embedding's scale included).
    row = t.model.get_input_embeddings().weight[MASK].detach().clone()
    with torch.no_grad():
        theirs_row = MarsLoss(t.model, torch.nn.Parameter(row), MASK)(**torch_inputs)
    ours_row = mars_losses(m.model, mlx_inputs, mask_row=mx.array(row.numpy()), mask_id=MASK)
    for a, b in zip(list(ours) + list(ours_row), list(theirs) + list(theirs_row)):
        assert abs(float(a.item()) - float(b)) < 1e-3 * max(1.0, abs(float(b)))


# -- mars convert ----------------------------------------------------------------------------------


def convert_cases():
    from mars.convert import SUPPORTED

    return [a for a in ARCHITECTURES if a in SUPPORTED]


def tensors_of(d):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(f)).items()})
    return out


@pytest.mark.parametrize("arch", convert_cases())
def test_convert_round_trip_and_vllm_export(tmp_path, arch):
    from clitools import invoke, ok

    from mars.core.config import MarsConfig, write_config

    src = save_model(tmp_path / "hf", arch, seed=1, window=SMALL_WINDOW if arch in SLIDING else None)
    ok(invoke("convert", src, "--to", "mlx", "--output", tmp_path / "mlx"))
    ok(invoke("convert", tmp_path / "mlx", "--to", "hf", "--output", tmp_path / "back"))
    before, after = tensors_of(src), tensors_of(tmp_path / "back")
    if "mlx_lm" in sys.modules or importlib.util.find_spec("mlx_lm"):
        # mlx-lm reads the MLX directory into the same weights as the Hugging Face one.
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load as mlx_lm_load

        from mars.checkpoint.hf_config import rope_overrides

        def weights(d):
            model, _ = mlx_lm_load(str(d), model_config=rope_overrides(json.loads((d / "config.json").read_text())))
            return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}

        theirs, ours = weights(src), weights(tmp_path / "mlx")
        assert sorted(theirs) == sorted(ours) and all(np.array_equal(theirs[k], ours[k]) for k in theirs)
        if arch in ("qwen3_moe", "mixtral"):
            assert any(".switch_mlp." in k for k in tensors_of(tmp_path / "mlx"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and np.array_equal(
            before[name].view(np.uint8), after[name].view(np.uint8)
        ), name
    # A full MARS checkpoint of this architecture exports as a vLLM drafter with its logits.
    write_config(MarsConfig(mask_token="<unused0>", mask_token_id=MASK, base_model=str(src)), src)
    ok(invoke("convert", src, "--to", "vllm", "-o", tmp_path / "vllm"))
    drafter = tmp_path / "vllm" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["mask_token_id"] == MASK
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 12, 7, 30, 31, 32, 33, 34, 35]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(drafter), dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)


# -- outside the table: one line, before any work -------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A model directory of an architecture outside the table."""
    from transformers import AutoModelForCausalLM, GPT2Config

    path = tmp_path_factory.mktemp("gpt2") / "model"
    tok = make_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    from mars.core.config import MarsConfig, write_config

    write_config(
        MarsConfig(mask_token="<unused0>", mask_token_id=MASK, base_model=str(path)), path
    )  # a MARS checkpoint
    return path


COMMANDS = [
    ("generate", "--prompt", "hi"),
    ("generate", "--prompt", "hi", "--backend", "mlx"),
    ("chat",),
    ("finetune", "--data", "{data}", "--output", "{tmp}/out", "--iters", "1"),
    ("finetune", "--data", "{data}", "--output", "{tmp}/out", "--iters", "1", "--backend", "mlx"),
    ("convert", "--to", "mlx", "--output", "{tmp}/mlx"),
    ("convert", "--to", "vllm", "--output", "{tmp}/vllm"),
    ("serve",),
    ("bench",),
    ("eval", "--data", "{data}", "--split", "train"),
]


@pytest.mark.parametrize(
    "command",
    COMMANDS,
    ids=lambda c: " ".join(
        c[:1] + c[-2:] if "--backend" in c else c[:1] + (("--to", c[2]) if c[0] == "convert" else ())
    ),
)
def test_an_architecture_outside_the_table_is_refused_in_one_line(gpt2, data, tmp_path, command):
    from clitools import invoke, one_line_error

    args = [a.format(data=data, tmp=tmp_path) for a in command]
    if args[0] == "convert":
        args = ["convert", str(gpt2), *args[1:]]
    else:
        args = [args[0], "--model", str(gpt2), *args[1:]]
    last = one_line_error(invoke(*args, input="hello\n"), "architecture 'gpt2'", "supported: llama")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlx").exists() and not (tmp_path / "vllm").exists(), (
        last
    )


def test_an_architecture_on_torch_only_points_there_from_mlx(tmp_path):
    from clitools import invoke, one_line_error

    model = save_model(tmp_path / "ministral", "ministral", seed=1)
    one_line_error(
        invoke("generate", "--backend", "mlx", "--model", model, "--prompt", "hi"),
        "architecture 'ministral'",
        "runs on the torch backend only: use --backend torch",
    )
    one_line_error(invoke("convert", model, "--to", "mlx", "--output", tmp_path / "mlx"), "architecture 'ministral'")


def test_a_mixture_of_experts_is_not_quantized_by_convert(tmp_path):
    from clitools import invoke, one_line_error

    src = save_model(tmp_path / "moe", "mixtral", seed=1)
    one_line_error(
        invoke("convert", src, "--to", "mlx", "-q", "--output", tmp_path / "mlx"),
        "mixture of experts",
        "mlx_lm.convert",
    )
    assert not (tmp_path / "mlx").exists()


# -- the sliding-window models through the CLI ------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_window_models_generate_through_the_cli(tmp_path, arch, backend):
    """`mars generate --lossless` gives AR's text and `--threshold 0.9 --force` runs, for a
    window smaller than prompt and reply."""
    from clitools import invoke, ok

    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    model = save_model(tmp_path / arch, arch, seed=1, window=SMALL_WINDOW)

    def run(*mode):
        args = (
            "generate",
            "--backend",
            backend,
            "--model",
            model,
            "--prompt",
            "Hello there, how are you today?",
            "--max-tokens",
            24,
            "--json",
            *mode,
        )
        return json.loads(next(line for line in ok(invoke(*args)).output.splitlines() if line.startswith("{")))

    ar = run("--threshold", "1.0")
    lossless = run("--lossless")
    assert ar["mode"] == "AR greedy" and lossless["mode"] == "lossless greedy"
    assert lossless["text"] == ar["text"] and lossless["tokens"] == ar["tokens"] > 0
    assert run("--threshold", "0.9", "--force")["tokens"] > 0


@pytest.mark.parametrize("cache", ["window", "block"])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("arch", SLIDING)
def test_a_served_batch_of_a_sliding_window_model_decodes_each_row_as_alone(
    tok, tmp_path_factory, arch, backend, cache
):
    """Rows join one every few steps and leave as they finish (the batch drops their keys):
    with a window smaller than every row, each row's tokens are its greedy AR tokens alone."""
    from mars.core.decode.loop import ContinuousBatch

    if backend == "torch":
        dec = TorchDecoder(tiny_torch(tok, arch, SMALL_WINDOW))
    else:
        pytest.importorskip("mlx_lm")
        from mars.backends.mlx.decode import MlxDecoder

        dec = MlxDecoder(pair(tmp_path_factory, (arch, SMALL_WINDOW))[1])
    prompts = prompts_of(tok) * 2
    s = settings(threshold=1.0, max_tokens=16, cache=cache)
    batch = ContinuousBatch(dec, s, keep_keys=dec.keep_keys)
    pending, rows, step = list(enumerate(prompts)), {}, 0
    while pending or batch.rows:
        if pending and pending[0][0] * 2 <= step and batch.can_join:
            i, p = pending.pop(0)
            rows[i] = batch.join(p, threshold=1.0 if i % 2 else 0.5, max_tokens=16 - 4 * (i % 3))
        batch.step()
        step += 1
    for i, p in enumerate(prompts):
        alone = generate(
            dec, [p], settings(threshold=1.0 if i % 2 else 0.5, max_tokens=16 - 4 * (i % 3), cache=cache)
        ).tokens[0]
        assert rows[i].out == alone, i


# -- a LoRA fine-tune, decoded on both backends --------------------------------------------------


@pytest.mark.parametrize("arch", ["phi3", "gemma3_text"])
def test_a_lora_adapter_decodes_alike_on_both_backends(tmp_path, data, arch):
    """Phi-3's fused projections take LoRA like the others; Gemma's scaled embedding takes the
    trained mask row as the backends feed it: the adapter (and its mask row) written by a torch
    fine-tune decodes to the same tokens on MLX, and its lossless output is its AR output."""
    pytest.importorskip("mlx_lm")
    from clitools import invoke, ok

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.torch.load import load as torch_load

    base = save_model(tmp_path / "base", arch, seed=1, window=SMALL_WINDOW if arch in SLIDING else None)
    out = tmp_path / "adapter"
    ok(
        invoke(
            "finetune",
            "--backend",
            "torch",
            "--model",
            base,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            3,
            "--batch-size",
            2,
            "--learning-rate",
            "1e-2",
        )
    )
    config = json.loads((out / "adapter_config.json").read_text())
    if arch == "phi3":
        assert {"qkv_proj", "gate_up_proj"} <= set(config["target_modules"])
    quiet = dict(announce=lambda m: None)
    t, m = torch_load(out, **quiet), mlx_load(out, **quiet)
    prompts = prompts_of(t.tokenizer)
    ar = generate(TorchDecoder(t), prompts, settings(threshold=1.0)).tokens
    for s in (settings(threshold=1.0), settings(lossless=True)):
        assert generate(MlxDecoder(m), prompts, s).tokens == ar
        assert generate(TorchDecoder(t), prompts, s).tokens == ar
    s = settings(threshold=0.5)
    assert generate(MlxDecoder(m), prompts, s).tokens == generate(TorchDecoder(t), prompts, s).tokens
