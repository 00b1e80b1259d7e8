"""`mars generate` and `mars chat`: decode prompts, or a conversation, with a speed knob."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ..core.decode.drafts import LABELS
from ..core.decode.types import masks_share
from .common import backend_option, decode_options, friendly_errors, model_options, open_session, plan_from_options


@click.command("generate")
@model_options
@click.option("--prompt", "prompt_texts", multiple=True, help="A prompt (repeat for several).")
@click.option(
    "--prompts",
    "prompt_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='A file of prompts: JSONL ({"prompt"} or {"messages"}) or one per line.',
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt (text, tokens, statistics).")
@click.option(
    "--logprobs",
    type=click.IntRange(0, 20),
    default=None,
    help="--json: also print each token's log-probability and the N most likely ids at its place (under the "
    "distribution it was taken from: the model's, or in threshold modes a mask's); the tokens do not change.",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Also run the prompts as plain greedy AR (threshold 1.0) and print both side by side.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="--compare: timed rounds, AR and the mode interleaved; each mode reports its median round, "
    "and the speed ratio is the ratio of those two.",
)
@decode_options
@backend_option
@friendly_errors
def generate_command(
    model,
    adapter_path,
    dtype,
    device,
    prompt_texts,
    prompt_file,
    batch_size,
    raw,
    as_json,
    logprobs,
    compare,
    rounds,
    backend,
    **decode,
):
    """Generate replies; prints the text and tokens per forward."""
    from ..core.acceptance import ar_threshold
    from ..core.decode.plan import replan
    from ..prompts import read_prompts
    from ..session import token_logprobs

    prompts = list(prompt_texts) + (read_prompts(prompt_file) if prompt_file else [])
    if not prompts:
        raise click.UsageError("give --prompt TEXT or --prompts FILE")
    session = open_session(
        model, adapter_path, dtype, device, backend, decode.pop("remeasure_cost"), decode.pop("compile_steps")
    )
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs prints with --json")
    settings = plan_from_options(session, **decode, logprobs=logprobs)
    tok = session.tokenizer
    ids = session.encode(prompts, chat=not raw)
    runs = [settings]
    if compare:
        # AR beside the mode: the same request at the AR threshold, planned as every plan is.
        runs = [replan(settings, session.mars, threshold=ar_threshold(settings.metric), lossless=False), settings]
    for s in runs:
        session.prepare_feed(s, batch=min(batch_size, len(ids)))  # measured (once per device) before anything is timed
    # Rounds interleave AR and the mode, so drift on a busy machine hits both alike.
    timed = [[session.decode(ids, s, batch_size) for s in runs] for _ in range(rounds if compare else 1)]
    # Every figure printed for a mode (texts, JSON rows, its summary line) comes from one round: its median.
    results = [median_round([t[k] for t in timed]) for k in range(len(runs))]
    rows = [r.total.rows for r in results]
    for i, p in enumerate(prompts):
        texts = [tok.decode(r.tokens[i], skip_special_tokens=True) for r in results]
        if as_json:
            for s, r, text, run_rows in zip(runs, results, texts, rows):
                row = run_rows[i]
                click.echo(
                    json.dumps(
                        {
                            "prompt": p,
                            "mode": s.name,
                            "text": text,
                            "tokens": len(r.tokens[i]),
                            "finish": r.finish[i],
                            "forwards": row.forwards,
                            "tokens_per_forward": round(row.tokens_per_forward, 3),
                            **sources_fields(row.by_source),
                            **(
                                {"logprobs": token_logprobs(tok, r.tokens[i], r.logprobs[i])}
                                if r.logprobs is not None
                                else {}
                            ),
                        }
                    )
                )
            continue
        click.echo(f"--- [{i}] {p if isinstance(p, str) else p[-1]['content']}")
        if compare:
            click.echo(f"[{runs[0].name}]")
            click.echo(texts[0])
            click.echo(f"[{runs[1].name}]" + ("  (same text)" if texts[1] == texts[0] else ""))
        click.echo(texts[-1])
    if not compare:
        lines = [summary(runs[0], results[0])]
    else:
        lines = [summary(s, r, [speed(t[k]) for t in timed]) for k, (s, r) in enumerate(zip(runs, results))]
        lines.append(compare_line(runs, results, timed, len(prompts)))
    for line in lines:
        click.echo(line, err=as_json)


def speed(r) -> float:
    """Decoded tokens per second of wall time."""
    return r.total.accepted / max(r.seconds, 1e-9)


def median_round(decoded: list):
    """The round whose speed is the median (the lower of the middle two for an even count)."""
    return sorted(decoded, key=speed)[(len(decoded) - 1) // 2]


def compare_line(runs, results, timed, prompts: int) -> str:
    """--compare's last line: replies equal to AR's, and the mode's speed over AR's, from the
    two tokens/s the summary lines above print, with the per-round ratios' range."""
    same = sum(a == b for a, b in zip(results[0].tokens, results[1].tokens))
    ar, mode = speed(results[0]), speed(results[1])
    line = (
        f"{same}/{prompts} replies identical to AR; {runs[1].name}: {mode / max(ar, 1e-9):.2f}x AR's tokens/s "
        f"({mode:.1f} / {ar:.1f} tok/s"
    )
    if len(timed) == 1:
        return line + ", one round)"
    per_round = [speed(t[1]) / max(speed(t[0]), 1e-9) for t in timed]
    return line + f", the medians above; round by round {min(per_round):.2f}-{max(per_round):.2f}x)"


