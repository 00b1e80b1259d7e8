"""Tokenizer-level choices shared by the backends: the mask token (docs/method.md §1) and prompt encoding."""

from __future__ import annotations

from collections.abc import Mapping

NEW_MASK_TOKEN = "<|mars_mask|>"


def _ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding (a mapping) where 4.x returned a plain list.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def choose_mask_token(tokenizer, exclude=()) -> tuple[str, int, bool]:
    """(token, id, must_add): an unused special token if the tokenizer has one, else a new one.

    Unused: an added/special token that is not BOS/EOS/PAD/UNK (nor in `exclude`, e.g.
    the model's generation EOS ids), that the chat template never writes (so chat never
    produces it and the embedding keeps its shape), and preferably not an end-of-text marker.
    """
    reserved = {
        getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    } | set(exclude)
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = []
    for token_id, token in sorted(added.items()):
        text = str(getattr(token, "content", token))
        if token_id in reserved or not text or text in template:
            continue
        if getattr(token, "special", True):
            lowered = text.lower()
            rank = 0 if "mask" in lowered else 2 if ("end" in lowered or "eos" in lowered) else 1
            candidates.append((rank, token_id, text))
    if candidates:
        _, token_id, text = min(candidates)
        return text, int(token_id), False
    return NEW_MASK_TOKEN, len(tokenizer), True


def encode_prompt(tokenizer, prompt, *, chat: bool = True) -> list[int]:
    """Token ids of a prompt: a string or a list of chat messages, through the chat template."""
    if isinstance(prompt, str):
        if not chat or not getattr(tokenizer, "chat_template", None):
            return _ids(tokenizer(prompt)["input_ids"])
        prompt = [{"role": "user", "content": prompt}]
    return _ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))


def eos_ids(tokenizer, generation_eos=None) -> tuple[int, ...]:
    """Every id that ends a reply: the tokenizer's EOS plus the model's generation EOS list."""
    found = []
    for value in (tokenizer.eos_token_id, generation_eos):
        if value is None:
            continue
        found.extend(value if isinstance(value, (list, tuple)) else [value])
    return tuple(dict.fromkeys(int(v) for v in found))
