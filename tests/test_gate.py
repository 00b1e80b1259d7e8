"""Gated LoRA adapters (`--gate masks`): the deltas act at mask positions only, so every
real token runs the base weights, on both backends; such an adapter cannot be fused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from clitools import invoke, ok, one_line_error
from tiny import make_plan

from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import load as torch_load
from mars.core.decode.loop import generate
from mars.core.tokens import encode_prompt

PROMPTS = ["Spell from c", "Spell from k", "hello there"]
QUIET = dict(announce=lambda m: None)


@pytest.fixture(scope="module")
def gated(tiny, data, tmp_path_factory):
    """A gated LoRA adapter trained by `mars finetune` (torch) on the tiny base."""
    out = tmp_path_factory.mktemp("gated") / "adapter"
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--gate",
            "masks",
            "--iters",
            80,
            "--learning-rate",
            1e-2,
            "--lora-rank",
            8,
            "--backend",
            "torch",
            "--default-mode",
            "lossless",
        )
    )
    return out


def real_token_logits(tm, ids, mask_id):
    """Logits at every position, without the mask token's own column: with tied embeddings
    the trained mask row is also that token's output row (docs/method.md §7)."""
    with torch.no_grad():
        logits = tm.model(input_ids=torch.tensor([ids])).logits
    return torch.cat([logits[..., :mask_id], logits[..., mask_id + 1 :]], dim=-1)


def without(a: np.ndarray, column: int) -> np.ndarray:
    return np.delete(a, column, axis=-1)


def test_gated_training_leaves_every_real_token_output_equal_to_the_base(tiny, gated):
    assert json.loads((gated / "mars.json").read_text())["gate"] == "masks"
    base = torch_load(tiny, **QUIET)
    tm = torch_load(gated, **QUIET)
    assert tm.gate is not None
    mask = tm.mars.mask_token_id
    for p in PROMPTS:
        ids = encode_prompt(tm.tokenizer, p)
        tm.gate.set(torch.tensor([ids]))
        torch.testing.assert_close(
            real_token_logits(tm, ids, mask), real_token_logits(base, ids, mask), atol=1e-5, rtol=0
        )
        # ... while at mask positions the adapter acts: the masks' outputs moved.
        with_masks = ids + [mask] * 4
        tm.gate.set(torch.tensor([with_masks]))
        diff = (real_token_logits(tm, with_masks, mask) - real_token_logits(base, with_masks, mask))[0].abs()
        assert diff[: len(ids)].max() <= 1e-5 and diff[len(ids) :].max() > 1e-3


def test_the_decoding_form_of_a_gated_adapter_equals_its_peft_form(tiny, gated):
    """Loaded for decoding, the PEFT layers give way to GatedLoRALinear: the base layers alone
    where no mask is fed (bit for bit the base), the same deltas as PEFT's at the masks."""
    from mars.backends.torch.gate import DecodeGate, GatedLoRALinear, MaskGate

    dec, train, base = torch_load(gated, **QUIET), torch_load(gated, merge=False, **QUIET), torch_load(tiny, **QUIET)
    assert isinstance(dec.gate, DecodeGate) and isinstance(train.gate, MaskGate)
    assert sum(isinstance(m, GatedLoRALinear) for m in dec.model.modules()) > 0
    mask = dec.mars.mask_token_id
    for p in PROMPTS:
        ids = encode_prompt(dec.tokenizer, p)
        for fed in (ids, ids + [mask] * 4, [mask] + ids[1:] + [mask, ids[-1], mask]):
            x = torch.tensor([fed])
            dec.gate.set(x)
            train.gate.set(x)
            with torch.no_grad():
                ours, theirs = dec.model(input_ids=x).logits, train.model(input_ids=x).logits
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
            if mask not in fed:  # no mask fed: exactly the base's forward
                with torch.no_grad():
                    plain = base.model(input_ids=x).logits
                assert np.array_equal(without(ours.numpy(), mask), without(plain.numpy(), mask))
    dec.gate.set(torch.tensor([[mask] * 3]))
    with pytest.raises(RuntimeError, match="gate was set for 3 positions"):
        with torch.no_grad():
            dec.model(input_ids=torch.tensor([[mask] * 5]))


