"""`mars eval`: NLL equals a direct computation, the threshold sweep's statistics are sound, the CLI writes its
outputs."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import save_model

from mars import evaluate as ev
from mars.cli.evaluate import evaluate_command
from mars.core.config import MarsConfig, write_config
from mars.core.train.data import IGNORE, DataError

RECORDS = [
    {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How are you?"}]},
    {"prompt": "What is 2+2?", "completion": "It is 4."},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour"},
            {"role": "assistant", "content": "Blue, like the sea."},
        ]
    },
    {"text": "Plain text has no prompt to decode."},
    {"prompt": "Write a short poem", "completion": "Waves roll in; waves roll out."},
]
QUIET = dict(announce=lambda m: None)
FAST = dict(max_tokens=12, batch_size=2, thresholds=(1.0, 0.9, 0.5))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    mars = save_model(root / "mars", "llama", seed=1)
    write_config(MarsConfig(block_size=4, mask_token="<unused0>", mask_token_id=3, default_threshold=0.9), mars)
    base = save_model(root / "base", "llama", seed=2)
    data = root / "data"
    data.mkdir()
    write_jsonl(data / "test.jsonl", RECORDS)
    write_jsonl(data / "train.jsonl", RECORDS[:2])
    return {"root": root, "mars": mars, "base": base, "data": data}


@pytest.fixture(scope="module")
def torch_report(paths):
    models = [ev.load_model(paths["mars"], "torch", **QUIET)]
    baseline = ev.load_model(paths["base"], "torch", **QUIET)
    return ev.evaluate(models, baseline=baseline, data=paths["data"], settings=ev.EvalSettings(**FAST))


def direct_clean_nll(path, data_file, block_size=4):
    """Mean CE of a plain HF forward over every response token (EOS included, block padding not)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    total, count = 0.0, 0
    for ex in ev.load_examples(data_file, tok, block_size=block_size):
        labels = ev.response_labels(ex.labels[None], tok.eos_token_id)[0]
        with torch.no_grad():
            logits = model(torch.from_numpy(ex.ids)[None]).logits[0].float()
        t = np.nonzero((labels != IGNORE) & (np.arange(labels.size) > 0))[0]
        ce = torch.nn.functional.cross_entropy(logits[t - 1], torch.from_numpy(labels[t]), reduction="sum")
        total += float(ce)
        count += t.size
    return total / count, count


def check_sweep(sweep, block_size=4):
    rows = sweep["thresholds"]
    assert rows[0]["threshold"] == 1.0
    ar = rows[0]
    assert ar["exact_match"] == 1.0 and ar["mean_prefix_fraction"] == 1.0 and ar["tokens_per_forward"] == 1.0
    assert ar["slot_acceptance"] == [1.0] + [0.0] * block_size
    for r in rows:
        slots = r["slot_acceptance"]
        assert len(slots) == block_size + 1
        assert slots[0] == 1.0
        assert all(0.0 <= s <= 1.0 for s in slots)
        assert all(a >= b for a, b in zip(slots, slots[1:]))  # a slot is accepted only after every earlier one
        # every counted forward accepts slot 0, so tokens/forward is the sum of the slot rates
        assert r["tokens_per_forward"] == pytest.approx(sum(slots))
        assert 0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["mean_prefix_fraction"] <= 1.0
        assert len(r["outputs"]) == sweep["prompts"]
        prefixes = [ev.common_prefix(o, a) for o, a in zip(r["outputs"], ar["outputs"])]
        assert r["mean_prefix"] == pytest.approx(np.mean(prefixes))
        assert r["exact_match"] == pytest.approx(np.mean([o == a for o, a in zip(r["outputs"], ar["outputs"])]))


def test_torch_nll_equals_a_plain_forward_and_baseline_is_compared(torch_report, paths):
    m = torch_report["models"][0]
    assert torch_report["split"] == "test" and m["mars"]
    clean, count = direct_clean_nll(paths["mars"], paths["data"] / "test.jsonl")
    assert m["nll"]["tokens"] == count
    assert m["nll"]["clean_nll"] == pytest.approx(clean, abs=1e-5)
    assert m["nll"]["noisy_nll"] is not None and np.isfinite(m["nll"]["noisy_nll"])
    base = torch_report["baseline"]
    base_clean, _ = direct_clean_nll(paths["base"], paths["data"] / "test.jsonl")
    assert base["nll"]["clean_nll"] == pytest.approx(base_clean, abs=1e-5)
    assert base["nll"]["noisy_nll"] is None and "mars.json" in base["nll"]["note"]
    assert m["nll"]["clean_nll_vs_baseline"] == pytest.approx(clean - base_clean, abs=1e-5)


