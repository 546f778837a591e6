"""A generative model as a reward function: the `"judge:<path>[?<options>]"` registry terms.

A judge model reads a rubric prompt holding the task, the completion and the record's
reference answer, and writes a grade ("Score: 7"); the reward is that grade over `max_score`,
in [0, 1]. Like the `"rm:"` reward models, judge terms are scored in the trainer's process
(never in `RewardPool`'s workers, each of which would load the model), and one scoring call
grades all its completions in one call of the generation engine (greedy, continuous batching).

Grades are cached: an LRU keyed by the SHA-256 of the rendered judge prompt, so the same
(prompt, completion, reference) under the same rubric is never graded twice in a process.
An answer without a score in [0, max_score] (or a judge prompt too long for the judge's
context) scores `failure_reward` and is counted: `info["judge_parse_failure"]` per completion,
`JudgeReward.metrics()` in total and `rewards/<domain>/judge_parse_failures` in the pool's.

Options follow the path as a query string, percent-encoded where a value holds `&`, `=` or `#`:

    judge:/models/judge?rubric=/rubrics/helpful.txt&max_new_tokens=16&pattern=Grade%3A%20(%5Cd%2B)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import math
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence

from posttrain import paths

PREFIX = "judge:"

# The rubric when a reference names none: str.format fields {prompt}, {completion}, {reference}.
DEFAULT_RUBRIC = """\
You are grading a response to a task.

Task:
{prompt}

Reference answer (may be empty):
{reference}

Response:
{completion}

Rate the response from 0 (wrong or unhelpful) to 10 (correct, complete and well written). \
Reply with one line: "Score: <0-10>"."""
FIELDS = ("prompt", "completion", "reference")
JINJA_SUFFIXES = (".j2", ".jinja", ".jinja2")


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A judge reference's path and options (each option is a field)."""

    path: str  # the judge model: an HF model directory or a posttrain training workdir
    rubric: str = ""  # rubric file (str.format, or jinja2 for .j2/.jinja); "": the default
    pattern: str = r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"  # the grade: group 1, last match, no case
    max_score: float = 10.0  # a grade in [0, max_score] scores grade / max_score
    failure_reward: float = 0.0  # the score of an answer without a valid grade
    max_new_tokens: int = 32  # tokens the judge may write
    max_len: int = 4096  # judge prompt + answer tokens (capped by the model's max_seq_len)
    chat: str = "auto"  # render as a user turn: "auto" (if the tokenizer has a template), yes, no
    slots: int = 16  # sequences the engine decodes together
    cache_size: int = 65536  # graded (prompt, completion) pairs kept (0: no cache)

    def __post_init__(self):
        where = f"judge {self.path!r}"
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ValueError(f"{where}: pattern {self.pattern!r} is not a regex: {e}") from None
        if groups > 1:
            raise ValueError(f"{where}: pattern {self.pattern!r} has {groups} groups; use one")
        if not (math.isfinite(self.max_score) and self.max_score > 0):
            raise ValueError(f"{where}: max_score must be a positive number, got {self.max_score}")
        if not math.isfinite(self.failure_reward):
            raise ValueError(f"{where}: failure_reward must be finite, got {self.failure_reward}")
        if self.chat not in ("auto", "yes", "no"):
            raise ValueError(f"{where}: chat={self.chat!r}; use auto, yes or no")
        sizes = {k: getattr(self, k) for k in ("max_new_tokens", "max_len", "slots", "cache_size")}
        if bad := {k: v for k, v in sizes.items() if v < (k != "cache_size")}:
            raise ValueError(f"{where}: {bad} too small; cache_size >= 0, the others >= 1")


def is_judge_ref(fn: object) -> bool:
    """Whether a registered reward reference names a judge model ("judge:<path>[?<options>]")."""
    return isinstance(fn, str) and fn.startswith(PREFIX)


def parse_judge_ref(ref: str) -> JudgeConfig:
    """The `JudgeConfig` of a "judge:<path>[?k=v&...]" reference (the path made absolute).

    Raises:
      ValueError: no path, an unknown or repeated option, or a value of the wrong type.
    """
    if not is_judge_ref(ref):
        raise ValueError(f"a judge reference reads 'judge:<path>[?k=v&...]', got {ref!r}")
    path, _, query = ref[len(PREFIX) :].partition("?")
    if not path:
        raise ValueError(f"judge reference {ref!r} has no path; write 'judge:<path>'")
    fields = {f.name: f for f in dataclasses.fields(JudgeConfig) if f.name != "path"}
    options: dict[str, object] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key not in fields:
            raise ValueError(
                f"judge reference {ref!r}: unknown option {key!r}; options: {', '.join(fields)}"
            )
        if key in options:
            raise ValueError(f"judge reference {ref!r} sets {key!r} twice")
        kind = type(fields[key].default)
        try:
            options[key] = kind(value)
        except ValueError:
            raise ValueError(
                f"judge reference {ref!r}: {key}={value!r} is not a {kind.__name__}"
            ) from None
    if options.get("rubric"):
        options["rubric"] = str(paths.path(options["rubric"]))
    return JudgeConfig(path=str(paths.path(path)), **options)