def test_a_gated_adapter_decodes_as_the_base_at_threshold_1_and_losslessly(tiny, gated):
    base = torch_load(tiny, **QUIET)
    tm = torch_load(gated, **QUIET)
    prompts = [encode_prompt(tm.tokenizer, p) for p in PROMPTS]
    settings = dict(mask_id=tm.mars.mask_token_id, eos_ids=tm.eos_ids, max_tokens=16)
    plain = generate(TorchDecoder(base), prompts, make_plan(**settings, threshold=1.0)).tokens
    assert generate(TorchDecoder(tm), prompts, make_plan(**settings, threshold=1.0)).tokens == plain
    lossless = generate(TorchDecoder(tm), prompts, make_plan(**settings, lossless=True))
    assert lossless.tokens == plain
    assert lossless.stats.draft_totals()["kept_per_slot"][0] > 0  # the masks drafted something that was kept
    # Compiled steps apply the adapter's delta times the gate's column on every row: the same tokens.
    compiled = TorchDecoder(tm, compile=True)
    assert generate(compiled, prompts, make_plan(**settings, lossless=True)).tokens == plain
    threshold = make_plan(**settings, threshold=0.5)
    assert generate(compiled, prompts, threshold).tokens == generate(TorchDecoder(tm), prompts, threshold).tokens


def test_a_gated_adapter_cannot_be_fused(tiny, data, gated, tmp_path):
    one_line_error(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            tmp_path / "f",
            "--gate",
            "masks",
            "--fuse",
            "--iters",
            1,
            "--backend",
            "torch",
        ),
        "gated adapter",
    )
    one_line_error(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            tmp_path / "g",
            "--gate",
            "masks",
            "--fine-tune-type",
            "full",
            "--iters",
            1,
            "--backend",
            "torch",
        ),
        "--gate",
    )
    one_line_error(
        invoke("convert", tiny, "--adapter", gated, "--fuse", "--to", "hf", "--output", tmp_path / "fused"),
        "gated adapter",
    )
    assert not (tmp_path / "f").exists() and not (tmp_path / "fused").exists()


def test_a_gated_adapter_loads_and_decodes_alike_on_mlx(tiny, gated, tmp_path):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from mars.backends.mlx.decode import MlxDecoder
    from mars.backends.mlx.forward import head, hidden_states
    from mars.backends.mlx.load import load as mlx_load

    ok(invoke("convert", gated, "--to", "mlx", "--output", tmp_path / "mlx-adapter", "--model", tiny))
    assert json.loads((tmp_path / "mlx-adapter" / "mars.json").read_text())["gate"] == "masks"
    m = mlx_load(tmp_path / "mlx-adapter", **QUIET)
    base = mlx_load(tiny, **QUIET)
    tm = torch_load(gated, **QUIET)
    assert m.gate is not None
    for p in PROMPTS:
        ids = encode_prompt(m.tokenizer, p)
        x = mx.array([ids])
        m.gate.set(x)
        ours = np.array(head(m.model, hidden_states(m.model, x, [(len(ids), 0)], "causal")).astype(mx.float32))
        plain = np.array(head(base.model, hidden_states(base.model, x, [(len(ids), 0)], "causal")).astype(mx.float32))
        mask = m.mars.mask_token_id
        np.testing.assert_allclose(without(ours, mask), without(plain, mask), atol=1e-5, rtol=0)
    prompts = [encode_prompt(m.tokenizer, p) for p in PROMPTS]
    s = make_plan(mask_id=m.mars.mask_token_id, eos_ids=m.eos_ids, max_tokens=16, lossless=True)
    assert generate(MlxDecoder(m), prompts, s).tokens == generate(TorchDecoder(tm), prompts, s).tokens


def test_gated_mlx_training_leaves_real_tokens_to_the_base(tiny, data, tmp_path):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from mars.backends.mlx.forward import head, hidden_states
    from mars.backends.mlx.load import load as mlx_load

    out = tmp_path / "mlx-gated"
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--gate",
            "masks",
            "--iters",
            20,
            "--learning-rate",
            5e-3,
            "--lora-rank",
            4,
            "--backend",
            "mlx",
        )
    )
    m = mlx_load(out, **QUIET)
    base = mlx_load(tiny, **QUIET)
    mask = m.mars.mask_token_id
    for p in PROMPTS:
        ids = encode_prompt(m.tokenizer, p)
        for fed, real in ((ids, True), (ids + [mask] * 4, False)):
            x = mx.array([fed])
            m.gate.set(x)
            ours = np.array(head(m.model, hidden_states(m.model, x, [(len(fed), 0)], "causal")).astype(mx.float32))
            plain = np.array(
                head(base.model, hidden_states(base.model, x, [(len(fed), 0)], "causal")).astype(mx.float32)
            )
            ours, plain = without(ours, mask), without(plain, mask)
            if real:
                np.testing.assert_allclose(ours, plain, atol=1e-5, rtol=0)
            else:
                np.testing.assert_allclose(ours[0, : len(ids)], plain[0, : len(ids)], atol=1e-5, rtol=0)
                assert np.abs(ours[0, len(ids) :] - plain[0, len(ids) :]).max() > 1e-3


