"""What a request's stream carries from the engine to the HTTP layer: text deltas, then exactly one
Done or Error. Plain dataclasses without heavy imports, so the ingress can receive them over Ray
without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class Text:
    delta: str  # new text since the previous event
    # with logprobs asked for: the tokens committed since the previous event, each
    # {"token", "logprob", "top_logprobs": [{"token", "logprob"}, ..]} (the target's raw log-probabilities)
    logprobs: Optional[list[dict]] = None


@dataclass(frozen=True)
class Done:
    info: dict  # finish_reason, prompt/completion tokens, speculative statistics, logprobs not sent yet


@dataclass(frozen=True)
class Error:
    message: str
    status: int = 500  # the HTTP status the request gets (400 bad request, 429 overloaded, 503 unavailable, ...)


Event = Text | Done | Error


def position_counts(rounds: Sequence) -> tuple[list[int], list[int]]:
    """Per draft position k = 1 .. the longest verified, over rounds with `verified` l and `accepted` n
    (speculative.RoundRecord): how many verified x_k (l >= k), and how many accepted it (n >= k; n <= l).
    What Done's speculative statistics and the server's per-position metrics count."""
    positions = range(1, max((r.verified for r in rounds), default=0) + 1)
    return [sum(r.verified >= k for r in rounds) for k in positions], [
        sum(r.accepted >= k for r in rounds) for k in positions
    ]


def coalesce(events: list[Event]) -> list[Event]:
    """Adjacent Text events merged into one (deltas and logprobs concatenated, in order): what a consumer
    that fell behind the engine gets as one message instead of one per round."""
    out: list[Event] = []
    for ev in events:
        prev = out[-1] if out else None
        if isinstance(ev, Text) and isinstance(prev, Text):
            lps = None if prev.logprobs is None and ev.logprobs is None else (prev.logprobs or []) + (ev.logprobs or [])
            out[-1] = Text(prev.delta + ev.delta, lps)
        else:
            out.append(ev)
    return out
