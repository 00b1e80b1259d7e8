"""The `mars` command end to end on a tiny model: bad input, finetune (full, LoRA, resume), generate, chat.

Most commands run in-process through click's CliRunner (fast); two run as real `mars`
processes to check the exit status and the stderr a user sees.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import LETTERS, invoke, ok, one_line_error, spell_records, write_jsonl

# --- helpers -------------------------------------------------------------------------


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines() if line.strip()]


def mars_exe() -> str:
    exe = Path(sys.executable).parent / "mars"
    return str(exe) if exe.exists() else (shutil.which("mars") or "mars")


def finetune_args(model, data, out, *extra, iters=20, kind="lora"):
    return (
        "finetune",
        "--model",
        model,
        "--data",
        data,
        "--output",
        out,
        "--fine-tune-type",
        kind,
        "--iters",
        iters,
        "--batch-size",
        4,
        "--learning-rate",
        1e-3,
        "--device",
        "cpu",
        *extra,
    )


def run_mars(*args):
    """A real `mars` process (one torch thread: see `one_torch_thread`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([mars_exe(), *map(str, args)], capture_output=True, text=True, timeout=180, env=env)


# --- fixtures: one tiny base, one dataset, one full and one LoRA fine-tune ------------


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine torch's
    spinning worker threads slow every step down by 10-50x when another process is busy."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def full(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out"
    result = ok(invoke(*finetune_args(tiny, data, out, "--ar-weight", 0.5, "--default-threshold", 0.8, kind="full")))
    return out, result


@pytest.fixture(scope="module")
def lora(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "out"
    result = ok(invoke(*finetune_args(tiny, data, out, kind="lora")))
    return out, result


# --- 1. bad input: one line, non-zero, no output directory ---------------------------


def test_malformed_jsonl_line(tiny, tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [spell_records(1)[0], '{"prompt": "a", "completion": ', spell_records(1)[0]])
    out = tmp_path / "out"
    last = one_line_error(invoke(*finetune_args(tiny, d, out, iters=2)), "train.jsonl:2", "malformed JSON")
    assert str(d / "train.jsonl") in last
    assert not out.exists()


def test_unknown_field(tiny, tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [spell_records(1)[0], {"prompt": "a", "completion": "b", "answer": "c"}])
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(tiny, d, out, iters=2)), "train.jsonl:2", "unknown field 'answer'")
    assert not out.exists()


def test_empty_response(tiny, tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", [{"prompt": "a", "completion": "  "}])
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(tiny, d, out, iters=2)), "train.jsonl:1", "empty 'completion'")
    assert not out.exists()


def test_empty_final_assistant_message(tiny, tmp_path):
    d = tmp_path / "data"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    write_jsonl(d / "train.jsonl", [spell_records(1)[0], {"messages": msgs}])
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(tiny, d, out, iters=2)), "train.jsonl:2", "empty final assistant message")
    assert not out.exists()


def test_too_long_is_an_error_by_default(tiny, data, tmp_path):
    out = tmp_path / "out"
    last = one_line_error(
        invoke(*finetune_args(tiny, data, out, "--max-seq-length", 32, iters=2)),
        "train.jsonl:1",
        "--max-seq-length 32",
        "neither truncated nor skipped",
    )
    assert "--on-long" in last
    assert not out.exists()


def test_model_without_weights(tiny, data, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny / "config.json", bare / "config.json")
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(bare, data, out, iters=2)), str(bare), "no weights")
    assert not out.exists()
    one_line_error(invoke("generate", "--model", bare, "--prompt", "hi", "--device", "cpu"), str(bare), "no weights")


def test_generate_refuses_block_size_zero(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    (bad / "mars.json").write_text(json.dumps({"block_size": 0, "mask_token": "<unused0>", "mask_token_id": 3}))
    one_line_error(
        invoke("generate", "--model", bad, "--prompt", "hi", "--max-tokens", 3, "--device", "cpu"),
        "mars.json",
        "block_size",
    )


def test_missing_data_dir(tiny, tmp_path):
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(tiny, tmp_path / "nope", out, iters=2)), str(tmp_path / "nope"))
    assert not out.exists()