# -- the distillation objective -------------------------------------------------------------------


def _batch(tok):
    from mars.core.train.data import encode_record, pad_to_block

    rows = [
        encode_record({"prompt": "Spell from c", "completion": "c d e f g"}, tok, eos_id=tok.eos_token_id),
        encode_record({"prompt": "hi", "completion": "hello there, friend"}, tok, eos_id=tok.eos_token_id),
    ]
    rows = [pad_to_block(i, lab, 4, tok.eos_token_id, ended=True) for i, lab in rows]
    width = max(len(i) for i, _ in rows)
    ids = np.full((2, width), tok.eos_token_id)
    labels = np.full((2, width), -100)
    for r, (i, lab) in enumerate(rows):
        ids[r, : len(i)], labels[r, : len(lab)] = i, lab
    return ids, labels, np.array([len(i) for i, _ in rows])


@pytest.mark.parametrize("temperature,mix", [(1.0, 1.0), (2.0, 1.0), (0.5, 0.3)])
def test_distill_loss_equals_a_hand_computed_kl(temperature, mix):
    from tiny import make_model, make_tokenizer

    from mars.backends.torch.loss import MarsLoss, loss_inputs

    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=2).eval()
    ids, labels, lengths = _batch(tok)
    inputs = loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu")
    with torch.no_grad():
        noisy, clean = MarsLoss(model, mask_id=3, distill=(temperature, mix))(**inputs)
        ce_noisy, ce_clean = MarsLoss(model, mask_id=3)(**inputs)
        # By hand: the logits at the noisy and the clean positions of each label, from a plain forward.
        from mars.backends.torch.forward import body_and_head

        body, head = body_and_head(model)
        h = body(
            input_ids=inputs["input_ids"], position_ids=inputs["positions"], attention_mask=inputs["attn"]
        ).last_hidden_state
        student = head(h[inputs["rows"], inputs["noisy_index"]]).double()
        teacher = head(h[inputs["rows"], inputs["clean_index"]]).double()
        p = torch.softmax(teacher / temperature, -1)
        kl = (p * (p.log() - torch.log_softmax(student / temperature, -1))).sum(-1) * temperature**2
        ce = torch.nn.functional.cross_entropy(student, inputs["targets"], reduction="none")
        want = (((1 - mix) * ce + mix * kl) * inputs["weights"].double()).sum()
    assert clean == pytest.approx(float(ce_clean), rel=1e-6)  # the AR term is untouched
    assert float(noisy) == pytest.approx(float(want), rel=1e-4)
    assert float(noisy) != pytest.approx(float(ce_noisy), rel=1e-3)


@pytest.mark.parametrize(
    "distill,slot_weights,consistency", [((1.5, 0.6), (), 0.0), ((1.0, 1.0), (1.0, 2.0, 3.0, 0.5), 0.3)]
)
def test_the_training_losses_agree_across_backends(distill, slot_weights, consistency):
    """Distillation (and with it, slot weights and the consistency term): torch = MLX."""
    pytest.importorskip("mlx_lm")
    import tempfile
    from pathlib import Path

    from tiny import make_tokenizer, save_model

    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.mlx.loss import loss_inputs as mlx_loss_inputs
    from mars.backends.mlx.loss import mars_losses
    from mars.backends.torch.loss import MarsLoss, loss_inputs

    tok = make_tokenizer()
    ids, labels, lengths = _batch(tok)
    with tempfile.TemporaryDirectory() as d:
        path = save_model(Path(d) / "m", "qwen2", seed=4)
        m, t = mlx_load(path, **QUIET), torch_load(path, **QUIET)
        with torch.no_grad():
            ours = MarsLoss(t.model, mask_id=3, distill=distill)(
                **loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu", slot_weights=slot_weights),
                consistency=consistency,
            )
        theirs = mars_losses(
            m.model,
            mlx_loss_inputs(ids, labels, lengths, 4, 3, slot_weights=slot_weights),
            mask_id=3,
            distill=distill,
            consistency=consistency,
        )
    for a, b in zip(ours, theirs):
        assert float(a) == pytest.approx(float(b), rel=1e-4)


