"""`mars eval`: AR quality (NLL per response token) and a decoding threshold sweep.

Two measurements per model, on one dataset or prompt file:

1. NLL: the mean clean-stream loss per response token (the model's ordinary next-token
   loss) and, for a MARS checkpoint (with mars.json), the noisy-stream loss, computed with
   the training loss code (docs/method.md §4) and aggregated as one token-weighted mean over the
   whole split. Padding after a response's EOS carries no loss here (training counts it):
   every response token, its EOS included, counts once.
2. A threshold sweep with the decoding loop (docs/method.md §5): per threshold, tokens per forward,
   the acceptance rate of each window slot, and agreement with the same model's AR output
   (threshold 1.0): exact-match rate and mean matching-prefix length. Lossless and verified
   rows also report their parity with AR in the format the model ran in (mars.parity): the
   replies identical to AR's and, for each other one, its first divergence and AR's top-2
   logit gap there (a gap within the format's rounding is a near-tie, not a method error).

Backend-neutral: the models are opened as a mars.session.Session, and `nll` reaches the
framework only through the backend contract (mars.backends.base.losses).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backends import base
from .core.decode.plan import Mode
from .core.decode.rules import metric_for
from .core.decode.types import masks_share, sum_ragged
from .core.files import atomic_write_text
from .core.train.data import IGNORE, DataError, batches, load_split, read_jsonl
from .parity import GAP_MEANING, common_prefix, parity, summary
from .prompts import RawText, prompt_of, split_files
from .session import Session, decode_batches

DEFAULT_THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5)


@dataclass
class EvalSettings:
    thresholds: tuple = DEFAULT_THRESHOLDS
    metric: str | None = None  # default: the checkpoint's, else probability
    block_size: int | None = None  # default: the checkpoint's, else 4
    max_tokens: int = 128
    batch_size: int = 8
    cache: str = "window"  # none | window | block
    block_cache: int = 16
    max_seq_length: int = 512
    on_long: str = "error"
    limit: int | None = None  # at most this many prompts are decoded
    force: bool = False  # sweep below AR mode on a model without mars.json
    decode: bool = True
    nll: bool = True
    lossless: bool = False  # also decode in lossless mode (docs/method.md §8): one more row, exact by construction
    hedges: tuple = (None,)  # lossless rows: spare mask groups of each (DraftSources.hedge; None: B)
    trees: tuple = (0,)  # lossless rows: tree nodes of each (DraftSources.tree; 0: the chain alone)
    alternatives: int = 0  # lossless and verified rows: runner-up groups (DraftSources.alternatives)
    # Lossless and verified rows: also draft up to this many tokens a step from n-gram lookup in
    # the prompt and reply and from the checkpoint's draft corpus (DraftSources.ngram, .corpus);
    # 0: the masks' drafts only.
    ngram: int = 0
    # Also decode each threshold below AR mode in verified threshold mode (Mode.VERIFIED):
    # one more row per threshold, named v<threshold>. Like the lossless rows, masks only (no n-gram
    # drafts) and a fixed feed: the weights' own figure.
    verify: bool = False
    humaneval: int = 0  # also sweep the first N HumanEval problems and report pass@1 per mode (mars.humaneval)
    humaneval_timeout: float = 10.0  # seconds each problem's tests may run


def load_model(
    model,
    backend: str = "auto",
    *,
    label: str | None = None,
    dtype=None,
    device=None,
    announce=lambda m: None,
    compile: bool | str = False,
) -> Session:
    """Open `model` (a path, or None for the embedded default) with the resolved backend; its
    `label` (reports name it by) is `label`, else the model as given, else "default"; `compile`:
    Session's."""
    return Session(model, backend=backend, dtype=dtype, device=device, announce=announce, label=label, compile=compile)


# -- data ---------------------------------------------------------------------------------------


def eval_file(data, split: str | None = None) -> tuple[Path, str]:
    """(file, split name): a single .jsonl file as it is, else DIR/<split>.jsonl; without a split,
    test.jsonl, falling back to valid.jsonl."""
    found = split_files(
        data,
        [split] if split else ["test", "valid"],
        takes="--data takes a directory with test.jsonl or valid.jsonl, or one .jsonl file",
    )
    if found:
        name, path = found[0]
        return path, name or path.stem
    wanted = f"{split}.jsonl" if split else "test.jsonl or valid.jsonl"
    hint = "" if split else "; pass --split train to evaluate on the training data"
    raise DataError(f"{data}: no {wanted}{hint}")


