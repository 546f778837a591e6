"""Hugging Face dataset folders read in place: `save_to_disk` folders and dataset-repository
layouts written by the `datasets` library itself, their splits as `datasets.load_dataset` finds
them, and column mappings; SFT, preference and RL prompt batches from them equal those of the
same records as JSON lines. (An SFT run on a `save_to_disk` folder: tests/train/test_sft.py; the
eval suite on mapped folders: tests/eval/test_harness.py.)"""

import itertools
import json
import shutil

import datasets
import numpy as np
import pytest

from posttrain.config import ConfigError, build
from posttrain.data import DataConfig, Records, load_tokenizer, make_pipeline
from posttrain.data._data_config import config_identity
from posttrain.data._preference_data import make_preference_pipeline
from posttrain.demo import ASSETS_DIR
from posttrain.rl._prompts import PromptData

# The demo's records, with a dataset's own column names: {field: column}.
COLUMNS = {"messages": "conversation", "prompt": "question", "answer": "solution"}


def _demo(n):
    with open(ASSETS_DIR / "train.jsonl") as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


def _renamed(records, columns=COLUMNS):
    return [{columns.get(k, k): v for k, v in r.items()} for r in records]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ASSETS_DIR / "tokenizer")


def _batches(data, n=3):
    return [jax_free(b) for b in itertools.islice(iter(data), n)]


def jax_free(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _data(path, packing=True, **source):
    return build(
        DataConfig,
        {"sources": [{"path": path, "domain": "arithmetic", **source}], "max_len": 64,
         "batch_size": 8, "seed": 3, "packing": packing},
    )  # fmt: skip


def test_sft_batches_from_a_save_to_disk_dict_equal_the_jsonl_ones(tmp_path, tokenizer):
    records = _demo(40)
    train, test = records[:32], records[32:]
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(_renamed(train)),
        test=datasets.Dataset.from_list(_renamed(test)),
    ).save_to_disk(folder)
    for split, rows in (("train", train), ("test", test)):
        plain = make_pipeline(_data(_jsonl(tmp_path / f"{split}.jsonl", rows)), tokenizer,
                              process_index=0, process_count=1)  # fmt: skip
        mapped = _data(str(folder), split=split, columns=COLUMNS)
        saved = make_pipeline(mapped, tokenizer, process_index=0, process_count=1)
        _assert_same(_batches(plain), _batches(saved))
    # Several splits and none chosen: one error naming them.
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]; set the source"):
        make_pipeline(_data(str(folder)), tokenizer, process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"has no split 'dev'; it has \['test', 'train'\]"):
        Records(str(folder), "dev")
    # A mapping that names a column the data lacks: one error listing the columns there are.
    with pytest.raises(ValueError, match=r"columns names \['query'\], .* its columns are \["):
        Records(str(folder), "train", {"prompt": "query"})


def test_preference_and_rl_prompt_batches_from_mapped_folders(tmp_path, tokenizer):
    """A preference source from a `save_to_disk` Dataset and RL prompts from a Hub-layout
    Parquet folder, both with their own column names, batch as their JSONL."""
    records = _demo(24)
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"] + "0"}
             for r in records]  # fmt: skip
    names = {"prompt": "instruction", "chosen": "good", "rejected": "bad"}
    datasets.Dataset.from_list(_renamed(pairs, names)).save_to_disk(tmp_path / "pairs")
    plain = make_preference_pipeline(
        _data(_jsonl(tmp_path / "pairs.jsonl", pairs), packing=False), tokenizer, process_index=0,
        process_count=1)  # fmt: skip
    mapped = make_preference_pipeline(
        _data(str(tmp_path / "pairs"), packing=False, columns=names), tokenizer, process_index=0,
        process_count=1)  # fmt: skip
    _assert_same(_batches(plain), _batches(mapped))

    hub = tmp_path / "hub"
    datasets.Dataset.from_list(_renamed(records)).to_parquet(
        hub / "data" / "train-00000-of-00001.parquet"
    )
    datasets.Dataset.from_list(_renamed(records[:4])).to_parquet(
        hub / "data" / "test-00000-of-00001.parquet")  # fmt: skip
    (hub / "README.md").write_text("# a dataset card without a YAML header\n")
    prompts = PromptData(_data(str(hub), split="train", columns=COLUMNS), tokenizer,
                         max_prompt_len=32, process_index=0, process_count=1)  # fmt: skip
    expected = PromptData(_data(_jsonl(tmp_path / "p.jsonl", records)), tokenizer,
                          max_prompt_len=32, process_index=0, process_count=1)  # fmt: skip
    got, want = list(itertools.islice(iter(prompts), 3)), list(itertools.islice(iter(expected), 3))
    assert [[p["prompt_ids"] for p in b] for b in got] == [[p["prompt_ids"] for p in b]
                                                            for b in want]  # fmt: skip
    assert [[p["record"] for p in b] for b in got] == [[p["record"] for p in b] for b in want]


