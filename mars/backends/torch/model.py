"""PyTorch backend: transformers models, the MARS training forward, and the decoding step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...core.acceptance import speculative_sampling
from ...core.config import MarsConfig, has_config, read_config
from ...core.decode.types import runners_up_of
from ...core.decode.plan import Sampling
from ...core.loss import Alignment
from ...core.masks import decode_mask
from ...checkpoint.hf_config import position_gaps, sliding_windows
from ...core.tokens import eos_ids, mask_config, new_row_init
from . import packed
from .attention import REDUCED, row_exact
from .cache import cache_argument
from ...checkpoint.paths import (  # noqa: F401  (re-exported for callers of this backend)
    MASK_EMBEDDING_FILE,
    MASK_EMBEDDING_KEY,
    ModelError,
    check_model_path,
    load_tokenizer,
    refuse_mlx_quantized,
    resolve_model_path,
    tokenizer_path,
)

def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ModelError(f"--device {device}: not a device (cpu, cuda, cuda:1, mps or auto)") from None
        mps = getattr(torch.backends, "mps", None)
        if (dev.type == "cuda" and not torch.cuda.is_available()) or (dev.type == "mps" and not (mps and mps.is_available())):
            raise ModelError(f"--device {device}: not available on this machine (use cpu or auto)")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise ModelError(f"--dtype {dtype}: choose float32, float16 or bfloat16") from None


def additive_mask(mask: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool (b, q, kv) -> additive float (b, 1, q, kv): 0 where allowed, the dtype's minimum elsewhere.

    A float mask means the same thing to every attention implementation (eager adds
    a boolean mask as 0/1 instead of masking).
    """
    allowed = torch.from_numpy(np.ascontiguousarray(mask)).to(device)
    out = torch.zeros(allowed.shape, dtype=dtype, device=device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def model_windows(model: torch.nn.Module) -> list[int | None]:
    """Per layer, the sliding window the model applies, or None (mars.checkpoint.hf_config)."""
    return sliding_windows(body_and_head(model)[0].config.to_dict())


def attention_masks(mask: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray, windows, dtype, device):
    """The `attention_mask` a transformers body takes for the bool `mask` (b, q, kv): one
    additive mask for every layer, or one per layer type when some layers slide.

    A transformers model given a 4D mask applies it as it is, its sliding windows included:
    so a sliding layer gets `mask` cut to the window here, by logical position (a query at
    position p keeps the keys at p - W + 1 .. p), the same cut for a real token and a mask,
    in training and in decoding. Where no query is W positions past a key, the window
    changes nothing and the one mask serves every layer."""
    full = additive_mask(mask, dtype, device)
    sizes = {w for w in windows if w}
    if not sizes:
        return full
    if len(sizes) > 1:
        raise ModelError(f"layers with different sliding windows ({sorted(sizes)}) are not supported")
    window = sizes.pop()
    gap = position_gaps(query_positions, key_positions)
    if not (mask & (gap >= window)).any():
        return full
    sliding = additive_mask(mask & (gap < window), dtype, device)
    if None not in windows:
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


def _mask_part(attn, rows: slice, columns):
    """Rows and columns (a slice, or a list of slices joined) of an attention argument."""
    if isinstance(attn, dict):
        return {kind: _mask_part(a, rows, columns) for kind, a in attn.items()}
    if isinstance(columns, slice):
        return attn[:, :, rows, columns]
    return torch.cat([attn[:, :, rows, c] for c in columns], dim=-1)


def body_and_head(model: torch.nn.Module):
    """The decoder body and the LM head of a *ForCausalLM, through a PEFT wrapper if any
    (LoRA layers live inside the body, so calling it uses them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    config = base.config
    scaling, softcap = getattr(config, "logits_scaling", None), getattr(config, "final_logit_softcapping", None)
    if (scaling not in (None, 1.0) or softcap) and not isinstance(head, FinalLogits):
        head = FinalLogits(head, scaling or 1.0, softcap)
    return getattr(base, base.base_model_prefix), head


class FinalLogits(torch.nn.Module):
    """An LM head followed by what the model's own forward does to its logits: Granite divides
    them by `logits_scaling`, Gemma soft-caps them (`final_logit_softcapping`). Confidences are
    read off these logits, so they must be the model's."""

    def __init__(self, head: torch.nn.Module, scaling: float, softcap: float | None):
        super().__init__()
        self.head, self.scaling, self.softcap = head, scaling, softcap

    @property
    def weight(self):
        return self.head.weight

    def forward(self, hidden):
        logits = self.head(hidden)
        if self.scaling != 1.0:
            logits = logits / self.scaling
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass
class TorchModel:
    """A loaded causal LM with what MARS needs to drive it."""

    model: torch.nn.Module  # a transformers *ForCausalLM (LoRA merged for inference)
    tokenizer: object
    mars: MarsConfig | None
    path: str
    device: torch.device
    dtype: torch.dtype
    gate: object = None  # a gated adapter's gate: DecodeGate loaded for decoding, MaskGate for training
    backend = "torch"  # the mars.backends module that loaded it

    @property
    def body(self) -> torch.nn.Module:
        return body_and_head(self.model)[0]

    @property
    def head(self) -> torch.nn.Module:
        return body_and_head(self.model)[1]

    @property
    def vocab_rows(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def number_format(self) -> str:
        """The dtype the model computes in: "float32", "bfloat16" or "float16"."""
        return str(self.dtype).rsplit(".", 1)[-1]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        gen = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        return eos_ids(self.tokenizer, gen)

    @property
    def context_length(self) -> int | None:
        """The model's position limit, when its config states one."""
        value = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return value if isinstance(value, int) and value > 0 else None


def load_hf_model(path: Path, *, dtype: torch.dtype, device: torch.device):
    """A transformers model from a directory or a GGUF file (dequantized), with sdpa attention."""
    from transformers import AutoModelForCausalLM

    check_model_path(path)
    refuse_mlx_quantized(path)
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    try:
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
            check_architecture(path, getattr(model.config, "model_type", None))
            # The weights are dequantized; drop the GGUF marker so the model saves like any other.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, ModelError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path}: could not load the model ({first})") from None
    return model.to(device).eval()


def ensure_mask_token(model, tokenizer, mars: MarsConfig | None, *, block_size: int = MarsConfig.block_size, exclude=(), announce=print):
    """Return a MarsConfig whose mask token exists in `tokenizer` and `model` (the choice is
    mars.core.tokens.mask_config's; a token it adds grows the embedding by one row)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    exclude = set(eos_ids(tokenizer, gen_eos)) | set(exclude)
    mars = mask_config(tokenizer, mars, block_size=block_size, exclude=exclude, announce=announce)
    emb = model.get_input_embeddings()
    if mars.mask_token_id >= emb.weight.shape[0]:
        old = emb.weight.shape[0]
        model.resize_token_embeddings(mars.mask_token_id + 1, mean_resizing=False)
        inp, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        with torch.no_grad():  # the new rows start as mars.core.tokens.new_row_init says
            inp[old:] = inp[:old].mean(0)
            if head is not None and head.weight is not inp and new_row_init(output_head=True) == "zeros":
                head.weight[old:] = 0
                if getattr(head, "bias", None) is not None:
                    head.bias[old:] = 0
    return mars


def check_architecture(path: Path, arch: str | None = None) -> None:
    """Refuse a model whose architecture is outside the table (mars.checkpoint.architectures):
    a directory before any work, from its config.json; a GGUF file once transformers has read
    it (`arch`, its model_type)."""
    from ...checkpoint.architectures import model_type, refusal

    arch = arch or (model_type(path) if path.is_dir() else None)
    refused = refusal(arch, path if path.is_file() else f"{path}/config.json", "torch") if arch is not None else None
    if refused:
        raise ModelError(refused)


def load_mask_embedding(adapter_dir: Path):
    from safetensors.torch import load_file

    f = adapter_dir / MASK_EMBEDDING_FILE
    return load_file(str(f))[MASK_EMBEDDING_KEY] if f.is_file() else None


def load(
    model_path=None,
    *,
    adapter_path=None,
    dtype: str | None = None,
    device: str | None = None,
    merge: bool = True,
    announce=print,
) -> TorchModel:
    """Load a model for decoding or training: HF dir, GGUF file, adapter dir, or None (embedded default)."""
    base_path, adapter = resolve_model_path(model_path, adapter_path)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    check_model_path(base_path)
    check_architecture(base_path)
    source = adapter if adapter is not None else base_path
    tokenizer = load_tokenizer(tokenizer_path(base_path, adapter))
    model = load_hf_model(base_path, dtype=dt, device=dev)
    mars = None
    cfg_dir = source if source.is_dir() else None
    if cfg_dir is not None and has_config(cfg_dir):
        mars = read_config(cfg_dir)
        ensure_mask_token(model, tokenizer, mars, announce=announce)
    if adapter is not None:
        from peft import PeftModel

        if not (adapter / "adapter_config.json").is_file():
            raise ModelError(f"{adapter}: no adapter_config.json (not a PEFT adapter directory)")
        gated = mars is not None and mars.gate == "masks"
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=not merge)
        if merge and not gated:  # a gated adapter cannot be merged: it acts at mask positions only
            model = model.merge_and_unload()
        row = load_mask_embedding(adapter)
        if row is not None and mars is not None:
            with torch.no_grad():
                model.get_input_embeddings().weight[mars.mask_token_id] = row.to(dt)
    model.eval()
    gate = None
    if adapter is not None and mars is not None and mars.gate == "masks":
        from .gate import MaskGate, unwrap_for_decoding

        if merge:  # decoding: the base layers alone wherever no mask is fed
            model, gate = unwrap_for_decoding(model, mars.mask_token_id)
        else:
            gate = MaskGate(model, mars.mask_token_id)
    return TorchModel(model=model, tokenizer=tokenizer, mars=mars, path=str(source), device=dev, dtype=dt, gate=gate)


# Below this many bytes of packed weights the row paths are not measured (packed for every
# product of 2 rows or more): a small model's products cost too little to tell them apart.
ROW_PATHS_MIN_BYTES = 8 << 20


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
    """The row counts (of 2-4) whose products run `F.linear` rather than the packed product
    on this CPU (packed.time_row_paths): measured once per CPU model, thread count, dtype,
    torch version and layer shapes, about a second on the default model, and kept under
    the cache directory (`MARS_HOME`, default ~/.cache/mars/paths). None for a small model
    (below ROW_PATHS_MIN_BYTES of packed weights): every product of 2 rows or more is packed."""
    import json

    from ...core.files import atomic_write_text
    from ...checkpoint.default_model import keyed_cache_file

    layers = packed.packed_layers(tm.model)
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if size < ROW_PATHS_MIN_BYTES:
        return []
    key = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": str(tm.dtype), "torch": torch.__version__,
           "shapes": sorted({(layer.out_features, layer.in_features) for layer in layers}), "layers": len(layers), "paths": 1}
    path = keyed_cache_file("paths", key)
    try:
        return [int(r) for r in json.loads(path.read_text())["linear_rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = packed.time_row_paths(tm.model)
    rows = packed.faster_on_linear(timings)
    report = {"key": key, "linear_rows": rows, "seconds": {str(r): {"linear": a, "packed": b} for r, (a, b) in timings.items()}}
    try:
        atomic_write_text(path, json.dumps(report, indent=1))
    except OSError:
        pass  # a read-only cache: measure again next time
    return rows


class TorchDecoder:
    """The decoding step of docs/method.md §5 for the core loop (mars.core.decode.loop.StepBackend).

    `pack` (default: on the CPU where oneDNN is available): the linear layers also keep
    their weights packed for multi-token forwards (mars.backends.torch.packed), which makes
    a forward of 2-16 tokens cost much less than with `F.linear`; one-token forwards are
    unchanged. The packed copies double the weights' memory. With packed layers a batch's
    step computes its real positions alone, not its holes (`skips_holes`)."""

    def __init__(self, tm: TorchModel, pack: bool | None = None):
        from .attention import use_grouped_sdpa
        from .packed import can_pack, pack_linears

        self.tm = tm
        self.body = tm.body
        self.head = tm.head
        self.generator = None
        self._seeded = None
        self._drafted = None  # lossless sampling: the last step's mask distributions
        if pack is None:
            pack = can_pack(tm.device, tm.dtype)
        self.packed = pack_linears(tm.model) if pack else 0
        # Row counts whose products run F.linear, where this CPU computes them faster (packed.py).
        self.linear_rows = linear_rows_for(tm) if self.packed else []
        if self.packed:
            packed.use_linear_rows(tm.model, self.linear_rows)
        # A batch's step computes its real positions alone, not its holes (packed.real_rows).
        self.skips_holes = bool(self.packed)
        # CPU: masked multi-token forwards share key heads instead of copying them (same results).
        self.grouped = tm.device.type == "cpu" and use_grouped_sdpa(tm.model)
        # CPU, bfloat16 or float16: each attention row computes what a one-token forward computes
        # (attention.row_exact), so lossless verification reads AR's own predictions.
        self.row_exact = self.grouped and tm.dtype in REDUCED
        # Sliding-window layers: the masks cut the window by position (attention_masks), so the
        # cache keeps every position; the cached keys' positions are kept beside it, per row.
        self.windows = model_windows(tm.model)
        self.slides = any(self.windows)

    def cost_key(self) -> dict:
        """What a forward's cost depends on besides the model: the cost curve's cache key."""
        return {"backend": "torch", "device": str(self.tm.device), "dtype": str(self.tm.dtype).replace("torch.", ""),
                "threads": torch.get_num_threads(), "packed": bool(self.packed),
                "packed_min_rows": packed.MIN_ROWS if self.packed else None,
                "packed_pad_rows": sorted(packed.PAD_ROWS.items()) if self.packed else None,
                "linear_rows": self.linear_rows if self.packed else None,
                "grouped": self.grouped, "torch": torch.__version__, **({"row_exact": True} if self.row_exact else {})}

    def new_cache(self, batch: int):
        from .cache import growing_cache

        self._drafted = None
        return growing_cache(self.tm.model.config)

    def crop(self, cache, length: int) -> None:
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def keep_rows(self, cache, rows: list[int]) -> None:
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[rows]
        idx = torch.tensor(rows, device=self.tm.device)
        for layer in cache.layers if cache is not None else ():
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        if self._drafted is not None:
            self._drafted = self._drafted.index_select(0, idx)

    def keep_keys(self, cache, columns) -> None:
        """Keep only these cache positions of every layer (a served batch drops the keys of rows that left)."""
        if getattr(cache, "key_positions", None) is not None:
            cache.key_positions = cache.key_positions[:, np.asarray(columns, dtype=np.int64)]
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

    def logits(self, cache, input_ids, positions, mask, read, valid=None) -> torch.Tensor:
        """One forward of `input_ids` (as `step`): the float32 logits of the `read` columns,
        on the device. `step` and `speculate` reduce them; a subclass may inspect them."""
        unique, where = self._read_logits(cache, input_ids, positions, mask, read, valid)
        return unique[torch.from_numpy(where).to(unique.device)]

    def _read_logits(self, cache, input_ids, positions, mask, read, valid=None) -> tuple[torch.Tensor, np.ndarray]:
        """One forward: the float32 logits of each distinct (row, column) that `read` names,
        (n, vocab), and where each read finds its own among them, (b, k). A row that
        feeds fewer drafts than the widest repeats its last read: the head (a large matrix
        product on a small model) runs once per distinct read. With `valid` (b, q), reads at
        holes (never used) share the row's first, and with packed layers the body computes
        the real positions alone (packed.real_rows)."""
        dev = self.tm.device
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
        real = contextlib.nullcontext()
        if valid is not None:
            valid = np.asarray(valid)
            if self.skips_holes and not valid.all():
                real = packed.real_rows(torch.from_numpy(np.flatnonzero(valid)).to(dev), b * q)
            # A read at a hole is never used: let it share the row's first read.
            read = np.where(np.take_along_axis(valid, read, axis=1), read, read[:, :1])
        flat = (np.arange(b)[:, None] * q + read).reshape(-1)
        distinct, where = np.unique(flat, return_inverse=True)
        with packed.active(), self._row_exact(input_ids, valid):
            with real:  # the body alone: the head's rows are reads, not positions
                out = self.body(input_ids=ids, position_ids=pos, attention_mask=attn, use_cache=cache is not None,
                                **cache_argument(self.body, cache))
            hidden = out.last_hidden_state
            picked = hidden.reshape(b * q, hidden.shape[-1]).index_select(0, torch.from_numpy(distinct).to(dev))
            return self.head(picked[None])[0].float(), where.reshape(read.shape)

    def _row_exact(self, input_ids, valid):
        """Row-exact attention (attention.row_exact) for the rows fed a real token, whose outputs
        may be taken as AR's; masks only propose drafts, and holes nothing."""
        if not self.row_exact:
            return contextlib.nullcontext()
        mask_id = self.tm.mars.mask_token_id if self.tm.mars is not None else None
        if mask_id is None and valid is None:
            return row_exact()
        exact = np.ones(np.shape(input_ids), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        return row_exact(exact if mask_id is None else exact & (np.asarray(input_ids) != mask_id))

    def _window_masks(self, cache, mask, positions):
        """The attention argument of a model with sliding layers (attention_masks), with the
        positions of the cached keys (kept on the cache, cut to its length: crops only shorten
        it) followed by the step's own."""
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

    @torch.inference_mode()
    def step(self, cache, input_ids, positions, mask, read, *, metric, sampling, valid=None, runners_up: int = 0):
        if not sampling.greedy:  # every read draws its own token: the reads stay apart
            logits = self.logits(cache, input_ids, positions, mask, read, valid)
            return tuple(to_host(*slot_predictions(logits, metric, sampling, self.rng(sampling))))
        unique, where = self._read_logits(cache, input_ids, positions, mask, read, valid)
        chosen, conf = slot_predictions(unique, metric, sampling)
        # One device-to-host copy a step: the ids, their confidences (none in AR mode: zeros)
        # and the runners-up together.
        wanted = [chosen] + ([conf] if metric is not None else []) + ([unique.topk(runners_up + 1, dim=-1).indices] if runners_up else [])
        host = [a[where] for a in to_host(*wanted)]
        ids = host[0]
        conf = host[1] if metric is not None else np.zeros(ids.shape, np.float32)
        if not runners_up:
            return ids, conf
        return ids, conf, runners_up_of(host[-1], ids, runners_up)

    @torch.inference_mode()
    def speculate(self, cache, input_ids, positions, mask, read, drafts, n_drafts, *, sampling):
        """Lossless sampling (mars.core.decode.loop.StepBackend.speculate), on the device."""
        logits = self.logits(cache, input_ids, positions, mask, read)
        gen = self.rng(sampling)
        width = drafts.shape[1]
        p = sampling_probs(logits[:, : width + 1], sampling)
        q_next = sampling_probs(logits[:, width + 1 :], sampling)
        device = p.device
        dr = torch.from_numpy(np.ascontiguousarray(drafts)).to(device)
        n = torch.from_numpy(np.ascontiguousarray(n_drafts)).to(device)
        u = torch.rand(dr.shape, generator=gen, device=device) if width else None
        q = self._drafted[:, :width] if width else None
        kept, dist = speculative_sampling(TorchOps(device), p, q, dr, n, u)
        token = torch.multinomial(dist, 1, generator=gen)[:, 0]
        proposals = torch.multinomial(q_next.reshape(-1, q_next.shape[-1]), 1, generator=gen).reshape(q_next.shape[:-1])
        self._drafted = q_next
        return tuple(to_host(kept, token, proposals))


_HOST_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def to_host(*arrays: torch.Tensor, pack: bool | None = None) -> list[np.ndarray]:
    """Device tensors (integers, booleans, float32) copied to the host in one transfer: each
    flattened to int64 (a float32 by its bits), joined, copied, then split and given back its
    dtype and shape, bit for bit. Tensors already on the CPU are read as they are (`pack`
    True packs them anyway, as a device would)."""
    if not (pack if pack is not None else any(a.device.type != "cpu" for a in arrays)):
        return [a.numpy() for a in arrays]
    flat = [a.reshape(-1).view(torch.int32).long() if a.dtype == torch.float32 else a.reshape(-1).long() for a in arrays]
    host = torch.cat(flat).cpu().numpy()
    out, at = [], 0
    for a in arrays:
        part = host[at : at + a.numel()]
        at += a.numel()
        part = part.astype(np.int32).view(np.float32) if a.dtype == torch.float32 else part.astype(_HOST_DTYPES[a.dtype])
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
    No metric (greedy AR): the argmax alone, as `generate` takes it."""
    if metric is None and sampling.greedy:
        return logits.argmax(-1), torch.zeros(logits.shape[:-1], device=logits.device)
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


class MarsLoss(torch.nn.Module):
    """The MARS objective (docs/method.md §4) around a causal LM; a module so DDP/accelerate can wrap it."""

    def __init__(self, model: torch.nn.Module, mask_row: torch.nn.Parameter | None = None, mask_id: int = -1, gate=None,
                 distill: tuple[float, float] | None = None):
        super().__init__()
        self.model = model
        self.mask_row = mask_row
        self.mask_id = mask_id
        self.gate = gate  # gated LoRA: the deltas act at mask positions only
        self.distill = distill  # (temperature, mix): the noisy stream learns the clean stream's distribution
        self.split = True  # gated: the clean stream in a pass of its own, without gradients (gated_hidden)
        self.body, self.head = body_and_head(model)

    def embed(self, input_ids):
        table = self.body.get_input_embeddings()
        embeds = table(input_ids)
        if self.mask_row is None:
            return embeds
        # Under LoRA the embedding matrix is frozen; the mask token's row is its own parameter,
        # scaled as the embedding scales its rows (Gemma's sqrt(hidden)), as it will be once saved.
        row = self.mask_row.to(embeds.dtype)
        scale = getattr(table, "embed_scale", None)
        if scale is not None:
            row = row * (scale.to(table.weight.dtype) if torch.is_tensor(scale) else scale)
        is_mask = (input_ids == self.mask_id)[..., None]
        return torch.where(is_mask, row, embeds)

    def gated_hidden(self, input_ids, positions, attn):
        """The hidden states of a gated adapter's batch in two passes. The clean stream runs
        the base weights alone (the gate is 0 on every real token) and no loss term trains
        anything through it, so it runs without gradients, its keys kept in a cache; then
        the noisy stream runs with gradients on top of that cache, under its rows of the
        same mask. The same numbers as one joint forward, without the clean stream's backward."""
        from .cache import full_cache

        clean = int(positions[0, -1]) + 1  # the clean stream's positions are 0 .. L-1
        n = input_ids.shape[1] - clean
        cache = full_cache(self.body.config)
        with torch.no_grad():
            self.gate.set(input_ids[:, n:])
            out_c = self.body(inputs_embeds=self.embed(input_ids[:, n:]), position_ids=positions[:, n:],
                              attention_mask=_mask_part(attn, slice(n, None), slice(n, None)), use_cache=True,
                              **cache_argument(self.body, cache))
        self.gate.set(input_ids[:, :n])
        # keys: the cached clean stream, then the noisy
        mask = _mask_part(attn, slice(None, n), [slice(n, None), slice(None, n)])
        out_n = self.body(inputs_embeds=self.embed(input_ids[:, :n]), position_ids=positions[:, :n], attention_mask=mask,
                          use_cache=True, **cache_argument(self.body, cache))
        return torch.cat([out_n.last_hidden_state, out_c.last_hidden_state], dim=1)

    def hidden(self, input_ids, positions, attn):
        if self.gate is not None and self.split:
            return self.gated_hidden(input_ids, positions, attn)
        if self.gate is not None:
            self.gate.set(input_ids)
        if self.mask_row is None:
            out = self.body(input_ids=input_ids, position_ids=positions, attention_mask=attn, use_cache=False)
        else:
            out = self.body(inputs_embeds=self.embed(input_ids), position_ids=positions, attention_mask=attn, use_cache=False)
        return out.last_hidden_state

    def forward(self, input_ids, positions, attn, rows, noisy_index, clean_index, targets, weights, noisy_weights=None,
                consistency: float = 0.0):
        """(noisy, clean) losses; `noisy_weights` (default `weights`) weigh the noisy stream's
        targets (slot weights, core.loss.align); `consistency` adds that weight times the
        noisy last hidden state's squared distance to the clean one's (detached), relative to
        the clean state's squared norm, to each noisy target's loss."""
        hidden = self.hidden(input_ids, positions, attn)
        index = torch.cat([noisy_index, clean_index])
        states = hidden[torch.cat([rows, rows]), index]
        logits = self.head(states).float()
        ce = F.cross_entropy(logits, torch.cat([targets, targets]), reduction="none")
        n = targets.shape[0]
        per_token = ce[:n]
        if self.distill is not None:
            per_token = mix_distill(per_token, logits[:n], logits[n:], *self.distill)
        if consistency:
            per_token = per_token + consistency * relative_distance(states[:n].float(), states[n:].float())
        noisy = (per_token * (weights if noisy_weights is None else noisy_weights)).sum()
        clean = (ce[n:] * weights).sum()
        return noisy, clean


def relative_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per row: |student - teacher|^2 / |teacher|^2, the teacher detached."""
    teacher = teacher.detach()
    return ((student - teacher) ** 2).sum(-1) / (teacher**2).sum(-1).clamp_min(1e-12)


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per row: T^2 KL(softmax(teacher / T) || softmax(student / T)), the teacher detached."""
    t = temperature
    p = torch.softmax(teacher.detach() / t, dim=-1)
    return (p * (torch.log_softmax(teacher.detach() / t, dim=-1) - torch.log_softmax(student / t, dim=-1))).sum(-1) * t * t


def mix_distill(ce: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, temperature: float, mix: float) -> torch.Tensor:
    """(1 - mix) CE(label) + mix KL(clean stream || noisy stream), per noisy token."""
    kl = distill_kl(student, teacher, temperature)
    return kl if mix >= 1.0 else (1.0 - mix) * ce + mix * kl


def loss_inputs(ids, labels, lengths, block_size: int, mask_id: int, dtype, device, normalize="row", trim=True, windows=(),
                slot_weights=()):
    """Tensors for MarsLoss.forward from a padded numpy batch (the core builds masks and alignment).
    trim: leave out the noisy blocks no loss reads (masks.noisy_start); the losses are the same.
    windows: the model's sliding windows per layer (model_windows), cut into the mask by position.
    slot_weights: the noisy loss's weight per mask slot (core.loss.align)."""
    from ...core.loss import align
    from ...core.masks import noisy_start, training_inputs

    start = noisy_start(labels, block_size) if trim else 0
    input_ids, positions, mask = training_inputs(ids, labels, lengths, block_size, mask_id, start=start)
    al: Alignment = align(labels, normalize, start, block_size, slot_weights)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return dict(
        input_ids=t(input_ids),
        positions=t(positions),
        attn=attention_masks(mask, positions, positions, windows, dtype, device),
        rows=t(al.rows),
        noisy_index=t(al.noisy_index),
        clean_index=t(al.clean_index),
        targets=t(al.targets),
        weights=t(al.weights),
        **({"noisy_weights": t(al.noisy_weights)} if al.noisy_weights is not al.weights else {}),
    )


def losses(tm: TorchModel):
    """`step(ids, labels, lengths, block_size, mask_id) -> (noisy, clean)`: the mean losses per
    labelled token of a padded batch, through the training forward and loss without gradients
    (mars eval's NLL)."""
    module = MarsLoss(tm.model, gate=tm.gate)  # a gated adapter's deltas act at mask positions only
    windows = model_windows(tm.model)

    @torch.inference_mode()
    def step(ids, labels, lengths, block_size, mask_id):
        inputs = loss_inputs(ids, labels, lengths, block_size, mask_id, tm.dtype, tm.device, normalize="token", windows=windows)
        noisy, clean = module(**inputs)
        return float(noisy), float(clean)

    return step
