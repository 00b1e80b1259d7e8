"""One plan everywhere (mars.core.decode.plan): a request's mode is resolved by one function and
named once, and every entry point (generate, chat, the server, bench) decodes a checkpoint's
default mode the same way, with the same text and the same mode name."""

from __future__ import annotations

import json

import pytest
from clitools import invoke, ok
from tiny import make_tokenizer, save_model

from mars.core.config import MarsConfig, write_config
from mars.core.decode.plan import Mode, Plan, Sampling, make_plan, why_not_verified

pytest.importorskip("starlette")
pytest.importorskip("openai")

PROMPTS = ["Hello there", "abc abc abc", "Why is the sky blue?"]
MAX_TOKENS = 16
THRESHOLD = 0.3  # the threshold-default checkpoint's default_threshold


def mask_config(**fields) -> MarsConfig:
    mask = "<unused0>"
    return MarsConfig(
        block_size=4, mask_token=mask, mask_token_id=make_tokenizer().convert_tokens_to_ids(mask), **fields
    )


# -- the plan itself -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mars", "asked", "mode", "name"),
    [
        (None, {}, Mode.AR, "AR greedy"),
        (mask_config(default_threshold=0.8), {}, Mode.VERIFIED, "verified threshold 0.8 (probability)"),
        (mask_config(default_threshold=0.8), {"verify": False}, Mode.THRESHOLD, "threshold 0.8 (probability)"),
        (mask_config(default_threshold=0.8), {"threshold": 1.0}, Mode.AR, "AR greedy"),
        (mask_config(default_threshold=0.8, default_mode="lossless"), {}, Mode.LOSSLESS, "lossless greedy"),
        (
            mask_config(default_threshold=0.8, default_mode="lossless"),
            {"threshold": 0.5},
            Mode.VERIFIED,
            "verified threshold 0.5 (probability)",
        ),
        (None, {"lossless": True}, Mode.LOSSLESS, "lossless greedy"),
    ],
)
def test_one_function_resolves_the_mode_and_names_it(mars, asked, mode, name):
    plan = make_plan(mars, mask_id=3, eos_ids=(2,), **asked)
    assert plan.mode is mode and plan.name == name


def test_sampling_and_verify_where_it_cannot_apply():
    sampled = make_plan(mask_config(default_threshold=0.8), mask_id=3, eos_ids=(2,), sampling=Sampling(temperature=0.7))
    assert sampled.mode is Mode.THRESHOLD and "greedy" in why_not_verified(
        sampled
    )  # a sampled draft's check needs its distribution
    lossless = make_plan(None, mask_id=3, eos_ids=(2,), lossless=True, sampling=Sampling(temperature=0.7))
    assert lossless.name == "lossless sampling (temp 0.7)"
    ar = make_plan(None, mask_id=3, eos_ids=(2,), sampling=Sampling(temperature=0.7))
    assert ar.name == "AR sampling (temp 0.7)"
    assert make_plan(None, mask_id=3, eos_ids=(2,), threshold=0.5, verify=True, lossless=True).mode is Mode.LOSSLESS