def load_examples(path: Path, tokenizer, *, block_size: int, max_seq_length: int = 512, on_long: str = "error"):
    """Encoded, block-padded examples of one JSONL file (the training encoding)."""
    # load_split reads DIR/<split>.jsonl or a single file as 'train': give it the file.
    return load_split(
        path, "train", tokenizer, block_size=block_size, max_seq_length=max_seq_length, on_long=on_long
    ).examples


def dataset_prompts(path: Path) -> list:
    """The prompts of a dataset's records: messages without the final assistant turn, or the
    'prompt' field; `text` records have no prompt and are skipped."""
    return [p for p in (prompt_of(record) for _, record in read_jsonl(path)) if p is not None]


def response_labels(labels: np.ndarray, eos_id: int) -> np.ndarray:
    """Labels with the block padding after each row's first labelled EOS set to IGNORE."""
    labels = np.array(labels, dtype=np.int64, copy=True)
    for row in labels:
        hit = np.nonzero((row == eos_id) & (np.arange(row.size) > 0))[0]
        if hit.size:
            row[hit[0] + 1 :] = IGNORE
    return labels


# -- NLL ----------------------------------------------------------------------------------------


def nll(session: Session, examples, *, block_size: int | None = None, batch_size: int = 8) -> dict:
    """Mean clean- and noisy-stream NLL per response token over `examples` (token-weighted).

    Uses the training forward and loss (normalize="token"), so the clean NLL is the model's
    ordinary next-token loss on the responses. The noisy NLL is reported for MARS checkpoints
    only (None otherwise, with a note: a plain model's mask token was never trained).
    """
    B = session.block_size(block_size)
    mask_id = session.mask_id()
    eos_id = session.loaded.tokenizer.eos_token_id
    pad_id = eos_id
    clean_sum = noisy_sum = 0.0
    count = 0
    step = base.losses(session.loaded)
    for ids, labels, lengths in batches(examples, batch_size, pad_id=pad_id, shuffle=False):
        labels = response_labels(labels, eos_id)
        n = int((labels[:, 1:] != IGNORE).sum())
        if n == 0:
            continue
        noisy, clean = step(ids, labels, lengths, B, mask_id)
        noisy_sum += noisy * n
        clean_sum += clean * n
        count += n
    if count == 0:
        raise DataError("no response tokens to evaluate")
    out = {
        "tokens": count,
        "examples": len(examples),
        "block_size": B,
        "clean_nll": clean_sum / count,
        "noisy_nll": noisy_sum / count if session.mars is not None else None,
    }
    out["clean_ppl"] = math.exp(out["clean_nll"])
    if session.mars is None:
        out["note"] = "no mars.json: the noisy stream (mask predictions) was never trained; its NLL is not reported"
    return out


# -- decoding sweep -----------------------------------------------------------------------------


def decode_all(session: Session, prompt_ids: list, settings, batch_size: int = 8) -> dict:
    """Decode every prompt in batches; tokens per row plus the summed statistics."""
    decoded = decode_batches(session.decoder, prompt_ids, settings, batch_size)
    total = decoded.total
    slots = sum_ragged([[0] * (settings.masks_per_step + 1)] + [row.accepted_per_slot for row in total.rows])
    per_slot = np.asarray(slots, dtype=np.int64)
    totals = [stats.draft_totals() for stats in decoded.stats]  # each batch's draft slots
    drafts = {name: sum_ragged(t[name] for t in totals) for name in (totals[0] if totals else {})}
    return {
        "outputs": decoded.tokens,
        "accepted": total.accepted,
        "forwards": total.row_forwards,
        "per_slot": per_slot,
        "drafts": drafts,
        "seconds": decoded.seconds,
        "by_source": total.by_source(),
    }


