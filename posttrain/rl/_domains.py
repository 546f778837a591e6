"""Per-domain handling of a step's rollout batch (grouped domain updates: per-domain advantage
normalisation and learning-rate scales) and the stability monitor that watches the run's curves
for entropy collapse and runaway KL."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)


def normalise_by_domain(
    advantages: np.ndarray, domain_ids: np.ndarray, mask: np.ndarray, eps: float = 1e-6
) -> np.ndarray:
    """Each domain's advantages divided by their standard deviation over the batch (over its
    rows for `[B]` advantages, over its trained tokens for `[B, L]`); rows of other domains
    and fillers (domain -1) unchanged. Domains whose advantages are all 0 stay 0."""
    out = np.array(advantages, np.float32)
    for d in np.unique(domain_ids[domain_ids >= 0]):
        rows = domain_ids == d
        if out.ndim == 1:
            values = out[rows]
        else:
            values = out[rows][mask[rows] > 0]
        std = float(values.std()) if values.size else 0.0
        out[rows] = out[rows] / (std + eps) if std > 0 else out[rows]
    return out


def update_scales(domain_ids: np.ndarray, domains: Sequence[str], lr_scale: dict) -> np.ndarray:
    """Per row, its domain's learning-rate multiplier (`domains.lr_scale`, default 1); filler
    rows get the mean of the real rows', so the batch mean that `train_step` applies is the
    real rows' mean (a grouped step: its domain's multiplier)."""
    table = np.asarray([float(lr_scale.get(d, 1.0)) for d in domains], np.float32)
    real = domain_ids >= 0
    scales = np.ones(len(domain_ids), np.float32)
    scales[real] = table[domain_ids[real]]
    scales[~real] = scales[real].mean() if real.any() else 1.0
    return scales


class StabilityMonitor:
    """Watches a run's metrics and warns (once per episode, with hysteresis) when the policy's
    entropy collapses or its KL runs away.

    - entropy collapse: entropy below `entropy_collapse` x the mean of the first `warmup`
      steps' entropy (a policy that stopped exploring; GRPO's failure mode on easy data);
    - KL runaway: the mean KL to the reference (or, without one, the old-policy KL of the
      update, `approx_kl_old`) above `kl_max`.

    `__call__(step, metrics)` returns alert metrics (`alert/entropy_collapse`,
    `alert/kl_runaway`: 1.0 while the condition holds, else 0.0) to log with the step's.
    """

    def __init__(self, entropy_collapse: float = 0.1, kl_max: float = 0.0, warmup: int = 3):
        self.entropy_collapse, self.kl_max, self.warmup = entropy_collapse, kl_max, warmup
        self._start: list[float] = []
        self._active: dict[str, bool] = {}

    def __call__(self, step: int, metrics: dict) -> dict[str, float]:
        out = {}
        entropy = metrics.get("entropy")
        if self.entropy_collapse > 0 and entropy is not None and np.isfinite(entropy):
            if len(self._start) < self.warmup:
                self._start.append(float(entropy))
            else:
                floor = self.entropy_collapse * float(np.mean(self._start))
                out["alert/entropy_collapse"] = self._flag(
                    "entropy_collapse",
                    entropy < floor,
                    step,
                    f"entropy {entropy:.4g} fell below {self.entropy_collapse} x its starting "
                    f"{np.mean(self._start):.4g}: the policy stopped exploring (raise "
                    "loss.entropy_coef or the temperature, add KL, or check for easy data)",
                )
        kl = metrics.get("kl", metrics.get("approx_kl_old"))
        if self.kl_max > 0 and kl is not None and np.isfinite(kl):
            out["alert/kl_runaway"] = self._flag(
                "kl_runaway",
                kl > self.kl_max,
                step,
                f"KL {kl:.4g} is above monitor.kl_max={self.kl_max}: the policy is running "
                "away (lower the learning rate, raise kl.coef or set kl.target)",
            )
        return out

    def _flag(self, name: str, bad: bool, step: int, message: str) -> float:
        if bad and not self._active.get(name):
            log.warning("step %d: %s", step, message)
        self._active[name] = bool(bad)
        return float(bad)