def test_a_plan_is_a_frozen_value_whose_mode_agrees_with_its_threshold():
    """The mode is a field, set once: a plan never changes (a change of mode is a new plan,
    made by make_plan), and one built by hand must say a mode its threshold allows."""
    import dataclasses

    from mars.core.decode.plan import DraftSources, replan

    plan = make_plan(None, mask_id=3, eos_ids=(2,), threshold=0.5, force=True, ngram=4, hedge=1)
    assert plan.mode is Mode.VERIFIED and plan.drafts == DraftSources(hedge=1, ngram=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mode = Mode.LOSSLESS
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.threshold = 0.9
    assert Plan(mask_id=3, eos_ids=(2,), mode=Mode.THRESHOLD, threshold=0.5).masks_per_step == 4
    with pytest.raises(ValueError, match="AR mode decodes at threshold 1"):
        Plan(mask_id=3, eos_ids=(2,), threshold=0.5)  # the default mode is AR's
    with pytest.raises(ValueError, match="below AR mode"):
        Plan(mask_id=3, eos_ids=(2,), mode=Mode.VERIFIED, threshold=1.0)
    with pytest.raises(ValueError, match="greedy"):
        Plan(mask_id=3, eos_ids=(2,), mode=Mode.VERIFIED, threshold=0.5, sampling=Sampling(temperature=0.5))
    with pytest.raises(ValueError, match="hedge must be >= 0"):
        DraftSources(hedge=-1)
    # A change of mode is a new plan from the same request (chat's /lossless, /threshold).
    lossless = replan(plan, None, lossless=True, threshold=None, force=True)
    assert lossless.mode is Mode.LOSSLESS and lossless.drafts is plan.drafts and plan.mode is Mode.VERIFIED
    ar = replan(lossless, None, threshold=1.0, lossless=False)
    assert ar.mode is Mode.AR and ar.masks_per_step == 0 and ar.name == "AR greedy"
    assert replan(ar, None, threshold=0.5, lossless=False, force=True).mode is Mode.VERIFIED
    assert replan(ar, None, threshold=0.5, lossless=False, verify=False, force=True).mode is Mode.THRESHOLD
    # Draft sources apply where the plan verifies drafts, greedy.
    assert plan.lookup_drafts == 4 and plan.spare_groups == 1
    plain = replan(plan, None, verify=False, force=True)
    assert plain.mode is Mode.THRESHOLD and plain.lookup_drafts == 0 and plain.spare_groups == 0


def test_a_servers_default_mode_is_decided_by_the_plan_function():
    """A server's default mode and threshold are defaults of make_plan: a request that names
    neither a threshold nor lossless takes them; one that names either does not."""
    ask = dict(mask_id=3, eos_ids=(2,), force=True)
    assert make_plan(None, default_mode=Mode.LOSSLESS, default_threshold=0.6, **ask).mode is Mode.LOSSLESS
    at = make_plan(None, default_mode=Mode.THRESHOLD, default_threshold=0.6, **ask)
    assert at.mode is Mode.VERIFIED and at.threshold == 0.6
    assert make_plan(None, default_mode=Mode.THRESHOLD, default_threshold=1.0, **ask).mode is Mode.AR
    assert (
        make_plan(None, default_mode=Mode.LOSSLESS, default_threshold=0.6, lossless=False, **ask).mode is Mode.VERIFIED
    )
    assert make_plan(None, threshold=0.7, default_mode=Mode.LOSSLESS, **ask).threshold == 0.7
    # Verified threshold mode runs on the window cache where the block cache was asked for.
    assert make_plan(None, threshold=0.7, cache="block", **ask).cache == "window"
    assert make_plan(None, threshold=0.7, cache="block", verify=False, **ask).cache == "block"


# -- every entry point decodes the default mode alike ----------------------------------------------


@pytest.fixture(scope="module", params=["threshold", "lossless"])
def checkpoint(request, tmp_path_factory):
    """A tiny model whose mars.json makes the given mode its default."""
    path = save_model(tmp_path_factory.mktemp(f"{request.param}-default") / "model", "llama", seed=0)
    write_config(mask_config(default_threshold=THRESHOLD, default_mode=request.param), path)
    return path


def generated(path) -> list[dict]:
    """`mars generate --json`, each prompt alone (a feed chosen from the cost curve may depend
    on the batch)."""
    args = ["generate", "--model", path, "--max-tokens", MAX_TOKENS, "--json", "--device", "cpu", "--batch-size", 1]
    for p in PROMPTS:
        args += ["--prompt", p]
    return [json.loads(line) for line in ok(invoke(*args)).stdout.splitlines()]


def chatted(path, prompt: str) -> tuple[str, str]:
    """One turn of `mars chat`: (the reply as streamed, the mode its per-reply line names)."""
    result = ok(
        invoke("chat", "--model", path, "--max-tokens", MAX_TOKENS, "--device", "cpu", input=f"{prompt}\n/quit\n")
    )
    reply = result.stdout.split(">> ")[1].removesuffix("\n")
    line = next(x for x in result.stderr.splitlines() if x.startswith("[") and "tokens/forward" in x)
    return reply, line[1:].split(": ")[0]


def served(path, **fields) -> list[tuple[str, str]]:
    """`mars serve` with no mode fields in the request but `fields` (temperature 0): (text, usage.mode)."""
    from test_serve import live

    from mars.backends import base
    from mars.backends.torch.decode import TorchDecoder
    from mars.serve import EngineLimits

    loaded = base.load("torch", str(path), device="cpu", announce=lambda m: None)
    out = []
    with live(loaded, TorchDecoder, engine_limits=EngineLimits(max_batch=1)) as srv:
        client = srv.client()
        for p in PROMPTS:
            r = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body=fields,
            )
            out.append((r.choices[0].message.content, r.usage.model_extra["mode"]))
    return out


def benched(path, mode: str) -> list[str]:
    """`mars bench`'s configuration whose plan is named `mode` (its rows' "mode"), each prompt alone."""
    from mars import bench
    from mars.backends import base
    from mars.session import Session

    session = Session(str(path), backend="torch", device="cpu", announce=lambda m: None)
    settings = bench.BenchSettings(
        thresholds=(THRESHOLD,),
        block_caches=(),
        max_tokens=MAX_TOKENS,
        verify=True,
        lossless=True,
        prompt_lookup=0,
        llama_cpp=False,
    )
    cost = base.costs(session.loaded, session.decoder)
    configs = bench.build_configs(session, settings, cost)
    config = next(c for c in configs if c.kind != "reference" and c.run.mode == mode)
    return [
        session.tokenizer.decode(config.run([ids])[0][0], skip_special_tokens=True) for ids in session.encode(PROMPTS)
    ]


