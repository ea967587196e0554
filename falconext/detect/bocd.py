"""Bayesian online change-point detection (Adams & MacKay, 2007) for iteration times.

Model. Iteration times are modelled on a log scale, so a fail-slow that stretches every
iteration by a factor is a shift of the mean of the same size whatever the job's speed,
and noise that scales with the iteration time has a constant variance. Within a run the
log times are Normal with unknown mean and variance under a Normal-Gamma prior; the
posterior predictive is a Student-t. Changes arrive with a constant hazard H.

Run-length convention. After observing x_t, ``r_t = k`` (k >= 1) means the last k
observations x_{t-k+1..t} form the current run, so a change whose first slow iteration is
s has run length t - s + 1 at time t. ``r_t = 0`` is the prior mass for a run that starts
with the *next* observation.

The change signal (the BOCD pitfall). With a constant hazard the posterior mass on
``r_t = 0`` is exactly H at every step, so the paper's "P(r_t = 0) > 0.9" can never fire.
We use instead the posterior probability that the current run started within the last W
iterations, ``P(1 <= r_t <= W | x_1..t)``: it stays near 0 in a long stable run and jumps
towards 1 within a few iterations of a real change. When it exceeds the threshold (0.9,
the paper's value) the most probable start of the run among those W is the candidate
change point. A run that survives more than W iterations stops being "recent", so each
change is reported once; the same start seen again is de-duplicated by the caller.

Pruning. Run lengths beyond ``max_run_length`` are folded into the longest kept one: its
probability is added, its statistics (a window of the most recent observations) kept.
Each update is therefore O(max_run_length), and the longest hypothesis behaves like a
sliding window, which lets it follow slow drift instead of accumulating it forever.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

_LOG_EPS = -1e300


class BOCD:
    """Run-length posterior over a stream of positive values (iteration times)."""

    def __init__(
        self,
        hazard: float = 1.0 / 250.0,
        max_run_length: int = 300,
        prior_kappa: float = 0.1,
        prior_alpha: float = 1.0,
        prior_scale: float = 0.03,
    ) -> None:
        if not 0.0 < hazard < 1.0:
            raise ValueError(f"hazard must be in (0, 1), got {hazard!r}")
        if max_run_length < 2:
            raise ValueError("max_run_length must be >= 2")
        if prior_kappa <= 0 or prior_alpha <= 0 or prior_scale <= 0:
            raise ValueError("prior_kappa, prior_alpha and prior_scale must be > 0")
        self._log_h = math.log(hazard)
        self._log_1mh = math.log1p(-hazard)
        self._rmax = int(max_run_length)
        self._k0 = float(prior_kappa)
        self._a0 = float(prior_alpha)
        # prior_scale is the expected relative noise of a run: beta0 = alpha0 * scale^2
        self._b0 = self._a0 * float(prior_scale) ** 2
        self._m0: float | None = None  # prior mean: the first observation's log
        self.t = 0
        # Index r holds the hypothesis "run length r". Because folding keeps the shorter
        # run's statistics, kappa and alpha depend on r alone: precompute everything that
        # only depends on them, so an update touches two arrays (mu, beta) in place.
        r = np.arange(self._rmax + 2, dtype=float)
        kappa = self._k0 + r
        alpha = self._a0 + r / 2.0
        df = 2.0 * alpha
        self._scale_factor = (kappa + 1.0) / (alpha * kappa)  # scale^2 = beta * this
        self._df = df
        self._half_df1 = (df + 1.0) / 2.0
        self._const = gammaln((df + 1.0) / 2.0) - gammaln(df / 2.0) - 0.5 * np.log(df * math.pi)
        self._shrink = kappa / (kappa + 1.0)  # beta update weight
        self._inv_k1 = 1.0 / (kappa + 1.0)  # mean update weight
        self._n = 1  # live hypotheses: r = 0 .. n-1
        cap = self._rmax + 2
        self._logp = np.zeros(cap)
        self._mu = np.zeros(cap)
        self._beta = np.full(cap, self._b0)
        self._tmp = np.empty(cap)

    # -- posterior access ----------------------------------------------------------------
    @property
    def run_length_posterior(self) -> np.ndarray:
        """P(r_t = r | x_1..t) for r = 0 .. len-1 (the last entry is 'this long or longer')."""
        return np.exp(self._logp[: self._n])

    def recent_mass(self, window: int) -> float:
        """P(1 <= r_t <= window): the change signal, see the module docstring."""
        stop = min(window + 1, self._n)
        return float(np.exp(self._logp[1:stop]).sum())

    def recent_start(self, window: int) -> int | None:
        """Index (0-based, in update order) of the most probable recent run start."""
        stop = min(window + 1, self._n)
        if stop <= 1:
            return None
        r = int(np.argmax(self._logp[1:stop])) + 1
        return self.t - r

    def map_run_length(self) -> int:
        """The most probable run length now (iterations since the last change point)."""
        return int(np.argmax(self._logp[: self._n]))

    # -- update ----------------------------------------------------------------------------
    def update(self, value: float) -> None:
        """Absorb one positive observation (an iteration time in any unit)."""
        if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value > 0):
            raise ValueError(f"BOCD observations must be finite and > 0, got {value!r}")
        x = math.log(float(value))
        if self._m0 is None:
            self._m0 = x
            self._mu[0] = x
        n = self._n
        logp, mu, beta = self._logp[:n], self._mu[:n], self._beta[:n]
        d = x - mu
        d2 = d * d
        scale2 = beta * self._scale_factor[:n]
        pred = self._const[:n] - 0.5 * np.log(scale2)
        pred -= self._half_df1[:n] * np.log1p(d2 / (self._df[:n] * scale2))
        joint = logp + pred
        # Normalise by the evidence; since H + (1 - H) = 1 this is the new posterior's
        # normaliser too, and the change-point mass is exactly H (the pitfall, visibly).
        joint -= _logsumexp(joint)
        change = self._log_h
        # growth: hypothesis r becomes r + 1 (shift right by one), statistics absorb x
        shrink = self._shrink[:n]
        self._logp[1 : n + 1] = joint + self._log_1mh
        self._beta[1 : n + 1] = beta + shrink * d2 / 2.0
        self._mu[1 : n + 1] = mu + d * self._inv_k1[:n]
        self._logp[0] = change
        self._mu[0] = self._m0
        self._beta[0] = self._b0
        n += 1
        if n > self._rmax + 1:
            # fold the longest hypothesis into the next longest (keep the shorter window)
            self._logp[n - 2] = np.logaddexp(self._logp[n - 2], self._logp[n - 1])
            n -= 1
        self._n = n
        self.t += 1


def _logsumexp(a: np.ndarray) -> float:
    m = float(a.max())
    if m == -math.inf:
        return -math.inf
    return m + math.log(float(np.exp(a - m).sum()))
