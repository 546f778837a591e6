"""Reward functions by domain: registration by name, weighted combination, startup checks.

A reward function is `fn(record, completion) -> (score, info)`: `record` is the prompt record with
its verifier fields (`answer`, `tests`, `schema`, `tools`...), `completion` the generated text,
`info` a small picklable dict (extracted answer, failure reason; a function whose score is made
of named parts puts them in `info["components"]` as {name: value}, and RL logs each part's
mean per domain). A domain maps to one or more such functions with weights and scores their
weighted sum, so one RL run can mix many domains.

Functions are held as importable references ("package.module:function" strings or top-level
functions, which pickle by name), so a registry travels to `RewardPool` worker processes and
heavy verifiers (sympy, the code sandbox) are imported only where they run. A reference
"rm:<path>[#<head>]" is a trained reward model (`ModelReward`), a reference
"judge:<path>[?<options>]" a generative judge model (`JudgeReward`); `RewardPool` scores such
terms in its own process, batched, never in the workers.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import json
import math
import pickle
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from posttrain.rewards._judge import JudgeReward, check_judge_ref, is_judge_ref
from posttrain.rewards._model import ModelReward, check_model_ref, is_model_ref, parse_model_ref

RewardFn = Callable[[Mapping, str], tuple[float, dict]]


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function of a domain."""

    name: str  # key of this term's info in the domain's combined info
    fn: str | Callable  # "module:function" or a picklable callable
    weight: float  # multiplies the term's score in the domain's sum

    @property
    def is_model(self) -> bool:
        """Whether this term is a reward model ("rm:<path>") or a judge ("judge:<path>"), scored
        batched outside the workers."""
        return is_model_ref(self.fn) or is_judge_ref(self.fn)


class RewardRegistry:
    """Maps domain names to weighted reward functions.

    Example:
      registry = RewardRegistry()
      registry.register("math", "posttrain.rewards:math_reward")
      registry.register("math", format_reward, weight=0.1)
      registry.register("chat", "rm:/runs/rm/export")  # a trained reward model
      registry.check({r["domain"] for r in dataset})  # at startup: one error for all unknowns
      score, info = registry.score(record, completion)
    """

    def __init__(self):
        self._terms: dict[str, tuple[RewardTerm, ...]] = {}

    def register(
        self, domain: str, fn: str | Callable, *, weight: float = 1.0, name: str | None = None
    ) -> None:
        """Adds a reward function to a domain (a domain's score is the weighted sum of its terms).

        Args:
          domain: the name records carry in their "domain" field.
          fn: "package.module:function" (with options, "package.module:function?a=1&b=x",
            keyword arguments it is called with: JSON numbers and true/false, else text), or a
            top-level function (or a `functools.partial` of
            one): it must pickle by name to reach the worker processes. Or "rm:<path>" for a
            trained reward model's directory, "rm:<path>#<head>" to score with a given head
            (by default, the head named like the domain, else the model's only head). Or
            "judge:<path>[?<options>]" for a generative judge model (see `JudgeConfig`).
          weight: the term's weight in the domain's sum.
          name: the term's key in the combined info; defaults to the function's name ("rm", or
            "rm_<head>", for a reward model; "judge" for a judge).

        Raises:
          ValueError: a malformed reference, a reward model directory that does not exist, a
            callable that does not pickle (lambda, nested function), a non-finite weight or a
            term name the domain already has.
        """
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"a reward domain is a non-empty string, got {domain!r}")
        if not math.isfinite(weight):
            raise ValueError(f"reward weight for domain {domain!r} must be finite, got {weight}")
        if is_model_ref(fn):
            fn = check_model_ref(fn)
        elif is_judge_ref(fn):
            fn = check_judge_ref(fn)
        elif isinstance(fn, str):
            module, _, attr = fn.partition(":")
            if not module or not attr:
                raise ValueError(f"reward reference {fn!r} must read 'package.module:function'")
        elif callable(fn):
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"reward function {fn!r} for domain {domain!r} cannot be pickled to the "
                    f"worker processes ({e}); define it at module top level or register it as "
                    "a 'package.module:function' string"
                ) from e
        else:
            raise ValueError(f"reward function for domain {domain!r} must be callable, got {fn!r}")
        name = name or _fn_name(fn)
        terms = self._terms.get(domain, ())
        if any(t.name == name for t in terms):
            raise ValueError(f"domain {domain!r} already has a reward term named {name!r}")
        self._terms[domain] = (*terms, RewardTerm(name, fn, float(weight)))

    def domains(self) -> list[str]:
        """The registered domain names, sorted."""
        return sorted(self._terms)

    def terms(self, domain: str) -> tuple[RewardTerm, ...]:
        """The weighted terms of a domain."""
        self.check([domain], resolve=False)
        return self._terms[domain]

    def check(self, domains: Iterable[str], *, resolve: bool = True) -> None:
        """Fails early, with one message, for domains a run would meet but cannot score.

        Args:
          domains: the domains of the run's records (duplicates are fine).
          resolve: also import every function of those domains, so a broken reference fails
            here rather than in a worker mid-run; for "rm:" and "judge:" terms, load the model
            (once per process) and pick each domain's head.

        Raises:
          ValueError: names every unknown domain with its close matches and the registered ones,
            or every reference that does not import (or reward model that does not load or has
            no head for its domain).
        """
        unknown = sorted(set(domains) - set(self._terms))
        if unknown:
            hints = []
            for d in unknown:
                close = difflib.get_close_matches(str(d), self._terms, n=3, cutoff=0.6)
                hints.append(
                    f"{d!r} (did you mean {', '.join(map(repr, close))}?)" if close else repr(d)
                )
            raise ValueError(
                f"unknown reward domain(s): {', '.join(hints)}. Registered: "
                f"{', '.join(self.domains()) or 'none'}. Register them with "
                "registry.register(domain, fn) or fix the records' 'domain' field."
            )
        if not resolve:
            return
        broken = []
        for d in sorted(set(domains)):
            for t in self._terms[d]:
                try:
                    fn = resolve_fn(t.fn)
                    if t.is_model:
                        fn.check(d)
                except Exception as e:
                    broken.append(f"{d}/{t.name} ({t.fn!r}): {type(e).__name__}: {e}")
        if broken:
            raise ValueError("reward functions that do not import (or load): " + "; ".join(broken))

    def score(
        self,
        record: Mapping,
        completion: str,
        domain: str | None = None,
        *,
        model_terms: bool = True,
    ) -> tuple[float, dict]:
        """Scores one completion in this process: the weighted sum of its domain's terms.

        Args:
          record: the prompt record.
          completion: the generated text.
          domain: defaults to `record["domain"]`.
          model_terms: include the "rm:" and "judge:" terms; `RewardPool`'s workers leave them
            out (the pool scores them in its own process, batched).

        Returns:
          (score, info) with info = {term name: {"score": term score, **term info}}.

        Raises:
          ValueError: an unknown domain or a term that returns something other than
            (finite number, dict). Exceptions of the reward functions propagate.
        """
        domain = record_domain(record) if domain is None else domain
        total, info = 0.0, {}
        for t in self.terms(domain):
            if t.is_model:
                if not model_terms:
                    continue
                # With the head of `domain`, which may differ from the record's own field.
                out = resolve_fn(t.fn).score_batch([record], [completion], [domain])[0]
            else:
                out = resolve_fn(t.fn)(record, completion)
            score, term_info = check_output(t, out)
            total += t.weight * score
            info[t.name] = term_info
        return total, info

    def __repr__(self):
        return f"RewardRegistry({', '.join(self.domains())})"