@pytest.fixture
def flat_costs(monkeypatch, tmp_path):
    """Cost curves kept in a fresh cache directory, measured as a device whose forward costs
    the same at any width would measure them (a GPU's regime): the cost-aware feed then feeds
    the masks, so the default mode's text depends on the curves every entry point reads."""
    from mars.core.decode import cost

    monkeypatch.setenv("MARS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(
        cost,
        "calibrate",
        lambda backend, prompt, *, widths=cost.CALIBRATION_WIDTHS, batch=1, **kw: cost.CostCurve(
            {batch * k: 0.01 for k in widths}
        ),
    )


def test_every_entry_point_decodes_the_default_mode_alike(checkpoint, flat_costs):
    """The acceptance check: a checkpoint whose mars.json says default_mode "threshold" (and
    one that says "lossless"): the server, given no mode fields, answers with the text and
    the usage.mode `mars generate --json` prints; chat (one turn) and bench's configuration
    of that mode say the same."""
    default_mode = json.loads((checkpoint / "mars.json").read_text())["default_mode"]
    rows = generated(checkpoint)
    want_mode = {"threshold": f"verified threshold {THRESHOLD:g} (probability)", "lossless": "lossless greedy"}[
        default_mode
    ]
    assert [r["mode"] for r in rows] == [want_mode] * len(PROMPTS)
    texts = [r["text"] for r in rows]
    assert all(texts)
    assert served(checkpoint) == [(t, want_mode) for t in texts]
    assert [chatted(checkpoint, p) for p in PROMPTS] == [(t, want_mode) for t in texts]
    assert benched(checkpoint, want_mode) == texts
    ar = [
        r["text"]
        for r in json.loads(
            "["
            + ",".join(
                ok(
                    invoke(
                        "generate",
                        "--model",
                        checkpoint,
                        "--max-tokens",
                        MAX_TOKENS,
                        "--json",
                        "--device",
                        "cpu",
                        "--threshold",
                        1.0,
                        *[a for p in PROMPTS for a in ("--prompt", p)],
                    )
                ).stdout.splitlines()
            )
            + "]"
        )
    ]
    if default_mode == "lossless":
        assert texts == ar  # lossless: AR's text
    else:
        assert texts != ar  # the masks' confident guesses were taken: the mode really ran below AR


def test_a_request_asks_for_plain_threshold_mode_as_the_cli_does(tmp_path):
    """`"verify": false` in a request is `--no-verify`: plain threshold mode, under the same
    name, with the text of its fixed feed (B masks a step; a served batch feeds no fewer)."""
    path = save_model(tmp_path / "model", "llama", seed=0)
    write_config(mask_config(default_threshold=THRESHOLD, default_mode="threshold"), path)
    args = [
        "generate",
        "--model",
        path,
        "--max-tokens",
        MAX_TOKENS,
        "--json",
        "--device",
        "cpu",
        "--no-verify",
        "--feed",
        "fixed",
    ]
    rows = [
        json.loads(line)
        for line in ok(invoke(*args, *[a for p in PROMPTS for a in ("--prompt", p)])).stdout.splitlines()
    ]
    want = [(r["text"], r["mode"]) for r in rows]
    assert {m for _, m in want} == {f"threshold {THRESHOLD:g} (probability)"}
    assert served(path, verify=False) == want


def test_the_checkpoint_and_server_default_modes_are_the_plans_names():
    """mars.json's default_mode and `mars serve --default-mode` name plan modes, by their values."""
    from mars.core.config import MODES
    from mars.serve.policy import DEFAULT_MODES

    assert MODES == DEFAULT_MODES == (Mode.THRESHOLD.value, Mode.LOSSLESS.value)


def test_the_python_session_plans_the_drafts_the_cli_does(tmp_path):
    """`Session.plan()` with nothing asked takes the draft sources `mars generate` takes by default."""
    from mars.core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM
    from mars.session import Session

    session = Session(save_model(tmp_path / "m", "llama", seed=1), backend="torch", announce=lambda m: None)
    plan = session.plan(lossless=True)
    assert (plan.drafts.ngram, plan.drafts.alternatives) == (DEFAULT_NGRAM, DEFAULT_ALTERNATIVES)
    assert session.plan(lossless=True, ngram=0).drafts.ngram == 0
