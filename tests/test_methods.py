"""`posttrain compile` lowers the step a run jits: for every method, with every option of its
loss set away from the default, the step `posttrain.methods.lowering` builds (what
`compile_plan` compiles for a TPU slice) and the step a one-step run jitted give the same loss,
metrics and updated params on the same state, frozen inputs and batch, and the batch and
frozen inputs the run fed have the shapes the compile assumes. Also: only the methods package
reaches a driver (everything else goes through the records), the RL records refuse each other's
configs, and each record's abstract batch is its data source's batch."""

import ast
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import methods
from posttrain.config import ConfigError
from tests.rl.toy import toy_config
from tests.tolerance import assert_close, ulp
from tests.train.conftest import small_config
from tests.train.test_dpo_driver import _config as dpo_config
from tests.train.test_dpo_driver import pair_files  # noqa: F401 (a fixture)

ONE_STEP = {"train.steps": 1, "checkpoint.every": 100, "train.eval_every": 0, "eval_data": []}
RL_LOSS = {  # every policy-loss option away from its default
    "loss.clip_low": 0.1,
    "loss.clip_high": 0.3,
    "loss.dual_clip": 3.0,
    "loss.ratio": "sequence",
    "loss.aggregation": "token-mean",
    "loss.mask_truncated": True,
    "loss.kl_estimator": "k2",
    "loss.entropy_coef": 0.01,
    "loss.correction": "geometric",
    "loss.correction_mode": "mask",
    "loss.is_low": 0.4,
    "loss.is_high": 2.5,
    "kl.coef": 0.05,
    "algorithm.epochs": 2,
    "algorithm.minibatches": 2,
    "data.batch_size": 4,  # 16 rows: two updates of 8, one row per device
    "rollout.num_generations": 4,
}


def _config(method: str, pairs):
    if method == "sft":  # (sharded over fsdp and tensor too)
        mesh = {"mesh.ici.data": 2, "mesh.ici.fsdp": 2, "mesh.ici.tensor": 2}
        return small_config(z_loss=1e-3, train__micro_batches=2, **_dunder({**ONE_STEP, **mesh}))
    if method == "dpo":
        values = {"loss.type": "robust", "loss.beta": 0.2, "loss.label_smoothing": 0.1,
                  "loss.sft_weight": 0.5, "loss.reference": "on_the_fly",
                  "train.micro_batches": 2}  # fmt: skip
        return dpo_config(pairs, **ONE_STEP, **values)
    if method == "simpo":
        values = {"loss.type": "simpo", "loss.beta": 2.0, "loss.gamma": 0.5,
                  "loss.label_smoothing": 0.1, "loss.reference": "auto"}  # fmt: skip
        return dpo_config(pairs, **ONE_STEP, **values)
    if method == "rm":
        values = {**ONE_STEP, "loss.center_coefficient": 0.01, "loss.use_margins": False}
        return dpo_config(pairs, file="rm.py", **values)
    if method == "grpo":  # (LoRA: the frozen base is the step's input)
        return toy_config(lora__enabled=True, **_dunder({**ONE_STEP, **RL_LOSS}))
    ppo = {**ONE_STEP, **RL_LOSS, "critic.coef": 0.3, "critic.clip": 0.1, "kl.mode": "reward"}
    del ppo["loss.ratio"]  # PPO's ratio is per token
    return toy_config("tiny", "ppo.py", **_dunder(ppo))


def _dunder(values: dict) -> dict:
    return {k.replace(".", "__"): v for k, v in values.items()}


