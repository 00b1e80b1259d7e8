"""Decoding speed, measured side by side (docs/design.md, "Benchmarks").

Every configuration decodes the same prompt set at each batch size: AR with KV cache
through the project's own loop (threshold 1.0), what a user would run instead
(`transformers` `generate` on torch, `mlx_lm` on MLX), and MARS with the window and
the block-level cache at each threshold. After a warm-up, runs are interleaved,
every other round in reverse (A B C C B A ...), so drift on a shared machine hits
every configuration alike and none always runs after the same one;
medians are reported, and every speed also as a ratio to AR with KV cache in the
same round. The per-forward cost curve times one cached forward of k new tokens on
a prefilled prompt cache, cropped back after each sample. Lossless and verified rows also
report, untimed, their parity with the AR row's replies in the format the model ran in
(mars.parity: identical replies, and each other reply's first divergence with AR's top-2
logit gap there).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .backends import base
from .checkpoint.default_model import DEFAULT_REF, DefaultModelError, default_gguf, model_ref
from .core.acceptance import ar_threshold, check_threshold
from .core.decode.loop import generate
from .core.decode.plan import FEEDS, Plan, Sampling
from .core.decode.rules import (
    DEFAULT_ALTERNATIVES,
    DEFAULT_NGRAM,
    UntrainedModelError,
    block_size_for,
    check_may_decode,
    metric_for,
)
from .core.decode.types import masks_share
from .core.masks import decode_mask
from .session import Session

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "List three uses of a paperclip.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Give me a short packing list for a weekend hike.",
]


class BenchError(ValueError):
    """Bad benchmark settings; the message names the option and the fix."""


@dataclass
class BenchSettings:
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    thresholds: tuple[float, ...] = (0.9,)
    block_caches: tuple[int, ...] = (4, 8, 16, 32)
    max_tokens: int = 64
    repeats: int = 3
    block_size: int | None = None  # default: the checkpoint's (mars.core.decode.rules.block_size_for)
    metric: str | None = None  # default: the checkpoint's (mars.core.decode.rules.metric_for)
    forward_ks: tuple[int, ...] = tuple(range(1, 33))  # the cost curve; empty: skip it
    forward_repeats: int = 5
    force: bool = False  # allow thresholds < 1 on a model without mars.json
    lossless: bool = False  # also time lossless decoding (docs/method.md §8), window and block caches
    window: bool = True  # time threshold mode with the window cache
    prompt_lookup: int = 10  # torch: also time transformers prompt lookup with this many tokens (0: skip)
    ngram: int = DEFAULT_NGRAM  # lossless: n-gram drafts of the default (cost-aware) configuration
    alternatives: int = DEFAULT_ALTERNATIVES  # lossless: runner-up groups of the default configuration
    llama_cpp: bool = (
        True  # also time llama.cpp on the base GGUF (one prompt at a time), when llama-cpp-python is importable
    )
    # Threshold mode's feeds to time: "auto" (what `mars generate` runs: the masks per step
    # chosen from the cost curve, mars.core.decode.cost.ThresholdFeed) and/or "fixed" (B every step).
    feeds: tuple[str, ...] = ("auto",)
    # Also time verified threshold mode (mars.core.decode.plan.Mode.VERIFIED) at each
    # threshold, with the window cache, the cost-aware feed and n-gram drafts (`ngram`).
    verify: bool = False
    # --lossless: also time the default configuration's variants (no corpus, fixed spare groups);
    # False times the default lossless configuration alone (what `mars generate` runs).
    lossless_variants: bool = True

    def __post_init__(self):
        # Each configuration is named by its values; a repeated value would time one twice under one name.
        for name in ("batch_sizes", "thresholds", "block_caches", "forward_ks"):
            setattr(self, name, tuple(dict.fromkeys(getattr(self, name))))
        for name in ("batch_sizes", "block_caches", "forward_ks"):  # block_caches may be empty: no block cache
            values = getattr(self, name)
            if any(v < 1 for v in values):
                raise BenchError(f"{name.replace('_', ' ')} must be >= 1, got {list(values)}")
        if not self.batch_sizes:
            raise BenchError("give at least one batch size")
        self.feeds = tuple(dict.fromkeys(self.feeds))
        if not self.feeds or any(f not in FEEDS for f in self.feeds):
            raise BenchError(f"feeds must be some of {', '.join(FEEDS)}, got {list(self.feeds)}")
        if self.repeats < 1 or self.forward_repeats < 1:
            raise BenchError("repeats must be >= 1")
        if self.max_tokens < 1:
            raise BenchError(f"max tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Config:
    """One thing to time: `run(prompts)` decodes a batch and returns (tokens per row, DecodeStats or None)."""

    name: str
    kind: str  # ar | reference | mars | lossless
    run: Callable
    threshold: float | None = None
    cache: str | None = None
    block_cache: int | None = None
    cache_ran: str | None = None  # the cache strategy that ran (lossless block: may be the window's)
    walls: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    forwards: int | None = None
    row_forwards: int | None = None
    by_source: dict | None = None
    masks_fed: dict | None = None


def metric_of(loaded, s: BenchSettings) -> str:
    """The confidence metric: the one asked for, else the checkpoint's."""
    return metric_for(loaded.mars, s.metric)


