"""benchmarks/step_parts.py on a tiny MARS checkpoint (random weights, mars.json with default
mode lossless), torch and MLX: every part of a step is measured and the parts add up, the
transfers both ways are counted (host-to-device ones at the mars code that asks for them), and
the instrumented decoding gives the replies plain decoding gives (lossless equal to AR). No
timing is compared with anything: the machine's speed does not matter."""

import json
import math
import types

import pytest
from clitools import write_jsonl
from tiny import load_script, save_model

PARTS = ("forward", "reduce + D2H", "host")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mars.core.config import MarsConfig, write_config

    path = save_model(tmp_path_factory.mktemp("step_parts") / "model", "llama", seed=1)
    write_config(
        MarsConfig(
            block_size=4, mask_token="<unused0>", mask_token_id=3, default_threshold=0.9, default_mode="lossless"
        ),
        path,
    )
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    records = [{"prompt": p} for p in ("Hello there", "abc abc abc abc", "Why is the sky blue?")]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", records)


@pytest.mark.parametrize("backend,batch", [("torch", 1), ("torch", 2), ("mlx", 1)])
def test_parts_add_up_and_decoding_is_unchanged(checkpoint, prompts, tmp_path, backend, batch):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")
    script = load_script("benchmarks/step_parts.py")
    out = tmp_path / "parts.json"
    report = script.main(
        [
            "--model",
            str(checkpoint),
            "--backend",
            backend,
            "--prompts",
            str(prompts),
            "--limit",
            "3",
            "--max-tokens",
            "10",
            "--batch",
            str(batch),
            "--warmup-tokens",
            "3",
            "--output",
            str(out),
        ]
        + (["--device", "cpu", "--dtype", "float32", "--evict-mb", "1"] if backend == "torch" else [])
    )
    assert json.loads(out.read_text())["modes"].keys() == {"AR", "lossless"}
    assert report["modes"]["lossless"]["plan"].startswith("lossless")
    for name, m in report["modes"].items():
        assert m["steps"] > 0 and m["step_calls"] == m["steps"], name
        parts = m["parts_ms_per_step"]
        assert all(parts[p] >= 0 for p in PARTS), (name, parts)
        assert parts["forward"] > 0
        assert math.isclose(sum(parts.values()), m["ms_per_step"], rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(sum(m["parts_share"].values()), 1.0, rel_tol=1e-6)
        items = m["host_ms_per_step"]
        assert all(v >= 0 for v in items.values()), (name, items)
        assert math.isclose(sum(items.values()), parts["host"], rel_tol=1e-6, abs_tol=1e-9)
        assert isinstance(m["d2h_transfers"], int) and m["d2h_transfers"] > 0
        assert isinstance(m["d2h_bytes"], int) and m["d2h_bytes"] > 0
        lo, hi = m["d2h_per_step_range"]
        assert isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi
        assert sum(site["count"] for site in m["d2h_sites"].values()) == m["d2h_transfers"]
        # Every step copies its inputs (ids, positions or reads) to the device: a few a step, at mars's code.
        assert isinstance(m["h2d_transfers"], int) and m["h2d_transfers"] > 0
        assert isinstance(m["h2d_bytes"], int) and m["h2d_bytes"] > 0
        # Transfers are counted in their own untimed pass, over its own steps.
        assert m["counted_steps"] > 0
        assert math.isclose(m["h2d_per_step"], m["h2d_transfers"] / m["counted_steps"])
        assert 1 <= m["h2d_per_step"] <= 16, (name, m["h2d_per_step"], m["h2d_sites"])
        lo, hi = m["h2d_per_step_range"]
        assert isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi
        assert sum(site["count"] for site in m["h2d_sites"].values()) == m["h2d_transfers"]
        assert all(site.startswith(f"mars/backends/{backend}/") for site in m["h2d_sites"]), m["h2d_sites"]
    # torch's own forward is also timed replayed, and replayed with an array read at each forward:
    # each mode's replay decided as the forward did.
    for name, m in report["modes"].items():
        for key in ("replayed", "replayed_evicted"):
            r = m[key]
            if backend == "mlx":
                assert r is None
                continue
            assert r is not None and r["steps"] > 0, (name, key)
            assert r["host_ms_per_step"] >= 0 and r["reduce_ms_per_step"] >= 0
            assert math.isclose(
                sum(r["host_items_ms_per_step"].values()), r["host_ms_per_step"], rel_tol=1e-6, abs_tol=1e-9
            )
        if backend == "torch":  # the same decisions, so the same steps; reading the array is the forward's time
            assert m["replayed_evicted"]["steps"] == m["replayed"]["steps"]
    assert report["evict_mb"] == (1 if backend == "torch" else 0)
    # The peers at batch 1 on torch, a plain transformers loop and the least lossless loop over mars's
    # own step: timed alike, and AR's replies.
    for key in ("plain_loop", "chain_loop"):
        peer = report[key]
        if backend == "torch" and batch == 1:
            assert peer["steps"] > 0 and peer["forward_ms_per_step"] > 0 and peer["reduce_ms_per_step"] >= 0
            assert math.isclose(
                peer["forward_ms_per_step"] + peer["reduce_ms_per_step"] + peer["host_ms_per_step"],
                peer["ms_per_step"],
                rel_tol=1e-6,
            )
            assert report[f"{key}_replies_equal_to_ar"] == report["prompts"], key
        else:
            assert peer is None and report[f"{key}_replies_equal_to_ar"] is None
    # The untimed wall time a token of AR, lossless and the least loop, one value a round each.
    wall = report["wall_ms_per_token_interleaved"]
    if backend == "torch" and batch == 1:
        assert report["chain_loop"]["tokens_per_forward"] >= 1
        assert wall.keys() == {"AR", "lossless", "chain_loop"}
        assert all(len(v) == report["rounds"] and min(v) > 0 for v in wall.values()), wall
    else:
        assert wall is None
    # Lossless decoding is AR's, and the timers change nothing that is decoded.
    assert report["tokens"]["lossless"] == report["tokens"]["AR"]
    assert report["replies_equal_to_ar"] == report["prompts"] == 3
    plain = plain_replies(checkpoint, prompts, backend, batch)
    assert report["tokens"]["AR"] == plain
    # Everything the script patched is back as it was.
    from mars.core.decode import loop as decoding
    from mars.core.decode import strategies

    assert decoding._advance.__module__ == "mars.core.decode.loop"
    from mars.core.decode import cost

    assert cost.CostCurve.observe.__module__ == "mars.core.decode.cost"  # the replay's frozen curves thaw
    assert strategies.WindowStrategy.lay_out.__module__ == "mars.core.decode.strategies"
    if backend == "torch":
        import torch

        assert "cpu" not in vars(torch.Tensor) and "__bool__" not in vars(torch.Tensor)
        assert all(
            isinstance(getattr(torch, f), types.BuiltinFunctionType)
            for f in ("from_numpy", "tensor", "as_tensor", "asarray")
        )
    else:
        import mlx.core as mx
        import numpy as np

        from mars.backends.mlx import decode as mlx_model
        from mars.backends.mlx import forward as mlx_forward

        assert mlx_model.np is np
        assert mlx_model.mx is mx and mlx_forward.mx is mx


def plain_replies(checkpoint, prompts, backend, batch):
    from mars.prompts import read_prompts
    from mars.session import Session

    kw = {"device": "cpu", "dtype": "float32"} if backend == "torch" else {}
    session = Session(str(checkpoint), backend=backend, announce=lambda m: None, **kw)
    ids = session.encode(read_prompts(prompts))
    return session.decode(ids, session.plan(threshold=1.0, max_tokens=10), batch).tokens


def test_replayed_logits_keep_ranks_and_log_probabilities():
    """The replay hands back the recorded forward's top ids, in order, with their log-probabilities
    (a tree's ranked guesses read them), and says so when a decode asks for more forwards than the
    recorded one made, instead of inventing an answer."""
    import torch

    script = load_script("benchmarks/step_parts.py")
    torch.manual_seed(0)
    answers = [torch.randn(3, 50) * 4, torch.randn(5, 50)]

    class Cache:
        def reserve(self, width, batch):
            pass

    calls = iter(answers)
    replayer = script.Replayer(lambda cache, inputs: next(calls), top=8)
    inputs = types.SimpleNamespace(width=1, batch=1)
    for _ in answers:
        replayer(Cache(), inputs)
    replayer.replaying = True
    for real in answers:
        fake = replayer(Cache(), inputs)
        assert fake.shape == real.shape
        top_real, top_fake = real.log_softmax(-1).topk(8, dim=-1), fake.log_softmax(-1).topk(8, dim=-1)
        assert torch.equal(top_real.indices, top_fake.indices)
        assert torch.allclose(top_real.values, top_fake.values, atol=1e-4)
        assert torch.equal(real.argmax(-1), fake.argmax(-1))
    with pytest.raises(script.ReplayDiverged):
        replayer(Cache(), inputs)
