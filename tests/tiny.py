"""Tiny, offline models and tokenizers for the tests: built in memory, no download."""

from __future__ import annotations

import string

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unused0>", "<unused1>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " \n.,!?:;+-=*/()'\"")


def make_tokenizer(with_unused: bool = True):
    """A character-level fast tokenizer with a chat template, like an instruct model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS if with_unused else SPECIALS[:3]
    vocab = {tok: i for i, tok in enumerate(specials + CHARS)}
    vocab["<unk>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|im_end|>",
        additional_special_tokens=specials[3:],
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHAT_TEMPLATE
    return tok


# The architectures make_model builds (transformers model_type names).
ARCHITECTURES = tuple(
    "llama qwen2 qwen3 mistral ministral gemma3_text phi3 olmo2 granite smollm3 qwen3_moe mixtral".split()
)


def make_model(
    arch: str = "llama",
    vocab_size: int = 85,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    scale: float = 0.3,
    window: int | None = None,
):
    """A tiny random causal LM (float32). A large init scale makes logits peaked, so
    greedy argmax is stable across forwards of different shapes (no near-ties).
    `window`: the sliding window of the architectures that have one (mistral: every layer;
    ministral, gemma3_text: the first of each pair of layers, the second attends fully)."""
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=scale,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=(arch != "qwen2"),
    )
    head_dim = dict(head_dim=hidden // 4)
    experts = dict(num_experts_per_tok=2)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, **head_dim, use_sliding_window=False)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, **head_dim, sliding_window=window or 4096)
    elif arch == "ministral":
        config = transformers.MinistralConfig(
            **common,
            **head_dim,
            sliding_window=window or 4096,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        )
    elif arch == "gemma3_text":
        # Gemma's embeddings are scaled by sqrt(hidden): 8 here, exact in every float format.
        config = transformers.Gemma3TextConfig(
            **common,
            **head_dim,
            query_pre_attn_scalar=hidden // 4,
            sliding_window=window or 512,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        )
    elif arch == "phi3":
        config = transformers.Phi3Config(**common)
    elif arch == "olmo2":
        config = transformers.Olmo2Config(**common)
    elif arch == "granite":
        config = transformers.GraniteConfig(
            **common, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0
        )
    elif arch == "smollm3":
        # Every second layer without RoPE (SmolLM3's NoPE layers).
        config = transformers.SmolLM3Config(**common, no_rope_layer_interval=2, use_sliding_window=False)
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            **head_dim,
            **experts,
            num_experts=4,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            use_sliding_window=False,
        )
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**common, **experts, num_local_experts=4)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def save_model(path, arch: str = "llama", *, seed: int = 0, with_unused: bool = True, **kw):
    """Write a tiny model + tokenizer directory, as a user would have on disk."""
    tok = make_tokenizer(with_unused=with_unused)
    model = make_model(arch, len(tok), seed=seed, **kw)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


# Prompts the decoding tests share.
PROMPTS = [
    "Hello there",
    "What is 2+2? Tell me now.",
    "x",
    "Write a short poem about the sea, please",
    "abc abc abc",
    "Why is the sky blue?",
    "List three fruits",
    "q",
]


def spell_records():
    """Each reply repeats a letter the prompt names: every mask's target is fixed by the
    prompt, whatever offset a decoding window starts at."""
    return [
        {"prompt": f"Say {c}" + "!" * k, "completion": c * 12} for k in range(2) for c in string.ascii_lowercase[:20]
    ]


def train_spelling(out_dir, *, steps: int = 150):
    """A tiny llama MARS-trained (full, B = 4) on spell_records until its masks are right:
    returns (TorchModel with its MarsConfig, training result)."""
    import torch

    from mars.backends.torch.load import TorchModel, ensure_mask_token
    from mars.backends.torch.train import TorchTrainer
    from mars.core.train.data import Example, encode_record, pad_to_block
    from mars.core.train.loop import TrainSettings

    tok = make_tokenizer()
    model = make_model("llama", len(tok), seed=0, scale=0.1)
    mars = ensure_mask_token(model, tok, None, block_size=4, announce=lambda m: None)
    tm = TorchModel(model, tok, mars, "", torch.device("cpu"), torch.float32)
    examples = []
    for rec in spell_records():
        ids, labels = encode_record(rec, tok, eos_id=tok.eos_token_id)
        ids, labels = pad_to_block(ids, labels, 4, tok.eos_token_id, ended=True)
        examples.append(Example(ids, labels, "spell", False))
    s = TrainSettings(
        fine_tune_type="full", block_size=4, iters=steps, batch_size=8, learning_rate=3e-3, steps_per_save=10**9
    )
    result = TorchTrainer(tm, mars, s, out_dir).train(examples, progress=False)
    model.eval()
    return tm, result


def load_script(relpath: str):
    """A script of the repository (e.g. "benchmarks/slot_precision.py") imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def make_plan(*, verify: bool = False, force: bool = True, **asked):
    """A plan built as `make_plan` builds one, for a model with no checkpoint to read
    (mask_id and eos_ids given; MarsConfig's block size and metric unless given), allowed
    below AR mode (`force`), and plain threshold mode unless `verify`."""
    from mars.core.decode.plan import make_plan

    return make_plan(None, verify=verify, force=force, **asked)


def feed_of(cost, **options):
    """A feed controller over given cost curves (a CostCurve, a BatchCosts), None for None:
    what `generate` and `ContinuousBatch` take as `feed`; `options` go to FeedController."""
    from mars.core.decode.feed import FeedController

    return None if cost is None else FeedController(cost, **options)


# What a compiled step is checked in against the eager one (tests/test_compiled.py, test_mlx_compiled.py):
# the plan's base and every mode, a batch and both caches.
COMPILED_BASE = dict(mask_id=3, eos_ids=(2,), block_size=4, max_tokens=12, block_cache=8)
COMPILED_MODES = {
    "ar": dict(threshold=1.0),
    "threshold": dict(threshold=0.5),
    "lossless": dict(lossless=True),
    "lossless_trees": dict(lossless=True, tree=8),
    "lossless_groups_logprobs": dict(lossless=True, alternatives=2, hedge=1, logprobs=2),
    "verified": dict(threshold=0.5, verify=True),
    "block": dict(threshold=0.5, cache="block"),
    "lossless_block": dict(lossless=True, cache="block"),
}


def chat_prompts(tok, texts=("Hello there, how are you today?", "x")) -> list[list[int]]:
    """Each text as a user's chat turn, through the tokenizer's template, ready for a reply."""
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]


def eager_and_compiled(tok, arch: str, seed: int = 1, fixed: bool | None = None, **kw):
    """An eager TorchDecoder and a compiled one (`fixed`: at fixed shapes) over one tiny model,
    float32 on the CPU."""
    import torch

    from mars.backends.torch.decode import TorchDecoder
    from mars.backends.torch.load import TorchModel

    tm = TorchModel(make_model(arch, len(tok), seed=seed, **kw), tok, None, "", torch.device("cpu"), torch.float32)
    return TorchDecoder(tm), TorchDecoder(tm, compile=True, fixed=fixed)
