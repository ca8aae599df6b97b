"""OpenAI request bodies -> checked generation parameters; results -> OpenAI-shaped JSON.

Only the fields pwbench can honour are read; unknown fields are ignored, as OpenAI-compatible
servers do. A field of the wrong type or out of range raises ApiError (HTTP 400 with an
OpenAI-style error body naming the field). `return_token_ids` (vLLM's extension) adds the
prompt's and each chunk's token ids, which is how engine `openai` gets exact ids back.
Numbers are checked in the precision the engine uses them (docs/serving.md#what-is-validated).
Nothing here touches the engine or the network.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from engines.runtime.sampling import MIN_TEMPERATURE, SEED_RANGE


class ApiError(Exception):
    """An HTTP error with an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def render(self) -> bytes:
        # ASCII escapes: a message quoting the client's text (a lone surrogate) still encodes.
        return json.dumps(self.body()).encode()


@dataclass(frozen=True)
class Limits:
    """What the served engine accepts: vocabulary, longest prompt + output, model name."""

    model_name: str
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class GenParams:
    """One checked request: prompt ids and the sampling the engine is asked for."""

    chat: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400,
                       f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # the C parser's guard, about 1000 levels: far deeper than any request
        raise ApiError(400, "request body is nested too deeply (arrays/objects inside each other)") from None
    except ValueError as exc:  # an integer literal over Python's 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key} must be a number, got {type(value).__name__}", key)
    if not math.isfinite(value):  # NaN, Infinity and 1e999 parse as floats
        raise ApiError(400, f"{key} must be a finite number, got {value}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(400, f"{key} must be in {bound}, got {value}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        shown = value if isinstance(value, float) and not math.isfinite(value) else type(value).__name__
        raise ApiError(400, f"{key} must be an integer, got {shown}", key)
    if value < lo:
        raise ApiError(400, f"{key} must be >= {lo}, got {value}", key)
    if hi is not None and value > hi:
        raise ApiError(400, f"{key} must be <= {hi}, got {value}", key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false, got {type(value).__name__}", key)
    return value


def _unsupported(body: dict) -> None:
    """Fields whose meaning pwbench cannot honour: refused rather than silently ignored."""
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n must be 1 (one choice per request)", "n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of must be 1", "best_of")
    if body.get("stop") not in (None, [], ""):
        raise ApiError(400, "stop sequences are not supported; use max_tokens (the model stops at EOS)", "stop")
    if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", "logprobs")


def _prompt_ids(body: dict, tokenizer: Any, limits: Limits) -> tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = _encode(prompt, tokenizer, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {limits.vocab_size})", "prompt")
    elif prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    else:
        raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one prompt per request)",
                       "prompt")
    return tuple(ids)


def _encode(text: str, tokenizer: Any, param: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate escape such as "\ud800"
        raise ApiError(400, f"{param} has an unpaired surrogate (\\u{ord(text[exc.start]):04x}) at character "
                       f"{exc.start}: not valid Unicode", param) from None
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer.json: send the prompt as a list of token ids", param)
    ids = tokenizer.encode(text).ids
    if not ids:
        raise ApiError(400, f"{param} is empty after tokenization", param)
    return ids


def _chat_ids(body: dict, tokenizer: Any) -> tuple[int, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    parts = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: only text parts are read
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(texts) if all(isinstance(t, str) for t in texts) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role and string content", "messages")
        parts.append(content)
    # No chat template is applied: the contents are joined with newlines (the demo model has
    # none; a model whose template matters should be driven through /v1/completions).
    return tuple(_encode("\n".join(parts), tokenizer, "messages"))


def parse_request(body: dict[str, Any], chat: bool, tokenizer: Any, limits: Limits) -> GenParams:
    """Check an OpenAI completions / chat completions body against the served engine."""
    _unsupported(body)
    if body.get("model") not in (None, limits.model_name):
        raise ApiError(404, f"model {body.get('model')!r} is not served here; this server serves {limits.model_name!r}",
                       "model", code="model_not_found")
    ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer, limits)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, 16, 1)
    if len(ids) >= limits.max_model_len:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {limits.max_model_len} tokens "
                       "(prompt + max_tokens)", "messages" if chat else "prompt")
    if len(ids) + max_tokens > limits.max_model_len:
        raise ApiError(400, f"{key} {max_tokens} + prompt {len(ids)} tokens exceeds this model's context of "
                       f"{limits.max_model_len} tokens; at most {limits.max_model_len - len(ids)} here", key)
    min_tokens = _integer(body, "min_tokens", 0, 0)
    if min_tokens not in (0, max_tokens):
        raise ApiError(400, f"min_tokens must be 0 or equal to {key} (fixed-length outputs), got {min_tokens}",
                       "min_tokens")
    top_k = _integer(body, "top_k", 0, -1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature < MIN_TEMPERATURE:  # 1e-45 or 1e-300 would round to 0 in float32: the limit is greedy
        temperature = 0.0
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return GenParams(
        chat=chat, prompt_ids=ids, max_tokens=max_tokens,
        temperature=temperature, top_p=_number(body, "top_p", 1.0, 0.0, 1.0, True),
        top_k=top_k if 0 < top_k < limits.vocab_size else 0, seed=_integer(body, "seed", None, 0, SEED_RANGE[1]),
        ignore_eos=_flag(body, "ignore_eos") or min_tokens == max_tokens, stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage"), return_token_ids=_flag(body, "return_token_ids"),
    )


# -- responses ------------------------------------------------------------------------------
def _envelope(rid: str, params: GenParams, model: str, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if params.chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def _choice(params: GenParams, text: str, ids: list[int], finish: str | None, chunk: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if params.chat:
        choice["delta" if chunk else "message"] = ({"content": text} if chunk
                                                   else {"role": "assistant", "content": text})
    else:
        choice["text"] = text
        choice["logprobs"] = None
    choice["finish_reason"] = finish
    if params.return_token_ids:
        choice["token_ids"] = ids
    return choice


def usage(params: GenParams, completion_tokens: int) -> dict[str, int]:
    n = len(params.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}


def response(rid: str, params: GenParams, model: str, text: str, ids: list[int], finish: str) -> dict[str, Any]:
    out = _envelope(rid, params, model, False)
    out["choices"] = [_choice(params, text, ids, finish, False)]
    out["usage"] = usage(params, len(ids))
    if params.return_token_ids:
        out["prompt_token_ids"] = list(params.prompt_ids)
    return out


def chunk(rid: str, params: GenParams, model: str, text: str, ids: list[int], finish: str | None,
          first: bool = False) -> bytes:
    out = _envelope(rid, params, model, True)
    choice = _choice(params, text, ids, finish, True)
    if first and params.chat:
        choice["delta"]["role"] = "assistant"
    out["choices"] = [choice]
    if first and params.return_token_ids:
        out["prompt_token_ids"] = list(params.prompt_ids)
    return sse(out)


def usage_chunk(rid: str, params: GenParams, model: str, completion_tokens: int) -> bytes:
    out = _envelope(rid, params, model, True)
    out["choices"] = []
    out["usage"] = usage(params, completion_tokens)
    return sse(out)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
