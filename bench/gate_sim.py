"""The draft gate (scheduling.policies.DraftGate) on simulated rounds: how close it comes to the better of
"always draft" and "never draft", for several of its noise margins z, where drafting wins and where it loses.

    python bench/gate_sim.py [--z 1,0.5,0] [--seeds 40]

A scenario is R requests for a number of rounds. A plain round emits R tokens in `plain_s` seconds; a
drafted round verifies l drafts per request, accepted one after another with the per-position acceptance
ALPHA (R + the accepted drafts are emitted), in plain_s + extra_s seconds; every round's time carries 5%
log-normal noise. The gate decides each round from the rounds before it (observe, timed) and from each
request's own drafted rounds and accepted drafts, exactly as the decoder calls it (and, as requests end,
from their drafted rounds and accepted drafts: `DraftGate.finished`). A "warm" scenario
starts from a gate that has drafted 100 rounds at R = 1 (a server whose load rose). In "traffic changes",
requests of 50 rounds follow one another at R = 1 and the first one's drafts are almost never accepted
(3% per position, like the MT-Bench prompt of serve_load's first user; "requests of 50": the same
length, no bad one); it is run again with the gate
blind to the requests (`own` = None), as it was before it read them. "Slow drafter" is the built-in
target's serve_load at one request: a plain round 7.3 ms, a drafted one 16 ms (the drafter costs more than
a target step), requests of 64 rounds (8 of them, and 32: "long", where the gate has measured how far
requests differ). In the "bursts" the load changes every few rounds, as serve_load's
C = 16 puts it on the built-in target (BURSTS). The defaults are SmolLM2
serve_load's measurements (results/serve-load-gate4-smollm2: a plain round of 4 requests 51 ms, a drafted
one 95 ms; at R = 1, 43 and 58 ms). Prints, per z and scenario, the mean and 10th percentile over seeds
of the gate's tokens/s as a fraction of the better fixed choice's (always or never drafting, on the same
simulated rounds, mean over seeds), and the share of rounds that drafted.
"""

from __future__ import annotations

import argparse

import numpy as np

from dspark.scheduling.policies import DraftGate
from dspark.scheduling.sps import SPSTable

ALPHA = np.array([0.45, 0.55, 0.6, 0.6, 0.6, 0.6, 0.6])  # conditional acceptance per draft position
BAD = np.full(len(ALPHA), 0.03)  # a request whose drafts are almost never accepted
# name: (R, rounds, plain_s, extra_s, l, warm, rounds per request (0: the whole run), first request bad,
#        gate reads the requests)
SCENARIOS = {
    "R=1 wins": (1, 150, 0.043, 0.015, 3, False, 0, False, True),
    "R=1 wins, long": (1, 600, 0.043, 0.015, 3, False, 0, False, True),
    "R=1 wins by 10%": (1, 300, 0.043, 0.029, 3, False, 0, False, True),
    "R=1 loses": (1, 300, 0.043, 0.045, 3, False, 0, False, True),
    "R=1 loses, requests of 50": (1, 400, 0.043, 0.045, 3, False, 50, False, True),
    "R=4 loses, warm": (4, 130, 0.051, 0.044, 2, True, 0, False, True),
    "R=4 loses, warm, long": (4, 500, 0.051, 0.044, 2, True, 0, False, True),
    "traffic changes": (1, 400, 0.043, 0.015, 3, False, 50, True, True),
    "traffic changes, blind": (1, 400, 0.043, 0.015, 3, False, 50, True, False),
    "R=1 loses, slow drafter": (1, 512, 0.0073, 0.0087, 3, False, 64, False, True),
    "R=1 loses, slow drafter, long": (1, 2048, 0.0073, 0.0087, 3, False, 64, False, True),
}
# SPS(B) and t_d(R) of the model the gate falls back on before it has measured (SmolLM2 on this CPU)
SPS = SPSTable([1, 4, 8, 16], [29.0, 26.6, 20.0, 16.4], draft_batch=[1, 4, 8], draft_s=[0.008, 0.016, 0.028])
# Bursts, the load serve_load puts on a server at C = 16: 16 requests start together, run `rounds` rounds
# at R = 16, then end one by one (R = 15 .. 1, `tail` rounds each); `bursts` of them one after another.
# A plain round takes p0 + p1 R seconds, a drafted one e0 + e1 R more (the built-in target's serve_load
# rounds: 8.5 ms at R = 1 and 12.6 ms at 16; the quickstart's drafter 12 and 53 ms more, 4x a plain round
# at 16, with little accepted; the second about as the drafter trained on the whole built-in split at T=0,
# winning by 20% at R = 1 and losing by 13% at 16). name: (bursts, rounds, tail, (p0, p1), (e0, e1), l, alpha)
BURSTS = {
    "bursts of 16, drafting loses": (4, 48, 2, (0.0082, 0.00027), (0.0093, 0.0027), 3, np.full(7, 0.3)),
    "bursts of 16, wins at R=1 only": (4, 48, 2, (0.0082, 0.00027), (0.0100, 0.0011), 4, np.full(7, 0.7)),
}
# the built-in target's SPS(B) and t_d(R) (its profile's shape)
SPS_BUILTIN = SPSTable([1, 16, 64, 128], [122.0, 80.0, 40.0, 25.0], draft_batch=[1, 16], draft_s=[0.009, 0.05])


