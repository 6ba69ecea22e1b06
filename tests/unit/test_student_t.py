"""The detectors' Student t distribution function against scipy's (scipy is a test dependency only)."""

from __future__ import annotations

import numpy as np
import pytest
from llmobs.diagnostics.student_t import betainc, t_cdf

special = pytest.importorskip("scipy.special")


def test_t_cdf_matches_scipy_over_the_detectors_range():
    rng = np.random.default_rng(7)
    df = np.concatenate([np.arange(1, 65), rng.integers(1, 5000, 400)]).astype(float)
    t = np.concatenate([rng.normal(0, 3, len(df) // 2), rng.uniform(-80, 80, len(df) - len(df) // 2)])
    ours, theirs = t_cdf(df, t), special.stdtr(df, t)
    np.testing.assert_allclose(ours, theirs, rtol=1e-11, atol=1e-300)


def test_the_far_tails_keep_their_relative_precision():
    df = np.array([1.0, 2.0, 5.0, 30.0, 200.0, 1000.0])
    for t in (-1e3, -50.0, -12.0, 12.0):
        np.testing.assert_allclose(t_cdf(df, t), special.stdtr(df, t), rtol=1e-10)
    # not rounded to zero where scipy has a value (df 200 and 1000 underflow in both)
    assert ((t_cdf(df, -1e3) > 0) == (special.stdtr(df, -1e3) > 0)).all()


def test_non_integer_df_and_the_edges():
    df = np.array([0.5, 1.5, 2.5, 7.25, 99.5])
    t = np.array([-2.0, -0.1, 0.0, 0.3, 4.0])
    np.testing.assert_allclose(t_cdf(df, t), special.stdtr(df, t), rtol=1e-11)
    assert t_cdf(3.0, 0.0) == 0.5
    assert t_cdf(3.0, -np.inf) == 0.0 and t_cdf(3.0, np.inf) == 1.0
    assert np.isnan(t_cdf(3.0, np.nan)) and np.isnan(t_cdf(0.0, 1.0))


def test_betainc_matches_scipy():
    rng = np.random.default_rng(11)
    a, b, x = rng.uniform(0.1, 300, 500), rng.uniform(0.1, 300, 500), rng.uniform(0, 1, 500)
    np.testing.assert_allclose(betainc(a, b, x), special.betainc(a, b, x), rtol=1e-10, atol=1e-300)
    assert betainc(2.0, 3.0, 0.0) == 0.0 and betainc(2.0, 3.0, 1.0) == 1.0


def test_the_detectors_do_not_import_scipy():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np; from llmobs.diagnostics import detectors;"
        " detectors.StreamingDetector(); assert 'scipy' not in sys.modules, 'scipy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_element_by_element_path_agrees_with_the_batch_path():
    rng = np.random.default_rng(5)
    df, t = rng.integers(1, 400, 300).astype(float), rng.normal(0, 5, 300)
    whole = t_cdf(df, t)  # one numpy pass (above the element-by-element size)
    pieces = np.concatenate([t_cdf(df[i : i + 10], t[i : i + 10]) for i in range(0, 300, 10)])
    np.testing.assert_allclose(pieces, whole, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(pieces, special.stdtr(df, t), rtol=1e-11, atol=1e-300)


def test_the_critical_value_is_scipys_quantile():
    from llmobs.diagnostics.student_t import t_critical

    stats = pytest.importorskip("scipy.stats")
    for df in (1.0, 2.0, 3.0, 7.0, 15.0, 63.0, 1023.0):
        for alpha in (0.05, 0.01, 1e-4):
            assert t_critical(df, alpha) == pytest.approx(stats.t.isf(alpha, df), rel=1e-9)


@pytest.mark.parametrize("rows", [8, 500])  # the float path and the numpy path
def test_upper_tail_below_gives_the_exact_tail_and_verdict(rows):
    from llmobs.diagnostics.student_t import t_critical, upper_tail_below

    rng = np.random.default_rng(5)
    df = rng.integers(1, 64, rows).astype(float)
    t = rng.normal(1.5, 3, rows)
    t[:2] = [t_critical(df[0], 0.01), np.nan]  # on the critical value itself, and NaN
    p = upper_tail_below(df, t, 0.01)
    exact = special.stdtr(df, -t)
    flagged = exact < 0.01
    assert flagged.any() and (~flagged).any()
    np.testing.assert_array_equal(~np.isnan(p), flagged)
    np.testing.assert_allclose(p[flagged], exact[flagged], rtol=1e-11)
