"""The MLX backend's decoding step (MlxDecoder, a mars.core.decode.loop.StepBackend) on mlx-lm
KV caches: forwards, the predictions and confidences of the slots read, sampling, and lossless
sampling's speculate. A step copies its host inputs to the device once and reads its results back
once (forward.to_device, forward.to_host)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...core.acceptance import speculative_sampling, tree_sampling
from ...core.decode.plan import Sampling
from ...core.decode.types import ReadLogprobs, Speculated, StepOutput, compile_failed, runners_up_of
from ...core.masks import StepMask
from .compiled import CompiledMlxStep, StaticCache, compilable
from .forward import Caches, Positions, body, head, hidden_states, sliding_keys, step_mask, to_device, to_host
from .load import MlxModel


def slot_predictions(logits: mx.array, metric: str, sampling: Sampling, key=None):
    """(ids, confidence) per slot on the device; the same rule as the torch backend."""
    if metric is None and sampling.greedy:
        return mx.argmax(logits, axis=-1), mx.zeros(logits.shape[:-1])
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(logp)
    if sampling.greedy:
        chosen = mx.argmax(logits, axis=-1)
    else:
        chosen = sample(logits, sampling, key)
    if metric == "probability":
        conf = mx.take_along_axis(probs, chosen[..., None], axis=-1)[..., 0]
    elif metric == "margin":
        top2 = mx.topk(probs, 2, axis=-1)
        conf = mx.abs(top2[..., 1] - top2[..., 0])
    else:
        conf = -mx.sum(mx.where(probs > 0, probs * logp, 0.0), axis=-1)
    return chosen, conf


def most_likely(logits: mx.array, n: int) -> mx.array:
    """The n most likely ids of each read, most likely first: a partition, then a sort of those."""
    top = mx.argpartition(-logits, n - 1, axis=-1)[..., :n]
    order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
    return mx.take_along_axis(top, order, axis=-1)


def read_logprobs(logits: mx.array, ids: mx.array, n: int) -> list[mx.array]:
    """[the log-probability of `ids` at each read, the n most likely ids there, their log-probabilities],
    under the untempered distribution, on the device (the torch backend's rule)."""
    z = logits.astype(mx.float32)
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, ids.astype(mx.int32)[..., None], axis=-1)[..., 0]
    if not n:
        empty = logp[..., :0]
        return [chosen, empty.astype(mx.int64), empty]
    top = most_likely(logp, n)
    return [chosen, top.astype(mx.int64), mx.take_along_axis(logp, top, axis=-1)]


def sample(logits: mx.array, sampling: Sampling, key):
    return mx.random.categorical(sampling_logits(logits, sampling), axis=-1, key=key)


def sampling_logits(logits: mx.array, sampling: Sampling) -> mx.array:
    """Tempered, top-k and top-p filtered logits: the distribution sampling draws from (as
    logits; the torch backend's sampling_probs gives it as probabilities)."""
    z = logits.astype(mx.float32)
    z = (z - mx.max(z, axis=-1, keepdims=True)) / sampling.divisor
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = mx.sort(z, axis=-1)[..., -sampling.top_k][..., None]
        z = mx.where(z < kth, -mx.inf, z)
    if sampling.top_p < 1.0:
        order = mx.argsort(-z, axis=-1)
        sorted_z = mx.take_along_axis(z, order, axis=-1)
        p = mx.softmax(sorted_z, axis=-1)
        drop = (mx.cumsum(p, axis=-1) - p) >= sampling.top_p
        drop[..., 0] = False
        sorted_z = mx.where(drop, -mx.inf, sorted_z)
        z = mx.put_along_axis(mx.full(z.shape, -mx.inf), order, sorted_z, axis=-1)
    return z


