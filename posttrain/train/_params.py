"""Where a run's params come from, and how a finished run's are read back: a preset's random
init, an HF directory's weights, or a run's checkpoint (`ModelSpec`); only the params of a
checkpoint (`restore_params`, no optimizer state), and a LoRA run's adapters merged into the
base it names (`load_lora_params`).

A LoRA checkpoint holds only the adapters (and their optimizer state); its JSON item `lora`
points at the base (`ModelSpec` and the init seed), which `saved_base` rebuilds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import orbax.checkpoint as ocp

from posttrain import paths
from posttrain.config import ConfigError, build
from posttrain.data import load_tokenizer
from posttrain.lora import LoRAConfig, adapter_shapes, merge, quantize_params, quantized_shardings
from posttrain.models import (
    ModelConfig,
    NNXSpec,
    Transformer,
    from_hf,
    get_preset,
    init_params,
    load_hf_config,
    nnx_describe,
    param_shapes,
    param_shardings,
)
from posttrain.rewards import set_judge_loader
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer


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
                 "pipeline_microbatches", "batch_invariant")  # fmt: skip
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


def to_json(value) -> Any:
    """A (nested) dataclass as plain JSON values."""
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


def checkpoint_json(workdir: str, step: int | None = None) -> dict:
    """The JSON items (config, model_config, manifest...) saved with a run's checkpoint."""
    checkpointer = Checkpointer(workdir, CheckpointConfig(async_save=False))
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint under {checkpointer.directory}: is {workdir!r} the workdir of a "
                "finished (or checkpointed) run?"
            )
        return {"step": step, **checkpointer.read_json(step)}
    finally:
        checkpointer.close()


def check_same_model(workdir: str, model_config: ModelConfig) -> None:
    """Refuses (`ConfigError`) a workdir whose newest readable checkpoint holds another model
    (other parameter shapes or dtype), before the run rewrites anything in it."""
    directory = paths.path(workdir) / "checkpoints"
    if not directory.is_dir():
        return
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        try:
            saved = build(
                ModelConfig,
                json.loads((directory / str(step) / "model_config" / "metadata").read_text()),
            )
        except (OSError, ValueError):
            continue  # unreadable: the restore moves it aside and tries the previous one
        shapes = lambda c: jax.tree.map(lambda s: (s.shape, str(s.dtype)), param_shapes(c))
        if shapes(saved) == shapes(model_config):
            return
        old, new = to_json(saved), to_json(model_config)
        # Settings that may change between runs of one model.
        runtime = ("attention", "remat", "logits_chunk", "context_parallel",
                   "pipeline_microbatches", "compute_dtype", "batch_invariant", "name")  # fmt: skip
        changed = [k for k in new if k not in runtime and old.get(k) != new[k]]
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed)
        raise ConfigError(
            f"{workdir} holds checkpoints of another model ({details or 'other parameters'}; "
            f"newest: step {step}); train this model in a new --workdir, or restore the model "
            "settings of that run to resume it"
        )


