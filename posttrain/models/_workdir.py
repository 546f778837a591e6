"""A model from a workdir: which model a run starts from (`ModelSpec`: a preset's random init,
an HF directory, or an earlier run's checkpoint), and how a run's checkpoint is read back: its
JSON items (`checkpoint_json`) and only its params, without the optimizer state
(`restore_params`, `model_params`).

Orbax is imported when a checkpoint is read, so `posttrain.models` stays as light to import.
"""

from __future__ import annotations

import dataclasses
import json

import jax

from posttrain import paths
from posttrain.config import ConfigError, build
from posttrain.models._config import ModelConfig, NNXSpec
from posttrain.models._hf_config import load_hf_config
from posttrain.models._nnx import nnx_describe
from posttrain.models._presets import get_preset


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to start from: a preset (random init), an HF directory, or a run's checkpoint.

    At most one of `hf_path` and `checkpoint` is set; with neither, `preset` is initialised.
    """

    # posttrain.models preset name, used when neither path is set; "" refuses to start without
    # one of them (a config for a real model, never a random one).
    preset: str = "tiny"
    hf_path: str = ""  # HF model directory: its config.json and weights
    checkpoint: str = ""  # an earlier run's workdir (e.g. SFT): its latest checkpoint's params
    attention: str = ""  # override ModelConfig.attention ("" keeps the model's)
    remat: str = ""  # override ModelConfig.remat
    compute_dtype: str = ""  # override ModelConfig.compute_dtype
    param_dtype: str = ""  # override ModelConfig.param_dtype
    # Positions of each row whose vocabulary logits the losses compute at a time, which bounds
    # the logits' memory at long lengths; 0: all at once; -1 keeps the model's.
    logits_chunk: int = -1
    context_parallel: str = ""  # override ModelConfig.context_parallel: ring | all_gather
    pipeline_microbatches: int = 0  # override ModelConfig.pipeline_microbatches (0 keeps it)
    pipeline_remat: str = ""  # override ModelConfig.pipeline_remat: layers | stage
    pipeline_schedule: str = ""  # override ModelConfig.pipeline_schedule: gpipe | 1f1b
    # Zero-mismatch mode (ModelConfig.batch_invariant): the sampler's and the trainer's
    # log-probs of a token are bitwise equal; True turns it on, False keeps the model's.
    batch_invariant: bool = False
    # MoE run settings (0 keeps the model's): expert-parallel buffer size over the balanced
    # share (MoEConfig.ep_capacity_factor), routing-bias step, load-balancing loss weight.
    ep_capacity_factor: float = 0.0
    routing_bias_rate: float = 0.0
    aux_loss_coef: float = 0.0
    # Your own Flax NNX module instead of a preset: its builder, "package.module:function"
    # (called with rngs= and nnx_kwargs; see posttrain.models._nnx for the call contract).
    nnx: str = ""
    nnx_kwargs: dict = dataclasses.field(default_factory=dict)  # the builder's arguments
    # Params held fixed while the rest trains: regexes searched in each param's path, e.g.
    # ("vision/(patch|position|layers|final_norm)",) for a VLM's image encoder (its projector
    # still trains) or ("vision",) for the whole tower. Not with LoRA (its base is frozen).
    freeze: tuple[str, ...] = ()

    def __post_init__(self):
        if not (self.preset or self.hf_path or self.checkpoint or self.nnx):
            raise ConfigError(
                "no model to start from: set model.hf_path (an HF model directory), "
                "model.checkpoint (a run's workdir) or model.preset (random init)"
            )
        if self.hf_path and self.checkpoint:
            raise ConfigError(
                f"model.hf_path={self.hf_path!r} and model.checkpoint={self.checkpoint!r} are both "
                "set; start from one of them"
            )
        if self.nnx and self.hf_path:
            raise ConfigError(
                f"model.nnx={self.nnx!r} and model.hf_path={self.hf_path!r} are both set: a "
                "module starts from its own initialisers or a checkpoint of a run that trained it"
            )
        if self.nnx and self.param_dtype:
            raise ConfigError(
                f"model.param_dtype={self.param_dtype!r} with model.nnx: the module decides its "
                "parameters' dtype; pass it in model.nnx_kwargs"
            )

    def overrides(self) -> dict:
        names = ("attention", "remat", "compute_dtype", "param_dtype", "context_parallel",
                 "pipeline_microbatches", "pipeline_remat", "pipeline_schedule",
                 "batch_invariant")  # fmt: skip
        out = {n: getattr(self, n) for n in names if getattr(self, n)}
        return out | ({"logits_chunk": self.logits_chunk} if self.logits_chunk >= 0 else {})

    def model_config(self) -> ModelConfig:
        if self.hf_path:
            config = load_hf_config(self.hf_path, **self.overrides())
        elif self.checkpoint:
            saved = checkpoint_json(self.checkpoint)
            config = dataclasses.replace(
                build(ModelConfig, saved["model_config"]), **self.overrides()
            )
            if self.nnx and config.nnx != NNXSpec.of(self.nnx, self.nnx_kwargs):
                raise ConfigError(
                    f"model.checkpoint={self.checkpoint!r} holds "
                    f"{config.nnx.builder + ' ' + config.nnx.kwargs if config.nnx else config.name}"
                    f", not model.nnx={self.nnx!r} with model.nnx_kwargs={self.nnx_kwargs}; "
                    "start from a checkpoint of this module, or clear model.nnx to take the "
                    "checkpoint's model"
                )
        elif self.nnx:
            spec = NNXSpec.of(self.nnx, self.nnx_kwargs)
            name = self.nnx.rpartition(":")[2]
            config = ModelConfig(**nnx_describe(spec), name=name, nnx=spec, **self.overrides())
        else:
            config = get_preset(self.preset, **self.overrides())
        names = ("ep_capacity_factor", "routing_bias_rate", "aux_loss_coef")
        moe = {n: getattr(self, n) for n in names if getattr(self, n)}
        if moe and config.moe is None:
            raise ConfigError(f"model.{next(iter(moe))} is set but {config.name} has no MoE layers")
        return config.replace(moe=dataclasses.replace(config.moe, **moe)) if moe else config


def checkpoint_items(directory, step: int) -> dict:
    """The JSON items (config, manifest, ...) saved with `step` under a run's checkpoint
    `directory`, read without orbax args."""
    out = {}
    for item in (paths.path(directory) / str(step)).iterdir():
        path = item / "metadata"
        if item.name not in ("state", "data") and path.is_file():
            out[item.name] = json.loads(path.read_text())
    return out


def checkpoint_json(workdir: str, step: int | None = None) -> dict:
    """The JSON items (config, model_config, manifest...) saved with a run's checkpoint (the
    newest by default), and its "step"; every process reads them alone (`_manager`)."""
    directory = paths.path(workdir) / "checkpoints"
    several = jax.process_count() > 1
    manager = _manager(directory, several, enable_async_checkpointing=False)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint under {directory}: is {workdir!r} the workdir of a "
                "finished (or checkpointed) run?"
            )
        return {"step": step, **checkpoint_items(directory, step)}
    finally:
        manager.wait_until_finished()
        manager.close()


def _manager(directory, local: bool, **options):
    """An Orbax manager of a checkpoint directory. `local`: this process reads alone (no
    barrier waits for the other processes, which may be elsewhere, or done), as it does a
    checkpoint's JSON items or a model it holds on its own devices (a reward model or a judge,
    loaded by each process of several when it first scores)."""
    import orbax.checkpoint as ocp

    if local:
        me = jax.process_index()
        options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"process{me}"
        )
        options["create"] = False  # (it reads: the directory is there)
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options))


def finished_step(workdir: str) -> int:
    """The newest checkpoint's step in a workdir, read from its directory names (0: none)."""
    checkpoints = paths.path(workdir) / "checkpoints"
    if not checkpoints.is_dir():
        return 0
    return max([int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()], default=0)


