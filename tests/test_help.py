"""Every command's --help: no empty bounds, and chat lists the slash commands it handles."""

import inspect
import re

import pytest
from clitools import invoke, ok

from mars.cli import generate
from mars.cli.main import cli


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_help_prints_no_none_bound(name):
    text = ok(invoke(name, "--help")).output
    assert not re.search(r"(<=?|>=?)\s*None|None\]", text), text


def handled_slash_commands() -> set[str]:
    """The slash commands chat's code compares against, read from its source."""
    source = inspect.getsource(generate.chat_command.callback) + inspect.getsource(generate.chat_command_line)
    found = set(re.findall(r'command == "(/[a-z]+)"', source))
    for group in re.findall(r"command in \(([^)]*)\)", source):
        found |= set(re.findall(r'"(/[a-z]+)"', group))
    return found


def test_chat_help_lists_every_slash_command_it_handles():
    handled = handled_slash_commands()
    assert {"/threshold", "/lossless", "/verify", "/reset", "/help", "/quit"} <= handled  # the reading works
    text = ok(invoke("chat", "--help")).output
    missing = sorted(c for c in handled if not re.search(re.escape(c) + r"\b", text))
    assert not missing, f"chat --help does not list {missing}"
