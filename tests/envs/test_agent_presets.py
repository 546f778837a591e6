"""Every preset of configs/agent.py runs as documented, at tiny size.

Each preset is loaded as a user loads it and run by `posttrain train` (`posttrain.cli.main`)
with `--config.*` flags that change only what size requires: the model (the tiny model, or for
the Qwen2.5-7B presets a tiny random Qwen2 directory in `model.hf_path`), batch and group size,
lengths, steps. The method, the environment with its options and budgets, the data's domains
and formats stay the preset's. The runs happen in a directory holding `runs/agent/assets`, so
the presets' relative paths are used as they are, and chain as the docs describe:
calculator_sft writes runs/agent/sft, which calculator and calculator_faults start from. The
7B presets are also traced at full size with Qwen2.5-7B-Instruct's config.json (no weights).
"""

import dataclasses
import importlib.util
import json
import math
import os
import shutil

import jax
import pytest

from posttrain import cli, methods
from posttrain.config import build, load_config_file, override
from posttrain.demo._calculator import build_calculator_assets
from posttrain.envs import make_env
from posttrain.envs._builtin import FaultInjection
from posttrain.models import num_params
from posttrain.rl import RLConfig
from posttrain.rl._episodes_rollout import make_episode_env
from posttrain.testing import save_tiny_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(REPO, "configs", "agent.py")
RUN_HERE = ("calculator_sft", "calculator", "calculator_faults", "python_tool_qwen25_7b",
            "terminal_qwen25_7b")  # fmt: skip
# Presets of the tiny model run at their own size elsewhere.
RUN_ELSEWHERE = {
    "clarify_sft": "tests/envs/test_clarify.py::test_a_tiny_model_learns_to_ask (slow)",
    "clarify": "tests/envs/test_clarify.py::test_a_tiny_model_learns_to_ask (slow)",
    **dict.fromkeys(
        ("retrieval_sft", "retrieval", "truncated_sft", "truncated"),
        "tests/envs/test_retrieval.py::test_a_tiny_model_that_searches_answers_what_one_"
        "reading_truncated_documents_cannot (slow)",
    ),
}
SFT_STEPS = 40  # loss falls; calling the tool takes ~100 (test_calculator.py's slow test)
TINY_RL = {  # what size requires of a GRPO preset on 8 CPU devices
    "data.batch_size": 4,  # x 2 episodes: one row per device
    "rollout.num_generations": 2,
    "train.steps": 2,
    "train.log_every": 1,  # a metrics row per step (the 7B presets log every 10)
    "checkpoint.every": 2,
    "train.progress": False,
    "rewards.workers": 1,  # (2 cores)
}
# The 7B presets at tiny size: one update of the 8 rows (the full size splits 1024 in 4 x 4);
# a 32-token episode, well under the preset's turn_tokens=1024, so a turn the random model does
# not end is cut by the episode's budget (truncated) and one it ends goes to the environment.
TINY_7B = {**TINY_RL, "algorithm.minibatches": 1, "train.micro_batches": 1,
           "rollout.max_new_tokens": 32}  # fmt: skip
# Qwen2.5-7B-Instruct's config.json (the fields posttrain reads), for the full-size trace.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "vocab_size": 152064, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 131072,
    "max_window_layers": 28, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645,
}  # fmt: skip


def _train(preset: str, workdir: str, values: dict) -> list[dict]:
    """`posttrain train --config=configs/agent.py:<preset> --workdir=<workdir>
    --config.<key>=<value> ...`; returns the run's metrics rows."""
    flags = [f"--config.{k}={v}" for k, v in values.items()]
    assert cli.main(["train", f"--config={AGENT}:{preset}", f"--workdir={workdir}", *flags]) == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _checkpoints(workdir: str) -> list[int]:
    return sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit())


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["split"] == "train"]