def restore_params(workdir: str, abstract_params, step: int | None = None):
    """Only the params of a run's checkpoint (no optimizer state is read), onto the shardings
    of `abstract_params` (a pytree of `jax.ShapeDtypeStruct` with `sharding`)."""
    step = checkpoint_json(workdir, step)["step"]
    manager = ocp.CheckpointManager(paths.path(workdir) / "checkpoints")
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
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def on_default_device(shapes):
    """`shapes` with the default device's sharding (for `restore_params`)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return with_shardings(shapes, jax.tree.map(lambda _: device, shapes))


def start_params(spec: ModelSpec, model_config: ModelConfig, mesh, seed: int):
    """The transformer params a run starts from, sharded on `mesh`."""
    if spec.hf_path:
        return from_hf(spec.hf_path, mesh=mesh, **spec.overrides()).params
    if spec.checkpoint:
        shardings = param_shardings(model_config, mesh)
        if "lora" in checkpoint_json(spec.checkpoint):  # a LoRA run: its merged weights
            return jax.device_put(load_lora_params(spec.checkpoint), shardings)
        return model_params(spec.checkpoint, with_shardings(param_shapes(model_config), shardings))
    return init_params(model_config, jax.random.key(seed), mesh)


# `merge` compiled once per (shapes, LoRAConfig): loading checkpoint after checkpoint (eval)
# and evaluating during a run reuse it.
merge_jit = jax.jit(merge, static_argnames="lora")


def quantize_base(lora: LoRAConfig, params: dict, model_config: ModelConfig, mesh=None):
    """QLoRA: the base with its layer matrices quantised (`lora.quantize`), sharded like the
    weights they replace on `mesh`; unchanged without `lora.quantize`."""
    if not lora.quantize:
        return params
    quantize = functools.partial(
        quantize_params, model_config=model_config, format=lora.quantize, block=lora.quant_block
    )
    shardings = None
    if mesh is not None:
        shardings = quantized_shardings(model_config, lora.quantize, lora.quant_block, mesh)
    return jax.jit(quantize, out_shardings=shardings)(params)


def saved_base(saved: dict):
    """(frozen base params, LoRAConfig) of a LoRA checkpoint's JSON items, on the default
    device; a QLoRA base comes back quantised, as the run trained on it."""
    item = saved["lora"]
    lora = LoRAConfig.from_config(item["config"])
    model_config = build(ModelConfig, saved["model_config"])
    spec = build(ModelSpec, item["base"])
    if spec.hf_path:
        base = from_hf(spec.hf_path, **spec.overrides()).params
    elif spec.checkpoint:
        base = start_params_single(spec, model_config)
    else:
        base = init_params(model_config, jax.random.key(item["seed"]))
    return quantize_base(lora, base, model_config), lora


def load_lora_params(workdir: str, step: int | None = None, *, merged: bool = True):
    """A LoRA run's (base params, adapters, LoRAConfig), or the merged params when `merged`,
    on the default device. A QLoRA base is quantised (merged: dequantised, then merged), so
    the merged model is the one the run trained."""
    saved = checkpoint_json(workdir, step)
    base, lora = saved_base(saved)
    model_config = build(ModelConfig, saved["model_config"])
    shapes = on_default_device(adapter_shapes(model_config, lora))
    under = saved["lora"].get("under", [])
    for key in reversed(under):
        shapes = {key: shapes}
    adapters = restore_params(workdir, shapes, saved["step"])
    for key in under:
        adapters = adapters[key]
    if merged:
        return merge_jit(base, adapters, lora=lora)
    return base, adapters, lora


def start_params_single(spec: ModelSpec, model_config: ModelConfig):
    """A base restored from another run's checkpoint (itself possibly a LoRA run)."""
    if "lora" in checkpoint_json(spec.checkpoint):
        return load_lora_params(spec.checkpoint)
    return model_params(spec.checkpoint, on_default_device(param_shapes(model_config)))


def load_checkpoint_model(workdir: str, step: int | None = None, *, mesh=None) -> Transformer:
    """The model (params + config) of a run's checkpoint (SFT, DPO, GRPO, PPO's policy); a
    LoRA run's adapters come back merged into its base. With `mesh` the params are read
    straight onto the model's shardings over it (each device reads only its shards), else onto
    the default device."""
    saved = checkpoint_json(workdir, step)
    model_config = build(ModelConfig, saved["model_config"])
    shardings = param_shardings(model_config, mesh) if mesh is not None else None
    if "lora" in saved:
        params = load_lora_params(workdir, saved["step"])
        return Transformer(
            params if mesh is None else jax.device_put(params, shardings), model_config
        )
    if mesh is None:
        abstract = on_default_device(param_shapes(model_config))
    else:
        abstract = with_shardings(param_shapes(model_config), shardings)
    return Transformer(model_params(workdir, abstract, saved["step"]), model_config)


def load_model_and_tokenizer(path: str, *, mesh=None):
    """`(Transformer, Tokenizer)` of an HF model directory (config.json + safetensors +
    tokenizer files) or a training workdir (its latest checkpoint and the tokenizer its config
    names); with `mesh`, the params sharded over it."""
    if (paths.path(path) / "checkpoints").is_dir():
        config = json.loads((paths.path(path) / "config.json").read_text())
        tokenizer_dir = config.get("tokenizer") or config.get("model", {}).get("hf_path")
        return load_checkpoint_model(path, mesh=mesh), load_tokenizer(tokenizer_dir)
    if (paths.path(path) / "config.json").is_file():
        return from_hf(path, mesh=mesh), load_tokenizer(path)
    raise FileNotFoundError(
        f"{path!r} is neither an HF model directory (config.json) nor a "
        f"training workdir (checkpoints/)"
    )


set_judge_loader(load_model_and_tokenizer)  # "judge:<path>" rewards load their models with it
