"""Reads back the spans `train.trace` writes (`<workdir>/traces/process<i>.jsonl`) as one tree
per step, checked to be whole: one root, every other span's parent present."""

import collections
import json
import pathlib


def read_spans(workdir) -> list[dict]:
    """Every span of every process, each with its "process" (from the span's resource)."""
    spans = []
    for path in sorted(pathlib.Path(workdir, "traces").glob("process*.jsonl")):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            span["process"] = span["resource"]["attributes"]["posttrain.process"]
            spans.append(span)
    return spans


def step_trees(workdir, kind: str = "step") -> dict[int, dict]:
    """{step: its tree} of the traces rooted at a `kind` span; a tree is the root span with
    "children" (lists of spans, each with its own "children")."""
    by_trace = collections.defaultdict(list)
    for span in read_spans(workdir):
        by_trace[span["context"]["trace_id"]].append(span)
    trees = {}
    for trace_id, spans in by_trace.items():
        ids = {s["context"]["span_id"]: s for s in spans}
        assert len(ids) == len(spans), f"trace {trace_id}: a span id twice"
        roots = [s for s in spans if s["parent_id"] is None]
        assert len(roots) == 1, f"trace {trace_id}: roots {[r['name'] for r in roots]}"
        for s in spans:
            s.setdefault("children", [])
            if s["parent_id"] is not None:
                assert s["parent_id"] in ids, f"{s['name']} of trace {trace_id}: no parent"
                ids[s["parent_id"]].setdefault("children", []).append(s)
        (root,) = roots
        if root["name"] == kind:
            step = root["attributes"]["step"]
            assert step not in trees, f"step {step}: two {kind} trees"
            trees[step] = root
    return trees


def names_below(span) -> collections.Counter:
    """The names of every span under `span` (not itself), counted."""
    names = collections.Counter()
    for child in span["children"]:
        names[child["name"]] += 1
        names += names_below(child)
    return names
