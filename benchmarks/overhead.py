"""Per-step overhead where arithmetic is almost free: a model of the embedded default's depth, made narrow.

    python benchmarks/overhead.py                           # torch: mars, transformers (eager and compiled)
    python benchmarks/overhead.py --no-compile              # without the compiled StaticCache loop (compiling: 1-2 min)
    python benchmarks/overhead.py --mlx                     # also mars's MLX backend and mlx_lm.stream_generate
    python benchmarks/overhead.py --quick                   # 2 layers, 1 prompt, 4 tokens: what the test runs

On a GPU a forward of the embedded default (SmolLM2-135M-Instruct, 30 layers) costs little arithmetic:
what a step costs there is mostly launching each layer's kernels and the host's work around them, and a
few more tokens fed cost little more than one. This script builds that regime on the CPU: a random
`LlamaForCausalLM` with the default's depth (30 layers), vocabulary (49152), tokenizer and tied embeddings
but hidden size 64, intermediate size 256, 4 heads and 2 key/value heads (`--layers`, `--hidden`,
`--intermediate`, `--heads`, `--kv-heads`), its weights drawn with standard deviation 0.3 (`--init-std`; at
the config's 0.02 the 30 random layers answer one token whatever the input, so every draft would pass)
after `torch.manual_seed(--seed)`, saved with the default's tokenizer and a mars.json (mask token id 3,
`<repo_name>`, as the shipped weights; block size 4) into a temporary directory. Its body costs about 60
thousand multiply-adds a token a layer; the LM head (49152 x 64) about 3 million a token, so on this CPU
the head is what grows with a step's width.

Each runner decodes the first `--prompts` held-out test prompts (data/prompts/test.jsonl, through the
chat template as mars encodes them) one at a time (batch 1), greedy, up to `--max-tokens` new tokens,
stopping at the model's EOS ids, on `--threads` torch threads (float32, CPU):

- `mars_ar`: mars's AR mode (threshold 1.0) through `mars.session.Session`, as `mars generate` decodes;
- `mars_lossless_w{W}` (`--widths`): mars's lossless mode (masks only: no n-gram, corpus, runner-up or
  tree drafts) with a feed that makes every decoding step W tokens wide where it can. A window step of
  the fixed feed (`make_plan(..., feed="fixed")`) feeds the token the last step took, B drafts, B masks and
  min(hedge, B) spare groups of B masks: 1 + B (2 + hedge) tokens while the drafts fail before their
  `hedge`-th (random weights keep almost none), (B + 1)^2 whatever they keep at hedge = B. W is mapped to
  the block size B and `hedge` that give it (9: B 2, hedge 2; 17: B 4, hedge 2; 33: B 8, hedge 2), else to
  the nearest such width (5 -> 4: B 1, hedge 1). W = 1 runs the lossless loop on the cost-aware feed
  (`feed="auto"`, the checkpoint's B) over a given cost curve on which no mask ever pays, so every step feeds
  the one token (its per-step choice of the feed is then part of the step). What each step really fed is
  reported: `fed_tokens / forwards` from the decode statistics (the prompt's forward included) and every
  decoding step's width, counted in the untimed warm-up;
- `hf_generate`: transformers `generate(do_sample=False, max_new_tokens=N)` on the same weights (a model of
  its own, loaded from the saved directory: mars's CPU fast paths never touch it);
- `hf_loop`: a plain Python loop over that model with its `DynamicCache`: the prompt, then one token a step,
  argmax (logits of the last position only, as `generate` computes them);
- `hf_forward_w{W}`: the peer of `mars_lossless_w{W}`: the prompt's forward, then at each cached length
  `hf_loop` passed through, a forward of the width mars's step fed (the next AR token, then the mask token),
  its logits at every position, and `cache.crop` back to one token more; ms per forward;
- `hf_static_compiled` (unless `--no-compile`): the model on a `StaticCache` with its one-token step (forward
  and argmax) under `torch.compile`, by hand as gpt-fast does (`generate` compiles only on CUDA); the prompt's
  forward runs eagerly; its ids must equal `hf_loop`'s; the first compiled call (compile time) is reported
  apart, from the warm-up;
- `mars_compiled_ar`, `mars_compiled_lossless_w{W}` (unless `--no-compile`): mars's runners on a session
  with `compile=True` (models.CompiledStep), compiled during their warm-up; their ids must equal the eager
  runners' (`compiled_equal_eager`), and the graphs compiled after the warm-up are counted
  (`compiled_graphs`); with `--fixed`, `mars_fixed_ar`: the AR step through the fixed-shape graph CUDA
  captures (models.CompiledStep(fixed=True): padded widths, attention over the cache's whole room), on
  this CPU;
- `hf_static_forward_w{W}` (unless `--no-compile`, widths above 1): `hf_forward_w{W}`'s steps on a
  `StaticCache` with the W-token forward under `torch.compile`: the compiled peer of mars's compiled
  lossless step;
- with `--mlx` (where mlx and mlx_lm import): the same weights converted by `mars convert --to mlx`,
  `mars_mlx_ar` (mars's MLX backend, AR) and `mlx_lm_stream_generate` (mlx_lm's greedy default sampler).

Every runner runs once untimed (the warm-up: widths, compile time, the ids checked), then `--rounds` timed
rounds each run every runner once, in reversed order every other round, so drift hits all alike. ms per step
is a runner's wall time over its forwards (the prompt's forward counted as a step: each runner has one a
prompt), ms per token its wall time over the tokens it produced; each is the median over the rounds.
`ar_equal` says mars_ar's ids equal both hf_loop's and hf_generate's, `lossless_equal_ar` each lossless run's
mars_ar's.

Prints a table (runner, fed width, ms/step, ms/token, tokens/forward, tokens/s over hf_loop's); writes JSON
to --output (default benchmarks/results/overhead_<backend>_<UTC time>.json): the machine, the settings, each
runner's per-round and median timings, and the ratios `mars_ar_vs_hf_loop` (tokens/s) and, per W,
`lossless_w{W}_vs_hf_forward_w{W}` (ms per step of mars over ms per forward of the peer), of the medians and
(`ratios_per_round`) within each round.
`projection`: what the default model's tokens per forward on a flat cost curve (a kept `benchmarks/trees.py
--flat` run, `--projection-from`) would give at this run's measured step costs (mars's compiled lossless steps
by fed width, interpolated): printed and kept labelled as a projection, never a measurement.
`tests/test_overhead.py` runs `--quick`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
MASK_ID = 3  # the shipped weights' mask token (weights/mars.json): "<repo_name>"
BLOCK_SIZE = 4
# The default model's tokens per forward on a flat cost curve (benchmarks/trees.py --flat), projected at the
# step costs measured here (`projection`).
KEPT_FLAT = ROOT / "benchmarks" / "results" / "trees_flat_cpu_20261207b.json"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2, help="the first N held-out test prompts")
    p.add_argument("--prompt-file", default=str(ROOT / "data" / "prompts" / "test.jsonl"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--widths", default="1,5,9,17,33", help="lossless step widths W, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (every other one in reversed order)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--layers", type=int, default=30, help="the default's depth")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the weights are drawn")
    p.add_argument(
        "--init-std",
        type=float,
        default=0.3,
        help="the weights' standard deviation (the config's initializer_range; at the default's 0.02 the "
        "random layers give one token whatever the input)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip hf_static_compiled (torch.compile)")
    p.add_argument(
        "--fixed",
        action="store_true",
        help="also mars_fixed_ar: the compiled AR step at fixed shapes, as CUDA graphs take them (fixed=True)",
    )
    p.add_argument("--mlx", action="store_true", help="also mars's MLX backend and mlx_lm (where they import)")
    p.add_argument("--quick", action="store_true", help="2 layers, 1 prompt, 4 tokens, widths 1,5, 1 round, no compile")
    p.add_argument(
        "--projection-from",
        default=str(KEPT_FLAT),
        help="a kept `benchmarks/trees.py --flat` run: its tokens per forward, projected at this run's step costs",
    )
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prompts, args.max_tokens, args.widths, args.rounds = 2, 1, 4, "1,5", 1
        args.no_compile = True
    args.widths = [int(w) for w in str(args.widths).split(",") if w.strip()]
    if any(w < 1 for w in args.widths):
        p.error("--widths must be >= 1")
    if args.rounds < 1 or args.prompts < 1 or args.max_tokens < 1:
        p.error("--rounds, --prompts and --max-tokens must be >= 1")
    return args


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the model ---------------------------------------------------------------------------------------


def build_model(directory: Path, args) -> Path:
    """A random llama of the default's vocabulary, tokenizer, embedding tying and RoPE, with the given
    depth and width, saved with the default's tokenizer and a mars.json into `directory`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mars.checkpoint.default_model import default_model_dir
    from mars.checkpoint.hf_config import add_rope_keys
    from mars.core.config import MarsConfig, write_config

    source = default_model_dir(announce=say)
    base = json.loads((source / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=base["max_position_embeddings"],
        rms_norm_eps=base["rms_norm_eps"],
        rope_parameters=base["rope_parameters"],
        tie_word_embeddings=True,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["pad_token_id"],
        initializer_range=args.init_std,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(directory))
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.save_pretrained(str(directory))
    add_rope_keys(directory)  # mlx-lm reads rope_theta, as the default's own cached config carries it
    mask_token = tokenizer.convert_ids_to_tokens(MASK_ID)
    write_config(
        MarsConfig(
            block_size=BLOCK_SIZE,
            mask_token=mask_token,
            mask_token_id=MASK_ID,
            default_threshold=0.95,
            default_mode="lossless",
        ),
        directory,
    )
    return directory


# -- widths ------------------------------------------------------------------------------------------


def fixed_feed(width: int) -> tuple[int, int, int]:
    """(block size B, hedge, the width a step feeds) of the fixed lossless feed nearest `width` (ties: the
    narrower): 1 + B (2 + hedge) tokens a step while each step's drafts fail before the hedge-th
    (mars.core.decode.layout.lossless_width with B drafts and min(hedge, B) spare groups)."""
    options = sorted(
        ((abs(1 + b * (2 + h) - width), 1 + b * (2 + h), -h, b) for b in range(1, width + 1) for h in range(1, b + 1)),
    )
    _, fed, h, b = options[0]
    return b, -h, fed


# -- runners ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One decode of every prompt: the ids produced per prompt, the forwards, and the tokens fed."""

    tokens: list[list[int]] | None
    forwards: int
    fed_tokens: int | None = None

    @property
    def produced(self) -> int:
        return sum(len(t) for t in self.tokens) if self.tokens is not None else 0


@dataclass
class Runner:
    name: str
    run: Callable[[list[list[int]]], Run]
    width: float | None = 1  # tokens fed a decoding step
    peer: bool = False  # a cost probe (hf_forward_w): ms per forward only, no reply
    info: dict = field(default_factory=dict)
    warmup: Callable[[list[list[int]]], Run] | None = None  # the untimed first run, where it differs


class StepWidths:
    """A decoder (StepBackend) whose steps' widths are recorded: every other call goes through."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.widths: list[int] = []

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def step(self, cache, ids, *args, **kwargs):
        self.widths.append(len(ids[0]))  # arrays or lists of rows (the decoder `takes_rows`)
        return self._decoder.step(cache, ids, *args, **kwargs)


def mars_runner(name: str, session, plan, controller=None, info: dict | None = None) -> Runner:
    from mars.session import decode_batches

    def run(ids):
        decoded = decode_batches(session.decoder, ids, plan, 1, controller=controller)
        total = decoded.total
        return Run(decoded.tokens, total.forwards, total.fed_tokens)

    runner = Runner(name, run, info=dict(info or {}, plan=plan.name, block_size=plan.block_size))

    def warmup(ids):
        probe = StepWidths(session.decoder)
        decoded = decode_batches(probe, ids, plan, 1, controller=controller)
        total = decoded.total
        # One batch a prompt: its first step feeds the prompt (and the masks), its decoding steps follow.
        decoding, start = [], 0
        for stats in decoded.stats:
            decoding += probe.widths[start + 1 : start + stats.forwards]
            start += stats.forwards
        counts: dict[int, int] = {}
        for w in decoding:
            counts[w] = counts.get(w, 0) + 1
        runner.info.update(
            fed_tokens_per_forward=round(total.fed_tokens / max(total.forwards, 1), 3),
            decoding_step_widths=dict(sorted(counts.items())),
            mean_decoding_width=round(statistics.fmean(decoding), 3) if decoding else None,
        )
        if decoding:
            runner.width = runner.info["mean_decoding_width"]
        return Run(decoded.tokens, total.forwards, total.fed_tokens)

    runner.warmup = warmup
    return runner


def mars_session(model_dir: Path, backend: str, compile: bool = False):
    from mars.session import Session

    kwargs = dict(dtype="float32", device="cpu", compile=compile) if backend == "torch" else dict(compile=compile)
    return Session(str(model_dir), backend=backend, announce=say, **kwargs)


def mars_runners(session, args, prefix: str = "mars") -> list[Runner]:
    """{prefix}_ar and, for the torch backend (prefix mars, or mars_compiled for the steps under
    torch.compile), {prefix}_lossless_w{W} per width."""
    from mars.core.decode.cost import CostCurve
    from mars.core.decode.feed import FeedController

    no_drafts = dict(ngram=0, alternatives=0, tree=0)
    runners = [mars_runner(f"{prefix}_ar", session, session.plan(threshold=1.0, max_tokens=args.max_tokens))]
    if prefix not in ("mars", "mars_compiled"):
        return runners
    for w in args.widths:
        if w == 1:
            # The cost-aware feed over a curve on which any second token costs a second: it feeds no mask.
            controller = FeedController(CostCurve({1: 1e-6, 2: 1.0}, refresh=0.0), explore=10**9)
            plan = session.plan(lossless=True, feed="auto", max_tokens=args.max_tokens, **no_drafts)
            info = dict(feed="auto, on a cost curve where masks never pay", asked_width=w, expected_width=1)
            runners.append(mars_runner(f"{prefix}_lossless_w{w}", session, plan, controller, info))
            continue
        b, hedge, fed = fixed_feed(w)
        plan = session.plan(
            lossless=True, feed="fixed", block_size=b, hedge=hedge, max_tokens=args.max_tokens, **no_drafts
        )
        info = dict(feed="fixed", hedge=hedge, asked_width=w, expected_width=fed)
        if fed != w:
            info["note"] = f"no fixed feed steps {w} wide; the nearest, {fed}, runs"
        runners.append(mars_runner(f"{prefix}_lossless_w{w}", session, plan, None, info))
    return runners


def hf_runners(model, eos: set[int], args) -> dict[str, Runner]:
    """hf_generate and hf_loop on a transformers model (float32, CPU)."""
    import torch
    from transformers import DynamicCache

    n = args.max_tokens

    @torch.inference_mode()
    def generate(ids):
        out, forwards = [], 0
        for p in ids:
            x = torch.tensor([p])
            new = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                num_beams=1,
                max_new_tokens=n,
                eos_token_id=sorted(eos),
                pad_token_id=min(eos),
            )[0, len(p) :].tolist()
            row = []
            for t in new:  # generate pads a row that ended early in a batch; here, one row, none
                row.append(t)
                if t in eos:
                    break
            out.append(row)
            forwards += len(row)
        return Run(out, forwards)

    @torch.inference_mode()
    def loop(ids):
        out, forwards = [], 0
        for p in ids:
            cache = DynamicCache(config=model.config)
            logits = model(input_ids=torch.tensor([p]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            row = [token]
            while token not in eos and len(row) < n:
                logits = model(
                    input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
                token = int(logits[0, -1].argmax())
                row.append(token)
            out.append(row)
            forwards += len(row)
        return Run(out, forwards)

    return {"hf_generate": Runner("hf_generate", generate), "hf_loop": Runner("hf_loop", loop)}


def hf_forward_runner(name: str, model, width: int, replies: list[list[int]], asked: int) -> Runner:
    """The prompt's forward, then at each cached length of the AR `replies` a forward of `width` tokens (the
    next AR token, then masks) and a crop back to one token more: what mars's lossless step costs without mars."""
    import torch
    from transformers import DynamicCache

    @torch.inference_mode()
    def run(ids):
        forwards = 0
        for p, reply in zip(ids, replies):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([p]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            forwards += 1
            for i in range(len(reply) - 1):
                fed = torch.full((1, width), MASK_ID, dtype=torch.long)
                fed[0, 0] = reply[i]
                model(input_ids=fed, past_key_values=cache, use_cache=True)
                cache.crop(1 - width)  # the tokens after the first go (transformers 5: a negative count)
                forwards += 1
        return Run(None, forwards)

    return Runner(name, run, width=width, peer=True, info=dict(asked_width=asked, width=width))


def static_forward_runner(
    name: str, model, width: int, replies: list[list[int]], asked: int, longest_prompt: int
) -> Runner:
    """hf_forward_w's steps on transformers' own compiled path: the model on a `StaticCache`, the prompt's
    forward eager, then at each cached length of the AR `replies` a forward of `width` tokens (the next AR
    token, then masks) under `torch.compile` (one graph: the width is fixed, the positions are a tensor);
    each step's layers are then set back to one token more (transformers 5's static layers write at their
    own `cumulative_length`, not at `cache_position`: left to run on, they wrote past the cache's end), so
    the next step writes over the masks' keys, which the causal mask hides meanwhile. In the warm-up each
    step's first output must be the AR reply's next token (`ar_agreement`: the share that was)."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=longest_prompt + max(map(len, replies)) + width + 1)

    def forward(fed, position):
        return model(
            input_ids=fed, position_ids=position.unsqueeze(0), cache_position=position, past_key_values=cache
        ).logits

    step = torch.compile(forward, dynamic=False)
    info: dict = dict(asked_width=asked, width=width)

    @torch.inference_mode()
    def run(ids, first=None):
        forwards, agree, steps = 0, 0, 0
        for p, reply in zip(ids, replies):
            cache.reset()
            model(
                input_ids=torch.tensor([p]),
                cache_position=torch.arange(len(p)),
                past_key_values=cache,
                logits_to_keep=1,
            )
            forwards += 1
            for i in range(len(reply) - 1):
                fed = torch.full((1, width), MASK_ID, dtype=torch.long)
                fed[0, 0] = reply[i]
                t0 = time.perf_counter()
                logits = step(fed, len(p) + i + torch.arange(width))
                if first is not None and not first:
                    first.append(time.perf_counter() - t0)
                for layer in getattr(cache, "layers", ()):  # back to the cached length and the AR token
                    count = getattr(layer, "cumulative_length", None)
                    if isinstance(count, torch.Tensor):
                        count.fill_(len(p) + i + 1)
                    elif count is not None:
                        layer.cumulative_length = len(p) + i + 1
                if first is not None:
                    agree += int(logits[0, 0].argmax()) == reply[i + 1]
                    steps += 1
                forwards += 1
        if first is not None:
            info.update(ar_agreement=round(agree / max(steps, 1), 4))
        return Run(None, forwards)

    runner = Runner(name, run, width=width, peer=True, info=info)

    def warmup(ids):
        first: list[float] = []
        out = run(ids, first)
        info.update(compile_s=round(first[0], 3) if first else None)
        return out

    runner.warmup = warmup
    return runner


def static_compiled_runner(model, eos: set[int], args, longest_prompt: int) -> Runner:
    """gpt-fast's loop on transformers: a StaticCache, the prompt's forward eager, then a compiled one-token
    step (forward and argmax) per token."""
    import torch
    from transformers import StaticCache

    n = args.max_tokens
    cache = StaticCache(config=model.config, max_cache_len=longest_prompt + n + 1)

    def one_token(token, position):
        logits = model(
            input_ids=token,
            position_ids=position.unsqueeze(0),
            cache_position=position,
            past_key_values=cache,
            use_cache=True,
        ).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(one_token, dynamic=False)
    info: dict = {}

    @torch.no_grad()
    def run(ids, first=None):
        out, forwards = [], 0
        for p in ids:
            cache.reset()
            logits = model(
                input_ids=torch.tensor([p]),
                cache_position=torch.arange(len(p)),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            row = [int(token)]
            position = torch.tensor([len(p)])
            while row[-1] not in eos and len(row) < n:
                t0 = time.perf_counter()
                token = step(token, position)
                row.append(int(token))
                if first is not None and not first:
                    first.append(time.perf_counter() - t0)
                position += 1
            out.append(row)
            forwards += len(row)
        return Run(out, forwards)

    runner = Runner("hf_static_compiled", run, info=info)

    def warmup(ids):
        first: list[float] = []
        t0 = time.perf_counter()
        out = run(ids, first)
        info.update(compile_s=round(first[0], 3) if first else None, warmup_s=round(time.perf_counter() - t0, 3))
        return out

    runner.warmup = warmup
    return runner


def mlx_runners(model_dir: Path, work: Path, args, eos: set[int]):
    """mars_mlx_ar, mars_mlx_compiled_ar and mlx_lm_stream_generate on the weights converted by `mars
    convert --to mlx`, and the compiled session's step (its traces are counted)."""
    from mlx_lm import load as mlx_load
    from mlx_lm import stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mars.convert.models import convert_model

    mlx_dir = convert_model(model_dir, work / "mlx", "mlx", announce=say)
    session = mars_session(mlx_dir, "mlx")
    runners = mars_runners(session, args, prefix="mars_mlx")
    compiled = mars_session(mlx_dir, "mlx", compile=True)  # mx.compile (mlx.compiled.CompiledMlxStep)
    runners += mars_runners(compiled, args, prefix="mars_mlx_compiled")
    model, _ = mlx_load(str(mlx_dir))
    tokenizer = TokenizerWrapper(session.tokenizer, eos_token_ids=sorted(eos))

    def run(ids):
        out = []
        for p in ids:
            row = []
            for r in stream_generate(model, tokenizer, p, max_tokens=args.max_tokens):
                row.append(int(r.token))
                if row[-1] in eos:
                    break
            out.append(row)
        return Run(out, sum(len(r) for r in out))

    runners.append(Runner("mlx_lm_stream_generate", run))
    return runners, compiled.decoder.compiled


# -- measuring -------------------------------------------------------------------------------------


def timed(runner: Runner, ids) -> tuple[Run, float]:
    t0 = time.perf_counter()
    out = runner.run(ids)
    return out, time.perf_counter() - t0


def median(values):
    return statistics.median(values) if values else None


def summarise(runner: Runner, first: Run, rounds: list[tuple[Run, float]]) -> dict:
    seconds = [s for _, s in rounds]
    ms_step = [1000 * s / max(r.forwards, 1) for r, s in rounds]
    ms_token = [1000 * s / r.produced for r, s in rounds] if not runner.peer else []
    row = {
        "width": runner.width,
        "forwards": first.forwards,
        "tokens": None if runner.peer else first.produced,
        "tokens_per_forward": None if runner.peer else round(first.produced / max(first.forwards, 1), 4),
        "seconds": [round(s, 4) for s in seconds],
        "ms_per_step": [round(v, 4) for v in ms_step],
        "ms_per_token": [round(v, 4) for v in ms_token] or None,
        "median_ms_per_step": round(median(ms_step), 4),
        "median_ms_per_token": round(median(ms_token), 4) if ms_token else None,
        # Greedy decoding: every round must produce what the warm-up did.
        "same_every_round": all(r.tokens == first.tokens and r.forwards == first.forwards for r, _ in rounds),
    }
    row.update(runner.info)
    return row


def ratio_rounds(numerators: list[float], denominators: list[float]) -> list[float]:
    return [round(a / b, 4) for a, b in zip(numerators, denominators)]


def cpu_name() -> str:
    try:
        from mars.backends.torch.decode import cpu_name as name

        return name()
    except Exception:  # noqa: BLE001 (a name for the report only)
        return platform.processor() or platform.machine()


def commit() -> str | None:
    """The checkout's commit, "+changes" where tracked files differ: step_parts.py's own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_parts", Path(__file__).with_name("step_parts.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.commit()


def load_average() -> list[float] | None:
    """1, 5 and 15 minutes: a shared machine shows here."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine(args) -> dict:
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if args.mlx:
        try:
            import mlx.core as mx
            import mlx_lm

            info.update(mlx=getattr(mx, "__version__", ""), mlx_lm=getattr(mlx_lm, "__version__", ""))
        except ImportError:
            pass
    return info


def projection(rows: dict, path: Path) -> dict | None:
    """What the default model's tokens per forward on a flat curve (a kept `trees.py --flat` run: each
    mode's tokens per forward and mean fed tokens per forward) would give at this run's measured step
    costs (mars's compiled lossless steps, else its eager ones, ms per step by fed width, interpolated,
    linear past the widest): a projection, never a measurement. None without a kept run."""
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    modes = [r for r in kept.get("flat_curve", []) if r.get("fed_tokens_per_forward")]
    prefix = "mars_compiled" if "mars_compiled_ar" in rows else "mars"
    points = sorted(
        (r["width"], r["median_ms_per_step"])
        for name, r in rows.items()
        if (name == f"{prefix}_ar" or name.startswith(f"{prefix}_lossless_w")) and r["width"]
    )
    by_width = dict(points)  # one cost per fed width (AR and a width-1 lossless step share one)
    if not modes or len(by_width) < 2:
        return None  # a line needs two widths
    ws, ms = list(by_width), list(by_width.values())

    def step_ms(width: float) -> float:
        if width <= ws[-1]:
            return ms[0] if width <= ws[0] else _interp(width, ws, ms)
        return ms[-1] + (ms[-1] - ms[-2]) / (ws[-1] - ws[-2]) * (width - ws[-1])

    ar = rows[f"{prefix}_ar"]["median_ms_per_token"]
    out = {
        "label": "projection, not a measurement: kept tokens per forward at this run's step costs",
        "from": str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve().is_relative_to(ROOT) else str(path),
        "step_costs": f"{prefix} (ms per step by fed width)",
        "modes": {},
    }
    for r in modes:
        width, tpf = r["fed_tokens_per_forward"], r["tokens_per_forward"]
        ms_token = step_ms(width) / tpf
        out["modes"][r["mode"]] = {
            "tokens_per_forward": tpf,
            "fed_tokens_per_forward": width,
            "extrapolated": width > ws[-1],
            "projected_ms_per_token": round(ms_token, 4),
            f"projected_vs_{prefix}_ar": round(ar / ms_token, 4),
        }
    return out


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return ys[-1]


def table(report: dict) -> str:
    runners = report["runners"]
    lines = [f"{'runner':<24} {'width':>6} {'ms/step':>8} {'ms/token':>9} {'tok/fwd':>7} {'x hf_loop':>9}"]
    for name, r in runners.items():
        width = "-" if r["width"] is None else f"{r['width']:g}"
        ms_token = "-" if r["median_ms_per_token"] is None else f"{r['median_ms_per_token']:9.3f}"
        per_fwd = "-" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:7.2f}"
        ratio = r.get("tokens_per_s_vs_hf_loop")
        lines.append(
            f"{name:<24} {width:>6} {r['median_ms_per_step']:8.3f} {ms_token:>9} {per_fwd:>7} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>9}"
        )
    lines.append(f"ar_equal: {report['ar_equal']}")
    for key, value in report["ratios"].items():
        lines.append(f"{key}: {value:.3f}")
    proj = report.get("projection")
    if proj:
        lines.append(f"{proj['label']} ({proj['from']}; {proj['step_costs']}):")
        for mode, m in proj["modes"].items():
            ratio = next(v for k, v in m.items() if k.startswith("projected_vs_"))
            lines.append(
                f"  {mode:<22} {m['tokens_per_forward']:.3f} tok/fwd, {m['fed_tokens_per_forward']:g} fed: "
                f"{m['projected_ms_per_token']:.3f} ms/token, {ratio:.2f}x AR"
                + (" (width extrapolated)" if m["extrapolated"] else "")
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse(argv if argv is not None else sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from mars.cli.common import quiet_libraries
    from mars.core.files import atomic_write_text
    from mars.prompts import read_prompts

    quiet_libraries()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = load_average()
    mlx = False
    if args.mlx:
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401

            mlx = True
        except ImportError:
            say("--mlx: mlx or mlx_lm does not import here; the MLX runners are left out")

    with tempfile.TemporaryDirectory(prefix="mars_overhead_") as tmp:
        work = Path(tmp)
        model_dir = build_model(work / "model", args)
        session = mars_session(model_dir, "torch")
        eos = set(session.loaded.eos_ids)
        ids = session.encode(read_prompts(Path(args.prompt_file))[: args.prompts])
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
        hf = hf.eval()
        vocab = hf.config.vocab_size

        runners = mars_runners(session, args) + list(hf_runners(hf, eos, args).values())
        compiled_session = None
        if not args.no_compile:  # mars's steps under torch.compile (compiled during their warm-up)
            compiled_session = mars_session(model_dir, "torch", compile=True)
            runners += mars_runners(compiled_session, args, prefix="mars_compiled")
        if args.fixed and not args.no_compile:  # the fixed-shape graph (CUDA's) on this CPU, AR
            from mars.backends.torch.decode import TorchDecoder

            fixed_session = mars_session(model_dir, "torch")
            fixed_session.decoder = TorchDecoder(fixed_session.loaded, compile=True, fixed=True)
            runners += mars_runners(fixed_session, args, prefix="mars_fixed")
        # The warm-up of the AR runners first: the peers replay hf_loop's replies.
        first: dict[str, Run] = {}
        for r in runners:
            say(f"warm-up: {r.name}")
            first[r.name] = (r.warmup or r.run)(ids)
        replies = first["hf_loop"].tokens
        by_width = {}
        for r in runners:
            if r.name.startswith("mars_lossless_w"):  # (the compiled runners feed the same widths)
                fed = r.info.get("decoding_step_widths") or {}
                # The peer feeds the width mars's steps fed most (its steady width), not the one asked.
                by_width[r.info["asked_width"]] = max(fed, key=fed.get) if fed else r.info["expected_width"]
        extra = [hf_forward_runner(f"hf_forward_w{w}", hf, fed, replies, w) for w, fed in by_width.items()]
        if not args.no_compile:
            longest = max(len(p) for p in ids)
            extra.append(static_compiled_runner(hf, eos, args, longest))
            extra += [  # the compiled peer of mars's compiled lossless steps
                static_forward_runner(f"hf_static_forward_w{w}", hf, fed, replies, w, longest)
                for w, fed in by_width.items()
                if fed > 1
            ]
        mlx_step = None
        if mlx:
            mlx_extra, mlx_step = mlx_runners(model_dir, work, args, eos)
            extra += mlx_extra
        failed: dict[str, str] = {}
        for r in extra:
            say(f"warm-up: {r.name}")
            try:
                first[r.name] = (r.warmup or r.run)(ids)
            except RuntimeError as e:  # transformers' compiled multi-token static step fails here (see the JSON)
                if not r.name.startswith("hf_static_forward_w"):
                    raise
                failed[r.name] = str(e).strip().splitlines()[-1][:300]
                say(f"{r.name}: failed ({failed[r.name]}); left out")
        runners += [r for r in extra if r.name not in failed]

        graphs = {"after_warmup": compiled_session.decoder.compiled.compiles} if compiled_session else None
        mlx_graphs = {"after_warmup": mlx_step.traces, "ahead_taken": mlx_step.ahead} if mlx_step else None
        results: dict[str, list[tuple[Run, float]]] = {r.name: [] for r in runners}
        for rnd in range(args.rounds):
            order = runners if rnd % 2 == 0 else runners[::-1]
            say(f"round {rnd + 1}/{args.rounds}")
            for r in order:
                results[r.name].append(timed(r, ids))
        if compiled_session is not None:  # no graph compiled after the warm-up
            graphs["after_rounds"] = compiled_session.decoder.compiled.compiles
        if mlx_step is not None:
            mlx_graphs["after_rounds"] = mlx_step.traces

    rows = {r.name: summarise(r, first[r.name], results[r.name]) for r in runners}
    loop_ms = rows["hf_loop"]["median_ms_per_token"]
    for row in rows.values():
        if row["median_ms_per_token"]:
            row["tokens_per_s_vs_hf_loop"] = round(loop_ms / row["median_ms_per_token"], 4)
    ar = first["mars_ar"].tokens
    ratios = {"mars_ar_vs_hf_loop": rows["hf_loop"]["median_ms_per_token"] / rows["mars_ar"]["median_ms_per_token"]}
    for w in args.widths:
        ours, peer = rows[f"mars_lossless_w{w}"], rows[f"hf_forward_w{w}"]
        ratios[f"lossless_w{w}_vs_hf_forward_w{w}"] = ours["median_ms_per_step"] / peer["median_ms_per_step"]
    # The same ratios within each round (drift between rounds cancels), for their spread.
    per_round = {"mars_ar_vs_hf_loop": ratio_rounds(rows["hf_loop"]["ms_per_token"], rows["mars_ar"]["ms_per_token"])}
    for w in args.widths:
        per_round[f"lossless_w{w}_vs_hf_forward_w{w}"] = ratio_rounds(
            rows[f"mars_lossless_w{w}"]["ms_per_step"], rows[f"hf_forward_w{w}"]["ms_per_step"]
        )
    compiled = "mars_compiled_ar" in rows
    if compiled:
        ratios["mars_compiled_ar_vs_mars_ar"] = (
            rows["mars_ar"]["median_ms_per_token"] / rows["mars_compiled_ar"]["median_ms_per_token"]
        )
        per_round["mars_compiled_ar_vs_mars_ar"] = ratio_rounds(
            rows["mars_ar"]["ms_per_token"], rows["mars_compiled_ar"]["ms_per_token"]
        )
        static = rows["hf_static_compiled"]["median_ms_per_token"]
        ratios["mars_compiled_ar_vs_hf_static_compiled"] = static / rows["mars_compiled_ar"]["median_ms_per_token"]
        per_round["mars_compiled_ar_vs_hf_static_compiled"] = ratio_rounds(
            rows["hf_static_compiled"]["ms_per_token"], rows["mars_compiled_ar"]["ms_per_token"]
        )
        for w in args.widths:
            ours, peer = rows[f"mars_compiled_lossless_w{w}"], rows[f"hf_forward_w{w}"]
            ratios[f"compiled_lossless_w{w}_vs_hf_forward_w{w}"] = (
                ours["median_ms_per_step"] / peer["median_ms_per_step"]
            )
            static = rows.get(f"hf_static_forward_w{w}")
            if static is not None:  # against transformers' compiled forward of the same width
                key = f"compiled_lossless_w{w}_vs_hf_static_forward_w{w}"
                ratios[key] = ours["median_ms_per_step"] / static["median_ms_per_step"]
                per_round[key] = ratio_rounds(ours["ms_per_step"], static["ms_per_step"])
    checks = {
        "ar_equal": ar == first["hf_loop"].tokens == first["hf_generate"].tokens,
        "lossless_equal_ar": {f"w{w}": first[f"mars_lossless_w{w}"].tokens == ar for w in args.widths},
    }
    if compiled:
        checks["compiled_equal_eager"] = {
            name: first[f"mars_compiled_{name}"].tokens == first[f"mars_{name}"].tokens
            for name in ["ar"] + [f"lossless_w{w}" for w in args.widths]
        }
        checks["compiled_graphs"] = graphs
        checks["peers_failed"] = failed
    if "mars_fixed_ar" in rows:
        ratios["mars_fixed_ar_vs_mars_compiled_ar"] = (
            rows["mars_compiled_ar"]["median_ms_per_token"] / rows["mars_fixed_ar"]["median_ms_per_token"]
        )
        per_round["mars_fixed_ar_vs_mars_compiled_ar"] = ratio_rounds(
            rows["mars_compiled_ar"]["ms_per_token"], rows["mars_fixed_ar"]["ms_per_token"]
        )
        checks["fixed_equal_eager"] = first["mars_fixed_ar"].tokens == ar
    if "hf_static_compiled" in first:
        checks["static_compiled_equal_hf_loop"] = first["hf_static_compiled"].tokens == first["hf_loop"].tokens
    if "mars_mlx_ar" in first:
        checks["mars_mlx_ar_equal_mars_ar"] = first["mars_mlx_ar"].tokens == ar
        checks["mlx_lm_equal_mars_mlx_ar"] = first["mlx_lm_stream_generate"].tokens == first["mars_mlx_ar"].tokens
        checks["mlx_compiled_equal_eager"] = first["mars_mlx_compiled_ar"].tokens == first["mars_mlx_ar"].tokens
        checks["mlx_compiled_graphs"] = mlx_graphs
        peer = rows["mlx_lm_stream_generate"]["ms_per_token"]
        for name in ("mars_mlx_ar", "mars_mlx_compiled_ar"):
            key = f"{name}_vs_mlx_lm_stream_generate"
            ratios[key] = rows["mlx_lm_stream_generate"]["median_ms_per_token"] / rows[name]["median_ms_per_token"]
            per_round[key] = ratio_rounds(peer, rows[name]["ms_per_token"])
        key = "mars_mlx_compiled_ar_vs_mars_mlx_ar"
        ratios[key] = rows["mars_mlx_ar"]["median_ms_per_token"] / rows["mars_mlx_compiled_ar"]["median_ms_per_token"]
        per_round[key] = ratio_rounds(rows["mars_mlx_ar"]["ms_per_token"], rows["mars_mlx_compiled_ar"]["ms_per_token"])
    info = dict(machine(args), load_average_before=load_before, load_average_after=load_average())
    report = {
        "benchmark": "overhead",
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "machine": info,
        "settings": {
            "prompts": args.prompts,
            "prompt_file": str(Path(args.prompt_file).resolve().relative_to(ROOT))
            if Path(args.prompt_file).resolve().is_relative_to(ROOT)
            else args.prompt_file,
            "prompt_lengths": [len(p) for p in ids],
            "max_tokens": args.max_tokens,
            "widths": args.widths,
            "rounds": args.rounds,
            "batch": 1,
            "greedy": True,
            "dtype": "float32",
            "device": "cpu",
            "compile": not args.no_compile,
            "mlx": mlx,
            "quick": args.quick,
            "model": {
                "architecture": "LlamaForCausalLM (random)",
                "layers": args.layers,
                "hidden": args.hidden,
                "intermediate": args.intermediate,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "vocab": vocab,
                "tied_embeddings": True,
                "seed": args.seed,
                "mask_token_id": MASK_ID,
                "block_size": BLOCK_SIZE,
            },
        },
        **checks,
        "ratios": {k: round(v, 4) for k, v in ratios.items()},
        "ratios_per_round": per_round,
        "runners": rows,
        "projection": projection(rows, Path(args.projection_from)),
    }
    if args.output:
        out = Path(args.output)
    else:
        backend = "torch+mlx" if mlx else "torch"
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = ROOT / "benchmarks" / "results" / f"overhead_{backend}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