SOURCES = {**LABELS, "ar": "AR", "threshold": "unverified (threshold)"}


def summary(settings, r, round_speeds: list[float] | None = None) -> str:
    """One run's totals; lossless runs add where the tokens came from (drafts kept, by source;
    one AR token a step). With `round_speeds` (the tokens/s of every round, `r` the median
    one) the time says it is the median round, and the rounds' range."""
    total = r.total
    n, f, sec = total.accepted, total.row_forwards, r.seconds
    cache = settings.cache
    if total.cache and total.cache != cache:  # the block cache did not pay on this device
        cache = f"{total.cache} (the block cache would be slower here)"
    line = (
        f"{settings.name}, B={settings.block_size}, cache={cache}: {n} tokens, {f} forwards, "
        f"{n / max(1, f):.2f} tokens/forward, {sec:.2f}s ({speed(r):.1f} tok/s"
    )
    if round_speeds and len(round_speeds) > 1:
        line += f"; median of {len(round_speeds)} rounds, range {min(round_speeds):.1f}-{max(round_speeds):.1f} tok/s"
    line += ")"
    fed = total.masks_fed
    if fed and settings.masks_per_step and set(fed) != {settings.masks_per_step}:  # threshold mode, --feed auto
        line += "; masks fed a step: " + ", ".join(f"{m} ({n} forwards)" for m, n in sorted(fed.items()))
    sources = total.by_source()
    if sources:
        line += "; tokens from " + ", ".join(f"{SOURCES[k]} {sources[k]}" for k in SOURCES if sources.get(k))
        share = masks_share(sources)
        if share is not None:
            line += f"; the masks' share of the extra tokens {share:.0%}"
    return line


def sources_fields(sources: dict) -> dict:
    """--json: where a reply's tokens came from and the masks' share of its extra tokens."""
    if not sources:
        return {}
    share = masks_share(sources)
    return {"tokens_by_source": dict(sources), "masks_share": None if share is None else round(share, 4)}