def sweep(session: Session, prompts: list, settings: EvalSettings, *, announce=lambda m: None) -> dict:
    """Decode `prompts` at every threshold of `settings`; agreement is measured against the AR
    output (threshold 1.0, or 0.0 for entropy), which is always run first."""
    from .core.acceptance import ar_threshold, is_ar_mode
    from .core.decode.rules import may_decode
    from .core.tokens import encode_prompt

    metric = metric_for(session.mars, settings.metric)
    B = session.block_size(settings.block_size)
    ar = ar_threshold(metric)
    thresholds = list(dict.fromkeys(float(t) for t in settings.thresholds))
    others = [t for t in thresholds if not is_ar_mode(metric, t)]
    skipped = [] if settings.force else [t for t in others if not may_decode(session.mars is not None, metric, t)]
    others = [t for t in others if t not in skipped]
    tok = session.loaded.tokenizer
    prompt_ids = [encode_prompt(tok, p, chat=not isinstance(p, RawText)) for p in prompts]
    if not prompt_ids:
        raise DataError("no prompts to decode (text records have none; pass a prompt file)")

    def run(threshold, lossless=False, hedge=None, verify=False, tree=0):
        s = base.plan_for_model(
            session.loaded,
            threshold=threshold,
            metric=metric,
            block_size=B,
            lossless=lossless,
            force=settings.force,
            max_tokens=settings.max_tokens,
            cache=settings.cache,
            block_cache=settings.block_cache,
            hedge=hedge,
            verify=verify,
            alternatives=settings.alternatives,
            ngram=settings.ngram,
            tree=tree,
        )
        alts = f", {s.alternative_groups} runner-up groups" if s.alternative_groups else ""
        alts += f", trees of up to {s.tree_nodes} nodes" if s.tree_nodes else ""
        lookup, corpus = (
            s.lookup_drafts,
            s.lookup_drafts > 0 and s.drafts.corpus is not None,
        )  # where the plan verifies drafts
        if lookup:
            alts += f", n-gram{' and corpus' if corpus else ''} drafts of up to {lookup} tokens"
        what = (
            f"lossless ({s.spare_groups} spare groups{alts})"
            if s.mode is Mode.LOSSLESS
            else f"{'verified threshold mode ' if s.mode is Mode.VERIFIED else ''}at threshold {threshold}"
        )
        announce(f"{session.label}: decoding {len(prompt_ids)} prompts {what}")
        return decode_all(session, prompt_ids, s, settings.batch_size) | {
            "hedges": s.spare_groups,
            "alternatives": s.alternative_groups,
            "tree": s.tree_nodes,
            "ngram": lookup,
            "corpus": corpus,
            "name": s.name,
        }

    reference = run(ar)
    rows = []
    modes = [(t, False, None, False, 0) for t in [ar] + others]
    modes += [(t, False, None, True, 0) for t in others] if settings.verify else []
    modes += [(ar, True, h, False, n) for h in settings.hedges for n in settings.trees] if settings.lossless else []
    for threshold, lossless, hedge, verify, tree in modes:
        d = reference if threshold == ar and not lossless else run(threshold, lossless, hedge, verify, tree)
        prefix = [common_prefix(o, r) for o, r in zip(d["outputs"], reference["outputs"])]
        longest = [max(len(o), len(r), 1) for o, r in zip(d["outputs"], reference["outputs"])]
        slots = np.zeros(max(B + 1, d["per_slot"].size))  # n-gram drafts may outnumber the masks
        slots[: d["per_slot"].size] = d["per_slot"] / max(1, d["forwards"])
        rows.append(
            {
                "mode": "lossless" if lossless else "verified" if verify else "threshold",
                "threshold": None if lossless else threshold,
                "name": d["name"],  # the plan's printable name, as generate, chat, bench and the server print it
                "tokens": d["accepted"],
                "forwards": d["forwards"],
                "tokens_per_forward": d["accepted"] / max(1, d["forwards"]),
                "slot_acceptance": [float(x) for x in slots],
                "exact_match": float(np.mean([o == r for o, r in zip(d["outputs"], reference["outputs"])])),
                "mean_prefix": float(np.mean(prefix)),
                "mean_prefix_fraction": float(np.mean([p / n for p, n in zip(prefix, longest)])),
                # The share of the AR output's tokens reproduced before the first divergence.
                "prefix_token_share": float(sum(prefix) / max(1, sum(len(r) for r in reference["outputs"]))),
                "seconds": d["seconds"],
                **({"drafts": d["drafts"], "hedge": d["hedges"]} if lossless or verify else {}),
                **(
                    {"tokens_by_source": d["by_source"], "masks_share": masks_share(d["by_source"])}
                    if d["by_source"]
                    else {}
                ),
                **({"alternatives": d["alternatives"]} if (lossless or verify) and d["alternatives"] else {}),
                **({"tree": d["tree"]} if lossless and d["tree"] else {}),
                **({"ngram": d["ngram"], "corpus": d["corpus"]} if (lossless or verify) and d["ngram"] else {}),
                # Lossless rows promise AR's replies, verified rows come close: where, in this format, they did not.
                **(
                    {"parity": parity(session.decoder, session.loaded, prompt_ids, reference["outputs"], d["outputs"])}
                    if lossless or verify
                    else {}
                ),
                "outputs": d["outputs"],
            }
        )
    out = {
        "metric": metric,
        "block_size": B,
        "cache": settings.cache,
        "max_tokens": settings.max_tokens,
        "prompts": len(prompt_ids),
        "reference_threshold": ar,
        "thresholds": rows,
    }
    if skipped:
        out["skipped_thresholds"] = skipped
        out["note"] = "no mars.json (never MARS-trained): thresholds below AR mode skipped (force=True runs them)"
    return out


