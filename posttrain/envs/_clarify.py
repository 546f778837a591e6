"""The `clarify` environment: a coding request with details left out, and a user who knows them.

Real requests are incomplete. Each task has a full specification (`spec`: the function, and the
facts that decide its behaviour) and the request the model is shown (`prompt`), which states
only some of the facts. A turn with a ```python block is the answer: its program runs against
the task's hidden tests in the sandbox and the episode ends. Any other turn is a question to
the user, who answers from the full specification: by default a scripted user (every fact whose
keywords the question names, or "I don't know" when it names none); with the option
`user="judge:<path>[?options]"` a generative model through the judge path (`USER_RUBRIC`: the
request, every fact, the question; its greedy answer is the reply). Either way a question costs
the same: which facts it names is read from its keywords.

The reward is the share of tests passed, less `question_cost` for each question and
`redundant_cost` more for a question whose every fact was already in the request (asking what
you were told earns nothing and costs more), floored at 0. So the model should ask for exactly
what it is missing, then write the code. Counts go to `Step.info` (`questions`,
`redundant_questions`: `episode/questions` in RL metrics).

`clarify_tasks(n, seed)` makes tasks from six families (clamping, price formatting, sorting
records, rounding, joining words, truncating text), each with its own hidden facts, tests and
reference solution; `posttrain/envs/assets/clarify.jsonl` is a small bundled set of them.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.envs._base import Environment, Step, prompt_messages, register_env

CLARIFY_SYSTEM = (
    "You write Python functions for a user. The request may leave details out: ask the user "
    "one short question at a time about what you need to know (without code), and when you "
    "know enough, answer with the function in a ```python block."
)
QUESTION_COST = 0.05
REDUNDANT_COST = 0.1
UNKNOWN = "I don't know; use your own judgement."
# A model user's prompt (str.format fields of the judge path): {prompt} the request as shown,
# {reference} every fact of the full specification, {completion} the question.
USER_RUBRIC = """\
You asked a programmer for a Python function:
{prompt}

What you know about it:
{reference}

The programmer asks: {completion}
Answer in one short sentence from what you know. If it does not say, answer: I don't know."""


@dataclasses.dataclass(frozen=True)
class Fact:
    """A detail of a task: what a question must mention to get it (`keywords`, any of them),
    how the request states it and how the user answers."""

    name: str
    keywords: tuple[str, ...]
    stated: str  # as the request says it, e.g. "Values below 0 become 0."
    answer: str  # as the user says it


@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    function: str
    request: str  # the request without any fact
    facts: Callable[[random.Random], tuple[dict, list[Fact]]]  # (values, facts)
    tests: Callable[[dict], list[str]]
    solution: Callable[[dict], str]


def _clamp(rng):
    lo, hi = rng.choice([(0, 10), (-5, 5), (1, 100), (0, 255)])
    return {"lower": lo, "upper": hi}, [
        Fact("lower", ("minimum", "lower", "min", "below", "smallest", "bound", "range"),
             f"Values below {lo} become {lo}.", f"The lower bound is {lo}."),
        Fact("upper", ("maximum", "upper", "max", "above", "largest", "bound", "range"),
             f"Values above {hi} become {hi}.", f"The upper bound is {hi}."),
    ]  # fmt: skip


def _price(rng):
    symbol = rng.choice(["€", "$", "£", "CHF "])
    separator = rng.choice([",", "."])
    return {"symbol": symbol, "separator": separator}, [
        Fact("symbol", ("currency", "symbol", "sign"),
             f"Prices start with {symbol!r}.", f"Use the currency symbol {symbol!r}."),
        Fact("separator", ("separator", "decimal", "comma", "point", "dot"),
             f"Cents follow a {separator!r}.", f"The decimal separator is {separator!r}."),
    ]  # fmt: skip


def _sort(rng):
    key = rng.choice(["age", "name", "score"])
    descending = rng.choice([True, False])
    order = "descending" if descending else "ascending"
    return {"key": key, "order": descending}, [
        Fact("key", ("key", "field", "by what", "which", "attribute", "column"),
             f"Sort by the {key!r} field.", f"Sort by the {key!r} field."),
        Fact("order", ("order", "descending", "ascending", "direction", "reverse"),
             f"The order is {order}.", f"In {order} order."),
    ]  # fmt: skip