def _write(path, rows):
    """`rows` as a one-split dataset file of `path`'s kind, written by `datasets`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(rows)
    if path.suffix == ".arrow":  # save_to_disk's Arrow file, moved to where the name says
        dataset.save_to_disk(path.parent / "_saved")
        (path.parent / "_saved" / "data-00000-of-00001.arrow").rename(path)
        shutil.rmtree(path.parent / "_saved")
    else:
        (dataset.to_parquet if path.suffix == ".parquet" else dataset.to_json)(str(path))


@pytest.mark.parametrize(
    "files, card, expected",
    [
        # data/<split>-NNNNN-of-NNNNN: the split is the name's first part.
        (["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
          "data/validation-00000-of-00001.parquet"], None,
         {"train": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"],
          "validation": ["data/validation-00000-of-00001.parquet"]}),
        # A split's keyword in a directory name wins over file names.
        (["dev/a.jsonl", "train/b.jsonl", "train/c.jsonl"], None,
         {"validation": ["dev/a.jsonl"], "train": ["train/b.jsonl", "train/c.jsonl"]}),
        # In file names: a keyword bounded by separators or digits only ("contest" is none).
        (["my_test.jsonl", "train.jsonl", "contest.jsonl"], None,
         {"test": ["my_test.jsonl"], "train": ["train.jsonl"]}),
        # No split named anywhere: every file is "train".
        (["a.parquet", "b.arrow"], None, {"train": ["a.parquet", "b.arrow"]}),
        # The card's `configs` decide, its default config first.
        (["x/one.jsonl", "x/two.jsonl", "y/three.jsonl"],
         "configs:\n- config_name: other\n  data_files: y/*.jsonl\n- config_name: main\n"
         "  default: true\n  data_files:\n  - split: held_out\n    path: x/t*.jsonl\n"
         "  - split: train\n    path: [x/one.jsonl, y/three.jsonl]\n",
         {"held_out": ["x/two.jsonl"], "train": ["x/one.jsonl", "y/three.jsonl"]}),
    ],
)  # fmt: skip
def test_splits_are_found_as_load_dataset_finds_them(tmp_path, files, card, expected):
    for name in files:
        _write(tmp_path / name, [{"text": f"{name} row"}])
    if card is not None:
        (tmp_path / "README.md").write_text(f"---\n{card}---\n# card\n")
    for split, names in expected.items():
        recs = Records(str(tmp_path), split)
        got = [json.loads(r) if isinstance(r, bytes) else r for r, _ in
               (recs[i] for i in range(len(recs)))]  # fmt: skip
        assert [g["text"].split()[0] for g in got] == names, split
    # The same folders through `datasets` (what a user's own code would see), for the layouts
    # it reads without a loading script: the same splits with the same rows.
    if card is None and not any(n.endswith(".arrow") for n in files) and len(
            {n.rsplit(".", 1)[1] for n in files}) == 1:  # fmt: skip
        loaded = datasets.load_dataset(str(tmp_path))
        assert {s: [r["text"].split()[0] for r in loaded[s]] for s in loaded} == expected


def test_a_column_mapping_renames_only_what_it_names(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"q": "1+1", "a": "2", "prompt": "old", "id": 7}])
    raw, where = Records(path, columns={"prompt": "q", "answer": "a"})[0]
    assert raw == {"prompt": "1+1", "answer": "2", "id": 7} and where == f"{path} line 1"
    with pytest.raises(ConfigError, match=r"columns reads the column 'q' into several fields"):
        _data(path, columns={"prompt": "q", "question": "q"})
    with pytest.raises(ValueError, match=r"split='train' needs a dataset folder"):
        Records(path, "train")
    # A source at its defaults names neither field in a pipeline state's identity, so states
    # saved before they existed still resume.
    source = config_identity(_data(path))["sources"][0]
    assert "split" not in source and "columns" not in source
    assert config_identity(_data(path, split="x"))["sources"][0]["split"] == "x"