def plan(
    loaded,
    threshold: float,
    cache: str,
    block_cache: int,
    s: BenchSettings,
    lossless: bool = False,
    hedge: int | None = None,
    ngram: int = 0,
    feed: str = "auto",
    verify: bool = False,
    alternatives: int = 0,
) -> Plan:
    """The plan `mars generate` would make for this model (mars.core.decode.plan.make_plan), greedy."""
    return base.plan_for_model(
        loaded,
        threshold=threshold,
        lossless=lossless,
        verify=verify,
        metric=s.metric,
        block_size=s.block_size,
        force=s.force,
        max_tokens=s.max_tokens,
        cache=cache,
        block_cache=block_cache,
        sampling=Sampling(),
        hedge=hedge,
        ngram=ngram,
        feed=feed,
        alternatives=alternatives,
    )


def _until_eos(tokens, eos: set[int], max_tokens: int) -> list[int]:
    """A reply as the project's loop reports it: up to and including the first EOS, at most max_tokens."""
    out = []
    for t in tokens[:max_tokens]:
        out.append(int(t))
        if out[-1] in eos:
            break
    return out


def torch_reference(loaded, max_tokens: int, lookup: int = 0):
    """`transformers` `generate`: greedy, the batch left-padded, the same max_new_tokens;
    with `lookup`, its prompt lookup decoding (that many draft tokens, batch 1 only). It runs
    as its users run it: our packed linear layers are switched off for it."""
    import torch

    eos = list(loaded.eos_ids)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else eos[0]

    @torch.inference_mode()
    def run(prompts):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            attn[r, width - len(p) :] = 1
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        if loaded.gate is not None:
            loaded.gate.clear()  # no masks fed: a gated adapter's model is the base
        out = loaded.model.generate(
            ids.to(loaded.device),
            attention_mask=attn.to(loaded.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=pad,
            **extra,
        )
        new = out[:, width:].tolist()
        return [_until_eos(row, set(eos), max_tokens) for row in new], None

    def one_by_one(prompts):  # prompt lookup decodes one row at a time
        out = [run([p])[0][0] for p in prompts]
        return out, None

    if lookup:
        return f"transformers lookup {lookup}", one_by_one
    return "transformers.generate", run


def gguf_for(loaded) -> str | None:
    """The GGUF file of the model's base, where one is known: a model given as a .gguf file,
    or the embedded default (directly or under an adapter, per its mars.json)."""
    path = str(getattr(loaded, "path", "") or "")
    if path.endswith(".gguf") and Path(path).is_file():
        return path
    base_model = loaded.mars.base_model if loaded.mars is not None else None
    if DEFAULT_REF in (model_ref(path) if path else None, base_model):
        try:
            return str(default_gguf())
        except DefaultModelError:
            return None
    return None


def llama_cpp_reference(gguf: str, max_tokens: int, eos: set[int], threads: int | None = None):
    """llama.cpp (`llama-cpp-python`) on a GGUF file: greedy, one prompt at a time, the same
    prompt token ids and max_tokens, stopping at the first EOS id. It runs the GGUF's own
    weights (the embedded default's are Q4_1; ours are de-quantized from them to fp32), so
    its replies may differ from ours: the table's `=AR` column says how often they agree."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=threads or 1, n_threads_batch=threads or 1, verbose=False)

    def run(prompts):
        out = []
        for p in prompts:
            row = []
            for t in llm.generate(list(p), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                row.append(int(t))
                if row[-1] in eos or len(row) >= max_tokens:
                    break
            out.append(row)
        return out, None

    return "llama.cpp (GGUF)", run


def mlx_reference(loaded, max_tokens: int):
    """`mlx_lm.stream_generate` (what `mlx_lm.generate` runs) for one prompt, `mlx_lm.batch_generate` for a batch."""
    from mlx_lm import batch_generate, stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(loaded.tokenizer, eos_token_ids=list(loaded.eos_ids))
    eos = set(loaded.eos_ids)

    def run(prompts):
        if len(prompts) == 1:
            return [
                [r.token for r in stream_generate(loaded.model, tokenizer, prompts[0], max_tokens=max_tokens)]
            ], None
        result = batch_generate(loaded.model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
        # batch_generate leaves the stop token out; a reply shorter than max_tokens ended on one.
        return [list(t) + ([min(eos)] if len(t) < max_tokens else []) for t in result.token_ids], None

    return "mlx_lm.generate", run


class _Ours:
    """A configuration of this project's loop: prompts -> (tokens, statistics); `mode` names its plan."""

    def __init__(self, decoder, settings: Plan, controller=None):
        self.decoder, self.settings, self.controller = decoder, settings, controller
        self.mode = settings.name

    def __call__(self, prompts):
        result = generate(self.decoder, prompts, self.settings, controller=self.controller)
        return result.tokens, result.stats


def build_configs(session: Session, s: BenchSettings, cost=None) -> list[Config]:
    """The configurations of a model opened for decoding (its loaded model, decoder and backend).
    `cost`: the decoder's per-forward cost curves (mars.core.decode.cost.BatchCosts); the default
    lossless configuration (what `mars generate --lossless` runs) and threshold mode's "auto"
    feed choose what they feed from them, each configuration through a feed controller of its
    own (mars.core.decode.feed.FeedController) over these curves."""
    from .core.decode.feed import FeedController

    loaded, decoder, backend = session.loaded, session.decoder, session.backend

    def controller():
        return FeedController(cost) if cost is not None else None

    ar_tau = ar_threshold(metric_of(loaded, s))
    ar = Config("ar-kv-cache", "ar", _Ours(decoder, plan(loaded, ar_tau, "window", 16, s)), ar_tau, "window")
    name, ref = (mlx_reference if backend == "mlx" else torch_reference)(loaded, s.max_tokens)
    configs = [ar, Config(name, "reference", ref)]
    if backend == "torch" and s.prompt_lookup:  # one prompt at a time, whatever the batch size
        name, ref = torch_reference(loaded, s.max_tokens, lookup=s.prompt_lookup)
        configs.append(Config(name, "reference", ref))
    if s.llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        gguf = gguf_for(loaded)
        if gguf is not None:  # one prompt at a time, whatever the batch size
            name, ref = llama_cpp_reference(
                gguf, s.max_tokens, set(loaded.eos_ids), _torch_threads() if backend == "torch" else None
            )
            configs.append(Config(name, "reference", ref))
    # Threshold rows decide on the curves as stored now (a controller keeps them as it found
    # them): the lossless rows refresh `cost` from the forwards they time, and threshold-mode
    # text must not follow that from round to round.
    stored = controller()
    for tau in s.thresholds:
        for feed in s.feeds:
            # auto: each call picks its masks per step from the cost curve (a policy of its own,
            # mars.core.decode.feed.ThresholdFeed), and may leave the block cache where it does not pay.
            fed, suffix = (stored, "") if feed == "auto" else (None, " fixed")
            if s.window:
                window = _Ours(decoder, plan(loaded, tau, "window", 16, s, feed=feed), fed)
                configs.append(Config(f"mars-window t={tau:g}{suffix}", "mars", window, tau, "window"))
            for bc in s.block_caches:
                run = _Ours(decoder, plan(loaded, tau, "block", bc, s, feed=feed), fed)
                configs.append(Config(f"mars-block{bc} t={tau:g}{suffix}", "mars", run, tau, "block", bc))
    if s.verify:
        for tau in s.thresholds:
            # The window cache (verified threshold mode runs no other), deciding on the stored curves.
            verified = plan(loaded, tau, "window", 16, s, ngram=s.ngram, verify=True, alternatives=s.alternatives)
            configs.append(Config(f"verified t={tau:g}", "mars", _Ours(decoder, verified, stored), tau, "window"))
    if s.lossless:
        if s.window:
            auto = plan(loaded, 1.0, "window", 16, s, True, ngram=s.ngram, alternatives=s.alternatives)
            configs.append(Config("lossless (default)", "lossless", _Ours(decoder, auto, controller()), None, "window"))
            if (
                auto.drafts.corpus is not None and s.lossless_variants
            ):  # what the checkpoint's draft corpus adds (mars.core.decode.drafts.corpus)
                bare = dataclasses.replace(auto, drafts=dataclasses.replace(auto.drafts, corpus=None))
                configs.append(
                    Config("lossless, no corpus", "lossless", _Ours(decoder, bare, controller()), None, "window")
                )
            if s.lossless_variants:
                fixed = plan(loaded, 1.0, "window", 16, s, True, hedge=auto.block_size)
                configs.append(
                    Config(f"lossless hedge {auto.block_size}", "lossless", _Ours(decoder, fixed), None, "window")
                )
                configs.append(
                    Config(
                        "lossless hedge 0",
                        "lossless",
                        _Ours(decoder, plan(loaded, 1.0, "window", 16, s, True, hedge=0)),
                        None,
                        "window",
                    )
                )
        for bc in s.block_caches:
            block = plan(loaded, 1.0, "block", bc, s, True, ngram=s.ngram, alternatives=s.alternatives)
            # With a cost curve the loop may leave the block cache for the window cache where
            # that is faster (the row's "cache_ran" says which ran).
            configs.append(
                Config(f"lossless-block{bc}", "lossless", _Ours(decoder, block, controller()), None, "block", bc)
            )
    return configs


def _chunks(prompts, size):
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def _timed_pass(config: Config, chunks) -> tuple[float, list[list[int]], int, int | None, int | None]:
    """Decode every chunk; also leaves in `config.by_source` where a lossless pass's tokens came
    from, and in `config.masks_fed` how many masks a threshold pass fed a step (masks -> forwards)."""
    tokens, forwards, row_forwards, sources, ran, fed = [], 0, 0, {}, set(), {}
    t0 = time.perf_counter()
    for chunk in chunks:
        out, stats = config.run(chunk)
        tokens.extend(out)
        if stats is not None:
            forwards += stats.forwards
            row_forwards += stats.row_forwards
            if stats.cache:
                ran.add(stats.cache)
            for k, v in stats.by_source().items():
                sources[k] = sources.get(k, 0) + v
            for m, n in stats.masks_fed.items():
                fed[m] = fed.get(m, 0) + n
    wall = time.perf_counter() - t0
    config.by_source = sources or None
    config.masks_fed = dict(sorted(fed.items())) if config.kind == "mars" else None
    config.cache_ran = ",".join(sorted(ran)) or None
    own = config.kind != "reference"
    return wall, tokens, sum(len(t) for t in tokens), forwards if own else None, row_forwards if own else None


def _prefix_kept(rows, ar_rows) -> float:
    """Share of AR's tokens a configuration reproduced before its first difference, over all rows."""
    kept = 0
    for row, ar in zip(rows, ar_rows):
        n = 0
        while n < min(len(row), len(ar)) and row[n] == ar[n]:
            n += 1
        kept += n
    return round(kept / max(1, sum(len(a) for a in ar_rows)), 4)


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def _strip_eos(rows, eos):
    return [[t for t in row if t not in eos] for row in rows]


def _no_tick(what: str, tokens: int) -> None:
    pass


def bench_batch(
    configs: list[Config], prompts, batch: int, s: BenchSettings, eos: set[int], log=None, tick=_no_tick
) -> dict:
    """Time every configuration on `prompts` in batches of `batch`, interleaved; medians and ratios to AR.
    `tick(name, tokens)` is called after each pass (warm-up or timed) with the tokens it may
    decode (its prompts x max_tokens), for a progress bar that counts tokens: passes of
    different lengths weigh what they cost."""
    chunks = _chunks(prompts, batch)
    for c in configs:  # warm-up: one batch each
        c.run(chunks[0])
        c.walls, c.ratios, c.tokens = [], [], []
        tick(f"batch {batch} warm-up {c.name}", len(chunks[0]) * s.max_tokens)
    for rep in range(s.repeats):
        speeds = {}
        # Every other round runs the configurations in reverse, so none always follows the
        # same one (a run can leave the process or the machine slower for the next).
        for c in configs if rep % 2 == 0 else configs[::-1]:
            wall, tokens, count, forwards, row_forwards = _timed_pass(c, chunks)
            tick(f"batch {batch} round {rep + 1} {c.name}", len(prompts) * s.max_tokens)
            c.walls.append(wall)
            speeds[c.name] = count / wall
            if rep == 0:
                c.tokens, c.forwards, c.row_forwards = tokens, forwards, row_forwards
            if log:
                log(f"batch {batch} round {rep + 1}/{s.repeats}: {c.name} {count} tokens in {wall:.3f}s")
        ar_speed = speeds[configs[0].name]
        for c in configs:
            c.ratios.append(speeds[c.name] / ar_speed)
    ar, ref = configs[0], configs[1]
    ar_rows = _strip_eos(ar.tokens, eos)
    rows = []
    for c in configs:
        count = sum(len(t) for t in c.tokens)
        wall = statistics.median(c.walls)
        rows.append(
            {
                "name": c.name,
                "kind": c.kind,
                "mode": getattr(c.run, "mode", None),
                "batch_size": batch,
                "threshold": c.threshold,
                "cache": c.cache,
                "block_cache": c.block_cache,
                "tokens": count,
                "forwards": c.forwards,
                "tokens_per_forward": round(count / c.row_forwards, 4) if c.row_forwards else None,
                "wall_s": wall,
                "wall_s_runs": c.walls,
                "tokens_per_s": count / wall,
                "ratio_to_ar": 1.0 if c is ar else statistics.median(c.ratios),
                "ratio_min": min(c.ratios),
                "ratio_max": max(c.ratios),
                "tokens_by_source": c.by_source,
                "masks_share": _rounded(masks_share(c.by_source)),
                "masks_fed": c.masks_fed,
                "cache_ran": c.cache_ran,
                "ar_prefix_kept": _prefix_kept(_strip_eos(c.tokens, eos), ar_rows),
                "rows_equal_to_ar": sum(a == b for a, b in zip(_strip_eos(c.tokens, eos), ar_rows)) / len(ar_rows),
            }
        )
    mismatched = [i for i, (a, b) in enumerate(zip(ar_rows, _strip_eos(ref.tokens, eos))) if a != b]
    check = {"batch_size": batch, "reference": ref.name, "matches": not mismatched, "mismatched_rows": mismatched}
    return {"runs": rows, "reference_check": check}


def add_parity(runs: list[dict], configs: list[Config], session: Session, prompts) -> None:
    """To each run (one per configuration, in order) whose plan verifies against AR (lossless:
    AR's replies by construction; verified threshold mode: close to them) add its parity with
    the AR row's replies of the same round, in the format the model ran in (mars.parity), after
    the timing: one plain forward per differing reply."""
    from .core.decode.plan import Mode
    from .parity import parity

    ar = configs[0]
    for run, c in zip(runs, configs):
        plan = getattr(c.run, "settings", None)
        if plan is not None and plan.mode in (Mode.LOSSLESS, Mode.VERIFIED):
            run["parity"] = parity(session.decoder, session.loaded, prompts, ar.tokens, c.tokens)


def forward_cost(
    decoder, prompts, batch: int, ks, repeats: int, filler: int, tick=_no_tick, ar_filler: int | None = None
) -> list[dict]:
    """Median time of one cached forward of k new tokens on a prefilled cache of the first
    `batch` prompts (right-aligned, holes in front, as the decoding loop lays them out).
    The new tokens are `filler` (the mask), or `ar_filler` for k = 1: a one-token forward is
    an AR step, which feeds a real token (a gated adapter does no work there)."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    width = max(len(p) for p in rows)
    ids = np.full((batch, width), filler, dtype=np.int64)
    valid = np.zeros((batch, width), dtype=bool)
    for r, p in enumerate(rows):
        ids[r, width - len(p) :] = p
        valid[r, width - len(p) :] = True
    positions = np.where(valid, np.cumsum(valid, axis=1) - 1, 0)
    lengths = valid.sum(axis=1)
    greedy = Sampling()
    cache = decoder.new_cache(batch)
    mask = None if valid.all() else decode_mask(valid, width)
    decoder.step(cache, ids, positions, mask, np.full((batch, 1), width - 1), metric="probability", sampling=greedy)

    def one(k):
        new_ids = np.full((batch, k), filler if k > 1 or ar_filler is None else ar_filler, dtype=np.int64)
        new_pos = lengths[:, None] + np.arange(k)[None, :]
        keys = np.concatenate([valid, np.ones((batch, k), dtype=bool)], axis=1)
        m = None if keys.all() else decode_mask(keys, k)
        read = np.tile(np.arange(k), (batch, 1))
        t0 = time.perf_counter()
        decoder.step(cache, new_ids, new_pos, m, read, metric="probability", sampling=greedy)
        seconds = time.perf_counter() - t0
        decoder.crop(cache, width)
        return seconds

    for k in ks:  # warm-up
        one(k)
        tick(f"batch {batch} forward cost k={k}", batch * k)
    samples = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            samples[k].append(one(k))
            tick(f"batch {batch} forward cost k={k}", batch * k)
    base = statistics.median(samples[ks[0]])
    return [
        {
            "batch_size": batch,
            "cache_length": int(width),
            "k": k,
            "median_s": statistics.median(samples[k]),
            "ratio_to_first": statistics.median(samples[k]) / base,
        }
        for k in ks
    ]


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_benchmark(
    session: Session, prompts: list[list[int]], s: BenchSettings, log=None, progress: bool = False
) -> dict:
    """Every configuration at every batch size, and the forward-cost curve, of a model opened for
    decoding; a JSON-ready dict. `progress` shows a progress bar (stderr) over every pass."""
    loaded, decoder, backend = session.loaded, session.decoder, session.backend
    metric, block_size = metric_of(loaded, s), block_size_for(loaded.mars, s.block_size)
    for t in s.thresholds:
        check_threshold(metric, t)
    try:
        for t in s.thresholds:
            check_may_decode(loaded.mars is not None, metric, t, force=s.force)
    except UntrainedModelError as e:
        raise BenchError(str(e)) from e
    cost = None
    if s.lossless or "auto" in s.feeds:
        cost = base.costs(loaded, decoder)
        cost.prepare(max(s.batch_sizes))  # every batch's curve measured before anything is timed
    configs = build_configs(session, s, cost)
    eos = set(loaded.eos_ids)
    runs, checks, curve = [], [], []
    ks = tuple(s.forward_ks)
    # Progress in tokens (decoded, or fed to a timed forward), so that the estimate of the time
    # left weighs a long decoding pass and a one-token forward for what they are.
    tokens = sum(
        len(configs) * (min(batch, len(prompts)) + s.repeats * len(prompts)) * s.max_tokens
        + (1 + s.forward_repeats) * batch * sum(ks)
        for batch in s.batch_sizes
    )
    with tqdm(total=tokens, desc="bench", unit="token", disable=not progress, leave=False) as bar:

        def tick(what: str, n: int) -> None:
            bar.set_postfix_str(what, refresh=False)
            bar.update(n)

        for batch in s.batch_sizes:
            result = bench_batch(configs, prompts, batch, s, eos, log, tick)
            add_parity(result["runs"], configs, session, prompts)
            runs += result["runs"]
            checks.append(result["reference_check"])
        for batch in s.batch_sizes if ks else ():
            curve += forward_cost(
                decoder,
                prompts,
                batch,
                ks,
                s.forward_repeats,
                base.mask_id_for(loaded),
                tick,
                ar_filler=loaded.eos_ids[0],
            )
    settings = asdict(s)
    settings.update(block_size=block_size, metric=metric)
    return {
        "backend": backend,
        "model": getattr(loaded, "path", None),
        "device": str(loaded.device),
        "torch_threads": _torch_threads() if backend == "torch" else None,
        "mars_checkpoint": loaded.mars is not None,
        "prompts": len(prompts),
        "settings": settings,
        "ar_matches_reference": all(c["matches"] for c in checks),
        "reference_check": checks,
        "runs": runs,
        "forward_cost": curve,
    }


def benchmark(
    model=None,
    *,
    backend: str = "auto",
    adapter_path=None,
    prompts=None,
    raw: bool = False,
    settings: BenchSettings | None = None,
    threads: int | None = None,
    compile: bool | str = False,
    announce=print,
    log=None,
    progress: bool = False,
) -> dict:
    """Load a model (None: the embedded default), encode the prompts (default: DEFAULT_PROMPTS) and run.

    `threads` sets torch's CPU threads: on a shared machine, fewer threads than cores avoids
    the oversubscription that makes every timing noisy."""
    name = base.resolve(backend)
    if threads and name == "torch":
        import torch

        torch.set_num_threads(threads)
    session = Session(model, adapter_path, backend=name, announce=announce, compile=compile)
    ids = session.encode(list(prompts) if prompts else DEFAULT_PROMPTS, chat=not raw)
    return run_benchmark(session, ids, settings or BenchSettings(), log, progress=progress)


def format_table(report: dict) -> str:
    """The runs per batch size, then the forward-cost curve, as plain text."""
    s = report["settings"]
    head = (
        f"backend {report['backend']} on {report['device']}, {report['prompts']} prompts, max {s['max_tokens']} "
        f"tokens, "
        f"median of {s['repeats']}; AR matches {report['reference_check'][0]['reference']}: "
        f"{report['ar_matches_reference']}"
    )
    lines = [
        head,
        "",
        f"{'batch':>5}  {'configuration':<24} {'tokens':>6} {'wall s':>8} {'tok/s':>8} {'tok/fwd':>7} {'x AR':>6} "
        f"{'min-max':>11} {'=AR':>5} {'masks':>6}",
    ]
    for r in report["runs"]:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] is not None else "-"
        lines.append(
            f"{r['batch_size']:>5}  {r['name']:<24} {r['tokens']:>6} {r['wall_s']:>8.3f} {r['tokens_per_s']:>8.1f} "
            f"{tpf:>7} {r['ratio_to_ar']:>6.2f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f} "
            f"{r['rows_equal_to_ar']:>5.2f} "
            f"{'-' if r.get('masks_share') is None else format(r['masks_share'], '.0%'):>6}"
            + (f"  (ran the {r['cache_ran']} cache)" if r.get("cache_ran") and r["cache_ran"] != r.get("cache") else "")
        )
    checked = [r for r in report["runs"] if "parity" in r]
    if checked:
        from .parity import GAP_MEANING, summary

        lines += ["", "parity with AR in this run and format (lossless, verified rows; each divergence in the JSON):"]
        lines += [f"{r['batch_size']:>5}  {r['name']:<24} {summary(r['parity'])}" for r in checked]
        lines.append(GAP_MEANING)
    if report["forward_cost"]:
        lines += ["", "one cached forward of k new tokens (median ms; x the first k)"]
        for batch in s["batch_sizes"]:
            points = [p for p in report["forward_cost"] if p["batch_size"] == batch]
            cells = ", ".join(f"k={p['k']}: {p['median_s'] * 1e3:.2f} ({p['ratio_to_first']:.2f}x)" for p in points)
            lines.append(f"batch {batch} (cache {points[0]['cache_length']}): {cells}")
    return "\n".join(lines)
