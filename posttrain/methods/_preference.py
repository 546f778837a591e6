"""What DPO and reward-model runs share around the loss: the preference data (with its counts
in the manifest), the reference log-probs precomputed once per dataset, and held-out
evaluation."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.data import make_preference_pipeline
from posttrain.train import each_batch, local_rows, summed

log = logging.getLogger(__name__)


def attach_reference(data, ref_params_fn, score, mesh, path: str, identity: dict) -> bool:
    """Precomputes the reference log-probs of every pair of `data` once and attaches them.

    They are stored in `path` (one file per process) with a key made of the pairs' tokens and
    `identity` (the reference model), so a resumed run reads them back instead of recomputing;
    `ref_params_fn()` loads the reference weights (with LoRA: the frozen base), only when
    they are needed, and `score(weights, batch)` returns `ref_chosen_logps` and
    `ref_rejected_logps` (`posttrain.train.reference_logps`).

    Returns:
      True if they were computed, False if read back from `path`.
    """
    key = hashlib.sha256(
        json.dumps({"pairs": data.fingerprint(), "reference": identity}, sort_keys=True).encode()
    ).hexdigest()
    if paths.path(path).exists():
        with np.load(io.BytesIO(paths.path(path).read_bytes())) as saved:
            if str(saved["key"]) == key:
                data.set_reference(saved["chosen"], saved["rejected"])
                return False
        log.warning("%s belongs to other pairs or another reference; recomputing", path)
    ref_params = ref_params_fn()
    chosen, rejected = [], []
    batches = data.ordered_batches()
    total = -(-len(data.pairs) // data.rows)
    bar = tqdm(total=total, desc="reference log-probs", disable=jax.process_index() > 0)
    for batch, real in each_batch(batches, mesh):
        out = score(ref_params, batch)
        if real:
            chosen.append(local_rows(out["ref_chosen_logps"], mesh))
            rejected.append(local_rows(out["ref_rejected_logps"], mesh))
            bar.update(1)
    bar.close()
    n = len(data.pairs)
    chosen, rejected = np.concatenate(chosen)[:n], np.concatenate(rejected)[:n]
    data.set_reference(chosen, rejected)
    buffer = io.BytesIO()
    np.savez(buffer, key=np.asarray(key), chosen=chosen, rejected=rejected)
    paths.write_bytes(path, buffer.getvalue())
    return True


def preference_data(config, tokenizer, workdir: str, vision=None):
    """A preference run's (train data, eval data or None, manifest); bad pairs are counted (or
    raised) here, and the counts written with the manifest to `workdir/manifest.json`.
    `vision`: a VLM's vision config (pairs may hold images)."""
    data = make_preference_pipeline(config.data, tokenizer, vision=vision)
    log.info("preference data: %s", {k: v for k, v in data.stats.items() if k != "errors"})
    manifest = data.manifest()
    manifest_json = json.dumps({**manifest, "pairs": data.stats}, indent=2)
    paths.write_text(paths.join(workdir, "manifest.json"), manifest_json)
    eval_data = None
    if config.eval_data:
        eval_config = dataclasses.replace(
            config.data, sources=config.eval_data, shuffle=False, num_epochs=1
        )
        eval_data = make_preference_pipeline(
            eval_config, tokenizer, domains=data.domains, vision=vision
        )
    return data, eval_data, manifest


class PreferenceEvaluator:
    """Held-out pairs: mean loss, accuracy, margin and per-domain accuracy (a full pass).

    `loss(inputs)` builds the loss function, as for `train` (`inputs`: named frozen inputs,
    an on-the-fly reference or a LoRA run's frozen base)."""

    def __init__(self, data, loss, mesh, shardings, max_batches, domains, inputs=None,
                 input_sh=None):  # fmt: skip
        self.data, self.mesh, self.max_batches = data, mesh, max_batches
        self.domains, self.inputs = domains, dict(inputs or {})
        self._step = jax.jit(
            lambda params, inputs, batch: loss(inputs)(params, batch, None),
            in_shardings=(shardings, dict(input_sh or {}), None),
        )

    def __call__(self, state) -> dict:
        step = lambda params, batch: self._step(params, self.inputs, batch)
        batches = self.data.ordered_batches()
        totals = summed(step, state.params, batches, self.mesh, self.max_batches)
        n = max(totals.get("num_tokens", 0.0), 1.0)
        metrics = {
            "eval_loss": totals["loss_sum"] / n,
            "eval_accuracy": totals["accuracy_sum"] / n,
            "eval_rewards/margins": totals["rewards/margins_sum"] / n,
            "eval_rewards/chosen": totals["rewards/chosen_sum"] / n,
            "eval_rewards/rejected": totals["rewards/rejected_sum"] / n,
            "eval_pairs": totals.get("num_tokens", 0.0),
        }
        for name in self.domains:
            count = totals.get(f"accuracy/{name}_count", 0.0)
            if count:
                metrics[f"eval_accuracy/{name}"] = totals[f"accuracy/{name}_sum"] / count
        return metrics
