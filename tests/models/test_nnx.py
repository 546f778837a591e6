"""Your own Flax NNX module as the model: an NNX Llama written without posttrain's model code
(posttrain.testing's `nnx_decoder`) against posttrain's own Llama with the same weights, its
shardings against its own annotations, its decoding against posttrain's KV-cache sampler, and
the errors a user's module can cause."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.config import ConfigError, load_config_file, override
from posttrain.demo import ASSETS_DIR
from posttrain.methods import method_config
from posttrain.models import ModelSpec, Transformer, get_preset, init_params
from posttrain.parallel import MeshConfig, axis_rules, make_mesh
from posttrain.sampling import Engine, EngineConfig, PromptLookup, generate, run_generate, stream
from posttrain.testing import nnx_decoder
from tests.sampling.reference import generate_static
from tests.sampling.test_generate import CharTokenizer
from tests.tolerance import assert_close

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = get_preset("tiny")
LLAMA = {  # posttrain's tiny preset, written as an NNX module
    "style": "llama",
    "vocab_size": TINY.vocab_size,
    "embed_dim": TINY.embed_dim,
    "num_layers": TINY.num_layers,
    "num_heads": TINY.num_heads,
    "num_kv_heads": TINY.num_kv_heads,
    "head_dim": TINY.head_dim,
    "mlp_dim": TINY.mlp_dim,
    "max_seq_len": TINY.max_seq_len,
}
BUILDER = "posttrain.testing:nnx_decoder"
MESHES = {"one device": {"fsdp": 1}, "fsdp4 x tensor2": {"fsdp": 4, "tensor": 2}}


def _ours(p: dict) -> dict:
    """The NNX module's params in posttrain's layout (layers stacked, norms as arrays)."""
    T = len(p["layers"])
    stack = lambda f: jnp.stack([f(p["layers"][str(i)]) for i in range(T)])  # noqa: E731
    layer = lambda *path: stack(lambda x: x[path[0]][path[1]])  # noqa: E731
    head = {"lm_head": p["lm_head"]} if "lm_head" in p else {}  # (a reward trunk has none)
    return {
        **head,
        "embed": p["embed"],
        "final_norm": p["final_norm"]["scale"],
        "layers": {
            "attn_norm": layer("attn_norm", "scale"),
            "mlp_norm": layer("mlp_norm", "scale"),
            "attn": {k: layer("attn", k) for k in "qkvo"},
            "mlp": {k: layer("mlp", k) for k in ("gate", "up", "down")},
        },
    }


def _convert(tree, to: str):
    """`tree` with every NNX model params subtree in posttrain's layout (`to="ours"`)."""
    if to == "nnx" or not isinstance(tree, dict):
        return tree
    if {"embed", "layers", "final_norm"} <= set(tree):
        return _ours(tree)
    return {k: _convert(v, to) for k, v in tree.items()}


@pytest.fixture(scope="module")
def nnx_model():
    config = ModelSpec(nnx=BUILDER, nnx_kwargs=LLAMA).model_config()
    return Transformer(init_params(config, jax.random.key(0)), config)


