"""The torch backend's decoding step (TorchDecoder, a mars.core.decode.loop.StepBackend): forwards
on the KV cache, the predictions and confidences of the slots read, sampling, and lossless
sampling's speculate, with one device-to-host copy a step."""

from __future__ import annotations

import array
import bisect
from itertools import chain

import numpy as np
import torch

from ...core.acceptance import speculative_sampling, tree_sampling
from ...core.decode.layout import rows_of
from ...core.decode.plan import Sampling
from ...core.decode.types import ReadLogprobs, Speculated, StepOutput, compile_failed, runners_up_of
from ...core.masks import WIDTH_BUCKETS, StepMask, bucket, decode_mask, dense_mask, pad_width
from . import models, packed
from .attention import REDUCED, ROW_EXACT
from .cache import cache_argument
from .forward import additive_mask, attention_masks, model_windows
from .load import TorchModel

# Positions a new cache of mars's own forward holds before it first grows (models.KVCache.reserve).
CACHE_START = 256
# Below this many bytes of packed weights the row paths are not measured (packed for every
# product of 2 rows or more): a tiny model's products (the tests') cost too little to tell them
# apart. A narrow model of the default's depth (30 layers, hidden 64: 7.4 MB) is measured.
ROW_PATHS_MIN_BYTES = 2 << 20


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo where there is one), for keys of measurements."""
    import platform

    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def linear_rows_for(tm: TorchModel) -> list[int]:
    """The row counts (2 to packed.CHOSEN_ROWS) whose products run `F.linear` rather than the packed
    product on this CPU (packed.time_row_paths, packed.row_choices): measured once per CPU model, thread count, dtype,
    torch version and layer shapes, about 4 s on the default model (2 cores, 1 thread), and kept under
    the cache directory (`MARS_HOME`, default ~/.cache/mars/paths). None for a small model
    (below ROW_PATHS_MIN_BYTES of packed weights): every product of 2 rows or more is packed."""
    import json

    from ...checkpoint.default_model import keyed_cache_file
    from ...core.files import atomic_write_text

    layers = packed.packed_layers(tm.body)  # the body's: the head keeps its own path (packed.pack_head)
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if size < ROW_PATHS_MIN_BYTES:
        return []
    key = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "dtype": str(tm.dtype),
        "torch": torch.__version__,
        "shapes": sorted({(layer.out_features, layer.in_features) for layer in layers}),
        "layers": len(layers),
        "paths": 2,  # 2: row counts 2-4, 8, 16 and 32 measured, the others chosen alike
    }
    path = keyed_cache_file("paths", key)
    try:
        return [int(r) for r in json.loads(path.read_text())["linear_rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = packed.time_row_paths(tm.body)
    rows = packed.row_choices(timings)
    report = {
        "key": key,
        "linear_rows": rows,
        "seconds": {str(r): {"linear": a, "packed": b} for r, (a, b) in timings.items()},
    }
    try:
        atomic_write_text(path, json.dumps(report, indent=1))
    except OSError:
        pass  # a read-only cache: measure again next time
    return rows


class TorchDecoder:
    """The decoding step of docs/method.md §5 for the core loop (mars.core.decode.loop.StepBackend).

    `pack` (default: on the CPU where oneDNN is available, for mars's own forward): the linear
    layers also keep their weights packed for multi-token forwards (mars.backends.torch.packed),
    which makes a forward of 2-16 tokens cost much less than with `F.linear`; one-token forwards
    are unchanged. A float32 LM head is packed too, for reads of 2 rows or more
    (packed.pack_head). The packed copies double the weights' memory. With packed layers a batch's
    step computes its real positions alone, not its holes (`skips_holes`). transformers' modules
    run as transformers wrote them: no packs, every position computed.

    `lean` (default): the architectures of TORCH_OWN_FORWARD run on mars's own forward
    (models/, docs/design.md "The torch step"), the others on transformers' modules; False runs
    every architecture on transformers' modules. `buckets`: pad each step's width to
    WIDTH_BUCKETS (mars's own forward only). `compile`: mars's own forward under `torch.compile`
    (models.CompiledStep: one graph for every cached length and width, its wide products packed
    where the eager step's are; a prompt's step and row-exact attention run eager); architectures
    without it run eager. `on_compile_error` (what `--compile auto` gives: a function taking a
    message): a compiled step that raises is dropped, the message says why, and that step and the
    ones after it run eager on the same cache; without it the error propagates (`--compile on`).

    `step` takes the step's (b, w) host values as arrays or as lists of rows (`takes_rows`): the
    loop hands over the lists it laid the step out in."""

    takes_rows = True

    def __init__(
        self,
        tm: TorchModel,
        pack: bool | None = None,
        lean: bool = True,
        buckets: bool = False,
        compile: bool = False,
        fixed: bool | None = None,
        on_compile_error=None,
    ):
        from .attention import use_grouped_sdpa
        from .packed import can_pack, pack_linears

        self.tm = tm
        self._device_kind = tm.device.type  # read once: a step asks it every time
        self.body = tm.body
        self.head = tm.head
        self.generator = None
        self._seeded = None
        self._drafted = None  # lossless sampling: the last step's mask distributions
        own = lean and models.lean_family(self.body.config) is not None
        compile = bool(compile) and own
        if pack is None:
            pack = can_pack(tm.device, tm.dtype)
        self.packed = pack_linears(self.body) if pack and own else 0
        # Row counts whose products run F.linear, where this CPU computes them faster (packed.py).
        self.linear_rows = linear_rows_for(tm) if self.packed else []
        if self.packed:
            packed.use_linear_rows(self.body, self.linear_rows)
            # The head too, in float32 (its reads of 2 rows or more; 113 MB more on the default
            # model): packed.pack_head. Packed after the body's row paths are chosen, which it keeps out of.
            packed.pack_head(self.head)
        # A batch's step computes its real positions alone, not its holes (models.StepInputs.real).
        self.skips_holes = bool(self.packed) and not compile  # (a compiled graph runs the holes too)
        # CPU: masked multi-token forwards share key heads instead of copying them (same results).
        self.grouped = tm.device.type == "cpu" and use_grouped_sdpa(tm.model)
        # CPU, bfloat16 or float16: each attention row computes what a one-token forward computes
        # (attention.row_exact_attention), so lossless verification reads AR's own predictions.
        self.row_exact = self.grouped and tm.dtype in REDUCED
        # Sliding-window layers: the masks cut the window by position (attention_masks), so the
        # cache keeps every position; the cached keys' positions are kept beside it, per row.
        self.windows = model_windows(tm.model)
        self.slides = any(self.windows)
        # mars's own forward (models/) where the architecture has one: the step's arguments explicit,
        # its cache preallocated; None: transformers' modules, steered as above.
        self.lean = models.build(self.body, self.head, self.windows) if own else None
        # Pad each step's width to WIDTH_BUCKETS (mars's own forward only): fixed shapes for a compiled
        # step. Off in an eager step, where it buys nothing: padding changes no token, but torch's
        # attention kernel gives the real rows other last bits with more query rows or keys
        # (tests/test_lean_forward.py measures both).
        # The forward a step calls: mars's own, compiled where asked; at fixed shapes (`fixed`: on
        # CUDA unless told, where its graphs are captured) every step is padded to the buckets.
        # (Row-exact attention, bfloat16 on the CPU, runs eager: its steps keep the cached length's shapes.)
        fixed = False if self.row_exact else fixed
        self.compiled = models.CompiledStep(self.lean, fixed=fixed) if compile else None
        self.fixed = self.compiled is not None and self.compiled.fixed
        self._asked_buckets = bool(buckets)
        self.buckets = (self._asked_buckets or self.fixed) and self.lean is not None
        self.forward = self.compiled if compile else self.lean
        self.on_compile_error = on_compile_error

    def _drop_compiled(self, error: Exception) -> None:
        """Run eager from now on: the compiled step raised `error` (`on_compile_error`)."""
        self.on_compile_error(compile_failed(error))
        self.compiled, self.fixed, self.forward = None, False, self.lean
        self.buckets = self._asked_buckets and self.lean is not None
        self.skips_holes = bool(self.packed)

    def cost_key(self) -> dict:
        """What a forward's cost depends on besides the model: the cost curve's cache key."""
        return {
            "backend": "torch",
            "device": str(self.tm.device),
            "dtype": str(self.tm.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "packed": bool(self.packed),
            "packed_min_rows": packed.MIN_ROWS if self.packed else None,
            "packed_pad_rows": sorted(packed.PAD_ROWS.items()) if self.packed else None,
            "linear_rows": self.linear_rows if self.packed else None,
            **({"packed_head": 1} if packed.head_packed(self.head) else {}),
            "grouped": self.grouped,
            "torch": torch.__version__,
            **({"row_exact": True} if self.row_exact else {}),
            **({"own_forward": 1} if self.lean is not None else {}),  # mars's forward costs what transformers' did not
            **({"buckets": list(WIDTH_BUCKETS)} if self.buckets else {}),
            **({"compiled": 1} if self.compiled is not None else {}),
            **({"fixed": 1} if self.fixed else {}),
        }

    def new_cache(self, batch: int):
        from .cache import growing_cache

        self._drafted = None
        if self.lean is not None:
            return self._lean_cache(batch)
        return growing_cache(self.tm.model.config)

    def _lean_cache(self, batch: int):
        return models.KVCache(self.lean.args, batch, CACHE_START, self.tm.dtype, self.tm.device)

    def crop(self, cache, length: int) -> None:
        if isinstance(cache, models.KVCache):
            cache.crop(length)
            return
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def keep_rows(self, cache, rows: list[int]) -> None:
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[rows]
        idx = torch.tensor(rows, device=self.tm.device)
        if isinstance(cache, models.KVCache):
            cache.keep_rows(idx)
        for layer in cache.layers if cache is not None and not isinstance(cache, models.KVCache) else ():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        if self._drafted is not None:
            self._drafted = self._drafted.index_select(0, idx)

    def keep_keys(self, cache, columns) -> None:
        """Keep only these cache positions of every layer (a served batch drops the keys of rows that left)."""
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[:, np.asarray(columns, dtype=np.int64)]
        if isinstance(cache, models.KVCache):
            cache.keep_columns(torch.as_tensor(np.asarray(columns, dtype=np.int64), device=self.tm.device))
            return
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                idx = torch.as_tensor(columns, device=layer.keys.device)
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)

    def rng(self, sampling: Sampling):
        """The generator sampling draws from: this decoder's own, seeded by `sampling.seed`
        (reseeded when the seed changes), never torch's global one."""
        if self.generator is None or self._seeded != sampling.seed:
            self.generator = torch.Generator(device=self.tm.device)
            if sampling.seed is None:
                self.generator.seed()  # this generator only: torch.seed() would reseed the global one
            else:
                self.generator.manual_seed(sampling.seed)
            self._seeded = sampling.seed
        return self.generator

    def logits(self, cache, input_ids, positions, mask, read, valid=None, extra=(), travelled=None) -> torch.Tensor:
        """One forward of `input_ids` (as `step`): the float32 logits of the `read` columns,
        on the device. `step` and `speculate` reduce them; a subclass may inspect them. `extra`:
        host arrays (integers, booleans) the caller needs on the device beside, appended to the
        list `travelled` there; on mars's own forward they travel in the step's one copy."""
        if self.lean is not None:
            unique, _, where, moved = self._lean_logits(cache, input_ids, positions, mask, read, valid, extra, True)
            logits = unique[where]
        else:
            unique, where = self._read_logits(cache, input_ids, positions, mask, read, valid)
            logits = unique[torch.from_numpy(where).to(unique.device)]
            moved = [torch.from_numpy(np.ascontiguousarray(a)).to(unique.device) for a in extra]
        if travelled is not None:
            travelled.extend(moved)
        return logits

    def _read_logits(self, cache, input_ids, positions, mask, read, valid=None) -> tuple[torch.Tensor, np.ndarray]:
        """One forward: the float32 logits of each distinct (row, column) that `read` names,
        (n, vocab), and where each read finds its own among them, (b, k) (None from mars's own
        forward where the reads are the distinct rows in order: read c of row r is r * k + c). A row that
        feeds fewer drafts than the widest repeats its last read: the head (a large matrix
        product on a small model) runs once per distinct read. With `valid` (b, q), reads at
        holes (never used) share the row's first; mars's own forward computes the real positions
        alone where the decoder `skips_holes`, transformers' modules compute them all."""
        if self.lean is not None:
            return self._lean_logits(cache, input_ids, positions, mask, read, valid)[:2]
        dev = self.tm.device
        input_ids, positions = np.asarray(input_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        mask = dense_mask(mask, len(input_ids))
        ids = torch.from_numpy(np.ascontiguousarray(input_ids)).to(dev)
        pos = torch.from_numpy(np.ascontiguousarray(positions)).to(dev)
        if self.slides:
            attn = self._window_masks(cache, mask, positions)
        else:
            attn = None if mask is None else additive_mask(mask, self.tm.dtype, dev)
        if self.tm.gate is not None:  # the masks' places read off the host's ids: no copy back
            self.tm.gate.set_host(input_ids, dev)
        b, q = ids.shape
        read = np.asarray(read)
        if valid is not None:  # a read at a hole is never used: let it share the row's first read
            read = np.where(np.take_along_axis(np.asarray(valid), read, axis=1), read, read[:, :1])
        flat = (np.arange(b)[:, None] * q + read).reshape(-1)
        distinct, where = np.unique(flat, return_inverse=True)
        exact = self._exact_rows(input_ids, valid)
        out = self.body(  # the body alone: the head's rows are reads, not positions
            input_ids=ids,
            position_ids=pos,
            attention_mask=attn,
            use_cache=cache is not None,
            **cache_argument(self.body, cache),
            **({ROW_EXACT: (exact, {})} if exact is not None else {}),
        )
        hidden = out.last_hidden_state
        picked = hidden.reshape(b * q, hidden.shape[-1]).index_select(0, torch.from_numpy(distinct).to(dev))
        return self.head(picked[None])[0].float(), where.reshape(read.shape)

    def _lean_logits(self, cache, input_ids, positions, mask, read, valid=None, extra=(), where_on_device=False):
        """`_read_logits` on mars's own forward (models.Transformer): (the logits of the distinct
        reads, where each read finds its own, on the host and, with `where_on_device`, on the device (else
        None), `extra` on the device).
        Everything the step takes is laid out on the host first and copied to the device in one
        transfer: the real positions' ids, the positions, the rows read and where each read finds
        its row, where the real positions sit (a batch with holes, packed layers), `extra` (integer
        or bool arrays a caller needs beside: speculate's drafts and tree), and the attention mask:
        a StepMask's `see` and `start` and its keys as bytes (the forward builds the mask on the
        device), or a bool mask given as an array, as bytes."""
        asked = (cache, input_ids, positions, mask, read, valid, extra, where_on_device)
        dev = self.tm.device
        # The step's few values as plain lists (arrays or lists of rows given): a step's host work is a
        # few dozen numbers, and each array operation costs more than its arithmetic.
        ids_of = rows_of(input_ids)
        b, fed = len(ids_of), len(ids_of[0])
        own = cache if cache is not None else self._lean_cache(b)
        cached = own.length
        if mask is None:  # plain causal over the cache
            mask = StepMask(cached, fed)
        elif isinstance(mask, StepMask) and (mask.cached, mask.width) != (cached, fed):
            raise ValueError(
                f"a mask of {mask.cached} cached keys and {mask.width} columns for a step of {cached} and {fed}"
            )
        if self.buckets:
            width = models.graph_width(fed) if self.fixed else bucket(fed)
            padded = pad_width(
                np.asarray(ids_of, dtype=np.int64), np.asarray(positions, dtype=np.int64), mask, valid, cached, width
            )
            ids_of, positions, mask, valid = rows_of(padded[0]), padded[1], padded[2], padded[3]
        q = len(ids_of[0])
        reads_of = rows_of(read)
        shape = (len(reads_of), len(reads_of[0]))  # the reads'
        ids = list(chain.from_iterable(ids_of))
        real = None
        if valid is not None:
            valid_of = rows_of(valid)
            if all(all(row) for row in valid_of):  # no holes: as if none were marked
                valid = None
            else:  # a read at a hole is never used: it shares its row's first read
                reads_of = [[c if ok[c] else row[0] for c in row] for row, ok in zip(reads_of, valid_of)]
                if self.skips_holes:
                    real = [i for i, ok in enumerate(chain.from_iterable(valid_of)) if ok]
        flat = [r * q + c for r, row in enumerate(reads_of) for c in row]
        if all(x < y for x, y in zip(flat, flat[1:])):  # distinct and in order already (a row alone, most steps)
            distinct, where, in_order = flat, list(range(len(flat))), True
        else:  # np.unique's distinct values and inverse
            distinct = sorted(set(flat))
            at = {v: i for i, v in enumerate(distinct)}
            where = [at[v] for v in flat]
            in_order = False
        reads = distinct
        length = []
        if self.fixed:  # the mask over the cache's room, the reads padded to a bucket, the length
            mask, padded = self._room_inputs(own, mask, np.asarray(distinct, dtype=np.int64), b, q)
            reads, length = padded.tolist(), [cached]
        if real is not None:
            # A read of a row that is all holes is never used: any real row's output will do.
            ids = [ids[i] for i in real]
            reads = [min(bisect.bisect_left(real, d), len(real) - 1) for d in distinct]
        # A gated adapter's gate: its delta on the rows fed the mask (models.Linear). Where they are one
        # run of rows, a slice of them; elsewhere (and in a compiled step's one graph) a 0/1 column
        # (n, 1) that travels in the step's one copy.
        gate, column = None, None
        if self.tm.gate is not None:
            mask_id = self.tm.gate.mask_id
            spots = [i for i, t in enumerate(ids) if t == mask_id]
            if self.compiled is None and spots and spots[-1] - spots[0] + 1 == len(spots):
                gate = (slice(spots[0], spots[-1] + 1), None)
            elif spots or self.compiled is not None:
                column = [int(t == mask_id) for t in ids]
        compact = isinstance(mask, StepMask)
        views = compact and mask.see is not None
        bools = (mask.keys if compact else mask,)
        extra = [np.asarray(e) for e in extra]
        # (values, the shape seen on the device: None for a flat one)
        numbers = [(ids, None), (list(chain.from_iterable(rows_of(positions))), (b, q)), (reads, None)]
        numbers += [(where, shape)] if where_on_device else []
        if views:
            numbers += [(list(chain.from_iterable(rows_of(a))), (b, q)) for a in (mask.see, mask.start)]
        numbers += [(e.reshape(-1).tolist(), e.shape if e.ndim != 1 else None) for e in extra]
        numbers += ([(real, None)] if real is not None else []) + ([(length, None)] if length else [])
        numbers += [(column, (len(column), 1))] if column else []
        # One int64 buffer: the numbers, then the bool mask's bytes (padded to whole int64s), made by
        # Python's own array type (no array library's code to wake between two forwards).
        host = array.array("q", chain.from_iterable(v for v, _ in numbers))
        count = len(host)
        flags = None if bools[0] is None else np.ascontiguousarray(bools[0], dtype=bool).reshape(-1)
        nbytes = 0 if flags is None else flags.size
        if flags is not None:
            host.frombytes(flags.tobytes() + bytes(-nbytes % 8))
        buf = torch.frombuffer(host, dtype=torch.int64)
        kind = self._device_kind
        if kind == "cuda":
            buf = buf.pin_memory().to(dev, non_blocking=True)
        elif kind != "cpu":
            buf = buf.to(dev)
        pieces = buf.split_with_sizes([len(v) for v, _ in numbers] + [len(host) - count])
        parts = [part if shape is None else part.view(shape) for (_, shape), part in zip(numbers, pieces)]
        allowed = pieces[-1].view(torch.bool)[:nbytes].view(bools[0].shape) if flags is not None else None
        parts.reverse()  # taken in order from the end
        ids_d, pos_d, reads_d = parts.pop(), parts.pop(), parts.pop()
        where_d = parts.pop() if where_on_device else None
        see_d, start_d = (parts.pop(), parts.pop()) if views else (None, None)
        extra_d = [parts.pop().bool() if e.dtype == bool else parts.pop() for e in extra]
        real_d = parts.pop() if real is not None else None
        length_d = parts.pop() if length else None
        if column:  # the gate's column: the 0/1 that travelled (in the model's dtype for a compiled graph)
            column = parts.pop()
            gate = (None, column if self.compiled is None else column.to(self.tm.dtype))
        exact = self._exact_rows(ids_of, valid)
        inputs = models.StepInputs(
            ids=ids_d,
            positions=pos_d,
            reads=reads_d,
            batch=b,
            width=q,
            real=real_d,
            gate=gate,
            exact=exact,
            allowed=None if compact else allowed,
            keys=allowed if compact else None,
            see=see_d,
            start=start_d,
            length=length_d,
        )
        try:
            logits = self.forward(own, inputs)
        except Exception as error:
            if self.forward is not self.compiled or self.on_compile_error is None:
                raise
            self._drop_compiled(error)  # nothing was written into the cache: the step again, eager
            return self._lean_logits(*asked)
        if self.fixed:
            logits = logits[: len(distinct)]  # the padded reads' rows dropped
        own.length = cached + fed  # the padding's keys lie past the length: the next step writes over them
        where = None if in_order else np.array(where, dtype=np.int64).reshape(shape)
        return logits, where, where_d, extra_d

    def _room_inputs(self, cache, mask, distinct: np.ndarray, b: int, q: int):
        """A fixed-shape step's mask and reads (models.CompiledStep with `fixed`): the mask's keys
        laid out over the cache's room (its room made first, for q more columns of b rows), every
        part of a StepMask given so that every kind of step meets one graph of its shape; the reads
        padded by repeating the last (to the width, or a bucket of them past the widest)."""
        cached = cache.length
        cache.reserve(q, b)
        cache.fit_rows()
        room = cache.capacity
        if isinstance(mask, StepMask):
            keys = np.ones((b, cached + q), dtype=bool) if mask.keys is None else np.asarray(mask.keys, dtype=bool)
            see = np.broadcast_to(np.arange(q, dtype=np.int64), (b, q)) if mask.see is None else mask.see
            see = np.asarray(see, dtype=np.int64)
            start = see if mask.start is None else np.asarray(mask.start, dtype=np.int64)
            mask = StepMask(cached, q, models.room_layout(keys, cached, room), see, start)
        else:
            mask = models.room_layout(np.asarray(mask, dtype=bool), cached, room)
        n = distinct.size
        # A step of the width buckets reads its width's rows (a row's, or the batch's where it reads
        # more): the head over a few more rows costs a device little, and a graph per read count would
        # multiply the graphs. A prompt's wider step reads a bucket of what it reads (its last rows).
        wide = q > WIDTH_BUCKETS[-1]
        target = models.graph_width(n) if wide else (q if n <= q else b * q)
        reads = np.concatenate([distinct, np.repeat(distinct[-1:], target - n)])
        return mask, reads

    def _exact_rows(self, input_ids, valid) -> np.ndarray | None:
        """The rows row-exact attention computes as a one-token forward would (None where the decoder
        runs none): those fed a real token, whose outputs may be taken as AR's; masks only propose
        drafts, and holes nothing."""
        if not self.row_exact:
            return None
        exact = np.ones(np.shape(input_ids), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        return exact if self.tm.mars is None else exact & (np.asarray(input_ids) != self.tm.mars.mask_token_id)

    def _window_masks(self, cache, mask, positions):
        """The attention argument of a model with sliding layers on transformers' modules
        (attention_masks), with the positions of the cached keys (kept on the cache, cut to its
        length: crops only shorten it) followed by the step's own."""
        positions = np.asarray(positions, dtype=np.int64)
        b, q = positions.shape
        cached = 0 if cache is None else cache.get_seq_length()
        before = getattr(cache, "key_positions", None)
        before = np.zeros((b, 0), np.int64) if before is None or not cached else before[:, :cached]
        keys = np.concatenate([before, positions], axis=1)
        if cache is not None:
            cache.key_positions = keys
        if mask is None:  # plain causal on top of the cache, no holes
            mask = decode_mask(np.ones(keys.shape, dtype=bool), q)
        return attention_masks(mask, positions, keys, self.windows, self.tm.dtype, self.tm.device)

    @models.inference
    def step(
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
        if not sampling.greedy:  # every read draws its own token: the reads stay apart
            logits = self.logits(cache, input_ids, positions, mask, read, valid)
            chosen, conf = slot_predictions(logits, metric, sampling, self.rng(sampling))
            lp = read_logprobs(logits, chosen, logprobs) if logprobs is not None else []
            host = to_host(chosen, conf, *lp)
            return StepOutput(host[0], host[1], logprobs=ReadLogprobs(*host[2:]) if logprobs is not None else None)
        unique, where = self._read_logits(cache, input_ids, positions, mask, read, valid)
        shape = np.shape(read) if isinstance(read, np.ndarray) else (len(read), len(read[0]))
        if where is None:  # each read its own row, in order: each result's rows reshaped to the reads'

            def by_read(a):
                return a.reshape(shape + a.shape[1:])
        else:

            def by_read(a):
                return a[where]

        chosen, conf = slot_predictions(unique, metric, sampling)
        # One device-to-host copy a step: the ids, their confidences (none in AR mode: zeros),
        # the runners-up and the log-probabilities together.
        lp = read_logprobs(unique, chosen, logprobs) if logprobs is not None else []
        top = []
        if runners_up:  # the distinct rows of the reads from `runners_up_from` on, as one range
            if where is None:  # row r's read c is row r * k + c
                b, k = shape
                lo, hi = (runners_up_from, b * k) if runners_up_from < k else (0, 0)
            else:
                rows = where[:, runners_up_from:].ravel().tolist()
                lo, hi = (min(rows), max(rows) + 1) if rows else (0, 0)
            top = [unique[lo:hi].topk(runners_up + 1, dim=-1).indices] if hi > lo else []
        host = to_host(*([chosen] + ([conf] if metric is not None else []) + top + lp))
        chosen = host.pop(0)
        ids = by_read(chosen)
        conf = by_read(host.pop(0)) if metric is not None else np.zeros(ids.shape, np.float32)
        second = None
        if runners_up:  # the rows outside the range have none (-1)
            every = np.full((unique.shape[0], runners_up), -1, dtype=np.int64)
            if top:
                every[lo:hi] = runners_up_of(host.pop(0), chosen[lo:hi], runners_up)
            second = by_read(every)
        return StepOutput(ids, conf, second, ReadLogprobs(*map(by_read, host)) if logprobs is not None else None)

    @models.inference
    def speculate(
        self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling, logprobs=None, tree=None, ranks=0
    ):
        """Lossless sampling (mars.core.decode.loop.StepBackend.speculate), on the device."""
        tree_arrays = () if tree is None else (tree.nodes, tree.anchors, tree.live)
        travelled = []  # the drafts and the tree, on the device
        logits = self.logits(cache, input_ids, positions, mask, read, None, (drafts, n_drafts, *tree_arrays), travelled)
        gen = self.rng(sampling)
        width = drafts.shape[1]
        masks = logits.shape[1] - width - 1 if tree is None else tree.masks
        mask_logits = logits[:, width + 1 : width + 1 + masks]
        p = sampling_probs(logits[:, : width + 1], sampling)
        device = p.device
        dr, n = travelled[0], travelled[1]
        u = torch.rand(dr.shape, generator=gen, device=device) if width else None
        q = self._drafted[:, :width] if width else None
        kept, dist = speculative_sampling(TorchOps(device), p, q, dr, n, u)
        if tree is not None:  # one node at least (verify.sampled_tree)
            ids, anchors, live = travelled[2:]
            u_tree = torch.rand(ids.shape, generator=gen, device=device)
            chosen, dist = tree_sampling(TorchOps(device), dist, kept, ids, anchors, live, u_tree)
        token = torch.multinomial(dist, 1, generator=gen)[:, 0]
        extra = []
        if tree is not None:
            rows = torch.arange(p.shape[0], device=device)
            at = chosen.clamp(min=0)
            node_read = width + 1 + masks + (1 + masks) * at  # the taken node's read (node 0's where none)
            node_logits = logits[rows, node_read]
            after = torch.multinomial(sampling_probs(node_logits, sampling), 1, generator=gen)[:, 0]
            token = torch.where(chosen >= 0, ids[rows, at], token)
            group = logits[rows[:, None], node_read[:, None] + 1 + torch.arange(masks, device=device)[None, :]]
            mask_logits = torch.where((chosen >= 0)[:, None, None], group, mask_logits)
            extra = [chosen, after]
        q_next = sampling_probs(mask_logits, sampling)
        proposals = torch.multinomial(q_next.reshape(-1, q_next.shape[-1]), 1, generator=gen).reshape(q_next.shape[:-1])
        self._drafted = q_next
        parts = [kept, token, proposals, *extra]
        if logprobs is not None:
            # The ids taken at the first 1 + width reads: the drafts kept, then the token (then `after`).
            taken = torch.cat([dr, dr.new_zeros((dr.shape[0], 1))], dim=1).scatter(1, kept[:, None], token[:, None])
            reads = logits[:, : width + 1]
            if tree is not None:
                taken = torch.cat([taken, after[:, None]], dim=1)
                reads = torch.cat([reads, node_logits[:, None]], dim=1)
            parts += read_logprobs(reads, taken, logprobs)
        if ranks:
            parts += read_logprobs(mask_logits, proposals, ranks)
        host = to_host(*parts)
        kept, token, proposals, *rest = host
        node, after = (rest.pop(0), rest.pop(0)) if extra else (None, None)
        lp_out = ReadLogprobs(*rest[:3]) if logprobs is not None else None
        ranked = ReadLogprobs(*rest[-3:]) if ranks else None
        return Speculated(kept, token, proposals, node, after, lp_out, ranked)


_HOST_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def to_host(*arrays: torch.Tensor, pack: bool | None = None) -> list[np.ndarray]:
    """Device tensors (integers, booleans, float32) copied to the host in one transfer: each
    flattened to int64 (a float32 by its bits), joined, copied, then split and given back its
    dtype and shape, bit for bit. One tensor already on the CPU is read as it is (`pack`
    True packs it anyway); several are packed as on a device, so a step reads back once wherever
    it runs (the join costs microseconds)."""
    if not (pack if pack is not None else len(arrays) > 1 or any(a.device.type != "cpu" for a in arrays)):
        return [a.numpy() for a in arrays]
    flat = [
        a.reshape(-1).view(torch.int32).long() if a.dtype == torch.float32 else a.reshape(-1).long() for a in arrays
    ]
    host = torch.cat(flat).cpu().numpy()
    out, at = [], 0
    for a in arrays:
        part = host[at : at + a.numel()]
        at += a.numel()
        part = (
            part.astype(np.int32).view(np.float32) if a.dtype == torch.float32 else part.astype(_HOST_DTYPES[a.dtype])
        )
        out.append(part.reshape(tuple(a.shape)))
    return out


class TorchOps:
    """mars.core.acceptance.DeviceOps on torch tensors of one device."""

    def __init__(self, device):
        self.device = device

    def arange(self, n):
        return torch.arange(n, device=self.device)

    def zeros_int(self, n):
        return torch.zeros(n, dtype=torch.long, device=self.device)

    def zeros_like(self, x):
        return torch.zeros_like(x)

    def take(self, x, ids):
        return x.gather(-1, ids[..., None])[..., 0]

    def leading(self, ok):
        return ok.long().cumprod(1).sum(1)

    def where(self, condition, a, b):
        return torch.where(condition, a, b)

    def minimum(self, x, n):
        return x.clamp(max=n)

    def at_least(self, x, low):
        return x.clamp(min=low)

    def row_sum(self, x):
        return x.sum(-1, keepdim=True)


def slot_predictions(logits: torch.Tensor, metric: str, sampling: Sampling, generator=None):
    """(ids, confidence) per slot, on the device. Confidence is measured on the untempered
    distribution: of the drawn token for `probability`, of the slot for entropy and margin.
    No metric (greedy AR): the argmax alone, as `generate` takes it, and no confidence (None)."""
    if metric is None and sampling.greedy:
        return logits.argmax(-1), None
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    if sampling.greedy:
        top = probs.topk(2 if metric == "margin" else 1, dim=-1)
        chosen = top.indices[..., 0]
    else:
        chosen = sample(logits, sampling, generator)
    if metric == "probability":
        conf = probs.gather(-1, chosen[..., None])[..., 0]
    elif metric == "margin":
        top2 = top.values if sampling.greedy else probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    else:
        conf = -(probs * logp).nan_to_num().sum(-1)
    return chosen, conf


def read_logprobs(logits: torch.Tensor, ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """[the log-probability of `ids` at each read, the n most likely ids there, their log-probabilities],
    under the untempered distribution, on the device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(n, dim=-1)
    return [logp.gather(-1, ids[..., None].long())[..., 0], top.indices, top.values]


def sample(logits: torch.Tensor, sampling: Sampling, generator=None) -> torch.Tensor:
    probs = sampling_probs(logits, sampling)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution sampling draws from: tempered, then top-k and top-p filtered."""
    z = logits.float()
    z = (z - z.amax(-1, keepdim=True)) / sampling.divisor
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = z.topk(sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (cum - sorted_z.softmax(-1)) >= sampling.top_p
        drop[..., 0] = False
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    return z.softmax(-1)