def _round(rng):
    step = rng.choice([5, 10, 25, 100])
    mode = rng.choice(["down", "up"])
    return {"step": step, "mode": mode}, [
        Fact("step", ("multiple", "step", "nearest", "granularity", "increment"),
             f"Round to a multiple of {step}.", f"To a multiple of {step}."),
        Fact("mode", ("direction", "up", "down", "ceil", "floor", "how"),
             f"Always round {mode}.", f"Always round {mode}."),
    ]  # fmt: skip


def _join(rng):
    separator = rng.choice([" | ", ", ", "-", " / "])
    last = rng.choice([" and ", " or "])
    return {"separator": separator, "last": last}, [
        Fact("separator", ("separator", "between", "delimiter", "join"),
             f"Words are separated by {separator!r}.", f"Separate them with {separator!r}."),
        Fact("last", ("conjunction", "last", "final", "end"),
             f"The last two are joined by {last!r}.", f"The last two get {last!r}."),
    ]  # fmt: skip


def _truncate(rng):
    length = rng.choice([8, 10, 12, 16])
    suffix = rng.choice(["...", "~", " [cut]"])
    return {"length": length, "suffix": suffix}, [
        Fact("length", ("length", "long", "characters", "limit", "how many", "size"),
             f"At most {length} characters in all.", f"At most {length} characters."),
        Fact("suffix", ("suffix", "end", "marker", "ellipsis", "indicate"),
             f"A cut text ends with {suffix!r}.", f"End a cut text with {suffix!r}."),
    ]  # fmt: skip


def _price_code(v):
    return (
        "def format_price(cents):\n"
        "    whole, rest = divmod(cents, 100)\n"
        f"    return {v['symbol']!r} + str(whole) + {v['separator']!r} + f'{{rest:02d}}'\n"
    )


def _join_code(v):
    return (
        "def join_words(words):\n"
        "    if len(words) < 2:\n"
        "        return ''.join(words)\n"
        f"    return {v['separator']!r}.join(words[:-1]) + {v['last']!r} + words[-1]\n"
    )


def _round_code(v):
    op = "math.floor" if v["mode"] == "down" else "math.ceil"
    return f"import math\n\n\ndef round_to(x):\n    return {op}(x / {v['step']}) * {v['step']}\n"


def _truncate_code(v):
    return (
        "def truncate(text):\n"
        f"    if len(text) <= {v['length']}:\n"
        "        return text\n"
        f"    return text[: {v['length']} - {len(v['suffix'])}] + {v['suffix']!r}\n"
    )


def _truncate_expected(v, text):
    n, s = v["length"], v["suffix"]
    return text if len(text) <= n else text[: n - len(s)] + s


def _round_expected(v, x):
    import math

    op = math.floor if v["mode"] == "down" else math.ceil
    return op(x / v["step"]) * v["step"]


def _join_expected(v, words):
    if len(words) < 2:
        return "".join(words)
    return v["separator"].join(words[:-1]) + v["last"] + words[-1]


_PEOPLE = [
    {"name": "Ada", "age": 36, "score": 7},
    {"name": "Bo", "age": 19, "score": 9},
    {"name": "Cy", "age": 52, "score": 3},
    {"name": "Di", "age": 27, "score": 5},
]

