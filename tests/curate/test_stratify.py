"""`posttrain data stratify`: records into difficulty buckets by a score field or an RL run's
pass rates, as files a curriculum schedules."""

import json

import pytest

from posttrain.cli.data_stratify import main
from posttrain.curate import stratify_records
from posttrain.data import read_records
from posttrain.errors import UserError
from tests.data.conftest import write_records

RATES = [0.9, 0.1, 0.5, None, 0.0, 0.7, 0.3, 1.0, 0.6, 0.2]  # None: no score


def _prompts(tmp_path):
    records = [{"prompt": f"q{i}", **({} if r is None else {"pass_rate": r})}
               for i, r in enumerate(RATES)]  # fmt: skip
    return str(write_records(tmp_path / "prompts.jsonl", records))


def _prompts_in(path):
    return [r["prompt"] for r, _ in read_records(str(path))]


def test_quantile_buckets_hardest_first_from_a_score_field(tmp_path):
    report = stratify_records(_prompts(tmp_path), str(tmp_path / "b"), score_field="pass_rate",
                              progress=False)  # fmt: skip
    # 9 scored: sorted by rate q4 0.0, q1 .1, q9 .2 | q6 .3, q2 .5, q8 .6 | q5 .7, q0 .9, q7 1.
    assert _prompts_in(tmp_path / "b" / "hard.jsonl") == ["q1", "q4", "q9"]  # input order
    assert _prompts_in(tmp_path / "b" / "medium.jsonl") == ["q2", "q6", "q8"]
    assert _prompts_in(tmp_path / "b" / "easy.jsonl") == ["q0", "q5", "q7"]
    assert [b["records"] for b in report["buckets"]] == [3, 3, 3] and report["unscored"] == 1
    assert report["buckets"][0]["score_min"] == 0.0 and report["buckets"][2]["score_max"] == 1.0
    assert json.loads((tmp_path / "b" / "stratify.json").read_text()) == report


def test_fixed_edges_from_an_rl_runs_pass_rates_through_the_cli(tmp_path, capsys):
    rates = {str(i): r for i, r in enumerate(RATES) if r is not None}
    difficulty = tmp_path / "difficulty.json"
    difficulty.write_text(json.dumps({"key": {}, "pass_rates": rates}))
    out = tmp_path / "b"
    argv = ["posttrain data stratify", f"--input={_prompts(tmp_path)}", f"--out={out}",
            f"--pass-rates={difficulty}", "--edges=0.25,0.75", "--names=hard,mid,easy",
            "--format=parquet"]  # fmt: skip
    assert main(argv) == 0
    assert _prompts_in(out / "hard.parquet") == ["q1", "q4", "q9"]  # < 0.25
    assert _prompts_in(out / "mid.parquet") == ["q2", "q5", "q6", "q8"]
    assert _prompts_in(out / "easy.parquet") == ["q0", "q7"]  # >= 0.75
    assert "hard" in capsys.readouterr().out
    with pytest.raises(UserError, match="--score-field=FIELD, --pass-rates=FILE or --model"):
        main(["posttrain data stratify", "--input=x.jsonl", f"--out={out}"])
    with pytest.raises(ValueError, match="line 2: score pass_rate='high' is not a number"):
        bad = write_records(tmp_path / "bad.jsonl", [{"pass_rate": 0.5}, {"pass_rate": "high"}])
        stratify_records(str(bad), str(tmp_path / "c"), score_field="pass_rate", progress=False)
    assert not (tmp_path / "c").exists()  # nothing written before the scores are read