def check_output(term: RewardTerm, out: object) -> tuple[float, dict]:
    """A term's (score, {"score": score, **info}) after checking what its function returned."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(f"reward {term.name!r} must return (score, info dict), got {out!r:.200}")
    score = float(out[0])
    if not math.isfinite(score):
        raise ValueError(f"reward {term.name!r} returned a non-finite score {score}")
    return score, {"score": score, **out[1]}


def record_domain(record: Mapping) -> str:
    """The "domain" field of a record, with a clear error where it is missing."""
    try:
        return record["domain"]
    except (KeyError, TypeError):
        raise ValueError(
            f"record has no 'domain' field to pick its reward: {record!r:.200}; add one or pass "
            "domains explicitly"
        ) from None


@functools.cache
def _resolve_ref(ref: str) -> Callable:
    if is_model_ref(ref):
        return ModelReward.from_ref(ref)
    if is_judge_ref(ref):
        return JudgeReward.from_ref(ref)
    ref, _, query = ref.partition("?")
    module, _, attr = ref.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{ref!r} is not callable")
    if not query:
        return fn
    options = {k: _option(v) for k, v in urllib.parse.parse_qsl(query, strict_parsing=True)}
    try:
        inspect.signature(fn).bind({}, "", **options)
    except TypeError as e:
        raise TypeError(f"{ref!r} takes no such options {sorted(options)} ({e})") from None
    return functools.partial(fn, **options)


def _option(value: str):
    """A reference option's value: a JSON number, true/false or null as such, else the text."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def resolve_fn(fn: str | Callable) -> Callable:
    """The callable behind a registered reference (imports its module on first use)."""
    return _resolve_ref(fn) if isinstance(fn, str) else fn


def _fn_name(fn: str | Callable) -> str:
    if is_model_ref(fn):
        head = parse_model_ref(fn)[1]
        return "rm" if head is None else f"rm_{head}"
    if is_judge_ref(fn):
        return "judge"
    if isinstance(fn, str):
        return fn.partition("?")[0].rpartition(":")[2].rpartition(".")[2]
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__name__", type(fn).__name__)


def default_registry() -> RewardRegistry:
    """A registry with the built-in domains.

    Domains: "math" (`math_reward`), "code" (`code_reward`, the sandboxed test runner),
    "code_quality" (`code_quality_reward`: the test pass rate with lint components),
    "format" (`format_reward`), "tool_call" (`tool_call_reward`), "extraction"
    (`extraction_reward`: JSON-schema validity and field F1), "grounded_qa"
    (`grounded_qa_reward`: answer F1 and cited spans), "cad" (`cad_reward`: a CAD script's part
    against a target) and "arithmetic" (the demo task).
    Each is registered by reference, so nothing heavy is imported until a domain is scored.
    """
    registry = RewardRegistry()
    registry.register("math", "posttrain.rewards._math:math_reward")
    registry.register("code", "posttrain.rewards._code:code_reward")
    registry.register("code_quality", "posttrain.rewards._code_quality:code_quality_reward")
    registry.register("format", "posttrain.rewards._format:format_reward")
    registry.register("tool_call", "posttrain.rewards._format:tool_call_reward")
    registry.register("extraction", "posttrain.rewards._extraction:extraction_reward")
    registry.register("grounded_qa", "posttrain.rewards._grounded:grounded_qa_reward")
    registry.register("arithmetic", "posttrain.rewards._arithmetic:arithmetic_reward")
    registry.register("cad", "posttrain.rewards._cad:cad_reward")
    return registry
