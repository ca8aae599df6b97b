"""The statistics behind the verdict: an arm's repeats as a median with a 95% interval, and two
arms compared as a ratio with a 95% interval. Pure Python (math, statistics): no numpy, no
scipy.

- One arm: the median of its repeats, with the 95% Student-t interval of their geometric mean
  (exp(mean(log x) +- t(0.975, n-1) x s(log x) / sqrt(n))) when every value is positive, as
  rates, costs and device counts are: the bounds stay positive and match the ratio intervals
  below; of the plain mean otherwise. Error bars run from the median to the bounds, so they
  may be asymmetric.
- Two arms on a ratio metric (capacity, goodput, tokens/s): Welch's t-interval on the log
  values, exponentiated: the ratio of the geometric means with its 95% interval. Logs make a
  ratio symmetric (2x and 0.5x are equally far from 1x) and Welch does not assume the two
  arms are equally noisy; its degrees of freedom (Welch-Satterthwaite) are fractional.
- Two arms on a difference (accuracy points): Welch's t-interval on the raw values.
An interval that contains 1x (ratio) or 0 (difference) is a tie. With fewer than two runs on
a side there is no interval, and the functions say so instead of guessing one.

t quantiles: tabulated for df 1..30 (t(0.975), 4 decimals); a fractional df is interpolated
linearly between its neighbours; beyond 30 the Cornish-Fisher expansion of t around the normal
quantile (error below 1e-4 there), not the bare normal 1.96, which would narrow the interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

NO_INTERVAL = "one run each: no interval; use --repeat 3"
Z975 = 1.959963984540054
# t(0.975, df) for df = 1..30
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: float) -> float:
    """The two-sided 95% Student-t quantile for `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    if df > len(T975):
        z = Z975
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    lo = int(math.floor(df))
    if lo == df or lo == len(T975):
        return T975[lo - 1]
    return T975[lo - 1] + (df - lo) * (T975[lo] - T975[lo - 1])


@dataclass(frozen=True)
class Estimate:
    """An arm's repeats: median, 95% interval of the mean (None with fewer than 2), count."""
    median: float | None
    low: float | None
    high: float | None
    n: int

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def relative_half_width(self) -> float | None:
        """Half the interval's width over the median (the "+-4%" of a statement)."""
        if not self.has_interval or not self.median:
            return None
        return (self.high - self.low) / 2 / abs(self.median)


def estimate(values: list[float | None]) -> Estimate:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return Estimate(None, None, None, 0)
    med = statistics.median(xs)
    if len(xs) < 2:
        return Estimate(med, None, None, len(xs))
    positive = all(x > 0 for x in xs)
    ys = [math.log(x) for x in xs] if positive else xs
    mean = statistics.fmean(ys)
    half = t975(len(ys) - 1) * statistics.stdev(ys) / math.sqrt(len(ys))
    if positive:
        return Estimate(med, math.exp(mean - half), math.exp(mean + half), len(xs))
    return Estimate(med, mean - half, mean + half, len(xs))


@dataclass(frozen=True)
class Comparison:
    """a against b. ratio: point (ratio of geometric means, or of the single values); for a
    difference, `point` is the difference of means. low/high: the 95% interval, None without."""
    point: float | None
    low: float | None
    high: float | None
    n_a: int
    n_b: int
    df: float | None = None
    null: float = 1.0  # 1 for a ratio, 0 for a difference

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def tie(self) -> bool:
        """The interval contains the null (1x or 0). Without an interval: not decided (False)."""
        return self.has_interval and self.low <= self.null <= self.high

    @property
    def beyond_noise(self) -> bool:
        """a is larger than b beyond noise: the whole interval above the null."""
        return self.has_interval and self.low > self.null

    def why_no_interval(self) -> str:
        if self.has_interval:
            return ""
        if self.n_a < 2 and self.n_b < 2:
            return NO_INTERVAL
        return f"{min(self.n_a, self.n_b)} run on one side: no interval; use --repeat 3"


def _welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(mean a - mean b, standard error, Welch-Satterthwaite df)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return statistics.fmean(a) - statistics.fmean(b), 0.0, float(len(a) + len(b) - 2)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return statistics.fmean(a) - statistics.fmean(b), se, df


def ratio(a: list[float | None], b: list[float | None]) -> Comparison:
    """a / b with the 95% Welch interval on logs; no interval with fewer than 2 positive values
    a side. Point without an interval: ratio of the medians."""
    xa = [float(v) for v in a if v is not None]
    xb = [float(v) for v in b if v is not None]
    if not xa or not xb:
        return Comparison(None, None, None, len(xa), len(xb))
    ma, mb = statistics.median(xa), statistics.median(xb)
    point = ma / mb if mb else None
    if len(xa) < 2 or len(xb) < 2 or min(xa) <= 0 or min(xb) <= 0:
        return Comparison(point, None, None, len(xa), len(xb))
    d, se, df = _welch([math.log(x) for x in xa], [math.log(x) for x in xb])
    half = t975(max(df, 1.0)) * se
    return Comparison(math.exp(d), math.exp(d - half), math.exp(d + half), len(xa), len(xb), df)


def difference(a: list[float | None], b: list[float | None]) -> Comparison:
    """mean a - mean b with the 95% Welch interval; no interval with fewer than 2 values a side."""
    xa = [float(v) for v in a if v is not None]
    xb = [float(v) for v in b if v is not None]
    if not xa or not xb:
        return Comparison(None, None, None, len(xa), len(xb), null=0.0)
    if len(xa) < 2 or len(xb) < 2:
        return Comparison(statistics.median(xa) - statistics.median(xb), None, None, len(xa), len(xb), null=0.0)
    d, se, df = _welch(xa, xb)
    half = t975(max(df, 1.0)) * se
    return Comparison(d, d - half, d + half, len(xa), len(xb), df, null=0.0)


def spread(values: list[float | None]) -> float | None:
    """max / min of positive values: how far apart repeats of one configuration landed."""
    xs = [float(v) for v in values if v is not None]
    if len(xs) < 2:
        return None
    return max(xs) / min(xs) if min(xs) > 0 else math.inf
