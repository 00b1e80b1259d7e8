"""Continuous batching: one thread owns the model and runs the decoding loop for every request.

HTTP handlers (on the asyncio loop) submit a `Job` and read its tokens from the job's
`Outbox`; the engine thread never waits on a handler. Requests join a batch when there is
room (`max_batch` rows) and leave it the step they finish or are cancelled, on
`mars.core.decode.loop.ContinuousBatch`, by default on the window cache: a request joins at
once (its prompt fed beside the other rows' tokens), a step feeds each row only what it
needs (AR's one token when every row is at threshold 1.0), and greedy lossless requests (the
default mode of a checkpoint whose mars.json says so) run `mars generate`'s lossless loop
(mask, spare-group and n-gram drafts, the feed chosen per step from the device's cost curves
by one policy that learns for the server's life), so they are as fast as in `mars generate`
and say what greedy AR says. Each request is planned as `mars generate` plans it
(mars.core.decode.plan.make_plan): a greedy request below AR mode runs verified threshold mode
unless it says `"verify": false`, deciding on the stored cost curves as `mars generate`
does. `cache="block"` decodes on the block-level cache instead (docs/method.md §6; requests
join at block boundaries). Rows that decode differently cannot share a forward (a backend
step samples every row alike), so the engine keeps one batch per kind of decoding (the
request's mode, or its sampling), each with its own decoder and cache, and runs them in
turn: all greedy AR and plain threshold-mode requests share one batch whatever their
thresholds, as do all verified ones.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..backends import base
from ..core.acceptance import looser
from ..core.decode.feed import FeedController
from ..core.decode.loop import ContinuousBatch
from ..core.decode.plan import MAX_LOGPROBS, Mode, Plan, Sampling
from ..core.decode.rules import DEFAULT_ALTERNATIVES, DEFAULT_NGRAM
from ..session import Session
from .policy import ThresholdPolicy

log = logging.getLogger("mars.serve")


class QueueFull(Exception):
    """The waiting queue is at --max-queue."""


class EngineStopped(Exception):
    """The engine thread is not running (the server is shutting down, or it failed)."""


class Outbox:
    """One request's tokens, from the engine thread to its handler on the asyncio loop.

    The engine only appends under a lock and, when the handler is not already due to wake,
    schedules one wake-up: it never waits on the handler, so a slow or vanished client
    cannot stall the batch. What piles up is bounded by the request's max_tokens."""

    def __init__(self, loop: asyncio.AbstractEventLoop, looser: Callable[[float, float], float] = min):
        self._loop = loop
        self._looser = looser  # of two thresholds, the looser (mars.core.decode.rules.looser)
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._wake_due = False
        self._tokens: list[int] = []
        self._logprobs: list = []  # per token posted, its TokenLogprob, where the request asked for them
        self.taken_logprobs: list = []  # those of the tokens the last `take` returned
        self._forwards = 0
        self.finish: str | None = None  # "eos" | "length" | "error" | "cancelled"
        self.error: str | None = None
        self.threshold: float | None = None  # the loosest threshold the row decoded at

    def post(
        self,
        tokens: list[int],
        *,
        threshold: float | None = None,
        finish: str | None = None,
        error: str | None = None,
        logprobs: list | None = None,
    ) -> None:
        with self._lock:
            if tokens:
                self._tokens.extend(tokens)
                self._logprobs.extend(logprobs or [])
                self._forwards += 1  # a forward counts for a row when it produced a token (docs/method.md §5)
            if threshold is not None:
                self.threshold = threshold if self.threshold is None else self._looser(self.threshold, threshold)
            if finish is not None and self.finish is None:  # the first word on how it ended stands
                self.finish, self.error = finish, error
            wake, self._wake_due = not self._wake_due, True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    async def take(self) -> tuple[list[int], int, str | None]:
        """Wait for news; returns (new tokens, forwards that produced them, finish or None). Their
        log-probabilities, where asked for, wait in `taken_logprobs`."""
        await self._ready.wait()
        with self._lock:
            self._ready.clear()
            self._wake_due = False
            tokens, forwards = self._tokens, self._forwards
            self.taken_logprobs, self._logprobs = self._logprobs, []
            self._tokens, self._forwards = [], 0
            return tokens, forwards, self.finish


