"""bench/serve_load.py takes its prompts from the prompt sets in turn, so that a load's first requests
(a user sends items u, u + C, ...) cover every set rather than the first set only; its [gate run] lines
count the drafter's catch-up in a drafted round's speed; a point's plain rounds at full load are timed from
the engine's counters, and a median skips the repeats without them; with a spread, each request's max_tokens
is drawn from its user and index alone."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from serve_load import bench_prompts, median_row, plain_rounds, round_robin, run_line, spread_tokens  # noqa: E402

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
