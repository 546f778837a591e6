"""Agent episodes on CPU: 64 concurrent `python_tool` episodes on the continuous-batching engine
vs the same episodes one at a time, same model, greedy (the same work in every mode).

    python benchmarks/agent_episodes.py --workdir=runs/bench_agent    # --episodes=64 --reps=3

The model is the tiny preset fine-tuned (SFT, `configs/agent.py:calculator_sft` with python
trajectories instead of calculator ones) to answer "What is 347 * 589?" by calling the `python`
tool with `print(347 * 589)` and then answering with what it printed; the run is cached in
`--workdir` and reused. The episodes are held-out problems, each a fresh `python_tool`
environment whose calls run in the bwrap sandbox. Modes, interleaved rep by rep (best of
`--reps` after warm-up rounds that compile until a round compiles nothing new; timed runs
report their compilations, which should be 0; the machine is shared and noisy):

  continuous:                  one `run_episodes` call over all episodes (`--slots` engine
                               slots, default one per episode; tool pool `ElasticPool(0, 8)`):
                               while one episode's tool call runs, the others decode; an
                               episode's next turn continues on its kept KV blocks, and the
                               prompts' shared system text and tool schema are prefilled once
                               (the engine's prefix cache, emptied before each run).
  continuous, re-prefilling:   the same without either (`keep_kv=False`, no prefix cache):
                               every turn prefills the episode's whole history (the engine
                               before 2026-12-05).
  one at a time (same engine): `run_episodes` on one episode after the other, the same engine
                               (every decode step still computes all its slots' rows).
  one at a time (1 slot):      the same loop on an engine of 1 slot (decode steps of 1 row).

Reported in docs/benchmarks.md; raw numbers in benchmarks/results/agent_episodes_cpu.json
(`--json`; the `--slots=16` run in agent_episodes_cpu_slots16.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import time
from pathlib import Path

import jax
from _machine import cpu_model  # benchmarks/ is the script directory

from posttrain.config import load_config_file, override
from posttrain.data import load_tokenizer
from posttrain.demo import build_calculator_assets, make_problems
from posttrain.envs import Budget, ElasticPool, make_env, run_episodes
from posttrain.methods import method_config
from posttrain.rewards import integer_correct
from posttrain.sampling import Engine, EngineConfig
from posttrain.train import load_checkpoint_model

REPO = Path(__file__).resolve().parent.parent
BUDGET = Budget(max_turns=3, max_tokens=256, turn_tokens=96, max_tool_s=30.0)
MAX_LEN = 512  # the tiny preset's context: a ~170-token prompt + BUDGET.max_tokens
SFT_STEPS = 300
# A python trajectory (its system text, the tool's schema, the call, the answer) is ~270
# tokens: calculator_sft's rows of 256 would cut the answer off.
SFT_MAX_LEN = 320
_COMPILES = [0]  # XLA compilations so far (a timed run should have none)


def _count_compiles(event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def solved_python_episode(record: dict) -> dict:
    """The SFT record of a solved `python_tool` episode: call `python` with `print(a * b)`, read
    its output, answer with the number."""
    env = make_env("python_tool", record)
    expression = record["prompt"].removeprefix("What is ").removesuffix("?")
    call = {"name": "python", "arguments": {"code": f"print({expression})"}}
    # What the tool answers (the sandbox's result as `python_env` formats it).
    result = json.dumps({"status": "exit code 0", "stdout": f"{record['answer']}\n"})
    return {
        "messages": [
            *env.reset(),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": call}],
            },
            {"role": "tool", "content": result},
            {"role": "assistant", "content": record["answer"]},
        ],
        "tools": env.schemas,
    }


def prepare(workdir: Path, n_eval: int) -> tuple[str, list[dict], str]:
    """(the SFT run's dir, held-out problems, tokenizer dir); trains the run if not there yet."""
    assets = build_calculator_assets(workdir / "assets", n_train=8, n_eval=n_eval, n_sft=8)
    held_out = [json.loads(line) for line in Path(assets["eval"]).read_text().splitlines()]
    run = workdir / "sft"
    done = run / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("max_len") == SFT_MAX_LEN:
        return str(run), held_out, assets["tokenizer"]
    shutil.rmtree(run, ignore_errors=True)  # (a run of other settings: trained again)
    # The real tool's answer has the format the SFT trajectories assume.
    messages = solved_python_episode(held_out[0])["messages"]
    arguments = messages[-3]["tool_calls"][0]["function"]["arguments"]
    got = make_env("python_tool", held_out[0]).tools[0](arguments)
    if got != messages[-2]["content"]:
        raise RuntimeError(f"the python tool answered {got!r}, not {messages[-2]['content']!r}")
    sft_path = workdir / "python_sft.jsonl"
    rows = [solved_python_episode(r) for r in make_problems(1024, 2, exclude=held_out)]
    sft_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {"path": str(sft_path), "weight": 1.0, "domain": "python_tool", "format": "auto"}
    config = load_config_file(str(REPO / "configs" / "agent.py") + ":calculator_sft")
    values = {
        "tokenizer": assets["tokenizer"],
        "data.sources": [source],
        "data.max_len": SFT_MAX_LEN,
        "train.steps": SFT_STEPS,
        "train.progress": False,
        "checkpoint.every": SFT_STEPS,
        "checkpoint.async_save": False,
    }
    config = override(config, values)
    start = time.perf_counter()
    method, built = method_config(config)
    method.run(built, str(run))
    seconds = time.perf_counter() - start
    done.write_text(json.dumps({"steps": SFT_STEPS, "max_len": SFT_MAX_LEN, "seconds": seconds}))
    return str(run), held_out, assets["tokenizer"]


def _episodes(engine, tokenizer, records, keys, *, together: bool, keep_kv: bool = True) -> dict:
    """Runs every record's episode (all in one call, or one call each); the run's counts."""
    pool = ElasticPool(0, 8)
    engine.clear_prefix_cache()  # (every run starts cold)
    before, compiles = _engine_counts(engine), _COMPILES[0]
    start = time.perf_counter()
    common = dict(temperature=0.0, budget=BUDGET, pool=pool, tool_format="hermes",
                  keep_kv=keep_kv)  # fmt: skip
    if together:
        groups = [[make_env("python_tool", r)] for r in records]
        out = [g[0] for g in run_episodes(engine, tokenizer, groups, keys=keys, **common)]
    else:
        out = []
        for i, r in enumerate(records):
            groups = [[make_env("python_tool", r)]]
            out += run_episodes(engine, tokenizer, groups, keys=keys[i : i + 1], **common)[0]
    seconds = time.perf_counter() - start
    pool.close()
    after = _engine_counts(engine)
    return {
        "seconds": seconds,
        "episodes": len(out),
        "turns": sum(e.turns for e in out),
        "tool_calls": sum(e.tool_calls for e in out),
        "tool_errors": sum(e.tool_errors for e in out),
        "tool_s": sum(e.tool_s for e in out),
        "solved": sum(integer_correct(e.text, e.record) for e in out),
        "sampled_tokens": sum(sum(e.mask) for e in out),
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "decode_calls": after["decode_calls"] - before["decode_calls"],
        "episode_tokens": hash(tuple(tuple(e.token_ids) for e in out)),  # same episodes?
        "pool_peak_threads": pool.peak,
        "compiles": _COMPILES[0] - compiles,
        "finish": {
            k: sum(e.finish_reason == k for e in out) for k in {e.finish_reason for e in out}
        },
    }


def _engine_counts(engine) -> dict:
    return {
        "prefill_tokens": engine.stats.prefill_tokens,
        "decode_calls": engine.stats.decode_calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/bench_agent", help="assets + the SFT run")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slots", type=int, default=0, help="engine slots (0: one per episode)")
    parser.add_argument(
        "--json", default=str(REPO / "benchmarks/results/agent_episodes_cpu.json"), help="output"
    )
    parser.add_argument(
        "--skip-same-engine", action="store_true",
        help="leave out 'one at a time (same engine)' (the slowest mode, minutes on CPU)",
    )  # fmt: skip
    args = parser.parse_args()

    run, records, tokenizer_dir = prepare(Path(args.workdir), args.episodes)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = load_checkpoint_model(run)
    keys = jax.random.split(jax.random.key(0), len(records))
    slots = args.slots or args.episodes
    wide = Engine(model, EngineConfig(slots=slots, prefix_cache=True), max_len=MAX_LEN)
    plain = Engine(model, EngineConfig(slots=slots), max_len=MAX_LEN)
    narrow = Engine(model, EngineConfig(slots=1, prefix_cache=True), max_len=MAX_LEN)
    modes = {
        f"continuous ({slots} slots)": (wide, True, True),
        f"continuous, re-prefilling each turn ({slots} slots)": (plain, True, False),
        f"one at a time (same engine, {slots} slots)": (wide, False, True),
        "one at a time (1 slot)": (narrow, False, True),
    }
    if args.skip_same_engine:
        del modes[f"one at a time (same engine, {slots} slots)"]
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    # Warm-up: compile. Continuous batching's prefill shapes (how many prompts arrive together)
    # depend on when tool calls return, so it warms up until a round compiles nothing new.
    for engine, together, keep in modes.values():
        for _ in range(4 if together else 1):
            r = _episodes(engine, tokenizer, records, keys, together=together, keep_kv=keep)
            if r["compiles"] == 0:
                break
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for rep in range(args.reps):
        for name, (engine, together, keep) in modes.items():
            runs[name].append(
                _episodes(engine, tokenizer, records, keys, together=together, keep_kv=keep)
            )
            r = runs[name][-1]
            print(f"rep {rep} {name}: {r['seconds']:.2f} s, {r['compiles']} compiles", flush=True)
    best = {name: min(rs, key=lambda r: r["seconds"]) for name, rs in runs.items()}
    base = best[next(iter(modes))]["seconds"]
    print(
        f"\n{args.episodes} python_tool episodes, tiny model (SFT {SFT_STEPS} steps), greedy, "
        f"best of {args.reps}, {cpu_model()}\n"
    )
    same = len({r["episode_tokens"] for rs in runs.values() for r in rs}) == 1
    print(f"every mode and rep sampled the same episodes: {same}")
    print(
        "| mode | seconds | episodes/s | tool calls/s | sampled tokens/s | prefill tokens per "
        "sampled | turns | tool calls | solved | pool peak threads | time vs continuous |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in best.items():
        s = r["seconds"]
        print(
            f"| {name} | {s:.2f} | {r['episodes'] / s:.2f} | {r['tool_calls'] / s:.2f} | "
            f"{r['sampled_tokens'] / s:,.0f} | {r['prefill_tokens'] / r['sampled_tokens']:.2f} | "
            f"{r['turns']} | {r['tool_calls']} | {r['solved']}/{r['episodes']} | "
            f"{r['pool_peak_threads']} | {s / base:.2f}x |"
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/agent_episodes.py "
        f"--episodes={args.episodes} --reps={args.reps} --slots={slots}",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "budget": dataclasses.asdict(BUDGET),
        "sft": json.loads((Path(run) / "done.json").read_text()),
        "same_episodes_in_every_mode": same,
        "best": best,
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
