"""Long-context retrieval on a length x depth grid (`LongContextTask`) and its heatmaps.

The task's records are generated (`posttrain.data.long_context_records`, seeded: the same at
every checkpoint) and scored by greedy exact match in one teacher-forced pass per batch (the
answer and end of turn must be the argmax at every position), one batch shape per length.
"""

from __future__ import annotations

import io
import math

import numpy as np

from posttrain import paths
from posttrain.data import long_context_records, read_paragraphs
from posttrain.eval._exact_match import greedy_exact_match
from posttrain.eval._tasks import progress_bar


def cell_name(length: int, depth: float) -> str:
    return f"L{length}_d{depth:g}"


def long_context_metrics(model, tokenizer, task, *, progress: bool = True) -> dict[str, float]:
    """`accuracy` (all cells), `accuracy/L<length>_d<depth>` per cell, `examples`."""
    paragraphs = read_paragraphs(task.haystack) if task.haystack else []
    records = long_context_records(
        paragraphs, tokenizer, kind=task.kind, lengths=task.lengths, depths=task.depths,
        per_cell=task.per_cell, needles=task.needles, key_chars=task.key_chars,
        value_digits=task.value_digits, seed=task.seed,
    )  # fmt: skip
    metrics, hits = {}, []
    with progress_bar(f"long_context/{task.name}", len(records), progress) as bar:
        for length in task.lengths:  # one scoring call (one compiled shape) per length
            column = [r for r in records if r["target_length"] == length]
            ok = greedy_exact_match(model, tokenizer, column, batch_size=task.batch_size)
            for depth in task.depths:
                cell = [o for o, r in zip(ok, column, strict=True) if r["depth"] == depth]
                metrics[f"accuracy/{cell_name(length, depth)}"] = float(np.mean(cell))
            hits += list(ok)
            bar.update(len(column))
    return {"accuracy": float(np.mean(hits)), **metrics, "examples": float(len(hits))}


def write_heatmaps(out_dir: str, rows: list[dict], tasks) -> list[str]:
    """A PNG per long-context task and evaluated checkpoint: accuracy by depth (rows) and
    length (columns), `<out_dir>/<task>_step<N>.png` (`_model` for an HF model); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in tasks:
        for row in rows:
            prefix = f"long_context/{task.name}/accuracy/"
            grid = np.asarray([[row["metrics"].get(prefix + cell_name(L, d), math.nan)
                                for L in task.lengths] for d in task.depths])  # fmt: skip
            if np.isnan(grid).all():
                continue
            fig, ax = plt.subplots(
                figsize=(1.2 * len(task.lengths) + 2, 0.6 * len(task.depths) + 1.5)
            )
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(task.lengths)), [f"{L:,}" for L in task.lengths])
            ax.set_yticks(range(len(task.depths)), [f"{d:.0%}" for d in task.depths])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("depth of the fact")
            step = "model" if row["step"] is None else f"step {row['step']}"
            ax.set_title(f"{task.name} ({task.kind}), {step}: accuracy")
            for (i, j), value in np.ndenumerate(grid):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
            fig.colorbar(image, ax=ax)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
            plt.close(fig)
            label = "model" if row["step"] is None else f"step{row['step']}"
            target = paths.join(out_dir, f"{task.name}_{label}.png")
            paths.write_bytes(target, buffer.getvalue())
            written.append(target)
    return written
