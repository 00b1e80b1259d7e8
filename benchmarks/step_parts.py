"""Where a decoding step's time goes outside the model forward: AR and the default lossless mode.

    python benchmarks/step_parts.py                         # torch, the embedded default, 8 test prompts, 64 tokens
    python benchmarks/step_parts.py --backend mlx           # the same prompts through the MLX backend
    python benchmarks/step_parts.py --device cuda           # on a GPU: the forward timed between synchronisations
    python benchmarks/step_parts.py --evict-mb 512          # also the replayed host with the weights' stream

Decodes the prompts through `mars.session.Session` as `mars generate` does (the plan from the
command's own option defaults, the checkpoint's default mode and its cost-aware feed), once
at threshold 1.0 (AR) and once in the checkpoint's default lossless mode, after a short
warm-up of each, and splits the wall time of every loop step into three parts:

- forward: the model's body and LM head (torch: from the body's forward pre-hook, or the call
  of mars's own forward (mars/backends/torch/models/), to the head's forward hook,
  synchronising the device at both ends on CUDA; MLX: from the body's first layer to the
  evaluated logits of the reads, forced with `mx.eval`, so building MLX's lazy graph counts
  here);
- reduce + D2H: what `step`/`speculate` do after the forward: argmax, top-k and
  confidences, the device-to-host copies and the numpy conversions of their results;
- host: everything else the loop does, total - forward - reduce + D2H, itemised as step
  inputs (inside the decoder, before the forward: ids, positions, the additive mask, the
  gate, host-to-device copies), cache (crop, keep_rows, new_cache), layout (the strategy's
  lay_out, keys and mask: the attention mask; "feed plan" in results before 2026-12-05), drafting (which drafts and
  how wide,
  before the step; statistics and cost curve after it), acceptance (verification or threshold acceptance, after the
  step's results are on the host), commit (the strategy's cache bookkeeping) and loop (the rest: rows taking tokens,
  compaction, statistics, setting up each call).

Timers wrap the decoder's methods and the loop's functions from this script (nothing in
`mars` changes); host work is what the loop's clock saw minus the two timed device parts.
Transfers are counted in one untimed pass of each mode before the timed rounds, with the
counters alone installed: a counter wraps torch's or numpy's own functions, which would
otherwise add its cost to the host part (0.3-0.8 ms a step here before 2026-12-06).

torch with mars's own forward also reports each mode's host work with the forward replayed
("replayed"): the mode decoded once more with the forward's answers recorded (its top ids per
read), then timed with them handed back as logits of the same shape, the feed's curves frozen and
its state put back each round so that every pass decides alike (None where a replay decided
otherwise). On a CPU the real forward streams the weights through the caches and evicts the
loop's own code and data between steps; a GPU runs the forward beside the host, which then sees
the replayed figure. `--evict-mb N` replays each mode once more with N MB read at every replayed
forward ("replayed_evicted"), the weights' stream without the forward: on this CPU, 512 MB (about
the default model's float32 weights) brings the replayed host work back to the measured one's.

Beside the modes, at batch 1 on torch, a peer: a plain Python loop of greedy decoding over the
loaded transformers model and its `DynamicCache` (`plain_loop`), its forward, reduction and host
part timed alike ("plain_loop"), and whether its replies are mars's AR replies; and, with mars's own
forward, the least lossless loop over mars's decoder step (`chain_loop`: the longest draft on
offer and the plan's masks, no feed, groups or trees), whose host part is the decoder's own step
inputs and a few list operations ("chain_loop"), then the wall time a token of AR, the lossless
mode and that loop, untimed and interleaved ("wall_ms_per_token_interleaved").
Device-to-host transfers are counted where the host reads a device array: torch's `.cpu()`,
`.numpy()`, `.tolist()`, `.item()` and truth/int/float tests of a tensor (a `.numpy()` of what
`.cpu()` returned counts once), MLX's `np.array`/`np.asarray` of an `mx.array` in the MLX
backend; on CUDA, torch's sync debug mode also counts every synchronising operation.
Host-to-device copies are counted where code of the `mars` package (the frame that calls: not
torch's, transformers' or mlx_lm's code, not this script) makes a device array of host data:
torch's `torch.from_numpy`, `torch.frombuffer`, `torch.tensor`, `torch.as_tensor` and `torch.asarray`
of a numpy array, a buffer or Python data (of a CPU tensor only where the result is on another device), and on CUDA
`.to`, `.cuda()` and `.copy_` of a CPU tensor to the device (the `.to` of what such a call just
made, or of its pinned copy, counts once with it: `torch.from_numpy(a).to(dev)` is one copy);
MLX's `mx.array`/`mx.asarray` of numpy or Python data (not of an `mx.array`) in the MLX backend
and `mars.core`. On a CPU a "transfer" copies nothing: it is the place where a device would
have to. Each mode reports ms per step by part, each part's share, tokens per forward,
transfers each way (D2H, H2D) and bytes per step, and
the code locations of the transfers. Prints a table; writes JSON to --output (default
benchmarks/results/step_parts_<backend>_<UTC time>.json). The instrumented replies are the
plain ones: `tests/test_step_parts.py` checks it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# torch's own Python code: a transfer is located at the first frame outside it.
TORCH_DIR = (
    str(Path(importlib.util.find_spec("torch").origin).parent) + os.sep if importlib.util.find_spec("torch") else "\0"
)
# The mars package's code: a host-to-device copy counts where a frame of it asks for one.
MARS_DIR = (
    str(Path(importlib.util.find_spec("mars").origin).parent) + os.sep if importlib.util.find_spec("mars") else "\0"
)
# The host part's items, in the order printed.
HOST_ITEMS = ("step inputs", "cache", "layout", "drafting", "acceptance", "commit", "loop")
PART_NAMES = ("forward", "reduce + D2H", "host")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded default with its shipped MARS weights")
    p.add_argument("--adapter-path", default=None)
    p.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "test.jsonl"))
    p.add_argument("--limit", type=int, default=8, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    p.add_argument("--backend", choices=["torch", "mlx"], default="torch")
    p.add_argument("--device", default="auto", help="torch: cpu, cuda, cuda:1, mps or auto")
    p.add_argument("--dtype", default="auto", help="torch: auto, float32, float16 or bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--rounds", type=int, default=1, help="timed rounds, AR and lossless interleaved (every other round reversed)"
    )
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the untimed warm-up of each mode (0: none)")
    p.add_argument(
        "--remeasure-cost",
        action="store_true",
        help=(
            "measure the per-forward cost curve again first (as `mars generate --remeasure-cost`), "
            "e.g. once the machine is quiet"
        ),
    )
    p.add_argument(
        "--evict-mb",
        type=int,
        default=0,
        help=(
            "torch, mars's own forward: also replay each mode with this many MB read at every replayed "
            "forward (what the weights' stream does to the host's caches on a CPU); 0: not"
        ),
    )
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


class Clock:
    """Nested wall-clock regions: each region's inclusive and exclusive seconds (exclusive:
    less the regions opened inside it). Records only while `active`."""

    def __init__(self):
        self.active = False
        self.stack: list[list] = []  # [label, start, seconds of children]
        self.exclusive: dict[str, float] = defaultdict(float)
        self.inclusive: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()

    def enter(self, label: str) -> None:
        self.stack.append([label, time.perf_counter(), 0.0])

    def leave(self, label: str) -> float:
        now = time.perf_counter()
        top, start, children = self.stack.pop()
        if top != label:
            raise RuntimeError(f"step_parts: region {label!r} closed inside {top!r}")
        spent = now - start
        self.inclusive[label] += spent
        self.exclusive[label] += spent - children
        self.calls[label] += 1
        if self.stack:
            self.stack[-1][2] += spent
        return spent

    def unwind(self, label: str) -> None:
        """Close `label` and every region left open inside it, timing none (an exception passes)."""
        while self.stack and self.stack.pop()[0] != label:
            pass

    def timed(self, label: str, fn):
        clock = self

        def wrapper(*args, **kwargs):
            if not clock.active:
                return fn(*args, **kwargs)
            clock.enter(label)
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                clock.unwind(label)
                raise
            clock.leave(label)
            return out

        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", label)
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        return wrapper

    def reset(self) -> None:
        self.stack.clear()
        self.exclusive.clear()
        self.inclusive.clear()
        self.calls.clear()


class Transfers:
    """Transfers one way (device to host, or host to device) counted while `active`: count,
    bytes and the code location of each."""

    def __init__(self):
        self.active = False
        self.count = 0
        self.bytes = 0
        self.sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # "file:line (function)" -> [count, bytes]
        self.syncs = 0  # CUDA: synchronising operations torch's sync debug mode flagged
        self.per_step: list[int] = []

    def record(self, nbytes: int, depth: int = 2, where: str | None = None) -> None:
        """Count one transfer at `where`, or (None) at the first frame from `depth` up outside this
        script and torch's own Python code: where the read was asked for."""
        if where is None:
            frame = sys._getframe(depth)
            while frame is not None and (
                frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(TORCH_DIR)
            ):
                frame = frame.f_back
            where = "?" if frame is None else site_of(frame)
        self.count += 1
        self.bytes += int(nbytes)
        site = self.sites[where]
        site[0] += 1
        site[1] += int(nbytes)

    def reset(self) -> None:
        self.count = self.bytes = self.syncs = 0
        self.sites.clear()
        self.per_step = []