FAMILIES = (
    _Family(
        "clamp", "clamp_all", "Write a Python function `clamp_all(values)` that clamps every "
        "number of a list into a range and returns the new list.", _clamp,
        lambda v: [f"assert clamp_all([{v['lower'] - 3}, {v['upper'] + 7}]) == [{v['lower']}, "
                   f"{v['upper']}]", f"assert clamp_all([{v['lower'] + 1}]) == [{v['lower'] + 1}]",
                   "assert clamp_all([]) == []"],
        lambda v: (f"def clamp_all(values):\n    return [min(max(x, {v['lower']}), {v['upper']}) "
                   "for x in values]\n"),
    ),
    _Family(
        "price", "format_price", "Write a Python function `format_price(cents)` that formats "
        "an amount given in cents (an int) as a price string.", _price,
        lambda v: [f"assert format_price(1999) == {v['symbol'] + '19' + v['separator'] + '99'!r}",
                   f"assert format_price(5) == {v['symbol'] + '0' + v['separator'] + '05'!r}",
                   f"assert format_price(100) == {v['symbol'] + '1' + v['separator'] + '00'!r}"],
        _price_code,
    ),
    _Family(
        "sort", "sort_people", "Write a Python function `sort_people(people)` that sorts a "
        "list of dicts with 'name', 'age' and 'score' and returns the sorted list.", _sort,
        lambda v: [f"assert [p['name'] for p in sort_people({_PEOPLE!r})] == "
                   f"{[p['name'] for p in sorted(_PEOPLE, key=lambda p: p[v['key']], reverse=v['order'])]!r}",  # noqa: E501
                   "assert sort_people([]) == []"],
        lambda v: (f"def sort_people(people):\n    return sorted(people, key=lambda p: "
                   f"p[{v['key']!r}], reverse={v['order']})\n"),
    ),
    _Family(
        "round", "round_to", "Write a Python function `round_to(x)` that rounds a number.",
        _round,
        lambda v: [f"assert round_to({x}) == {_round_expected(v, x)}" for x in (7, 23, 101, 250)],
        _round_code,
    ),
    _Family(
        "join", "join_words", "Write a Python function `join_words(words)` that joins a list "
        "of words into one readable string.", _join,
        lambda v: [f"assert join_words({w!r}) == {_join_expected(v, w)!r}"
                   for w in (["a", "b", "c"], ["x", "y"], ["solo"])],
        _join_code,
    ),
    _Family(
        "truncate", "truncate", "Write a Python function `truncate(text)` that shortens long "
        "texts.", _truncate,
        lambda v: [f"assert truncate({t!r}) == {_truncate_expected(v, t)!r}"
                   for t in ("short", "a rather long sentence indeed", "0123456789abcdefghij")],
        _truncate_code,
    ),
)  # fmt: skip
_BY_NAME = {f.name: f for f in FAMILIES}


def clarify_tasks(n: int, seed: int = 0, *, shown: float = 0.5) -> list[dict]:
    """`n` clarify task records: each family in turn, its facts drawn from `seed`, each fact
    stated in the request with probability `shown` (at least one always hidden).

    A record: {"prompt", "spec": {"family", "function", "values", "facts": [{name, keywords,
    stated, answer, shown}]}, "asserts" (the hidden tests), "solution" (a reference program),
    "domain": "clarify"}.
    """
    rng = random.Random(seed)
    records = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        values, facts = family.facts(rng)
        shown_flags = [rng.random() < shown for _ in facts]
        if all(shown_flags):
            shown_flags[rng.randrange(len(facts))] = False
        request = " ".join(
            [family.request, *(f.stated for f, s in zip(facts, shown_flags, strict=True) if s)]
        )
        records.append({
            "prompt": request,
            "spec": {"family": family.name, "function": family.function, "values": values,
                     "facts": [{**dataclasses.asdict(f), "keywords": list(f.keywords),
                                "shown": s} for f, s in zip(facts, shown_flags, strict=True)]},
            "asserts": family.tests(values),
            "solution": family.solution(values),
            "domain": "clarify",
        })  # fmt: skip
    return records


def answer(spec: Mapping[str, Any], question: str) -> tuple[str, list[dict]]:
    """The scripted user's answer to `question`, and the facts it names."""
    text = question.lower()
    named = [f for f in spec["facts"] if any(_mentions(text, k) for k in f["keywords"])]
    if not named:
        return UNKNOWN, []
    return " ".join(f["answer"] for f in named), named


def _mentions(text: str, keyword: str) -> bool:
    return re.search(rf"(?<![a-z]){re.escape(keyword)}(?![a-z])", text) is not None