def test_torch_sweep(torch_report):
    sweep = torch_report["models"][0]["sweep"]
    assert sweep["prompts"] == 4  # the text record has no prompt
    assert [r["threshold"] for r in sweep["thresholds"]] == [1.0, 0.9, 0.5]
    check_sweep(sweep)


@pytest.mark.parametrize("change", [dict(batch_size=1), dict(cache="block", block_cache=8), dict(cache="none")])
def test_batching_and_cache_do_not_change_the_sweep(paths, torch_report, change):
    session = ev.load_model(paths["mars"], "torch", **QUIET)
    other = ev.evaluate([session], data=paths["data"], settings=ev.EvalSettings(**dict(FAST, **change), nll=False))
    assert "nll" not in other["models"][0]
    for a, b in zip(other["models"][0]["sweep"]["thresholds"], torch_report["models"][0]["sweep"]["thresholds"]):
        assert a["outputs"] == b["outputs"]
        if "batch_size" in change:
            assert a["slot_acceptance"] == b["slot_acceptance"]


def test_mlx_matches_torch_and_a_plain_forward(paths, torch_report):
    pytest.importorskip("mlx.core")
    session = ev.load_model(paths["mars"], "mlx", **QUIET)
    report = ev.evaluate([session], data=paths["data"], settings=ev.EvalSettings(**FAST))
    m, t = report["models"][0], torch_report["models"][0]
    clean, count = direct_clean_nll(paths["mars"], paths["data"] / "test.jsonl")
    assert m["backend"] == "mlx" and m["nll"]["tokens"] == count
    assert m["nll"]["clean_nll"] == pytest.approx(clean, abs=1e-4)
    assert m["nll"]["noisy_nll"] == pytest.approx(t["nll"]["noisy_nll"], abs=1e-4)
    check_sweep(m["sweep"])
    assert [r["outputs"] for r in m["sweep"]["thresholds"]] == [r["outputs"] for r in t["sweep"]["thresholds"]]


def test_plain_model_sweeps_ar_only_unless_forced(paths):
    session = ev.load_model(paths["base"], "torch", **QUIET)
    prompts = ["Hello", "What is 2+2?"]
    report = ev.evaluate([session], prompts=prompts, settings=ev.EvalSettings(**FAST))
    sweep = report["models"][0]["sweep"]
    assert [r["threshold"] for r in sweep["thresholds"]] == [1.0]
    assert sweep["skipped_thresholds"] == [0.9, 0.5] and "nll" not in report["models"][0]
    forced = ev.evaluate([session], prompts=prompts, settings=ev.EvalSettings(**FAST, force=True))
    check_sweep(forced["models"][0]["sweep"])


