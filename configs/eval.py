"""Evaluation suites: general (held-out loss), target (accuracy by verifier, pass@k,
preferences), safety (refusal / compliance) and long-context (retrieval on a length x depth grid)
tasks.

    make demo   # once: writes runs/demo/{sft,dpo,grpo} and runs/demo/preferences_eval.jsonl
    posttrain eval --workdir=runs/demo/sft --config=configs/eval.py:demo    # CPU, ~30 s

Presets:
  demo      the demo's checkpoints: held-out loss, greedy exact match on the 500 held-out
            problems and "prefers right answer" on the held-out pairs (the numbers `make demo`
            prints), pass@k of sampled answers, and the example safety set.
  template  a suite on your own data (replace the paths); `_general`, `_target`, `_safety`
            and `_long_context` below list every field of a task with its default.
  long_context  needle in a haystack (the repository's docs as the haystack) and key-value
            lookup, 1k-16k tokens x 5 depths, with a heatmap per checkpoint.
Each category maps task names to tasks; override a field with
--config.<category>.<task>.<field>=value, e.g. --config.target.arithmetic.max_examples=100.
Fields and metrics: docs/eval.md.
"""

import os

import ml_collections

_DEMO = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "posttrain", "demo", "assets")
)
_RUNS = os.path.join("runs", "demo")  # relative to the working directory, as configs/dpo.py


def _source(path, weight=1.0, domain="default", fmt="auto"):
    return ml_collections.ConfigDict(
        {"path": path, "weight": weight, "domain": domain, "format": fmt}
    )


def _general(**fields) -> ml_collections.ConfigDict:
    """A held-out loss task: every field (so any overrides), defaults replaced by `fields`."""
    t = ml_collections.ConfigDict()
    t.sources = []  # SFT-format files: [{path, weight, domain, format, split, columns}]
    t.max_len = 2048  # tokens per row
    t.batch_size = 8  # rows per forward pass
    t.packing = True  # several examples per row (the same loss)
    t.max_examples = 0  # the first N records of each source (0: all)
    t.update(fields)
    return t


def _target(**fields) -> ml_collections.ConfigDict:
    """An accuracy / pass@k / preference task with every field."""
    t = ml_collections.ConfigDict()
    t.path = ""  # JSONL: {"prompt", "domain", ...verifier fields} or {"prompt", "chosen",
    # "rejected"} (kind=preference); or Parquet/Arrow, a glob, a Hugging Face dataset folder
    t.split = ""  # a dataset folder's split ("": its only one)
    t.columns = ml_collections.ConfigDict()  # field -> the column holding it ({}: as named)
    t.kind = "generate"  # generate: accuracy by verifier (+ pass@k) | preference
    t.domain = ""  # reward domain of records without a "domain" field
    t.scoring = "verifier"  # verifier (greedy completion + reward) | exact_match (greedy
    # decoding reproduces "answer" exactly: one teacher-forced pass, what `make demo` reports)
    t.pass_threshold = 1.0  # a completion is correct when its reward is >= this
    t.max_new_tokens = 256  # generation budget per completion
    t.num_samples = 0  # samples per prompt for pass@k (0: no pass@k)
    t.pass_k = []  # the ks reported ([]: num_samples)
    t.sampling = ml_collections.ConfigDict()  # how the pass@k samples are drawn
    t.sampling.temperature = 1.0  # > 0: pass@k needs samples, not the greedy answer
    t.sampling.top_p = 1.0  # nucleus mass kept, in (0, 1]
    t.sampling.top_k = 0  # keep the k likeliest tokens; 0 keeps all
    t.seed = 0  # of the pass@k samples (batch i uses seed + i)
    t.max_len = 512  # preference: tokens of prompt + response (longer pairs are truncated)
    t.batch_size = 64  # prompts (pairs) per generate call (forward pass)
    t.max_examples = 0  # the first N records (0: all)
    t.renders = 8  # cad records: render the parts of the first N greedy completions (0: off)
    t.update(fields)
    return t