# -- the whole evaluation -----------------------------------------------------------------------


def evaluate(
    models: list,
    *,
    baseline: Session | None = None,
    data=None,
    split: str | None = None,
    prompts: list | None = None,
    settings: EvalSettings | None = None,
    announce=lambda m: None,
) -> dict:
    """Evaluate loaded models (mars.session.Session, each named by its `label`) on a dataset
    (`data`: dir or .jsonl) and/or `prompts`.

    NLL needs `data`; the sweep decodes `prompts` when given, else the dataset's prompts.
    The baseline gets the NLL only; each model's NLL is compared with it.
    """
    from .core.acceptance import check_threshold

    s = settings or EvalSettings()
    if data is None and prompts is None and not s.humaneval:
        raise DataError("nothing to evaluate: give a dataset, prompts or humaneval problems")
    if s.decode:  # every threshold in its metric's range before any work
        for session in models:
            for t in s.thresholds:
                check_threshold(metric_for(session.mars, s.metric), t)
    path = None
    if data is not None:
        path, split = eval_file(data, split)
    if prompts is None and s.decode and path is not None:
        prompts = dataset_prompts(path)
    if prompts is not None and s.limit is not None:
        prompts = prompts[: s.limit]
    report = {
        "data": str(path) if path else None,
        "split": split if path else None,
        "settings": _settings_dict(s),
        "models": [],
    }

    def quality(session):
        examples = load_examples(
            path,
            session.loaded.tokenizer,
            block_size=session.block_size(s.block_size),
            max_seq_length=s.max_seq_length,
            on_long=s.on_long,
        )
        announce(f"{session.label}: NLL over {len(examples)} examples")
        return nll(session, examples, block_size=s.block_size, batch_size=s.batch_size)

    do_nll = s.nll and path is not None
    if baseline is not None and do_nll:
        report["baseline"] = {
            "label": baseline.label,
            "backend": baseline.backend,
            "mars": baseline.mars is not None,
            "nll": quality(baseline),
        }
    for session in models:
        entry = {"label": session.label, "backend": session.backend, "mars": session.mars is not None}
        if do_nll:
            entry["nll"] = quality(session)
            if "baseline" in report:
                base = report["baseline"]["nll"]
                entry["nll"]["clean_nll_vs_baseline"] = entry["nll"]["clean_nll"] - base["clean_nll"]
                if entry["nll"]["noisy_nll"] is not None and base.get("noisy_nll") is not None:
                    entry["nll"]["noisy_nll_vs_baseline"] = entry["nll"]["noisy_nll"] - base["noisy_nll"]
                if entry["nll"]["tokens"] != base["tokens"]:
                    entry["nll"]["baseline_note"] = (
                        f"the baseline tokenizes the responses into {base['tokens']} tokens, this model into "
                        f"{entry['nll']['tokens']}: per-token NLLs are not directly comparable"
                    )
        if s.decode and (prompts is not None or path is not None):
            if not prompts:
                raise DataError(f"{path}: no prompts to decode (text records have none; pass a prompt file)")
            entry["sweep"] = sweep(session, prompts, s, announce=announce)
        if s.humaneval:
            entry["humaneval"] = humaneval_sweep(session, s, announce=announce)
        report["models"].append(entry)
    return report


