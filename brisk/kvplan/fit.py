"""Fit request lengths with a truncated lognormal (the article's model) by maximum
likelihood, and report goodness of fit (Kolmogorov–Smirnov) beside the empirical figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats


@dataclass(frozen=True)
class LengthFit:
    mu: float  # of log(length)
    sigma: float
    low: float  # truncation bounds (lengths)
    high: float
    n: int
    ks_statistic: float
    ks_pvalue: float
    empirical: dict[str, float]

    def _bounds(self) -> tuple[float, float]:
        return (math.log(self.low) - self.mu) / self.sigma, (math.log(self.high) - self.mu) / self.sigma

    def cdf(self, x):
        a, b = self._bounds()
        z = (np.log(np.maximum(np.asarray(x, dtype=float), 1e-12)) - self.mu) / self.sigma
        za, zb = stats.norm.cdf(a), stats.norm.cdf(b)
        return np.clip((stats.norm.cdf(z) - za) / (zb - za), 0.0, 1.0)

    def pdf(self, x):
        a, b = self._bounds()
        x = np.asarray(x, dtype=float)
        inside = (x >= self.low) & (x <= self.high)
        dens = stats.lognorm.pdf(x, s=self.sigma, scale=math.exp(self.mu)) / (stats.norm.cdf(b) - stats.norm.cdf(a))
        return np.where(inside, dens, 0.0)

    def quantile(self, q: float) -> float:
        a, b = self._bounds()
        za, zb = stats.norm.cdf(a), stats.norm.cdf(b)
        return float(math.exp(self.mu + self.sigma * stats.norm.ppf(za + q * (zb - za))))

    def mean(self) -> float:
        a, b = self._bounds()
        # E[e^Y] for Y ~ N(mu, sigma) truncated to [a, b] (standardised bounds)
        num = stats.norm.cdf(b - self.sigma) - stats.norm.cdf(a - self.sigma)
        return float(math.exp(self.mu + self.sigma ** 2 / 2) * num / (stats.norm.cdf(b) - stats.norm.cdf(a)))

    def to_dict(self) -> dict:
        return {"distribution": "truncated_lognormal", "mu": self.mu, "sigma": self.sigma, "low": self.low,
                "high": self.high, "n": self.n, "fitted_mean": self.mean(),
                "fitted_p50": self.quantile(0.5), "fitted_p90": self.quantile(0.9), "fitted_p99": self.quantile(0.99),
                "ks_statistic": self.ks_statistic, "ks_pvalue": self.ks_pvalue, "empirical": self.empirical}


def empirical_summary(values) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "min": float(v.min()), "max": float(v.max())}


def fit_truncated_lognormal(values, low: float | None = None, high: float | None = None) -> LengthFit:
    x = np.asarray(values, dtype=float)
    if x.size < 2 or np.any(x <= 0):
        raise ValueError("need at least two positive lengths to fit")
    low = float(low if low is not None else x.min())
    high = float(high if high is not None else x.max())
    if x.min() == x.max():  # one length only: a degenerate (very narrow) distribution
        low, high = x.min() * 0.999, x.max() * 1.001
    y = np.log(x)
    log_low, log_high = math.log(low), math.log(high)

    def nll(params):
        mu, log_sigma = params
        sigma = math.exp(log_sigma)
        mass = stats.norm.cdf((log_high - mu) / sigma) - stats.norm.cdf((log_low - mu) / sigma)
        if mass <= 1e-300:
            return 1e300
        return -(stats.norm.logpdf(y, mu, sigma).sum() - y.size * math.log(mass))

    if x.min() == x.max():  # nothing to fit (the optimiser would chase sigma -> 0 for thousands of steps)
        fit = LengthFit(float(y[0]), 1e-3, low, high, int(x.size), 0.0, 1.0, empirical_summary(x))
        return fit
    start = [float(y.mean()), math.log(max(float(y.std()), 1e-3))]
    # Bounded: with a few lengths the truncated likelihood is flat, and mu would otherwise wander
    # off to where exp(mu) overflows.
    bounds = [(log_low - 3.0, log_high + 3.0), (math.log(1e-3), math.log(10.0))]
    start = [min(max(start[0], bounds[0][0]), bounds[0][1]), min(max(start[1], bounds[1][0]), bounds[1][1])]
    result = optimize.minimize(nll, start, method="Nelder-Mead", bounds=bounds,
                               options={"xatol": 1e-6, "fatol": 1e-8, "maxiter": 4000})
    mu, sigma = float(result.x[0]), float(math.exp(result.x[1]))
    fit = LengthFit(mu, sigma, low, high, int(x.size), 0.0, 1.0, empirical_summary(x))
    ks = stats.kstest(x, fit.cdf)
    return LengthFit(mu, sigma, low, high, int(x.size), float(ks.statistic), float(ks.pvalue), fit.empirical)