@dataclass(eq=False)
class Job:
    """One request as the engine sees it."""

    prompt: list[int]
    max_tokens: int
    outbox: Outbox
    sampling: Sampling = field(default_factory=Sampling)
    lossless: bool | None = None  # as asked; None: the server's default mode decides
    threshold: float | None = None  # the request's own; None: the policy's
    verify: bool = True  # greedy threshold mode verifies the drafts it does not take (as `mars generate`)
    pinned: bool = False  # the request opted out of the adaptive policy
    logprobs: int | None = None  # the most likely ids each token's log-probability lists; None: none asked
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: bool = False
    # The request's plan (mars.core.decode.plan), made when it is admitted (with the threshold in force
    # then) and as its batch runs it: its mode decides the batch, its name the reply's usage.mode.
    plan: Plan | None = None

    def kind(self) -> tuple:
        """Jobs of one kind share a batch (and its forwards); `plan` must be set."""
        # Rows that keep log-probabilities batch apart (their steps read more), all at MAX_LOGPROBS ids.
        asked = self.logprobs is not None
        if self.sampling.greedy:
            # AR and threshold rows share one batch, each at its own threshold.
            return ("greedy", Mode.THRESHOLD if self.plan.mode is Mode.AR else self.plan.mode, asked)
        if self.sampling.seed is not None:  # its own random stream, as when decoded alone
            return ("seeded", self.id)
        s = self.sampling
        return ("sampled", self.plan.mode, s.temperature, s.top_p, s.top_k, asked)


class _Batch:
    def __init__(self, decoder, settings: Plan, controller: FeedController | None = None):
        """`controller`, for a greedy batch that verifies drafts: the served session's feed controller."""
        self.decoder = decoder
        self.batch = ContinuousBatch(self.decoder, settings, keep_keys=self.decoder.keep_keys, controller=controller)
        self.jobs: dict[int, Job] = {}  # id(row) -> job

    def __len__(self):
        return len(self.batch.rows)


@dataclass
class EngineLimits:
    max_batch: int = 16  # rows decoded together, every kind of batch counted
    max_queue: int = 64  # requests waiting for a row; past it `submit` raises QueueFull
    block_cache: int = 16  # B_cache
    # The cache requests decode on: "window" (they join at any step; greedy lossless ones with
    # the cost-aware feed and n-gram drafts) or "block" (the block-level cache, B_cache slots).
    cache: str = "window"
    ngram: int = DEFAULT_NGRAM  # n-gram drafts a greedy lossless window step may feed (0: off)
    alternatives: int = DEFAULT_ALTERNATIVES  # runner-up groups a greedy lossless window step may feed (0: off)
    tree: int = 0  # tree nodes (drafts/tree.py) a lossless step may feed, greedy or sampled (0: off)
    stats_window: float = 10.0  # seconds of history behind the recent tokens/s and tokens/forward


