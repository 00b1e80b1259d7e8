"""Training data: mlx-lm style JSONL files turned into labelled, block-padded examples.

Backend-neutral on purpose (standard library and numpy only): the tokenizer is any
object with the Hugging Face tokenizer interface, so the MLX side can share this.
See docs/method.md sections 2 and 4 for why padding and labels look the way they do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tokens import _ids

IGNORE = -100
SPLITS = ("train", "valid", "test")
ON_LONG = ("error", "truncate", "skip")

# Each record shape and the keys it may have; anything else is a typo worth stopping for.
SHAPES = {
    "messages": ("messages",),
    "prompt": ("prompt", "completion"),
    "text": ("text",),
}
SHAPE_HINT = '{"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}'
# Optional on chat shapes: how the response ended. "length" marks a reply cut by a generation
# limit (as `mars distill` writes them): it did not end, so neither its EOS nor its block
# padding is labelled (docs/method.md §2).
OPTIONAL = {"messages": ("finish",), "prompt": ("finish",), "text": ()}
FINISH = ("eos", "length")


class DataError(ValueError):
    """One-line message: '<file>:<line>: <what is wrong> (<how to fix>)'."""


@dataclass
class Example:
    ids: np.ndarray  # int64 (n,), n a multiple of block_size after padding
    labels: np.ndarray  # int64 (n,), IGNORE where no loss
    source: str  # 'train.jsonl:12'
    truncated: bool


@dataclass
class SplitData:
    examples: list[Example]
    skipped: int  # over-long examples dropped by on_long='skip'
    path: Path

    @property
    def truncated(self) -> int:
        return sum(e.truncated for e in self.examples)


def _fail(where: str, what: str, fix: str) -> DataError:
    return DataError(f"{where}: {what} ({fix})")


def _json_type(value) -> str:
    # Users wrote JSON, so name JSON types, not Python ones.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _need_str(value, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"{name} must be a string, got {_json_type(value)}", "quote it as a JSON string")
    return value


def check_record(record, where: str) -> str:
    """Validate one record's shape; return the shape name ('messages', 'prompt' or 'text')."""
    shape = _record_shape(record, where)
    if "finish" in record and record["finish"] not in FINISH:
        raise _fail(
            where,
            f'\'finish\' must be "eos" or "length", got {json.dumps(record["finish"])}',
            '"length" marks a response cut by a length limit; remove the field otherwise',
        )
    if shape == "text":
        if not _need_str(record["text"], "'text'", where).strip():
            raise _fail(where, "empty 'text'", "remove the line or give it some text")
    elif shape == "prompt":
        _need_str(record["prompt"], "'prompt'", where)
        if not _need_str(record["completion"], "'completion'", where).strip():
            raise _fail(
                where,
                "empty 'completion'",
                "every example needs a response to learn; remove the line",
            )
    else:
        _check_messages(record["messages"], where)
    return shape


def _record_shape(record, where: str) -> str:
    """The record's shape, once it is an object with exactly the fields that shape allows."""
    if not isinstance(record, dict):
        raise _fail(
            where,
            f"expected a JSON object, got {_json_type(record)}",
            f"each line must be one of {SHAPE_HINT}",
        )
    shape = next((s for s in SHAPES if s in record), None)
    if shape is None:
        found = ", ".join(repr(k) for k in record) or "none"
        raise _fail(
            where,
            f"no 'messages', 'prompt' or 'text' field (fields: {found})",
            f"each line must be one of {SHAPE_HINT}",
        )
    allowed = SHAPES[shape]
    for key in record:
        if key not in allowed and key not in OPTIONAL[shape]:
            expected = " or ".join(repr(k) for k in allowed + OPTIONAL[shape])
            raise _fail(
                where,
                f"unknown field {key!r}; expected {expected}",
                f"remove it; each line must be one of {SHAPE_HINT}",
            )
    for key in allowed:
        if key not in record:
            fields = " and ".join(repr(k) for k in allowed)
            raise _fail(where, f"missing field {key!r}", f"this record shape needs {fields}")
    return shape


def _check_messages(messages, where: str) -> None:
    """A non-empty array of {"role", "content"} string objects ending in a non-empty assistant reply."""
    if not isinstance(messages, list) or not messages:
        got = "an empty array" if messages == [] else _json_type(messages)
        raise _fail(
            where,
            f"'messages' must be a non-empty array, got {got}",
            'write [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]',
        )
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail(
                where,
                f"{name} must be an object, got {_json_type(message)}",
                'write {"role": ..., "content": ...}',
            )
        for key in ("role", "content"):
            if key not in message:
                raise _fail(where, f"{name} has no {key!r}", 'write {"role": ..., "content": ...}')
            _need_str(message[key], f"{name}.{key}", where)
    last = messages[-1]
    if last["role"] != "assistant":
        raise _fail(
            where,
            f"the last message has role {last['role']!r}, not 'assistant'",
            "the last message is the response to learn; end the conversation with an assistant message",
        )
    if not last["content"].strip():
        raise _fail(
            where,
            "empty final assistant message",
            "every example needs a response to learn; remove the line",
        )