def test_split_choice(tmp_path):
    write_jsonl(tmp_path / "valid.jsonl", RECORDS[:1])
    assert ev.eval_file(tmp_path) == (tmp_path / "valid.jsonl", "valid")
    write_jsonl(tmp_path / "test.jsonl", RECORDS[:1])
    assert ev.eval_file(tmp_path) == (tmp_path / "test.jsonl", "test")
    assert ev.eval_file(tmp_path, "valid")[1] == "valid"
    assert ev.eval_file(tmp_path / "test.jsonl") == (tmp_path / "test.jsonl", "test")
    with pytest.raises(DataError, match="no train.jsonl"):
        ev.eval_file(tmp_path, "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="test.jsonl or valid.jsonl"):
        ev.eval_file(tmp_path / "empty")


def invoke(*args):
    return CliRunner().invoke(evaluate_command, [str(a) for a in args])


def test_cli_writes_json_table_and_plot(paths, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    r = invoke(
        "--backend",
        "torch",
        "--model",
        paths["mars"],
        "--model",
        paths["base"],
        "--baseline",
        paths["base"],
        "--data",
        paths["data"],
        "--threshold",
        "1.0,0.9",
        "--threshold",
        "0.5",
        "--max-tokens",
        8,
        "--output",
        out,
        "--plot",
        png,
        "--force",
    )
    assert r.exit_code == 0, r.output
    assert "tok/fwd" in r.output and "clean NLL" in r.output and "vs baseline" in r.output
    report = json.loads(out.read_text())
    assert [m["label"] for m in report["models"]] == [str(paths["mars"]), str(paths["base"])]
    assert report["baseline"]["label"] == str(paths["base"])
    for m in report["models"]:
        assert [row["threshold"] for row in m["sweep"]["thresholds"]] == [1.0, 0.9, 0.5]
        assert "outputs" not in m["sweep"]["thresholds"][0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_text_only_data_gives_nll_without_decoding(paths, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [RECORDS[3]])
    r = invoke(
        "--backend", "torch", "--model", paths["mars"], "--data", data, "--no-decode", "--output", tmp_path / "t.json"
    )
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "t.json").read_text())["models"][0]
    assert "sweep" not in m and m["nll"]["tokens"] > 0


def test_cli_prompt_file(paths, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nWhat is 2+2?\nA third one\n")
    out = tmp_path / "p.json"
    r = invoke(
        "--backend",
        "torch",
        "--model",
        paths["mars"],
        "--prompts",
        prompts,
        "--limit",
        2,
        "--max-tokens",
        6,
        "--threshold",
        "0.8",
        "--output",
        out,
        "--outputs",
    )
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    sweep = report["models"][0]["sweep"]
    assert sweep["prompts"] == 2 and "nll" not in report["models"][0] and report["data"] is None
    assert [row["threshold"] for row in sweep["thresholds"]] == [1.0, 0.8]
    assert len(sweep["thresholds"][1]["outputs"]) == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--data", "{root}/nowhere"], "no such file or directory"),
        (["--data", "{root}/empty"], "test.jsonl or valid.jsonl"),
        (["--data", "{data}", "--split", "valid"], "no valid.jsonl"),
        (["--prompts", "{root}/missing.txt"], "no such file"),
        ([], "--data"),
        (["--data", "{root}/textonly.jsonl"], "--no-decode"),
        (["--data", "{root}/bad.jsonl"], "bad.jsonl:2: malformed JSON"),
        (["--data", "{data}", "--threshold", "fast"], "not a number"),
    ],
)
def test_cli_one_line_errors(paths, args, needle):
    (paths["root"] / "empty").mkdir(exist_ok=True)
    write_jsonl(paths["root"] / "textonly.jsonl", [RECORDS[3]])
    (paths["root"] / "bad.jsonl").write_text(json.dumps(RECORDS[1]) + "\n{oops\n")
    args = [a.format(root=paths["root"], data=paths["data"]) for a in args]
    r = invoke("--backend", "torch", "--model", paths["mars"], *args)
    assert r.exit_code != 0
    assert needle in r.output
    assert (
        "Traceback" not in r.output and len([line for line in r.output.splitlines() if line.startswith("Error")]) == 1
    )


def test_verified_rows_follow_their_thresholds(paths, tmp_path):
    session = ev.load_model(paths["mars"], "torch", **QUIET)
    settings = ev.EvalSettings(**dict(FAST, thresholds=(1.0, 0.5, 0.0), verify=True), nll=False)
    rows = ev.evaluate([session], data=paths["data"], settings=settings)["models"][0]["sweep"]["thresholds"]
    assert [(r["mode"], r["threshold"]) for r in rows] == [
        ("threshold", 1.0),
        ("threshold", 0.5),
        ("threshold", 0.0),
        ("verified", 0.5),
        ("verified", 0.0),
    ]
    # Each verified row is what generate gives in verified threshold mode at its threshold (fixed feed, masks only).
    from mars.backends import base
    from mars.core.decode.loop import generate
    from mars.core.tokens import encode_prompt

    prompts = [
        encode_prompt(session.loaded.tokenizer, p) for p in ev.dataset_prompts(ev.eval_file(paths["data"], None)[0])
    ]
    for row in rows[3:]:
        s = base.plan_for_model(session.loaded, threshold=row["threshold"], max_tokens=FAST["max_tokens"], verify=True)
        assert row["outputs"] == [generate(session.decoder, [p], s).tokens[0] for p in prompts]
        assert sum(row["drafts"]["kept_per_slot"]) <= sum(row["drafts"]["verified_per_slot"])
    r = invoke(
        "--backend",
        "torch",
        "--model",
        paths["mars"],
        "--data",
        paths["data"],
        "--threshold",
        "0.5",
        "--max-tokens",
        8,
        "--no-nll",
        "--verify",
    )
    assert r.exit_code == 0, r.output
    assert "v0.5" in r.output


