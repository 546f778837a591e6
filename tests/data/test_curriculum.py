"""Curriculum mixtures (`data.curriculum`): each phase's batches hold the scheduled share of
each source, every source's records continue across phases, resume is exact, and an SFT run
logs the per-source counts that show it."""

import json
import os

import numpy as np
import pytest

from posttrain.config import ConfigError, load_config_file
from posttrain.data import DataConfig, SourceConfig, make_pipeline
from posttrain.data._accounting import source_names
from posttrain.data._curriculum import CurriculumMap, Phase, proportions
from posttrain.methods import run_from_config
from posttrain.train import read_metrics
from tests.data.conftest import write_records
from tests.train.conftest import REPO, small_config

BUCKETS = ("easy", "medium", "hard")
SCHEDULE = (  # (steps, rows per batch from easy, medium, hard) with 4 rows per batch
    (2, (4, 0, 0)),
    (2, (2, 2, 0)),
    (None, (0, 1, 3)),
)
PHASES = (
    Phase(weights={"easy": 1.0}, steps=2),
    Phase(weights={"easy": 1.0, "medium": 1.0}, steps=2),
    Phase(weights={"medium": 1.0, "hard": 3.0}),
)


def test_phases_pick_their_shares_and_each_source_continues_where_it_was():
    lengths, weights = [8, 6, None], [[1, 0, 0], [1, 2, 0], [0, 1, 3]]
    picks = [CurriculumMap(lengths, weights)[i] for i in range(8 + 6 + 40)]
    sources = np.array([s for s, _ in picks])
    assert (sources[:8] == 0).all()
    assert np.bincount(sources[8:14], minlength=3).tolist() == [2, 4, 0]
    for period in range(10):  # the last phase: every 4 picks, 1 medium and 3 hard
        block = sources[14 + 4 * period : 18 + 4 * period]
        assert np.bincount(block, minlength=3).tolist() == [0, 1, 3]
    for s in range(3):  # no record of a source is skipped or repeated across phases
        keys = [k for src, k in picks if src == s]
        assert keys == list(range(len(keys)))
    assert proportions([0.2, 0.3, 0.5]) == [2, 3, 5]
    assert proportions([1, 0, 1e-6]) == [999, 0, 1]  # a positive weight keeps a share
    assert proportions([1, 1e-6, 1e-6]) == [999, 1, 1]  # (its share is not taken back twice)


def _sources(tmp_path):
    sources = []
    for b in BUCKETS:
        records = [{"text": f"{b} example {i}"} for i in range(7)]
        path = write_records(tmp_path / f"{b}.jsonl", records)
        sources.append(SourceConfig(str(path), domain=b))
    return tuple(sources)


def _rows_per_domain(data, batch):
    first = batch["domain_ids"][:, 0]
    return tuple(int((first == data.domains.index(b)).sum()) for b in BUCKETS)


