"""benchmarks/overhead.py --quick (a 2-layer random model with the default's vocabulary and tokenizer, 1 prompt,
4 tokens, widths 1 and 5, one round): every runner reports, mars's AR equals transformers' greedy loop and
generate, lossless equals AR, and each lossless step fed the width its feed promises. No timing is compared
with anything: the machine's speed does not matter."""

import json

import pytest
from tiny import load_script

RUNNERS = (
    "mars_ar",
    "mars_lossless_w1",
    "mars_lossless_w5",
    "hf_generate",
    "hf_loop",
    "hf_forward_w1",
    "hf_forward_w5",
)


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/overhead.py")


def test_fixed_feeds_reach_the_widths_they_can(script):
    # (B, hedge, width): 1 + B (2 + hedge) tokens a step; 5 has no such feed and runs the nearest, 4.
    assert script.fixed_feed(9) == (2, 2, 9)
    assert script.fixed_feed(17) == (4, 2, 17)
    assert script.fixed_feed(33) == (8, 2, 33)
    assert script.fixed_feed(5) == (1, 1, 4)


def test_quick_run_reports_every_runner_and_ar_equal(script, tmp_path):
    from mars.checkpoint.default_model import DefaultModelError, default_model_dir

    try:
        default_model_dir(announce=lambda m: None)  # its tokenizer and vocabulary make the model
    except DefaultModelError as e:
        pytest.skip(str(e))
    out = tmp_path / "overhead.json"
    report = script.main(["--quick", "--output", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ar_equal"] is True and report["ar_equal"] is True
    assert saved["lossless_equal_ar"] == {"w1": True, "w5": True}
    assert set(RUNNERS) <= set(saved["runners"])
    assert "hf_static_compiled" not in saved["runners"]  # --quick does not compile
    assert saved["settings"]["model"]["layers"] == 2 and saved["settings"]["model"]["vocab"] == 49152
    for name in RUNNERS:
        row = saved["runners"][name]
        assert len(row["ms_per_step"]) == 1 and row["median_ms_per_step"] > 0
        assert row["same_every_round"]
    assert saved["runners"]["mars_ar"]["tokens"] == 4
    # W = 1: every decoding step feeds the one token; W = 5: B 1, hedge 1, 4 a step (the last may be cut).
    w1, w5 = saved["runners"]["mars_lossless_w1"], saved["runners"]["mars_lossless_w5"]
    assert set(w1["decoding_step_widths"]) == {"1"}
    assert (w5["block_size"], w5["hedge"], w5["expected_width"]) == (1, 1, 4)
    assert max(int(w) for w in w5["decoding_step_widths"]) == 4
    assert saved["runners"]["hf_forward_w5"]["width"] == 4
    assert set(saved["ratios"]) == {
        "mars_ar_vs_hf_loop",
        "lossless_w1_vs_hf_forward_w1",
        "lossless_w5_vs_hf_forward_w5",
    }


def test_projection_reads_kept_tokens_per_forward_at_measured_step_costs(script, tmp_path):
    """The projection divides the step cost at each mode's fed width (interpolated between the measured
    widths, linear past the widest) by its kept tokens per forward, and says it is a projection."""
    kept = tmp_path / "flat.json"
    kept.write_text(
        json.dumps(
            {
                "flat_curve": [
                    {"mode": "inside", "tokens_per_forward": 2.0, "fed_tokens_per_forward": 3.0},
                    {"mode": "beyond", "tokens_per_forward": 4.0, "fed_tokens_per_forward": 9.0},
                    {"mode": "old run", "tokens_per_forward": 2.0},  # no fed width kept: left out
                ]
            }
        )
    )
    rows = {
        "mars_compiled_ar": {"width": 1.0, "median_ms_per_step": 1.0, "median_ms_per_token": 1.0},
        "mars_compiled_lossless_w5": {"width": 5.0, "median_ms_per_step": 2.0, "median_ms_per_token": 1.5},
        "mars_ar": {"width": 1.0, "median_ms_per_step": 9.0, "median_ms_per_token": 9.0},
    }
    got = script.projection(rows, kept)
    assert "projection" in got["label"] and "not a measurement" in got["label"]
    inside, beyond = got["modes"]["inside"], got["modes"]["beyond"]
    assert inside["projected_ms_per_token"] == 0.75 and not inside["extrapolated"]  # 1.5 ms / 2 tokens
    assert inside["projected_vs_mars_compiled_ar"] == round(1.0 / 0.75, 4)
    assert beyond["projected_ms_per_token"] == 0.75 and beyond["extrapolated"]  # 3.0 ms at width 9 / 4 tokens
    assert set(got["modes"]) == {"inside", "beyond"}
    assert script.projection(rows, tmp_path / "missing.json") is None
