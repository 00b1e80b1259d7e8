"""What a new user can get wrong: outputs that must not destroy anything, thresholds out of
range, chat commands, options that do nothing where they are given, and fuzzed arguments.

Every bad input must end in a one-line error (or an HTTP 4xx) with a non-zero exit status,
write nothing, and delete nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from clitools import invoke, ok, one_line_error
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from mars.convert import ConvertError, convert_model
from mars.core.acceptance import THRESHOLD_RANGES, ThresholdError, check_threshold
from mars.core.config import ConfigError, MarsConfig
from mars.core.decode.plan import Mode, Plan


def tree(root: Path) -> dict:
    """Every file and directory under root (hidden ones included) with its size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st_ = p.lstat()
            out[str(p.relative_to(root))] = (p.is_dir(), st_.st_size, st_.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def lossless_ckpt(tiny, data, tmp_path_factory):
    """A tiny full fine-tune whose mars.json says default_mode lossless."""
    out = tmp_path_factory.mktemp("ckpt") / "out"
    ok(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--fine-tune-type",
            "full",
            "--iters",
            3,
            "--batch-size",
            4,
            "--device",
            "cpu",
            "--default-mode",
            "lossless",
            "--default-threshold",
            0.5,
        )
    )
    return out


# --- 1. mars convert never destroys what is at --output or the source ---------------------


def test_convert_into_a_folder_holding_the_source_is_refused(tiny, tmp_path):
    """The reported case: `convert ./w/fused-hf --output ./w` deleted the source and notes.txt."""
    w = tmp_path / "w"
    w.mkdir()
    shutil.copytree(tiny, w / "fused-hf")
    (w / "notes.txt").write_text("hi")
    before = tree(tmp_path)
    for extra in ((), ("--overwrite",)):
        one_line_error(invoke("convert", w / "fused-hf", "--to", "mlx", "--output", w, *extra), "source")
        assert tree(tmp_path) == before
    # inside the source, or the source itself, is refused too
    one_line_error(invoke("convert", w / "fused-hf", "--to", "mlx", "--output", w / "fused-hf" / "mlx"), "source")
    one_line_error(invoke("convert", w / "fused-hf", "--to", "hf", "--output", w / "fused-hf", "--overwrite"), "source")
    assert tree(tmp_path) == before


def test_convert_refuses_existing_output_unless_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("hi")
    before = tree(tmp_path)
    one_line_error(invoke("convert", tiny, "--to", "mlx", "--output", out), "exists", "--overwrite")
    assert tree(tmp_path) == before
    ok(invoke("convert", tiny, "--to", "mlx", "--output", out, "--overwrite"))
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no hidden leftovers
    # an empty directory is fine without --overwrite
    empty = tmp_path / "empty"
    empty.mkdir()
    ok(invoke("convert", tiny, "--to", "mlx", "--output", empty))
    assert (empty / "config.json").is_file()


