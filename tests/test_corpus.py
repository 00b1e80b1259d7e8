"""Corpus drafts (mars.core.decode.drafts.corpus): lookup in the model's own earlier replies, the file that
keeps them beside a checkpoint, `mars corpus`, and lossless decoding that drafts from them
with its output unchanged."""

from __future__ import annotations

import collections
import json
import shutil

import numpy as np
import pytest
import torch
from clitools import invoke, ok, one_line_error
from test_cost import EOS, OracleBackend, oracle, settings
from tiny import PROMPTS, feed_of, make_model, make_tokenizer

from mars.backends import base
from mars.backends.torch.decode import TorchDecoder
from mars.backends.torch.load import TorchModel
from mars.core.decode.cost import CostCurve
from mars.core.decode.drafts import corpus as corpus_drafts
from mars.core.decode.drafts.corpus import CorpusError, DraftCorpus
from mars.core.decode.loop import generate


def reference(sequences, seq, max_drafts):
    """`DraftCorpus.match` by brute force: every window of every sequence, no hashing."""
    for n in range(min(corpus_drafts.MAX_NGRAM, len(seq)), corpus_drafts.MIN_NGRAM - 1, -1):
        tail = list(seq[len(seq) - n :])
        places = [
            (s, i + n) for s, sq in enumerate(sequences) for i in range(len(sq) - n + 1) if list(sq[i : i + n]) == tail
        ]
        if not places:
            continue
        places = places[-corpus_drafts.MAX_PLACES :]
        drafts = []
        for j in range(max_drafts):
            nxt = [sequences[s][e] if e < len(sequences[s]) else -1 for s, e in places]
            counts = collections.Counter(nxt)
            token, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # plurality; ties: the smallest id
            if token < 0 or (j and 2 * count <= len(places)):
                break
            drafts.append(token)
            places = [(s, e + 1) for (s, e), t in zip(places, nxt) if t == token]
        return n, drafts
    return 0, []


def test_lookup_takes_the_longest_match_and_the_continuation_most_places_agree_on():
    c = DraftCorpus([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 4, 6, 8], [1, 2, 3]])
    # "3 4" occurs three times: 6 twice, 5 once -> 6; then only two places are left and agree on nothing past 6
    assert c.match([0, 3, 4], max_drafts=4) == (2, [6])
    # "1 2 3 4" occurs once: its continuation until the sequence ends (never across sequences)
    assert c.match([1, 2, 3, 4], max_drafts=4) == (4, [5])
    assert c.match([7, 2, 3], max_drafts=3) == (3, [4, 6, 8])
    assert c.match([5, 5], max_drafts=3) == (0, [])  # no 2-gram matches (1-grams never count)
    assert c.match([4], max_drafts=3) == (0, [])
    assert c.match([2, 3], max_drafts=0) == (0, [])
    # a match may not span two sequences: "5 9" only occurs across the separator
    assert c.match([5, 9], max_drafts=2) == (0, [])
    assert len(c) == 19


def against_brute_force(rng, vocab: int, longest: int, trials: int = 300) -> list[DraftCorpus]:
    """Random corpora (sequences of 1 to `longest` - 1 ids) and sequences over `vocab` ids: every
    lookup equals `reference`'s; returns the corpora."""
    corpora = []
    for _ in range(trials):
        sequences = [
            rng.integers(0, vocab, size=int(rng.integers(1, longest))).tolist() for _ in range(int(rng.integers(1, 5)))
        ]
        c = DraftCorpus(sequences)
        seq = rng.integers(0, vocab, size=int(rng.integers(0, 12))).tolist()
        max_drafts = int(rng.integers(1, 13))
        assert c.match(seq, max_drafts=max_drafts) == reference(sequences, seq, max_drafts), (sequences, seq)
        corpora.append(c)
    return corpora


@pytest.mark.parametrize("most", [corpus_drafts.MAX_PLACES, 5])
def test_lookup_equals_a_brute_force_search(monkeypatch, most):
    """A lookup is the brute-force search's, with the places that vote capped as they are and at a few
    (the latest `most` of dozens of places vote)."""
    monkeypatch.setattr(corpus_drafts, "MAX_PLACES", most)
    against_brute_force(np.random.default_rng(5), vocab=4, longest=25)
    against_brute_force(np.random.default_rng(6), vocab=2, longest=60, trials=100)  # dozens of places


