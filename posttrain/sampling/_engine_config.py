"""What the engine is asked to be (`EngineConfig`: rows, KV blocks and dtype, chunking, the
decode attention) and what it counts as it runs (`EngineStats`)."""

from __future__ import annotations

import dataclasses

from posttrain.models import KV_DTYPES

_ATTENTION = ("auto", "xla", "ragged")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches.

    Attributes:
      slots: sequences decoded together (the decode batch); 0 sizes it to the work: a row for
        every sample of a `generate` call (up to 256), of an RL step's batch, and so on.
      block_size: tokens per KV block.
      num_blocks: blocks in the pool (block 0 is scratch); 0 sizes it so every slot can hold
        a sequence of the longest length the engine is asked for (never waits for blocks).
      chunk: decode steps per device call; finished rows are refilled between calls.
      prefill_bucket: prompt lengths are padded to a multiple of this for prefill (bounds
        compilations).
      kv_dtype: "auto" (the model's compute dtype), "int8" (per-token, per-head scales) or
        "int8_layered" (int8, and each sequence's last `kv_recent` tokens in full precision).
      kv_recent: the full-precision window of "int8_layered".
      prefix_sharing: the n samples of a prompt share its prefill and its full blocks.
      attention: how decode steps attend over the pool: "auto" (the TPU ragged paged-attention
        kernel on TPU where it applies: model-dtype KV, no MLA, head dim a multiple of 128;
        else "xla"), "xla" (gather the row's blocks, the reference), "ragged" (the kernel).
      unstack_layers: decode calls copy the layers' weights and KV pool into per-layer arrays
        once and loop over them, instead of a scan slicing (copying) each layer's weights and
        cache at every step: 1.5x the tokens/s of a small model on CPU, at the cost of one
        extra copy of the layer weights while a decode call runs (False on a device where
        that copy does not fit).
      record_routes: router replay: record each sample's routed experts at every position
        (prompt and completion) of a MoE model, into `Request.routes` (no drafter).
      speculative: prompt-lookup draft tokens per speculative round when the engine is given
        no drafter (0: plain decoding); greedy outputs are the plain ones.
      prefix_cache: keep the full KV blocks of prompts after their requests end, keyed by the
        tokens they hold (and all before them), so a later prompt starting with the same
        tokens prefills only the rest (`serve`: a shared system prompt, a conversation's
        history); cached blocks no sequence uses are evicted, least recently used first, when
        the pool runs short, and all of them when the weights change. Where the engine keeps
        blocks at all (`Engine.keeps_kv`).
    """

    slots: int = 8
    block_size: int = 16
    num_blocks: int = 0
    chunk: int = 16
    prefill_bucket: int = 16
    kv_dtype: str = "auto"
    kv_recent: int = 32
    prefix_sharing: bool = True
    attention: str = "auto"
    unstack_layers: bool = True
    record_routes: bool = False
    speculative: int = 0
    prefix_cache: bool = False

    def __post_init__(self):
        if self.slots < 0:
            raise ValueError(f"engine slots must be >= 0 (0: sized to the work), got {self.slots}")
        for name in ("block_size", "chunk", "prefill_bucket", "kv_recent"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if self.speculative < 0:
            raise ValueError(f"engine speculative must be >= 0 (0: plain), got {self.speculative}")
        if self.speculative and self.kv_dtype == "int8_layered":
            raise ValueError(
                "engine kv_dtype='int8_layered' keeps recent tokens in a ring that speculative "
                "drafts would overwrite: use kv_dtype='int8' or speculative=0"
            )
        if self.num_blocks < 0:
            raise ValueError(
                f"engine num_blocks must be >= 0 (0 = sized to fit), got {self.num_blocks}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"engine kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.attention not in _ATTENTION:
            raise ValueError(
                f"engine attention must be one of {_ATTENTION}, got {self.attention!r}"
            )

    def sized(self, rows: int) -> EngineConfig:
        """This config with `slots` = `rows` where it says 0 (sized to the work)."""
        return self if self.slots else dataclasses.replace(self, slots=rows)

    def kernel(self, model_config, platform: str, devices: int = 1) -> str:
        """The `PagedKVCache.kernel` decode steps use ("" for the XLA gather) on `devices`
        devices of `platform`: the Pallas kernels run on one (XLA cannot partition a Mosaic
        call over a mesh, and they are not wrapped in a shard_map yet)."""
        fits = (
            self.kv_dtype == "auto"
            and model_config.mla is None
            and model_config.head_dim % 128 == 0
            and not model_config.batch_invariant  # (which has its own attention)
            and not model_config.attn_softcap  # (Gemma 2: the kernels here do not cap)
        )
        if self.attention == "auto":
            return "ragged" if platform == "tpu" and fits and devices == 1 else ""
        if self.attention == "xla":
            return ""
        if devices > 1:
            raise ValueError(
                f"engine attention={self.attention!r} runs on one device (the weights are on "
                f"{devices}); use 'auto' or 'xla'"
            )
        if not fits:
            raise ValueError(
                f"engine attention={self.attention!r} needs a model-dtype KV cache (kv_dtype="
                f"'auto'), no MLA, no attention soft-capping and a head dim that is a multiple "
                f"of 128; use 'xla'"
            )
        return self.attention


@dataclasses.dataclass
class EngineStats:
    """Counts since the engine was made: prompt tokens asked for vs prefilled (prefix sharing
    prefills a group's prompt once), tokens generated, device calls, peak blocks in use."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    peak_blocks: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled)
    rounds: int = 0  # speculative rounds (forwards of the model after prefills)
    proposed: int = 0  # drafts proposed and accepted
    accepted: int = 0
