"""Tokenizer-level choices shared by the backends: the mask token (docs/method.md §1) and prompt encoding."""

from __future__ import annotations

from collections.abc import Mapping

from .config import MarsConfig

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
        getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
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


def mask_config(
    tokenizer, mars: MarsConfig | None, *, block_size: int = MarsConfig.block_size, exclude=(), announce=print
) -> MarsConfig:
    """The MarsConfig whose mask token is in `tokenizer`: a checkpoint's own (a token it added is
    added back to a tokenizer without it), or for a model without one the `choose_mask_token`
    choice, added to the tokenizer when it is new, and said through `announce`.

    The backend then grows its embedding to `mask_token_id + 1` rows where it has fewer; a new
    input row starts as the mean embedding, a neutral "unknown token"."""
    if mars is not None:
        if mars.mask_token_added and mars.mask_token_id >= len(tokenizer):
            tokenizer.add_special_tokens({"additional_special_tokens": [mars.mask_token]})
        return mars
    token, token_id, added = choose_mask_token(tokenizer, exclude=exclude)
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": [token]})
        token_id = tokenizer.convert_tokens_to_ids(token)
        announce(
            f"mask token: the tokenizer has no unused special token; added {token} as id {token_id} (the embedding "
            f"grows by one row)"
        )
    else:
        announce(f"mask token: reusing unused special token {token} (id {token_id})")
    return MarsConfig(block_size=block_size, mask_token=token, mask_token_id=token_id, mask_token_added=added)


def new_row_init(*, output_head: bool) -> str:
    """How a row added for a new mask token starts, in both backends: in the input embedding
    as the mean of the existing rows (a neutral "unknown token"); in an untied output head as
    zeros, so the new token's logit starts at 0 (nothing trains it: no label is the mask)."""
    return "zeros" if output_head else "mean"


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
