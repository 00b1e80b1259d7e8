"""The OpenAI API surface: request validation, the response and chunk shapes, streamed text.

Every way a request can be wrong becomes an `ApiError` with an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`) and a 4xx status, never a 500.
Beyond OpenAI's fields a request may carry `threshold` (float), `lossless` (bool),
`verify` (bool, default true: greedy threshold mode verifies the drafts it does not take, as
`mars generate` does; false: plain threshold mode), `adaptive` (bool: false pins the
request's threshold under the adaptive policy) and `top_k` (int, as mlx_lm.server takes it).
The usage of a reply names the mode it ran in (`usage.mode`), as `mars generate --json` does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace

from ..core.acceptance import ThresholdError, check_threshold
from ..core.decode.plan import MAX_LOGPROBS, Mode, Sampling
from ..core.decode.rules import UntrainedModelError
from ..core.tokens import encode_prompt
from ..session import token_logprobs

MAX_STOP_SEQUENCES = 4  # as OpenAI


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServeLimits:
    max_prompt_tokens: int | None = None  # None: the model's context length, if it states one
    max_tokens_limit: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512  # when a request asks for no number
    max_body_bytes: int = 4 << 20
    temperature: float = 0.0  # when a request gives none


@dataclass
class Completion:
    """A validated request, ready for the engine."""

    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    threshold: float | None = None
    lossless: bool | None = None  # as asked; None: the server's default mode decides (when planned)
    verify: bool = True
    pinned: bool = False
    logprobs: int | None = None  # the most likely ids each token's log-probability lists; None: not asked


# -- field readers --------------------------------------------------------------------------------


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, name: str, default, *, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise _bad(name, f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise _bad(name, f"'{name}' must be <= {high}, got {value}")
    return float(value)


def _integer(body: dict, name: str, default, *, low=None, high=None, code=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {value!r}")
    if low is not None and value < low:
        raise _bad(name, f"'{name}' must be >= {low}, got {value}", code)
    if high is not None and value > high:
        raise _bad(name, f"'{name}' must be <= {high}, got {value}", code)
    return value


def _boolean(body: dict, name: str, default: bool | None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be true or false, got {value!r}")
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many most likely ids each token's log-probability lists, None where none are asked for.
    Chat: `logprobs` true, with `top_logprobs` 0 to 20; completions: `logprobs` 0 to 20."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "'top_logprobs' is a chat field; completions take 'logprobs': N")
        return _integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if not _boolean(body, "logprobs", False):
        if top is not None:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad("stop", f"'stop' must be a string or a list of strings, got {value!r}")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _bad("stop", f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}")
    return [v for v in value if v]


def _unsupported(body: dict, chat: bool) -> None:
    """Fields whose meaning this server cannot honour: refuse rather than silently ignore."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise _bad(name, f"'{name}' is not supported by this server (leave it out or 0)")
    if body.get("tools"):
        raise _bad("tools", "tools are not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", 'only response_format {"type": "text"} is supported')
    if not chat:
        if _boolean(body, "echo", False):
            raise _bad("echo", "'echo' is not supported by this server")
        if body.get("suffix"):
            raise _bad("suffix", "'suffix' is not supported by this server")
        _integer(body, "best_of", 1, low=1, high=1)


