"""Building config dataclasses from config sections: nested sections keep their field's
defaults, a key that moved into a section or was retired is named, bad values name their
section."""

import ast
import dataclasses
import pathlib

import pytest

import posttrain
from posttrain.config import ConfigError, build
from posttrain.curate import SampleConfig
from posttrain.eval import TargetTask
from posttrain.rl import RolloutConfig
from posttrain.sampling import SamplingParams


def test_a_section_given_in_part_keeps_its_fields_default_for_the_rest():
    # RL samples at temperature 1 by default; SamplingParams' own default is greedy (0).
    rollout = build(RolloutConfig, {"sampling": {"top_p": 0.9}}, "rollout")
    assert rollout.sampling == SamplingParams(temperature=1.0, top_p=0.9, top_k=0)
    assert build(RolloutConfig, {}, "rollout").sampling == SamplingParams(temperature=1.0)
    pairs = build(SampleConfig, {"sampling": {"top_k": 5}}, "pairs")
    assert pairs.sampling == SamplingParams(temperature=1.0, top_k=5)


def test_a_key_that_moved_into_a_section_is_named():
    with pytest.raises(ConfigError, match=r"did you mean rollout\.sampling\.temperature\?"):
        build(RolloutConfig, {"temperature": 0.7}, "rollout")


def test_a_retired_rollout_key_names_what_replaces_it():
    """The engine's settings moved into rollout.engine (an EngineConfig) and the static sampler
    is gone: each old key is one error naming the key to set instead."""
    retired = {
        "engine_slots": ("rollout.engine.slots", 4),
        "kv_block_size": ("rollout.engine.block_size", 32),
        "kv_dtype": ("rollout.engine.kv_dtype", "int8"),
        "unstack_layers": ("rollout.engine.unstack_layers", False),
        "sampler": ("rollout.engine.prefix_sharing=False", "static"),
    }
    for old, (new, value) in retired.items():
        with pytest.raises(ConfigError) as error:
            build(RolloutConfig, {old: value}, "rollout")
        assert f"rollout has no key {old!r} any more" in str(error.value)
        assert new in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match="every rollout decodes on the engine"):
        build(RolloutConfig, {"sampler": "engine"}, "rollout")
    engine = build(RolloutConfig, {"engine": {"block_size": 32}}, "rollout").engine
    assert (engine.slots, engine.block_size) == (0, 32)  # (the rollout's default: sized to work)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
    ],
)
def test_sampling_out_of_range_names_its_section(section, message):
    with pytest.raises(ConfigError, match=rf"rollout\.sampling: {message}"):
        build(RolloutConfig, {"sampling": section}, "rollout")


def test_pass_at_k_needs_sampled_answers():
    with pytest.raises(ConfigError, match="pass@k samples need temperature > 0"):
        build(TargetTask, {"name": "t", "path": "x.jsonl", "num_samples": 4,
                           "sampling": {"temperature": 0.0}}, "target.t")  # fmt: skip


# A field that shares a name with a sampling setting but means something else.
NOT_SAMPLING = {("posttrain/models/_components.py", "MoEConfig", "top_k"): "experts per token"}


def _dataclass_fields(root):
    """(path, class, field) of every annotated field of every `@dataclass` under `root`."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or not any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            ):
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    yield str(path.relative_to(root.parent)), node.name, item.target.id


def test_every_sampling_setting_is_declared_once():
    """temperature/top_p/top_k are fields of SamplingParams only: generate's engine requests,
    serve, eval, RL rollouts and the data tools hold a SamplingParams instead of their own."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    declared = [
        (path, cls, name)
        for path, cls, name in _dataclass_fields(pathlib.Path(posttrain.__file__).parent)
        if name in names and (path, cls, name) not in NOT_SAMPLING
    ]
    assert declared == [("posttrain/sampling/_params.py", "SamplingParams", n) for n in
                        ("temperature", "top_p", "top_k")], declared  # fmt: skip


def test_the_declaration_check_sees_a_second_record(tmp_path):
    package = tmp_path / "posttrain"
    package.mkdir()
    (package / "a.py").write_text(
        "import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass Rollout:\n"
        "    steps: int = 1\n    temperature: float = 1.0\n"
    )
    assert list(_dataclass_fields(package)) == [
        ("posttrain/a.py", "Rollout", "steps"),
        ("posttrain/a.py", "Rollout", "temperature"),
    ]
