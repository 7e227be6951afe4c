"""The draft gate (scheduling.policies.DraftGate) on simulated rounds: how close it comes to the better of
"always draft" and "never draft", for several of its noise margins z, where drafting wins and where it loses.

    python bench/gate_sim.py [--z 2,1,0.5] [--seeds 40]

A scenario is R requests for a number of rounds. A plain round emits R tokens in `plain_s` seconds; a
drafted round verifies l drafts per request, accepted one after another with the per-position acceptance
ALPHA (R + the accepted drafts are emitted), in plain_s + extra_s seconds; every round's time carries 5%
log-normal noise. The gate decides each round from the rounds before it (observe, timed), exactly as the
decoder calls it. A "warm" scenario starts from a gate that has drafted 100 rounds at R = 1 (a server whose
load rose). The defaults are SmolLM2 serve_load's measurements (results/serve-load-gate4-smollm2: a plain
round of 4 requests 51 ms, a drafted one 95 ms; at R = 1, 43 and 58 ms). Prints, per z and scenario, the
mean and 10th percentile over seeds of the gate's tokens/s as a fraction of the better fixed choice's
expected tokens/s, and the share of rounds that drafted.
"""

from __future__ import annotations

import argparse

import numpy as np

from dspark.scheduling.policies import DraftGate
from dspark.scheduling.sps import SPSTable

ALPHA = np.array([0.45, 0.55, 0.6, 0.6, 0.6, 0.6, 0.6])  # conditional acceptance per draft position
# name: (R, rounds, plain_s, extra_s, l, warm)
SCENARIOS = {
    "R=1 wins": (1, 150, 0.043, 0.015, 3, False),
    "R=1 wins, long": (1, 600, 0.043, 0.015, 3, False),
    "R=1 wins by 10%": (1, 300, 0.043, 0.029, 3, False),
    "R=1 loses": (1, 300, 0.043, 0.045, 3, False),
    "R=4 loses, warm": (4, 130, 0.051, 0.044, 2, True),
    "R=4 loses, warm, long": (4, 500, 0.051, 0.044, 2, True),
}
# SPS(B) and t_d(R) of the model the gate falls back on before it has measured (SmolLM2 on this CPU)
SPS = SPSTable([1, 4, 8, 16], [29.0, 26.6, 20.0, 16.4], draft_batch=[1, 4, 8], draft_s=[0.008, 0.016, 0.028])


def one_round(rng, R: int, drafted: bool, l: int, plain_s: float, extra_s: float):
    """(verified, accepted, tokens, seconds) of a simulated round."""
    noise = rng.lognormal(0.0, 0.05)
    if not drafted:
        return [0] * R, [0] * R, R, plain_s * noise
    accepted = []
    for _ in range(R):
        n = 0
        while n < l and rng.random() < ALPHA[n]:
            n += 1
        accepted.append(n)
    return [l] * R, accepted, R + sum(accepted), (plain_s + extra_s) * noise


def run(z: float, seed: int, R: int, rounds: int, plain_s: float, extra_s: float, l: int, warm: bool):
    """The gate's tokens/s and drafting share over one simulated run."""
    rng = np.random.default_rng(seed)
    gate = DraftGate(SPS, len(ALPHA), 256, z=z)
    if warm:
        for _ in range(100):
            v, a, t, s = one_round(rng, 1, True, 3, 0.043, 0.015)
            gate.observe(v, a)
            gate.timed(1, True, t, s)
    tokens = seconds = 0.0
    drafted_rounds = 0
    for _ in range(rounds):
        drafted = gate(R)
        v, a, t, s = one_round(rng, R, drafted, l, plain_s, extra_s)
        if drafted:
            gate.observe(v, a)
            drafted_rounds += 1
        gate.timed(R, drafted, t, s)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds, drafted_rounds / rounds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--z", default="2,1,0.5")
    p.add_argument("--seeds", type=int, default=40)
    args = p.parse_args(argv)
    for z in [float(x) for x in args.z.split(",")]:
        print(f"z = {z}")
        for name, (R, rounds, plain_s, extra_s, l, warm) in SCENARIOS.items():
            runs = [run(z, s, R, rounds, plain_s, extra_s, l, warm) for s in range(args.seeds)]
            rates = np.array([r for r, _ in runs])
            drafting = R * (1 + np.cumprod(ALPHA[:l]).sum()) / (plain_s + extra_s)  # expected tokens/s
            best = max(R / plain_s, drafting)
            print(
                f"  {name:24s} {rates.mean() / best:.3f} of the better fixed choice (p10 "
                f"{np.percentile(rates, 10) / best:.3f}), drafting {np.mean([d for _, d in runs]):.2f} of rounds "
                f"(always drafting: {drafting / (R / plain_s):.2f}x plain)"
            )


if __name__ == "__main__":
    main()
