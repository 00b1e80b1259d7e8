"""`mars convert SRC --to vllm`: the drafter vLLM's parallel drafting takes (SRC fused at every
position, the mask row set, mask_token_id in config.json), the target named or written, the
speculative config and the README's commands; one-line errors for what it cannot export."""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from clitools import invoke, ok, one_line_error
from tiny import save_model

IDS = [1, 10, 20, 3, 3, 3, 30, 40, 11, 3, 12]  # mask tokens (id 3) among real ones


def serve_line(readme: str) -> list[str]:
    """The words of the README's serve command (the environment assignment first)."""
    line = next(
        line
        for line in readme.splitlines()
        if "vllm.entrypoints.openai.api_server" in line and not line.startswith(("#", "`"))
    )
    return shlex.split(line)


def option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def check_cards(out):
    """What the export's READMEs say matches the files beside them: every absolute path they
    name exists (none is the temporary directory the export wrote through), the drafter's card
    shows its own mars.json, and the training step it quotes is its adapter's last."""
    import re

    from mars.core.config import read_config

    for card in (out / "README.md", out / "drafter" / "README.md"):
        text = card.read_text()
        assert ".tmp." not in text, card
        for path in re.findall(r"(?<![\w.])(/[^\s`'\"(),]+)", text):
            if not path.startswith(("/v1/", "/dev/")):
                assert Path(path).exists(), (card, path)
    mars = read_config(out / "drafter")
    card = (out / "drafter" / "README.md").read_text()
    for name in ("gate", "mask_token_id", "block_size", "default_mode"):
        assert f"| `{name}` | `{json.dumps(getattr(mars, name))}` |" in card, name
    return card


def finetune(tiny, data, out, *extra):
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            3,
            "--batch-size",
            4,
            "--learning-rate",
            1e-2,
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--no-draft-corpus",
            *extra,
        )
    )
    return out


def logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def plain(path):
    """The directory as transformers loads any model: no mars code involved."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def fused_everywhere(base, adapter):
    """PEFT's own merge of the adapter (gate ignored) with the trained mask row."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model = PeftModel.from_pretrained(plain(base), str(adapter)).merge_and_unload()
    with torch.no_grad():
        model.get_input_embeddings().weight[3] = load_file(str(adapter / "mask_embedding.safetensors"))[
            "mask_embedding"
        ]
    return model.eval()


@pytest.mark.parametrize("gate", ["masks", "none"])
def test_adapter_exports_as_a_drafter_with_its_target(tiny, data, tmp_path, gate):
    adapter = finetune(tiny, data, tmp_path / "adapter", "--gate", gate)
    out = tmp_path / "vllm"
    result = ok(invoke("convert", adapter, "--to", "vllm", "-o", out))
    drafter = (out / "drafter").resolve()
    config = json.loads((drafter / "config.json").read_text())
    assert config["mask_token_id"] == json.loads((adapter / "mars.json").read_text())["mask_token_id"] == 3
    np.testing.assert_allclose(logits(plain(drafter)), logits(fused_everywhere(tiny, adapter)), atol=1e-4, rtol=0)
    assert json.loads((drafter / "mars.json").read_text())["gate"] == "none"

    # the target: the base the user has for a gated adapter (its greedy output is the base's), else the fused model
    target = tiny.resolve() if gate == "masks" else drafter
    assert not (out / "target").exists()
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {
        "method": "draft_model",
        "model": str(drafter),
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }
    readme = (out / "README.md").read_text()
    words = serve_line(readme)
    assert words[:4] == ["VLLM_CPU_KVCACHE_SPACE=2", "python", "-m", "vllm.entrypoints.openai.api_server"]
    assert option(words, "--model") == str(target) and option(words, "--dtype") == "float32"
    assert json.loads(option(words, "--speculative-config")) == spec
    assert f'LLM(model={str(target)!r}, dtype="float32", speculative_config={spec!r})' in readme
    assert "wrote" in result.output
    card = check_cards(out)
    assert "step 3" in card  # the adapter's last training step
    assert json.loads((adapter / "training_log.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_full_fine_tune_exports_itself_as_drafter_and_target(tiny, data, tmp_path):
    model = finetune(tiny, data, tmp_path / "full", "--fine-tune-type", "full")
    out = tmp_path / "vllm"
    ok(invoke("convert", model, "--to", "vllm", "-o", out))
    drafter = out / "drafter"
    assert json.loads((drafter / "config.json").read_text())["mask_token_id"] == 3
    np.testing.assert_array_equal(logits(plain(drafter)), logits(plain(model)))
    assert json.loads((out / "speculative_config.json").read_text())["model"] == str(drafter.resolve())
    assert option(serve_line((out / "README.md").read_text()), "--model") == str(drafter.resolve())
    check_cards(out)


def test_what_cannot_be_exported_fails_in_one_line(tiny, data, tmp_path):
    out = tmp_path / "vllm"
    one_line_error(invoke("convert", tiny, "--to", "vllm", "-o", out), str(tiny), "no mars.json")
    adapter = finetune(tiny, data, tmp_path / "adapter")
    one_line_error(invoke("convert", adapter, "--to", "vllm", "-o", out, "--fuse"), "--to vllm")

    other = save_model(tmp_path / "gpt2ish", "llama", seed=1)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    stray = tmp_path / "stray"
    stray.mkdir()
    for f in adapter.iterdir():
        (stray / f.name).write_bytes(f.read_bytes())
    mars = json.loads((stray / "mars.json").read_text())
    (stray / "mars.json").write_text(json.dumps({**mars, "base_model": str(other)}))
    one_line_error(invoke("convert", stray, "--to", "vllm", "-o", out), "'gpt2'", "not supported")

    out.mkdir()
    (out / "keep").write_text("mine")
    one_line_error(invoke("convert", adapter, "--to", "vllm", "-o", out), "exists", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_shipped_weights_export_for_vllm(tmp_path):
    from mars.checkpoint.default_model import shipped_weights

    weights = shipped_weights()
    out = tmp_path / "vllm"
    ok(invoke("convert", weights, "--to", "vllm", "-o", out))
    mars = json.loads((weights / "mars.json").read_text())
    drafter = plain(out / "drafter")  # transformers loads it as a plain model
    assert drafter.config.mask_token_id == mars["mask_token_id"]
    # the gated adapter's target is the embedded base, which is no directory the user has: written too
    target = plain(out / "target")
    assert json.loads((out / "speculative_config.json").read_text())["parallel_drafting"] is True
    assert option(serve_line((out / "README.md").read_text()), "--model") == str((out / "target").resolve())
    card = check_cards(out)
    log = (weights / "training_log.jsonl").read_text().splitlines()
    assert f"step {json.loads(log[-1])['step']}," in card  # the shipped weights' own last step
    ids = torch.tensor([[1, 504, 3, 3, 3]])
    with torch.no_grad():
        assert not torch.equal(drafter(ids).logits, target(ids).logits)  # the adapter acts everywhere in the drafter