def _concrete_batch(abstract: dict, vocab: int, seed: int = 0) -> dict:
    """A random but well-formed batch of the compile's shapes and shardings."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, s in abstract.items():
        if name.endswith("positions"):
            x = np.broadcast_to(np.arange(s.shape[-1], dtype=np.int32), s.shape)
        elif name.endswith("segment_ids"):
            x = np.ones(s.shape, np.int32)
        elif name == "domain_ids":
            x = np.zeros(s.shape, np.int32)
        elif jnp.issubdtype(s.dtype, jnp.integer):
            x = rng.integers(0, vocab, s.shape, dtype=np.int32)
        elif "mask" in name or name == "truncated":
            x = (rng.random(s.shape) < 0.7).astype(np.float32)
        elif "logps" in name:
            x = -rng.uniform(0.1, 3.0, s.shape).astype(np.float32)
        else:
            x = rng.uniform(0.5, 1.5, s.shape).astype(np.float32)
        out[name] = jax.device_put(np.asarray(x, s.dtype), s.sharding)
    return out


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), tree)


@pytest.mark.parametrize(
    "method",
    [
        "sft",
        # Suite time: the other methods run in `make test-slow` (~45-90 s each on 2 cores).
        pytest.param("grpo", marks=pytest.mark.slow),
        pytest.param("dpo", marks=pytest.mark.slow),
        pytest.param("simpo", marks=pytest.mark.slow),
        pytest.param("rm", marks=pytest.mark.slow),
        pytest.param("ppo", marks=pytest.mark.slow),
    ],
)
def test_compiled_step_is_the_step_a_run_jits(method, pair_files, tmp_path):  # noqa: F811
    config = _config(method, pair_files)
    summary = methods.run_from_config(config, str(tmp_path))
    low = methods.lowering(config, jax.devices(), summary.get("domains"))

    assert _shapes(dict(low.batch)) == _shapes(dict(summary["batch_shapes"]))
    assert _shapes(low.inputs) == _shapes(summary["loss_inputs"])
    # frozen inputs: DPO's on-the-fly reference, GRPO's LoRA base
    assert len(low.inputs) == (method in ("dpo", "grpo"))
    assert jax.tree.structure(low.state) == jax.tree.structure(summary["state"])

    batch = _concrete_batch(low.batch, low.model_config.vocab_size)
    copy = lambda: jax.tree.map(jnp.copy, summary["state"])  # noqa: E731 (both steps donate)
    inputs = summary["loss_inputs"]
    run_state, run_metrics = summary["step"](copy(), inputs, batch)
    with jax.set_mesh(low.mesh):
        compiled_state, compiled_metrics = low.jitted()(copy(), inputs, batch)

    run_metrics, compiled_metrics = jax.device_get((run_metrics, compiled_metrics))
    assert sorted(run_metrics) == sorted(compiled_metrics)
    assert np.isfinite(run_metrics["loss"]) and not run_metrics["bad_step"]
    for name, value in run_metrics.items():
        assert_close(compiled_metrics[name], value, rtol=1e-5, err_msg=name)
    # Equal gradients (their norm is compared above) give equal updates, up to reduction order:
    # the two jits need not fuse alike, and Adam divides each element's gradient by its own
    # scale, so one near zero moves by a sizeable share of the learning rate on float32 noise.
    lr = config.optimizer.learning_rate
    for new, old in zip(jax.tree.leaves(compiled_state.params), jax.tree.leaves(run_state.params),
                        strict=True):  # fmt: skip
        old = np.asarray(old, np.float32)
        checked = dict(rtol=1e-5, atol=8 * ulp(old) + 0.05 * lr)
        np.testing.assert_allclose(np.asarray(new, np.float32), old, **checked)


def test_an_unknown_method_names_the_available_ones():
    config = small_config()
    config.method = "dpoo"
    with pytest.raises(ConfigError, match="available: sft, dpo, iterative_dpo, rm, grpo, ppo"):
        methods.method_config(config)


# Drivers and stages: only their records (`posttrain.methods.get(name).run`, `run_from_config`)
# are reached from outside `posttrain/methods/`.
DRIVERS = {"run_sft", "run_dpo", "run_reward_model", "run_rl", "run_iterative_dpo", "offline_rl",
           "rejection_sampling", "filter_by_difficulty"}  # fmt: skip
POSTTRAIN = pathlib.Path(__file__).resolve().parents[1] / "posttrain"


def driver_uses(source: str) -> list[str]:
    """`name:line` of every driver `source` imports or names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"{a.name}:{node.lineno}" for a in node.names if a.name in DRIVERS]
        elif isinstance(node, ast.Attribute) and node.attr in DRIVERS:
            found.append(f"{node.attr}:{node.lineno}")
        elif isinstance(node, ast.Name) and node.id in DRIVERS:
            found.append(f"{node.id}:{node.lineno}")
    return found