class MlxDecoder:
    """The decoding step of docs/method.md §5 for the core loop, on mlx-lm KV caches (trim, never copy).
    `compile`: the step under `mx.compile` on a cache of fixed room (compiled.CompiledMlxStep), for a
    model with no sliding window (one with one runs eager; `compiled` is None then).
    `on_compile_error` (what `--compile auto` gives: a function taking a message): a compiled step
    that raises, when it is called or when its results are read, is dropped, the message says why,
    and that step and the ones after it run eager, every cache of fixed room turned into mlx-lm's
    caches with the keys it held (the failed step's own taken back); without it the error
    propagates (`--compile on`)."""

    def __init__(self, loaded: MlxModel, compile: bool = False, on_compile_error=None):
        self.loaded = loaded
        self.model = loaded.model
        self._key = None
        self._seed = None
        self._drafted = None  # lossless sampling: the last step's mask distributions
        self.compiled = CompiledMlxStep(self.model, loaded.gate) if compile and compilable(self.model) else None
        self.on_compile_error = on_compile_error

    def _eager(self, cache):
        """The cache a step runs on: a cache of fixed room once the compiled step is dropped is
        served by the mlx-lm caches it was turned into (made at its first step after that)."""
        if self.compiled is not None or not isinstance(cache, StaticCache):
            return cache
        if cache.eager is None:
            from mlx_lm.models.cache import KVCache

            cache.eager = Caches(KVCache() for _ in body(self.model).layers)
            if cache.keys is not None and cache.length:
                for c, k, v in zip(cache.eager, cache.keys, cache.values):
                    c.keys, c.values, c.offset = k[..., : cache.length, :], v[..., : cache.length, :], cache.length
        return cache.eager

    def _guarded(self, run, cache, *args, **kwargs):
        """`run` (a step) on `cache`; with `on_compile_error`, a compiled step that fails gives way to
        eager ones: what the step changed (the cache's buffers and length, the drafts' distributions,
        the random key) is put back, and it runs again eager. MLX evaluates lazily, so a failure may
        surface only when the step reads its results back."""
        cache = self._eager(cache)
        if self.on_compile_error is None or not isinstance(cache, StaticCache):
            return run(cache, *args, **kwargs)
        before = (cache.keys, cache.values, cache.length, self._drafted, self._key, self._seed)
        try:
            return run(cache, *args, **kwargs)
        except Exception as error:
            cache.keys, cache.values, cache.length, self._drafted, self._key, self._seed = before
            self.on_compile_error(compile_failed(error))
            self.compiled = None
            return run(self._eager(cache), *args, **kwargs)

    def cost_key(self) -> dict:
        """What a forward's cost depends on besides the model: the cost curve's cache key."""
        import mlx.core as mx

        # The number format too: a 4-bit base and the float one read through the same adapter path.
        return {
            "backend": "mlx",
            "device": str(mx.default_device()),
            "mlx": getattr(mx, "__version__", ""),
            "format": self.loaded.number_format,
            **({"compiled": 1} if self.compiled is not None else {}),
        }

    def new_cache(self, batch: int):
        from mlx_lm.models.cache import KVCache

        self._drafted = None
        if self.compiled is not None:
            return self.compiled.new_cache()
        return Caches(KVCache() for _ in body(self.model).layers)

    def crop(self, cache, length: int) -> None:
        cache = self._eager(cache)
        if isinstance(cache, StaticCache):
            self.compiled.crop(cache, length)
            return
        for c in cache:
            if c.offset > length:
                c.trim(c.offset - length)

    def keep_rows(self, cache, rows: list[int]) -> None:
        cache = self._eager(cache)
        idx = mx.array(rows, dtype=mx.int32)
        if isinstance(cache, StaticCache):
            self.compiled.keep_rows(cache, rows)
        else:
            if getattr(cache, "key_positions", None) is not None:
                cache.key_positions = cache.key_positions[rows]
            for c in cache if cache is not None else ():
                if c.keys is not None:
                    c.keys, c.values = c.keys[idx], c.values[idx]
        if self._drafted is not None:
            self._drafted = self._drafted[idx]

    def keep_keys(self, cache, columns) -> None:
        """Keep only these cache positions of every layer (a served batch drops the keys of rows that left)."""
        cache = self._eager(cache)
        if isinstance(cache, StaticCache):
            self.compiled.keep_keys(cache, columns)
            return
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[:, np.asarray(columns, dtype=np.int64)]
        idx = mx.array(np.asarray(columns, dtype=np.int32))
        for c in cache:
            if c.keys is not None:
                c.keys = mx.take(c.keys[..., : c.offset, :], idx, axis=2)
                c.values = mx.take(c.values[..., : c.offset, :], idx, axis=2)
                c.offset = len(columns)

    def _next_key(self, sampling: Sampling):
        if self._key is None or self._seed != sampling.seed:
            seed = sampling.seed if sampling.seed is not None else int(np.random.SeedSequence().entropy % (2**31))
            self._key, self._seed = mx.random.key(seed), sampling.seed
        self._key, sub = mx.random.split(self._key)
        return sub

    def logits(self, cache, input_ids, positions, mask, read, **more):
        """One forward of `input_ids` (as `step`): the logits of the `read` columns. Its host
        inputs reach the device in one copy (to_device), the mask as bool bytes; `more`: named host
        arrays the caller needs there too (speculate's drafts and tree), which travel in that copy,
        and then it returns (the logits, their device arrays by name)."""
        cache = self._eager(cache)
        if isinstance(cache, StaticCache):
            logits, sent = self.compiled.logits(cache, input_ids, positions, mask, read, more)
            return (logits, sent) if more else logits
        positions = np.asarray(positions)
        keys, cuts = sliding_keys(self.model, positions, cache)
        compact = isinstance(mask, StepMask)  # the mask's few numbers travel; the device builds it
        sent = to_device(
            ids=input_ids,
            positions=positions,
            read=read,
            keys=keys if cuts else None,
            mask=None if mask is None or compact else np.asarray(mask, dtype=bool),
            valid_keys=mask.keys if compact else None,
            see=mask.see if compact else None,
            start=mask.start if compact else None,
            **more,
        )
        ids = sent["ids"]
        if self.loaded.gate is not None:
            self.loaded.gate.set(ids)
        if compact:
            attn = step_mask(
                mask.cached, mask.width, len(positions), sent.get("valid_keys"), sent.get("see"), sent.get("start")
            )
        attn = "causal" if mask is None else attn[:, None] if compact else sent["mask"][:, None]
        h = hidden_states(self.model, ids, Positions(sent["positions"], sent.get("keys"), cuts), attn, cache)
        logits = head(self.model, mx.take_along_axis(h, sent["read"][..., None], axis=1))
        return (logits, {name: sent[name] for name in more}) if more else logits

    def step(self, cache, *args, **kwargs):
        return self._guarded(self._step, cache, *args, **kwargs)

    def speculate(self, cache, *args, **kwargs):
        """Lossless sampling (mars.core.decode.loop.StepBackend.speculate), on the device."""
        return self._guarded(self._speculate, cache, *args, **kwargs)

    def _step(
        self,
        cache,
        input_ids,
        positions,
        mask,
        read,
        *,
        metric,
        sampling,
        valid=None,
        runners_up=0,
        runners_up_from=0,
        logprobs=None,
    ):
        logits = self.logits(cache, input_ids, positions, mask, read)
        key = None if sampling.greedy else self._next_key(sampling)
        chosen, conf = slot_predictions(logits, metric, sampling, key)
        wants_top = runners_up and sampling.greedy and runners_up_from < logits.shape[1]
        top = [most_likely(logits[:, runners_up_from:], runners_up + 1)] if wants_top else []
        lp = read_logprobs(logits, chosen, logprobs) if logprobs is not None else []
        # A one-token greedy step that reads its own column: the next one starts on the device now.
        ahead = (
            isinstance(cache, StaticCache)
            and self.compiled.start_ahead
            and metric is None
            and sampling.greedy
            and not (wants_top or lp)
            and mask is None
            and np.shape(input_ids)[1] == 1
        )
        if ahead:
            self.compiled.start_next(cache, chosen, positions)
        ids, conf, *rest = to_host(chosen, conf, *top, *lp)
        if ahead:
            self.compiled.taken(ids)
        second = None
        if runners_up and sampling.greedy:  # the reads before `runners_up_from` have none (-1)
            second = np.full(ids.shape + (runners_up,), -1, dtype=np.int64)
            if top:
                second[:, runners_up_from:] = runners_up_of(rest.pop(0), ids[:, runners_up_from:], runners_up)
        return StepOutput(ids, conf, second, ReadLogprobs(*rest) if logprobs is not None else None)

    def _speculate(
        self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling, logprobs=None, tree=None, ranks=0
    ):
        chain = dict(drafts=drafts, n_drafts=n_drafts)
        nodes = {} if tree is None else dict(nodes=tree.nodes, anchors=tree.anchors, live=tree.live)
        logits, sent = self.logits(cache, input_ids, positions, mask, read, **chain, **nodes)
        logits = logits.astype(mx.float32)
        width = drafts.shape[1]
        p = mx.softmax(sampling_logits(logits[:, : width + 1], sampling), axis=-1)
        # None when a cost-aware step fed AR's feed alone.
        masks = logits.shape[1] - width - 1 if tree is None else tree.masks
        mask_logits = logits[:, width + 1 : width + 1 + masks]
        batch = p.shape[0]
        dr, n = sent["drafts"], sent["n_drafts"]
        u = mx.random.uniform(shape=dr.shape, key=self._next_key(sampling)) if width else None
        q = self._drafted[:, :width] if width else None
        kept, dist = speculative_sampling(MLX_OPS, p, q, dr, n, u)
        if tree is not None:  # one node at least (verify.sampled_tree)
            ids = sent["nodes"]
            u_tree = mx.random.uniform(shape=ids.shape, key=self._next_key(sampling))
            chosen, dist = tree_sampling(MLX_OPS, dist, kept, ids, sent["anchors"], sent["live"], u_tree)
        token = mx.random.categorical(mx.log(dist), axis=-1, key=self._next_key(sampling))
        extra = []
        if tree is not None:
            at = mx.maximum(chosen, 0)
            node_read = width + 1 + masks + (1 + masks) * at  # the taken node's read (node 0's where none)
            node_logits = mx.take_along_axis(logits, node_read[:, None, None], axis=1)[:, 0]
            after = mx.random.categorical(sampling_logits(node_logits, sampling), axis=-1, key=self._next_key(sampling))
            token = mx.where(chosen >= 0, mx.take_along_axis(ids, at[:, None], axis=1)[:, 0], token)
            group_reads = node_read[:, None] + 1 + mx.arange(masks)[None, :]
            group = mx.take_along_axis(logits, group_reads[:, :, None], axis=1)
            mask_logits = mx.where((chosen >= 0)[:, None, None], group, mask_logits)
            extra = [chosen, after]
        if masks:
            q_next = mx.softmax(sampling_logits(mask_logits, sampling), axis=-1)
            proposals = mx.random.categorical(mx.log(q_next), axis=-1, key=self._next_key(sampling))
        else:
            q_next = logits[:, :0]
            proposals = mx.zeros((batch, 0), dtype=mx.int32)
        self._drafted = q_next
        lp, ranked = [], []
        if logprobs is not None:  # the ids taken at the first 1 + width reads: the drafts kept, the token (`after`)
            at = mx.arange(width + 1)[None, :]
            fed = mx.concatenate([dr, mx.zeros((batch, 1), dtype=dr.dtype)], axis=1)
            taken = mx.where(at == kept[:, None], token[:, None], fed)
            reads = logits[:, : width + 1]
            if tree is not None:
                taken = mx.concatenate([taken, after[:, None].astype(taken.dtype)], axis=1)
                reads = mx.concatenate([reads, node_logits[:, None]], axis=1)
            lp = read_logprobs(reads, taken, logprobs)
        if ranks and masks:
            ranked = read_logprobs(mask_logits, proposals, ranks)
        elif ranks:  # no masks fed (a cost-aware step's AR feed): no next drafts to rank
            ranked = [mx.zeros((batch, 0)), mx.zeros((batch, 0, ranks), dtype=mx.int64), mx.zeros((batch, 0, ranks))]
        # One read-back; q_next, kept for the next call, is computed with them (the proposals are drawn from it).
        kept, token, proposals, *rest = to_host(kept, token, proposals, *extra, *lp, *ranked)
        node, after = (rest.pop(0), rest.pop(0)) if extra else (None, None)
        lp_out = ReadLogprobs(*rest[:3]) if logprobs is not None else None
        return Speculated(kept, token, proposals, node, after, lp_out, ReadLogprobs(*rest[-3:]) if ranks else None)


class MlxOps:
    """mars.core.acceptance.DeviceOps on MLX arrays."""

    def arange(self, n):
        return mx.arange(n)

    def zeros_int(self, n):
        return mx.zeros((n,), dtype=mx.int32)

    def zeros_like(self, x):
        return mx.zeros(x.shape)

    def take(self, x, ids):
        return mx.take_along_axis(x, ids[..., None], axis=-1)[..., 0]

    def leading(self, ok):
        return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)

    def where(self, condition, a, b):
        return mx.where(condition, a, b)

    def minimum(self, x, n):
        return mx.minimum(x, n)

    def at_least(self, x, low):
        return mx.maximum(x, low)

    def row_sum(self, x):
        return x.sum(axis=-1, keepdims=True)


MLX_OPS = MlxOps()