@pytest.mark.parametrize("most", [corpus_drafts.MAX_PLACES, 2])
def test_lookup_equals_a_brute_force_search_where_hashes_collide(monkeypatch, most):
    """With the hashes cut to 3 bits, different n-grams share hashes all the time: a lookup keeps
    only the places that hold the sequence's own tail (the latest `most` of them), as the
    brute-force search does."""
    monkeypatch.setattr(corpus_drafts, "MAX_PLACES", most)
    real = corpus_drafts._hashes
    monkeypatch.setattr(corpus_drafts, "_hashes", lambda values, n: real(values, n) & np.uint64(7))
    monkeypatch.setattr(corpus_drafts, "_MASK", 7)
    corpora = against_brute_force(np.random.default_rng(7), vocab=6, longest=30)
    shared = sum(len(found) for c in corpora if c._index for _, _, found in c._index.values())
    assert shared, "no hash was shared by two n-grams: the collision path went untested"


def test_sources_by_match_length():
    assert [corpus_drafts.source(n) for n in (2, 3, 4, 5, 6, 8)] == [
        "corpus2",
        "corpus3",
        "corpus4",
        "corpus4",
        "corpus6",
        "corpus6",
    ]


def test_a_corpus_file_round_trips_and_bad_files_name_themselves(tmp_path):
    c = DraftCorpus([[5, 6, 7], [8, 9]])
    c.save(tmp_path / "c.npz")
    back = DraftCorpus.load(tmp_path / "c.npz")
    assert back.tokens.tolist() == c.tokens.tolist() == [5, 6, 7, -1, 8, 9, -1]
    assert back.match([5, 6], max_drafts=2) == (2, [7])
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(CorpusError, match="junk.npz: cannot read a draft corpus"):
        DraftCorpus.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(CorpusError, match="other.npz: no 'tokens' array"):
        DraftCorpus.load(tmp_path / "other.npz")
    np.savez(tmp_path / "future.npz", tokens=np.array([1, 2, -1]), format=np.int32(99))
    with pytest.raises(CorpusError, match="future.npz: draft corpus format 99"):
        DraftCorpus.load(tmp_path / "future.npz")
    with pytest.raises(CorpusError, match="token ids >= 0"):
        DraftCorpus([[1, -5]])


@pytest.mark.parametrize("cost", [None, CostCurve({1: 1.0, 64: 4.0}, refresh=0.0)])
def test_corpus_drafts_keep_the_output_and_report_their_source(cost):
    # The oracle's text at positions 6.. is in the corpus (as an earlier reply), never in the prompt.
    prompt = [oracle(p) for p in range(6)]
    reply = [oracle(p) for p in range(6, 46)]
    book = DraftCorpus([[oracle(p) for p in range(3, 60)]])
    plain = generate(OracleBackend(0), [prompt], settings(hedge=0, ngram=6), controller=feed_of(cost))
    drafted = generate(OracleBackend(0), [prompt], settings(hedge=0, ngram=6, corpus=book), controller=feed_of(cost))
    assert plain.tokens == drafted.tokens == [reply]
    sources = drafted.stats.by_source()
    assert sources.get("corpus", 0) > len(reply) // 2
    assert sum(sources.values()) == len(reply)
    assert drafted.stats.forwards < plain.stats.forwards // 2
    assert sum(drafted.stats.draft_kept.get("corpus6", [0])) > len(reply) // 2
    # A corpus of other text drafts nothing that is kept, and changes nothing.
    other = DraftCorpus([[EOS + 1 + (p % 3) for p in range(50)]])
    assert generate(
        OracleBackend(0), [prompt], settings(hedge=0, ngram=6, corpus=other), controller=feed_of(cost)
    ).tokens == [reply]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("curve", [{1: 1.0, 64: 1.0}, {1: 1.0, 64: 64.0}, {1: 1.0, 4: 1.2, 8: 1.5, 32: 3.0}])