def test_batches_follow_the_schedule_and_resume_exactly(tmp_path, chatml):
    config = DataConfig(
        sources=_sources(tmp_path), max_len=16, batch_size=4, packing=False, curriculum=PHASES
    )
    data = make_pipeline(config, chatml, process_index=0, process_count=1)
    batches = [next(data) for _ in range(8)]
    expected = [mix for steps, mix in SCHEDULE for _ in range(steps or 4)]
    assert [_rows_per_domain(data, b) for b in batches] == expected
    assert data.batch_metrics()["data/easy/used"] == 4 * 2 + 2 * 2  # (7 records: a 2nd epoch)

    data = make_pipeline(config, chatml, process_index=0, process_count=1)
    for _ in range(3):
        next(data)
    state = json.loads(json.dumps(data.get_state()))
    resumed = make_pipeline(config, chatml, process_index=0, process_count=1)
    resumed.set_state(state)
    for want in batches[3:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_rl_prompt_batches_follow_the_schedule_and_resume_exactly(tmp_path, chatml):
    """The RL prompt stream (`PromptData`) takes a curriculum too: a phase's steps are prompt
    batches drawn."""
    from posttrain.rl import PromptData

    sources = []
    for b in BUCKETS:
        records = [{"prompt": f"{b} problem {i}", "domain": b} for i in range(7)]
        sources.append(SourceConfig(str(write_records(tmp_path / f"{b}.jsonl", records))))
    config = DataConfig(sources=tuple(sources), max_len=16, batch_size=4, packing=False,
                        curriculum=PHASES)  # fmt: skip

    def prompts():
        return PromptData(config, chatml, max_prompt_len=16, process_index=0, process_count=1)

    data = prompts()
    batches = [next(data) for _ in range(8)]
    mixes = [tuple(sum(p["domain"] == b for p in batch) for b in BUCKETS) for batch in batches]
    assert mixes == [mix for steps, mix in SCHEDULE for _ in range(steps or 4)]
    easy = [p["record"]["prompt"] for batch in batches for p in batch if p["domain"] == "easy"]
    assert len(set(easy[:7])) == 7  # each source runs through its records before repeating

    data = prompts()
    for _ in range(3):
        next(data)
    resumed = prompts()
    resumed.set_state(json.loads(json.dumps(data.get_state())))
    assert [[p["record"] for p in next(resumed)] for _ in range(5)] == [
        [p["record"] for p in batch] for batch in batches[3:]
    ]


def test_bad_curricula_say_what_to_change(tmp_path):
    sources = _sources(tmp_path)
    base = dict(sources=sources, max_len=16, batch_size=4, packing=False)
    with pytest.raises(ValueError, match="unknown source.*'eassy'.*'easy', 'medium', 'hard'"):
        DataConfig(**base, curriculum=(Phase(weights={"eassy": 1.0}),))
    with pytest.raises(ValueError, match="set data.packing=False, or give the phase `examples`"):
        DataConfig(**{**base, "packing": True}, curriculum=PHASES)
    with pytest.raises(ValueError, match="only the last phase may omit"):
        DataConfig(**base, curriculum=(Phase(weights={"easy": 1.0}), *PHASES))
    with pytest.raises(ValueError, match="at least one weight must be > 0"):
        Phase(weights={"easy": 0.0}, steps=2)
    dpo = load_config_file(os.path.join(REPO, "configs", "dpo.py") + ":tiny")
    name = source_names([s["path"] for s in dpo.data.sources])[0]
    dpo.data.curriculum = [{"weights": {name: 1.0}}]
    with pytest.raises(ConfigError, match="data.curriculum: SFT runs only so far"):
        run_from_config(dpo, str(tmp_path / "dpo"))
    grpo = load_config_file(os.path.join(REPO, "configs", "grpo.py") + ":tiny")
    grpo.data.curriculum = [{"weights": {"train": 1.0}}]
    grpo.domains.adaptive = True
    with pytest.raises(ConfigError, match="turn domains.adaptive and domains.grouped off"):
        run_from_config(grpo, str(tmp_path / "grpo"))


def test_an_sft_run_logs_the_scheduled_bucket_counts(tmp_path):
    """configs/sft.py:tiny on three bucket files of demo records, 8 rows a step, the curriculum
    given as config dicts: data/<bucket>/used grows by the schedule's rows at every step."""
    demo = [json.loads(line) for line in open(small_config().data.sources[0]["path"])][:96]
    sources = []
    for i, b in enumerate(BUCKETS):
        path = write_records(tmp_path / "buckets" / f"{b}.jsonl", demo[i::3])
        sources.append({"path": str(path), "weight": 1.0, "domain": b, "format": "auto"})
    config = small_config(**{"data.packing": False, "train.steps": 6, "checkpoint.every": 6})
    config.data.sources = sources
    held_out = write_records(tmp_path / "held_out.jsonl", demo[:8])  # (not a curriculum source)
    config.eval_data = [{**sources[0], "path": str(held_out), "domain": "held_out"}]
    config.data.curriculum = [
        {"weights": {"easy": 1.0}, "steps": 2},
        {"weights": {"easy": 1.0, "medium": 1.0}, "steps": 2},
        {"weights": {"medium": 1.0, "hard": 3.0}},
    ]
    run_from_config(config, str(tmp_path / "run"))
    rows = read_metrics(str(tmp_path / "run"), "train")
    used = np.array([[r.get(f"data/{b}/used", 0.0) for b in BUCKETS] for r in rows])
    per_step = np.diff(np.vstack([np.zeros(3), used]), axis=0).astype(int).tolist()
    assert config.data.batch_size == 8
    assert per_step == [[2 * n for n in mix] for steps, mix in SCHEDULE for _ in range(steps or 2)]