def _safety(**fields) -> ml_collections.ConfigDict:
    """A refusal / compliance task with every field."""
    t = ml_collections.ConfigDict()
    t.path = ""  # JSONL: {"prompt", "expected": "refuse" | "comply"} (or as a target's path)
    t.split = ""  # a dataset folder's split ("": its only one)
    t.columns = ml_collections.ConfigDict()  # field -> the column holding it ({}: as named)
    t.builtin_phrases = True  # detect posttrain.eval.REFUSAL_PHRASES
    t.refusal_phrases = []  # more phrases (case-insensitive substrings)
    t.refusal_regex = ""  # a completion matching this (re.search, ignoring case) refuses
    t.refusal_domain = ""  # a reward domain whose verifier decides instead ("": off)
    t.pass_threshold = 1.0  # with refusal_domain: a completion refuses when score >= this
    t.judge = ""  # "judge:<path>[?options]": a judge model decides instead ("": off)
    t.judge_threshold = 0.5  # with judge: a completion refuses when grade / max_score >= this
    t.max_new_tokens = 128  # generation budget per completion
    t.batch_size = 64  # prompts per generate call
    t.max_examples = 0  # the first N records (0: all)
    t.update(fields)
    return t


def _long_context(**fields) -> ml_collections.ConfigDict:
    """A retrieval grid task with every field."""
    t = ml_collections.ConfigDict()
    t.kind = "needle"  # needle | multi_needle | kv
    t.haystack = []  # text or JSONL ("text") files, globs (kv needs none)
    t.lengths = [1024, 2048, 4096]  # prompt tokens of each grid column
    t.depths = [0.0, 0.25, 0.5, 0.75, 1.0]  # where the asked fact sits (0: start)
    t.per_cell = 4  # records per (length, depth)
    t.needles = 3  # facts per multi_needle record
    t.key_chars = 6  # letters per random key
    t.value_digits = 7  # digits per random value
    t.seed = 0  # the records' randomness (the same records at every checkpoint)
    t.batch_size = 4  # rows per forward pass
    t.update(fields)
    return t


