"""Writes the committed prompt subsets from the paper's prompt sets (one {"turns": [...]} per line).

    python data/prompts/make_subsets.py /path/to/eval_datasets

Deterministic: every set is thinned by an even stride over the prompts whose turns are all at most
MAX_CHARS characters (long SWE-bench / LiveCodeBench issues cost minutes each on a CPU target).
Training sets and evaluation sets are disjoint by construction: different benchmarks, except that
the MATH-500 prompts not in eval/math500.jsonl are a training set (train/math500-rest.jsonl): the
other training sets hold 60 math prompts, against 39% math in the paper's training data.
"""

import json
import sys
from pathlib import Path

MAX_CHARS = 2500
EVAL = {"mt-bench": 16, "humaneval": 16, "mbpp": 16, "gsm8k": 16, "math500": 16}
TRAIN = {"arena-hard-v2": 400, "livecodebench": 150, "lbpp": 162, "swe-bench": 20, "aime24": 30, "aime25": 30}
REST = ["math500"]  # train/<name>-rest.jsonl: the short prompts of an evaluated set that eval/<name>.jsonl lacks


def short_prompts(src: Path) -> list[str]:
    lines = [ln for ln in src.read_text().split("\n") if ln.strip()]  # not splitlines: U+2028 is inside strings
    return [ln for ln in lines if all(len(t) <= MAX_CHARS for t in json.loads(ln)["turns"])]


def subset(src: Path, n: int) -> list[str]:
    short = short_prompts(src)
    step = max(1, len(short) // n)
    return short[::step][:n]


def main(src_dir: str) -> None:
    here = Path(__file__).resolve().parent
    for split, sets in (("eval", EVAL), ("train", TRAIN)):
        (here / split).mkdir(exist_ok=True)
        for name, n in sets.items():
            (here / split / f"{name}.jsonl").write_text("\n".join(subset(Path(src_dir) / f"{name}.jsonl", n)) + "\n")
    for name in REST:
        evaluated = set(subset(Path(src_dir) / f"{name}.jsonl", EVAL[name]))
        rest = [ln for ln in short_prompts(Path(src_dir) / f"{name}.jsonl") if ln not in evaluated]
        (here / "train" / f"{name}-rest.jsonl").write_text("\n".join(rest) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/eval_datasets")