def check_judge_ref(ref: str) -> str:
    """The normalised form of a judge reference (absolute paths, the options that differ from
    their defaults), after checking them and that its directory and rubric exist.

    Raises:
      ValueError: a malformed reference, a missing directory or rubric file.
    """
    config = parse_judge_ref(ref)
    if not paths.path(config.path).is_dir():
        raise ValueError(
            f"judge model directory {config.path!r} (from {ref!r}) does not exist; point "
            "'judge:<path>' at an HF model directory or a training workdir"
        )
    if config.rubric and not paths.path(config.rubric).is_file():
        raise ValueError(f"judge rubric {config.rubric!r} (from {ref!r}) is not a file")
    options = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(JudgeConfig)
        if f.name != "path" and getattr(config, f.name) != f.default
    }
    query = urllib.parse.urlencode(options, safe="/")
    return PREFIX + config.path + (f"?{query}" if query else "")


def load_rubric(file: str, default: str = DEFAULT_RUBRIC) -> Callable[[Mapping], str]:
    """`render(fields) -> judge prompt` of a rubric file ("": `default`), checked on dummy fields.

    Files ending in .j2/.jinja/.jinja2 are jinja2 templates (`{{ completion }}`), any other
    str.format templates (`{completion}`; literal braces doubled).

    Raises:
      ValueError: a template that names a field other than prompt, completion and reference.
    """
    text = paths.path(file).read_text() if file else default
    if file.endswith(JINJA_SUFFIXES):
        import jinja2

        template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text)
        render = template.render
    else:
        render = text.format_map
    try:
        render({k: "" for k in FIELDS})
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(
            f"rubric {file or '(default)'} uses a field other than {', '.join(FIELDS)} or has "
            f"unbalanced braces ({type(e).__name__}: {e}); in str.format rubrics, double "
            "literal braces"
        ) from None
    except Exception as e:  # jinja2's UndefinedError and TemplateSyntaxError
        raise ValueError(f"rubric {file}: {type(e).__name__}: {e}") from None
    return render


