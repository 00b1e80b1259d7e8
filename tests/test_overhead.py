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
