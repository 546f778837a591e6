"""Hugging Face dataset folders read in place: the data files of one split.

Two layouts are recognised:

- What `datasets`' `save_to_disk` writes: a `Dataset` folder (`state.json` naming its Arrow
  files, `data-00000-of-00001.arrow`, ...) or a `DatasetDict` folder (`dataset_dict.json` naming
  the splits, one such folder per split).
- A dataset repository's layout (a Hub download or `Dataset.to_parquet` into one): Parquet,
  Arrow or JSON-lines files, split as `datasets.load_dataset` splits them: by the `configs:`
  section of the dataset card (README.md's YAML header) when it has one, else by
  `data/<split>-00000-of-00001.*` names, else by a split's keyword ("train", "validation",
  "dev", "test", ...) in a directory or file name; files that name no split are all "train".

The column mapping a source configures is applied by `Records`; this module only finds files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# The data files read (`_sources._KINDS`) and the split keywords of `datasets.load_dataset`.
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")
_SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = r"[-._ 0-9]"
_SHARDED = re.compile(r"data/(?P<split>\w+)-\d{5}-of-\d{5}[^/]*$")
_NOT_DATA = {"dataset_info.json", "state.json", "dataset_dict.json", "config.json"}


def is_dataset_folder(path: Path) -> bool:
    """Whether `path` is a directory that `split_files` reads (it holds a data file)."""
    return path.is_dir() and bool(_data_files(path))


def split_files(folder: Path, split: str) -> tuple[list[Path], str]:
    """The data files of `split` ("" for the only one) in the dataset folder `folder`, in order,
    and the split's name.

    Raises:
      ValueError: the folder names several splits and `split` is empty, `split` is not one of
        them, or its files are missing (the message lists the splits there are).
    """
    splits = _splits(folder)
    if not split:
        if len(splits) > 1:
            raise ValueError(
                f"dataset folder {folder} holds the splits {sorted(splits)}; set the source's "
                "split to one of them"
            )
        split = next(iter(splits))
    if split not in splits:
        raise ValueError(f"dataset folder {folder} has no split {split!r}; it has {sorted(splits)}")
    files = splits[split]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ValueError(f"dataset folder {folder}, split {split!r}: missing files {missing}")
    unreadable = [f.name for f in files if f.suffix.lower() not in DATA_SUFFIXES]
    if unreadable:
        raise ValueError(
            f"dataset folder {folder}, split {split!r}: {unreadable[:3]} are not files posttrain "
            f"reads ({', '.join(DATA_SUFFIXES)}); convert them, e.g. with Dataset.to_parquet"
        )
    return files, split


def _splits(folder: Path) -> dict[str, list[Path]]:
    if (folder / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk
        names = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        return {name: _saved_files(folder / name) for name in names}
    if (folder / "state.json").is_file():  # Dataset.save_to_disk
        state = json.loads((folder / "state.json").read_text())
        return {state.get("_split") or "train": _saved_files(folder)}
    if (card := _card_configs(folder)) is not None:
        return card
    files = _data_files(folder)
    if not files:
        raise ValueError(
            f"dataset folder {folder} holds no data files ({', '.join(DATA_SUFFIXES)})"
        )
    relative = {f: f.relative_to(folder).as_posix() for f in files}
    sharded = {f: m["split"] for f, r in relative.items() if (m := _SHARDED.match(r))}
    if sharded:
        return _group(sharded)
    for where in (_in_directory, _in_file_name):
        named = {f: s for f, r in relative.items() if (s := where(r))}
        if named:
            return _group(named)
    return {"train": files}


def _saved_files(folder: Path) -> list[Path]:
    """The Arrow files of one `save_to_disk` split, in the order `state.json` lists them."""
    state = json.loads((folder / "state.json").read_text())
    return [folder / f["filename"] for f in state["_data_files"]]


def _data_files(folder: Path) -> list[Path]:
    return sorted(
        f
        for f in folder.rglob("*")
        if f.is_file()
        and f.suffix.lower() in DATA_SUFFIXES
        and f.name not in _NOT_DATA
        and not any(p.startswith(".") for p in f.relative_to(folder).parts)
    )


def _in_directory(relative: str) -> str | None:
    for split, keywords in _SPLIT_KEYWORDS.items():
        for directory in relative.split("/")[:-1]:
            if any(re.fullmatch(rf"(.*{_SEP})?{k}({_SEP}.*)?", directory) for k in keywords):
                return split
    return None


def _in_file_name(relative: str) -> str | None:
    name = relative.rsplit("/", 1)[-1]
    for split, keywords in _SPLIT_KEYWORDS.items():
        if any(re.fullmatch(rf"(.*{_SEP})?{k}{_SEP}.*", name) for k in keywords):
            return split
    return None


def _group(split_of: dict[Path, str]) -> dict[str, list[Path]]:
    splits: dict[str, list[Path]] = {}
    for f in sorted(split_of):
        splits.setdefault(split_of[f], []).append(f)
    return splits


def _card_configs(folder: Path) -> dict[str, list[Path]] | None:
    """The splits of the card's default config (`configs:` in README.md's YAML header: the one
    marked `default: true`, else the one named "default", else the first); None without one."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(encoding="utf-8", errors="replace")
    header = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not header:
        return None
    import yaml

    try:
        meta = yaml.safe_load(header.group(1)) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{card}: its YAML header does not parse ({e})") from None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not configs:
        return None
    chosen = next(
        (c for c in configs if c.get("default")),
        next((c for c in configs if c.get("config_name") == "default"), configs[0]),
    )
    data_files = chosen.get("data_files")
    if isinstance(data_files, str | list) and not (
        isinstance(data_files, list) and data_files and isinstance(data_files[0], dict)
    ):
        data_files = [{"split": "train", "path": data_files}]
    if not isinstance(data_files, list):
        raise ValueError(f"{card}: config {chosen.get('config_name')!r} has no data_files list")
    splits = {}
    for entry in data_files:
        patterns = entry["path"] if isinstance(entry["path"], list) else [entry["path"]]
        splits[entry["split"]] = sorted({f for p in patterns for f in folder.glob(p)})
    return splits
