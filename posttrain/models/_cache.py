"""KV caches for incremental decoding: a dense cache of S slots per row, and a paged pool.

Both give the decoder the same three things (`addressing`): the positions and segment ids of
what the queries may attend, and `update(store, new) -> (store, readable)`, which writes one
layer's new keys (or values) and returns that layer's keys as the queries see them, `[B, S, K,
H]`. Attention masks by position and segment id, so the model code is the same for both.

`PagedKVCache` is a pool of fixed-size blocks shared by every sequence (vLLM's PagedAttention,
as an XLA gather): a sequence's keys live in the blocks its block table names, in order, so the
key of its j-th token is at pool slot `table[j // block] * block + j % block`. Sequences grow
a block at a time, free their blocks when they finish, and may share blocks (a prompt's
prefix). Block 0 is scratch: padding and finished rows write there and nothing reads it.

With `kv_dtype="int8"` the pool holds int8 values with one scale per token and head
(absmax / 127, stored in float16), dequantised to the compute dtype as they are read.
`"int8_layered"` also keeps each sequence's most recent W tokens in full precision, in a ring of
W slots per sequence, and reads those from the ring: the tokens attention weighs most stay exact.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from posttrain.models._config import ModelConfig
from posttrain.parallel import constrain

KV_DTYPES = ("auto", "int8", "int8_layered")
_SCALE_DTYPE = jnp.float16


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_TBSKH", "v_TBSKH", "positions_BS", "segment_ids_BS", "index"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for S slots per row, for incremental decoding.

    A forward pass with a cache writes its L tokens' keys, values, positions and segment ids at
    slots `index .. index+L-1` of every row and attends over all S slots (masked by position and
    segment id, so slots never written, with segment id -1, are never seen). MLA models store
    their latent as one key "head" and no values (`ModelConfig.cache_dims`).
    """

    k_TBSKH: jax.Array
    v_TBSKH: jax.Array
    positions_BS: jax.Array  # int32 position of the token in each slot
    segment_ids_BS: jax.Array  # int32; -1 marks a slot never written
    index: jax.Array  # int32 scalar: the slot the next tokens are written at

    @classmethod
    def init(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """An empty cache of `length` slots per row, in the compute dtype."""
        heads, k_dim, v_dim = config.cache_dims()
        shape = (config.num_layers, batch, length, heads)
        return cls(
            k_TBSKH=jnp.zeros((*shape, k_dim), config.dtype),
            v_TBSKH=jnp.zeros((*shape, v_dim), config.dtype),
            positions_BS=jnp.zeros((batch, length), jnp.int32),
            segment_ids_BS=jnp.full((batch, length), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    def stores(self):
        return self.k_TBSKH, self.v_TBSKH

    def repeat(self, n: int) -> KVCache:
        """Each row n times in a row (the n samples of a prompt share its prefill)."""
        return KVCache(
            k_TBSKH=jnp.repeat(self.k_TBSKH, n, axis=1),
            v_TBSKH=jnp.repeat(self.v_TBSKH, n, axis=1),
            positions_BS=jnp.repeat(self.positions_BS, n, axis=0),
            segment_ids_BS=jnp.repeat(self.segment_ids_BS, n, axis=0),
            index=self.index,
        )

    def addressing(self, positions_BL, segment_ids_BL):
        """`(kv_positions_BS, kv_segment_ids_BS, update, attend)` for a forward pass writing
        tokens at these positions: what the queries may attend, `update(store, new) -> (store,
        readable)` per layer, and `attend(store, q, k, v, window=, scale=) -> (store, out)`
        when a fused kernel does the writing and attending itself (else None)."""
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=self.index)

        def update(store_BSKH, new_BLKH):
            store_BSKH = write(store_BSKH, new_BLKH.astype(store_BSKH.dtype), axis=1)
            return store_BSKH, store_BSKH

        return (
            write(self.positions_BS, positions_BL.astype(jnp.int32), axis=1),
            write(self.segment_ids_BS, segment_ids_BL.astype(jnp.int32), axis=1),
            update,
            None,
        )

    def blocks(self, blocks_BL) -> jax.Array:
        """`[B, S]`: these tokens' bidirectional image blocks where `addressing` writes them,
        0 elsewhere (a prefill's images attend within that prefill)."""
        zeros_BS = jnp.zeros_like(self.segment_ids_BS)
        return jax.lax.dynamic_update_slice_in_dim(zeros_BS, blocks_BL, self.index, axis=1)

    def updated(self, k_TBSKH, v_TBSKH, positions_BS, segment_ids_BS, written: int) -> KVCache:
        return KVCache(k_TBSKH, v_TBSKH, positions_BS, segment_ids_BS, self.index + written)


def quantize_int8(x_NKH):
    """Symmetric int8 with one scale per leading index and head: `(values, scales [..., K])`."""
    absmax = jnp.max(jnp.abs(x_NKH.astype(jnp.float32)), axis=-1)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0).astype(_SCALE_DTYPE)
    q = jnp.round(x_NKH.astype(jnp.float32) / scale.astype(jnp.float32)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def dequantize_int8(q, scale, dtype):
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_TNbKH", "v_TNbKH", "write_slots_BL", "tables_BM", "lengths_B", "ring_rows_B"],
    meta_fields=["dtype", "kernel"],
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Every layer's keys and values in a shared pool of N blocks of b token slots, plus where
    this forward pass writes and reads (filled in by the engine for each call).

    Attributes:
      k_TNbKH, v_TNbKH: the pool, `[layers, N, b, K, H]`; with int8 a dict of `q` (int8, same
        shape) and `scale` (`[layers, N, b, K]`). A combined pool (`init_pool(combined=True)`,
        the TPU kernel's layout) holds keys and values in one `[layers, N, b, 2K, H]` store,
        keys at even heads and values at odd ones, and `v_TNbKH` is None. A layered pool's dicts
        also hold `recent` (`[layers, R, W, K, H]`, the model dtype): a ring of each sequence's
        last W tokens (ring row R - 1 is scratch).
      write_slots_BL: the pool slot (`block * b + offset`) of each new token (scratch block 0
        for padding).
      tables_BM: the blocks each row reads, in order: its first `M * b` tokens (slots past the
        row's length are masked).
      lengths_B: tokens each row holds once this pass has written its new ones; the queries
        attend only to the first `lengths_B` (position j is the row's j-th token).
      dtype: the dtype keys and values are read back in (the model's compute dtype).
      ring_rows_B: the ring row of each row (layered pools only; None otherwise).
      kernel: "" attends through the XLA gather; "ragged" runs one-token decode steps through
        the TPU ragged paged-attention Pallas kernel (a combined pool), "ragged_reference"
        through that kernel's JAX reference (what tests on CPU check the layout with).
    """

    k_TNbKH: jax.Array | dict
    v_TNbKH: jax.Array | dict | None
    write_slots_BL: jax.Array
    tables_BM: jax.Array
    lengths_B: jax.Array
    dtype: str = "float32"
    kernel: str = ""
    ring_rows_B: jax.Array | None = None

    @staticmethod
    def init_pool(
        config: ModelConfig,
        blocks: int,
        block_size: int,
        kv_dtype: str = "auto",
        *,
        combined: bool = False,
        ring_rows: int = 0,
        recent: int = 0,
    ):
        """An empty pool `(k, v)` of `blocks` blocks per layer (block 0, scratch, included);
        `combined`: keys and values interleaved in one store, `(kv, None)`; a layered pool
        keeps the last `recent` tokens of `ring_rows` sequences (plus a scratch row) exact."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        heads, k_dim, v_dim = config.cache_dims()
        if combined:
            if kv_dtype != "auto" or config.mla or k_dim != v_dim:
                raise ValueError("a combined pool holds model-dtype keys and values of one size")
            shape = (config.num_layers, blocks, block_size, 2 * heads, k_dim)
            return jnp.zeros(shape, config.dtype), None

        def empty(dim):
            shape = (config.num_layers, blocks, block_size, heads, dim)
            if kv_dtype == "auto":
                return jnp.zeros(shape, config.dtype)
            store = {"q": jnp.zeros(shape, jnp.int8), "scale": jnp.zeros(shape[:-1], _SCALE_DTYPE)}
            if kv_dtype == "int8_layered":
                if ring_rows < 1 or recent < 1:
                    raise ValueError("a layered pool needs ring_rows >= 1 and recent >= 1")
                ring = (config.num_layers, ring_rows + 1, recent, heads, dim)
                store["recent"] = jnp.zeros(ring, config.dtype)
            return store

        return empty(k_dim), empty(v_dim)

    @staticmethod
    def bytes_per_token(config: ModelConfig, kv_dtype: str = "auto") -> int:
        """Pool bytes one cached token takes over all layers (keys, values and scales)."""
        heads, k_dim, v_dim = config.cache_dims()
        if kv_dtype != "auto":  # a layered pool's ring adds W tokens per sequence, not per token
            per_layer = heads * (k_dim + v_dim) + heads * (1 + (v_dim > 0)) * 2
        else:
            per_layer = heads * (k_dim + v_dim) * jnp.dtype(config.dtype).itemsize
        return config.num_layers * per_layer

    def stores(self):
        return self.k_TNbKH, self.v_TNbKH

    def blocks(self, blocks_BL):
        """`[B, M * b]`: the keys' bidirectional image blocks, read in table order. A call's
        tokens must sit at positions 0.. (the engine prefills whole prompts) or hold no image
        token (decode), so slot j of a row's table is its position j."""
        S = self.tables_BM.shape[1] * self.block_size
        pad = max(0, S - blocks_BL.shape[1])
        return jnp.pad(blocks_BL, ((0, 0), (0, pad)))[:, :S]

    def addressing(self, positions_BL, segment_ids_BL):
        B, M = self.tables_BM.shape
        write_N, tables_BM = self.write_slots_BL.reshape(-1), self.tables_BM

        def write(pool_Nb, new):  # one layer's pool, a token's entry per new row
            flat = pool_Nb.reshape(-1, *pool_Nb.shape[2:])
            return flat.at[write_N].set(new.astype(pool_Nb.dtype)).reshape(pool_Nb.shape)

        def read(pool_Nb):  # whole blocks, in table order: [B, M * b, ...]
            blocks = pool_Nb[tables_BM]
            return blocks.reshape(B, M * blocks.shape[2], *blocks.shape[3:])

        def update(store, new_BLKH):
            if isinstance(new_BLKH, tuple):  # a combined pool: (keys, values) in, and out
                kv_BLXH = jnp.stack(new_BLKH, axis=3).reshape(
                    *new_BLKH[0].shape[:2], -1, new_BLKH[0].shape[-1]
                )
                store = write(store, kv_BLXH.reshape(-1, *kv_BLXH.shape[2:]))
                read_BSXH = read(store).astype(self.dtype)
                spec = ("act_batch", None, "act_kv_heads", None)
                return store, (
                    constrain(read_BSXH[:, :, 0::2], spec),
                    constrain(read_BSXH[:, :, 1::2], spec),
                )
            new_NKH = new_BLKH.reshape(-1, *new_BLKH.shape[2:])
            if isinstance(store, dict):
                q, scale = quantize_int8(new_NKH)
                store = {**store, "q": write(store["q"], q), "scale": write(store["scale"], scale)}
                read_BSKH = dequantize_int8(read(store["q"]), read(store["scale"]), self.dtype)
                if "recent" in store:
                    store["recent"], read_BSKH = recent_layer(store["recent"], new_BLKH, read_BSKH)
            else:
                store = write(store, new_NKH)
                read_BSKH = read(store).astype(self.dtype)
            return store, constrain(read_BSKH, ("act_batch", None, "act_kv_heads", None))

        def recent_layer(ring_RWKH, new_BLKH, read_BSKH):
            """Writes the new tokens among each row's last W into its ring, and reads those
            positions from the ring instead of the int8 blocks."""
            R, W = ring_RWKH.shape[:2]
            lengths_B1 = self.lengths_B[:, None]
            real_BL = (self.write_slots_BL >= self.block_size) & (positions_BL >= lengths_B1 - W)
            row_BL = jnp.where(real_BL, self.ring_rows_B[:, None], R - 1)
            ring_RWKH = ring_RWKH.at[row_BL, positions_BL % W].set(new_BLKH.astype(ring_RWKH.dtype))
            S = read_BSKH.shape[1]
            j_S = jnp.arange(S)
            recent_BS = (j_S >= lengths_B1 - W) & (j_S < lengths_B1)
            ring_BSKH = ring_RWKH[self.ring_rows_B[:, None], j_S % W].astype(read_BSKH.dtype)
            return ring_RWKH, jnp.where(recent_BS[..., None, None], ring_BSKH, read_BSKH)

        def attend(store, q_BLNH, k_BLKH, v_BLKH, *, window: int, scale: float):
            """Writes the new keys and values into a combined pool and attends with the ragged
            paged-attention kernel (one query per row: decode)."""
            L = q_BLNH.shape[1]
            kv_BLXH = jnp.stack([k_BLKH, v_BLKH], axis=3).reshape(B, L, -1, k_BLKH.shape[-1])
            store = write(store, kv_BLXH.reshape(B * L, *kv_BLXH.shape[2:]))
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

            run = kernel.ref_ragged_paged_attention
            if self.kernel == "ragged":  # explicit block sizes: no tuning lookup on the device
                run = functools.partial(
                    kernel.ragged_paged_attention,
                    num_kv_pages_per_block=min(M, 8),
                    num_queries_per_block=8,
                    vmem_limit_bytes=32 * 1024 * 1024,
                )
            out_TNH = run(
                q_BLNH.reshape(B * L, *q_BLNH.shape[2:]),
                store.astype(q_BLNH.dtype),
                self.lengths_B,
                tables_BM,
                jnp.arange(B + 1, dtype=jnp.int32) * L,
                jnp.asarray([B], jnp.int32),
                sm_scale=scale,
                sliding_window=window or None,
            )
            return store, out_TNH.reshape(q_BLNH.shape)

        S = M * self.block_size
        kv_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        kv_segment_ids_BS = jnp.where(kv_positions_BS < self.lengths_B[:, None], 1, -1)
        fused = self.kernel and self.write_slots_BL.shape[1] == 1
        return kv_positions_BS, kv_segment_ids_BS, update, attend if fused else None

    @property
    def block_size(self) -> int:
        k = self.k_TNbKH[0] if isinstance(self.k_TNbKH, tuple) else self.k_TNbKH  # per layer
        k = k["q"] if isinstance(k, dict) else k
        return k.shape[-3]

    def updated(self, k_TNbKH, v_TNbKH, positions_BS, segment_ids_BS, written: int):
        return dataclasses.replace(self, k_TNbKH=k_TNbKH, v_TNbKH=v_TNbKH)