# The roles the OpenAI API takes, and those whose content it requires (an assistant turn may carry
# tool calls instead; this server takes no tools, so its content reads as text when present).
ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", '\'messages\' must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"'{where}' must be an object with a 'role' and a 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        if m.get("content") is None and role in CONTENT_REQUIRED:
            raise _bad(f"{where}.content", f"'{where}.content' is required for a {role} message")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"{where}.tool_call_id", f"'{where}.tool_call_id' (a string) is required for a tool message")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"{where}.name", f"'{where}.name' must be a string")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of text parts joined (none: the empty string)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(
                    f"{where}.content[{j}]",
                    f'\'{where}.content[{j}]\': only text parts ({{"type": "text", "text": ...}}) are supported',
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content", f"'{where}.content' must be a string or a list of text parts")


def _prompt(body: dict, tokenizer, vocab: int) -> list[int]:
    """/v1/completions: one prompt, as text or token ids (several prompts in one request: no)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, chat=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= vocab for t in prompt):
            raise _bad("prompt", f"'prompt': token ids must be in [0, {vocab})")
        return list(prompt)
    raise _bad("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)")


# -- the request ----------------------------------------------------------------------------------


def parse(body, *, chat: bool, session, names: tuple[str, ...], policy, limits: ServeLimits) -> Completion:
    """Validate a request body against the served model (`session`, a mars.session.Session,
    served under `names`: its name, then its aliases), the policy and the limits."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise _bad("model", f"'model' must be a string, got {name!r}")
    if name and name not in names:
        raise _bad(
            "model",
            f"the model '{name}' does not exist; this server serves '{names[0]}' (see GET /v1/models)",
            "model_not_found",
        )
    _integer(body, "n", 1, low=1, high=1)
    _unsupported(body, chat)
    # Greedy unless asked (as `mars generate` and mlx_lm.server; OpenAI's own default is 1.0).
    temperature = _number(body, "temperature", limits.temperature, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, low=0)
    seed = _integer(body, "seed", None)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}")
    include_usage = _boolean(options or {}, "include_usage", False)
    lossless = _boolean(body, "lossless", None)
    verify = _boolean(body, "verify", True)
    adaptive = _boolean(body, "adaptive", True)
    threshold = _number(body, "threshold", None)
    if threshold is not None:
        try:
            check_threshold(policy.metric, threshold, name="'threshold'")
        except ThresholdError as e:
            raise _bad("threshold", str(e)) from None
    # Neither asked: the server's default mode applies when the request is planned (the engine,
    # mars.core.decode.plan.make_plan); a threshold asks for threshold mode.
    if threshold is not None and not lossless:
        try:
            policy.check(threshold)
        except UntrainedModelError as e:
            raise _bad("threshold", f"'threshold' {threshold}: {e}", "model_not_mars_trained") from None
    stop = _stop(body)
    logprobs = _logprobs(body, chat)
    ceiling = limits.max_tokens_limit
    max_tokens = _integer(body, "max_tokens", None, low=1, high=ceiling, code="max_tokens_limit")
    max_tokens = _integer(body, "max_completion_tokens", max_tokens, low=1, high=ceiling, code="max_tokens_limit")

    tokenizer = session.tokenizer
    if chat:
        messages = _messages(body)
        if not getattr(tokenizer, "chat_template", None):
            raise _bad("messages", "this model has no chat template; use /v1/completions with a plain prompt")
        try:
            prompt = encode_prompt(tokenizer, messages)
        except Exception as e:  # the template itself refused (roles out of order, ...)
            raise _bad(
                "messages",
                f"the chat template rejected the messages: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            ) from None
    else:
        prompt = _prompt(body, tokenizer, session.loaded.vocab_rows)
    if not prompt:
        raise _bad("messages" if chat else "prompt", "the prompt is empty (no tokens)")
    context = session.context_length
    prompt_limit = limits.max_prompt_tokens or context
    if prompt_limit is not None and len(prompt) > prompt_limit:
        raise _bad(
            "messages" if chat else "prompt",
            f"the prompt has {len(prompt)} tokens; this server takes at most {prompt_limit}",
            "context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, ceiling)
        if context is not None:
            max_tokens = min(max_tokens, context - len(prompt))
        if max_tokens < 1:
            raise _bad(
                "messages" if chat else "prompt",
                f"the prompt fills the model's context ({context} tokens)",
                "context_length_exceeded",
            )
    elif context is not None and len(prompt) + max_tokens > context:
        raise _bad(
            "max_tokens",
            f"this model's context is {context} tokens; the prompt ({len(prompt)}) plus max_tokens ({max_tokens}) "
            f"exceed it",
            "context_length_exceeded",
        )
    return Completion(
        chat=chat,
        model=names[0],
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        threshold=None if lossless else threshold,
        lossless=lossless,
        verify=verify,
        pinned=not adaptive,
        logprobs=logprobs,
    )


# -- streamed text ---------------------------------------------------------------------------------


class TextStream:
    """Token ids in, text out: the text safe to send so far. Holds back a trailing incomplete
    character and any tail that could still grow into a stop string; ends at the first stop
    string, which is not included (as OpenAI).

    Decodes incrementally: each call decodes only the tokens since the last settled point,
    with a few tokens before them for context (a tokenizer may render a token differently
    at the start of a text), and keeps the difference."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] is the context decoded before the new tokens
        self._read = 0

    def _decode(self, final: bool = False) -> None:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        context = decode(self.ids[self._prefix : self._read])
        full = decode(self.ids[self._prefix :])
        if len(full) > len(context) and (final or not full.endswith("\ufffd")):  # else: a character is still coming
            self.text += full[len(context) :]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._decode()
        text = self.text
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits))
        # A suffix that is the start of a stop string waits for the next tokens.
        end = len(text)
        hold = max(
            (k for s in self.stop for k in range(1, min(len(s) - 1, end - self.sent) + 1) if text[end - k :] == s[:k]),
            default=0,
        )
        return self._emit(end - hold)

    def flush(self) -> str:
        """At the end: whatever was held back (an unfinished stop string is plain text)."""
        if self.stopped:
            return ""
        self._decode(final=True)
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


# -- responses --------------------------------------------------------------------------------------


FINISH = {"eos": "stop", "length": "length", "stop": "stop"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, forwards: int, threshold: float | None, mode: str) -> dict:
    """OpenAI's usage numbers, and this server's: tokens per forward, the loosest threshold the
    request decoded at, and `mode`, its plan's name (mars.core.decode.plan.Plan.name)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "tokens_per_forward": round(completion_tokens / forwards, 4) if forwards else 0.0,
        "threshold": threshold,
        "mode": mode,
    }


# What a choice's log-probabilities were computed under, by the request's mode (the `logprobs_from` field).
LOGPROBS_FROM = {
    Mode.AR: "model",
    Mode.LOSSLESS: "model",
    Mode.THRESHOLD: "model and masks",
    Mode.VERIFIED: "model and masks",
}


def choice_logprobs(req: Completion, tokenizer, tokens: list[int], entries: list, offset: int = 0) -> dict | None:
    """The `logprobs` of a choice (or of a streamed chunk) for these tokens, in the OpenAI API's form:
    chat {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}, completions {"tokens",
    "token_logprobs", "top_logprobs", "text_offset"} (`offset`: the text before them)."""
    if req.logprobs is None:
        return None
    listed = token_logprobs(tokenizer, tokens, [replace(e, top=e.top[: req.logprobs]) for e in entries])
    if req.chat:
        return {"content": listed}
    offsets = []
    for t in listed:
        offsets.append(offset)
        offset += len(t["token"])
    return {
        "tokens": [t["token"] for t in listed],
        "token_logprobs": [t["logprob"] for t in listed],
        "top_logprobs": [{x["token"]: x["logprob"] for x in t["top_logprobs"]} for t in listed],
        "text_offset": offsets,
    }


def response(
    req: Completion,
    rid: str,
    created: int,
    text: str,
    finish: str,
    use: dict,
    logprobs: dict | None = None,
    mode: Mode | None = None,
) -> dict:
    """The whole reply; `logprobs` (choice_logprobs) with the `mode` they were computed in."""
    extra = {"logprobs_from": LOGPROBS_FROM[mode]} if logprobs is not None and mode is not None else {}
    if req.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
            **extra,
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": use,
        }
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    req: Completion,
    rid: str,
    created: int,
    *,
    text: str | None = None,
    finish: str | None = None,
    first: bool = False,
    use: dict | None = None,
    usage_chunk: bool = False,
    logprobs: dict | None = None,
    mode: Mode | None = None,
) -> dict:
    """One streamed event. With include_usage every chunk carries "usage": null and a last
    chunk with no choices carries the numbers (as OpenAI). `logprobs`: those of the chunk's tokens."""
    extra = {"logprobs_from": LOGPROBS_FROM[mode]} if logprobs is not None and mode is not None else {}
    if req.chat:
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}]
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model, "choices": choices}
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish, **extra}]
        out = {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices}
    if usage_chunk:
        out["choices"] = []
    if req.include_usage:
        out["usage"] = use
    return out


def now() -> int:
    return int(time.time())