def one_round(rng, R: int, drafted: bool, l: int, plain_s: float, extra_s: float, alpha=ALPHA):
    """(verified, accepted, tokens, seconds) of a simulated round."""
    noise = rng.lognormal(0.0, 0.05)
    if not drafted:
        return [0] * R, [0] * R, R, plain_s * noise
    accepted = []
    for _ in range(R):
        n = 0
        while n < l and rng.random() < alpha[n]:
            n += 1
        accepted.append(n)
    return [l] * R, accepted, R + sum(accepted), (plain_s + extra_s) * noise


def run(z, seed, R, rounds, plain_s, extra_s, l, warm, request_rounds, bad_first, reads, fixed=None):
    """Tokens/s and drafting share over one simulated run: the gate's, or a fixed choice's (`fixed`)."""
    rng = np.random.default_rng(seed)
    gate = DraftGate(SPS, len(ALPHA), 256, z=z)
    if warm:
        for _ in range(100):
            v, a, t, s = one_round(rng, 1, True, 3, 0.043, 0.015)
            gate.observe(v, a)
            gate.timed(1, True, t, s)
    tokens = seconds = 0.0
    drafted_rounds = 0
    rounds_of = [[] for _ in range(R)]  # each request's accepted drafts per drafted round
    for i in range(rounds):
        request = i // request_rounds if request_rounds else 0  # the R requests start and end together
        if request_rounds and i % request_rounds == 0:
            if i:  # the requests that end: how much they differ sets the weight of a request's own rounds
                for accepted in rounds_of:
                    gate.finished(0, request_rounds, accepted)
            rounds_of = [[] for _ in range(R)]
        own = [(len(accepted), sum(accepted)) for accepted in rounds_of]  # drafted rounds, accepted drafts
        drafted = fixed if fixed is not None else gate(R, 0, own if reads else None)
        alpha = BAD if bad_first and request == 0 else ALPHA
        v, a, t, s = one_round(rng, R, drafted, l, plain_s, extra_s, alpha)
        if drafted:
            gate.observe(v, a)
            for accepted, k in zip(rounds_of, a):
                accepted.append(k)
            drafted_rounds += 1
        gate.timed(R, drafted, t, s)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds, drafted_rounds / rounds


def run_bursts(z, seed, bursts, rounds, tail, plain, extra, l, alpha, fixed=None):
    """As `run`, for a load that changes every few rounds (BURSTS); the gate reads the server's rounds.
    The work is fixed, as in serve_load (drafting that pays shortens a burst's tail, it does not add rounds
    there): the tokens/s is that of the plain rounds' tokens at each load, Σ_R W_R, emitted at the rate
    measured there, in Σ_R W_R / rate(R). The rounds at each load are fixed all the same: the gate decides
    (and probes) as often at each load as plain decoding has rounds there."""
    rng = np.random.default_rng(seed)
    gate = DraftGate(SPS_BUILTIN, len(alpha), 256, z=z)
    loads = ([16] * rounds + [R for R in range(15, 0, -1) for _ in range(tail)]) * bursts
    tokens, seconds = np.zeros(17), np.zeros(17)  # per load R
    drafted_rounds = 0
    for R in loads:
        drafted = fixed if fixed is not None else gate(R)
        p, e = plain[0] + plain[1] * R, extra[0] + extra[1] * R
        v, a, t, s = one_round(rng, R, drafted, l, p, e, alpha)
        if drafted:
            gate.observe(v, a)
            drafted_rounds += 1
        gate.timed(R, drafted, t, s)
        tokens[R], seconds[R] = tokens[R] + t, seconds[R] + s
    work = np.bincount(loads, minlength=17) * np.arange(17)  # W_R: R tokens per round at R
    at = tokens > 0
    return work.sum() / (work[at] * seconds[at] / tokens[at]).sum(), drafted_rounds / len(loads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--z", default="1,0.5,0")
    p.add_argument("--seeds", type=int, default=40)
    args = p.parse_args(argv)
    for z in [float(x) for x in args.z.split(",")]:
        print(f"z = {z}")
        for name, (sim, case) in [
            *((n, (run, c)) for n, c in SCENARIOS.items()),
            *((n, (run_bursts, c)) for n, c in BURSTS.items()),
        ]:
            runs = [sim(z, s, *case) for s in range(args.seeds)]
            rates = np.array([r for r, _ in runs])
            always, never = (np.mean([sim(z, s, *case, fixed=f)[0] for s in range(args.seeds)]) for f in (True, False))
            best = max(always, never)  # the better fixed choice's mean tokens/s on the same rounds
            print(
                f"  {name:24s} {rates.mean() / best:.3f} of the better fixed choice (p10 "
                f"{np.percentile(rates, 10) / best:.3f}), drafting {np.mean([d for _, d in runs]):.2f} of rounds "
                f"(always drafting: {always / never:.2f}x plain)"
            )


if __name__ == "__main__":
    main()
