"""OpenAI-compatible request schemas and response bodies. Validation errors name the field."""

from __future__ import annotations

import itertools
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dspark.decoding.events import MAX_LOGPROBS

# OpenAI request fields beyond the schemas below. Features we do not implement are refused (400 naming
# the field) unless set to a value that turns them off; metadata is accepted and ignored; any other
# unknown field is refused.
UNSUPPORTED: dict[str, tuple] = {  # field -> the values that mean "off"
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {}, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
METADATA = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


def _off(value: Any, neutral: tuple) -> bool:
    """value is one of `neutral` (0.0 counts as 0, but false does not: JSON booleans are not numbers)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def _encodable(v: str) -> str:
    """JSON can carry lone surrogates (\\ud800) that no tokenizer accepts."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("unicode", "not valid Unicode (it holds a lone surrogate)") from None
    return v


Text = Annotated[str, AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = None  # one more chunk before [DONE]: no choices, the request's usage


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # unknown fields are a 400 naming them

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)  # None: the engine picks a random seed
    stop: Optional[Union[Text, list[Text]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)

    @model_validator(mode="before")
    @classmethod
    def _openai_extras(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, neutral in UNSUPPORTED.items():
            if name in data and not _off(data[name], neutral):
                raise PydanticCustomError(
                    "unsupported", "not supported by this server (leave it out or null)", {"field": name}
                )
        ignored = (*UNSUPPORTED, *METADATA)
        return {k: v for k, v in data.items() if k not in ignored and v is not None}  # null means unset

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and (len(v) > 4 or not all(isinstance(x, str) for x in v)):
            raise ValueError("at most 4 stop strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        """None: no logprobs; k: each token's log-probability and its k most likely alternatives."""
        return None


class CompletionRequest(_Sampling):
    prompt: Text = Field(min_length=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, v):
        return None if v is False else v

    def n_logprobs(self) -> Optional[int]:
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):  # other fields (`name`, the nulls an SDK's own messages carry) are ignored
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Text, list[TextPart]]  # a string, or text parts (joined by newlines)

    def for_template(self) -> dict:
        """The message as chat templates know it: the developer role is the system role, and text
        parts are one string."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = Field(False, strict=True)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("logprobs", "needs logprobs: true", {"field": "top_logprobs"})
        return self

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


def usage_body(done: dict) -> dict:
    return {
        "prompt_tokens": done["prompt_tokens"],
        "completion_tokens": done["completion_tokens"],
        "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
    }


def logprobs_body(entries: Optional[list[dict]], chat: bool, offset: int = 0) -> Optional[dict]:
    """OpenAI's logprobs object for the engine's entries ({"token", "logprob", "top_logprobs"}): chat's
    {"content": [{token, logprob, bytes, top_logprobs}]}, or the completions API's {tokens, token_logprobs,
    top_logprobs: [{token: logprob}], text_offset} with offsets counted from `offset`. None: not asked for."""
    if entries is None:
        return None
    if chat:

        def one(e: dict) -> dict:
            return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

        return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries]}
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": list(itertools.accumulate((len(e["token"]) for e in entries), initial=offset))[:-1],
    }


def completion_body(rid: str, model: str, text: str, done: dict, chat: bool, logprobs: Optional[list] = None) -> dict:
    usage = usage_body(done)
    lp = logprobs_body(logprobs, chat)
    choice = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": done["finish_reason"],
            "logprobs": lp,
        }
        if chat
        else {"index": 0, "text": text, "finish_reason": done["finish_reason"], "logprobs": lp}
    )
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "speculative": done["speculative"],
        "timing": done["timing"],
    }


def chunk_body(
    rid: str, model: str, text: str, finish: Optional[str], chat: bool, logprobs: Optional[dict] = None
) -> dict:
    """One streamed chunk; `logprobs`: a logprobs_body of the tokens it carries."""
    if chat:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