def test_output_and_resume_guards(tiny, data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_error(invoke(*finetune_args(tiny, data, out, iters=2)), "--resume")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # untouched
    one_line_error(invoke(*finetune_args(tiny, data, out, "--resume", iters=2)), "no checkpoint")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (("--max-seq-length", 2), "--max-seq-length"),
        (("--batch-size", 0), "--batch-size"),
        (("--grad-accumulation-steps", 0), "--grad-accumulation-steps"),
        (("--save-every", 0), "--save-every"),
        (("--iters", -1), "--iters"),
        (("--learning-rate", -1), "--learning-rate"),
        (("--device", "nodevice"), "--device nodevice"),
    ],
)
def test_bad_finetune_options(tiny, data, tmp_path, extra, needle):
    out = tmp_path / "out"
    one_line_error(invoke(*finetune_args(tiny, data, out, *extra, iters=2)), needle)
    assert not out.exists()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (("--max-tokens", 0), "--max-tokens"),
        (("--batch-size", 0), "--batch-size"),
        (("--block-size", 0), "--block-size"),
        (("--top-p", 0, "--temp", 1), "--top-p"),
        (("--device", "nodevice"), "--device nodevice"),
    ],
)
def test_bad_generate_options(tiny, extra, needle):
    one_line_error(invoke("generate", "--model", tiny, "--prompt", "hi", "--max-tokens", 3, *extra), needle)


def test_real_process_exit_status_and_one_line_error(tiny, tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", ["{not json"])
    out = tmp_path / "out"
    proc = run_mars(*finetune_args(tiny, d, out, iters=2))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("Error:") and "train.jsonl:1" in lines[-1], proc.stderr
    assert not out.exists()


# --- 2. --on-long truncate / skip -----------------------------------------------------


@pytest.fixture
def mixed_lengths(tmp_path):
    long = {"prompt": "Spell it all", "completion": " ".join(LETTERS * 3)}
    return write_jsonl(tmp_path / "mixed" / "train.jsonl", spell_records(4) + [long, long])


@pytest.mark.parametrize(
    "mode,kept,report", [("truncate", 6, "2 truncated, 0 skipped"), ("skip", 4, "0 truncated, 2 skipped")]
)
def test_on_long(tiny, mixed_lengths, tmp_path, mode, kept, report):
    out = tmp_path / "out"
    result = ok(
        invoke(*finetune_args(tiny, mixed_lengths.parent, out, "--max-seq-length", 64, "--on-long", mode, iters=2))
    )
    assert f"{report} over --max-seq-length 64" in result.output
    assert f"data: {kept} train examples" in result.output
    assert "after 2 steps" in result.output
    assert (out / "mars.json").is_file()


# --- 3. full fine-tune ----------------------------------------------------------------


def test_finetune_keeps_its_training_data_as_the_draft_corpus(lora, full, tiny, data, tmp_path):
    """Both checkpoints carry the training split as their draft corpus, encoded as training
    encodes it, and decoding them drafts from it; --no-draft-corpus writes none."""
    import numpy as np

    from mars.backends import base
    from mars.checkpoint.paths import load_tokenizer
    from mars.core.decode.drafts import corpus

    want = corpus.from_data(data, load_tokenizer(Path(tiny)))
    assert len(want) > 0
    for out, result in (lora, full):
        assert np.array_equal(corpus.DraftCorpus.load(out / corpus.FILE).tokens, want.tokens)
        assert f"draft corpus: {len(want):,} tokens" in result.output
    loaded = base.load("torch", *lora[:1], device="cpu", announce=lambda m: None)
    assert np.array_equal(base.plan_for_model(loaded, lossless=True).drafts.corpus.tokens, want.tokens)
    out = tmp_path / "none"
    ok(invoke(*finetune_args(tiny, data, out, "--no-draft-corpus", iters=1)))
    assert (out / "mars.json").is_file() and not (out / corpus.FILE).exists()


def test_full_finetune_writes_a_plain_hf_model(full, tiny):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, result = full
    assert "after 20 steps" in result.output
    for name in (
        "config.json",
        "model.safetensors",
        "mars.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "training_log.jsonl",
    ):
        assert (out / name).is_file(), name
    assert not (out / "checkpoint").exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    mars = json.loads((out / "mars.json").read_text())
    assert mars["block_size"] == 4
    assert mars["mask_token"] == "<unused0>" and mars["mask_token_id"] == 3
    assert mars["mask_token_added"] is False
    assert mars["ar_weight"] == 0.5
    assert mars["default_threshold"] == 0.8
    assert oct((out / "mars.json").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    assert Path(mars["base_model"]).resolve() == tiny.resolve()

    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, 21))
    for r in log:
        assert math.isfinite(r["noisy"]) and math.isfinite(r["clean"])

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok("hello")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()

    # The weights moved away from the base (it was trained, not copied).
    new, old = load_file(str(out / "model.safetensors")), load_file(str(tiny / "model.safetensors"))
    assert new.keys() == old.keys()
    assert any(not torch.allclose(new[k], old[k]) for k in new)


# --- 4. LoRA ----------------------------------------------------------------------------


def test_lora_writes_a_peft_adapter(lora, tiny):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, result = lora
    assert "after 20 steps" in result.output
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "mask_embedding.safetensors",
        "mars.json",
        "training_log.jsonl",
    ):
        assert (out / name).is_file(), name
    assert not (out / "config.json").exists()  # an adapter, not a model
    assert not (out / "checkpoint").exists()
    mars = json.loads((out / "mars.json").read_text())
    assert Path(mars["base_model"]).resolve() == tiny.resolve()

    base = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    base_row = base.get_input_embeddings().weight[mars["mask_token_id"]].detach().clone()
    model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 10, 11, 12]])).logits
    assert torch.isfinite(logits).all()

    row = load_file(str(out / "mask_embedding.safetensors"))["mask_embedding"]
    assert row.shape == base_row.shape
    assert not torch.allclose(row.float(), base_row.float(), atol=1e-6), "the mask embedding row was not trained"


