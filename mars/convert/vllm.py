"""`mars convert SRC --to vllm`: a MARS checkpoint as a vLLM parallel drafter.

MARS trains the masks to predict the next tokens in one forward, which is what vLLM's parallel
drafting asks of a draft model (`"parallel_drafting": true`: the drafter sees the mask token,
named by `mask_token_id` in its config.json, in the positions still to be drafted). vLLM's
target model then verifies every drafted token, so its greedy output is the target's own in the dtype it
runs in (the commands written name float32: vLLM would load a float32 checkpoint as bfloat16).

    DIR/drafter/                 SRC fused at every position (a gated adapter too: the target
                                 verifies every token), the mask row set, mask_token_id in config.json
    DIR/target/                  the target, when it is not a directory the user already has
    DIR/speculative_config.json  what `vllm serve --speculative-config` and `LLM(speculative_config=)` take
    DIR/README.md                the commands
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

from ..checkpoint.adapters import adapter_format, safe_output
from ..checkpoint.card import fused_card
from ..checkpoint.tensors import ConvertError
from ..core.config import MarsConfig, has_config, write_config
from ..core.config import read_config as read_mars
from ..core.files import atomic_dir
from .models import convert_model, read_config

DRAFTER = "drafter"
TARGET = "target"
SPECULATIVE_CONFIG = "speculative_config.json"
SPECULATIVE_TOKENS = 4  # drafted tokens per target step


def speculative_config(drafter: Path) -> dict:
    return {
        "method": "draft_model",
        "model": str(drafter),
        "num_speculative_tokens": SPECULATIVE_TOKENS,
        "parallel_drafting": True,
    }


def _adapter_base(src: Path) -> Path:
    """The base an adapter was trained on, found as every loader finds it (mars.json, else
    adapter_config.json)."""
    from ..checkpoint.paths import ModelError, resolve_model_path

    try:
        base, _ = resolve_model_path(src)
    except ModelError:
        raise ConvertError(f"{src}/mars.json: no base_model (the model the adapter was trained on); add it") from None
    if not base.exists():
        raise ConvertError(f"{src}/mars.json: its base model {base} is not here; put it there (or fix base_model)")
    return base


def convert_vllm(src, output, *, overwrite: bool = False, announce=print) -> Path:
    """Write `output` (see the module's description) for the MARS checkpoint `src`: an adapter
    directory with mars.json, or a full model directory with mars.json."""
    from ..checkpoint.default_model import DEFAULT_REF, model_ref

    src, output = Path(src), Path(output)
    if not src.is_dir() or not has_config(src):
        raise ConvertError(
            f"{src}: no mars.json (not a MARS checkpoint: its mask token is unknown); give a directory written by mars "
            f"finetune"
        )
    safe_output(output, (src,), overwrite)
    mars = read_mars(src)
    final = Path(os.path.abspath(output))
    drafter = final / DRAFTER
    if adapter_format(src) is not None:
        base = _adapter_base(src)
        if base.is_dir():
            read_config(base)  # an unsupported architecture fails here, before any work
        gated = mars.gate == "masks"
        # A directory the user has is named; the cached default (or an imported GGUF) is written.
        own = base.is_dir() and model_ref(base) != DEFAULT_REF
        target = (base.resolve() if own else final / TARGET) if gated else drafter
        why = (
            "the base model: the adapter is gated (its deltas act at mask positions only), so its greedy output is the "
            "base's"
            if gated
            else "the fused model itself: its greedy output is the checkpoint's"
        )
    else:
        read_config(src)
        base, gated, own, target = None, False, True, drafter
        why = "the fine-tuned model itself: its greedy output is the checkpoint's"

    def write(d: Path):
        announce(
            f"writing the drafter ({'the adapter fused at every position' if base is not None else 'the model'}) into "
            f"{drafter}"
        )
        if base is not None:
            convert_model(base, d / DRAFTER, "hf", adapter=src, fuse_gated=True, announce=announce)
        else:
            convert_model(src, d / DRAFTER, "hf", announce=announce)
        config_file = d / DRAFTER / "config.json"
        config = json.loads(config_file.read_text())
        config["mask_token_id"] = mars.mask_token_id
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        drafted = dataclasses.replace(mars, gate="none")  # every position runs the adapted weights
        write_config(drafted, d / DRAFTER)
        # The card names where the drafter will be (not this temporary directory) and its own mars.json.
        (d / DRAFTER / "README.md").write_text(
            fused_card(
                drafter,
                base=model_ref(base) if base is not None else None,
                adapter=src,
                mars=drafted,
                note=_drafter_note(src, gated, target),
            )
        )
        if base is not None and not own:
            announce(f"writing the target ({base}) into {final / TARGET}")
            convert_model(base, d / TARGET, "hf", announce=announce)
        spec = speculative_config(drafter)
        (d / SPECULATIVE_CONFIG).write_text(json.dumps(spec, indent=2) + "\n")
        (d / "README.md").write_text(_readme(src, target, why, drafter, spec, mars))

    atomic_dir(output, write)
    return output


def serve_command(target: Path, spec: dict) -> str:
    """The shell line that serves `target` with the drafter of `spec`, on any vLLM build."""
    return (
        f"VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server --model {shlex.quote(str(target))} "
        f"--dtype float32 --speculative-config {shlex.quote(json.dumps(spec))}"
    )


def _drafter_note(src: Path, gated: bool, target: Path) -> str:
    if gated:
        return (
            f"This is a vLLM parallel drafter exported by `mars convert {src} --to vllm`. The adapter was trained "
            "gated (its deltas act at mask positions only); here it is fused at every position, so this model's own "
            f"greedy output is not the base's. Serve the target `{target}` with this model as its drafter: the "
            "target verifies every drafted token."
        )
    return (
        f"This is a vLLM parallel drafter exported by `mars convert {src} --to vllm`, the checkpoint itself with "
        "`mask_token_id` in its config.json; as its own target it verifies every drafted token."
    )


def _readme(src: Path, target: Path, why: str, drafter: Path, spec: dict, mars: MarsConfig) -> str:
    return "\n".join(
        [
            "# A MARS checkpoint as a vLLM parallel drafter",
            "",
            f"Exported by `mars convert {src} --to vllm`.",
            "",
            f"- target: `{target}`: {why}.",
            f"- drafter: `{drafter}`: {src} fused at every position, with the trained mask token "
            f"`{mars.mask_token}` (id {mars.mask_token_id}, `mask_token_id` in its config.json). It drafts "
            f"{spec['num_speculative_tokens']} tokens per target step in one forward (parallel drafting); the target "
            f"verifies "
            f"every one, so greedy replies are the target's own, in the dtype the target runs in: `--dtype float32` "
            f"below "
            "gives the float32 model's greedy output, token for token (vLLM's default, `auto`, loads a float32 "
            "checkpoint "
            "as bfloat16, whose greedy replies can differ from the float32 ones).",
            f"- `{SPECULATIVE_CONFIG}`: the speculative config below.",
            "",
            "## Serve",
            "",
            "An OpenAI-compatible server on port 8000 (the module form starts on every vLLM build; the `vllm` command "
            "fails on a CPU build installed as `vllm-cpu`, which looks its own version up under the name `vllm`). "
            "`VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache) is for vLLM's CPU build: without it vLLM asks for 92% of the "
            "machine's memory and refuses to start on a machine that is not idle; GPU builds ignore it.",
            "",
            "```bash",
            serve_command(target, spec),
            "```",
            "",
            "## Python",
            "",
            "```python",
            "import os",
            "",
            "from vllm import LLM, SamplingParams",
            "",
            'os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM\'s CPU build: 2 GiB of KV cache (GPU builds '
            "ignore it)",
            "",
            'if __name__ == "__main__":  # vLLM starts worker processes',
            f'    llm = LLM(model={str(target)!r}, dtype="float32", speculative_config={spec!r})',
            '    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=64))',
            "    print(out[0].outputs[0].text)",
            "```",
            "",
            "A drafter as large as its target costs a full forward per draft on a GPU; the recipe that pays is a small "
            "MARS-trained drafter for a larger target sharing its tokenizer (`mars finetune` the small model, then "
            "`mars convert` it and serve the larger one with this speculative config).",
            "",
        ]
    )
