"""Driving the `mars` command in-process (click's CliRunner), checking how it fails, and the small JSONL datasets the
CLI tests train on."""

from __future__ import annotations

import json
import string
from pathlib import Path

from click.testing import CliRunner

from mars.cli.main import cli

LETTERS = string.ascii_lowercase


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output[-2000:]}\n{result.exception!r}"
    return result


def one_line_error(result, *needles):
    """A known bad input: exit 1, no traceback, the last line is 'Error: ...' naming the problem."""
    assert result.exit_code != 0, result.output[-2000:]
    # A ClickException ends in SystemExit; anything else escaped the friendly-error net.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines, "no output at all"
    last = lines[-1]
    assert last.startswith("Error:"), result.output[-2000:]
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"
    return last


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def spell_records(n=20):
    return [
        {"prompt": f"Spell from {LETTERS[i % 14]}", "completion": " ".join(LETTERS[i % 14 : i % 14 + 12])}
        for i in range(n)
    ]
