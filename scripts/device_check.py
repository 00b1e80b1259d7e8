"""Exactness and training checks on an accelerator (CUDA or MPS): prints one JSON object.

    python scripts/device_check.py [--device cuda]

The same properties the CPU test suite checks, on the device: threshold 1.0 equals
`model.generate`, cached equals uncached, batch rows equal single rows, and a short
LoRA fine-tune in bfloat16 lowers both losses and reloads.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny import make_model, make_tokenizer  # noqa: E402

from mars.backends.torch.decode import TorchDecoder  # noqa: E402
from mars.backends.torch.load import TorchModel, ensure_mask_token, load  # noqa: E402
from mars.backends.torch.train import TorchTrainer  # noqa: E402
from mars.core.decode.loop import generate  # noqa: E402
from mars.core.decode.plan import make_plan  # noqa: E402
from mars.core.tokens import encode_prompt  # noqa: E402
from mars.core.train.data import Example, encode_record, pad_to_block  # noqa: E402
from mars.core.train.loop import TrainSettings  # noqa: E402

PROMPTS = ["Hello there", "What is 2+2? Tell me now.", "x", "Write a short poem about the sea, please"]


def plan(**asked):
    """A plan as make_plan makes one, for weights with no checkpoint to read: threshold mode
    (plain, unverified) below 1.0, AR at 1.0."""
    return make_plan(None, force=True, verify=False, **asked)


def decoding_checks(arch, device):
    tok = make_tokenizer()
    model = make_model(arch, len(tok), seed=1).to(device)
    tm = TorchModel(model, tok, None, "", torch.device(device), torch.float32)
    dec = TorchDecoder(tm)
    prompts = [encode_prompt(tok, p) for p in PROMPTS]
    base = dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=24, block_cache=8)
    out = {}
    ok = True
    for p in prompts:
        ids = torch.tensor([p], device=device)
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2
        )
        ref = ref[0, len(p) :].tolist()
        for cache in ("none", "window", "block"):
            ok &= generate(dec, [p], plan(threshold=1.0, cache=cache, **base)).tokens[0] == ref
    out["threshold_1_equals_generate"] = ok
    ok = True
    for tau in (0.9, 0.5, 0.1):
        for p in prompts:
            a = generate(dec, [p], plan(threshold=tau, cache="none", **base)).tokens
            b = generate(dec, [p], plan(threshold=tau, cache="window", **base)).tokens
            ok &= a == b
    out["cached_equals_uncached"] = ok
    ok = True
    for cache in ("none", "window", "block"):
        for tau in (1.0, 0.5, 0.1):
            s = plan(threshold=tau, cache=cache, **base)
            batch = generate(dec, prompts, s).tokens
            ok &= all(batch[i] == generate(dec, [p], s).tokens[0] for i, p in enumerate(prompts))
    out["batch_equals_single"] = ok
    return out


def say_examples(tok):
    """Replies that repeat the letter the prompt names: learnable in a few dozen steps."""
    examples = []
    for c in "abcdefghijklmnopqrst":
        ids, labels = encode_record({"prompt": f"Say {c}", "completion": c * 12}, tok, eos_id=tok.eos_token_id)
        ids, labels = pad_to_block(ids, labels, 4, tok.eos_token_id, ended=True)
        examples.append(Example(ids, labels, "x", False))
    return examples


def training_check(device):
    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=0, scale=0.1).to(device=device, dtype=torch.bfloat16)
    tm = TorchModel(model, tok, None, "", torch.device(device), torch.bfloat16)
    mars = ensure_mask_token(model, tok, None, block_size=4, announce=lambda m: None)
    examples = say_examples(tok)
    with tempfile.TemporaryDirectory() as d:
        base = Path(d) / "base"
        model.save_pretrained(base)
        tok.save_pretrained(base)
        out = Path(d) / "out"
        s = TrainSettings(fine_tune_type="lora", iters=60, batch_size=8, learning_rate=3e-3, steps_per_save=30)
        t0 = time.perf_counter()
        trainer = TorchTrainer(tm, mars, s, out)
        result = trainer.train(examples, progress=False)
        seconds = time.perf_counter() - t0
        trainer.save(tok, str(base))
        reloaded = load(out, device=device, dtype="bfloat16", announce=lambda m: None)
        prompt = encode_prompt(tok, "Say k")
        settings = plan(mask_id=mars.mask_token_id, eos_ids=(2,), block_size=4, threshold=0.9, max_tokens=16)
        res = generate(TorchDecoder(reloaded), [prompt], settings)
        h = result["history"]
        return {
            "lora_bf16_noisy_first_last": [round(h[0]["noisy"], 4), round(h[-1]["noisy"], 4)],
            "lora_bf16_clean_first_last": [round(h[0]["clean"], 4), round(h[-1]["clean"], 4)],
            "train_seconds": round(seconds, 2),
            "reloaded_reply": tok.decode(res.tokens[0]),
            "reloaded_tokens_per_forward": round(res.stats.tokens_per_forward, 3),
        }


def full_autocast_check(device):
    """Full fine-tuning keeps float32 weights and runs the forward under bfloat16 autocast on CUDA."""
    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=0, scale=0.1).to(device)
    tm = TorchModel(model, tok, None, "", torch.device(device), torch.float32)
    mars = ensure_mask_token(model, tok, None, block_size=4, announce=lambda m: None)
    examples = say_examples(tok)
    with tempfile.TemporaryDirectory() as d:
        s = TrainSettings(fine_tune_type="full", iters=150, batch_size=8, learning_rate=3e-3, steps_per_save=10**9)
        trainer = TorchTrainer(tm, mars, s, Path(d) / "out")
        h = trainer.train(examples, progress=False)["history"]
    model.eval()
    prompts = [encode_prompt(tok, f"Say {c}") for c in "abcdefghijklmnopqrst"]
    base = dict(mask_id=mars.mask_token_id, eos_ids=(2,), block_size=4, max_tokens=24)
    ar = generate(TorchDecoder(tm), prompts, plan(threshold=1.0, **base))
    fast = generate(TorchDecoder(tm), prompts, plan(threshold=0.9, **base))
    return {
        "autocast": str(trainer.autocast),
        "param_dtype": str(next(model.parameters()).dtype),
        "noisy_first_last": [round(h[0]["noisy"], 4), round(h[-1]["noisy"], 4)],
        "clean_first_last": [round(h[0]["clean"], 4), round(h[-1]["clean"], 4)],
        "tokens_per_forward_at_0.9": round(fast.stats.tokens_per_forward, 3),
        "same_output_as_1.0": fast.tokens == ar.tokens,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    torch.manual_seed(0)
    report = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    for arch in ("llama", "qwen2"):
        report[arch] = decoding_checks(arch, args.device)
    report["training"] = training_check(args.device)
    report["full_autocast"] = full_autocast_check(args.device)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