def read_jsonl(path) -> list[tuple[int, dict]]:
    """Every record of a JSONL file with its 1-based line number, all validated before returning."""
    path = Path(path)
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                # utf-8-sig: editors on Windows like to start files with a byte-order mark.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise _fail(
                    where,
                    f"not valid UTF-8 ({e.reason} at byte {e.start})",
                    "save the file as UTF-8",
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # else an open string blames the newline
            except json.JSONDecodeError as e:
                raise _fail(
                    where,
                    f"malformed JSON: {e.msg} at column {e.colno}",
                    "each line must be one complete JSON object",
                ) from None
            check_record(record, where)
            records.append((lineno, record))
    return records


def _chat_ids(tokenizer, messages, where: str, **kwargs) -> list[int]:
    try:
        return _ids(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs))
    except Exception as e:  # templates raise their own (jinja) errors, e.g. on role order
        raise _fail(
            where,
            f"the chat template failed: {e}",
            'fix the conversation, or use the {"text": ...} shape',
        ) from None


def encode_record(record, tokenizer, *, eos_id: int, where: str = "record") -> tuple[list[int], list[int]]:
    """(ids, labels), unpadded: prompt tokens labelled IGNORE, the response (ending in eos_id) labelled."""
    shape = check_record(record, where)
    if shape == "text":
        ids = _ids(tokenizer(record["text"]))
        if not ids or ids[-1] != eos_id:  # some tokenizers append EOS themselves
            ids.append(eos_id)
        # docs/method.md §4: position 0 has no predecessor, so it can never carry a label.
        return ids, [IGNORE] + ids[1:]

    if getattr(tokenizer, "chat_template", None) is None:
        raise _fail(
            where,
            "the tokenizer has no chat template, so chat records cannot be encoded",
            'use the {"text": ...} shape, or a tokenizer with a chat template',
        )
    if shape == "prompt":
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    else:
        messages = record["messages"]
    prompt = _chat_ids(tokenizer, messages[:-1], where, add_generation_prompt=True)
    full = _chat_ids(tokenizer, messages, where)
    if full[: len(prompt)] != prompt:
        raise _fail(
            where,
            "the chat template does not extend the prompt (the conversation's tokens do not start with the prompt's)",
            'this template rewrites earlier turns; use the {"text": ...} shape',
        )
    response = full[len(prompt) :]
    # Templates add text after the EOS (a newline, say) that the model should never be taught.
    if eos_id in response:
        response = response[: response.index(eos_id) + 1]
    else:
        response.append(eos_id)
    if not record_ended(record):
        response = response[:-1]  # the reply was cut, not ended: its EOS is no target
    return prompt + response, [IGNORE] * len(prompt) + response


def record_ended(record) -> bool:
    """False for a response marked as cut by a length limit ("finish": "length")."""
    return record.get("finish") != "length"


def pad_to_block(ids, labels, block_size: int, eos_id: int, *, ended: bool) -> tuple[np.ndarray, np.ndarray]:
    """Pad with eos_id to a multiple of block_size (docs/method.md §2).

    The padding is labelled EOS only when the response really ended; a response cut by the
    length limit did not, and labelling its padding would teach the model to stop mid-thought.
    """
    n = len(ids)
    extra = -n % block_size
    ids = np.asarray(list(ids) + [eos_id] * extra, dtype=np.int64)
    labels = np.asarray(list(labels) + [eos_id if ended else IGNORE] * extra, dtype=np.int64)
    return ids, labels


def find_split_file(data, split) -> Path | None:
    """data/<split>.jsonl, or the file itself when data is a single .jsonl file (its 'train' split)."""
    data = Path(data)
    if data.is_file():
        return data if split == "train" and data.suffix == ".jsonl" else None
    candidate = data / f"{split}.jsonl"
    return candidate if candidate.is_file() else None


def read_split(path_or_dir, split) -> tuple[Path, list[tuple[int, dict]]]:
    """(the split's file, its records with their line numbers): `find_split_file`, validated
    by `read_jsonl`; a missing or empty split raises DataError."""
    path = find_split_file(path_or_dir, split)
    if path is None:
        raise _no_split_file(Path(path_or_dir), split)
    records = read_jsonl(path)
    if not records:
        raise DataError(f"{path}: no records (the {split} split is empty; add at least one JSON line)")
    return path, records


