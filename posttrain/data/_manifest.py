"""The data manifest: which files, config and tokenizer the batches are made of."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from posttrain.data._data_config import DataConfig
from posttrain.data._sources import Records
from posttrain.data._tokenizer import Tokenizer


def _sha256_file(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def data_manifest(
    config: DataConfig, tokenizer: Tokenizer, records: list[Records], process_count: int
) -> dict[str, Any]:
    """The sources' files (sha256, record counts), the data config and the tokenizer's identity,
    as JSON; hashing reads every data file once."""
    root = Path(tokenizer.name_or_path)
    template = tokenizer.chat_template
    return {
        "sources": [
            {
                "path": s.path,
                "domain": s.domain,
                "weight": s.weight,
                "format": s.format,
                **({"split": recs.split} if recs.split else {}),  # a dataset folder's
                **({"columns": s.columns} if s.columns else {}),
                "records": len(recs),
                "files": recs.describe(),
                **({"build": recs.build} if recs.build else {}),  # a `posttrain data build`
            }
            for s, recs in zip(config.sources, records, strict=True)
        ],
        "config": json.loads(
            json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k != "sources"})
        ),
        "tokenizer": {
            "path": tokenizer.name_or_path,
            "sha256": _sha256_file(root / "tokenizer.json")
            or hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest(),
            "chat_template_sha256": template and hashlib.sha256(template.encode()).hexdigest(),
        },
        "process_count": process_count,
    }