def test_slot_weights_and_the_consistency_term_equal_a_hand_computation():
    from tiny import make_model, make_tokenizer

    from mars.backends.torch.forward import body_and_head
    from mars.backends.torch.loss import MarsLoss, loss_inputs

    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=2).eval()
    ids, labels, lengths = _batch(tok)
    w = (0.5, 1.0, 2.0, 4.0)
    plain = loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu")
    inputs = loss_inputs(ids, labels, lengths, 4, 3, torch.float32, "cpu", slot_weights=w)
    assert "noisy_weights" not in plain and not torch.equal(inputs["noisy_weights"], inputs["weights"])
    loss = MarsLoss(model, mask_id=3, distill=(1.0, 1.0))
    with torch.no_grad():
        base_noisy, base_clean = loss(**plain)
        noisy, clean = loss(**inputs, consistency=0.7)
        body, head = body_and_head(model)
        h = body(
            input_ids=plain["input_ids"], position_ids=plain["positions"], attention_mask=plain["attn"]
        ).last_hidden_state
        hs, ht = h[plain["rows"], plain["noisy_index"]].double(), h[plain["rows"], plain["clean_index"]].double()
        student, teacher = head(hs.float()).double(), head(ht.float()).double()
        p = torch.softmax(teacher, -1)
        kl = (p * (p.log() - torch.log_softmax(student, -1))).sum(-1)
        distance = ((hs - ht) ** 2).sum(-1) / (ht**2).sum(-1)
        want = ((kl + 0.7 * distance) * inputs["noisy_weights"].double()).sum()
    assert float(clean) == pytest.approx(float(base_clean), rel=1e-6)  # the AR term keeps its weights
    assert float(noisy) == pytest.approx(float(want), rel=1e-4)
    assert float(noisy) != pytest.approx(float(base_noisy), rel=1e-3)


def test_finetune_slot_weights_and_consistency_train_but_validate_on_the_plain_objective(tiny, data, tmp_path):
    """Both options change what a step trains (the training loss), not what validation
    reports: at learning rate 0 a run with them validates exactly as a run without."""
    import shutil

    both = tmp_path / "data"
    both.mkdir()
    for split in ("train", "valid"):
        shutil.copy(data / "train.jsonl", both / f"{split}.jsonl")
    for backend in ("torch", "mlx"):
        if backend == "mlx":
            pytest.importorskip("mlx_lm")
        logs = {}
        for name, extra in (("plain", ()), ("weighted", ("--slot-weights", "0.5,1,2,4", "--consistency", 0.5))):
            out = tmp_path / f"{backend}-{name}"
            ok(
                invoke(
                    "finetune",
                    "--model",
                    tiny,
                    "--data",
                    both,
                    "--output",
                    out,
                    "--gate",
                    "masks",
                    "--objective",
                    "distill",
                    "--iters",
                    2,
                    "--steps-per-eval",
                    2,
                    "--learning-rate",
                    0,
                    "--backend",
                    backend,
                    *extra,
                )
            )
            logs[name] = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
        plain, weighted = logs["plain"][-1], logs["weighted"][-1]
        assert weighted["val_noisy"] == pytest.approx(plain["val_noisy"], rel=1e-5), backend
        assert weighted["val_clean"] == pytest.approx(plain["val_clean"], rel=1e-5), backend
        assert weighted["noisy"] != pytest.approx(plain["noisy"], rel=1e-3), backend
        assert weighted["clean"] == pytest.approx(plain["clean"], rel=1e-5), backend


def test_finetune_refuses_slot_weights_that_do_not_fit_the_block(tiny, data, tmp_path):
    out = tmp_path / "o"
    result = invoke("finetune", "--model", tiny, "--data", data, "--output", out, "--slot-weights", "1,2", "--iters", 1)
    assert result.exit_code != 0 and "--slot-weights" in result.output and "4 (the block size)" in result.output
    result = invoke(
        "finetune", "--model", tiny, "--data", data, "--output", out, "--slot-weights", "1,a,2,2", "--iters", 1
    )
    assert result.exit_code != 0 and "comma-separated" in result.output
    assert not out.exists()


def test_finetune_with_distill_and_gate_runs_on_both_backends(tiny, data, tmp_path):
    for backend in ("torch", "mlx"):
        if backend == "mlx":
            pytest.importorskip("mlx_lm")
        out = tmp_path / backend
        ok(
            invoke(
                "finetune",
                "--model",
                tiny,
                "--data",
                data,
                "--output",
                out,
                "--gate",
                "masks",
                "--objective",
                "distill",
                "--distill-temperature",
                2,
                "--iters",
                3,
                "--backend",
                backend,
            )
        )
        assert json.loads((out / "mars.json").read_text())["gate"] == "masks"


