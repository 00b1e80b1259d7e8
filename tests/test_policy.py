"""The decoding policy (mars.core.decode.rules), the prompt reader (mars.prompts), the backend
contract (mars.backends.base) and the library entry points (mars.session, mars.finetune)."""

from __future__ import annotations

import json

import pytest
from tiny import save_model

from mars.core.acceptance import ar_threshold, looser, strict_and_loose
from mars.core.config import MarsConfig
from mars.core.decode.plan import Mode, make_plan
from mars.core.decode.rules import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_METRIC,
    UntrainedModelError,
    block_size_for,
    check_may_decode,
    checkpoint_mode,
    may_decode,
    metric_for,
)
from mars.core.train.data import DataError
from mars.prompts import prompt_of, read_prompts, split_files

CKPT = MarsConfig(block_size=3, mask_token="<unused0>", mask_token_id=3, metric="margin", default_threshold=0.8)
LOSSLESS = MarsConfig(
    block_size=4, mask_token="<unused0>", mask_token_id=3, default_threshold=0.9, default_mode="lossless"
)


def settings(mars, **asked):
    return make_plan(mars, mask_id=3, eos_ids=(2,), **asked)


# -- the policy ------------------------------------------------------------------------------------


def test_checkpoint_defaults():
    assert (DEFAULT_BLOCK_SIZE, DEFAULT_METRIC) == (MarsConfig().block_size, MarsConfig().metric) == (4, "probability")
    assert block_size_for(None) == 4 and block_size_for(CKPT) == 3 and block_size_for(CKPT, 7) == 7
    assert (
        metric_for(None) == "probability" and metric_for(CKPT) == "margin" and metric_for(CKPT, "entropy") == "entropy"
    )


def test_the_checkpoints_default_mode_applies_only_without_a_threshold():
    assert checkpoint_mode(None, "probability") == (1.0, False)
    assert checkpoint_mode(None, "entropy") == (0.0, False)
    assert checkpoint_mode(CKPT, "margin") == (0.8, False)
    assert checkpoint_mode(LOSSLESS, "probability") == (0.9, True)
    assert checkpoint_mode(LOSSLESS, "probability", 0.5) == (0.5, False)
    s = settings(LOSSLESS)
    assert s.mode is Mode.LOSSLESS and s.threshold == 0.9 and s.block_size == 4
    s = settings(LOSSLESS, threshold=0.5, max_tokens=7)
    assert s.mode is not Mode.LOSSLESS and s.threshold == 0.5 and s.max_tokens == 7
    s = settings(CKPT)
    assert (s.metric, s.threshold, s.block_size, s.mode is Mode.LOSSLESS) == ("margin", 0.8, 3, False)


def test_a_model_without_mars_json_decodes_only_as_ar_or_losslessly():
    for metric in ("probability", "margin", "entropy"):
        ar = ar_threshold(metric)
        assert (
            may_decode(False, metric, ar)
            and may_decode(False, metric, 0.5, lossless=True)
            and may_decode(True, metric, 0.5)
        )
        assert not may_decode(False, metric, 0.5 if metric != "entropy" else 1.5)
    with pytest.raises(UntrainedModelError) as e:
        settings(None, threshold=0.5)
    message = str(e.value)
    assert "mars.json" in message and "\n" not in message and "--" not in message  # one line, naming no option
    with pytest.raises(UntrainedModelError) as again:
        check_may_decode(False, "probability", 0.7)
    assert str(again.value) == message  # one message whoever asks
    heard = []
    s = settings(None, threshold=0.5, force=True, warn=heard.append)
    assert s.threshold == 0.5 and len(heard) == 1
    assert settings(None, threshold=0.5, lossless=True).mode is Mode.LOSSLESS
    assert settings(None).threshold == 1.0


def test_the_looser_direction_follows_the_metric():
    assert looser("probability", 0.9, 0.7) == 0.7 and looser("margin", 0.2, 0.5) == 0.2
    assert looser("entropy", 0.5, 1.5) == 1.5
    assert strict_and_loose("probability", 0.7, 1.0) == (1.0, 0.7)
    assert strict_and_loose("entropy", 0.0, 1.0) == (0.0, 1.0)


# -- prompts ---------------------------------------------------------------------------------------


def test_one_prompt_reader(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("\ufeffhello\n\n  \nworld\n")
    assert read_prompts(text) == ["hello", "world"]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps(r) for r in ({"prompt": "a"}, {"messages": chat}, {"messages": chat[:1]})) + "\n"
    )
    assert read_prompts(jsonl) == ["a", chat[:1], chat[:1]]
    assert prompt_of({"text": "x"}) is None and prompt_of(["x"]) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2: malformed JSON"):
        read_prompts(bad)
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: expected"):
        read_prompts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        read_prompts(empty)