def test_convert_over_a_file(tiny, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    one_line_error(invoke("convert", tiny, "--to", "mlx", "--output", notes), "exists", "file")
    assert notes.read_text() == "hi" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    ok(invoke("convert", tiny, "--to", "mlx", "--output", notes, "--overwrite"))
    assert (notes / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing hidden left behind


def test_convert_to_the_current_directory(tiny, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    before = tree(tmp_path)
    for target in (".", "..", str(work)):
        for extra in ((), ("--overwrite",)):
            one_line_error(invoke("convert", tiny, "--to", "mlx", "--output", target, *extra), "current directory")
    assert tree(tmp_path) == before


def test_convert_adapter_output_guard(tiny, tmp_path):
    """Adapters too: the library refuses (ConvertError) and the source stays."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA"}))
    with pytest.raises(ConvertError, match="source"):
        from mars.convert import convert_adapter

        convert_adapter(adapter, tmp_path, "mlx")
    with pytest.raises(ConvertError, match="source"):
        convert_model(tiny, tiny.parent, "mlx", overwrite=True)
    assert (adapter / "adapter_config.json").is_file() and (tiny / "config.json").is_file()


def test_finetune_output_is_a_file(tiny, data, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    one_line_error(
        invoke("finetune", "--model", tiny, "--data", data, "--output", notes, "--iters", 1, "--device", "cpu"),
        "exists",
    )
    assert notes.read_text() == "hi"
    one_line_error(
        invoke("finetune", "--model", tiny, "--data", data, "--output", data, "--iters", 1, "--device", "cpu"), "source"
    )


def test_convert_accepts_the_default_reference(tiny, tmp_path, monkeypatch):
    """`default:SmolLM2-135M-Instruct` names the embedded default as SRC and as --model, as in every other command."""
    import mars.checkpoint.default_model as dm

    monkeypatch.setattr(dm, "default_model_dir", lambda announce=print: tiny)
    out = tmp_path / "mlx"
    ok(invoke("convert", dm.DEFAULT_REF, "--to", "mlx", "--output", out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


# --- 3. thresholds: one range check in the core, every entry point uses it -------------------


@pytest.mark.parametrize("metric", sorted(THRESHOLD_RANGES))
def test_threshold_ranges(metric):
    low, high = THRESHOLD_RANGES[metric]
    for good in (low, 0.5, 1.0, 3.0 if math.isinf(high) else high):
        assert check_threshold(metric, good) == good
        Plan(mask_id=3, eos_ids=(2,), mode=Mode.LOSSLESS, threshold=good, metric=metric)  # any mode's threshold
    for bad in (-1, -1e-9, math.nan, math.inf, -math.inf, "0.5", True, None) + ((1.5, 1 + 1e-9) if high == 1.0 else ()):
        with pytest.raises(ThresholdError) as e:
            check_threshold(metric, bad)
        assert "\n" not in str(e.value)
        with pytest.raises(ThresholdError):
            Plan(mask_id=3, eos_ids=(2,), mode=Mode.LOSSLESS, threshold=bad, metric=metric)
    with pytest.raises(ConfigError, match="default_threshold"):
        MarsConfig(block_size=4, mask_token="m", mask_token_id=3, metric=metric, default_threshold=-1).validate()


@pytest.mark.parametrize("threshold", [-1, 1.5, "nan"])
def test_generate_threshold_out_of_range(tiny, threshold):
    one_line_error(
        invoke("generate", "--model", tiny, "--prompt", "hi", "--max-tokens", 2, "--threshold", threshold, "--force"),
        "--threshold",
        "out of range",
    )


def test_entropy_thresholds_above_one_are_fine(tiny):
    ok(
        invoke(
            "generate",
            "--model",
            tiny,
            "--prompt",
            "hi",
            "--max-tokens",
            2,
            "--metric",
            "entropy",
            "--threshold",
            1.5,
            "--force",
        )
    )


def test_finetune_default_threshold_out_of_range(tiny, data, tmp_path):
    out = tmp_path / "out"
    one_line_error(
        invoke(
            "finetune",
            "--model",
            tiny,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            1,
            "--device",
            "cpu",
            "--default-threshold",
            1.5,
        ),
        "--default-threshold",
    )
    assert not out.exists()


def test_eval_and_bench_threshold_out_of_range(tiny, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    one_line_error(
        invoke("eval", "--model", tiny, "--prompts", prompts, "--no-nll", "--threshold", "1.5,-1", "--max-tokens", 2),
        "out of range",
    )
    one_line_error(
        invoke(
            "bench",
            "--model",
            tiny,
            "--prompts",
            prompts,
            "--threshold",
            -1,
            "--batch-sizes",
            1,
            "--block-cache",
            4,
            "--repeats",
            1,
            "--forward-k",
            0,
            "--max-tokens",
            2,
            "--force",
        ),
        "out of range",
    )


def test_serve_threshold_out_of_range(tiny):
    pytest.importorskip("starlette")
    for flag in ("--threshold", "--min-threshold", "--max-threshold"):
        one_line_error(invoke("serve", "--model", tiny, flag, -1), flag, "out of range")


# --- 4. chat commands, options that do nothing, serve's default mode, bench progress -------


def test_chat_commands_never_reach_the_model(lossless_ckpt):
    result = ok(
        invoke(
            "chat",
            "--model",
            lossless_ckpt,
            "--max-tokens",
            4,
            "--device",
            "cpu",
            input="/help\n/bogus 1\n/threshold -1\n/threshold x\nhello\n//x\n/quit\n",
        )
    )
    out = result.output
    assert "/threshold X" in out and "/lossless" in out  # the help text
    assert "unknown command /bogus" in out
    assert "out of range" in out and "keeping lossless greedy" in out
    replies = [line for line in out.splitlines() if "tokens/forward" in line]
    assert len(replies) == 2, out  # "hello" and "/x" only


def test_ignored_options_are_reported(lossless_ckpt):
    common = ("generate", "--model", lossless_ckpt, "--prompt", "hi", "--max-tokens", 2, "--device", "cpu")
    result = ok(invoke(*common, "--lossless", "--threshold", 0.9))
    assert "--threshold is ignored with --lossless" in result.output
    result = ok(invoke(*common, "--cache", "block", "--hedge", 2))
    assert "--hedge is ignored" in result.output and "block cache" in result.output
    result = ok(invoke(*common, "--threshold", 0.9, "--hedge", 2, "--no-verify"))
    assert "--hedge is ignored" in result.output and "lossless" in result.output
    # Verified threshold mode (threshold mode's default) feeds spare groups as lossless mode does.
    assert "ignored" not in ok(invoke(*common, "--threshold", 0.9, "--hedge", 2)).output
    quiet = ok(invoke(*common, "--hedge", 2))
    assert "ignored" not in quiet.output


def test_serve_follows_the_checkpoints_default_mode(lossless_ckpt):
    """Without a threshold the server decodes a lossless-default checkpoint losslessly, as generate does."""
    pytest.importorskip("starlette")
    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import load
    from mars.serve import ServeLimits, build
    from mars.serve.api import ApiError, parse
    from mars.serve.engine import Job
    from mars.session import Session

    tm = load(lossless_ckpt, device="cpu", announce=lambda m: None)
    limits = ServeLimits()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    session = Session.from_loaded(tm, TorchDecoder)
    _, engine = build(session)
    assert engine.policy.default_mode is Mode.LOSSLESS

    def req(b):
        return parse(
            b,
            chat=True,
            session=engine.session,
            names=engine.names,
            policy=engine.policy,
            limits=limits,
        )

    def planned(b):
        """The plan the engine makes for the request (make_plan, with the server's defaults)."""
        r = req(b)
        return engine._plan(
            Job(
                prompt=r.prompt,
                max_tokens=r.max_tokens,
                outbox=None,
                sampling=r.sampling,
                lossless=r.lossless,
                verify=r.verify,
                threshold=r.threshold,
                pinned=r.pinned,
            )
        )

    assert req(body).lossless is None and planned(body).mode is Mode.LOSSLESS
    at = planned({**body, "threshold": 0.9})
    assert at.mode is Mode.VERIFIED and at.threshold == 0.9 and req({**body, "threshold": 0.9}).threshold == 0.9
    assert planned({**body, "lossless": False}).mode is not Mode.LOSSLESS
    for bad in (-1, 1.5):
        with pytest.raises(ApiError) as e:
            req({**body, "threshold": bad})
        assert e.value.status == 400 and "out of range" in e.value.body()["error"]["message"]
    # told otherwise: a server threshold, or a policy that turns it
    assert build(session, policy={"default_threshold": 0.9})[1].policy.default_mode is not Mode.LOSSLESS
    assert build(session, policy={"policy": "adaptive"})[1].policy.default_mode is not Mode.LOSSLESS
    assert build(session, policy={"default_mode": "threshold"})[1].policy.default_mode is not Mode.LOSSLESS


def test_bench_shows_progress(tiny, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\nho\n")
    result = ok(
        invoke(
            "bench",
            "--model",
            tiny,
            "--prompts",
            prompts,
            "--batch-sizes",
            1,
            "--block-cache",
            4,
            "--repeats",
            1,
            "--forward-k",
            "1,2",
            "--forward-repeats",
            1,
            "--max-tokens",
            2,
            "--threshold",
            1.0,
        )
    )
    # counted in tokens: 5 configurations (AR, transformers, transformers prompt lookup, window, block4) x
    # (warm-up: 1 prompt + 1 round: 2 prompts) x 2 tokens, + the forwards of k = 1 and 2 tokens x (warm-up + 1)
    assert "bench:" in result.output and "0/36 [" in result.output and "token/s" in result.output


def test_eval_table_explains_its_columns(tiny, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    out = ok(
        invoke("eval", "--model", tiny, "--prompts", prompts, "--no-nll", "--threshold", 1.0, "--max-tokens", 2)
    ).output
    header = next(line for line in out.splitlines() if "tok/fwd" in line)
    columns = header.split()[:8]
    for column in columns:
        assert any(line.strip().startswith(f"{column}:") for line in out.splitlines()), f"no legend for {column}"


# --- fuzzed arguments: a one-line error, nothing written or deleted ----------------------------

FUZZ = hsettings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
NAN, INF = math.nan, math.inf
# Out-of-range values per option: each must be refused before any work.
BAD_GENERATE = {
    "threshold": [-1, -1e-6, NAN, INF, -INF, "x"],
    "block-size": [0, -1, 1.5],
    "max-tokens": [0, -3],
    "top-p": [0, -0.5, 1.5, NAN],
    "top-k": [-1, 0.5],
    "temp": [-1, NAN, INF],
    "hedge": [-1, "x"],
    "batch-size": [0, -2],
    "block-cache": [0],
    "cache": ["blocks"],
    "metric": ["confidence"],
}
BAD_FINETUNE = {
    "block-size": [0, -1, 1.5],
    "max-seq-length": [0, -5, 2.5],
    "iters": [-1, 1.5],
    "batch-size": [0, -2],
    "learning-rate": [-1, NAN, INF],
    "default-threshold": [-1, 1.5, NAN, INF],
    "lora-rank": [0, -1],
    "lora-alpha": [0, -1, NAN],
    "lora-dropout": [-0.1, 1.0, NAN],
    "ar-weight": [-1, NAN, INF],
    "warmup": [-0.1, 1.5, NAN],
    "weight-decay": [-1, NAN],
    "epochs": [0, -1, NAN, INF],
    "grad-accumulation-steps": [0],
    "save-every": [0],
    "steps-per-eval": [0],
    "default-mode": ["fast"],
}
BAD_CONVERT = {
    "q-bits": [0, -1, 7, 9, 33],
    "q-group-size": [0, -1, 7, 48],
    "dtype": ["float8", "int4"],
    "to": ["gguf"],
}
BAD_REQUEST = {
    "threshold": [-1, 1.5, NAN, INF, "x", True],
    "temperature": [-1, 2.5, NAN, "x"],
    "top_p": [0, -1, 1.5, NAN],
    "top_k": [-1, 1.5, "x"],
    "max_tokens": [0, -1, 10**9, 1.5, "x"],
    "n": [2, 0, "x"],
    "lossless": ["x", 1],
    "adaptive": ["x", 0],
    "seed": [1.5, "x"],
}


def _pairs(table: dict):
    return st.sampled_from([(k, v) for k, vs in table.items() for v in vs])


def _assert_clean_failure(result, root: Path, before: dict, output: Path | None = None):
    one_line_error(result)
    after = tree(root)
    assert after == before, sorted(set(after.items()) ^ set(before.items()))
    if output is not None:
        assert not output.exists()


@FUZZ
@given(
    bad=_pairs(BAD_GENERATE),
    extra=st.sets(st.sampled_from(["--lossless", "--raw", "--json", "--compare"])),
    cache=st.sampled_from(["window", "block", "none"]),
    metric=st.sampled_from(["probability", "margin", "entropy"]),
)
def test_fuzz_generate(tiny, tmp_path_factory, bad, extra, cache, metric):
    root = tmp_path_factory.mktemp("gen")
    before, model = tree(root), tree(tiny)
    result = invoke(
        "generate",
        "--model",
        tiny,
        "--prompt",
        "hi",
        "--max-tokens",
        2,
        "--device",
        "cpu",
        "--cache",
        cache,
        "--metric",
        metric,
        "--force",
        *sorted(extra),
        f"--{bad[0]}",
        bad[1],
    )
    _assert_clean_failure(result, root, before)
    assert tree(tiny) == model


@FUZZ
@given(bad=_pairs(BAD_FINETUNE), kind=st.sampled_from(["lora", "full"]))
def test_fuzz_finetune(tiny, data, tmp_path_factory, bad, kind):
    root = tmp_path_factory.mktemp("ft")
    out = root / "out"
    before, inputs = tree(root), tree(tiny) | tree(data)
    result = invoke(
        "finetune",
        "--model",
        tiny,
        "--data",
        data,
        "--output",
        out,
        "--iters",
        1,
        "--batch-size",
        2,
        "--device",
        "cpu",
        "--fine-tune-type",
        kind,
        f"--{bad[0]}",
        bad[1],
    )
    _assert_clean_failure(result, root, before, out)
    assert tree(tiny) | tree(data) == inputs


@FUZZ
@given(bad=st.one_of(_pairs(BAD_CONVERT), st.just(("existing output", None))), overwrite=st.booleans())
def test_fuzz_convert(tiny, tmp_path_factory, bad, overwrite):
    root = tmp_path_factory.mktemp("cv")
    out = root / "out"
    args = ["convert", tiny, "--to", "mlx", "--output", out] + (["--overwrite"] if overwrite else [])
    name, value = bad
    if name in ("q-bits", "q-group-size"):
        args += ["-q", f"--{name}", value]
    elif name == "dtype":
        args += ["--dtype", value]
    elif name == "to":
        args[3] = value
    else:  # an existing, non-empty output, without --overwrite
        args = [a for a in args if a != "--overwrite"]
        out.mkdir()
        (out / "mine.txt").write_text("mine")
    before, model = tree(root), tree(tiny)
    result = invoke(*args)
    _assert_clean_failure(result, root, before, None if name == "existing output" else out)
    assert tree(tiny) == model


@FUZZ
@given(bad=_pairs(BAD_REQUEST), chat=st.booleans())
def test_fuzz_request_bodies(served, bad, chat):
    """Out-of-range values in a request: a 400 with an OpenAI-style error, never a reply or a 5xx."""
    import httpx

    field, value = bad
    body = {"max_tokens": 2, field: value}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(
        served + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60
    )
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def served(lossless_ckpt):
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    import socket
    import threading
    import time

    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import load
    from mars.serve import ServeLimits, build
    from mars.session import Session

    tm = load(lossless_ckpt, device="cpu", announce=lambda m: None)
    app, _ = build(
        Session.from_loaded(tm, TorchDecoder),
        name="tiny",
        serve_limits=ServeLimits(max_tokens_limit=8, default_max_tokens=4),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # seconds on an idle machine; generous for a busy one
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(20)