def test_the_gated_split_forward_gives_the_joint_forwards_losses_and_gradients(tiny):
    """Gated training runs the clean stream without gradients in a pass of its own: the
    losses and the LoRA and mask-row gradients equal one joint forward's."""
    from peft import LoraConfig, get_peft_model
    from tiny import make_tokenizer

    from mars.backends.torch.gate import MaskGate
    from mars.backends.torch.loss import MarsLoss, loss_inputs

    tok = make_tokenizer()
    base = torch_load(tiny, **QUIET)
    torch.manual_seed(0)
    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # fresh LoRA B is zero: make the deltas real
    row = torch.nn.Parameter(torch.randn(model.get_input_embeddings().weight.shape[1]) * 0.1)
    loss = MarsLoss(model, row, 3, gate=MaskGate(model, 3), distill=(1.5, 0.5))
    inputs = loss_inputs(*_batch(tok), 4, 3, torch.float32, "cpu")
    results = []
    for split in (False, True):
        loss.split = split
        model.zero_grad()
        row.grad = None
        noisy, clean = loss(**inputs)
        (noisy + clean).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        results.append((noisy.item(), clean.item(), grads, row.grad.clone()))
    (n0, c0, g0, r0), (n1, c1, g1, r1) = results
    assert n1 == pytest.approx(n0, rel=1e-5) and c1 == pytest.approx(c0, rel=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r1, r0, atol=1e-5, rtol=1e-4)


def test_eval_losses_of_a_gated_adapter_run_its_gate_on_both_backends(tiny, gated, tmp_path):
    """`mars eval`'s NLL goes through the adapter's gate: the noisy loss is the adapter's
    (not the base's with its deltas held at zero), the clean loss is the base weights', and MLX agrees."""
    from mars.backends.torch.loss import MarsLoss, loss_inputs, losses

    tm = torch_load(gated, **QUIET)
    mask = tm.mars.mask_token_id
    ids, labels, lengths = _batch(tm.tokenizer)
    noisy, clean = losses(tm)(ids, labels, lengths, 4, mask)
    inputs = loss_inputs(ids, labels, lengths, 4, mask, tm.dtype, tm.device, normalize="token")
    with torch.no_grad():
        joint = MarsLoss(tm.model, gate=tm.gate)
        joint.split = False  # one joint forward, the gate set on the whole row
        ref_noisy, ref_clean = (float(x) for x in joint(**inputs))
        tm.gate.clear()
        off_noisy, off_clean = (float(x) for x in MarsLoss(tm.model)(**inputs))  # no gate: the deltas are zero
    assert noisy == pytest.approx(ref_noisy, rel=1e-5) and clean == pytest.approx(ref_clean, rel=1e-5)
    assert abs(noisy - off_noisy) > 1e-3 * abs(off_noisy)
    assert clean == pytest.approx(off_clean, rel=1e-5)  # the clean stream has no masks: the deltas never act there
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from mars.backends.mlx.load import load as mlx_load
    from mars.backends.mlx.loss import losses as mlx_losses

    ok(invoke("convert", gated, "--to", "mlx", "--output", tmp_path / "mlx-adapter", "--model", tiny))
    m = mlx_load(tmp_path / "mlx-adapter", **QUIET)
    m.gate.set(mx.zeros((1, 1), dtype=mx.int32))  # a stale gate (no masks anywhere) must not leak in
    mn, mc = mlx_losses(m)(ids, labels, lengths, 4, mask)
    assert mn == pytest.approx(noisy, rel=1e-4) and mc == pytest.approx(clean, rel=1e-4)


def test_mars_serve_decodes_a_gated_adapter_as_the_base(tiny, gated):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from test_serve import live

    base = torch_load(tiny, **QUIET)
    tm = torch_load(gated, **QUIET)
    with live(tm, name="gated") as server:
        client = server.client()
        for text in PROMPTS:
            want = generate(
                TorchDecoder(base),
                [encode_prompt(base.tokenizer, text)],
                make_plan(mask_id=tm.mars.mask_token_id, eos_ids=base.eos_ids, max_tokens=12, threshold=1.0),
            )
            reply = base.tokenizer.decode(want.tokens[0], skip_special_tokens=True)
            for extra in ({"threshold": 1.0}, {"lossless": True}, {}):  # {}: the checkpoint's default mode, lossless
                r = client.chat.completions.create(
                    model="gated",
                    messages=[{"role": "user", "content": text}],
                    max_tokens=12,
                    temperature=0,
                    extra_body=extra,
                )
                assert r.choices[0].message.content == reply, (text, extra)