def test_init_adapter_continues_a_lora_run(lora, tiny, data, tmp_path):
    from safetensors.numpy import load_file

    src, _ = lora
    # Learning rate 0: the saved adapter is the one it started from, bit for bit.
    same = tmp_path / "same"
    ok(invoke(*finetune_args(tiny, data, same, "--init-adapter", src, "--learning-rate", 0, "--lora-rank", 4, iters=1)))
    for name in ("adapter_model.safetensors", "mask_embedding.safetensors"):
        a, b = load_file(str(src / name)), load_file(str(same / name))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), name
    assert (
        json.loads((same / "adapter_config.json").read_text())["r"]
        == json.loads((src / "adapter_config.json").read_text())["r"]
    )
    assert (
        json.loads((same / "mars.json").read_text())["block_size"]
        == json.loads((src / "mars.json").read_text())["block_size"]
    )
    # Training goes on from there: the first loss is the trained adapter's, well below a fresh start's.
    cont, fresh = tmp_path / "cont", tmp_path / "fresh"
    ok(invoke(*finetune_args(tiny, data, cont, "--init-adapter", src, iters=2)))
    ok(invoke(*finetune_args(tiny, data, fresh, iters=2)))
    first = lambda out: read_log(out)[0]["noisy"]  # noqa: E731
    assert first(cont) == pytest.approx(first(same), rel=1e-6)
    assert first(cont) < first(fresh) - 1.0, (first(cont), first(fresh))
    a, b = load_file(str(src / "adapter_model.safetensors")), load_file(str(cont / "adapter_model.safetensors"))
    assert any((a[k] != b[k]).any() for k in a), "the continued run did not train the adapter"


def test_init_adapter_changes_the_block_size(lora, tiny, data, tmp_path):
    """A B = 4 adapter continued with B = 2 keeps what its first two masks learnt."""
    from safetensors.numpy import load_file

    src, _ = lora
    assert json.loads((src / "mars.json").read_text())["block_size"] == 4
    same = tmp_path / "same"
    res = ok(
        invoke(
            *finetune_args(tiny, data, same, "--init-adapter", src, "--block-size", 2, "--learning-rate", 0, iters=1)
        )
    )
    assert "block size 4 becomes 2" in res.output
    assert json.loads((same / "mars.json").read_text())["block_size"] == 2
    for name in ("adapter_model.safetensors", "mask_embedding.safetensors"):
        a, b = load_file(str(src / name)), load_file(str(same / name))
        assert all((a[k] == b[k]).all() for k in a), name
    fresh = tmp_path / "fresh"
    ok(invoke(*finetune_args(tiny, data, fresh, "--block-size", 2, iters=1)))
    first = lambda out: read_log(out)[0]["noisy"]  # noqa: E731
    assert first(same) < first(fresh) - 1.0, (first(same), first(fresh))


