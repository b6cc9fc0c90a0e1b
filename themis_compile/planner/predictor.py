"""Expert-load prediction (§4.2): a per-layer sliding-window mean over the last w iterations.

The gate's load distribution drifts slowly between adjacent iterations, so the mean of the last w
observed loads (Themis uses w = 5) predicts the next one well enough to plan the SparseAllGather before
the gate runs. Observed loads are the all-reduced integer token counts, so every rank holds the same
history and predicts the same numbers.

First iterations: before a layer has any history it predicts uniform loads (all ones: nothing is known,
so no expert is preferred); with fewer than w observations it averages those it has.

Legend: L layers, E experts, W window.
"""

from __future__ import annotations

import logging

import numpy as np

from themis_compile.planner.materialize import check_loads

logger = logging.getLogger(__name__)

__all__ = ["LoadPredictor"]


class LoadPredictor:
    """Sliding-window mean of per-expert loads, one window per MoE layer.

    Args:
        num_layers: L, the number of MoE layers.
        num_experts: E, experts per layer.
        window: w >= 1 (paper: 5).
    """

    def __init__(self, num_layers: int, num_experts: int, window: int = 5) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"LoadPredictor needs num_layers >= 1 and num_experts >= 1, "
                             f"got {num_layers} and {num_experts}")
        if window < 1:
            raise ValueError(f"LoadPredictor window must be >= 1, got {window}")
        self.num_layers, self.num_experts, self.window = int(num_layers), int(num_experts), int(window)
        self._ring_LWE = np.zeros((self.num_layers, self.window, self.num_experts), dtype=np.float64)
        self._count_L = np.zeros(self.num_layers, dtype=np.int64)   # observations ever recorded

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range for {self.num_layers} MoE layers")
        return int(layer)

    def update(self, layer: int, load_E: np.ndarray) -> None:
        """Record the observed tokens per expert of ``layer`` for one iteration."""
        layer = self._check_layer(layer)
        load_E = check_loads(load_E, self.num_experts)
        self._ring_LWE[layer, self._count_L[layer] % self.window] = load_E
        self._count_L[layer] += 1

    def history(self, layer: int) -> np.ndarray:
        """[n, E] the recorded loads in the window, oldest first (n <= w)."""
        layer = self._check_layer(layer)
        count, w = int(self._count_L[layer]), self.window
        if count <= w:
            return self._ring_LWE[layer, :count].copy()
        start = count % w
        return np.concatenate([self._ring_LWE[layer, start:], self._ring_LWE[layer, :start]])

    def predict(self, layer: int) -> np.ndarray:
        """[E] float64 predicted load of ``layer`` for the next iteration."""
        layer = self._check_layer(layer)
        count = int(self._count_L[layer])
        if count == 0:
            return np.ones(self.num_experts, dtype=np.float64)
        # Sum oldest-first so the result depends only on the window's contents, not on the ring position.
        return self.history(layer).sum(axis=0) / min(count, self.window)

    def predict_all(self) -> np.ndarray:
        """[L, E] predictions of every layer (the input of Alg. 2)."""
        return np.stack([self.predict(layer) for layer in range(self.num_layers)])

    def reset(self) -> None:
        """Forget all history."""
        self._ring_LWE[:] = 0.0
        self._count_L[:] = 0
