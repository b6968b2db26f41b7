"""benchmarks/profile_step.py's share of the step, on made-up kernel intervals (CPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_step  # noqa: E402  (benchmarks/ is not a package)


def test_shares_count_what_each_kernel_adds_past_the_one_before():
    # a: 0-10; b starts early (PDL) at 8 and ends 15: adds 5; c inside b (ends 14): adds 0;
    # idle 15-20; a again 20-30: adds 10.
    kernels = [("a", 0.0, 10.0), ("b", 8.0, 15.0), ("c", 9.0, 14.0), ("a", 20.0, 30.0)]
    shares, idle = profile_step.step_shares(kernels)
    assert shares == {"a": [2, 20.0], "b": [1, 5.0], "c": [1, 0.0]}
    assert idle == 5.0
    span = kernels[-1][2] - kernels[0][1]
    assert sum(t for _, t in shares.values()) + idle == span


def test_shares_without_overlap_are_the_durations():
    kernels = [("x", 0.0, 3.0), ("y", 3.5, 7.0), ("x", 7.0, 8.0)]
    shares, idle = profile_step.step_shares(kernels)
    assert shares == {"x": [2, 4.0], "y": [1, 3.5]}
    assert idle == 0.5


def test_shares_reject_an_interval_that_ends_before_it_starts():
    with pytest.raises(ValueError, match="'k' ends"):
        profile_step.step_shares([("k", 5.0, 4.0)])