def test_init_adapter_bad_input(lora, tiny, data, tmp_path):
    src, _ = lora
    one_line_error(
        invoke(*finetune_args(tiny, data, tmp_path / "a", "--init-adapter", src, kind="full")), "--init-adapter", "lora"
    )
    one_line_error(
        invoke(*finetune_args(tiny, data, tmp_path / "b", "--init-adapter", tiny)), str(tiny), "not an adapter"
    )
    for out in ("a", "b"):
        assert not (tmp_path / out).exists()


def test_generate_from_adapter_dir_and_adapter_path(lora, tiny):
    out, _ = lora
    a = ok(invoke("generate", "--model", out, "--prompt", "hi", "--max-tokens", 5, "--device", "cpu", "--json"))
    b = ok(
        invoke(
            "generate",
            "--model",
            tiny,
            "--adapter-path",
            out,
            "--prompt",
            "hi",
            "--max-tokens",
            5,
            "--device",
            "cpu",
            "--json",
        )
    )
    ra, rb = json.loads(a.stdout.strip()), json.loads(b.stdout.strip())
    assert ra["tokens"] >= 1 and ra == rb  # the adapter dir resolves its base from mars.json: same model
    c = ok(invoke("generate", "--model", out, "--prompt", "hi", "--max-tokens", 5, "--device", "cpu"))
    assert "tokens/forward" in c.output