def humaneval_sweep(session: Session, s: EvalSettings, *, announce=lambda m: None) -> dict:
    """The sweep on the first `s.humaneval` HumanEval problems, with pass@1 per mode: each
    reply's code runs against the problem's tests in its own Python process (mars.humaneval)."""
    import dataclasses

    from . import humaneval

    problems = humaneval.load_problems(s.humaneval)
    result = sweep(
        session, [humaneval.messages(p) for p in problems], dataclasses.replace(s, limit=None), announce=announce
    )
    tok = session.loaded.tokenizer
    for row in result["thresholds"]:
        replies = [tok.decode(o, skip_special_tokens=True) for o in row["outputs"]]
        announce(f"{session.label}: running the tests of {len(problems)} HumanEval problems ({_mode_name(row, '.3g')})")
        row["passed"] = humaneval.pass_count(problems, replies, timeout=s.humaneval_timeout)
        row["pass_at_1"] = row["passed"] / len(problems)
    result["problems"] = [p["task_id"] for p in problems]
    return result


def _settings_dict(s: EvalSettings) -> dict:
    d = dict(s.__dict__)
    d["thresholds"] = list(d["thresholds"])
    return d


# -- output -------------------------------------------------------------------------------------


def write_json(report: dict, path, *, outputs: bool = False) -> Path:
    """The report as JSON; decoded token ids are left out unless `outputs`."""

    def strip(r):
        if outputs:
            return r
        r = json.loads(json.dumps(r))
        for m in r["models"]:
            for key in ("sweep", "humaneval"):
                for row in m.get(key, {}).get("thresholds", []):
                    row.pop("outputs", None)
        return r

    return atomic_write_text(path, json.dumps(strip(report), indent=2) + "\n")  # never a half-written report


def _mode_name(row: dict, fmt: str) -> str:
    if row.get("mode") == "verified":
        name = "v" + format(row["threshold"], fmt)
    elif row.get("mode") != "lossless":
        return format(row["threshold"], fmt)
    else:
        name = "lossless" if row.get("hedge") is None else f"lossless/h{row['hedge']}"
    name += f"/a{row['alternatives']}" if row.get("alternatives") else ""
    name += f"/t{row['tree']}" if row.get("tree") else ""
    return name + (f"/n{row['ngram']}{'c' if row.get('corpus') else ''}" if row.get("ngram") else "")


