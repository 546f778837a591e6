"""Generation on a sharded model equals one device: batch over data/fsdp, heads (and the paged
engine's KV pool) over tensor, experts over expert."""

import jax
import numpy as np
import pytest

from posttrain.models import Transformer, get_preset
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.sampling import Engine, EngineConfig, generate_continuous
from tests.sampling.reference import generate_static


def test_sharded_generation_matches_single_device(devices):
    config = get_preset("tiny", attention="xla")
    prompts = [list(np.random.RandomState(i).randint(1, 512, 5 + 3 * i)) for i in range(8)]
    reference = generate_static(Transformer.init(config, rng=0), None, prompts, max_new_tokens=10)
    mesh = make_mesh(MeshConfig.from_dict({"data": 2, "fsdp": 2, "tensor": 2}))
    with jax.set_mesh(mesh):
        model = Transformer.init(config, rng=0, mesh=mesh)
        assert model.params["layers"]["attn"]["q"].addressable_shards[0].data.shape[2] == 4
        static = generate_static(model, None, prompts, max_new_tokens=10)
        engine = Engine(model, EngineConfig(slots=4, block_size=8), max_len=64)
        # The pool [layers, blocks, block, kv heads, head dim]: 4 kv heads split in 2.
        assert engine._rows.k.sharding.spec[3] == "tensor"
        continuous = generate_continuous(model, None, prompts, max_new_tokens=10, engine=engine)
    for ref, a, b in zip(reference, static, continuous, strict=True):
        assert ref[0].token_ids == a[0].token_ids == b[0].token_ids
        np.testing.assert_allclose(ref[0].logprobs, a[0].logprobs, atol=1e-5)
        np.testing.assert_allclose(ref[0].logprobs, b[0].logprobs, atol=1e-5)


@pytest.mark.slow  # ~70 s on 2 cores; the dense test above runs the engine on a mesh by default
def test_expert_sharded_mla_moe_on_the_engine_matches_single_device(devices):
    config = get_preset("tiny_mla_moe", attention="xla")
    prompts = [list(np.random.RandomState(i).randint(1, 512, 4 + 5 * i)) for i in range(4)]
    kwargs = dict(max_new_tokens=8, n=2, slots=4, block_size=8)
    reference = generate_continuous(Transformer.init(config, rng=0), None, prompts, **kwargs)
    mesh = make_mesh(MeshConfig.from_dict({"expert": 2, "fsdp": 2, "tensor": 2}))
    with jax.set_mesh(mesh):
        model = Transformer.init(config, rng=0, mesh=mesh)
        experts = model.params["layers"]["moe"]["experts"]["gate"]  # [layers, E, D, F]
        assert experts.addressable_shards[0].data.shape[1] == experts.shape[1] // 2
        sharded = generate_continuous(model, None, prompts, **kwargs)
    for ref, ours in zip(reference, sharded, strict=True):
        assert [c.token_ids for c in ref] == [c.token_ids for c in ours]