class Engine:
    """The model's thread. `submit` and `cancel` are safe to call from any thread."""

    def __init__(
        self,
        session: Session,
        policy: ThresholdPolicy,
        limits: EngineLimits | None = None,
        *,
        name: str = "default",
        aliases=(),
        block_size: int | None = None,
    ):
        # The served model; its feed controller (session.controller, mars.core.decode.feed) holds
        # the cost curves, measured (or read from the cache directory) before the first request
        # that needs them, and the lossless feed policy, which learns for the server's life.
        # Verified threshold batches decide on the curves as measured, as `mars generate` does.
        self.session = session
        self.name = name  # the model id clients ask for, or one of its aliases
        self.aliases = tuple(a for a in aliases if a and a != name)
        self.block_size = session.block_size(block_size)
        self.policy = policy
        self.limits = limits or EngineLimits()
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._batches: dict[tuple, _Batch] = {}
        # Decoders of greedy batches that emptied, for the next greedy batch: making one costs
        # time (the torch decoder packs the weights, about 0.25 s on the default model on a CPU),
        # and a greedy decoder keeps no state between batches (a sampling one keeps its generator).
        self._idle_decoders: list = []
        self._turn = 0  # round robin over the batches
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed: str | None = None  # why the engine thread died, if it did
        # Recent history: (time, tokens, row forwards) per forward.
        self._history: deque[tuple[float, int, int]] = deque()
        self._history_lock = threading.Lock()
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        self.tokens_total = 0
        self.forwards_total = 0

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="mars-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    def new_outbox(self, loop) -> Outbox:
        return Outbox(loop, looser=functools.partial(looser, self.policy.metric))

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self.alive:
                raise EngineStopped(self.failed or "the engine is not running")
            # Requests that will get a free row at the next step do not count against the queue.
            free_rows = max(self.limits.max_batch - self._in_flight, 0)
            if len(self._waiting) >= self.limits.max_queue + free_rows:
                raise QueueFull(
                    f"{len(self._waiting) - free_rows} requests are waiting for a row (--max-queue "
                    f"{self.limits.max_queue})"
                )
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away (or a stop string ended it): free the row at the next step.
        Whoever still reads the job's outbox sees it end as "cancelled"."""
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()
        job.outbox.post([], finish="cancelled")

    @property
    def names(self) -> tuple[str, ...]:
        """The ids the model is served under: its name, then its aliases."""
        return (self.name, *self.aliases)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def recent(self) -> dict:
        """Tokens/s and tokens/forward over the last `stats_window` seconds."""
        now = time.monotonic()
        with self._history_lock:
            self._forget(now)
            tokens = sum(t for _, t, _ in self._history)
            forwards = sum(f for _, _, f in self._history)
        span = min(self.limits.stats_window, max(now - self.started_at, 1e-3))
        return {"tokens_per_second": tokens / span, "tokens_per_forward": tokens / forwards if forwards else 0.0}

    def _forget(self, now: float) -> None:
        while self._history and self._history[0][0] < now - self.limits.stats_window:
            self._history.popleft()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._drop_cancelled()  # first, so their rows are free for the waiting
                with self._cond:
                    if self._stopping:
                        break
                    admitted = self._admit_locked()
                    if not admitted and not self._in_flight_rows():
                        # Idle: wake now and then anyway so the adaptive threshold can relax.
                        self._cond.wait(timeout=0.05)
                load = len(self._waiting) + len(admitted) + self._in_flight_rows()
                self.policy.update(load, time.monotonic())
                for job in admitted:
                    try:
                        self._join(job)
                    except Exception as e:  # this request cannot be decoded; the others can
                        log.exception("a request could not join the batch")
                        job.outbox.post([], finish="error", error=f"could not start decoding: {type(e).__name__}: {e}")
                self._in_flight = self._in_flight_rows()
                self._step_next_batch()
                self._in_flight = self._in_flight_rows()
        except Exception:  # a bug, not a request's fault: fail loudly, answer 503 from now on
            self.failed = traceback.format_exc().strip().splitlines()[-1]
            log.exception("the engine thread failed")
            self._fail_everyone(self.failed)
        finally:
            with self._cond:
                leftovers = list(self._waiting)
                self._waiting.clear()
            for job in leftovers:
                job.outbox.post([], finish="error", error="the server is shutting down")
            for b in self._batches.values():
                for job in b.jobs.values():
                    job.outbox.post([], finish="error", error="the server is shutting down")
            self._batches.clear()

    def _in_flight_rows(self) -> int:
        return sum(len(b) for b in self._batches.values())

    def _admit_locked(self) -> list[Job]:
        """Waiting jobs that get a row now, first come first served among those whose batch is
        at a block boundary (the others wait for it); cancelled ones are dropped."""
        room = self.limits.max_batch - self._in_flight_rows()
        admitted: list[Job] = []
        still_waiting: deque[Job] = deque()
        for job in self._waiting:
            if job.cancelled:
                continue
            job.plan = self._plan(job)
            batch = self._batches.get(job.kind())
            if room > 0 and (batch is None or batch.batch.can_join):
                admitted.append(job)
                room -= 1
            else:
                still_waiting.append(job)
        self._waiting = still_waiting
        self._in_flight += len(admitted)  # counted at once, so `submit` never sees their rows as free
        return admitted

    def _plan(self, job: Job, threshold: float | None = None) -> Plan:
        """The job's plan (mars.core.decode.plan.make_plan, as every entry point makes it): at
        the threshold it decodes at now (or `threshold`), in the server's default mode where
        the request named neither a threshold nor lossless."""
        now = self._threshold(job) if threshold is None else threshold
        drafts = job.sampling.greedy  # the draft sources, used where the plan verifies drafts
        return base.plan_for_model(
            self.session.loaded,
            threshold=None if job.threshold is None and threshold is None else now,
            lossless=job.lossless,
            verify=job.verify,
            default_mode=self.policy.default_mode,
            default_threshold=now,
            metric=self.policy.metric,
            block_size=self.block_size,
            max_tokens=job.max_tokens,
            cache=self.limits.cache,
            block_cache=self.limits.block_cache,
            sampling=job.sampling,
            ngram=self.limits.ngram if drafts else 0,
            alternatives=self.limits.alternatives if drafts else 0,
            tree=self.limits.tree,  # sampled too: the speculative rule over the tree
            logprobs=MAX_LOGPROBS if job.logprobs is not None else None,
            **({} if drafts else {"corpus": None}),
        )

    def mode_name(self, job: Job, threshold: float | None) -> str:
        """The printable name of the mode a job ran in (`usage.mode`), at the loosest
        threshold it decoded at: what `mars generate --json` prints as "mode"."""
        plan = job.plan if job.plan is not None else self._plan(job)
        if threshold is None or plan.mode is Mode.LOSSLESS:
            return plan.name
        return self._plan(job, threshold).name

    def prepare_feed(self, announce: Callable[[str], None] = log.info) -> None:
        """Read (or measure now) the model's cost curves, of every batch size up to
        `max_batch`, notes of a measurement to `announce`. `mars serve` does it before serving,
        so that no measurement falls inside a request; otherwise the first request that needs
        the curves does it."""
        self.session.announce = announce
        self.session.controller.prepare_all(self.limits.max_batch)

    def _join(self, job: Job) -> None:
        kind = job.kind()
        batch = self._batches.get(kind)
        if batch is None:
            plan = job.plan
            # The chosen feed serves greedy batches that verify drafts (lossless, verified).
            controller = self.session.controller if plan.sampling.greedy and plan.verifies else None
            if controller is not None and FeedController.uses(plan):
                self.prepare_feed()
            greedy = job.sampling.greedy
            decoder = self._idle_decoders.pop() if greedy and self._idle_decoders else self.session.new_decoder()
            batch = self._batches[kind] = _Batch(decoder, plan, controller)
        row = batch.batch.join(job.prompt, threshold=self._threshold(job), max_tokens=job.max_tokens)
        batch.jobs[id(row)] = job

    def _threshold(self, job: Job) -> float:
        if job.lossless:
            return self.policy.for_request(None, pinned=True)  # unused: lossless ignores it
        return self.policy.for_request(job.threshold, pinned=job.pinned)

    def _drop_cancelled(self) -> None:
        for kind, b in list(self._batches.items()):
            gone = [row for row in b.batch.rows if b.jobs[id(row)].cancelled]
            if gone:
                b.batch.leave(gone)
                for row in gone:
                    del b.jobs[id(row)]
            if not len(b):
                self._retire(kind)

    def _retire(self, kind: tuple) -> None:
        """An emptied batch goes; a greedy one leaves its decoder for the next."""
        b = self._batches.pop(kind)
        if kind[0] == "greedy" and not self._idle_decoders:
            self._idle_decoders.append(b.decoder)

    def _step_next_batch(self) -> None:
        kinds = list(self._batches)
        if not kinds:
            return
        self._turn = (self._turn + 1) % len(kinds)
        kind = kinds[self._turn]
        b = self._batches[kind]
        for row in b.batch.rows:
            row.threshold = self._threshold(b.jobs[id(row)])
        thresholds = {id(row): row.threshold for row in b.batch.rows}
        try:
            took = b.batch.step()
        except Exception as e:  # a failed forward ends its batch's requests, not the server
            log.exception("a decoding step failed")
            for job in b.jobs.values():
                job.outbox.post([], finish="error", error=f"decoding failed: {type(e).__name__}: {e}")
            del self._batches[kind]
            return
        tokens = 0
        for row, new in took:
            job = b.jobs[id(row)]
            tokens += len(new)
            job.outbox.post(
                new,
                threshold=None if job.plan.mode is Mode.LOSSLESS else thresholds[id(row)],
                finish=row.finish if row.done else None,
                logprobs=row.logprobs[len(row.logprobs) - len(new) :] if job.logprobs is not None else None,
            )
        still = {id(r) for r in b.batch.rows}
        for key in [k for k in b.jobs if k not in still]:
            del b.jobs[key]
        if not len(b):
            self._retire(kind)
        now = time.monotonic()
        with self._history_lock:
            self._history.append((now, tokens, len(took)))
            self._forget(now)
        self.tokens_total += tokens
        self.forwards_total += 1

    def _fail_everyone(self, why: str) -> None:
        for b in self._batches.values():
            for job in b.jobs.values():
                job.outbox.post([], finish="error", error=f"the engine failed: {why}")
        self._batches.clear()