@click.command("chat")
@model_options
@click.option("--system", default=None, help="A system message.")
@decode_options
@backend_option
@friendly_errors
def chat_command(model, adapter_path, dtype, device, system, backend, **decode):
    """Interactive chat that streams tokens as they are accepted.

    Commands: /threshold 0.9 (decode at this threshold), /lossless (decode losslessly),
    /verify (verified threshold mode on or off), /reset (forget the conversation), /help,
    /quit (or /exit). A message that starts with "/" is sent by doubling it:
    "//etc/hosts is a file" sends "/etc/hosts is a file".
    """
    from ..core.tokens import encode_prompt

    session = open_session(
        model, adapter_path, dtype, device, backend, decode.pop("remeasure_cost"), decode.pop("compile_steps")
    )
    settings = plan_from_options(session, **decode)
    tok = session.tokenizer
    history = [{"role": "system", "content": system}] if system else []
    click.echo(f"{settings.name}, B={settings.block_size}. /help lists the commands", err=True)
    session.prepare_feed(settings)  # a first measurement of the device happens now, not inside the first reply
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("")
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            command = line.split()[0]
            if command in ("/quit", "/exit"):
                return
            if command == "/reset":
                history = history[:1] if system else []
                continue
            settings = chat_command_line(line, decode, settings, session)
            continue
        if line.startswith("//"):
            line = line[1:]
        history.append({"role": "user", "content": line})
        out: list[int] = []
        shown = ""

        def stream(row, new):
            nonlocal shown
            out.extend(new)
            text = tok.decode(out, skip_special_tokens=True)
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text

        t0 = time.perf_counter()
        result = session.generate([encode_prompt(tok, history)], settings, on_tokens=stream)
        dt = time.perf_counter() - t0
        st = result.stats.rows[0]
        click.echo("")
        click.echo(
            f"[{settings.name}: {st.accepted} tokens, {st.forwards} forwards, {st.tokens_per_forward:.2f} "
            f"tokens/forward, {dt:.2f}s]",
            err=True,
        )
        history.append({"role": "assistant", "content": shown})


CHAT_HELP = """commands:
  /threshold X   decode in threshold mode at X (1.0 is plain greedy AR)
  /lossless      decode losslessly (the masks draft, the next forward verifies)
  /verify        turn verified threshold mode on or off (threshold mode: drafts not taken are verified)
  /reset         forget the conversation
  /help          this list
  /quit          leave (also /exit, Ctrl-D)
a message that starts with "/" is sent by doubling the slash: //etc/hosts ..."""


def chat_command_line(line: str, asked: dict, settings, session):
    """Carry out a chat slash command (not /quit or /reset), reporting on stderr; never sends
    text to the model. `asked`: the chat's decoding options, which a command changes; returns
    the plan to decode by from now on, made anew by plan_from_options where the options changed."""
    from ..core.acceptance import ThresholdError, ar_threshold, check_threshold
    from ..core.decode.plan import replan, why_not_verified
    from ..core.decode.rules import UntrainedModelError, check_may_decode

    parts = line.split()
    command = parts[0]
    if command == "/help":
        click.echo(CHAT_HELP, err=True)
    elif command == "/threshold":
        if len(parts) != 2:
            click.echo("usage: /threshold 0.9", err=True)
            return settings
        try:
            threshold = check_threshold(settings.metric, float(parts[1]))
        except ValueError as e:
            why = str(e) if isinstance(e, ThresholdError) else f"{parts[1]!r} is not a number"
            click.echo(f"{why}; keeping {settings.name}", err=True)
            return settings
        try:
            check_may_decode(session.mars is not None, settings.metric, threshold, force=asked["force"])
        except UntrainedModelError as e:
            click.echo(f"{e}; keeping plain AR (start with --force to override)", err=True)
            threshold = ar_threshold(settings.metric)
        settings = replan(
            settings,
            session.mars,
            threshold=threshold,
            lossless=False,
            verify=asked.get("verify"),
            force=asked["force"],
        )
        click.echo(settings.name, err=True)
    elif command == "/lossless":
        settings = replan(settings, session.mars, lossless=True, threshold=None)
        click.echo(settings.name, err=True)
    elif command == "/verify":
        asked["verify"] = asked.get("verify") is False  # greedy threshold mode verifies unless told not to
        settings = replan(settings, session.mars, verify=asked["verify"], force=asked["force"])
        why = why_not_verified(settings) if asked["verify"] else None
        click.echo(settings.name + (f" (verify is on, for threshold mode: {why})" if why else ""), err=True)
    else:
        click.echo(
            f"unknown command {command}; /help lists the commands (start a message with // to send a leading /)",
            err=True,
        )
    return settings