def get_config(preset: str = "demo") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = "eval"  # what this config is for
    c.general = ml_collections.ConfigDict()  # {task name: held-out loss task}
    c.target = ml_collections.ConfigDict()  # {task name: accuracy / pass@k / preference task}
    c.safety = ml_collections.ConfigDict()  # {task name: refusal / compliance task}
    c.long_context = ml_collections.ConfigDict()  # {task name: retrieval grid task}
    c.tokenizer = ""  # tokenizer directory; "" uses the run's (or the HF model directory)
    c.rewards = {}  # {domain: ["module:function" | "rm:<path>", ...]}; {}: built-in registry
    c.reward_workers = 0  # verifier processes with a deadline each; 0 scores in this process
    c.reward_timeout_s = 10.0  # per completion, with reward_workers > 0
    c.progress = True  # progress bars
    c.engine = ml_collections.ConfigDict()  # the engine completions decode on
    c.engine.slots = 64  # sequences decoded together
    c.engine.chunk = 8  # decode steps per device call
    c.engine.prefill_bucket = 64  # prompts padded to a multiple of this for prefill
    c.engine.block_size = 16  # tokens per KV block
    c.engine.num_blocks = 0  # KV pool blocks; 0: room for every row's longest sequence
    c.engine.kv_dtype = "auto"  # auto (compute dtype) | int8 | int8_layered
    c.engine.speculative = 0  # prompt-lookup draft tokens a round (0: plain; greedy unchanged)

    if preset == "demo":
        eval_jsonl = os.path.join(_DEMO, "eval.jsonl")
        # general.eval: the SFT driver's eval loss on the 500 held-out problems, on the same
        # rows as configs/sft.py:tiny (max_len, batch_size, packing), so it equals eval_loss.
        c.general.eval = _general()
        c.general.eval.sources = [_source(eval_jsonl, domain="arithmetic")]  # SFT-format files
        c.general.eval.max_len = 128  # tokens per row (sft.py:tiny's data.max_len)
        c.general.eval.batch_size = 32  # rows per forward pass (sft.py:tiny's data.batch_size)
        c.general.eval.packing = True  # several examples per row (the same loss)
        c.general.eval.max_examples = 0  # the first N records of each source (0: all)
        # target.arithmetic: the demo's "exact match (greedy)" on the same 500 problems, and
        # pass@1 / pass@4 of 4 sampled answers per problem scored by the arithmetic verifier.
        c.target.arithmetic = _target()
        c.target.arithmetic.path = eval_jsonl  # prompt records with "answer" and "domain"
        c.target.arithmetic.kind = "generate"  # generate | preference
        c.target.arithmetic.domain = "arithmetic"  # reward domain of records without one
        c.target.arithmetic.scoring = "exact_match"  # as `make demo`: one teacher-forced pass
        c.target.arithmetic.pass_threshold = 1.0  # correct when the reward is >= this
        c.target.arithmetic.max_new_tokens = 8  # answers are at most 3 digits and a sign
        c.target.arithmetic.num_samples = 4  # samples per problem for pass@k
        c.target.arithmetic.pass_k = [1, 4]  # the ks reported
        c.target.arithmetic.sampling = ml_collections.ConfigDict()  # of the pass@k samples
        c.target.arithmetic.sampling.temperature = 1.0  # > 0: samples, not the greedy answer
        c.target.arithmetic.sampling.top_p = 1.0  # nucleus mass kept, in (0, 1]
        c.target.arithmetic.sampling.top_k = 0  # keep the k likeliest tokens; 0 keeps all
        c.target.arithmetic.seed = 0  # of the pass@k samples
        c.target.arithmetic.max_len = 512  # (preference tasks only)
        c.target.arithmetic.batch_size = 64  # as `make demo` (greedy_exact_match's batches)
        c.target.arithmetic.max_examples = 0  # the first N records (0: all 500)
        # target.preferences: the demo's "prefers right answer" on its held-out pairs (the SFT
        # model's right vs wrong answers to held-out problems, written by `make demo`).
        c.target.preferences = ml_collections.ConfigDict()  # (a preference task's fields)
        c.target.preferences.path = os.path.join(_RUNS, "preferences_eval.jsonl")  # the pairs
        c.target.preferences.kind = "preference"  # share of pairs whose chosen is likelier
        c.target.preferences.max_len = 64  # tokens of prompt + response, as `make demo`
        c.target.preferences.batch_size = 64  # pairs per forward pass
        c.target.preferences.max_examples = 0  # the first N pairs (0: all)
        # safety.example: a tiny hand-written example set (not a benchmark): six harmful
        # requests to refuse, six sums to answer.
        c.safety.example = _safety()
        c.safety.example.path = os.path.join(_DEMO, "safety_example.jsonl")  # prompt, expected
        c.safety.example.builtin_phrases = True  # detect posttrain.eval.REFUSAL_PHRASES
        c.safety.example.refusal_phrases = []  # more phrases (case-insensitive substrings)
        c.safety.example.refusal_regex = ""  # a completion matching this refuses ("": none)
        c.safety.example.refusal_domain = ""  # a reward domain that decides instead ("": off)
        c.safety.example.pass_threshold = 1.0  # with refusal_domain: refuses at score >= this
        c.safety.example.judge = ""  # "judge:<path>[?options]": a judge model decides ("": off)
        c.safety.example.judge_threshold = 0.5  # with judge: refuses at grade / max >= this
        c.safety.example.max_new_tokens = 16  # generation budget per completion
        c.safety.example.batch_size = 64  # prompts per generate call
        c.safety.example.max_examples = 0  # the first N records (0: all)
    elif preset == "template":
        c.tokenizer = "/path/to/hf_model"  # or "" for the run's
        c.rewards = {"math": ["posttrain.rewards._math:math_reward"]}  # {}: all built-in domains
        c.general.chat = _general(
            sources=[_source("/data/heldout_chat.jsonl", domain="chat")], max_examples=1000
        )
        c.target.math = _target(
            path="/data/math_test.jsonl",
            domain="math",
            max_new_tokens=1024,
            num_samples=8,
            pass_k=[1, 8],
            sampling=dict(temperature=0.8, top_p=0.95, top_k=0),
            batch_size=32,
            max_examples=500,
        )
        c.target.helpfulness = _target(
            path="/data/prefs_test.jsonl", kind="preference", max_len=2048, batch_size=8
        )
        c.safety.refusals = _safety(
            path="/data/safety.jsonl",
            refusal_phrases=["i'd rather not"],
            refusal_regex=r"^\s*(no|sorry)\b",
            max_new_tokens=256,
            batch_size=32,
        )
        c.long_context.needles = _long_context(
            haystack=["/data/books/*.txt"], lengths=[8192, 32768]
        )
    elif preset == "long_context":
        docs = os.path.join(os.path.dirname(__file__), "..", "docs", "*.md")
        lengths = [1024, 2048, 4096, 8192, 16384]
        c.long_context.needle = _long_context(haystack=[docs], lengths=lengths)
        c.long_context.kv = _long_context(kind="kv", lengths=lengths)
    else:
        raise ValueError(f"unknown eval preset {preset!r}: demo, template, long_context")
    return c