def test_lossless_row_equals_ar_and_counts_drafts(paths, tmp_path):
    session = ev.load_model(paths["mars"], "torch", **QUIET)
    report = ev.evaluate(
        [session], data=paths["data"], settings=ev.EvalSettings(**dict(FAST, lossless=True), nll=False)
    )
    rows = report["models"][0]["sweep"]["thresholds"]
    lossless = rows[-1]
    assert lossless["mode"] == "lossless" and lossless["threshold"] is None
    assert lossless["outputs"] == rows[0]["outputs"] and lossless["exact_match"] == 1.0
    assert lossless["prefix_token_share"] == 1.0
    drafts = lossless["drafts"]
    assert all(
        d >= v >= k for d, v, k in zip(drafts["drafted_per_slot"], drafts["verified_per_slot"], drafts["kept_per_slot"])
    )
    table = ev.format_table(report)
    assert "lossless" in table
    r = invoke(
        "--backend",
        "torch",
        "--model",
        paths["mars"],
        "--data",
        paths["data"],
        "--threshold",
        "1.0",
        "--max-tokens",
        8,
        "--no-nll",
        "--lossless",
        "--plot",
        tmp_path / "p.png",
    )
    assert r.exit_code == 0, r.output
    assert "lossless" in r.output
    # one lossless row per --hedge value, each exact
    r = invoke(
        "--backend",
        "torch",
        "--model",
        paths["mars"],
        "--data",
        paths["data"],
        "--threshold",
        "1.0",
        "--max-tokens",
        8,
        "--no-nll",
        "--lossless",
        "--hedge",
        "0,2",
        "--output",
        tmp_path / "h.json",
    )
    assert r.exit_code == 0, r.output
    assert "lossless/h0" in r.output and "lossless/h2" in r.output
    rows = json.loads((tmp_path / "h.json").read_text())["models"][0]["sweep"]["thresholds"]
    assert [(x["mode"], x.get("hedge")) for x in rows] == [("threshold", None), ("lossless", 0), ("lossless", 2)]
    assert all(x["exact_match"] == 1.0 for x in rows)
    bad = invoke(
        "--backend", "torch", "--model", paths["mars"], "--data", paths["data"], "--lossless", "--hedge", "two"
    )
    assert bad.exit_code != 0 and "'two' is not a whole number" in bad.output


def test_ngram_rows_draft_from_lookup_and_the_checkpoints_corpus(paths, tmp_path):
    """`--ngram N`: lossless and verified rows also draft from n-gram lookup and the checkpoint's
    draft corpus, as generate does; lossless stays AR's text, and a corpus of AR's own replies
    makes far fewer forwards than the random masks alone."""
    import shutil

    from mars.backends import base
    from mars.core.decode.drafts import corpus
    from mars.core.decode.loop import generate
    from mars.core.tokens import encode_prompt

    model = tmp_path / "mars"
    shutil.copytree(paths["mars"], model)
    session = ev.load_model(model, "torch", **QUIET)
    prompts = [
        encode_prompt(session.loaded.tokenizer, p) for p in ev.dataset_prompts(ev.eval_file(paths["data"], None)[0])
    ]
    ar = base.plan_for_model(session.loaded, threshold=1.0, max_tokens=FAST["max_tokens"])
    replies = [generate(session.decoder, [p], ar).tokens[0] for p in prompts]
    corpus.DraftCorpus([p + r for p, r in zip(prompts, replies)]).save(model / corpus.FILE)

    session = ev.load_model(model, "torch", **QUIET)
    settings = ev.EvalSettings(**dict(FAST, thresholds=(1.0, 0.5), lossless=True, verify=True, ngram=8), nll=False)
    report = ev.evaluate([session], data=paths["data"], settings=settings)
    rows = report["models"][0]["sweep"]["thresholds"]
    assert [(r["mode"], r.get("ngram"), r.get("corpus")) for r in rows] == [
        ("threshold", None, None),
        ("threshold", None, None),
        ("verified", 8, True),
        ("lossless", 8, True),
    ]
    lossless = rows[-1]
    assert lossless["outputs"] == rows[0]["outputs"] == replies and lossless["exact_match"] == 1.0
    masks_only = ev.evaluate(
        [session],
        data=paths["data"],
        settings=ev.EvalSettings(**dict(FAST, thresholds=(1.0,), lossless=True), nll=False),
    )
    assert lossless["forwards"] < 0.6 * masks_only["models"][0]["sweep"]["thresholds"][-1]["forwards"]
    # The verified row is generate's verified threshold mode with the same drafts (fixed feed).
    s = base.plan_for_model(session.loaded, threshold=0.5, max_tokens=FAST["max_tokens"], verify=True, ngram=8)
    assert s.drafts.corpus is not None
    assert rows[2]["outputs"] == [generate(session.decoder, [p], s).tokens[0] for p in prompts]
    table = ev.format_table(report)
    assert "lossless/h4/n8c" in table and "v0.5/n8c" in table
    r = invoke(
        "--backend",
        "torch",
        "--model",
        model,
        "--data",
        paths["data"],
        "--threshold",
        "1.0",
        "--max-tokens",
        8,
        "--no-nll",
        "--lossless",
        "--ngram",
        4,
    )
    assert r.exit_code == 0, r.output
    assert "lossless/h4/n4c" in r.output
