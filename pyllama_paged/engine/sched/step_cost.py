"""How long a step takes, learned from the steps the engine runs: the
scheduler's model for keeping every running stream's inter-token gap within
a budget. A step's time is fitted as

    seconds = fixed + per_decode * decode_columns + per_prefill * prefill_tokens

where decode_columns are the decode tokens plus the zero columns the step's
matrix products are padded with (pp_matmul_columns: 5 to 7 decodes cost
what 8 do), by exponentially weighted least squares (recent steps count most, so the
model follows the machine's load), pulled gently toward a prior so that it
answers sensibly from the first step."""

from __future__ import annotations

import numpy as np

from ..._native import lib


def decode_columns(decode_tokens: int, prefill_tokens: int) -> int:
    """Decode tokens plus the padding columns a step of these tokens computes."""
    return lib.pp_matmul_columns(decode_tokens + prefill_tokens) - prefill_tokens


def _solve3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with a x = b for a symmetric positive definite 3x3 a, without LAPACK.

    np.linalg.solve would call OpenBLAS every step, whose idle threads then
    spin on the cores GGML's workers need (measured: ~1% of a step)."""
    m = [[float(a[i, j]) for j in range(3)] + [float(b[i])] for i in range(3)]
    for col in range(3):
        pivot = m[col][col]
        for row in range(col + 1, 3):
            f = m[row][col] / pivot
            for j in range(col, 4):
                m[row][j] -= f * m[col][j]
    x = [0.0, 0.0, 0.0]
    for row in (2, 1, 0):
        x[row] = (m[row][3] - sum(m[row][j] * x[j] for j in range(row + 1, 3))) / m[row][row]
    return np.array(x)


class StepCostModel:
    """An online linear model of step time over (decode tokens, prefill tokens)."""

    def __init__(self, forgetting: float = 0.98, prior=(0.02, 0.005, 0.003), prior_weight: float = 1e-2,
                 min_steps: int = 8):
        self.forgetting = forgetting
        self._prior = np.asarray(prior, dtype=np.float64)
        self._ridge = prior_weight
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._coef = self._prior.copy()
        self.num_steps = 0
        self.min_steps = min_steps

    @property
    def ready(self) -> bool:
        """Whether enough steps were seen for the predictions to be the machine's."""
        return self.num_steps >= self.min_steps

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per decode token, per prefill token), in seconds."""
        return tuple(float(c) for c in self._coef)

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """Learn from one step that computed these tokens in this many seconds."""
        if not (seconds > 0) or decode_tokens + prefill_tokens <= 0:
            return
        x = np.array([1.0, decode_columns(decode_tokens, prefill_tokens), prefill_tokens])
        self._xtx = self.forgetting * self._xtx + np.outer(x, x)
        self._xty = self.forgetting * self._xty + x * seconds
        coef = _solve3(self._xtx + self._ridge * np.eye(3), self._xty + self._ridge * self._prior)
        # A cost is never negative; a collinear stretch of steps must not make it so.
        self._coef = np.maximum(coef, [1e-4, 1e-5, 1e-5])
        self.num_steps += 1

    def predict(self, decode_tokens: int, prefill_tokens: int = 0) -> float:
        """Predicted seconds of a step computing these tokens."""
        fixed, per_decode, per_prefill = self._coef
        return float(fixed + per_decode * decode_columns(decode_tokens, prefill_tokens)
                     + per_prefill * prefill_tokens)

    def prefill_tokens_within(self, decode_tokens: int, seconds: float) -> int:
        """The most prefill tokens a step with these decodes can add and stay within seconds."""
        fixed, per_decode, per_prefill = self._coef
        n = max(0, int((seconds - fixed - per_decode * decode_tokens) / per_prefill + 1e-9))
        # in a small step, padding columns may push it over: take the largest that fits
        while n > 0 and self.predict(decode_tokens, n) > seconds + 1e-12:
            n -= 1
        return n
