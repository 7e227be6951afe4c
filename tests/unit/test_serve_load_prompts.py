"""bench/serve_load.py takes its prompts from the prompt sets in turn, so that a load's first requests
(a user sends items u, u + C, ...) cover every set rather than the first set only; its [gate run] lines
count the drafter's catch-up in a drafted round's speed; a point's plain rounds at full load are timed from
the engine's counters, and a median skips the repeats without them; with a spread, each request's max_tokens
is drawn from its user and index alone; the rate while every user was in leaves the drain out."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from serve_load import (  # noqa: E402
    bench_prompts,
    best_ratios,
    median_row,
    plain_rounds,
    round_robin,
    run_line,
    spread_tokens,
    steady_rate,
)

from dspark.config import load_config  # noqa: E402


def test_round_robin_takes_one_of_each_group_in_turn():
    assert round_robin([[1, 2, 3], ["a"], ["x", "y"]]) == [1, "a", "x", 2, "y", 3]
    assert round_robin([]) == []


def test_spread_lengths_are_the_same_in_every_mode_and_cover_their_range():
    drawn = [spread_tokens(64, 0.5, u, i) for u in range(16) for i in range(8)]
    assert drawn == [spread_tokens(64, 0.5, u, i) for u in range(16) for i in range(8)]  # a function of (u, i)
    assert min(drawn) >= 32 and max(drawn) <= 96 and len(set(drawn)) > 32  # spread over 32..96, not one value
    assert spread_tokens(64, 0.5, 0, 1) != spread_tokens(64, 0.5, 1, 0)  # users differ
    assert spread_tokens(2, 1.0, 3, 4) >= 1


def test_first_requests_cover_every_prompt_set():
    cfg = load_config(ROOT / "configs/smollm2.yaml")
    lines = [[ln for ln in (ROOT / uri).read_text().split("\n") if ln.strip()] for uri in cfg.eval.prompt_sets.values()]
    firsts = [json.loads(ls[0])["turns"][0] for ls in lines]
    prompts = bench_prompts(cfg)
    assert [p["messages"][0]["content"] for p in prompts[: len(lines)]] == firsts
    assert len(prompts) == sum(map(len, lines))


def test_a_drafted_rounds_speed_counts_its_catch_up():
    drafted = {"rounds": 10, "tokens": 90, "seconds": 0.8, "catch_up_s": 0.2}
    assert run_line("drafted", drafted) == "drafted 10 rounds, 90.0 tok/s (catch-up 20% of it)"
    assert run_line("plain", {**drafted, "catch_up_s": 0.0}) == "plain 10 rounds, 112.5 tok/s"


def test_a_points_plain_rounds_are_the_difference_of_the_engines_counters():
    before = {"busy_s": {}, "plain_rounds": {"16": [10, 0.08, 0.07], "4": [3, 0.01, 0.01]}}
    after = {"busy_s": {}, "plain_rounds": {"16": [30, 0.24, 0.19], "4": [3, 0.01, 0.01], "15": [2, 0.02, 0.01]}}
    # 20 rounds in 0.16 s, 0.12 s of it the engine thread's CPU time
    assert plain_rounds(before, after, 16) == (20, pytest.approx(8.0), pytest.approx(6.0))
    assert plain_rounds(before, after, 4) == (0, None, None)  # none in this point
    assert plain_rounds(before, after, 15) == (2, pytest.approx(10.0), pytest.approx(5.0))  # none before it
    assert plain_rounds(None, after, 16) == (0, None, None)  # not our server
    rows = [
        {"tok_s": 1.0, "plain_round_ms": None},
        {"tok_s": 3.0, "plain_round_ms": 8.0},
        {"tok_s": 2.0, "plain_round_ms": 6.0},
    ]
    assert median_row(rows) == {"tok_s": 2.0, "plain_round_ms": 7.0}
    assert median_row([{"tok_s": 1.0, "budget": None}]) == {"tok_s": 1.0, "budget": None}


def sent(user: int, start: float, latency: float, tokens: int, ttft: float | None = 0.0) -> dict:
    """One request as serve_load's client records it."""
    return {"user": user, "start": start, "latency": latency, "tokens": tokens, "ttft": ttft}


def test_the_steady_rate_counts_the_window_where_every_user_was_in():
    # user 0: 0-1 s and 1-2 s; user 1 joins at 0.5 s and ends at 3.5 s: the window is 0.5-2 s
    reqs = [sent(0, 0.0, 1.0, 10), sent(0, 1.0, 1.0, 10), sent(1, 0.5, 1.0, 10), sent(1, 1.5, 2.0, 20)]
    rate, seconds = steady_rate(reqs, 2)
    assert seconds == pytest.approx(1.5)
    assert rate == pytest.approx((5 + 10 + 10 + 5) / 1.5)  # each request's share of the window, at an even pace
    # tokens stream from the first text on: user 1's last request sends nothing in its first second
    assert steady_rate(reqs[:3] + [sent(1, 1.5, 2.0, 20, ttft=1.0)], 2)[0] == pytest.approx((5 + 10 + 10) / 1.5)
    # no text (ttft None): from its start; all of it at once (a zero-length stream): counted where it ends
    assert steady_rate(reqs[:3] + [sent(1, 1.5, 2.0, 20, ttft=None)], 2)[0] == pytest.approx(rate)
    assert steady_rate(reqs + [sent(0, 1.0, 0.2, 4, ttft=0.2)], 2) == (pytest.approx(34 / 1.5), pytest.approx(1.5))
    # a deadline ends the window where users stopped sending
    assert steady_rate(reqs, 2, until=1.5) == (pytest.approx((5 + 5 + 10) / 1.0), pytest.approx(1.0))
    # one user: from its first request to its last end, each request streaming from its first text
    assert steady_rate([sent(0, 0.0, 1.0, 10, ttft=0.5), sent(0, 1.0, 3.0, 30)], 1) == (pytest.approx(10.0), 4.0)
    # no moment with both users in; a user none of whose requests succeeded
    assert steady_rate([sent(0, 0.0, 1.0, 10), sent(1, 2.0, 1.0, 10)], 2) == (None, 0.0)
    assert steady_rate(reqs, 3) == (None, 0.0)


def ratio_row(whole: float, steady: float | None) -> dict:
    return {"tok_s": whole, "steady_tok_s": steady}


def test_ratios_are_taken_within_repeats_that_measured_every_mode():
    results = {
        "target-only": {16: [ratio_row(100, 110), ratio_row(100, 100), ratio_row(90, None)]},
        "static 7": {16: [ratio_row(80, 120), ratio_row(90, 80), ratio_row(80, 80)]},
        "adaptive": {16: [ratio_row(95, 114), ratio_row(99, 102), ratio_row(90, 90)]},
    }
    fixed = ["target-only", "static 7"]
    assert best_ratios(results, 16, fixed, "tok_s") == [pytest.approx(0.95), pytest.approx(0.99), pytest.approx(1.0)]
    # the third repeat has no rate while all users were in for target-only: left out, not compared with static 7 alone
    assert best_ratios(results, 16, fixed, "steady_tok_s") == [pytest.approx(0.95), pytest.approx(1.02)]
