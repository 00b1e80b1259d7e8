"""`mars distill`: turn prompts into a training set with the model's own greedy replies.

Self-distillation keeps the MARS targets equal to the model's own AR behaviour: the masks
learn to guess what the model would say anyway, so accepting their guesses changes little.

Input: a prompt file or a directory of them (train/valid/test .jsonl), each line
`{"messages": [...ending with a user turn]}` or `{"prompt": "..."}`, optionally with
`"follow_ups": ["...", ...]`: later user turns, each asked after the model's reply to the
previous one (a multi-turn conversation whose every reply is the model's own).

Output: the same split files in the mlx-lm chat shape, one record per prompt, in prompt order:
`{"messages": [..., {"role": "assistant", "content": reply}], "finish": "eos" | "length"}`.
"finish": "length" marks a reply cut by --max-tokens; training labels neither its EOS nor its
padding (docs/method.md §2). Work is written batch by batch to `<split>.jsonl.partial` and renamed when
the split is complete, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .core.files import atomic_write_text
from .core.train.data import DataError
from .prompts import json_lines, prompt_of, split_files

SPLIT_ORDER = ("valid", "test", "train")  # small splits first: a partial run still has them
PARTIAL = ".partial"


@dataclass
class DistillSettings:
    max_tokens: int = 128
    batch_size: int = 32
    limit: int | None = None  # at most this many prompts per split


@dataclass
class PromptRecord:
    messages: list  # the conversation so far, ending with a user turn
    follow_ups: list  # later user turns


def _fail(where: str, what: str, fix: str) -> DataError:
    return DataError(f"{where}: {what} ({fix})")


def read_prompt_file(path: Path) -> list[PromptRecord]:
    """Prompt records of one .jsonl file, validated; errors name the file, line and field."""
    records = []
    for where, rec in json_lines(path):
        if not isinstance(rec, dict):
            raise _fail(where, "expected a JSON object", 'write {"messages": [...]} or {"prompt": "..."}')
        prompt = prompt_of(rec)  # a finished example's last reply is distilled anew
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif prompt is not None and rec["messages"]:
            messages = list(prompt)
            if not messages or any(not isinstance(m, dict) or not isinstance(m.get("content"), str) for m in messages):
                raise _fail(
                    where,
                    "'messages' must be objects with string 'role' and 'content'",
                    'write [{"role": "user", "content": "..."}]',
                )
            if messages[-1].get("role") != "user":
                raise _fail(
                    where, f"the last message has role {messages[-1].get('role')!r}", "end the prompt with a user turn"
                )
        else:
            raise _fail(
                where,
                "no 'prompt' string or non-empty 'messages' array",
                'write {"messages": [...]} or {"prompt": "..."}',
            )
        follow = rec.get("follow_ups", [])
        if not isinstance(follow, list) or not all(isinstance(t, str) and t.strip() for t in follow):
            raise _fail(
                where, "'follow_ups' must be an array of non-empty strings", "remove it, or list the later user turns"
            )
        records.append(PromptRecord(messages, list(follow)))
    if not records:
        raise DataError(f"{path}: no prompts")
    return records


def prompt_files(prompts) -> list[tuple[str, Path]]:
    """(split, file) pairs: a single .jsonl is the 'train' split; a directory gives its split files."""
    found = split_files(
        prompts, SPLIT_ORDER, takes="--prompts takes a .jsonl file or a directory of train/valid/test .jsonl"
    )
    if not found:
        raise DataError(f"{prompts}: no train.jsonl, valid.jsonl or test.jsonl")
    return [(split or "train", path) for split, path in found]


def _done_lines(partial: Path) -> int:
    """Complete records already written; a torn last line (a killed run) is cut off."""
    if not partial.exists():
        return 0
    data = partial.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        partial.write_bytes(keep)
    return keep.count(b"\n")


class Distiller:
    """Greedy replies from a loaded model, batched on the KV-cached decoding loop."""

    def __init__(self, loaded, decoder, settings: DistillSettings):
        from .backends.base import plan_for_model
        from .core.acceptance import ar_threshold
        from .core.decode.rules import metric_for

        self.tm, self.decoder, self.s = loaded, decoder, settings
        ar = ar_threshold(metric_for(loaded.mars))  # plain greedy AR
        self.decode = plan_for_model(loaded, threshold=ar, max_tokens=settings.max_tokens, cache="window")
        self.generated = 0

    def replies(self, conversations: list[list]) -> list[tuple[str, str]]:
        """(text, finish) for each conversation ending with a user turn."""
        from .core.decode.loop import generate
        from .core.tokens import encode_prompt

        tok = self.tm.tokenizer
        ids = [encode_prompt(tok, c) for c in conversations]
        result = generate(self.decoder, ids, self.decode)
        eos = set(self.decode.eos_ids)
        out = []
        for tokens, finish in zip(result.tokens, result.finish):
            self.generated += len(tokens)
            body = [t for t in tokens if t not in eos]
            out.append((tok.decode(body, skip_special_tokens=True), finish))
        return out

    def batch(self, records: list[PromptRecord]) -> list[dict]:
        """One finished record per prompt: every turn answered, follow-ups in order."""
        convs = [list(r.messages) for r in records]
        finish = [""] * len(records)
        pending = list(range(len(records)))
        turn = 0
        while pending:
            for i, (text, why) in zip(pending, self.replies([convs[i] for i in pending])):
                convs[i].append({"role": "assistant", "content": text})
                finish[i] = why
            pending = [i for i in pending if turn < len(records[i].follow_ups)]
            for i in pending:
                convs[i].append({"role": "user", "content": records[i].follow_ups[turn]})
            turn += 1
        return [{"messages": c, "finish": f} for c, f in zip(convs, finish)]


def _check_resume(output: Path, run: dict) -> None:
    """A resumed run must continue the same run: same model, prompts and limits."""
    meta = output / "distill.json"
    if not meta.exists():
        return
    old = json.loads(meta.read_text()).get("run", {})
    changed = [k for k in run if k in old and old[k] != run[k]]
    if changed:
        k = changed[0]
        raise DataError(
            f"{meta}: this output was distilled with {k} = {old[k]!r}, not {run[k]!r} "
            "(pass a new --output, or the same settings to resume)"
        )


def distill(
    loaded, decoder, prompts, output, settings: DistillSettings, *, model_ref: str = "", progress=True, log=print
) -> dict:
    """Distill every split of `prompts` into `output`; resumes from `<split>.jsonl.partial`."""

    output = Path(output)
    files = prompt_files(prompts)
    splits = {split: read_prompt_file(path) for split, path in files}  # validate all before any work
    # --limit may change between runs (a run cut short is finished with a smaller one).
    run = {"model": model_ref, "prompts": str(prompts), "max_tokens": settings.max_tokens}
    _check_resume(output, run)
    meta = output / "distill.json"
    # Time and tokens add up over the runs that made this output (a resumed run counts its own).
    before = json.loads(meta.read_text()) if meta.exists() else {}
    output.mkdir(parents=True, exist_ok=True)
    summary = {
        "run": run,
        "splits": {},
        "seconds": before.get("seconds", 0.0),
        "generated_tokens": before.get("generated_tokens", 0),
    }
    atomic_write_text(output / "distill.json", json.dumps(summary, indent=2) + "\n")
    d = Distiller(loaded, decoder, settings)
    t0 = time.perf_counter()
    for split, records in splits.items():
        if settings.limit is not None:
            records = records[: settings.limit]
        final, partial = output / f"{split}.jsonl", output / f"{split}.jsonl{PARTIAL}"
        if final.exists():
            counts = {**before.get("splits", {}).get(split, {}), **_count(final)}
            asked = counts.get("prompts", counts["records"] + counts.get("empty_replies_dropped", 0))
            if asked >= len(records):
                log(f"{final}: already complete, kept")
                summary["splits"][split] = counts
                continue
            if counts["records"] != asked:
                raise DataError(
                    f"{final}: cannot be extended to --limit {len(records)}: empty replies were dropped from it, so "
                    "its lines no longer match the prompts (distil into a new --output)"
                )
            # A larger --limit than the finished run: continue it where it stopped.
            final.rename(partial)
        done = _done_lines(partial)
        if done > len(records):  # a smaller --limit than the run that wrote it
            partial.write_text(
                "".join(partial.read_text(encoding="utf-8").splitlines(keepends=True)[: len(records)]), encoding="utf-8"
            )
            done = len(records)
        if done:
            log(f"{partial}: resuming after {done} of {len(records)} prompts")
        bar = tqdm(
            total=len(records),
            initial=done,
            desc=f"distill {split}",
            unit="prompt",
            disable=not progress,
            dynamic_ncols=True,
        )
        start_tokens, start_time = d.generated, time.perf_counter()
        with open(partial, "a", encoding="utf-8") as f:
            for start in range(done, len(records), settings.batch_size):
                rows = d.batch(records[start : start + settings.batch_size])
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(rows))
                rate = (d.generated - start_tokens) / max(1e-9, time.perf_counter() - start_time)
                bar.set_postfix(tok_s=f"{rate:.0f}")
        bar.close()
        summary["splits"][split] = _finish_split(partial, final)
    summary["seconds"] = round(before.get("seconds", 0.0) + time.perf_counter() - t0, 1)
    summary["generated_tokens"] = before.get("generated_tokens", 0) + d.generated
    atomic_write_text(output / "distill.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _finish_split(partial: Path, final: Path) -> dict:
    """Drop records whose last reply is empty (nothing to learn, and the data loader refuses
    them), then move the split into place."""
    lines = partial.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["messages"][-1]["content"].strip()]
    atomic_write_text(final, "".join(kept))
    partial.unlink()
    counts = _count(final)
    counts["empty_replies_dropped"] = len(lines) - len(kept)
    counts["prompts"] = len(lines)
    return counts


def _count(path: Path) -> dict:
    n = cut = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                n += 1
                cut += json.loads(line).get("finish") == "length"
    return {"records": n, "cut_by_max_tokens": cut}
