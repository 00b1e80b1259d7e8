"""benchmarks/formats.py on a tiny model (no mars.json: its default mode is lossless): every
format runs both modes in interleaved rounds and reports its figures, float32 lossless decoding
is AR's reply for reply on both backends, and the cross-format figures compare each format with
float32 of its own backend. The fixed feed keeps the cost-curve measurement out of the test."""

from __future__ import annotations

import json

import pytest
from tiny import PROMPTS, load_script

from mars.core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM

FORMATS = ("torch:float32", "torch:bfloat16", "mlx:float32", "mlx:4")


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("formats")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    out = tmp / "formats.json"
    script = load_script("benchmarks/formats.py")
    returned = script.main(
        [
            "--model",
            str(tiny),
            "--prompts",
            str(prompts),
            "--limit",
            "3",
            "--max-tokens",
            "8",
            "--repeats",
            "2",
            "--feed",
            "fixed",
            "--formats",
            ",".join(FORMATS),
            "--json",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))  # the JSON is the report the script returned
    return written


def test_every_format_reports_both_modes_over_every_round(report):
    assert list(report["formats"]) == list(FORMATS)
    assert report["limit"] == 3 and report["repeats"] == 2 and report["feed"] == "fixed"
    expected_format = {
        "torch:float32": "torch float32",
        "torch:bfloat16": "torch bfloat16",
        "mlx:float32": "mlx float32",
        "mlx:4": "mlx 4-bit (float32)",
    }
    for spec, r in report["formats"].items():
        assert r["computes_in"] == expected_format[spec]
        # A narrow format's lossless mode may name itself "AR's up to near-ties".
        assert r["ar"]["plan"] == "AR greedy" and r["default"]["plan"].startswith("lossless greedy")
        # The draft sources `mars generate` feeds by default (the tiny model has no draft corpus).
        assert r["default"]["drafts"] == {
            "ngram": DEFAULT_NGRAM,
            "corpus": False,
            "alternatives": DEFAULT_ALTERNATIVES,
            "spare_groups_cap": None,
            "feed": "fixed",
        }
        for mode in ("ar", "default"):
            m = r[mode]
            assert len(m["seconds"]) == 2 and len(m["tokens_per_s"]["rounds"]) == 2
            assert m["tokens_per_s"]["min"] <= m["tokens_per_s"]["median"] <= m["tokens_per_s"]["max"]
            assert len(m["replies"]) == 3 and m["tokens"] == sum(map(len, m["replies"])) > 0
            assert all(0 < len(t) <= 8 for t in m["replies"])
            assert m["replies_changed_after_round_1"] == 0  # greedy: each round repeats the first
        assert r["ar"]["tokens_per_forward"] == 1.0 and r["default"]["tokens_per_forward"] >= 1.0
        ratio = r["default_over_ar"]
        assert len(ratio["rounds"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
        assert r["parity"]["replies"] == 3 and r["parity"]["format"] == r["computes_in"]
        assert r["cost_curve"] is None  # the fixed feed measures none


def test_float32_lossless_replies_are_ar_on_both_backends(report):
    for spec in ("torch:float32", "mlx:float32"):
        r = report["formats"][spec]
        assert r["default"]["replies"] == r["ar"]["replies"]
        assert r["parity"]["identical"] == 3 and r["parity"]["divergences"] == []
    # One model in two float32 implementations: the tiny model's peaked logits leave no near-tie.
    assert report["mlx_float32_ar_equal_to_torch_float32_ar"]["identical"] == 3


def test_each_narrow_format_is_compared_with_float32_of_its_backend(report):
    formats = report["formats"]
    for spec, reference in (("torch:bfloat16", "torch:float32"), ("mlx:4", "mlx:float32")):
        r = formats[spec]
        same = r["ar_equal_to_float32_ar"]
        assert same["reference"] == reference and same["replies"] == 3
        assert same["identical"] == sum(a == b for a, b in zip(r["ar"]["replies"], formats[reference]["ar"]["replies"]))
        for mode in ("ar", "default"):
            ours, theirs = r[mode]["tokens_per_s"]["rounds"], formats[reference][mode]["tokens_per_s"]["rounds"]
            assert r["over_float32"][mode]["rounds"] == pytest.approx([a / b for a, b in zip(ours, theirs)])
    for spec in ("torch:float32", "mlx:float32"):
        assert "over_float32" not in formats[spec] and "ar_equal_to_float32_ar" not in formats[spec]


def test_a_format_that_is_not_one_is_refused():
    script = load_script("benchmarks/formats.py")
    with pytest.raises(SystemExit, match="mlx:BITS"):
        script.parse_formats("torch:4")