def load_split(
    path_or_dir,
    split,
    tokenizer,
    *,
    block_size: int,
    max_seq_length: int,
    on_long: str = "error",
    eos_id: int | None = None,
) -> SplitData:
    """Read, validate and encode a whole split; raises DataError rather than return a partial one."""
    limit = _usable_length(on_long, block_size, max_seq_length)
    if eos_id is None:
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            raise ValueError("the tokenizer has no eos token; pass eos_id explicitly")
    path, records = read_split(path_or_dir, split)
    examples, skipped = [], 0
    for lineno, record in records:
        where = f"{path}:{lineno}"
        ids, labels = encode_record(record, tokenizer, eos_id=eos_id, where=where)
        fitted = _fit_length(
            ids, labels, where, block_size=block_size, limit=limit, max_seq_length=max_seq_length, on_long=on_long
        )
        if fitted is None:
            skipped += 1
            continue
        ids, labels, truncated = fitted
        ended = not truncated and record_ended(record)
        ids, labels = pad_to_block(ids, labels, block_size, eos_id, ended=ended)
        examples.append(Example(ids=ids, labels=labels, source=where, truncated=truncated))
    if not examples:
        raise DataError(
            f"{path}: all {skipped} examples exceed max_seq_length={max_seq_length} and were skipped (raise "
            f"max_seq_length=, or set on_long=truncate)",
        )
    return SplitData(examples=examples, skipped=skipped, path=path)


def _usable_length(on_long: str, block_size: int, max_seq_length: int) -> int:
    """The longest row a split may hold: rows are padded to whole blocks, so the largest
    whole number of blocks within max_seq_length."""
    if on_long not in ON_LONG:
        raise ValueError(f"on_long must be one of {ON_LONG}, got {on_long!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    limit = max_seq_length // block_size * block_size
    if limit < block_size:
        raise ValueError(f"max_seq_length={max_seq_length} is shorter than one block ({block_size} tokens)")
    return limit


def _no_split_file(data: Path, split: str) -> DataError:
    """Why `data` holds no file for `split`."""
    if not data.exists():
        return DataError(
            f"{data}: no such file or directory (the data is a directory with train.jsonl and valid.jsonl, or one "
            f".jsonl file)",
        )
    if data.is_file():
        what = "is not a .jsonl file"
        if data.suffix == ".jsonl":
            what = f"is a single file, which only has a train split, not {split!r}"
        return DataError(f"{data}: {what} (pass a directory with {split}.jsonl)")
    expected = ", ".join(f"{s}.jsonl" for s in SPLITS)
    return DataError(
        f"{data}: no {split}.jsonl (a data directory holds {expected}; train.jsonl is required)",
    )


def _fit_length(ids, labels, where: str, *, block_size: int, limit: int, max_seq_length: int, on_long: str):
    """(ids, labels, truncated) of one encoded example within `limit` once padded, or None
    when `on_long` skips it; raises when it is too long and `on_long` is "error" or when
    truncation leaves no label."""
    padded = len(ids) + (-len(ids) % block_size)
    if padded <= limit:
        return ids, labels, False
    if on_long == "error":
        count = f"{len(ids)} tokens"
        if padded != len(ids):
            count += f" ({padded} padded to block_size={block_size})"
        raise _fail(
            where,
            f"{count} exceed max_seq_length={max_seq_length}",
            "it is neither truncated nor skipped by default: raise max_seq_length=, or set on_long=truncate|skip",
        )
    if on_long == "skip":
        return None
    ids, labels = ids[:limit], labels[:limit]
    if all(label == IGNORE for label in labels):
        raise _fail(
            where,
            f"the prompt alone fills max_seq_length={max_seq_length}, so truncation leaves nothing to learn",
            "raise max_seq_length=, shorten the prompt, or set on_long=skip",
        )
    return ids, labels, True


def batches(
    examples, batch_size: int, *, pad_id: int, seed: int = 0, shuffle: bool = True
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids (b, L), labels (b, L), lengths (b,)) batches of rows of similar length.

    Sorting by length keeps padding (wasted compute, doubled by the two MARS streams) small;
    shuffling the order of the batches keeps the optimiser from seeing short-to-long.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng(seed)
    order = np.arange(len(examples))
    if shuffle:
        # Randomise ties before the stable sort, so equal-length rows do not always share a batch.
        order = rng.permutation(order)
    lengths = np.array([len(examples[i].ids) for i in order], dtype=np.int64)
    order = order[np.argsort(lengths, kind="stable")]
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
    for chunk in chunks:
        rows = [examples[i] for i in chunk]
        lens = np.array([len(r.ids) for r in rows], dtype=np.int64)
        width = int(lens.max())
        ids = np.full((len(rows), width), pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        for j, row in enumerate(rows):
            ids[j, : lens[j]] = row.ids
            labels[j, : lens[j]] = row.labels
        yield ids, labels, lens