class ClarifyEnvironment(Environment):
    """A clarify episode (module docstring)."""

    def __init__(self, record: Mapping[str, Any], *, question_cost: float = QUESTION_COST,
                 redundant_cost: float = REDUNDANT_COST, system: str = CLARIFY_SYSTEM,
                 timeout_s: float = 5.0, user: str = "scripted"):  # fmt: skip
        from posttrain.rewards import is_judge_ref

        super().__init__(record)
        if "spec" not in record or "asserts" not in record:
            raise ValueError(
                "a clarify record needs 'spec' (its facts) and 'asserts' (hidden tests); make "
                "them with posttrain.envs.clarify_tasks"
            )
        if user != "scripted" and not is_judge_ref(user):
            raise ValueError(
                f"clarify: user={user!r}; use 'scripted' or a model through the judge path, "
                "'judge:<model path>[?options]' (docs/agents.md)"
            )
        self.user = None if user == "scripted" else _model_user(user)
        self.question_cost, self.redundant_cost = question_cost, redundant_cost
        self.system, self.timeout_s = system, timeout_s
        self.questions = self.redundant = 0

    def reset(self) -> list[dict]:
        self.questions = self.redundant = 0
        return prompt_messages(self.record, self.system)

    def step(self, message: dict) -> Step:
        from posttrain.rewards import code_reward, extract_code

        content = str(message.get("content") or "")
        if extract_code(content) is None:  # a question
            reply, named = answer(self.record["spec"], content)
            if self.user is not None:
                reply = self.model_reply(content)
            self.questions += 1
            redundant = bool(named) and all(f["shown"] for f in named)
            self.redundant += redundant
            info = {"questions": 1, "redundant_questions": int(redundant)}
            return Step([{"role": "user", "content": reply}], None, False, info)
        record = {"asserts": self.record["asserts"], "timeout_s": self.timeout_s}
        passed, _ = code_reward(record, content)
        cost = self.questions * self.question_cost + self.redundant * self.redundant_cost
        info = {"questions": 0, "redundant_questions": 0, "tests_passed": passed}
        return Step([], max(0.0, passed - cost), True, info)

    def user_prompt(self, question: str) -> str:
        """What a model user reads (its rubric, `USER_RUBRIC` by default): the request as shown,
        every fact of the full specification, and `question`."""
        facts = " ".join(f["answer"] for f in self.record["spec"]["facts"])
        known = {"prompt": self.record["prompt"], "reference": facts}
        return self.user.judge_prompt(known, question)

    def model_reply(self, question: str) -> str:
        """The model user's greedy answer to `question` (`UNKNOWN` when it writes nothing, or
        its prompt does not fit the model's context)."""
        text = self.user.answers([self.user_prompt(question)])[0]
        return (text or "").strip() or UNKNOWN


@functools.cache
def _model_user(ref: str):
    """The judge-path model behind `user=ref`, one per reference and process (its weights load
    once, on the first question)."""
    from posttrain.rewards import JudgeReward

    return JudgeReward.from_ref(ref, default_rubric=USER_RUBRIC)


def clarify_env(record: Mapping[str, Any], **options: Any) -> ClarifyEnvironment:
    return ClarifyEnvironment(record, **options)


def scripted_turns(record: Mapping[str, Any], ask: Sequence[str] | str) -> list[str]:
    """The turns of a scripted policy on `record`: a question per fact named in `ask` ("hidden":
    the facts the request leaves out, "all": every fact, or a list of names), then the
    reference solution with what the answers said (the code is right only when every hidden
    fact was asked). For tests, and for SFT trajectories that ask before they code."""
    facts = record["spec"]["facts"]
    if ask == "hidden":
        chosen = [f for f in facts if not f["shown"]]
    elif ask == "all":
        chosen = list(facts)
    else:
        chosen = [f for f in facts if f["name"] in ask]
    turns = [f"What is the {f['keywords'][0]}?" for f in chosen]
    known = {f["name"] for f in facts if f["shown"]} | {f["name"] for f in chosen}
    family = _BY_NAME[record["spec"]["family"]]
    values = dict(record["spec"]["values"])
    if known != {f["name"] for f in facts}:  # a guess for what was never learnt
        values = _guess(family, values, {f["name"] for f in facts} - known)
    return [*turns, f"```python\n{family.solution(values)}```"]


def _guess(family: _Family, values: dict, unknown: set[str]) -> dict:
    """`values` with the unknown facts' values taken from another draw of the family where it
    differs (a guess: what a policy that never asked would write)."""
    for seed in range(100):
        other, _ = family.facts(random.Random(seed))
        guessed = {**values, **{k: other[k] for k in unknown}}
        if all(guessed[k] != values[k] for k in unknown):
            return guessed
    raise AssertionError(f"no other draw of {family.name} differs in {sorted(unknown)}")


def clarify_episode(record: dict, *, ask: bool) -> dict:
    """The SFT record of a scripted episode: the hidden facts asked for, then the right code
    (`ask`), or the code at once with guesses for them."""
    messages = [{"role": "system", "content": CLARIFY_SYSTEM},
                {"role": "user", "content": record["prompt"]}]  # fmt: skip
    turns = scripted_turns(record, "hidden" if ask else [])
    for turn in turns[:-1]:
        messages += [{"role": "assistant", "content": turn},
                     {"role": "user", "content": answer(record["spec"], turn)[0]}]  # fmt: skip
    return {"messages": [*messages, {"role": "assistant", "content": turns[-1]}]}


register_env("clarify", clarify_env, rewards=True)
