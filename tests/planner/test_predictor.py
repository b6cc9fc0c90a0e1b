"""Load prediction: sliding-window mean (§4.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import LoadPredictor


def test_predictor_first_iterations_and_window():
    pred = LoadPredictor(2, 3, window=2)
    assert pred.predict(0).tolist() == [1.0, 1.0, 1.0]            # no history: uniform
    pred.update(0, np.array([3, 0, 6]))
    assert pred.predict(0).tolist() == [3.0, 0.0, 6.0]            # fewer than w: mean of what exists
    pred.update(0, np.array([5, 2, 0]))
    pred.update(0, np.array([7, 4, 2]))
    assert pred.predict(0).tolist() == [6.0, 3.0, 1.0]            # last w = 2 only
    assert pred.history(0).tolist() == [[5, 2, 0], [7, 4, 2]]
    assert pred.predict(1).tolist() == [1.0, 1.0, 1.0]            # layers are independent
    assert pred.predict_all().shape == (2, 3)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=1, max_size=15))
def test_predictor_matches_mean_of_last_w(window, history):
    pred = LoadPredictor(1, 4, window=window)
    for loads in history:
        pred.update(0, np.array(loads))
    expected = np.mean(np.array(history[-window:], dtype=float), axis=0)
    assert np.allclose(pred.predict(0), expected)


def test_predictor_bad_input():
    with pytest.raises(ValueError):
        LoadPredictor(1, 3, window=0)
    pred = LoadPredictor(1, 3)
    with pytest.raises(ValueError, match="negative"):
        pred.update(0, np.array([1, -1, 0]))
    with pytest.raises(ValueError, match="out of range"):
        pred.predict(1)
    with pytest.raises(ValueError, match="shape"):
        pred.update(0, np.ones(4))
