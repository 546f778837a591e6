"""The same loss and gradients on every mesh, with weights really sharded as the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import Transformer, get_preset, init_params, param_shardings
from posttrain.parallel import MeshConfig, make_mesh, shard_batch

CONFIG = get_preset("tiny", attention="xla", qkv_bias=True, qk_norm=True)  # T=2 D=64 N=8 K=4 H=16
MESHES = {
    "data=8": {"data": 8},
    "fsdp=8": {"fsdp": 8},
    "fsdp=2,tensor=4": {"fsdp": 2, "tensor": 4},
    "data=2,fsdp=2,tensor=2": {"data": 2, "fsdp": 2, "tensor": 2},
}
# Per-device shard shapes the default rules imply (embed->fsdp, heads/kv_heads/mlp/vocab->tensor).
EXPECTED_SHARDS = {
    "data=8": {
        "embed": (512, 64),
        "q": (2, 64, 8, 16),
        "k": (2, 64, 4, 16),
        "o": (2, 8, 16, 64),
        "gate": (2, 64, 128),
        "down": (2, 128, 64),
        "lm_head": (64, 512),
        "q_bias": (2, 8, 16),
    },
    "fsdp=8": {
        "embed": (512, 8),
        "q": (2, 8, 8, 16),
        "k": (2, 8, 4, 16),
        "o": (2, 8, 16, 8),
        "gate": (2, 8, 128),
        "down": (2, 128, 8),
        "lm_head": (8, 512),
        "q_bias": (2, 8, 16),
    },
    "fsdp=2,tensor=4": {
        "embed": (128, 32),
        "q": (2, 32, 2, 16),
        "k": (2, 32, 1, 16),
        "o": (2, 2, 16, 32),
        "gate": (2, 32, 32),
        "down": (2, 32, 32),
        "lm_head": (32, 128),
        "q_bias": (2, 2, 16),
    },
    "data=2,fsdp=2,tensor=2": {
        "embed": (256, 32),
        "q": (2, 32, 4, 16),
        "k": (2, 32, 2, 16),
        "o": (2, 4, 16, 32),
        "gate": (2, 32, 64),
        "down": (2, 64, 32),
        "lm_head": (32, 256),
        "q_bias": (2, 4, 16),
    },
}


def _loss(params, batch):
    """Mean next-token cross-entropy over the non-padding targets."""
    logits = Transformer(params, CONFIG)(batch["tokens"], segment_ids_BL=batch["segments"])
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], axis=-1)[..., 0]
    weights = (batch["segments"][:, 1:] > 0).astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.sum(weights)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 512, (8, 32)).astype(np.int32)
    segments = (np.arange(32)[None] < rng.randint(8, 33, (8, 1))).astype(np.int32)
    params = jax.device_get(init_params(CONFIG, jax.random.key(0)))
    batch = {"tokens": tokens, "segments": segments}
    loss, grads = jax.jit(jax.value_and_grad(_loss))(params, batch)
    return params, batch, float(loss), jax.device_get(grads)


def _leaf_name(path) -> str:
    return str(path[-1].key)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_loss_and_grads_match_single_device(problem, name, devices):
    params, batch, ref_loss, ref_grads = problem
    mesh = make_mesh(MeshConfig.from_dict(MESHES[name]))
    shardings = param_shardings(CONFIG, mesh)
    sharded_params = init_params(CONFIG, jax.random.key(0), mesh=mesh)
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # sharded init == unsharded init

    # Each weight's per-device shard has exactly the shape the rules imply.
    for path, x in jax.tree_util.tree_leaves_with_path(sharded_params):
        expected = EXPECTED_SHARDS[name].get(_leaf_name(path))
        if expected is not None:
            assert x.addressable_shards[0].data.shape == expected, (_leaf_name(path), name)

    with jax.set_mesh(mesh):
        step = jax.jit(
            jax.value_and_grad(_loss),
            in_shardings=(shardings, None),
            out_shardings=(None, shardings),
        )
        loss, grads = step(sharded_params, shard_batch(batch, mesh))
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = ref_grads
        for key in path:
            ref = ref[key.key]
        g = np.asarray(g)
        rel = np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-12)
        assert rel <= 1e-5, f"{_leaf_name(path)} on {name}: relative grad error {rel:.2e}"


def test_batches_enter_sharded(devices):
    mesh = make_mesh(MeshConfig.from_dict({"data": 2, "fsdp": 2, "tensor": 2}))
    batch = shard_batch({"tokens": np.zeros((8, 16), np.int32)}, mesh)
    assert batch["tokens"].addressable_shards[0].data.shape == (2, 16)  # 8 rows / (data*fsdp)
