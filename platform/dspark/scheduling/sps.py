"""The cost of a round, profiled once on the actual device (warm-up, repeats, median, realistic context
lengths) and kept as a table; a table measured elsewhere (production hardware) can be loaded from JSON:

- SPS(B): target steps per second at a total batch of B tokens, spread over as many requests as the
  engine serves (B requests of one token each up to its batch: what plain decoding costs);
- t_d(R): seconds of one drafting round (gamma drafts) for R requests; absent = drafting is free;
- t_e: seconds per context position the drafter reads when it catches up (a new request's prompt,
  the positions committed in rounds that did not draft);
- t_v(R, B): seconds of verifying B tokens of R requests. Where attention over each request's cache is
  much of a step (a CPU, a small target), R requests with 8 tokens each cost less than SPS(8R) says (on the
  built-in target 5.0 against 5.6 ms at R = 1, 18.8 against 24.8 at R = 16). So the table
  also holds, at each R of t_d's, one forward of R requests with gamma + 1 tokens each (`verify_s`), and
  t_v runs linearly from 1/SPS(R) (one token each) to it over the B - R drafts verified; without it,
  t_v = 1/SPS(B).

A round that drafts takes t_e * (positions behind) + t_d(R) + t_v(R, B); one that does not takes 1/SPS(R)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dspark.errors import UserError


@dataclass
class SPSTable:
    batch: list[int]  # measured B values, increasing
    sps: list[float]  # steps per second at each B
    hardware: dict = field(default_factory=dict)
    draft_batch: list[int] = field(default_factory=list)  # measured R values (requests), increasing
    draft_s: list[float] = field(default_factory=list)  # seconds per drafting round at each R
    extend_s: float = 0.0  # t_e: seconds per context position of a catch-up (0 = not measured)
    verify_s: list[float] = field(default_factory=list)  # seconds verifying verify_tokens each, per draft_batch R
    verify_tokens: int = 0  # tokens per request in verify_s (gamma + 1; 0 = not measured)

    def __post_init__(self):
        if not self.batch or len(self.batch) != len(self.sps) or any(np.diff(self.batch) <= 0):
            raise UserError("SPS table: 'batch' must be increasing and as long as 'sps'")
        if len(self.draft_batch) != len(self.draft_s) or any(np.diff(self.draft_batch) <= 0):
            raise UserError("SPS table: 'draft_batch' must be increasing and as long as 'draft_s'")
        if self.verify_s and (len(self.verify_s) != len(self.draft_batch) or self.verify_tokens < 2):
            raise UserError("SPS table: 'verify_s' must be as long as 'draft_batch', with 'verify_tokens' >= 2")
        # as arrays once: the policies call the table for every candidate draft of every round
        self._b, self._s = np.asarray(self.batch, dtype=np.float64), np.asarray(self.sps, dtype=np.float64)

    def __call__(self, B: int) -> float:
        """Linear interpolation inside the table; beyond it, constant tokens/s (SPS ∝ 1/B)."""
        b = self._b
        if B <= b[0]:
            return float(self._s[0])
        if B >= b[-1]:
            return float(self._s[-1] * b[-1] / B)
        return float(np.interp(B, b, self._s))

    def draft_time(self, R: int) -> float:
        """t_d(R): linear interpolation inside the table; beyond it, proportional to R; 0 without a table."""
        return self._per_request(R, self.draft_s) if self.draft_batch else 0.0

    def _per_request(self, R: int, seconds: list[float]) -> float:
        """A time profiled at each R of draft_batch, at R: linear interpolation inside the table, the first
        value below its first R, proportional to R beyond its last."""
        r = self.draft_batch
        return float(seconds[-1] * R / r[-1]) if R >= r[-1] else float(np.interp(R, r, seconds))

    def verify_time(self, B: int, R: int | None = None) -> float:
        """t_v(R, B): seconds of a verification forward of B tokens for R requests (B >= R),
            t_v = 1/SPS(R) + (B - R) * (t_full(R) - 1/SPS(R)) / (R * (k - 1)),
        t_full(R) the profiled forward of R requests with k = verify_tokens each (interpolated between the
        profiled R, proportional to R beyond the last); without R or without that profile, 1/SPS(B)."""
        if R is None or not self.verify_s:
            return 1.0 / self(B)
        full, one = self._per_request(R, self.verify_s), 1.0 / self(R)
        return one + (B - R) * max(full - one, 0.0) / (R * (self.verify_tokens - 1))

    def catch_up_time(self, positions: float) -> float:
        """Seconds for the drafter to read `positions` context positions it has not seen yet."""
        return self.extend_s * positions

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SPSTable:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"SPS table not found: {p}")
        try:
            return cls(**json.loads(p.read_text()))
        except (ValueError, TypeError) as e:
            raise UserError(f"SPS table {p} is not valid: {e}") from None

    @classmethod
    def synthetic(cls, kind: str = "smooth", max_batch: int = 2048) -> SPSTable:
        """Shapes for simulation: 'smooth' (flat, then bandwidth-bound decay) or 'cliff' (a step at 64)."""
        b = np.arange(1, max_batch + 1)
        if kind == "smooth":
            s = 100.0 / (1 + (b / 48.0) ** 1.5) ** (2 / 3)
        elif kind == "cliff":
            s = np.where(b <= 64, 100.0 / (1 + b / 400.0), 45.0 / (1 + (b - 64) / 200.0))
        else:
            raise UserError(f"unknown synthetic SPS table {kind!r} (smooth, cliff)")
        return cls(b.tolist(), s.tolist(), {"synthetic": kind})
