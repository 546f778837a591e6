"""Reward components over scored completions: the named parts a reward function reports in
`info["components"]` (the CAD reward's `iou`, the code quality reward's lint groups), summed per
domain as results arrive and averaged for the metrics (RL's `reward_parts/<domain>/<name>`, the
eval suite's `target/<task>/reward_parts/...`), with the share of completions whose reward
failed (`reward_errors`)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_WARNED: set[tuple[str, str]] = set()


def tally_components(totals: dict, results) -> None:
    """Adds the reward components of scored completions (a term's `info["components"]`) to
    running sums in `totals`: `reward_parts/<domain>/<name>` and its count under `n:`; and
    `reward_errors`, the share of completions whose reward function raised or timed out (they
    score 0), with a warning naming the first error of each kind per domain."""
    for res in results:
        failed = res.status != "ok"
        totals["reward_errors"] = totals.get("reward_errors", 0.0) + float(failed)
        totals["n:reward_errors"] = totals.get("n:reward_errors", 0) + 1
        error = str(res.info.get("error", res.status)) if failed else ""
        if failed and (res.domain, error.split(":")[0]) not in _WARNED:
            _WARNED.add((res.domain, error.split(":")[0]))
            log.warning(
                "a reward of domain %r failed (%s): %s; such completions score 0 and are "
                "counted in the reward_errors metric. Check the domain's reward functions "
                "(they must return (score, info dict)).",
                res.domain,
                res.status,
                error[:500],
            )
        for term in res.info.values() if res.status == "ok" else ():
            parts = term.get("components") if isinstance(term, dict) else None
            for name, value in (parts or {}).items():
                key = f"reward_parts/{res.domain}/{name}"
                totals[key] = totals.get(key, 0.0) + float(value)
                totals[f"n:{key}"] = totals.get(f"n:{key}", 0) + 1


def component_means(totals: dict) -> dict:
    """`totals` with each tallied reward component's sum made its mean (counts dropped)."""
    return {
        k: v / totals[f"n:{k}"] if f"n:{k}" in totals else v
        for k, v in totals.items()
        if not k.startswith("n:")
    }
