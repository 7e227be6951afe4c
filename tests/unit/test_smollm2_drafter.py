"""bench/smollm2_drafter.sh takes hours, so its chain is checked from the commands it would run (DRY=1):
every setting is a valid config key, every cache a stage reads was built or joined before it, every
warm start is the stage before, and the stages add up to the measured chain (docs/smollm2.md)."""

import os
import shlex
import subprocess
from pathlib import Path

from dspark.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, **env) -> list[list[str]]:
    out = subprocess.run(
        ["bash", str(ROOT / "bench/smollm2_drafter.sh")],
        env={
            **os.environ,
            **{"DRY": "1", "ROOT": str(tmp_path / "store"), "OUT": str(tmp_path / "out"), "PY": "python"},
            **{"EXAMPLES": "0", "STEPS_SCALE": "1", "PROMPTS": "12", **env},  # the defaults, whatever the shell says
        },
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def options(cmd: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's --options (the last of each) and its --set overrides, in order."""
    opts, sets = {}, []
    for flag, value in zip(cmd, cmd[1:]):
        if flag == "--set":
            sets.append(value)
        elif flag.startswith("--") and not value.startswith("--"):
            opts[flag] = value
    return opts, sets


def test_the_chain_builds_what_each_stage_reads_with_valid_settings(tmp_path):
    cmds = dry_run(tmp_path)
    caches, stages, steps, seeds, trained_on = [], [], {}, [], ""
    for cmd in cmds:
        script = cmd[1]
        assert (ROOT / script).is_file(), script
        opts, sets = options(cmd)
        cfg = load_config(ROOT / opts["--config"], sets)  # raises on an unknown key or a bad value
        if script == "jobs/build_cache.py":
            if cfg.cache.source_uri:  # a join grows the cache trained on last by the answers built just now
                assert [Path(u).name for u in cfg.cache.source_uri] == [trained_on, caches[-1]], cmd
            else:
                assert all((ROOT / s).is_file() for s in cfg.cache.sources), cfg.cache.sources
                seeds.append((Path(cfg.cache.sources[0]).stem, cfg.cache.seed))
            caches.append(cfg.cache.name)
        elif script == "bench/drafter_comparison.py":
            trained_on = Path(opts["--cache"]).name
            assert trained_on == caches[-1], cmd  # the cache made just before
            warm = cfg.train.warm_start
            assert (warm == "") == (not stages), cmd  # the first stage alone starts from the target
            if stages:
                assert warm == f"{tmp_path}/out/{stages[-1]}/dspark" and cfg.train.lr == 3e-4, cmd
            else:
                assert cfg.train.init_layers == "target_top"
            stages.append(Path(opts["--out"]).name)
            steps[stages[-1]] = int(opts["--steps"])
        else:  # the profile and the evaluation read the last stage's drafter
            assert script in ("jobs/profile_sps.py", "jobs/evaluate.py"), script
            assert opts["--drafter"].endswith(f"{tmp_path}/out/{stages[-1]}/dspark"), cmd
    assert steps == {
        "top": 1607,
        "seeds2": 800,
        "seeds3": 1000,
        "math": 1000,
        "math2": 1000,
        "math3": 1000,
        "math4": 600,
        "math5": 600,
    }
    assert seeds == [("arena-hard-v2", 0), ("arena-hard-v2", 1), ("arena-hard-v2", 2)] + [
        ("math500-rest", k) for k in range(5)
    ]
    assert cmds[-1][1] == "jobs/evaluate.py"


def test_sizes_scale_and_finished_stages_are_skipped(tmp_path):
    cmds = dry_run(tmp_path, STEPS_SCALE="0.01", EXAMPLES="2")
    steps = [int(options(c)[0]["--steps"]) for c in cmds if c[1] == "bench/drafter_comparison.py"]
    assert steps == [16, 8, 10, 10, 10, 10, 6, 6]
    assert all("cache.max_examples=2" in c for c in cmds if c[1] == "jobs/build_cache.py" and "cache.seed=0" in c)
    for name in ("smollm2-indomain", "smollm2-indomain-s1"):
        (tmp_path / "store/caches" / name).mkdir(parents=True)
        (tmp_path / "store/caches" / name / "manifest.json").write_text("{}")
    (tmp_path / "out/top/dspark").mkdir(parents=True)
    (tmp_path / "out/top/dspark/model.safetensors").write_text("")
    rerun = [what(c) for c in dry_run(tmp_path)]
    assert rerun == [what(c) for c in cmds if what(c) not in ("smollm2-indomain", "smollm2-indomain-s1", "top")]


def what(cmd: list[str]) -> str:
    """What a command makes: a cache's name, a stage's name, or the script (the profile, the evaluation)."""
    opts, sets = options(cmd)
    if cmd[1] == "jobs/build_cache.py":
        return next(s for s in sets if s.startswith("cache.name=")).partition("=")[2]
    return Path(opts["--out"]).name if cmd[1] == "bench/drafter_comparison.py" else cmd[1]
