"""A model opened for decoding: what `mars generate`, `mars chat`, `mars serve`, `mars distill`,
eval and bench share.

`Session` loads a model through the backend contract (mars.backends.base) (or takes one
already loaded: `Session.from_loaded`), makes its decoder (and more over the same weights:
`new_decoder`, one per served batch), takes the plan of a request from its checkpoint plus
what was asked (mars.core.decode.plan), owns the model's feed controller (`controller`,
mars.core.decode.feed: the per-forward cost curves and the feed policies that learn across
calls), and decodes prompts in batches (`decode_batches`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .backends import base
from .core.decode.feed import FeedController
from .core.decode.loop import generate
from .core.decode.plan import Plan
from .core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM, block_size_for
from .core.decode.types import DecodeStats, TokenLogprob
from .core.tokens import encode_prompt


@dataclass
class Decoded:
    """Prompts decoded in batches: tokens and finish per prompt, each batch's statistics, wall time."""

    tokens: list[list[int]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    stats: list[DecodeStats] = field(default_factory=list)
    seconds: float = 0.0
    logprobs: list[list[TokenLogprob]] | None = None  # per prompt and token, where the plan asked for them

    @property
    def total(self) -> DecodeStats:
        """The batches' statistics as one: every prompt's RowStats in prompt order, forwards,
        fed tokens, threshold mode's masks fed and the feed's choices summed; `cache` the
        strategies that ran, comma-separated where they differ."""
        ran = sorted({s.cache for s in self.stats if s.cache})
        fed: dict[int, int] = {}
        chosen: dict[tuple[int, int], int] = {}
        for s in self.stats:
            for m, n in s.masks_fed.items():
                fed[m] = fed.get(m, 0) + n
            for c, n in s.feed_choices.items():
                chosen[c] = chosen.get(c, 0) + n
        # The drafting statistics as they stood after the last batch (a kept policy's grow from call to call).
        last = self.stats[-1] if self.stats else DecodeStats(rows=[])
        return DecodeStats(
            rows=[row for s in self.stats for row in s.rows],
            forwards=sum(s.forwards for s in self.stats),
            fed_tokens=sum(s.fed_tokens for s in self.stats),
            cache=",".join(ran) or None,
            masks_fed=dict(sorted(fed.items())),
            feed_choices=dict(sorted(chosen.items())),
            draft_reached=last.draft_reached,
            draft_kept=last.draft_kept,
        )


def decode_batches(
    decoder,
    ids: list[list[int]],
    settings: Plan,
    batch_size: int = 8,
    *,
    controller: FeedController | None = None,
) -> Decoded:
    """Decode every prompt (token ids) in batches of `batch_size`, the feed chosen by `controller`."""
    out = Decoded()
    t0 = time.perf_counter()
    for start in range(0, len(ids), batch_size):
        result = generate(decoder, ids[start : start + batch_size], settings, controller=controller)
        out.tokens += result.tokens
        out.finish += result.finish
        out.stats.append(result.stats)
        if result.logprobs is not None:
            out.logprobs = (out.logprobs or []) + result.logprobs
    out.seconds = time.perf_counter() - t0
    return out


def token_logprobs(tokenizer, tokens: list[int], entries: list[TokenLogprob]) -> list[dict]:
    """Each generated token's log-probability and its place's most likely ids, as the OpenAI API
    spells them in chat: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}."""

    def one(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(t, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]} for t, e in zip(tokens, entries)]


# What Session's `compile` accepts (the command line's --compile takes the strings).
COMPILE_SETTINGS = (True, False, "on", "off", "auto")


def compiles(setting: bool | str, loaded) -> bool:
    """Whether a session with `compile=setting` over `loaded` runs compiled steps: on or off as
    asked, and "auto" where compiling pays without a measurement: CUDA (torch) and Apple silicon's
    GPU (MLX). On a CPU it paid for a deep, narrow model and not for the default one
    (benchmarks/README.md, "Per-step overhead"): there "auto" asks the kept cost curves once the
    decoder is built (Session, base.compiled_pays)."""
    if setting in (False, "off"):
        return False
    if setting in (True, "on"):
        return True
    if loaded.backend == "mlx":
        import mlx.core as mx

        return mx.default_device() == mx.gpu
    return getattr(getattr(loaded, "device", None), "type", None) == "cuda"


