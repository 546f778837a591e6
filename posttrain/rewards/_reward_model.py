"""A trained reward model: the transformer trunk with one scalar head per domain
(`reward_scores`), read back from a `configs/rm.py` run's checkpoint (`load_reward_model`) to
score completions, which is what an "rm:<path>" reward term calls.

The params are `{"trunk": the transformer without its LM head, "head": [D, H]}`; a sequence's
reward under head h is `hidden(last token) @ head[:, h]` (the last real token of the row, as
HF's `*ForSequenceClassification`). The `rm` method (`posttrain.methods`) trains them; this
module imports jax, so `posttrain.rewards` loads it only when one of its names is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.config import build
from posttrain.data import RecordError, Tokenizer, encode_record, load_tokenizer
from posttrain.lora import adapter_shapes, merge_jit, saved_base
from posttrain.models import (
    ModelConfig,
    checkpoint_json,
    hidden_states,
    on_default_device,
    param_shapes,
    restore_params,
)
from posttrain.parallel import mesh_of


def without_lm_head(tree: dict) -> dict:
    """A transformer params-shaped tree without the LM head (a reward model does not use it)."""
    return {k: v for k, v in tree.items() if k != "lm_head"}


def reward_shapes(model_config: ModelConfig, num_heads: int) -> dict:
    head = jax.ShapeDtypeStruct((model_config.embed_dim, num_heads), jnp.float32)
    return {"trunk": without_lm_head(param_shapes(model_config)), "head": head}


def reward_scores(
    params: dict,
    model_config: ModelConfig,
    tokens_BL: jax.Array,
    positions_BL: jax.Array,
    segment_ids_BL: jax.Array,
    head_ids_B: jax.Array,
    **trunk_kwargs,
) -> jax.Array:
    """`[B]` float32 rewards: each row's last real token's hidden state through its head.

    Rows are right-padded, one sequence each (segment id > 0 on tokens); `head_ids_B` picks each
    row's head (negative ids, filler rows, read head 0). `trunk_kwargs`: the trunk's forward
    arguments (a `posttrain.lora.Policy`'s).
    """
    hidden_BLD = hidden_states(
        params["trunk"], tokens_BL, model_config, positions_BL, segment_ids_BL, **trunk_kwargs
    )
    last_B = jnp.maximum(jnp.sum(segment_ids_BL > 0, axis=-1) - 1, 0)
    last_BD = jnp.take_along_axis(hidden_BLD, last_B[:, None, None], axis=1)[:, 0]
    scores_BH = jnp.dot(last_BD.astype(jnp.float32), params["head"].astype(jnp.float32))
    return jnp.take_along_axis(scores_BH, jnp.maximum(head_ids_B, 0)[:, None], axis=1)[:, 0]


_BUCKET = 16  # shortest padded length; lengths round up to powers of two (few compiles)
_ROWS = 32  # sequences per scoring call


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """A trained reward model: `score(prompts, completions, heads) -> [N]` rewards.

    Prompts and completions are encoded as in training (a message-list prompt through the chat
    template, a string completion with EOS appended as the run's `data.add_eos` says), cut to
    the run's `data.max_len`.
    """

    params: dict
    model_config: ModelConfig
    heads: tuple[str, ...]
    tokenizer: Tokenizer
    max_len: int
    add_eos: bool = True

    def encode(self, prompt, completion: str) -> list[int]:
        try:
            record = {"prompt": prompt, "completion": completion}
            ids, _ = encode_record(
                record, "prompt_completion", self.tokenizer, add_eos=self.add_eos
            )
        except RecordError as e:
            raise ValueError(f"the reward model cannot score {record!r:.200}: {e}") from None
        return ids[: self.max_len]

    def score(
        self, prompts: Sequence, completions: Sequence[str], heads: Sequence[str]
    ) -> np.ndarray:
        """Rewards `[N]` (float32) of each completion after its prompt, under the named heads."""
        if not len(prompts) == len(completions) == len(heads):
            raise ValueError(
                f"{len(prompts)} prompts, {len(completions)} completions, {len(heads)} heads"
            )
        if unknown := sorted(set(heads) - set(self.heads)):
            raise ValueError(f"reward model has no head {unknown}; its heads: {list(self.heads)}")
        ids = [self.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
        head_ids = [self.heads.index(h) for h in heads]
        out = np.zeros(len(ids), np.float32)
        for start in range(0, len(ids), _ROWS):
            chunk = ids[start : start + _ROWS]
            length = max(_BUCKET, 1 << (max(map(len, chunk)) - 1).bit_length())
            rows = 1 << (len(chunk) - 1).bit_length()
            tokens = np.zeros((rows, length), np.int32)
            segments = np.zeros((rows, length), np.int32)
            for r, seq in enumerate(chunk):
                tokens[r, : len(seq)] = seq
                segments[r, : len(seq)] = 1
            positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
            heads_R = np.zeros(rows, np.int32)
            heads_R[: len(chunk)] = head_ids[start : start + _ROWS]
            with jax.set_mesh(mesh_of(self.params)):  # (its device, whatever the caller's mesh)
                scores = _score(
                    self.params, self.model_config, tokens, positions, segments, heads_R
                )
            out[start : start + len(chunk)] = np.asarray(scores)[: len(chunk)]
        return out


def reward_params(path: str, saved: dict) -> dict:
    """A reward-model checkpoint's `{"trunk", "head"}` on the default device (`saved`: its
    `checkpoint_json`); a LoRA run's adapters come back merged into its trunk."""
    model_config = build(ModelConfig, saved["model_config"])
    shapes = reward_shapes(model_config, len(saved["heads"]))
    if "lora" in saved:
        base, lora = saved_base(saved)
        shapes = {"adapters": adapter_shapes(model_config, lora), "head": shapes["head"]}
        params = restore_params(path, on_default_device(shapes), saved["step"])
        trunk = merge_jit(without_lm_head(base), params["adapters"], lora=lora)
        return {"trunk": trunk, "head": params["head"]}
    return restore_params(path, on_default_device(shapes), saved["step"])


@functools.partial(jax.jit, static_argnums=1)
def _score(params, model_config, tokens, positions, segments, heads):
    return reward_scores(params, model_config, tokens, positions, segments, heads)


def load_reward_model(path: str, step: int | None = None) -> RewardModel:
    """The reward model of a `configs/rm.py` run's checkpoint (newest by default), on the
    default device.

    Raises:
      FileNotFoundError: `path` has no checkpoint.
      ValueError: the checkpoint is not a reward model's (no heads saved with it).
    """
    saved = checkpoint_json(path, step)
    if "heads" not in saved:
        raise ValueError(
            f"{path} is not a reward-model run (its checkpoint saved no heads); train one with "
            "`posttrain train --config=configs/rm.py:<preset>`"
        )
    model_config = build(ModelConfig, saved["model_config"])
    heads = tuple(saved["heads"])
    data = saved["config"]["data"]
    return RewardModel(
        params=reward_params(path, saved),
        model_config=model_config,
        heads=heads,
        tokenizer=load_tokenizer(saved["tokenizer"]),
        max_len=int(data["max_len"]),
        add_eos=bool(data["add_eos"]),
    )
