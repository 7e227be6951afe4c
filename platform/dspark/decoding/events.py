"""What a request's stream carries from the engine to the HTTP layer: text deltas, then exactly one
Done or Error. Plain dataclasses without heavy imports, so the ingress can receive them over Ray
without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Text:
    delta: str  # new text since the previous event


@dataclass(frozen=True)
class Done:
    info: dict  # finish_reason, prompt/completion tokens, speculative statistics


@dataclass(frozen=True)
class Error:
    message: str
    status: int = 500  # the HTTP status the request gets (400 bad request, 429 overloaded, 503 unavailable, ...)


Event = Text | Done | Error