def test_split_files(tmp_path):
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("{}\n")
    assert split_files(tmp_path, ("valid", "test", "train"), takes="x") == [
        ("test", tmp_path / "test.jsonl"),
        ("train", tmp_path / "train.jsonl"),
    ]
    assert split_files(tmp_path / "test.jsonl", ("train",), takes="x") == [(None, tmp_path / "test.jsonl")]
    with pytest.raises(DataError, match="no such file or directory"):
        split_files(tmp_path / "nowhere", ("train",), takes="x")
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(DataError, match="not a .jsonl file"):
        split_files(tmp_path / "a.txt", ("train",), takes="x")


# -- the backend contract and the library entry points -------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("plain") / "base", "llama", seed=0)


@pytest.mark.parametrize("name", ["torch", "mlx"])
def test_the_backend_contract(plain, name):
    import numpy as np

    from mars.backends import base
    from mars.core.train.data import Example, batches, encode_record, pad_to_block

    if name == "mlx":
        pytest.importorskip("mlx_lm")
    quiet = lambda m: None  # noqa: E731
    loaded = base.load(name, plain, device="cpu", announce=quiet)
    assert loaded.backend == name and base.context_length(loaded) == 512 and loaded.mars is None
    decoder = base.decoder(loaded)
    assert isinstance(decoder, base.decoder_class(name))
    assert base.loader(name)[1] is type(decoder)
    assert base.trainer(name).__name__ == {"torch": "TorchTrainer", "mlx": "MlxTrainer"}[name]
    mars = base.ensure_mask_token(loaded, None, block_size=2, announce=quiet)
    assert mars.mask_token_id == 3 and mars.block_size == 2 and not mars.mask_token_added
    ids, labels = encode_record(
        {"prompt": "ab", "completion": "cd"}, loaded.tokenizer, eos_id=loaded.tokenizer.eos_token_id
    )
    ids, labels = pad_to_block(ids, labels, 2, loaded.tokenizer.eos_token_id, ended=True)
    ((batch_ids, batch_labels, lengths),) = batches([Example(ids, labels, "x", False)], 1, pad_id=2, shuffle=False)
    noisy, clean = base.losses(loaded)(batch_ids, batch_labels, lengths, 2, mars.mask_token_id)
    assert np.isfinite(noisy) and np.isfinite(clean)
    s = base.plan_for_model(loaded, max_tokens=3)
    assert s.threshold == 1.0 and s.mask_id == base.mask_id_for(loaded) and s.eos_ids == loaded.eos_ids
    # The step protocol (mars.core.decode.types.StepBackend): a forward on a cache equals the
    # same forward without one, a crop undoes what a step added, a row kept is that row.
    from mars.core.decode.plan import Sampling
    from mars.core.tokens import encode_prompt

    greedy = Sampling()
    prompt = np.array([encode_prompt(loaded.tokenizer, "Hello there")])
    n = prompt.shape[1]
    positions = np.arange(n)[None]
    whole, conf = decoder.step(None, prompt, positions, None, positions, metric="probability", sampling=greedy)
    assert whole.shape == conf.shape == (1, n) and ((conf > 0) & (conf <= 1)).all()
    cache = decoder.new_cache(1)
    first = decoder.step(
        cache, prompt[:, :-1], positions[:, :-1], None, np.array([[n - 2]]), metric=None, sampling=greedy
    ).ids
    last = decoder.step(
        cache, prompt[:, -1:], positions[:, -1:], None, np.array([[0]]), metric=None, sampling=greedy
    ).ids
    assert first[0, 0] == whole[0, n - 2] and last[0, 0] == whole[0, n - 1]
    decoder.crop(cache, n - 1)
    assert (
        decoder.step(cache, prompt[:, -1:], positions[:, -1:], None, np.array([[0]]), metric=None, sampling=greedy).ids[
            0, 0
        ]
        == whole[0, n - 1]
    )
    other = np.roll(prompt, 3, axis=1)  # another row beside it
    both = decoder.new_cache(2)
    decoder.step(
        both,
        np.concatenate([other, prompt])[:, :-1],
        np.tile(positions[:, :-1], (2, 1)),
        None,
        np.full((2, 1), n - 2),
        metric=None,
        sampling=greedy,
    )
    decoder.keep_rows(both, [1])  # the second row alone, as if decoded alone
    kept = decoder.step(
        both, prompt[:, -1:], positions[:, -1:], None, np.array([[0]]), metric=None, sampling=greedy
    ).ids
    assert kept[0, 0] == whole[0, n - 1]