def test_generate_adapter_dir_real_process(lora):
    out, _ = lora
    proc = run_mars(
        "generate", "--model", out, "--prompt", "hi", "--max-tokens", 5, "--device", "cpu", "--threshold", 0.5
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "--- [0] hi"
    assert "threshold 0.5" in lines[-1] and "tokens/forward" in lines[-1]


# --- 5. resume --------------------------------------------------------------------------


class Interrupted(Exception):
    pass


def test_resume_matches_an_uninterrupted_run(tiny, data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from mars.backends.torch import train as train_mod

    args = ("--save-every", 3, "--warmup", 0.2)
    whole = tmp_path / "whole"
    ok(invoke(*finetune_args(tiny, data, whole, *args, iters=9)))

    # Interrupt a second run right after its checkpoint at step 6 (the second save, which replaces the first).
    out = tmp_path / "resumed"
    original = train_mod.TorchTrainer.save_checkpoint
    saved_at = []

    def save_then_stop(self):
        original(self)
        saved_at.append(self.step)
        ckpt = out / "checkpoint"
        assert (ckpt / "state.pt").is_file() and (ckpt / "trainable.safetensors").is_file()
        leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert not leftovers, f"temporary checkpoint dirs left behind: {leftovers}"
        if self.step == 6:
            raise Interrupted

    monkeypatch.setattr(train_mod.TorchTrainer, "save_checkpoint", save_then_stop)
    result = invoke(*finetune_args(tiny, data, out, *args, iters=9))
    assert isinstance(result.exception, Interrupted), (result.exception, result.output[-2000:])
    assert saved_at == [3, 6]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint"]
    monkeypatch.setattr(train_mod.TorchTrainer, "save_checkpoint", original)

    result = ok(invoke(*finetune_args(tiny, data, out, "--resume", *args, iters=9)))
    assert "resumed from" in result.output and "at step 6/9" in result.output
    assert "after 9 steps" in result.output
    assert not (out / "checkpoint").exists(), "the resume checkpoint outlived the final save"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    log_whole, log_resumed = read_log(whole), read_log(out)
    assert [r["step"] for r in log_resumed] == list(range(1, 10))
    for a, b in zip(log_whole, log_resumed):
        assert a["noisy"] == pytest.approx(b["noisy"], abs=1e-4) and a["clean"] == pytest.approx(b["clean"], abs=1e-4)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)

    for name in ("adapter_model.safetensors", "mask_embedding.safetensors"):
        w, r = load_file(str(whole / name)), load_file(str(out / name))
        assert w.keys() == r.keys()
        for k in w:
            diff = (w[k].float() - r[k].float()).abs().max().item()
            assert diff <= 1e-5, f"{name}:{k} differs by {diff} after resume"


# --- 6. generate ------------------------------------------------------------------------


def test_generate_prints_tokens_per_forward(full):
    out, _ = full
    result = ok(
        invoke(
            "generate",
            "--model",
            out,
            "--prompt",
            "Spell from c",
            "--max-tokens",
            8,
            "--threshold",
            0.5,
            "--device",
            "cpu",
        )
    )
    assert "--- [0] Spell from c" in result.stdout
    last = [line for line in result.output.splitlines() if line.strip()][-1]
    assert "threshold 0.5" in last and "tokens/forward" in last


MODE_LINE = re.compile(
    r"^(?P<mode>[^,]+), B=\d+, cache=[^:]+: (?P<tokens>\d+) tokens, (?P<forwards>\d+) forwards, [\d.]+ tokens/forward, "
    r"(?P<seconds>[\d.]+)s \((?P<speed>[\d.]+) tok/s; median of (?P<rounds>\d+) rounds, "
    r"range (?P<low>[\d.]+)-(?P<high>[\d.]+) tok/s\)"
)
RATIO_LINE = re.compile(
    r"^(?P<same>\d+)/(?P<prompts>\d+) replies identical to AR; (?P<mode>[^:]+): (?P<ratio>[\d.]+)x AR's tokens/s "
    r"\((?P<speed>[\d.]+) / (?P<ar>[\d.]+) tok/s, the medians above; "
    r"round by round (?P<low>[\d.]+)-(?P<high>[\d.]+)x\)$"
)


def compare_figures(output: str) -> tuple[list[dict], dict]:
    """--compare's two summary lines and its ratio line, parsed."""
    lines = [line for line in output.splitlines() if line.strip()][-3:]
    modes = [MODE_LINE.match(line) for line in lines[:2]]
    ratio = RATIO_LINE.match(lines[2])
    assert all(modes) and ratio, lines
    num = lambda m: {k: v if k == "mode" else float(v) for k, v in m.groupdict().items()}  # noqa: E731
    return [num(m) for m in modes], num(ratio)


def check_compare_figures(modes: list[dict], ratio: dict, rounds: int) -> None:
    """What --compare prints agrees with itself: each mode's tokens/s is its tokens over its
    seconds and lies within its rounds' range; the ratio is the two printed tokens/s, which it
    repeats, and lies within the per-round ratios' range."""
    ar, mode = modes
    assert [ar["mode"], ratio["mode"]] == ["AR greedy", mode["mode"]]
    for m in modes:
        assert m["rounds"] == rounds and m["low"] <= m["speed"] <= m["high"]
        # seconds are printed to 0.01 s, tokens/s to 0.1: the same figure within that rounding
        assert (
            m["tokens"] / (m["seconds"] + 0.005) - 0.05
            <= m["speed"]
            <= m["tokens"] / max(m["seconds"] - 0.005, 1e-9) + 0.05
        )
    assert (ratio["speed"], ratio["ar"]) == (mode["speed"], ar["speed"])
    assert ratio["ratio"] == pytest.approx(
        mode["speed"] / ar["speed"], abs=0.005 + 0.05 * (1 / ar["speed"] + mode["speed"] / ar["speed"] ** 2)
    )
    assert ratio["low"] <= ratio["ratio"] <= ratio["high"]


def test_compare_prints_one_set_of_figures(full, monkeypatch):
    """--compare's summary lines and its ratio tell the same story: each mode's line reports
    its median round, and the ratio is the ratio of the two tokens/s printed above it (it used
    to follow the first round's lines with the median of the rounds' ratios, and a reader could
    see lossless both slower and faster than AR). The rounds' wall times are scripted here so
    the median round differs from the first."""
    import mars.session

    out, _ = full
    args = (
        "generate",
        "--model",
        out,
        "--prompt",
        "Spell from c",
        "--prompt",
        "hi",
        "--max-tokens",
        8,
        "--device",
        "cpu",
        "--lossless",
        "--compare",
    )
    # Wall times per round, AR then lossless (AR then lossless within each round): the first
    # round has lossless slowest, the median rounds have it faster.
    script = iter([1.0, 4.0, 4.0, 1.0, 2.0, 1.5])
    real = mars.session.decode_batches

    def scripted(*a, **kw):
        decoded = real(*a, **kw)
        decoded.seconds = next(script)
        return decoded

    monkeypatch.setattr(mars.session, "decode_batches", scripted)
    result = ok(invoke(*args))
    modes, ratio = compare_figures(result.output)
    check_compare_figures(modes, ratio, 3)
    ar, lossless = modes
    assert (ar["seconds"], lossless["seconds"]) == (2.0, 1.5)  # the median rounds, not the first
    n_ar, n_lossless = ar["tokens"], lossless["tokens"]
    assert ar["low"] == pytest.approx(n_ar / 4, abs=0.05) and ar["high"] == pytest.approx(n_ar / 1, abs=0.05)
    assert ratio["ratio"] == pytest.approx(round((n_lossless / 1.5) / (n_ar / 2.0), 2))
    assert (ratio["low"], ratio["high"]) == (round((n_lossless / 4) / n_ar, 2), round(n_lossless / (n_ar / 4), 2))

    # Unscripted, and under --json (the lines then go to stderr): the same agreement, and the
    # JSON rows add up to the summary line of their mode.
    monkeypatch.setattr(mars.session, "decode_batches", real)
    result = ok(invoke(*args, "--json", "--rounds", 4))
    modes, ratio = compare_figures(result.stderr)
    check_compare_figures(modes, ratio, 4)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    for m in modes:
        mine = [r for r in rows if r["mode"] == m["mode"]]
        assert len(mine) == 2
        assert (sum(r["tokens"] for r in mine), sum(r["forwards"] for r in mine)) == (m["tokens"], m["forwards"])
    assert ratio["same"] == sum(a["text"] == b["text"] for a, b in zip(rows[::2], rows[1::2]))
    # Where the tokens came from, per reply and in the lossless line: the masks' share of the
    # extra tokens (mask drafts and spare groups over every token not computed as AR's own).
    lossless_rows = [r for r in rows if r["mode"] == modes[1]["mode"]]
    totals = {}
    for r in lossless_rows:
        sources = r["tokens_by_source"]
        assert sum(sources.values()) == r["tokens"]
        extra = r["tokens"] - sources.get("ar", 0)
        assert r["masks_share"] == (
            None if extra == 0 else round((sources.get("masks", 0) + sources.get("spare", 0)) / extra, 4)
        )
        for k, v in sources.items():
            totals[k] = totals.get(k, 0) + v
    line = next(line for line in result.stderr.splitlines() if line.startswith(modes[1]["mode"] + ","))
    extra = sum(totals.values()) - totals.get("ar", 0)
    if extra:
        assert (
            f"the masks' share of the extra tokens {(totals.get('masks', 0) + totals.get('spare', 0)) / extra:.0%}"
            in line
        )
    else:
        assert "masks' share" not in line
    assert all("tokens_by_source" not in r for r in rows if r["mode"] == modes[0]["mode"])  # AR takes no drafts

    one = ok(invoke(*args, "--rounds", 1)).output.splitlines()
    assert "median" not in one[-2] and "(one round)" not in one[-2] and one[-1].endswith("tok/s, one round)")


def test_generate_json_and_prompts_file(full, tmp_path):
    out, _ = full
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "Spell from a"}, {"messages": [{"role": "user", "content": "Spell from b"}]}],
    )
    result = ok(
        invoke(
            "generate",
            "--model",
            out,
            "--prompts",
            prompts,
            "--prompt",
            "hi",
            "--json",
            "--max-tokens",
            6,
            "--device",
            "cpu",
        )
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(rows) == 3  # one JSON object per prompt, nothing else on stdout
    assert rows[0]["prompt"] == "hi" and rows[1]["prompt"] == "Spell from a"
    for row in rows:
        assert {"prompt", "text", "tokens", "finish", "forwards", "tokens_per_forward"} <= row.keys()
        assert 1 <= row["tokens"] <= 6 and row["forwards"] >= 1
        assert row["tokens_per_forward"] >= 1.0
    assert "tokens/forward" in result.stderr  # the summary goes to stderr under --json


def test_generate_with_trees_answers_as_ar(full, tmp_path):
    """`mars generate --tree N`: greedy lossless replies are AR's, tree nodes taken (the fixed feed, no
    n-gram drafts); sampled lossless runs over the tree too."""
    out, _ = full
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Spell from {c}"} for c in "abcd"])
    common = ("generate", "--model", out, "--prompts", prompts, "--json", "--max-tokens", 30, "--device", "cpu")
    ar = [json.loads(line) for line in ok(invoke(*common, "--threshold", 1.0)).stdout.splitlines()]
    tree = [
        json.loads(line)
        for line in ok(invoke(*common, "--lossless", "--tree", 8, "--feed", "fixed")).stdout.splitlines()
    ]
    assert [r["text"] for r in tree] == [r["text"] for r in ar]
    assert sum(r.get("tokens_by_source", {}).get("tree", 0) for r in tree) > 0, "no tree node was taken"
    sampled = ok(invoke(*common, "--lossless", "--tree", 8, "--temp", 1.0, "--seed", 3, "--feed", "fixed"))
    rows = [json.loads(line) for line in sampled.stdout.splitlines()]
    assert len(rows) == 4 and all(r["mode"].startswith("lossless sampling") for r in rows)


def test_threshold_below_one_needs_mars_json_or_force(tiny):
    args = ("generate", "--model", tiny, "--prompt", "hi", "--max-tokens", 3, "--threshold", 0.5, "--device", "cpu")
    one_line_error(invoke(*args), "mars.json", "--force")
    result = ok(invoke(*args, "--force"))
    assert "tokens/forward" in result.output


def test_verify_runs_verified_threshold_mode(tiny):
    common = (
        "generate",
        "--model",
        tiny,
        "--prompt",
        "hi",
        "--prompt",
        "Spell from c",
        "--max-tokens",
        10,
        "--json",
        "--device",
        "cpu",
    )
    ar = [json.loads(line) for line in ok(invoke(*common)).stdout.splitlines()]
    at_one = ok(invoke(*common, "--threshold", 1.0, "--verify"))
    assert "--verify is ignored here: AR mode" in at_one.stderr
    assert [json.loads(line)["text"] for line in at_one.stdout.splitlines()] == [r["text"] for r in ar]
    verified = [
        json.loads(line) for line in ok(invoke(*common, "--threshold", 0.5, "--verify", "--force")).stdout.splitlines()
    ]
    assert [r["mode"] for r in verified] == ["verified threshold 0.5 (probability)"] * 2
    summary = ok(
        invoke(*common[:-3], "--device", "cpu", "--threshold", 0.0, "--verify", "--force", "--feed", "fixed")
    ).output
    assert "unverified (threshold)" in summary and "AR" in summary
    result = ok(
        invoke(
            "chat",
            "--model",
            tiny,
            "--max-tokens",
            6,
            "--device",
            "cpu",
            "--force",
            input="/verify\n/threshold 0.5\nhi\n/verify\n/quit\n",
        )
    )
    said = [line.removeprefix(">> ").strip() for line in result.output.splitlines()]
    said = [line for line in said if line.startswith(("AR", "lossless", "threshold", "verified"))]
    assert said[0].startswith("AR greedy, B=4")  # the banner
    assert said[1:] == ["AR greedy", "threshold 0.5 (probability)", "verified threshold 0.5 (probability)"]
    # Verified threshold mode is the default of threshold mode; --no-verify is plain threshold mode.
    plain = [
        json.loads(line)
        for line in ok(invoke(*common, "--threshold", 0.5, "--no-verify", "--force")).stdout.splitlines()
    ]
    default = [json.loads(line) for line in ok(invoke(*common, "--threshold", 0.5, "--force")).stdout.splitlines()]
    assert [r["mode"] for r in plain] == ["threshold 0.5 (probability)"] * 2
    assert [r["mode"] for r in default] == ["verified threshold 0.5 (probability)"] * 2
    sampled = invoke(*common, "--threshold", 0.5, "--force", "--temp", 0.7)
    assert (
        "ignored" not in sampled.stderr
        and json.loads(sampled.stdout.splitlines()[0])["mode"] == "threshold 0.5 (probability)"
    )
    assert "lossless mode verifies every draft already" in invoke(*common, "--lossless", "--verify").stderr
    assert "is ignored" not in invoke(*common, "--threshold", 0.5, "--verify", "--force", "--hedge", 1).stderr


def test_default_mode_lossless(tiny, data, tmp_path):
    """A checkpoint whose mars.json says default_mode lossless decodes losslessly when given no
    --threshold (output identical to AR), and at a threshold when given one."""
    out = tmp_path / "out"
    ok(invoke(*finetune_args(tiny, data, out, "--default-mode", "lossless", "--default-threshold", 0.5, kind="full")))
    assert json.loads((out / "mars.json").read_text())["default_mode"] == "lossless"
    common = (
        "generate",
        "--model",
        out,
        "--prompt",
        "Spell from c",
        "--prompt",
        "hi",
        "--max-tokens",
        12,
        "--json",
        "--device",
        "cpu",
    )
    default = [json.loads(line) for line in ok(invoke(*common)).stdout.splitlines()]
    ar = [json.loads(line) for line in ok(invoke(*common, "--threshold", 1.0)).stdout.splitlines()]
    loose = [json.loads(line) for line in ok(invoke(*common, "--threshold", 0.5)).stdout.splitlines()]
    assert [r["mode"] for r in default] == ["lossless greedy"] * 2
    assert [r["mode"] for r in ar] == ["AR greedy"] * 2
    assert [r["mode"] for r in loose] == ["verified threshold 0.5 (probability)"] * 2
    assert [r["text"] for r in default] == [r["text"] for r in ar]
    plain = [json.loads(line) for line in ok(invoke(*common, "--hedge", 0)).stdout.splitlines()]
    assert [r["text"] for r in plain] == [r["text"] for r in ar] and plain[0]["mode"] == "lossless greedy"
    fixed = [json.loads(line) for line in ok(invoke(*common, "--feed", "fixed")).stdout.splitlines()]
    assert [r["text"] for r in fixed] == [r["text"] for r in ar]
    fixed_loose = [
        json.loads(line) for line in ok(invoke(*common, "--threshold", 0.5, "--feed", "fixed")).stdout.splitlines()
    ]
    assert [r["mode"] for r in fixed_loose] == ["verified threshold 0.5 (probability)"] * 2
    assert invoke(*common, "--feed", "wide").exit_code == 2
    result = ok(
        invoke(
            "chat",
            "--model",
            out,
            "--max-tokens",
            8,
            "--device",
            "cpu",
            input="hello\n/threshold 0.5\nhi\n/lossless\nhey\n/quit\n",
        )
    )
    said = [line.removeprefix(">> ").strip() for line in result.output.splitlines()]
    said = [line for line in said if line.startswith(("AR", "lossless", "threshold", "verified"))]
    assert said[0].startswith("lossless greedy, B=4")
    assert said[1:] == ["verified threshold 0.5 (probability)", "lossless greedy"]
    assert len([line for line in result.output.splitlines() if "tokens/forward" in line]) == 3
    bad = tmp_path / "bad"
    one_line_error(invoke(*finetune_args(tiny, data, bad, "--default-mode", "fast")), "--default-mode")
    assert not bad.exists()


# --- 7. chat ------------------------------------------------------------------------------


def test_chat(full):
    out, _ = full
    result = ok(
        invoke(
            "chat",
            "--model",
            out,
            "--max-tokens",
            8,
            "--device",
            "cpu",
            input="hello\n/threshold 0.5\nhi\n/quit\n",
        )
    )
    assert "threshold 0.5 (probability)" in result.output
    replies = [line for line in result.output.splitlines() if "tokens/forward" in line]
    assert len(replies) == 2, result.output


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