def _check_episodes(
    rows: list[dict], domain: str, *, steps: int = 2, lowest: float = 0.0
) -> list[dict]:
    """The GRPO run's train rows: one per step, each with its episodes' metrics and a finite
    reward in [lowest, 1] (every preset's reward lies in [0, 1]; penalties lower it), named by
    the data's domain."""
    train = _train_rows(rows)
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert lowest <= r["reward"] <= 1.0 and math.isfinite(r["loss"]), r
        assert r[f"reward/{domain}"] == r["reward"]
        assert r["episode/turns"] >= 1 and r["episode/tokens"] > 0, r
        assert 0.0 <= r["episode/truncated"] <= 1.0 and r["episode/ended_error"] == 0.0, r
        assert r.get("reward_errors", 0.0) == 0.0, r  # (no domain raised while scoring)
    return train


def test_every_preset_runs_here():
    """A preset added to configs/agent.py fails here until this module runs it."""
    spec = importlib.util.spec_from_file_location("agent_presets_config", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert sorted(module.PRESETS) == sorted([*RUN_HERE, *RUN_ELSEWHERE])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A directory the module runs in, holding runs/agent/assets as `posttrain demo
    --task=calculator` writes them (fewer problems)."""
    root = tmp_path_factory.mktemp("agent_presets")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        build_calculator_assets(os.path.join("runs", "agent", "assets"), n_train=64, n_eval=8)
        yield root


@pytest.fixture(scope="module")
def sft(root):
    """configs/agent.py:calculator_sft into runs/agent/sft, where calculator reads it."""
    workdir = os.path.join("runs", "agent", "sft")
    return _train("calculator_sft", workdir, {"train.steps": SFT_STEPS, "train.progress": False})


@pytest.fixture(scope="module")
def tiny_qwen(root):
    """A tiny random Qwen2 directory (Qwen2.5's architecture) with the calculator's tokenizer
    (a chat template with tool calls), for the presets that take `model.hf_path`; 2048
    positions hold the terminal prompts (about 670 tokens in that tokenizer)."""
    path = save_tiny_hf_model("qwen2", "qwen_tiny", vocab_size=512, max_position_embeddings=2048)
    tokenizer = os.path.join("runs", "agent", "assets", "tokenizer")
    for name in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, name), path)
    return path


def test_calculator_sft(sft):
    """The warm start learns its episodes and leaves its checkpoint where calculator looks."""
    workdir = os.path.join("runs", "agent", "sft")
    train = _train_rows(sft)
    assert [r["step"] for r in train] == list(range(20, SFT_STEPS + 1, 20))  # log_every=20
    first, last = train[0], train[-1]
    assert last["loss"] < 0.75 * first["loss"], (first, last)
    assert last["accuracy"] > first["accuracy"], (first, last)
    assert _checkpoints(workdir)[-1] == SFT_STEPS


@pytest.mark.parametrize("preset", ["calculator", "calculator_faults"])
def test_calculator_grpo(sft, preset):
    """GRPO from the SFT run where the preset looks for it (runs/agent/sft): episodes of the
    calculator environment within its budgets, scored by the arithmetic domain, on the
    training prompts and the held-out ones. (At SFT_STEPS the start answers without the tool;
    tool use from this preset is test_calculator.py's slow test.)"""
    workdir = os.path.join("runs", "agent", preset)
    rows = _train(preset, workdir, TINY_RL)
    train = _check_episodes(rows, "arithmetic")
    # Step 1's update has learning rate 0 (warmup): its params are the SFT run's last ones.
    assert train[0]["learning_rate"] == 0.0
    assert train[0]["param_norm"] == pytest.approx(_train_rows(sft)[-1]["param_norm"], rel=1e-6)
    for r in train:
        assert 0.0 <= r["episode/tool_error_rate"] <= 1.0, r
        assert 1 <= r["episode/turns"] <= 3, r  # env.max_turns
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]  # before training and at the end
    assert all(r["eval_prompts"] == 8 and 0 <= r["eval_reward"] <= 1 for r in evals), evals
    assert _checkpoints(workdir) == [2]


def test_calculator_faults_wraps_the_calculator():
    """calculator_faults' episodes are calculator episodes in which 30% of the calls fail."""
    values = load_config_file(f"{AGENT}:calculator_faults")
    config = build(RLConfig, {k: v for k, v in values.items() if k != "method"})
    record = {"prompt": "What is 12 * 34?", "answer": "408"}
    failed = 0
    for episode in range(40):
        env = make_episode_env(config.env, {**record, "id": episode}, config.train.seed)
        assert isinstance(env, FaultInjection) and env.tools[0].name == "calculate"
        env.reset()
        function = {"name": "calculate", "arguments": {"expression": "12 * 34"}}
        call = {"id": "c", "type": "function", "function": function}
        step = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
        failed += step.info["tool_errors"]
        assert step.info["tool_errors"] or step.observations[0]["content"] == "408"
    assert 6 <= failed <= 20, failed  # 30% of 40 is 12


def test_python_tool_qwen25_7b(root, tiny_qwen):
    """The python_tool environment on math prompts (the preset's data.sources, prompts.jsonl):
    episodes run and the math domain scores them, cut ones too (scored as the others)."""
    with open("prompts.jsonl", "w") as f:
        for a, b in ((17, 25), (120, 3), (9, 9), (1000, 7)):
            f.write(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")
    workdir = "python_tool"
    values = {"model.hf_path": tiny_qwen, "rollout.max_prompt_len": 256, **TINY_7B}
    rows = _train("python_tool_qwen25_7b", workdir, values)
    train = _check_episodes(rows, "math")
    assert all("reward_errors" in r for r in train)  # the reward pool scored them
    assert _checkpoints(workdir) == [2]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the hidden tests run in bubblewrap")
def test_terminal_qwen25_7b(root, tiny_qwen):
    """The terminal environment on the bundled tasks, whose records name the domain "terminal"
    that no reward function has: the environment scores finished episodes with the hidden tests
    (the untouched workspaces pass none of them: checked below) and cut ones get 0, so no
    episode goes to the reward pool (which stopped this preset with "unknown reward domain")."""
    workdir = "terminal"
    values = {"model.hf_path": tiny_qwen, "rollout.max_prompt_len": 768, **TINY_7B}
    rows = _train("terminal_qwen25_7b", workdir, values)
    train = _check_episodes(rows, "terminal")
    for r in train:
        assert r["reward"] == 0.0 and "reward_errors" not in r, r
        assert r["episode/ended_length"] == r["episode/truncated"], r  # cut by the budget
    # The random model ends a few episodes within 32 tokens (the hidden tests score them) and
    # is cut in the others (0, without the environment): both paths ran.
    assert any(r["episode/truncated"] > 0 for r in train), train  # the path that crashed
    assert any(r["episode/truncated"] < 1 for r in train), train
    assert _checkpoints(workdir) == [2]
    # What a finished episode scores on a task's untouched workspace: 0 of its hidden tests.
    values = load_config_file(f"{AGENT}:terminal_qwen25_7b")
    with open(values.data.sources[0]["path"]) as f:
        task = json.loads(f.readline())
    with make_env("terminal", task) as env:
        env.reset()
        step = env.step({"role": "assistant", "content": "done"})
    assert step.done and step.reward == 0.0 and step.info["tests_total"] > 0, step


# python_tool's (~11 s) in `make test-slow`: the same model, mesh and rows as terminal's; its
# own run at tiny scale stays (test_python_tool_qwen25_7b).
@pytest.mark.parametrize(
    "preset", [pytest.param("python_tool_qwen25_7b", marks=pytest.mark.slow), "terminal_qwen25_7b"]
)
def test_full_size_7b_preset(preset, tmp_path, capsys):
    """As shipped (model.hf_path unset), the preset stops before anything runs, saying to set
    it; with Qwen2.5-7B-Instruct's config.json in model.hf_path its train step traces at full
    size on the preset's mesh (8 fake devices here) with its 1024 + 4096-token rows."""
    code = cli.main(["train", f"--config={AGENT}:{preset}", f"--workdir={tmp_path / 'run'}"])
    assert code == 2 and "model.hf_path" in capsys.readouterr().err
    (tmp_path / "qwen25_7b").mkdir()
    (tmp_path / "qwen25_7b" / "config.json").write_text(json.dumps(QWEN25_7B))
    values = override(
        load_config_file(f"{AGENT}:{preset}"), {"model.hf_path": str(tmp_path / "qwen25_7b")}
    )
    low = methods.lowering(values, jax.devices())
    assert 7.6e9 < num_params(low.model_config) < 7.7e9  # Qwen2.5-7B
    assert low.length == 1024 + 4096 and low.batch["tokens"].shape == (1024, 5120)
    with jax.set_mesh(low.mesh):
        state, metrics = jax.eval_shape(low.step, *low.arguments())
    assert jax.tree.structure(state) == jax.tree.structure(low.state)
    domain = "math" if preset.startswith("python") else "terminal"
    assert metrics["loss"].shape == () and f"kl/{domain}" in metrics


def test_the_terminal_preset_stops_its_tools_at_the_episodes_tool_time():
    """env.max_tool_s reaches the terminal environment (it stops its own calls when the
    episode's tool seconds are spent); an option the user set wins."""
    values = override(load_config_file(f"{AGENT}:terminal_qwen25_7b"), {"model.hf_path": "x"})
    config = build(RLConfig, {k: v for k, v in values.items() if k != "method"})
    record = {"prompt": "p", "tests": [{"name": "t", "code": "assert True"}]}
    assert make_episode_env(config.env, record, 0).options.max_tool_s == config.env.max_tool_s
    own = dataclasses.replace(config.env, options={"max_tool_s": 3.0})
    assert make_episode_env(own, record, 0).options.max_tool_s == 3.0


_RUNNER = """
import json, sys
from posttrain.parallel import initialize
initialize()
from posttrain.config import load_config_file, override
from posttrain.methods import run_from_config
config = override(load_config_file(sys.argv[2]), json.loads(sys.argv[3]))
summary = run_from_config(config, sys.argv[1])
print("STOPPED", summary["stopped"], summary["final_step"], flush=True)
"""


def _on_two_processes_and_one(tmp_path, preset: str, values: dict) -> tuple[list, list]:
    """The preset with `values` on 2 processes x 4 devices, then 1 x 8; each run's train rows."""
    from tests.launch import finish, launch, launch_group

    config = f"{AGENT}:{preset}"
    argv = lambda where: ["-c", _RUNNER, str(tmp_path / where), config, json.dumps(values)]  # noqa: E731
    pair = launch_group(argv("two"), processes=2, devices=4)
    single = launch(argv("one"), devices=8)
    for p in [*pair, single]:
        assert "STOPPED completed 2" in finish(p)
    read = lambda where: _train_rows(  # noqa: E731
        [json.loads(line) for line in open(tmp_path / where / "metrics.jsonl")]
    )
    return read("two"), read("one")


@pytest.fixture(scope="module")
def terminal_sft(root, tiny_qwen):
    """A warm start that works the terminal tasks with their tools: the tiny Qwen2 after SFT on
    one solved episode per bundled task (its solution's tool calls, the observations the
    sandbox really returned, then "Done."), so that sampled at temperature 0.7 it calls the
    tools, solves some tasks and fails others (slightly garbled calls). ~3 minutes."""
    from posttrain.envs._terminal import terminal_tasks

    rows = []
    for task in terminal_tasks():
        with make_env("terminal", task) as env:
            opening = env.reset()
            calls = [{"type": "function", "function": call} for call in task["solution"]]
            turn = {"role": "assistant", "content": "", "tool_calls": calls}
            step = env.step(turn)
            done = {"role": "assistant", "content": "Done."}
            rows.append({"messages": [*opening, turn, *step.observations, done],
                         "tools": env.schemas})  # fmt: skip
    data = os.path.abspath("terminal_sft.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    source = {"path": data, "weight": 1.0, "domain": "terminal", "format": "auto"}
    values = {"model.hf_path": tiny_qwen, "model.preset": "", "tokenizer": tiny_qwen,
              "data.sources": [source], "eval_data": [], "data.max_len": 1152,
              "data.batch_size": 8, "train.steps": 150, "train.log_every": 50,
              "train.eval_every": 0, "train.progress": False, "checkpoint.every": 150,
              "checkpoint.async_save": False, "optimizer.learning_rate": 5e-3,
              "optimizer.warmup_steps": 10}  # fmt: skip
    config = override(load_config_file(os.path.join(REPO, "configs", "sft.py:tiny")), values)
    workdir = os.path.abspath("terminal_sft")
    assert methods.run_from_config(config, workdir)["stopped"] == "completed"
    return workdir


@pytest.mark.slow  # (~7 minutes: the warm start, then the preset on 2 processes x 4, and 1 x 8)
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the tools run in bubblewrap")
def test_terminal_episodes_on_two_processes_match_one(tmp_path, tiny_qwen, terminal_sft):
    """configs/agent.py:terminal_qwen25_7b at tiny size from a warm start that uses its tools,
    on 2 processes x 4 devices vs 1 x 8: each process runs its share's episodes with sandboxed
    workspaces of its own and scores those that end with the task's hidden tests. The episodes
    call tools (some calls garbled: env.options.format_penalty scores those turns), groups'
    rewards differ, so advantages and gradients are not 0; rewards, gradient norms, losses and
    the episode metrics equal one process's, and the processes' episodes end at different
    lengths."""
    from tests.tolerance import assert_close

    values = {"model.hf_path": "", "model.checkpoint": terminal_sft,
              "tokenizer": os.path.abspath(tiny_qwen),
              **TINY_7B, "data.batch_size": 2, "rollout.num_generations": 4,
              "rollout.max_prompt_len": 768, "rollout.max_new_tokens": 192,
              "env.turn_tokens": 160, "env.max_turns": 3, "env.options": {"format_penalty": 0.5},
              "rollout.sampling.temperature": 0.7, "checkpoint.async_save": False}  # fmt: skip
    two, one = _on_two_processes_and_one(tmp_path, "terminal_qwen25_7b", values)
    _check_episodes(two, "terminal", lowest=-1.5)  # (3 turns of garbled calls)
    keys = ("reward", "pass_rate", "grad_norm", "episode/turns", "episode/tool_calls",
            "episode/tool_error_rate", "episode/tokens", "episode/truncated")  # fmt: skip
    for key in keys:
        assert_close([r[key] for r in two], [r[key] for r in one], rtol=1e-5, err_msg=key)
    # (on-policy, the loss is a sum of advantages that cancel: compared at their scale, 1)
    assert_close([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5, scale=1.0)
    assert all(r["episode/tool_calls"] > 0 and r["grad_norm"] > 0 for r in one), one
    assert any(r["pass_rate"] > 0 for r in one), one  # (some hidden tests passed)
    lengths = [(r["response_length/process0"], r["response_length/process1"]) for r in two]
    assert any(a != b for a, b in lengths), lengths


@pytest.mark.slow  # (~2 minutes: the preset on 2 processes x 4 devices, then 1 x 8)
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the tools run in bubblewrap")
def test_python_tool_episodes_on_two_processes_match_one(root, tiny_qwen, tmp_path):
    """configs/agent.py:python_tool_qwen25_7b at tiny size on 2 processes x 4 devices vs 1 x 8:
    each process runs its share's episodes with its own sandboxed interpreter and the math
    domain's verifier. The model is random: it calls no tool and solves nothing (every reward
    is 0, so rewards and losses are compared but cannot differ); what the comparison sees are
    the episodes: their lengths, turns and how they ended (by the model or cut by the budget),
    equal to one process's. (The terminal test above is the one from a tool-using start.)"""
    from tests.tolerance import assert_close

    values = {"model.hf_path": os.path.abspath(tiny_qwen), "rollout.max_prompt_len": 768,
              **TINY_7B, "checkpoint.async_save": False}  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"  # (the preset reads prompts.jsonl where it runs)
    prompts.write_text("".join(
        json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n"
        for a, b in ((17, 25), (120, 3), (9, 9), (1000, 7))
    ))  # fmt: skip
    values["data.sources"] = [
        {"path": str(prompts), "weight": 1.0, "domain": "math", "format": "auto"}
    ]  # fmt: skip
    two, one = _on_two_processes_and_one(tmp_path, "python_tool_qwen25_7b", values)
    _check_episodes(two, "math")
    for key in ("reward", "loss", "response_length", "episode/turns", "episode/tokens",
                "episode/truncated", "episode/ended_length"):  # fmt: skip
        assert_close([r[key] for r in two], [r[key] for r in one], rtol=1e-5, err_msg=key)
    assert any(0 < r["episode/truncated"] < 1 for r in two), two  # (both ends happened)
    lengths = [(r["response_length/process0"], r["response_length/process1"]) for r in two]
    assert any(a != b for a, b in lengths), lengths