def _config(method: str, mesh: dict):
    """configs/<method>.py:tiny on the demo's files, from random init, on `mesh`."""
    file = f"{method}.py:tiny"
    config = load_config_file(os.path.join(REPO, "configs", file))
    source = {"path": str(ASSETS_DIR / "train.jsonl"), "weight": 1.0, "domain": "arithmetic",
              "format": "auto"}  # fmt: skip
    values = {
        "model.checkpoint": "",
        "model.remat": "",
        "model.attention": "xla",
        "tokenizer": str(ASSETS_DIR / "tokenizer"),
        "data.sources": [source],
        "eval_data": [],
        "data.batch_size": 8,
        "data.max_len": 24,
        "mesh.ici": {"data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1, **mesh},
    }
    if method == "dpo":
        values["loss.reference"] = "precomputed"
    if method in ("grpo", "ppo"):
        values |= {"rollout.num_generations": 2, "rollout.max_prompt_len": 16,
                   "rollout.max_new_tokens": 8, "kl.coef": 0.05}  # fmt: skip
    return method_config(override(config, values))


def _batch(abstract: dict, vocab: int) -> dict:
    """A random batch of the step's shapes (token ids in the vocabulary, documents packed two
    to a row, every third token masked out)."""
    rng = np.random.default_rng(0)
    out = {}
    for name, x in abstract.items():
        shape = x.shape
        if name.endswith(("tokens", "targets")):
            value = rng.integers(0, vocab, shape)
        elif name.endswith("positions"):
            half = shape[-1] // 2
            value = np.broadcast_to(np.r_[np.arange(half), np.arange(shape[-1] - half)], shape)
        elif name.endswith("segment_ids"):
            value = np.broadcast_to(
                np.r_[np.ones(shape[-1] // 2), 2 * np.ones(shape[-1] - shape[-1] // 2)], shape
            )
        elif name.endswith("loss_mask"):
            value = (np.arange(np.prod(shape)).reshape(shape) % 3 != 0).astype(np.float32)
        elif name == "domain_ids":
            value = np.zeros(shape)
        elif name.endswith("logps") or name in ("advantages", "old_values", "returns"):
            value = -np.abs(rng.normal(0, 1, shape)) if "logps" in name else rng.normal(0, 1, shape)
        else:  # rewards, lengths, kl coefficients, margins...
            value = np.abs(rng.normal(0, 1, shape))
        out[name] = jax.device_put(np.asarray(value, x.dtype), x.sharding)
    return out


# SFT on both meshes; the other methods sharded.
CASES = [("sft", "one device")] + [
    (m, "fsdp4 x tensor2") for m in ("sft", "dpo", "rm", "grpo", "ppo")
]


@pytest.mark.parametrize("method, mesh_name", CASES)
def test_same_losses_and_gradients_as_posttrains_llama(nnx_model, devices, method, mesh_name):
    """The NNX Llama and posttrain's Llama, same weights, give the same loss sums and
    gradients (<= 1e-5) under each method's own step plan, on one device and sharded: the
    policy (SFT, GRPO), policy and reference (DPO), reward-model trunk (RM), critic (PPO)."""
    record, c = _config(method, MESHES[mesh_name])
    n = int(np.prod([*MESHES[mesh_name].values()]))
    mesh = make_mesh(c.mesh, devices[:n])
    sums, grads = {}, {}
    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        start = None
        for name, config in (("nnx", nnx_model.config), ("ours", TINY)):
            plan = record.plan(c, config, mesh, ("arithmetic",))
            if start is None:  # the NNX run's start (a reward head, a critic: theirs too)
                start = plan.trainable.init()
            params = jax.device_put(_convert(start, name), plan.trainable.shardings)
            batch = _batch(record.batch(c, mesh)[0], config.vocab_size)
            loss_fn = plan.loss({})

            def objective(params, batch, loss_fn=loss_fn):
                out = loss_fn(params, batch, jax.random.key(0))
                return out["loss_sum"], out

            (_, out), g = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, batch)
            sums[name] = {k: np.asarray(v) for k, v in out.items()}
            grads[name] = g if name == "ours" else _convert(g, "ours")
    assert sums["nnx"].keys() == sums["ours"].keys()
    for key, value in sums["ours"].items():
        assert_close(sums["nnx"][key], value, rtol=1e-5, err_msg=key)
    flat_nnx = jax.tree_util.tree_leaves_with_path(grads["nnx"])
    flat_ours = dict(jax.tree_util.tree_leaves_with_path(grads["ours"]))
    assert len(flat_nnx) == len(flat_ours)
    for path, g in flat_nnx:
        assert_close(g, flat_ours[path], rtol=1e-5, ulps=64, err_msg=jax.tree_util.keystr(path))


def _trimmed(spec) -> tuple:
    out = tuple(spec)
    while out and out[-1] is None:
        out = out[:-1]
    return out


def test_params_land_on_the_shardings_the_module_asks_for(devices):
    """Each parameter's placement is what its own `nnx.with_partitioning` names ask for under
    the default rules (embed -> fsdp; heads, kv_heads, mlp, vocab -> tensor), the names read
    here from the module itself with Flax's `nnx.get_partition_spec`."""
    config = ModelSpec(nnx=BUILDER, nnx_kwargs=LLAMA).model_config()
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 4, "tensor": 2}, {}), devices)
    params = init_params(config, jax.random.key(0), mesh)

    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: nnx_decoder(rngs=nnx.Rngs(0), **LLAMA))
    names = nnx.get_partition_spec(nnx.state(module, nnx.Param)).to_pure_dict()
    rules = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
             "vocab": "tensor", "head_dim": None, None: None}  # fmt: skip
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, leaf in leaves:
        spec = names
        for k in path:
            spec = spec[int(k.key) if k.key.isdigit() else k.key]
        expected = tuple(rules[n] for n in spec)
        assert _trimmed(leaf.sharding.spec) == _trimmed(expected), jax.tree_util.keystr(path)
    assert len(leaves) == 3 + 9 * LLAMA["num_layers"]  # embed, lm_head, final norm; 9 per layer
    q = params["layers"]["0"]["attn"]["q"]  # [D, N, H] = [64, 8, 16] over fsdp=4, tensor=2
    assert q.sharding.spec == P("fsdp", "tensor") and q.addressable_shards[0].data.shape == (
        16,
        4,
        16,
    )


