"""Generation on a sharded model (batch over data/fsdp, heads over tensor) equals one device."""

import jax
import numpy as np

from posttrain.models import Transformer, get_preset
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.sampling import generate, generate_continuous


def test_sharded_generation_matches_single_device(devices):
    config = get_preset("tiny", attention="xla")
    prompts = [list(np.random.RandomState(i).randint(1, 512, 5 + 3 * i)) for i in range(8)]
    reference = generate(Transformer.init(config, rng=0), None, prompts, max_new_tokens=10)
    mesh = make_mesh(MeshConfig.from_dict({"data": 2, "fsdp": 2, "tensor": 2}))
    with jax.set_mesh(mesh):
        model = Transformer.init(config, rng=0, mesh=mesh)
        assert model.params["layers"]["attn"]["q"].addressable_shards[0].data.shape[2] == 4
        static = generate(model, None, prompts, max_new_tokens=10)
        continuous = generate_continuous(model, None, prompts, max_new_tokens=10, slots=4)
    for ref, a, b in zip(reference, static, continuous, strict=True):
        assert ref[0].token_ids == a[0].token_ids == b[0].token_ids
        np.testing.assert_allclose(ref[0].logprobs, a[0].logprobs, atol=1e-5)
