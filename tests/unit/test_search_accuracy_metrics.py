"""benchmarks/_accuracy.py metrics: Spearman rank correlation with ties, percentage errors, best-plan gap."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _accuracy as acc  # noqa: E402


def test_ranks_average_ties():
    assert acc.ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]


def test_spearman_matches_pearson_of_ranks_and_known_values():
    assert acc.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert acc.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # textbook case with one swap among 5: 1 - 6 * 2 / (5 * 24) = 0.9
    assert acc.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=12).round(1), rng.normal(size=12).round(1)  # rounding makes ties
    expected = np.corrcoef(acc.ranks(list(x)), acc.ranks(list(y)))[0, 1]
    assert acc.spearman(list(x), list(y)) == pytest.approx(expected)
    assert np.isnan(acc.spearman([1, 2], [2, 1]))


def test_group_metrics_best_gap_and_errors():
    rows = [{"label": "a", "measured_s": 1.00, "predicted_s": 1.10, "measured_mem": 100, "predicted_mem": 90},
            {"label": "b", "measured_s": 1.02, "predicted_s": 0.90, "measured_mem": 200, "predicted_mem": 200},
            {"label": "c", "measured_s": 2.00, "predicted_s": 2.00, "measured_mem": -1, "predicted_mem": 50}]
    m = acc.group_metrics(rows)
    assert m["n"] == 3 and m["mem_n"] == 2
    assert m["time_median_ape"] == pytest.approx(10.0) and m["time_max_ape"] == pytest.approx(100 * 0.12 / 1.02)
    assert m["mem_median_ape"] == pytest.approx(5.0) and m["mem_max_ape"] == pytest.approx(10.0)
    assert (m["measured_best"], m["predicted_best"]) == ("a", "b")
    assert m["predicted_best_gap"] == pytest.approx(0.02) and m["predicted_best_ok"]
