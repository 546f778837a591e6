"""Orbax checkpoints: async saves, keep-last-K plus keep-best, resharding restore, fallback.

A checkpoint holds the train state (params, optimizer state, step, rng, counters), the data
iterator state of every process, the run config and the dataset manifest.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from posttrain import paths

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # save every N steps (and at the end, on SIGTERM and on a NaN stop)
    keep_last: int = 3  # most recent checkpoints kept
    keep_best: int = 1  # checkpoints with the lowest eval loss kept in addition (0: none)
    async_save: bool = True  # write in a background thread while training continues


class Checkpointer:
    """Saves and restores train states under `<workdir>/checkpoints/<step>`."""

    def __init__(self, workdir: str, config: CheckpointConfig):
        self.directory = paths.path(workdir) / "checkpoints"  # local or gs://
        self.every = config.every
        keep = [policies.LatestN(n=config.keep_last)]
        if config.keep_best:
            keep.append(
                policies.BestN(
                    get_metric_fn=lambda m: m["eval_loss"],
                    reverse=True,  # sorted high to low: the last n are the lowest losses
                    n=config.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=config.async_save,
            save_interval_steps=1,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state,
        *,
        data_state: dict | None = None,
        extra: dict | None = None,
        metrics: dict | None = None,
        force: bool = False,
    ) -> bool:
        """Starts writing `state` at `step` (async); `extra` holds JSON items (config, manifest).

        Every process calls this; each contributes its shards and its own data-iterator state.
        """
        items = {"state": ocp.args.StandardSave(state)}
        data = {f"process_{jax.process_index()}": data_state} if data_state is not None else {}
        items["data"] = ocp.args.JsonSave(data)
        for name, value in (extra or {}).items():
            items[name] = ocp.args.JsonSave(value)
        return self.manager.save(
            step, args=ocp.args.Composite(**items), metrics=metrics, force=force
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore(self, abstract_state, *, step: int | None = None):
        """Restores the newest readable checkpoint onto `abstract_state`'s shardings.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings, possibly on a
        different mesh than the one that saved: Orbax reads each device's shard directly. A
        checkpoint that fails to load (corrupt or partial) is skipped with a warning and the
        previous one is tried; none readable raises.

        Returns:
          (step, state, data_state of this process or None, extra JSON items) or None when the
          directory holds no checkpoint.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if step is not None:
            steps = [step]
        errors = []
        for candidate in steps:
            try:
                restored = self.manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        data=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                log.warning(
                    "checkpoint %d in %s is unreadable (%s: %s); trying the previous one",
                    candidate,
                    self.directory,
                    type(e).__name__,
                    str(e)[:200],
                )
                errors.append(f"step {candidate}: {type(e).__name__}: {str(e)[:200]}")
                continue
            data = (restored.data or {}).get(f"process_{jax.process_index()}")
            return candidate, restored.state, data, self.read_json(candidate)
        if errors:
            raise RuntimeError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(errors))
        return None

    def read_json(self, step: int) -> dict:
        """The JSON items (config, manifest, ...) saved with `step`, read without orbax args."""
        out = {}
        for item in (self.directory / str(step)).iterdir():
            path = item / "metadata"
            if item.name not in ("state", "data") and path.is_file():
                out[item.name] = json.loads(path.read_text())
        return out

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