def test_session_decodes_in_batches(plain):
    from mars.session import Session

    session = Session(plain, backend="torch", device="cpu", announce=lambda m: None)
    s = session.plan(max_tokens=4)
    ids = session.encode(["hi", "there", "you"])
    decoded = session.decode(ids, s, batch_size=2)
    assert len(decoded.tokens) == len(decoded.finish) == 3 and len(decoded.stats) == 2
    assert decoded.total.accepted == sum(len(t) for t in decoded.tokens)
    assert decoded.tokens == [session.generate([i], s).tokens[0] for i in ids]
    with pytest.raises(UntrainedModelError):
        session.plan(threshold=0.5)
    assert not session.controller.uses(s)  # AR mode feeds what AR feeds


def test_session_threshold_mode_decides_on_the_stored_curves(plain, tmp_path, monkeypatch):
    """Threshold mode's feed comes from the stored cost curves, which lossless decoding's
    refreshed copy never reaches: one session gives the same text call after call."""
    from dataclasses import replace

    from mars.session import Session

    monkeypatch.setenv("MARS_HOME", str(tmp_path))  # the curves are measured and kept here
    session = Session(plain, backend="torch", device="cpu", announce=lambda m: None)
    t = session.plan(threshold=0.5, verify=False, force=True, max_tokens=6)
    assert session.controller.uses(t) and not session.controller.uses(replace(t, feed="fixed"))
    session.prepare_feed(t, batch=2)
    stored = session.controller.stored
    lossless = session.controller.feed_for(session.plan(lossless=True, max_tokens=6))
    assert lossless.costs is not stored
    ids = session.encode(["hi", "there"])
    stored_points = {b: dict(c.points) for b, c in stored.curves.items()}
    first = session.generate(ids, t)
    assert sum(first.stats.masks_fed.values()) == first.stats.forwards
    lossless.costs.observe(2, 5, 100.0)  # what lossless decoding times stays with it
    lossless.costs.observe(1, 5, 100.0)
    assert session.generate(ids, t).tokens == first.tokens
    assert {b: dict(c.points) for b, c in stored.curves.items()} == stored_points
    # In batches: the feed chose every step of every batch, and the total says so.
    decoded = session.decode(ids, t, batch_size=1)
    assert len(decoded.stats) == 2 and sum(decoded.total.feed_choices.values()) == decoded.total.forwards > 0


def test_finetune_library_entry_point(plain, data, tmp_path):
    from mars.finetune import FinetuneError, finetune

    quiet = lambda m: None  # noqa: E731
    with pytest.raises(FinetuneError) as e:
        finetune(data, tmp_path / "x", model=plain, fuse=True, fine_tune_type="full", announce=quiet)
    assert e.value.setting == "fuse"
    result = finetune(
        data, tmp_path / "out", model=plain, backend="torch", device="cpu", iters=2, batch_size=4, announce=quiet
    )
    assert result["steps"] == 2 and (tmp_path / "out" / "mars.json").is_file()
    assert json.loads((tmp_path / "out" / "mars.json").read_text())["default_threshold"] == 0.9


def test_an_added_mask_token_starts_alike_in_both_backends(tmp_path):
    """A checkpoint whose mask token was added grows the embedding by one row: the new input row is the
    mean embedding and an untied head's new row is zero (mars.core.tokens.new_row_init), the
    same numbers in torch and MLX."""
    import numpy as np

    pytest.importorskip("mlx_lm")
    from mars.backends import base
    from mars.core.tokens import NEW_MASK_TOKEN

    path = save_model(tmp_path / "qwen", "qwen2", with_unused=False)  # qwen2: an untied head
    rows = {}
    for name in ("torch", "mlx"):
        loaded = base.load(name, path, device="cpu", announce=lambda m: None)
        vocab = len(loaded.tokenizer)
        added = MarsConfig(
            block_size=2, mask_token=NEW_MASK_TOKEN, mask_token_id=vocab, mask_token_added=True
        )  # as a checkpoint records it
        assert base.ensure_mask_token(loaded, added, announce=lambda m: None) is added
        assert loaded.tokenizer.convert_tokens_to_ids(NEW_MASK_TOKEN) == vocab
        if name == "torch":
            emb = loaded.model.get_input_embeddings().weight.detach().numpy()
            head = loaded.model.get_output_embeddings().weight.detach().numpy()
        else:
            emb = np.array(loaded.model.model.embed_tokens.weight)
            head = np.array(loaded.model.lm_head.weight)
        rows[name] = emb, head
        assert np.allclose(emb[-1], emb[:-1].mean(0), atol=1e-6) and not head[-1].any()
    for a, b in zip(rows["torch"], rows["mlx"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