class JudgeReward:
    """Grades completions with a generative judge model through the generation engine.

    The judge prompt of a record is the rubric with {prompt} (the record's prompt; chat
    messages as "role: content" lines), {completion} and {reference} (the record's
    "reference", else "answer", else ""), rendered as a user turn when the judge's tokenizer
    has a chat template (option chat).
    """

    def __init__(self, config: JudgeConfig, default_rubric: str = DEFAULT_RUBRIC):
        self.config = config
        self.render = load_rubric(config.rubric, default_rubric)
        self.pattern = re.compile(config.pattern, re.IGNORECASE)
        self._cache: collections.OrderedDict[str, tuple[float, dict]] = collections.OrderedDict()
        self.totals = collections.Counter()

    @classmethod
    def from_ref(cls, ref: str, default_rubric: str = DEFAULT_RUBRIC) -> JudgeReward:
        """The `JudgeReward` of a "judge:" reference; `default_rubric` where it names none."""
        return cls(parse_judge_ref(ref), default_rubric)

    def __call__(self, record: Mapping, completion: str) -> tuple[float, dict]:
        """Grades one completion."""
        return self.score_batch([record], [completion], [None])[0]

    def check(self, domain: str | None = None) -> None:
        """Loads the judge model (once per process), so a broken one fails at startup."""
        _load(self.config.path)

    def score_batch(
        self,
        records: Sequence[Mapping],
        completions: Sequence[str],
        domains: Sequence[str | None] = (),
    ) -> list[tuple[float, dict]]:
        """Grades many completions: the uncached ones in one greedy engine call.

        Args:
          records: prompt records; each needs a "prompt" (a string or chat messages).
          completions: one generated text per record.
          domains: unused (one judge grades every domain alike); kept for the "rm:" interface.

        Returns:
          One (score, info) per record, in input order; info holds the judge's answer
          ("judge_answer"), its grade ("judge_grade", None if unparsable),
          "judge_parse_failure" and "judge_cached".

        Raises:
          ValueError: mismatched lengths or a record without a prompt.
        """
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        prompts = [self.judge_prompt(r, c) for r, c in zip(records, completions, strict=True)]
        keys = [hashlib.sha256(p.encode()).hexdigest() for p in prompts]
        todo = {k: p for k, p in zip(keys, prompts, strict=True) if k not in self._cache}
        graded = dict(zip(todo, self._grade(list(todo.values())), strict=True))
        # Every result read before `_remember` may evict a cached one.
        found = {k: graded[k] if k in graded else self._cache[k] for k in keys}
        out, seen = [], set()
        for k in keys:
            cached = k not in graded or k in seen  # a pair's repeats in a batch are hits too
            if k not in seen:
                seen.add(k)
                self._remember(k, found[k])
            score, info = found[k]
            out.append((score, {**info, "judge_cached": cached}))
            self.totals["judge_cache_hits" if cached else "judge_graded"] += 1
            self.totals["judge_parse_failures"] += info["judge_parse_failure"]
        return out

    def _remember(self, key: str, result: tuple[float, dict]) -> None:
        """Caches a grade as the most recent, dropping the oldest beyond `cache_size`."""
        self._cache[key] = result
        self._cache.move_to_end(key)
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    def judge_prompt(self, record: Mapping, completion: str) -> str:
        """The rubric rendered for one (record, completion)."""
        return self.render(
            {
                "prompt": _prompt_text(record),
                "completion": completion,
                "reference": _reference_text(record),
            }
        )

    def parse(self, answer: str) -> float | None:
        """The grade in a judge's answer (the pattern's last match), None unless in range."""
        matches = list(self.pattern.finditer(answer))
        if not matches:
            return None
        try:
            grade = float(matches[-1].group(1 if self.pattern.groups else 0))
        except ValueError:
            return None
        return grade if 0 <= grade <= self.config.max_score else None

    def metrics(self, *, reset: bool = False) -> dict[str, float]:
        """Completions graded, answered from the cache, and unparsable, since the last reset."""
        keys = ("judge_graded", "judge_cache_hits", "judge_parse_failures")
        out = {k: float(self.totals[k]) for k in keys}
        if reset:
            self.totals.clear()
        return out

    def answers(self, prompts: Sequence[str]) -> list[str | None]:
        """The judge model's greedy answer to each rendered prompt, in one engine call; None
        for a prompt too long for the judge's context (`max_len`, the model's
        `max_seq_len`)."""
        if not prompts:
            return []
        # Here, not at the top: reward workers import this module but never grade.
        import jax

        from posttrain.parallel import mesh_of
        from posttrain.sampling import EngineConfig, generate_continuous

        c = self.config
        model, tokenizer = _load(c.path)
        chat = c.chat == "yes" or (c.chat == "auto" and tokenizer.chat_template is not None)
        if chat:
            ids = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True
                )
                for p in prompts
            ]
        else:
            ids = tokenizer.encode_batch(list(prompts))
        max_len = min(c.max_len, model.config.max_seq_len)
        fits = [i for i, p in enumerate(ids) if len(p) + c.max_new_tokens <= max_len]
        answers: list[str | None] = [None] * len(prompts)
        if fits:
            with jax.set_mesh(mesh_of(model.params)):  # (its device, whatever the caller's mesh)
                results = generate_continuous(
                    model,
                    tokenizer,
                    [ids[i] for i in fits],
                    max_new_tokens=c.max_new_tokens,
                    temperature=0.0,
                    config=EngineConfig(slots=c.slots),
                    max_len=max_len,  # (fixed: every grading call runs the same programs)
                )
            for i, samples in zip(fits, results, strict=True):
                answers[i] = samples[0].text
        return answers

    def _grade(self, prompts: list[str]) -> list[tuple[float, dict]]:
        """(score, info) of each judge prompt: one greedy engine call over those that fit."""
        c, out = self.config, []
        for answer in self.answers(prompts):
            grade = None if answer is None else self.parse(answer)
            info = {
                "judge_answer": "(judge prompt too long)" if answer is None else answer[:500],
                "judge_grade": grade,
                "judge_parse_failure": grade is None,
            }
            out.append((c.failure_reward if grade is None else grade / c.max_score, info))
        return out


def _prompt_text(record: Mapping) -> str:
    """A record's prompt as text: a string, or chat messages as "role: content" lines."""
    prompt = record.get("prompt") if isinstance(record, Mapping) else None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
            for m in prompt
        )
    raise ValueError(
        "a judge grades a completion against its record's 'prompt' (a string or chat "
        f"messages), but this record has none: {record!r:.200}"
    )


def _reference_text(record: Mapping) -> str:
    """The record's "reference" (else "answer") as text; "" when it has neither."""
    ref = record.get("reference", record.get("answer", ""))
    return ref if isinstance(ref, str) else json.dumps(ref)


@functools.cache
def _load(path: str) -> tuple:
    """The judge `(model, tokenizer)` at `path` (an HF directory or a training workdir), loaded
    once per process."""
    from posttrain.lora import load_model_and_tokenizer  # imports jax: on first use

    return load_model_and_tokenizer(path)