class Session:
    """A loaded model (`loaded`: what the backend's load returned), its decoder, and what its
    decoding keeps between calls. `label` names it in reports (`mars eval`): the model as
    given, or "default" for the embedded one."""

    def __init__(
        self,
        model=None,
        adapter_path=None,
        *,
        backend: str = "auto",
        dtype=None,
        device=None,
        announce=print,
        remeasure_cost: bool = False,
        label: str | None = None,
        compile: bool | str = False,
    ):
        """`compile` (True or "on", False or "off", "auto"; `Session.compile` says what was chosen):
        the torch backend runs its steps through `torch.compile` (mars's own forward,
        models.CompiledStep), the MLX backend through `mx.compile` (mlx.compiled.CompiledMlxStep);
        architectures without that path run eager. "auto" compiles on CUDA and on Apple silicon's
        GPU, and a step that fails to compile or run there gives way to eager steps, saying why.
        The replies are the same either way."""
        if compile not in COMPILE_SETTINGS:
            raise TypeError(f"compile={compile!r}: True, False, 'on', 'off' or 'auto'")
        name = base.resolve(backend)
        loaded = base.load(name, model, adapter_path=adapter_path, dtype=dtype, device=device, announce=announce)
        self.compile = compiles(compile, loaded)
        # Under "auto" a compiled step that fails gives way to eager ones, saying why; asked
        # for ("on"), its error stops the call.
        self.compile_fallback = announce if compile == "auto" else None
        auto = compile == "auto" and not self.compile and name == "torch"
        if self.compile and name == "mlx":
            announce("compiling the decoding step (mx.compile) as it first runs: a graph per kind of step, in seconds")
        elif self.compile:
            announce(
                "compiling the decoding step (torch.compile) as it first runs: a graph per kind of step (one "
                "row or several, one token or more), seconds each for a small model, 6-15 minutes for the "
                "default model on a 2-core CPU the first time; inductor keeps its work under the cache directory"
            )
        self._open(
            loaded,
            name,
            None,
            announce=announce,
            remeasure_cost=remeasure_cost,
            label=label or (str(model) if model is not None else "default"),
        )
        verdict = base.compiled_pays(loaded, self.decoder) if auto else None
        if verdict is not None and verdict[0]:  # a CPU where kept measurements say compiling pays
            announce(f"compiling the decoding step (torch.compile): the kept cost curves say it pays ({verdict[1]})")
            self.compile = True
            self.decoder = self.new_decoder()

    @classmethod
    def from_loaded(
        cls, loaded, decoder_cls=None, *, announce=print, remeasure_cost: bool = False, label: str = "default"
    ) -> Session:
        """A session over a model already loaded (what a backend's load returned); its decoders
        are `decoder_cls(loaded)`, by default the backend's (mars.backends.base.decoder)."""
        session = cls.__new__(cls)
        session.compile = False
        session.compile_fallback = None
        session._open(
            loaded, loaded.backend, decoder_cls, announce=announce, remeasure_cost=remeasure_cost, label=label
        )
        return session

    def _open(self, loaded, backend: str, decoder_cls, *, announce, remeasure_cost: bool, label: str) -> None:
        self.backend = backend
        self.label = label
        self.announce = announce
        self.remeasure_cost = remeasure_cost  # measure the cost curves again instead of reading the kept ones
        self.loaded = loaded
        self._decoder_cls = decoder_cls
        self.decoder = self.new_decoder()
        # What a forward costs here, measured (or read from the cache directory) when a plan
        # first needs it, and the lossless feeds that learn across calls.
        self.controller = FeedController(measure=self._measured_costs)

    def new_decoder(self):
        """Another decoding step (StepBackend) over the same weights, with a cache of its own."""
        if self._decoder_cls is not None:
            return self._decoder_cls(self.loaded)
        return base.decoder(self.loaded, compile=self.compile, on_compile_error=self.compile_fallback)

    @property
    def mars(self):
        """The checkpoint's MarsConfig, None for a model without mars.json."""
        return self.loaded.mars

    @property
    def trained(self) -> bool:
        """MARS-trained (has mars.json): may decode below AR mode."""
        return self.loaded.mars is not None

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int | None:
        """The model's position limit, when its config states one."""
        return base.context_length(self.loaded)

    def mask_id(self) -> int:
        """The checkpoint's mask token; for a plain model, the token fine-tuning would pick."""
        return base.mask_id_for(self.loaded)

    def block_size(self, override: int | None = None) -> int:
        """Masks per step: `override`, else the checkpoint's (mars.core.decode.rules.block_size_for)."""
        return block_size_for(self.mars, override)

    def plan(self, **asked) -> Plan:
        """The plan a request decodes by: the checkpoint's defaults plus `asked`
        (mars.core.decode.plan.make_plan), with the draft sources `mars generate` takes by
        default (n-gram lookup, runner-up groups) unless `asked` names them."""
        if "drafts" not in asked:
            asked.setdefault("ngram", DEFAULT_NGRAM)
            asked.setdefault("alternatives", DEFAULT_ALTERNATIVES)
        return base.plan_for_model(self.loaded, **asked)

    def prepare_feed(self, settings: Plan, batch: int = 1) -> None:
        """Measure now (once per device, mars.backends.base.cost_curve) the cost curves a plan's
        chosen feed needs for up to `batch` rows, so that no measurement falls inside a timed run."""
        self.controller.prepare(settings, batch)

    def _measured_costs(self):
        costs = base.costs(self.loaded, self.decoder, announce=self.announce, remeasure=self.remeasure_cost)
        self.remeasure_cost = False  # measured now: the next call reads what this one kept
        return costs

    def encode(self, prompts, *, chat: bool = True) -> list[list[int]]:
        """Token ids of each prompt (a string or chat messages), through the chat template unless `chat` is False."""
        return [encode_prompt(self.tokenizer, p, chat=chat) for p in prompts]

    def decode(self, ids: list[list[int]], settings: Plan, batch_size: int = 8) -> Decoded:
        """Decode prompts (token ids) in batches, with the cost-aware feed where `settings` takes it."""
        return decode_batches(self.decoder, ids, settings, batch_size, controller=self.controller)

    def generate(self, ids: list[list[int]], settings: Plan, **kwargs):
        """One batch through the decoding loop (mars.core.decode.loop.generate), with the cost-aware
        feed where `settings` takes it; `kwargs` go to the loop (e.g. on_tokens)."""
        return generate(self.decoder, ids, settings, controller=self.controller, **kwargs)