def restore_params(workdir: str, abstract_params, step: int | None = None):
    """Only the params of a run's checkpoint (no optimizer state is read), onto the shardings
    of `abstract_params` (a pytree of `jax.ShapeDtypeStruct` with `sharding`)."""
    import orbax.checkpoint as ocp

    local = jax.process_count() > 1 and all(
        x.sharding.device_set <= set(jax.local_devices()) for x in jax.tree.leaves(abstract_params)
    )
    step = checkpoint_json(workdir, step)["step"]
    manager = _manager(paths.path(workdir) / "checkpoints", local)
    try:
        item = {"params": abstract_params}
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=item,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True,
                )
            ),
        )
    except Exception as e:
        raise ValueError(
            f"could not read the params of {workdir} step {step} ({type(e).__name__}: "
            f"{str(e)[:300]}); is it a checkpoint of the same model?"
        ) from e
    finally:
        manager.close()
    return restored.state["params"]


def model_params(workdir: str, abstract_params, step: int | None = None):
    """The trained model's params of a run's checkpoint (`restore_params`), wherever the run
    kept them: a PPO run saves `{"policy", "value"}`, and only the policy is read."""
    saved = checkpoint_json(workdir, step)
    if saved.get("config", {}).get("algorithm", {}).get("advantage") == "gae":  # PPO
        return restore_params(workdir, {"policy": abstract_params}, saved["step"])["policy"]
    return restore_params(workdir, abstract_params, saved["step"])


def with_shardings(shapes, shardings):
    """`shapes` (a pytree of `jax.ShapeDtypeStruct`) placed on `shardings`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def on_default_device(shapes):
    """`shapes` with the default device's sharding (for `restore_params`): this process's first
    device (on several processes `jax.devices()[0]` is process 0's)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return with_shardings(shapes, jax.tree.map(lambda _: device, shapes))
