"""The engine's KV block pool, host side: which blocks are free, how many users each has, and
the blocks kept past their sequences (the prefix cache, kept samples, the prompts of groups
admitted in parts). The device side, the pool's arrays, is `_paged.Rows`."""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from posttrain.sampling._request import Kept


class BlockPool:
    """`num_blocks` blocks (block 0 is scratch, never handed out), reference-counted.

    Besides the sequences' own references, three kinds of holders keep blocks past a sequence:
    the prefix cache (`cache`: a key of a block's tokens and all before them -> the block, least
    recently used first), kept samples (`kept`: their `Kept`, oldest first) and groups admitted
    in parts (`held`: request id -> its prompt's full blocks and a copy of its last one). When
    `take` runs short it evicts cached blocks no sequence uses, then drops kept samples.
    """

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, 0, -1))  # a stack
        self.refs = np.zeros(num_blocks, np.int32)
        self.cache: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.kept: dict[int, Kept] = {}
        self.held: dict[int, tuple[list[int], int | None]] = {}

    def take(self, count: int) -> list[int]:
        """`count` free blocks, each with one reference (evicting or dropping if short)."""
        for key in [k for k, b in self.cache.items() if self.refs[b] == 1]:
            if len(self.free) >= count:
                break
            self.release([self.cache.pop(key)])
        for kept in list(self.kept.values()):  # (their next part then prefills whole)
            if len(self.free) >= count:
                break
            self.drop(kept)
        blocks = [self.free.pop() for _ in range(count)]
        self.refs[blocks] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def evictable(self, keep=()) -> int:
        """Cached blocks no sequence uses (nor `keep`): what eviction can free."""
        return sum(1 for b in self.cache.values() if self.refs[b] == 1 and b not in keep)

    def droppable(self, spare: Kept | None = None) -> int:
        """Blocks only kept samples hold (but `spare`): what dropping them can free."""
        return sum(
            1
            for kept in self.kept.values()
            if kept is not spare
            for b in kept.blocks
            if self.refs[b] == 1
        )

    def keep(self, blocks: list[int], length: int) -> Kept:
        """A finished sample's blocks, kept (its references move to the `Kept`)."""
        kept = Kept(blocks, length)
        self.kept[id(kept)] = kept
        return kept

    def drop(self, kept: Kept) -> None:
        """Frees a kept sample's blocks: a request continuing it prefills its whole prompt."""
        self.kept.pop(id(kept), None)
        self.release(kept.blocks)
        kept.blocks, kept.length = [], 0

    def cached_prefix(self, prompt, block_size: int) -> tuple[list[bytes], list[int]]:
        """The keys of the prompt's full blocks (each: its tokens and all before them), and the
        cached blocks holding its longest cached prefix (touched: most recently used)."""
        tokens, keys, key = np.asarray(prompt, np.int32), [], b""
        for i in range(len(tokens) // block_size):
            chunk = tokens[i * block_size : (i + 1) * block_size]
            key = hashlib.blake2b(key + chunk.tobytes()).digest()
            keys.append(key)
        found = []
        for key in keys:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            found.append(self.cache[key])
        return keys, found

    def cache_blocks(self, keys: list[bytes], blocks: list[int]) -> None:
        """Puts prefilled full blocks in the prefix cache (a key already there keeps its own)."""
        for key, block in zip(keys, blocks, strict=True):
            if key not in self.cache:
                self.cache[key] = block
                self.refs[block] += 1

    def clear_cache(self) -> None:
        self.release(list(self.cache.values()))
        self.cache.clear()

    def let_go(self, request_id: int) -> None:
        """Gives back the prompt blocks held for a request's later samples."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.release(held[0] + ([] if held[1] is None else [held[1]]))
