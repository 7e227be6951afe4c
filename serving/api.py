"""OpenAI-compatible request schemas and response bodies. Validation errors name the field."""
from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (e.g. user, logit_bias)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = Field(None, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and (len(v) > 4 or not all(isinstance(x, str) for x in v)):
            raise ValueError("at most 4 stop strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


def completion_body(rid: str, model: str, text: str, done: dict, chat: bool) -> dict:
    usage = {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
             "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": done["finish_reason"]}
              if chat else {"index": 0, "text": text, "finish_reason": done["finish_reason"], "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "speculative": done["speculative"]}


def chunk_body(rid: str, model: str, text: str, finish: Optional[str], chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