def test_decoding_matches_posttrains_kv_cache_sampler(nnx_model):
    """The engine decodes the NNX module (re-running it over each row's tokens so far) to the
    tokens and log-probs its KV-cache decoding of the same Llama gives, and so does the padded
    reference loop; the rows end at different lengths (an EOS id some rows draw)."""
    prompts = [[1, 5, 9, 200, 31], [7, 8], [300, 2, 2, 2, 2, 2, 2, 9]]
    kwargs = dict(max_new_tokens=6, temperature=1.0, n=2, seed=3)
    llama = Transformer(_ours(nnx_model.params), TINY)
    # An id drawn mid-sample by some rows ends them there: rows of different lengths.
    drawn = [c.token_ids for group in generate(llama, None, prompts, **kwargs) for c in group]
    kwargs["eos_ids"] = [drawn[0][2]]
    ours = generate(llama, None, prompts, **kwargs)
    assert len({len(c.token_ids) for group in ours for c in group}) > 1
    theirs = generate(nnx_model, None, prompts, **kwargs)
    reference = generate_static(nnx_model, None, prompts, **kwargs)
    for a_group, b_group, r_group in zip(theirs, ours, reference, strict=True):
        for a, b, r in zip(a_group, b_group, r_group, strict=True):
            assert a.token_ids == b.token_ids == r.token_ids
            assert_close(a.logprobs, b.logprobs, rtol=1e-5, ulps=64)
            assert_close(a.logprobs, r.logprobs, rtol=1e-5, ulps=64)


def test_an_nnx_module_streams_token_by_token_and_writes_a_prompts_file(nnx_model, tmp_path):
    """`stream` (the CLI's one-prompt path) gives an NNX module's text in pieces, the sample
    `generate` draws; a prompts file goes through the same engine (`run_generate`)."""
    tok = CharTokenizer()
    kwargs = dict(max_new_tokens=8, temperature=1.0, seed=5)
    pieces = list(stream(nnx_model, tok, tok.encode("abc"), **kwargs))
    [[sample]] = generate(nnx_model, tok, [tok.encode("abc")], **kwargs)
    assert len(pieces) > 1 and "".join(pieces) == sample.text
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"abc"\n"de"\n')
    run_generate(nnx_model, tok, prompts_file=str(prompts), out=str(tmp_path / "out.jsonl"),
                 **kwargs)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows[0]["completion"] == sample.text and len(rows) == 2


class _WithDropout(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((4, 4)))
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def with_dropout(*, rngs):
    return _WithDropout(rngs)


def bad_axes(*, rngs):
    module = nnx.Linear(4, 4, rngs=rngs)
    module.kernel = nnx.Param(jnp.ones((4, 4)), sharding=("embed", "width"))
    return module


def linear(*, rngs):
    return nnx.Linear(4, 4, rngs=rngs)


@pytest.mark.parametrize(
    "builder, message",
    [
        ("no_such_package.models:build", "cannot import no_such_package"),
        ("posttrain.testing:no_such_builder", "has no 'no_such_builder'"),
        ("posttrain.testing", "'package.module:function'"),
        ("tests.models.test_nnx:with_dropout", "not an nnx.Param: drop/rngs"),
        ("tests.models.test_nnx:bad_axes", "names logical axis 'width'"),
        ("tests.models.test_nnx:linear", r"calling module\(tokens \[1, 2\], positions, segment"),
    ],
)
def test_a_module_posttrain_cannot_train_is_one_clear_error(builder, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec(nnx=builder).model_config()


def test_the_engine_refuses_to_quantise_or_draft_into_an_nnx_modules_missing_kv_cache(nnx_model):
    for config, drafter in [(EngineConfig(kv_dtype="int8"), None),
                            (EngineConfig(speculative=4), None),
                            (EngineConfig(), PromptLookup(k=2))]:  # fmt: skip
        with pytest.raises(ValueError, match="no KV cache to quantise or draft into"):
            Engine(nnx_model, config, drafter=drafter)


def test_posttrain_compile_plans_the_gemma_style_example_for_a_tpu_slice():
    """`posttrain compile` lowers the NNX module's SFT step for v5e-8 with its shardings (the
    same function a run jits) and reports its memory and FLOPs."""
    from posttrain.methods import compile_plan
    from posttrain.models import num_params

    config = load_config_file(os.path.join(REPO, "configs", "nnx.py:sft"))
    report = compile_plan(config, "v5e-8")
    assert report.fits and report.arguments > 0, report.lines()
    params = num_params(method_config(config)[1].model.model_config())
    tokens = config.data.batch_size * config.data.max_len
    assert report.model_flops == pytest.approx(6 * params * tokens)  # (6 N per token for NNX)
    assert report.compiled_flops >= report.model_flops