def notebook_code(path: pathlib.Path) -> str:
    """A notebook's code cells as one module (shell and magic lines left out)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = [line.rstrip("\n") for c in cells for line in c["source"]]
    return "\n".join(x for x in lines if not x.lstrip().startswith(("!", "%")))


def test_only_the_methods_package_reaches_a_driver():
    outside = [p for p in sorted(POSTTRAIN.rglob("*.py")) if "methods" not in p.parts]
    found = [f"{p.relative_to(POSTTRAIN)}:{use}" for p in outside for use in driver_uses(
        p.read_text())]  # fmt: skip
    notebooks = sorted((POSTTRAIN.parent / "notebooks").glob("*.ipynb"))
    assert notebooks
    found += [f"{p.name}:{use}" for p in notebooks for use in driver_uses(notebook_code(p))]
    assert found == []
    # The check itself: a driver imported, or called off the package, is caught.
    probe = "from posttrain.methods import run_sft\nimport posttrain.methods as m\nm.run_rl(c, w)\n"
    assert driver_uses(probe) == ["run_sft:1", "run_rl:3"]
    assert driver_uses("from posttrain.methods import get\nget('sft').run(c, w)\n") == []


@pytest.mark.parametrize(
    "method, file, match",
    [
        ("ppo", "grpo.py", "method=ppo trains a critic: set algorithm.advantage=gae"),
        ("grpo", "ppo.py", "algorithm.advantage=gae .* is PPO: set method=ppo"),
        ("distill", "grpo.py", "method=distill needs a teacher: set distill.teacher"),
    ],
)
def test_rl_records_refuse_another_methods_config(method, file, match, tmp_path):
    config = toy_config("tiny", file)
    _, built = methods.method_config(config)  # (its own method takes it)
    config.method = method
    with pytest.raises(ConfigError, match=match):
        methods.method_config(config)
    with pytest.raises(ConfigError, match=match):  # the record's run, before anything starts
        methods.get(method).run(built, str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_rl_records_take_their_own_configs():
    for method, file, values in [("grpo", "grpo.py", {}), ("ppo", "ppo.py", {}),
                                 ("distill", "grpo.py", {"distill__teacher": "teacher"}),
                                 ("grpo", "grpo.py", {"distill__teacher": "teacher"})]:  # fmt: skip
        config = toy_config("tiny", file, **values)
        config.method = method
        record, built = methods.method_config(config)
        assert record.name == method and built.ppo == (method == "ppo")


def _spec(tree) -> dict:
    return {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in tree.items()}


def test_sft_batch_spec_is_the_pipelines_batch():
    """The abstract batch the compile lowers (`Method.batch`) is what SFT's data source
    yields, name for name, shape for shape, dtype for dtype."""
    from posttrain.data import make_pipeline
    from posttrain.parallel import make_mesh

    _, c = methods.method_config(small_config(data__batch_size=4, data__max_len=32))
    abstract, tokens, length = methods.get("sft").batch(c, make_mesh(c.mesh, jax.devices()))
    batch = next(iter(make_pipeline(c.data, c.tokenizer or c.model.hf_path)))
    assert _spec(abstract) == _spec(batch)
    assert (tokens, length) == (4 * 32, 32)


@pytest.mark.parametrize("method", ["dpo", "rm"])
def test_preference_batch_spec_is_the_pipelines_batch(method, pair_files):  # noqa: F811
    from posttrain.data import make_preference_pipeline
    from posttrain.parallel import make_mesh

    values = {"loss.reference": "on_the_fly"} if method == "dpo" else {"file": "rm.py"}
    config = dpo_config(pair_files, **values)
    _, c = methods.method_config(config)
    abstract, _, _ = methods.get(method).batch(c, make_mesh(c.mesh, jax.devices()))
    batch = next(iter(make_preference_pipeline(c.data, c.tokenizer or c.model.hf_path)))
    assert _spec(abstract) == _spec(batch)
