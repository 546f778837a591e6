"""Long-context tasks in the eval suite: a length x depth grid of greedy exact match, through
the suite's config, and a heatmap per checkpoint."""

import os

import matplotlib.image
import pytest

from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.eval import evaluate, load_eval_config
from posttrain.eval._long_context import write_heatmaps
from posttrain.models import Transformer, get_preset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = {
    "long_context": {
        "kv": {"kind": "kv", "lengths": [64, 128], "depths": [0.0, 1.0], "per_cell": 3,
               "key_chars": 2, "value_digits": 2, "batch_size": 3},
        "needle": {"kind": "needle", "haystack": [os.path.join(REPO, "docs", "*.md")],
                   "lengths": [200], "depths": [0.0, 0.5, 1.0], "per_cell": 2, "batch_size": 2},
    },
    "progress": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ASSETS_DIR / "tokenizer"))


def test_the_grid_reports_every_cell_and_draws_a_heatmap(tok, tmp_path):
    config = load_eval_config(SUITE)
    model = Transformer.init(get_preset("tiny"), 0)
    metrics = evaluate(model, tok, config)
    for name, lengths, depths, per_cell in [("kv", (64, 128), (0, 1), 3), ("needle", (200,),
                                            (0, 0.5, 1), 2)]:  # fmt: skip
        prefix = f"long_context/{name}/"
        cells = {k for k in metrics if k.startswith(prefix + "accuracy/")}
        assert cells == {f"{prefix}accuracy/L{L}_d{d:g}" for L in lengths for d in depths}
        assert metrics[prefix + "examples"] == len(cells) * per_cell
        assert metrics[prefix + "accuracy"] == 0.0  # a random model retrieves nothing
    rows = [{"step": 5, "metrics": {**metrics, "long_context/kv/accuracy/L128_d1": 0.5}}]
    written = write_heatmaps(str(tmp_path), rows, config.long_context)
    assert sorted(os.path.basename(p) for p in written) == ["kv_step5.png", "needle_step5.png"]
    image = matplotlib.image.imread(written[0])
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