def test_lossless_with_corpus_drafts_equals_ar_on_a_real_model(arch, curve):
    tok = make_tokenizer()
    tm = TorchModel(make_model(arch, len(tok), seed=1), tok, None, "", torch.device("cpu"), torch.float32)
    dec = TorchDecoder(tm)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in PROMPTS
    ]
    ar = generate(dec, prompts, settings(threshold=1.0, lossless=False, max_tokens=24)).tokens
    # The model's own replies to the other prompts, and to a shifted copy of each prompt, as the corpus:
    # what it says after a few tokens it has said before.
    shifted = [p[1:] for p in prompts]
    book = DraftCorpus(
        [
            p + r
            for p, r in zip(
                shifted, generate(dec, shifted, settings(threshold=1.0, lossless=False, max_tokens=24)).tokens
            )
        ]
    )
    feed = feed_of(CostCurve(dict(curve), refresh=0.0), explore=3)
    kept = 0
    for batch in (1, 3):
        out = []
        for start in range(0, len(prompts), batch):
            result = generate(
                dec, prompts[start : start + batch], settings(max_tokens=24, ngram=5, corpus=book), controller=feed
            )
            out += result.tokens
            kept += result.stats.by_source().get("corpus", 0)
        assert out == ar, (arch, batch)
    if curve.get(64) != 64:  # on the steep curve (every fed token costs a forward) no draft pays
        assert kept > 0  # corpus drafts were fed and kept


def test_a_checkpoint_with_a_corpus_drafts_from_it(tmp_path, tiny, data):
    # `mars corpus` writes the file into a model directory; loaded from there, the decode
    # settings carry it unless asked otherwise, and a model without one has none.
    from mars.backends.torch.load import load

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    ok(invoke("corpus", "--data", data, "--model", tiny, "--output", ckpt))
    book = DraftCorpus.load(ckpt / corpus_drafts.FILE)
    assert len(book) > 20 * 5 and book.tokens[-1] == -1
    loaded = load(str(ckpt), device="cpu", announce=lambda m: None)
    s = base.plan_for_model(loaded, lossless=True)
    assert s.drafts.corpus is not None and s.drafts.corpus.tokens.tolist() == book.tokens.tolist()
    assert base.plan_for_model(loaded, lossless=True).drafts.corpus is s.drafts.corpus  # read once per loaded model
    assert base.plan_for_model(loaded, lossless=True, corpus=None).drafts.corpus is None
    assert (
        base.plan_for_model(load(str(tiny), device="cpu", announce=lambda m: None), lossless=True).drafts.corpus is None
    )


def test_mars_corpus_rejects_bad_input(tmp_path, tiny):
    one_line_error(
        invoke("corpus", "--data", tmp_path, "--model", tiny, "--output", tmp_path / "c.npz"), "no train.jsonl"
    )
    (tmp_path / "train.jsonl").write_text('{"messages": 3}\n')
    one_line_error(
        invoke("corpus", "--data", tmp_path, "--model", tiny, "--output", tmp_path / "c.npz"), "train.jsonl:1"
    )
    one_line_error(
        invoke("corpus", "--data", tmp_path, "--model", tiny, "--output", tmp_path / "nowhere"), "not a directory"
    )
    assert not (tmp_path / "c.npz").exists()


def test_generate_takes_a_corpus_or_none(tmp_path, tiny, data):
    book = tmp_path / "book.npz"
    ok(invoke("corpus", "--data", data, "--model", tiny, "--output", book))
    args = ("generate", "--model", tiny, "--prompt", "Spell from c", "--lossless", "--max-tokens", 6, "--json")
    outputs = [ok(invoke(*args, *extra)).output for extra in ((), ("--corpus", book), ("--corpus", "none"))]
    texts = [[json.loads(line)["text"] for line in out.splitlines() if line.startswith("{")] for out in outputs]
    assert texts[0] and all(t == texts[0] for t in texts)  # corpus or not, the reply is AR's
    one_line_error(invoke(*args, "--corpus", tmp_path / "missing.npz"), "missing.npz")