def site_of(frame) -> str:
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def mars_caller() -> str | None:
    """The code location of the first frame outside this script (the caller of the wrapper that
    asks), where that frame is the `mars` package's own code; None where it is not (torch's,
    transformers', mlx_lm's)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(MARS_DIR):
        return None
    return site_of(frame)


def short_path(path: str) -> str:
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        parts = p.parts
        return str(Path(*parts[parts.index("site-packages") + 1 :])) if "site-packages" in parts else path


class Patches:
    """Attributes replaced for the measurement, put back by `undo`."""

    _MISSING = object()

    def __init__(self):
        self.undo_list: list[tuple] = []

    def set(self, obj, name: str, value) -> None:
        # What the object itself holds (an inherited attribute is deleted again, not copied in).
        self.undo_list.append((obj, name, vars(obj).get(name, self._MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self.undo_list:
            obj, name, old = self.undo_list.pop()
            if old is self._MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


class Profiler:
    """Installs the timers (`count` False) or the transfer counters (`count` True) on a session's
    decoder and the decoding loop. The two are never installed together: a counter wraps torch's
    or numpy's own functions, and its cost must not be timed as the loop's."""

    def __init__(self, session, count: bool = False):
        self.session = session
        self.count = count
        self.clock = Clock()
        self.transfers = Transfers()
        self.h2d = Transfers()
        self.patches = Patches()
        self.handles: list = []
        self.backend = session.backend
        self.cuda = False
        self.forward_graph = 0.0  # MLX: seconds of the forward spent building the lazy graph
        self.from_cpu: set[int] = set()  # torch: see _torch
        self.from_host: set[int] = set()  # torch: see _torch_h2d

    # -- the loop's own functions and classes ------------------------------------------------

    def _loop(self) -> None:
        from mars.core.decode import drafting, step, strategies
        from mars.core.decode import loop as decoding

        c, P = self.clock, self.patches
        transfers, h2d, profiler = self.transfers, self.h2d, self

        advance = decoding._advance

        def loop_step(*args, **kwargs):
            if not c.active:
                return advance(*args, **kwargs)
            before, before_h2d = transfers.count, h2d.count
            profiler.from_cpu.clear()
            profiler.from_host.clear()
            c.enter("loop")
            try:
                out = advance(*args, **kwargs)
            except BaseException:
                c.unwind("loop")
                raise
            c.leave("loop")
            transfers.per_step.append(transfers.count - before)
            h2d.per_step.append(h2d.count - before_h2d)
            return out

        P.set(decoding, "_advance", loop_step)
        for name in ("verify", "accept_by_threshold", "take_confident"):
            P.set(step, name, c.timed("acceptance", getattr(step, name)))
        for cls in (strategies.WindowStrategy, strategies.BlockStrategy):
            for name in ("lay_out", "keys", "mask"):
                P.set(cls, name, c.timed("layout", cls.__dict__[name]))
            P.set(cls, "commit", c.timed("commit", cls.__dict__["commit"]))
        for name in ("before_step", "after_step"):
            P.set(drafting.Drafting, name, c.timed("drafting", drafting.Drafting.__dict__[name]))

    # -- the decoder ---------------------------------------------------------------------------

    def _decoder(self) -> None:
        d, c, P = self.session.decoder, self.clock, self.patches
        for name in ("new_cache", "crop", "keep_rows", "keep_keys"):
            if hasattr(d, name):
                P.set(d, name, c.timed("cache", getattr(d, name)))
        for name in ("step", "speculate"):
            P.set(d, name, c.timed("reduce + D2H", getattr(d, name)))
        if self.backend == "mlx":
            self._mlx(d)
        else:
            self._torch(d)

    def _torch(self, d) -> None:
        import torch

        c, P, t = self.clock, self.patches, self.transfers
        self.cuda = d.tm.device.type == "cuda"
        cuda = self.cuda

        def sync():
            if cuda:
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize(d.tm.device)
                torch.cuda.set_sync_debug_mode(mode)

        def forward_begins(module, args):
            if c.active:
                sync()  # what was queued before belongs to the inputs' time
                c.enter("forward")

        def forward_ends(module, args, out):
            if c.active and c.stack and c.stack[-1][0] == "forward":
                sync()
                c.leave("forward")

        # mars's own forward (compiled or not), as the decoder calls it: its call begins the forward,
        # the head's hook ends it
        lean = getattr(d, "forward", None) if getattr(d, "lean", None) is not None else None
        if lean is not None:

            class TimedForward:
                def __getattr__(self, name):
                    return getattr(lean, name)

                def __call__(self, *args, **kwargs):
                    forward_begins(None, args)
                    out = lean(*args, **kwargs)
                    forward_ends(None, args, out)  # where no head's hook did (a replayed forward)
                    return out

            P.set(d, "_lean_logits", c.timed("step inputs", d._lean_logits))
            P.set(d, "forward", TimedForward())
        else:
            P.set(d, "_read_logits", c.timed("step inputs", d._read_logits))
            self.handles.append(d.body.register_forward_pre_hook(forward_begins))
        self.handles.append(d.head.register_forward_hook(forward_ends))

        from_cpu = self.from_cpu  # ids of what a counted `.cpu()` returned: their `.numpy()` is no second transfer

        def size(x) -> int:
            return x.numel() * x.element_size()

        def wrap(name, nbytes, mark=False, skip_marked=False, when=None):
            original = getattr(torch.Tensor, name)

            def method(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                if (
                    t.active
                    and (when is None or when(self, args, kwargs))
                    and not (skip_marked and id(self) in from_cpu)
                ):
                    t.record(nbytes(self), depth=2)
                    if mark and isinstance(out, torch.Tensor):
                        from_cpu.add(id(out))
                return out

            method.__name__ = name
            P.set(torch.Tensor, name, method)

        def to_host(self, args, kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, torch.Tensor):
                target = target.device
            try:
                return self.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
            except (TypeError, RuntimeError):
                return False

        if not self.count:
            return
        wrap("cpu", size, mark=True)
        if cuda:  # on a CPU no `.to` reads a device: leave the forward's many dtype casts unwrapped
            wrap("to", size, mark=True, when=to_host)
        wrap("numpy", size, skip_marked=True)
        wrap("tolist", size, skip_marked=True)
        wrap("item", lambda x: x.element_size(), skip_marked=True)
        for dunder in ("__bool__", "__int__", "__float__"):
            wrap(dunder, lambda x: x.element_size(), skip_marked=True)
        self._torch_h2d(torch, size)

    def _torch_h2d(self, torch, size) -> None:
        """Host-to-device copies asked for by mars's code: tensors made of host data, and on CUDA
        CPU tensors moved to the device."""
        P, h = self.patches, self.h2d
        # The storages of the CPU tensors counted as made of host data: moving one of them (or a
        # view of it) to the device is the same copy, counted once (`torch.from_numpy(a).to(dev)`).
        from_host = self.from_host

        def storage(x) -> int | None:
            try:
                return x.untyped_storage().data_ptr()
            except (RuntimeError, AttributeError):
                return None

        def making(name):
            original = getattr(torch, name)

            def make(*args, **kwargs):
                out = original(*args, **kwargs)
                if h.active and isinstance(out, torch.Tensor):
                    data = (
                        args[0]
                        if args
                        else kwargs.get("data", kwargs.get("obj", kwargs.get("ndarray", kwargs.get("buffer"))))
                    )
                    # Numpy or Python data counts; a tensor's only from the CPU to a device.
                    if not isinstance(data, torch.Tensor) or (data.device.type == "cpu" and out.device.type != "cpu"):
                        where = mars_caller()
                        if where is not None:
                            h.record(size(out), where=where)
                            if out.device.type == "cpu":
                                from_host.add(storage(out))
                return out

            make.__name__ = name
            make.__doc__ = original.__doc__
            P.set(torch, name, make)

        for name in ("from_numpy", "frombuffer", "tensor", "as_tensor", "asarray"):
            making(name)
        if not self.cuda:  # on a CPU no `.to` moves a tensor to a device: leave the forward's casts unwrapped
            return

        def to_target(x, args, kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, torch.Tensor):
                return target.device
            try:
                return torch.device(target) if isinstance(target, (str, int, torch.device)) else None
            except (TypeError, RuntimeError):
                return None

        def cuda_target(x, args, kwargs):
            return torch.device("cuda")

        def copy_source(x, args, kwargs):
            src = args[0] if args else kwargs.get("src")
            return src if isinstance(src, torch.Tensor) else None

        def moving(name, source, target):
            original = getattr(torch.Tensor, name)

            def method(self, *args, **kwargs):
                out = original(self, *args, **kwargs)
                if h.active:
                    src = source(self, args, kwargs)
                    if src is not None and src.device.type == "cpu" and storage(src) not in from_host:
                        dst = target(self, args, kwargs)
                        if dst is not None and dst.type != "cpu":
                            where = mars_caller()
                            if where is not None:
                                h.record(size(src), where=where)
                return out

            method.__name__ = name
            P.set(torch.Tensor, name, method)

        # A pinned copy of a tensor made of host data is still that data on its way: its `.to` is no second copy.
        pin_memory = torch.Tensor.pin_memory

        def pinned(self, *args, **kwargs):
            out = pin_memory(self, *args, **kwargs)
            if h.active and storage(self) in from_host:
                from_host.add(storage(out))
            return out

        P.set(torch.Tensor, "pin_memory", pinned)
        moving("to", lambda x, a, k: x, to_target)
        moving("cuda", lambda x, a, k: x, cuda_target)
        moving("copy_", copy_source, lambda x, a, k: x.device)

    def _mlx(self, d) -> None:
        import mlx.core as mx
        import numpy as np

        from mars.backends.mlx import decode as mlx_model
        from mars.backends.mlx import forward as mlx_forward

        c, P, t = self.clock, self.patches, self.transfers
        profiler = self
        logits = d.logits
        hidden_states = mlx_model.hidden_states
        marks: dict = {}

        def timed_hidden_states(*args, **kwargs):
            if c.active and c.stack and c.stack[-1][0] == "step inputs":
                c.enter("forward")
                marks["start"] = time.perf_counter()
            return hidden_states(*args, **kwargs)

        def timed_logits(*args, **kwargs):
            if not c.active:
                return logits(*args, **kwargs)
            c.enter("step inputs")
            try:
                out = logits(*args, **kwargs)
                if c.stack[-1][0] == "forward":
                    profiler.forward_graph += time.perf_counter() - marks["start"]
                    mx.eval(out)  # the forward's compute, which would otherwise run inside the step's reduction
                    c.leave("forward")
                return out
            finally:
                c.leave("step inputs")

        P.set(mlx_model, "hidden_states", timed_hidden_states)
        P.set(d, "logits", timed_logits)

        if not self.count:
            return
        # The backend's numpy, with array/asarray counting what they read from an mx.array.
        counted = types.ModuleType("numpy")
        counted.__dict__.update(np.__dict__)

        def reading(fn):
            def read(obj, *args, **kwargs):
                out = fn(obj, *args, **kwargs)
                if t.active and isinstance(obj, mx.array):
                    t.record(out.nbytes, depth=2)
                return out

            return read

        counted.array = reading(np.array)
        counted.asarray = reading(np.asarray)
        P.set(mlx_model, "np", counted)
        P.set(mlx_forward, "np", counted)
        self._mlx_h2d(mx)

    def _mlx_h2d(self, mx) -> None:
        """Host-to-device copies: the `mx` of mars's MLX backend and core modules, with
        `mx.array`/`mx.asarray` counting what they make of numpy or Python data (not of an
        `mx.array`). `mx.array` stays a type to `isinstance`."""
        P, h = self.patches, self.h2d

        def note(args, kwargs, out) -> None:
            data = args[0] if args else kwargs.get("val", kwargs.get("a"))
            if h.active and not isinstance(data, mx.array):
                where = mars_caller()
                if where is not None:
                    h.record(out.nbytes, where=where)

        class Counting(type):
            def __call__(cls, *args, **kwargs):
                out = mx.array(*args, **kwargs)
                note(args, kwargs, out)
                return out

            def __instancecheck__(cls, obj):
                return isinstance(obj, mx.array)

            def __subclasscheck__(cls, sub):
                return issubclass(sub, mx.array)

        class array(metaclass=Counting):
            __doc__ = mx.array.__doc__

        def asarray(*args, **kwargs):
            out = mx.asarray(*args, **kwargs)
            note(args, kwargs, out)
            return out

        counted = types.ModuleType(mx.__name__)
        counted.__dict__.update(mx.__dict__)
        counted.array = array
        if hasattr(mx, "asarray"):
            counted.asarray = asarray
        for name, module in list(sys.modules.items()):
            if name.startswith(("mars.backends.mlx.", "mars.core.")) and getattr(module, "mx", None) is mx:
                P.set(module, "mx", counted)

    # -- on and off ----------------------------------------------------------------------------

    def install(self) -> None:
        self._loop()
        self._decoder()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.patches.undo()

    def measure(self, fn):
        """Run `fn()` with the clock and the counters on, inside one "loop" region of the
        clock's (what no other region covers is the loop's); returns its result and the
        seconds it took."""
        import contextlib
        import warnings

        c, t, h = self.clock, self.transfers, self.h2d
        sync_mode = contextlib.nullcontext()
        if self.cuda:
            import torch

            sync_mode = warnings.catch_warnings(record=True)
        with sync_mode as caught:
            if self.cuda and self.count:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(1)
            c.active = t.active = h.active = True
            c.enter("loop")
            try:
                out = fn()
            except BaseException:
                c.unwind("loop")
                raise
            else:
                seconds = c.leave("loop")
            finally:
                c.active = t.active = h.active = False
                if self.cuda and self.count:
                    torch.cuda.set_sync_debug_mode(0)
                    t.syncs += sum("synchroniz" in str(w.message) for w in caught)
        self.from_cpu.clear()
        self.from_host.clear()
        return out, seconds


class ReplayDiverged(Exception):
    """A replayed decode asked for a forward the recorded one never made."""


class Replayer:
    """mars's own torch forward stood in for by what it answered before: recording keeps each call's
    `top` most likely ids and their logits (per row read) and the logsumexp of the row; replaying
    hands back, call by call, logits of the same shape with those ids and values and every other
    entry at one value that keeps the logsumexp (below the last kept value), so a greedy step
    decides as it did: its argmax, runners-up, a tree's ranked guesses (RANKS) and their
    log-probabilities are what the forward gave, while the forward computes nothing and evicts
    nothing."""

    def __init__(self, lean, top: int, evict=None):
        self.lean, self.top = lean, top
        self.calls: list = []  # (top ids (k, top), their logits, the other entries' logit, vocabulary)
        self.at = 0
        self.replaying = False
        self.evict = evict  # an array read through at each replayed call (as a forward here reads the weights)

    def __getattr__(self, name):
        return getattr(self.lean, name)

    def __call__(self, cache, inputs):
        import torch

        if not self.replaying:
            logits = self.lean(cache, inputs)
            vocab = logits.shape[-1]
            top = logits.float().topk(min(self.top, vocab), dim=-1)
            rest = torch.full((logits.shape[0], 1), -1e4, dtype=torch.float32)
            if vocab > top.indices.shape[-1]:
                lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
                kept = torch.logsumexp(top.values, dim=-1, keepdim=True)
                share = torch.log(-torch.expm1(kept - lse)) + lse - math.log(vocab - top.indices.shape[-1])
                floor = top.values[:, -1:] - 1e-3 * top.values[:, -1:].abs() - 1e-6
                rest = torch.minimum(torch.nan_to_num(share, nan=-1e4, neginf=-1e4), floor)
            self.calls.append((top.indices, top.values, rest, vocab))
            return logits
        cache.reserve(inputs.width, inputs.batch)  # as the forward does: the cache's room grows alike
        if self.evict is not None:
            self.evict.sum()
        if self.at >= len(self.calls):
            raise ReplayDiverged(f"the replay asked for forward {self.at + 1}; the forward made {len(self.calls)}")
        ids, values, rest, vocab = self.calls[self.at]
        self.at += 1
        return rest.expand(ids.shape[0], vocab).clone().scatter_(1, ids, values)


def replayed(session, ids, plans, batch: int, rounds: int, evict_mb: int = 0) -> dict:
    """Per mode, the loop's host work with the forward replayed (torch, mars's own forward): each
    mode decoded once with its forward's answers recorded, then `rounds` times with them replayed
    under the timers; the feed learns no timing in these passes (its curves frozen, its state put
    back before each), so every pass decides alike. On this CPU a real forward streams the weights
    through the caches and evicts the loop's own code and data; a device that runs the forward
    beside the host leaves the host what this measures. With `evict_mb`, each replayed forward also
    reads an array of that many MB (timed as the forward's), as a forward here reads the weights.
    None per mode where it does not apply (MLX, transformers' modules) or the replay did not decide
    as the forward did."""
    import copy

    from mars.core.decode import cost
    from mars.core.decode.drafts.tree import RANKS

    decoder = session.decoder
    lean = getattr(decoder, "forward", None) if getattr(decoder, "lean", None) is not None else None
    if lean is None:
        return {name: None for name in plans}
    evict = None
    if evict_mb:
        import numpy as np

        evict = np.ones(evict_mb * 2**20 // 8)
    frozen = Patches()
    frozen.set(cost.CostCurve, "observe", lambda self, tokens, seconds: None)
    out = {}
    try:
        for name, plan in plans.items():
            start = copy.deepcopy(session.controller, {id(session): session})
            replayer = Replayer(lean, max(1 + plan.alternative_groups, RANKS), evict)
            decoder.forward = replayer
            want = session.decode(ids, plan, batch).tokens
            profiler = Profiler(session)
            profiler.install()
            clock, seconds, same, steps = Clock(), 0.0, True, 0
            replayer.replaying = True
            try:
                for _ in range(rounds):
                    session.controller = copy.deepcopy(start, {id(session): session})
                    replayer.at = 0
                    profiler.clock.reset()
                    try:
                        decoded, spent = profiler.measure(lambda: session.decode(ids, plan, batch))
                    except ReplayDiverged:
                        same = False
                        break
                    merge(clock, profiler.clock)
                    seconds += spent
                    steps += decoded.total.forwards
                    same = same and decoded.tokens == want and replayer.at == len(replayer.calls)
            finally:
                profiler.remove()
                decoder.forward = lean
                session.controller = start
            if not same:
                out[name] = None
                continue
            ex = clock.exclusive
            forward, reduce = ex.get("forward", 0.0), ex.get("reduce + D2H", 0.0)
            host = seconds - forward - reduce
            items = {k: ex.get(k, 0.0) for k in HOST_ITEMS}
            items["loop"] = host - sum(v for k, v in items.items() if k != "loop")
            per = 1000.0 / max(steps, 1)
            out[name] = {
                "steps": steps,
                "host_ms_per_step": host * per,
                "reduce_ms_per_step": reduce * per,
                "replay_ms_per_step": forward * per,
                "host_items_ms_per_step": {k: v * per for k, v in items.items()},
            }
    finally:
        frozen.undo()
    return out


def plain_loop(session, ids, max_tokens: int, eos, rounds: int) -> dict | None:
    """A peer beside mars's loop (torch, float32 or not, any device): a plain Python loop of greedy
    decoding over the loaded transformers model and its `DynamicCache`, one token a step, timed as
    the modes are: the forward from the body's pre-hook to the head's hook (synchronising on CUDA),
    the reduction (argmax and reading the id, `int()`), and the host part, the rest of the step
    (making the input tensor, transformers' own code around the body and head). The prompts' own
    forwards are not counted. None on MLX."""
    if session.backend != "torch":
        return None
    import torch
    from transformers import DynamicCache

    tm = session.loaded
    model, cuda = tm.model, tm.device.type == "cuda"
    clock = {"forward": 0.0, "start": 0.0}

    def sync():
        if cuda:
            torch.cuda.synchronize(tm.device)

    def begins(module, args):
        sync()
        clock["start"] = time.perf_counter()

    def ends(module, args, out):
        sync()
        clock["forward"] += time.perf_counter() - clock["start"]

    handles = [tm.body.register_forward_pre_hook(begins), tm.head.register_forward_hook(ends)]
    total = reduce = forward = 0.0
    steps, replies = 0, []
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                replies = []
                for p in ids:
                    cache = DynamicCache(config=model.config)
                    fed = torch.tensor([p], device=tm.device)
                    logits = model(input_ids=fed, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    token = int(logits[0, -1].argmax())
                    row = [token]
                    clock["forward"] = 0.0
                    spent = 0.0
                    while token not in eos and len(row) < max_tokens:
                        t0 = time.perf_counter()
                        fed = torch.tensor([[token]], device=tm.device)
                        logits = model(input_ids=fed, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                        t1 = time.perf_counter()
                        token = int(logits[0, -1].argmax())
                        t2 = time.perf_counter()
                        row.append(token)
                        spent += t2 - t0
                        reduce += t2 - t1
                        steps += 1
                    total += spent
                    forward += clock["forward"]
                    replies.append(row)
    finally:
        for h in handles:
            h.remove()
    per = 1000.0 / max(steps, 1)
    return {
        "steps": steps,
        "ms_per_step": total * per,
        "forward_ms_per_step": forward * per,
        "reduce_ms_per_step": reduce * per,
        "host_ms_per_step": (total - forward - reduce) * per,
        "tokens": replies,
    }


def chain_loop(session, ids, plan, max_tokens: int, rounds: int, max_drafts: int = 8) -> dict | None:
    """A second peer (torch, mars's own forward, batch 1): the least a greedy lossless loop does over
    mars's own decoder step. Each step feeds the tokens not yet cached, the longest of the drafts on
    offer (the masks' from the step before, where it kept every draft, or a lookup source's of
    `plan`), at most `max_drafts`, and `plan.block_size` masks, under plain causal attention; it keeps
    the leading drafts AR confirms and AR's token after them, and crops the cache to what it fed for
    real. No feed, no groups or trees, no statistics: what is left of the host part is the decoder's
    own step inputs and the loop's few list operations. Timed as the modes are (the forward, the
    reduction inside `step`, the rest), the prompt's own forward not counted. None where it does not
    apply (MLX, transformers' modules, batch > 1)."""
    decoder = session.decoder
    if session.backend != "torch" or getattr(decoder, "lean", None) is None:
        return None
    import numpy as np

    from mars.core.decode.drafts import lookup_sources

    lookups, eos, masks = lookup_sources(plan), set(plan.eos_ids), plan.block_size
    timed = {"forward": 0.0, "inputs": 0.0, "step": 0.0}
    forward, lean_logits, step = decoder.forward, decoder._lean_logits, decoder.step

    def clocked(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timed[name] += time.perf_counter() - t0

        return call

    class TimedForward:
        def __getattr__(self, name):
            return getattr(forward, name)

        __call__ = staticmethod(clocked("forward", forward))

    patches = Patches()
    patches.set(decoder, "forward", TimedForward())
    patches.set(decoder, "_lean_logits", clocked("inputs", lean_logits))
    patches.set(decoder, "step", clocked("step", step))
    total = reduce = spent_forward = 0.0
    steps = taken = 0
    replies = []
    try:
        for _ in range(rounds):
            replies = []
            for p in ids:
                cache = decoder.new_cache(1)
                first = step(
                    cache,
                    np.asarray([p]),
                    np.arange(len(p))[None],
                    None,
                    np.asarray([[len(p) - 1]]),
                    metric=None,
                    sampling=plan.sampling,
                )
                seq, cached, offered = list(p) + [int(first.ids[0, 0])], len(p), []
                for k in timed:  # the prompt's own forward is not counted
                    timed[k] = 0.0
                loop = 0.0
                while len(seq) - len(p) < max_tokens and seq[-1] not in eos:
                    t0 = time.perf_counter()
                    produced = len(seq) - len(p)
                    drafts = offered
                    for lookup in lookups:
                        found = lookup.propose(seq, plan.lookup_drafts)
                        if found is not None and len(found[1]) > len(drafts):
                            drafts = found[1]
                    drafts = drafts[: min(max_drafts, max_tokens - produced - 1)]
                    real, d = seq[cached:], len(drafts)
                    fed = real + drafts + [plan.mask_id] * masks
                    last = len(real) - 1
                    out = decoder.step(
                        cache,
                        np.asarray([fed]),
                        np.arange(cached, cached + len(fed))[None],
                        None,
                        np.arange(last, last + d + 1 + masks)[None],
                        metric=None,
                        sampling=plan.sampling,
                    )
                    ar = out.ids[0].tolist()
                    kept = 0
                    while kept < d and drafts[kept] == ar[kept]:
                        kept += 1
                    new = drafts[:kept] + [ar[kept]]
                    for j, t in enumerate(new):
                        if t in eos:
                            new = new[: j + 1]
                            break
                    new = new[: max_tokens - produced]
                    seq.extend(new)
                    offered = ar[d + 1 :] if kept == d else []
                    cached += len(real) + kept
                    decoder.crop(cache, cached)
                    loop += time.perf_counter() - t0
                    steps += 1
                    taken += len(new)
                total += loop
                spent_forward += timed["forward"]
                reduce += timed["step"] - timed["inputs"]
                replies.append(seq[len(p) :])
    finally:
        patches.undo()
    per = 1000.0 / max(steps, 1)
    return {
        "steps": steps,
        "tokens_per_forward": taken / max(steps, 1),
        "masks": masks,
        "max_drafts": max_drafts,
        "ms_per_step": total * per,
        "forward_ms_per_step": spent_forward * per,
        "reduce_ms_per_step": reduce * per,
        "host_ms_per_step": (total - spent_forward - reduce) * per,
        "ms_per_token": total * 1000.0 / max(taken, 1),
        "tokens": replies,
    }


def interleaved_wall(session, ids, plans, max_tokens: int, rounds: int) -> dict:
    """Untimed wall time per token of AR, the lossless mode and the least lossless loop (`chain_loop`),
    interleaved: each round decodes the prompts in each, the order reversed every other round, the
    prompts' own forwards included alike (no timers or counters installed but the least loop's own
    three clocks). Per runner, ms a token per round."""
    runners = {
        "AR": lambda: session.decode(ids, plans["AR"], 1).tokens,
        "lossless": lambda: session.decode(ids, plans["lossless"], 1).tokens,
        "chain_loop": lambda: chain_loop(session, ids, plans["lossless"], max_tokens, 1)["tokens"],
    }
    out = {name: [] for name in runners}
    for rnd in range(rounds):
        for name in list(runners) if rnd % 2 == 0 else list(runners)[::-1]:
            t0 = time.perf_counter()
            replies = runners[name]()
            spent = time.perf_counter() - t0
            out[name].append(1000.0 * spent / max(sum(len(r) for r in replies), 1))
    return out


def mode_plans(session, max_tokens: int):
    """(AR, lossless) plans as `mars generate` makes them: its options' own defaults, then
    threshold 1.0 for AR and the checkpoint's default mode for the other (lossless for the
    shipped weights; --lossless where a checkpoint's default is not)."""
    from mars.cli.common import plan_from_options
    from mars.cli.generate import generate_command
    from mars.core.decode.plan import Mode

    names = set(plan_from_options.__code__.co_varnames[1 : plan_from_options.__code__.co_argcount])
    given = generate_command.make_context("generate", ["--prompt", "-"]).params  # every option at its default
    options = {k: v for k, v in given.items() if k in names}
    options["max_tokens"] = max_tokens
    ar = plan_from_options(session, **dict(options, threshold=1.0))
    default = plan_from_options(session, **options)
    if default.mode is not Mode.LOSSLESS:
        default = plan_from_options(session, **dict(options, lossless=True))
    return {"AR": ar, "lossless": default}


def summarise(
    clock: Clock, transfers: Transfers, h2d: Transfers, total: float, decoded, forward_graph: float, counted: int
) -> dict:
    """A mode's report: the timed rounds' parts, and the transfers of the counting pass over its
    `counted` steps."""
    t = decoded.total
    steps = t.forwards
    ex = clock.exclusive
    forward = ex.get("forward", 0.0)
    reduce = ex.get("reduce + D2H", 0.0)
    host = total - forward - reduce
    items = {k: ex.get(k, 0.0) for k in HOST_ITEMS}
    # The loop's own time is whatever no other region covered; make the items sum to the host part exactly.
    items["loop"] = host - sum(v for k, v in items.items() if k != "loop")
    per = 1000.0 / max(steps, 1)
    parts = {"forward": forward, "reduce + D2H": reduce, "host": host}
    return {
        "steps": steps,
        "step_calls": clock.calls.get("reduce + D2H", 0),
        "row_forwards": t.row_forwards,
        "tokens": t.accepted,
        "tokens_per_forward": t.accepted / max(t.row_forwards, 1),
        "fed_tokens_per_step": t.fed_tokens / max(steps, 1),
        "seconds": total,
        "ms_per_step": total * per,
        "parts_ms_per_step": {k: v * per for k, v in parts.items()},
        "parts_share": {k: v / total if total > 0 else 0.0 for k, v in parts.items()},
        "host_ms_per_step": {k: v * per for k, v in items.items()},
        "host_share_of_step": {k: v / total if total > 0 else 0.0 for k, v in items.items()},
        "forward_graph_ms_per_step": forward_graph * per if forward_graph else None,
        **copies("d2h", transfers, counted),
        **copies("h2d", h2d, counted),
        "cuda_syncs_per_step": transfers.syncs / max(counted, 1) if transfers.syncs else None,
        "counted_steps": counted,
        "by_source": t.by_source(),
        "seconds_by_region_inclusive": dict(clock.inclusive),
    }


def machine(args, session) -> dict:
    from mars.backends.torch.decode import cpu_name

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = list(os.getloadavg())
    if session.backend == "torch":
        import torch

        tm = session.loaded
        info.update(
            device=str(tm.device),
            dtype=str(tm.dtype).replace("torch.", ""),
            threads=torch.get_num_threads(),
            torch=torch.__version__,
        )
        if tm.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(tm.device)
    else:
        import mlx.core as mx

        info.update(device=str(mx.default_device()), mlx=getattr(mx, "__version__", ""))
    return info


def copies(prefix: str, counter, steps: int) -> dict:
    """A transfer counter's fields in a mode's report: totals, per step, the range over steps, and
    the code locations with their counts and bytes, most first."""
    return {
        f"{prefix}_transfers": counter.count,
        f"{prefix}_bytes": counter.bytes,
        f"{prefix}_per_step": counter.count / max(steps, 1),
        f"{prefix}_bytes_per_step": counter.bytes / max(steps, 1),
        f"{prefix}_per_step_range": [min(counter.per_step, default=0), max(counter.per_step, default=0)],
        f"{prefix}_sites": {
            k: {"count": v[0], "bytes": v[1]} for k, v in sorted(counter.sites.items(), key=lambda kv: -kv[1][0])
        },
    }


def commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (head + ("+changes" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def table(report: dict) -> str:
    modes = report["modes"]
    lines = [
        f"{'mode':<10} {'steps':>5} {'tok/fwd':>7} {'ms/step':>8}  "
        + "  ".join(f"{p:>16}" for p in PART_NAMES)
        + f"  {'D2H/step':>8} {'bytes/step':>10}  {'H2D/step':>8} {'bytes/step':>10}"
    ]
    for name, m in modes.items():
        cells = "  ".join(f"{m['parts_ms_per_step'][p]:7.2f} ({100 * m['parts_share'][p]:5.1f}%)" for p in PART_NAMES)
        lo, hi = m["d2h_per_step_range"]
        lines.append(
            f"{name:<10} {m['steps']:>5} {m['tokens_per_forward']:7.2f} {m['ms_per_step']:8.2f}  {cells}  "
            f"{m['d2h_per_step']:8.2f} {m['d2h_bytes_per_step']:10.0f}  "
            f"{m['h2d_per_step']:8.2f} {m['h2d_bytes_per_step']:10.0f}"
        )
    lines.append("")
    lines.append("host part by item, ms per step (share of the step):")
    for name, m in modes.items():
        lines.append(
            f"  {name:<10} "
            + ", ".join(
                f"{k} {m['host_ms_per_step'][k]:.2f} ({100 * m['host_share_of_step'][k]:.1f}%)" for k in HOST_ITEMS
            )
        )
    evict = report.get("evict_mb")
    for key, heading in (
        ("replayed", "host part with the forward replayed (nothing evicts the loop's caches), ms per step:"),
        ("replayed_evicted", f"host part replayed, {evict} MB read at each replayed forward, ms per step:"),
    ):
        if not any(m.get(key) for m in modes.values()):
            continue
        lines.append(heading)
        for name, m in modes.items():
            r = m.get(key)
            if r is None:
                lines.append(f"  {name:<10} not replayed")
                continue
            items = ", ".join(f"{k} {r['host_items_ms_per_step'][k]:.2f}" for k in HOST_ITEMS)
            lines.append(
                f"  {name:<10} host {r['host_ms_per_step']:.2f} ({items}); reduce + D2H {r['reduce_ms_per_step']:.2f}"
            )
    for name, m in modes.items():
        lo, hi = m["d2h_per_step_range"]
        counted = max(m["counted_steps"], 1)  # the counting pass's steps
        extra = (
            f"; CUDA synchronising operations {m['cuda_syncs_per_step']:.2f} a step" if m["cuda_syncs_per_step"] else ""
        )
        graph = (
            f"; the forward's graph building {m['forward_graph_ms_per_step']:.2f} ms a step"
            if m["forward_graph_ms_per_step"]
            else ""
        )
        lines.append(f"{name} D2H reads: {lo}-{hi} a step{extra}{graph}")
        for site, v in m["d2h_sites"].items():
            lines.append(f"    {v['count'] / counted:5.2f}/step {v['bytes'] / max(v['count'], 1):8.0f} B each  {site}")
        lo, hi = m["h2d_per_step_range"]
        lines.append(f"{name} H2D copies: {lo}-{hi} a step")
        for site, v in m["h2d_sites"].items():
            lines.append(f"    {v['count'] / counted:5.2f}/step {v['bytes'] / max(v['count'], 1):8.0f} B each  {site}")
    same = report["replies_equal_to_ar"]
    lines.append(f"replies of lossless equal to AR's: {same}/{report['prompts']}")
    for key, about in (
        ("plain_loop", lambda p: f"a plain transformers loop (batch 1, {p['steps']} steps)"),
        (
            "chain_loop",
            lambda p: (
                f"the least lossless loop over mars's step ({p['masks']} masks, at most {p['max_drafts']} "
                f"drafts, {p['steps']} steps, {p['tokens_per_forward']:.2f} tok/fwd)"
            ),
        ),
    ):
        peer = report.get(key)
        if peer is not None:
            per_token = f", {peer['ms_per_token']:.2f} ms a token" if "ms_per_token" in peer else ""
            lines.append(
                f"peer, {about(peer)}: {peer['ms_per_step']:.2f} ms a step, forward {peer['forward_ms_per_step']:.2f}, "
                f"reduce + D2H {peer['reduce_ms_per_step']:.2f}, host {peer['host_ms_per_step']:.2f}{per_token}; "
                f"replies equal to AR's: {report[key + '_replies_equal_to_ar']}/{report['prompts']}"
            )
    wall = report.get("wall_ms_per_token_interleaved")
    if wall:
        lines.append(
            "wall time a token, untimed, interleaved rounds: "
            + ", ".join(f"{name} {' '.join(f'{v:.2f}' for v in values)} ms" for name, values in wall.items())
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse(argv if argv is not None else sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    from mars.cli.common import quiet_libraries
    from mars.core.files import atomic_write_text
    from mars.prompts import read_prompts
    from mars.session import Session

    quiet_libraries()

    def say(m):
        print(m, file=sys.stderr)

    session = Session(
        args.model,
        args.adapter_path,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        announce=say,
        remeasure_cost=args.remeasure_cost,
    )
    prompts = read_prompts(Path(args.prompts))[: args.limit]
    ids = session.encode(prompts)
    plans = mode_plans(session, args.max_tokens)
    batch = max(1, min(args.batch, len(ids)))
    for s in plans.values():
        session.prepare_feed(
            s, batch=batch
        )  # measured (once per device) before anything is timed, as `mars generate` does
    if args.warmup_tokens:
        from dataclasses import replace

        for s in plans.values():
            session.decode(ids[:batch], replace(s, max_tokens=args.warmup_tokens), batch)

    results = {name: {"seconds": 0.0, "decoded": []} for name in plans}
    clocks = {name: (Clock(), Transfers(), Transfers(), [0.0]) for name in plans}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    # First one untimed pass of each mode with the transfer counters on, then the timed rounds
    # with the timers alone (a counter's own cost is no part of the loop's).
    counted_steps = {}
    counter = Profiler(session, count=True)
    counter.install()
    try:
        for name in plans:
            _, transfers, h2d, _ = clocks[name]
            decoded, _ = counter.measure(lambda: session.decode(ids, plans[name], batch))
            merge_transfers(transfers, counter.transfers)
            merge_transfers(h2d, counter.h2d)
            counter.transfers.reset()
            counter.h2d.reset()
            counted_steps[name] = decoded.total.forwards
    finally:
        counter.remove()
    profiler = Profiler(session)
    profiler.install()
    try:
        for rnd in range(args.rounds):
            order = list(plans) if rnd % 2 == 0 else list(plans)[::-1]
            for name in order:
                clock, transfers, h2d, graph = clocks[name]
                # Each mode keeps its own totals: point the profiler at them for this run.
                profiler.clock.reset()
                profiler.transfers.reset()
                profiler.h2d.reset()
                profiler.forward_graph = 0.0
                decoded, seconds = profiler.measure(lambda: session.decode(ids, plans[name], batch))
                merge(clock, profiler.clock)
                graph[0] += profiler.forward_graph
                results[name]["seconds"] += seconds
                results[name]["decoded"].append(decoded)
    finally:
        profiler.remove()

    replays = replayed(session, ids, plans, batch, args.rounds)
    evicted = replayed(session, ids, plans, batch, args.rounds, args.evict_mb) if args.evict_mb else {}
    peer = plain_loop(session, ids, args.max_tokens, set(plans["AR"].eos_ids), args.rounds) if batch == 1 else None
    chain = chain_loop(session, ids, plans["lossless"], args.max_tokens, args.rounds) if batch == 1 else None
    wall = interleaved_wall(session, ids, plans, args.max_tokens, args.rounds) if chain is not None else None

    from mars.session import Decoded

    modes, tokens = {}, {}
    for name, r in results.items():
        joined = Decoded(
            tokens=[t for d in r["decoded"] for t in d.tokens], stats=[s for d in r["decoded"] for s in d.stats]
        )
        clock, transfers, h2d, graph = clocks[name]
        modes[name] = summarise(clock, transfers, h2d, r["seconds"], joined, graph[0], counted_steps[name])
        modes[name]["plan"] = plans[name].name
        modes[name]["replayed"] = replays[name]
        modes[name]["replayed_evicted"] = evicted.get(name)
        tokens[name] = r["decoded"][0].tokens
    report = {
        "what": "where a decoding step's time goes: forward, reduce + D2H, host (benchmarks/step_parts.py)",
        "started_utc": started,
        "commit": commit(),
        "backend": session.backend,
        "model": str(getattr(session.loaded, "path", "")),
        "prompts": len(ids),
        "prompts_file": args.prompts,
        "max_tokens": args.max_tokens,
        "batch": batch,
        "rounds": args.rounds,
        "warmup_tokens": args.warmup_tokens,
        "evict_mb": args.evict_mb,
        "machine": dict(machine(args, session), load_average_before=load_before),
        "modes": modes,
        "replies_equal_to_ar": sum(a == b for a, b in zip(tokens["AR"], tokens["lossless"])),
        "plain_loop": None if peer is None else {k: v for k, v in peer.items() if k != "tokens"},
        "plain_loop_replies_equal_to_ar": None
        if peer is None
        else sum(a == b for a, b in zip(tokens["AR"], peer["tokens"])),
        "chain_loop": None if chain is None else {k: v for k, v in chain.items() if k != "tokens"},
        "chain_loop_replies_equal_to_ar": None
        if chain is None
        else sum(a == b for a, b in zip(tokens["AR"], chain["tokens"])),
        "wall_ms_per_token_interleaved": wall,
        "tokens": tokens,
    }
    out = (
        Path(args.output)
        if args.output
        else ROOT
        / "benchmarks"
        / "results"
        / (f"step_parts_{session.backend}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    )
    atomic_write_text(out, json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    how = ", ".join(x for x in (m.get("dtype"), f"{m['threads']} threads" if "threads" in m else None) if x)
    print(
        f"{session.backend} on {m['device']}{f' ({how})' if how else ''}, {report['model']}, "
        f"{len(ids)} prompts x {args.max_tokens} "
        f"tokens, batch {batch}, {args.rounds} round(s); load {' '.join(f'{x:.2f}' for x in load_before or [])}"
    )
    for name, mm in modes.items():
        print(f"{name}: {mm['plan']}")
    print(table(report))
    print(f"wrote {out}")
    report["output"] = str(out)
    return report


def merge(into: Clock, new: Clock) -> None:
    for k, v in new.exclusive.items():
        into.exclusive[k] += v
    for k, v in new.inclusive.items():
        into.inclusive[k] += v
    into.calls.update(new.calls)


def merge_transfers(into: Transfers, new: Transfers) -> None:
    into.count += new.count
    into.bytes += new.bytes
    into.syncs += new.syncs
    into.per_step += new.per_step
    for k, (n, b) in new.sites.items():
        into.sites[k][0] += n
        into.sites[k][1] += b


if __name__ == "__main__":
    main()
