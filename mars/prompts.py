"""Prompt files, read one way everywhere: `mars generate`, `mars eval` and `mars bench` read
them with `read_prompts`, `mars distill` reads conversations from the same records, and eval
takes a dataset's prompts with `prompt_of`. `split_files` finds the split files of a data or
prompt directory.

A prompt is a string (sent through the chat template unless asked not to) or a list of chat
messages. A prompt record is `{"prompt": "..."}` or `{"messages": [...]}`; a final assistant
message (a finished example) is left out, so its reply is asked for anew. Where asked, a
`{"text": "..."}` record is a RawText prompt: its text continued as it is, without the template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .core.train.data import DataError


class RawText(str):
    """A `{"text": ...}` record's text as a prompt: fed as it is, without the chat template."""


def prompt_of(record, *, text: bool = False) -> str | list | None:
    """A record's prompt: its 'prompt' string, or its 'messages' without a final assistant
    message, or with `text` a 'text' record's RawText; None for a record with none of these."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    if text and isinstance(record.get("text"), str) and "messages" not in record:
        return RawText(record["text"])
    messages = record.get("messages")
    if not isinstance(messages, list):
        return None
    last = messages[-1] if messages else None
    return messages[:-1] if isinstance(last, dict) and last.get("role") == "assistant" else messages


def json_lines(path) -> Iterator[tuple[str, object]]:
    """('file:line', value) for every non-blank line of a JSONL file (a leading byte-order mark
    is allowed); a line that is not JSON raises DataError naming the file and line."""
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: malformed JSON: {e.msg} at column {e.colno} (each line must be one JSON object)"
                ) from None


def read_prompts(path, *, text: bool = False) -> list:
    """A prompt file: JSONL of {"prompt": ...} or {"messages": [...]} records (with `text`,
    {"text": ...} records too, as RawText prompts), or plain text with one prompt per line."""
    path = Path(path)
    if path.suffix != ".jsonl":
        prompts = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    else:
        prompts = []
        for where, record in json_lines(path):
            prompt = prompt_of(record, text=text)
            if prompt is None:
                shapes = (
                    '{"prompt": ...}, {"messages": [...]} or {"text": ...}'
                    if text
                    else '{"prompt": ...} or {"messages": [...]}'
                )
                raise DataError(f"{where}: expected {shapes}")
            prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def split_files(path, splits, *, takes: str) -> list[tuple[str | None, Path]]:
    """(split, file) pairs: a single .jsonl file as (None, file); for a directory, each
    `<split>.jsonl` of `splits` it holds, in that order. `takes` says what the path should be,
    for the errors."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory ({takes})")
    if path.is_file():
        if path.suffix != ".jsonl":
            raise DataError(f"{path}: not a .jsonl file ({takes})")
        return [(None, path)]
    return [(split, path / f"{split}.jsonl") for split in splits if (path / f"{split}.jsonl").is_file()]