def format_table(report: dict) -> str:
    lines = []
    if report.get("data"):
        lines.append(f"data: {report['data']}")
    base = report.get("baseline")

    def nll_line(label, n, extra=""):
        noisy = f"{n['noisy_nll']:.4f}" if n.get("noisy_nll") is not None else "n/a"
        clean = f"clean NLL {n['clean_nll']:.4f} (ppl {n['clean_ppl']:.2f})"
        return f"  {label}: {clean}, noisy NLL {noisy}, {n['tokens']} tokens{extra}"

    if base:
        lines.append(f"baseline {base['label']}")
        lines.append(nll_line("NLL", base["nll"]))
    for m in report["models"]:
        lines.append(f"model {m['label']} ({m['backend']}{', MARS' if m['mars'] else ', no mars.json'})")
        if "nll" in m:
            n = m["nll"]
            extra = f", clean vs baseline {n['clean_nll_vs_baseline']:+.4f}" if "clean_nll_vs_baseline" in n else ""
            if "noisy_nll_vs_baseline" in n:
                extra += f", noisy vs baseline {n['noisy_nll_vs_baseline']:+.4f}"
            lines.append(nll_line("NLL", n, extra))
            if n.get("baseline_note"):
                lines.append(f"  note: {n['baseline_note']}")
        for key, title in (("sweep", "sweep"), ("humaneval", "HumanEval")):
            sw = m.get(key)
            if not sw:
                continue
            lines.append(
                f"  {title}: {sw['prompts']} prompts, B={sw['block_size']}, cache={sw['cache']}, "
                f"metric={sw['metric']}, max {sw['max_tokens']} tokens"
            )
            w = max([8] + [len(_mode_name(r, ".3g")) for r in sw["thresholds"]])
            p1 = f" {'pass@1':>7}" if key == "humaneval" else ""
            lines.append(
                f"  {'tau':>{w}} {'tok/fwd':>8} {'exact':>6} {'prefix':>7} {'pfrac':>6} {'pshare':>6} {'tokens':>7} "
                f"{'sec':>6}{p1}  slot acceptance 0..B"
            )
            for r in sw["thresholds"]:
                slots = " ".join(f"{x:.2f}" for x in r["slot_acceptance"])
                tau = _mode_name(r, ".3g")
                passed = f" {r['passed']:>3d}/{len(sw['problems']):<3d}" if key == "humaneval" else ""
                lines.append(
                    f"  {tau:>{w}} {r['tokens_per_forward']:>8.3f} {r['exact_match']:>6.2f} {r['mean_prefix']:>7.1f} "
                    f"{r['mean_prefix_fraction']:>6.2f} {r['prefix_token_share']:>6.2f} {r['tokens']:>7d} "
                    f"{r['seconds']:>6.2f}{passed}  {slots}"
                )
            checked = [r for r in sw["thresholds"] if "parity" in r]
            lines += [f"  parity {_mode_name(r, '.3g')}: {summary(r['parity'])}" for r in checked]
            if sw.get("note"):
                lines.append(f"  note: {sw['note']}")
    if any(m.get("sweep") or m.get("humaneval") for m in report["models"]):
        humaneval = any(m.get("humaneval") for m in report["models"])
        lines += [f"  {name}: {meaning}" for name, meaning in SWEEP_COLUMNS if humaneval or name != "pass@1"]
        rows = [r for m in report["models"] for k in ("sweep", "humaneval") for r in m.get(k, {}).get("thresholds", [])]
        if any("parity" in r for r in rows):
            lines.append(f"  parity: replies identical to AR's in this run and format; {GAP_MEANING}")
    return "\n".join(lines)


# What each column of the sweep table means (printed under it, and in the README).
SWEEP_COLUMNS = (
    (
        "tau",
        "the threshold (vX: verified threshold mode at X; lossless/hN: lossless mode with N spare mask groups; "
        "/aN: N runner-up groups; /nN: n-gram drafts of up to N tokens, /nNc: and the draft corpus)",
    ),
    ("tok/fwd", "tokens per forward pass (1.0 is plain AR)"),
    ("exact", "share of replies identical to the threshold-1.0 (AR) reply"),
    ("prefix", "mean tokens before a reply first differs from AR's"),
    ("pfrac", "that prefix as a fraction of the longer reply, averaged over replies"),
    ("pshare", "all AR tokens reproduced before the first difference / all AR tokens"),
    ("tokens", "tokens generated in all"),
    ("sec", "wall time of the decoding, seconds"),
    ("pass@1", "HumanEval: problems whose reply passed the problem's tests (run in a separate process)"),
)


def plot(report: dict, path, *, x: str = "exact") -> Path:
    """Tokens per forward (y) against agreement with AR (x: exact-match rate, or mean prefix
    fraction with x='prefix'): one point per threshold, one line per model. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'mars-mtp[plot]'") from None
    key = {"exact": "exact_match", "prefix": "mean_prefix_fraction"}[x]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for m in report["models"]:
        sw = m.get("sweep")
        if not sw:
            continue
        rows = sw["thresholds"]
        xs, ys = [r[key] for r in rows], [r["tokens_per_forward"] for r in rows]
        (line,) = ax.plot(xs, ys, marker="o", label=f"{m['label']} (B={sw['block_size']})")
        points: dict = {}  # thresholds that land on the same point share one label
        for r, a, b in zip(rows, xs, ys):
            name = _mode_name(r, "g")
            points.setdefault((round(a, 6), round(b, 6)), []).append(name)
        for (a, b), names in points.items():
            ax.annotate(
                ", ".join(names), (a, b), textcoords="offset points", xytext=(4, 4), fontsize=8, color=line.get_color()
            )
    ax.set_xlabel(
        "exact match with threshold 1.0" if x == "exact" else "mean matching-prefix fraction vs threshold 1.0"
    )
    ax.set_ylabel("tokens per forward")
    ax.set_xlim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("MARS: speed vs agreement with AR decoding")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
