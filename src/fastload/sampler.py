"""O(1)-memory shuffling with even sharding and O(1) mid-epoch resume.

The epoch order is a seeded bijection of ``range(n)`` computed per position (a keyed Feistel
network over the next power-of-four domain, cycle-walked back into ``range(n)``), so no
permutation is ever materialised and any position can be computed directly.

Sharding is by *global position*: the epoch is the sequence ``order(0), order(1), ...``, padded
to a multiple of ``world_size``; rank ``r`` takes positions ``start + r, start + r + W, ...``.
A checkpoint stores how many global positions were consumed, so resuming on a different world
size continues with exactly the samples not yet seen.

In block mode (chunked storage, shards read in place) rank ``r`` takes a contiguous share of the
epoch instead, ``r * P`` to ``(r + 1) * P``: the epoch visits blocks one after another, so each
rank reads its own blocks and a block is read by one rank, not by every rank (striding would
give every rank a sample of every block). A checkpoint then stores the positions not yet
consumed, as ranges; resuming on any world size shares those ranges out the same way.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import DistributedSampler

from fastload.errors import ConfigError
from fastload.ranks import rank_world, sharding_rank_world, this_rank_alone, xla_rank_world

logger = logging.getLogger(__name__)

Indices = npt.NDArray[np.int64]
_U64 = np.uint64
_MASK64 = (1 << 64) - 1
_ROUNDS = 4  # Luby-Rackoff: four rounds of a good round function give a strong PRP
_CHUNK = 1 << 16  # positions per vectorised step: cache-sized
_FIRST_CHUNK = 256  # the first index must come fast (and so must a resume)
_STATE_VERSION = 1
_MAX_N = 1 << 62  # positions and indices are int64, padded positions up to 2n
_SEEDS = 1 << 63  # seeds in [-2**63, 2**63): each a distinct 64-bit key (no two collide)
_STATE_FIELDS = ("n", "seed", "shuffle", "block_size", "window", "epoch", "position")


def _checked_int(what: str, value: object, low: int, high: int = _MAX_N) -> int:
    """``value`` as an int in ``[low, high)``; a ConfigError naming ``what`` for anything else
    (a float, a string or a bool would fail later, a seed past 64 bits collide with another)."""
    number = None if isinstance(value, bool) or not isinstance(value, int | np.integer) else value
    if number is None or not low <= number < high:
        bound = f">= {low}" if high == _MAX_N else f"in [{low}, {high})"
        raise ConfigError(f"PermutationSampler: {what} must be an int {bound}, got {value!r}")
    return int(number)


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix(values: npt.NDArray[np.uint64], key: int) -> npt.NDArray[np.uint64]:
    """A 64-bit avalanche hash of ``values`` keyed by ``key`` (vectorised, wraps mod 2**64)."""
    x = values ^ _U64(key)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    result: npt.NDArray[np.uint64] = x ^ (x >> _U64(31))
    return result


class KeyedPermutation:
    """A seeded bijection of ``range(n)``: O(1) memory, any position computable directly."""

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ConfigError(f"KeyedPermutation: n must be >= 0, got {n}")
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        self._half = (bits + 1) // 2
        self._half_mask = _U64((1 << self._half) - 1)
        state = key & _MASK64
        keys = []
        for _ in range(_ROUNDS):
            state = _splitmix64(state)
            keys.append(state)
        self._keys = tuple(keys)

    def _feistel(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        shift = _U64(self._half)
        top = _U64(64 - self._half)
        left, right = x >> shift, x & self._half_mask
        for key in self._keys:
            # round function: multiply-xorshift-multiply, keep the top ``half`` bits
            f = (right ^ _U64(key)) * _U64(0x9E3779B97F4A7C15)
            f ^= f >> _U64(29)
            f *= _U64(0xBF58476D1CE4E5B9)
            f >>= top
            f ^= left
            left, right = right, f
        result: npt.NDArray[np.uint64] = (left << shift) | right
        return result

    def __call__(self, positions: npt.ArrayLike) -> Indices:
        """The permuted values of ``positions`` (each in ``range(n)``)."""
        x = np.asarray(positions, dtype=np.uint64).reshape(-1)
        if self.n <= 1:
            return x.astype(np.int64)
        out = np.empty(x.size, dtype=np.int64)
        for begin in range(0, x.size, _CHUNK):
            out[begin : begin + _CHUNK] = self._walk(x[begin : begin + _CHUNK])
        return out

    def _walk(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        y = self._feistel(x)
        limit = _U64(self.n)
        outside = np.flatnonzero(y >= limit)
        while outside.size:  # cycle-walking: the walk stays on x's cycle, which meets range(n)
            y[outside] = self._feistel(y[outside])
            outside = outside[y[outside] >= limit]
        return y


def _chunks(length: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` steps over ``range(length)``: a small first one, then cache-sized."""
    start, size = 0, _FIRST_CHUNK
    while start < length:
        yield start, min(start + size, length)
        start, size = start + size, _CHUNK


@dataclass(frozen=True)
class _Plan:
    """How one epoch's remaining positions are laid out over the ranks: from ``start`` on
    (strided), or in block mode the ``ranges`` ([start, stop) rows, in epoch order), shared out
    in contiguous runs of ``per_rank``."""

    start: int
    per_rank: int
    real: int  # this rank's samples that are not padding (always first)
    ranges: Indices | None = None

    def positions(self, concat: Indices) -> Indices:
        """The epoch positions at places ``concat`` of the ranges laid end to end (wrapping)."""
        assert self.ranges is not None
        sizes = self.ranges[:, 1] - self.ranges[:, 0]
        total = int(sizes.sum())
        if total == 0:
            return concat
        concat = concat % total
        ends = np.cumsum(sizes)
        row = np.searchsorted(ends, concat, side="right")
        out: Indices = self.ranges[row, 0] + concat - (ends[row] - sizes[row])
        return out

    def positions_between(self, a: int, b: int) -> Indices:
        """The epoch positions at places ``[a, b)`` of the ranges laid end to end, as ranges."""
        assert self.ranges is not None
        ends = np.cumsum(self.ranges[:, 1] - self.ranges[:, 0])
        starts = ends - (self.ranges[:, 1] - self.ranges[:, 0])
        lo, hi = np.maximum(starts, a), np.minimum(ends, b)
        keep = lo < hi
        shift = self.ranges[keep, 0] - starts[keep]
        rows: Indices = np.stack([lo[keep] + shift, hi[keep] + shift], axis=1)
        return rows


class PermutationSampler(DistributedSampler[int]):
    """Shuffled (or sequential) indices of ``range(n)`` for this rank, in O(1) memory.

    A ``torch.utils.data.DistributedSampler`` (without its dataset: the order is computed),
    so frameworks that shard a loader's sampler unless it is one (Lightning, Lightning
    Fabric, Ray Train) leave it to shard itself. ``len()`` is this rank's share of the whole
    epoch, as torch's; after :meth:`load_state_dict` a pass yields only what is left of it.

    Args:
        n: dataset length.
        shuffle: shuffle per epoch (``False``: ``0, 1, 2, ...`` sharded the same way).
        seed: same seed and epoch give the same order on every machine.
        rank: this process's rank; by default, looked up whenever the sampler is used (so a
            sampler made before ``init_process_group`` shards once the group is up): from
            ``torch.distributed`` when initialised, else from the launcher's ``RANK``
            (torchrun), else 0; under torch_xla's runtime, its ordinal when the sampler is
            made; made inside :func:`fastload.this_rank_only`, 0 wherever it is used.
        world_size: number of ranks, from the same sources (``WORLD_SIZE``; else 1).
        drop_last: drop the tail that does not divide evenly (never down to zero samples: with
            fewer samples than ranks, the epoch is padded instead). Otherwise the epoch is padded
            by wrapping; padding always comes last on each rank, see :attr:`num_real_samples`.
        block_size: locality-aware mode for chunked storage. Blocks of ``block_size``
            consecutive indices are visited in a shuffled order, and indices are shuffled
            within windows of ``window`` consecutive blocks, so a batch touches few chunks.
        blocks: the same with blocks of any size (the shards or row groups of a dataset read
            in place): the first index of each block, ascending from 0 (``dataset.blocks``).
            Memory is O(number of blocks).
        window: blocks per shuffling window in block mode.
    """

    def __init__(
        self,
        n: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        block_size: int | None = None,
        blocks: Sequence[int] | npt.ArrayLike | None = None,
        window: int = 4,
    ) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < _MAX_N:
            raise ConfigError(f"PermutationSampler: n must be an int in [0, 2**62), got {n!r}")
        seed = _checked_int("seed", seed, -_SEEDS, _SEEDS)
        # Made for this rank alone: every sample, wherever used. Under torch_xla the ordinal is
        # read here: a loader's threads (MpDeviceLoader's) may see another one.
        pinned = (0, 1) if this_rank_alone() else xla_rank_world() and rank_world()
        self._given_world = pinned[1] if pinned and world_size is None else world_size
        self._given_rank = pinned[0] if pinned and rank is None else rank
        if world_size is not None:
            _checked_int("world_size", world_size, 1)
        self._ranks()  # explicit values are checked now, looked-up ones whenever used
        if block_size is not None:
            block_size = _checked_int("block_size", block_size, 1)
        window = _checked_int("window", window, 1)
        self.blocks = None if blocks is None else _checked_blocks(blocks, n, block_size)
        self._block_layout: tuple[int, Indices, Indices] | None = None  # (epoch, order, ends)
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.drop_last = drop_last
        self.block_size, self.window = block_size, window
        self.epoch = 0
        self._yielded = 0
        self._unserved: int | Indices = self._whole_epoch()  # what this pass has left to serve
        self._planned: tuple[tuple[int, int], _Plan] | None = None  # (rank, world), its plan
        self._epoch_chosen = False  # set_epoch/load_state_dict since the loader last looked
        self._finished: int | None = None  # a loaded state ended this epoch (see set_epoch)
        self._owner: str | None = None  # the fastload.DataLoader it is the sampler of, if any
        self._granted = 0  # passes a fastload.DataLoader began and has not iterated yet

    # -- ranks -------------------------------------------------------------------------------
    def _ranks(self) -> tuple[int, int]:
        """``(rank, world size)`` now: the given ones, the others looked up."""
        rank, world = self._given_rank, self._given_world
        if rank is None or world is None:
            found_rank, found_world = sharding_rank_world()
            rank = found_rank if rank is None else rank
            world = found_world if world is None else world
        world = _checked_int("world_size", world, 1)
        return _checked_int("rank", rank, 0, world), world

    @property
    def rank(self) -> int:
        """This process's rank among those the epoch is split over."""
        return self._ranks()[0]

    @rank.setter
    def rank(self, rank: int) -> None:
        self._given_rank = _checked_int("rank", rank, 0)

    @property
    def world_size(self) -> int:
        """How many ranks the epoch is split over."""
        return self._ranks()[1]

    @world_size.setter
    def world_size(self, world_size: int) -> None:
        self._given_world = _checked_int("world_size", world_size, 1)

    @property
    def num_replicas(self) -> int:  # DistributedSampler's name
        return self.world_size

    @num_replicas.setter
    def num_replicas(self, world_size: int) -> None:
        self.world_size = world_size

    # -- epochs and layout -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch``. Setting the current epoch again keeps a resume point;
        so does setting, after loading a state saved at the end of an epoch, that epoch (the
        pass is then empty: nothing of it is left)."""
        epoch = _checked_int("epoch", epoch, 0)
        self._epoch_chosen = True
        if epoch == self._finished:
            self.epoch, self._finished = epoch, None
            self._start(self._whole_epoch(end=True))
        elif epoch != self.epoch:
            self.epoch, self._finished = epoch, None
            self._start(self._whole_epoch())

    def _start(self, left: int | Indices) -> None:
        """The pass now has ``left`` to serve: from a position on (strided), or ranges."""
        self._unserved = left
        self._planned = None

    @property
    def _plan(self) -> _Plan:
        """What is left of the epoch, laid out over the ranks there are now."""
        ranks = self._ranks()
        if self._planned is None or self._planned[0] != ranks:
            self._planned = (ranks, self._make_plan(self._unserved, *ranks))
        return self._planned[1]

    @property
    def _contiguous(self) -> bool:
        """Whether ranks take contiguous shares (block mode) rather than strided positions."""
        return self.blocks is not None or self.block_size is not None

    def _whole_epoch(self, end: bool = False) -> int | Indices:
        """All of the epoch left to serve (or, ``end``, none of it)."""
        if not self._contiguous:
            return self.n if end else 0
        return np.zeros((0, 2), np.int64) if end else np.asarray([[0, self.n]], np.int64)

    def _make_plan(self, left: int | Indices, rank: int, world: int) -> _Plan:
        """The plan for the positions not yet consumed: from ``left`` on (strided), or the
        ranges ``left`` (block mode)."""
        if isinstance(left, int):
            start, ranges, remaining = left, None, max(self.n - left, 0)
        else:
            start, ranges = 0, left.reshape(-1, 2)
            remaining = int((ranges[:, 1] - ranges[:, 0]).sum())
        per_rank = self._per_rank(remaining, world)
        if self.drop_last and 0 < remaining < world:
            logger.warning(
                "PermutationSampler: %d samples for %d ranks; padding instead of dropping "
                "so that no rank gets zero",
                remaining,
                world,
            )
        if ranges is not None:  # contiguous shares: padding comes at the end of the last ones
            real = max(0, min(per_rank, remaining - rank * per_rank))
        else:
            real = max(0, min(per_rank, -(-(remaining - rank) // world)))
        return _Plan(start, per_rank, real, ranges)

    def _per_rank(self, samples: int, world: int) -> int:
        """Each rank's share of ``samples``: padded, or with ``drop_last`` cut (never to 0)."""
        if self.drop_last and samples >= world:
            return samples // world
        return -(-samples // world)

    def __len__(self) -> int:
        """This rank's share of the whole epoch, as torch's samplers count: also after a
        resume mid-epoch, whose pass yields only what is left (:attr:`num_left`)."""
        return self._per_rank(self.n, self.world_size)

    @property
    def num_left(self) -> int:
        """How many samples this rank's pass yields: :func:`len` but after a resume, what the
        resumed epoch has left for this rank."""
        return self._plan.per_rank

    @property
    def num_real_samples(self) -> int:
        """How many of this rank's samples this pass are unique; the rest (at the end) are
        padding that repeats samples, to be skipped when evaluating each sample once."""
        return self._plan.real

    # -- the order ---------------------------------------------------------------------------
    def _epoch_key(self) -> int:
        return _splitmix64((self.seed & _MASK64) ^ _splitmix64(self.epoch + 1))

    def order(self, positions: npt.ArrayLike) -> Indices:
        """The index at each global epoch position (positions >= n wrap around)."""
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self.n == 0:
            return p[:0]
        p = p % self.n
        if not self.shuffle:
            return p
        if self.blocks is not None:
            return self._sized_block_order(p)
        if self.block_size is None:
            return KeyedPermutation(self.n, self._epoch_key())(p)
        return self._block_order(p)

    def _sized_block_order(self, p: Indices) -> Indices:
        """Block mode with ``blocks`` of any size: the epoch visits the blocks in a shuffled
        order; positions are shuffled within windows of ``window`` consecutive visited blocks."""
        assert self.blocks is not None
        key = self._epoch_key()
        visit, ends = self._layout(key)
        count = len(visit)
        window_ends = ends[
            np.minimum(np.arange(self.window, count + self.window, self.window), count) - 1
        ]
        window_id = np.searchsorted(window_ends, p, side="right")
        out = np.empty_like(p)
        sizes = np.diff(np.append(self.blocks, self.n))
        for w in np.unique(window_id):
            mask = window_id == w
            begin = int(window_ends[w - 1]) if w > 0 else 0
            span = int(window_ends[w]) - begin
            inner = begin + KeyedPermutation(span, _splitmix64(key ^ (int(w) + 1)))(p[mask] - begin)
            slot = np.searchsorted(ends, inner, side="right")  # the visited block holding it
            block = visit[slot]
            out[mask] = self.blocks[block] + inner - (ends[slot] - sizes[block])
        return out

    def _layout(self, key: int) -> tuple[Indices, Indices]:
        """This epoch's block visiting order and where each visited block ends (positions)."""
        if self._block_layout is None or self._block_layout[0] != self.epoch:
            assert self.blocks is not None
            sizes = np.diff(np.append(self.blocks, self.n))
            visit = KeyedPermutation(len(sizes), key)(np.arange(len(sizes)))
            self._block_layout = (self.epoch, visit, np.cumsum(sizes[visit]))
        return self._block_layout[1], self._block_layout[2]

    def _block_order(self, p: Indices) -> Indices:
        size, key = int(self.block_size or 1), self._epoch_key()
        full_blocks = self.n // size
        body = full_blocks * size
        out = np.empty_like(p)
        tail = p >= body  # the partial last block comes last, shuffled within itself
        if tail.any():
            out[tail] = body + KeyedPermutation(self.n - body, key ^ 0x7A11)(p[tail] - body)
        head = ~tail
        if head.any():
            block_perm = KeyedPermutation(full_blocks, key)
            span = self.window * size
            q = p[head]
            window_id, offset = q // span, q % span
            out[head] = self._within_windows(window_id, offset, block_perm, full_blocks, key)
        return out

    def _within_windows(
        self,
        window_id: Indices,
        offset: Indices,
        block_perm: KeyedPermutation,
        full_blocks: int,
        key: int,
    ) -> Indices:
        size = int(self.block_size or 1)
        out = np.empty_like(offset)
        for w in np.unique(window_id):
            mask = window_id == w
            first_slot = int(w) * self.window
            blocks = min(self.window, full_blocks - first_slot)
            inner = KeyedPermutation(blocks * size, _splitmix64(key ^ (int(w) + 1)))(offset[mask])
            slot = first_slot + inner // size
            out[mask] = block_perm(slot) * size + inner % size
        return out

    def indices(self, start: int = 0, stop: int | None = None) -> Indices:
        """This rank's indices for local positions ``[start, stop)`` as one numpy array."""
        stop = self.num_left if stop is None else min(stop, self.num_left)
        local = np.arange(start, max(start, stop), dtype=np.int64)
        plan, (rank, world) = self._plan, self._ranks()
        if plan.ranges is not None:
            return self.order(plan.positions(rank * plan.per_rank + local))
        return self.order(plan.start + rank + local * world)

    def __iter__(self) -> Iterator[int]:
        self._check_driver()
        self._finished = None  # a pass began: set_epoch(e) is that epoch again
        return _iter_counted(self, self.indices)

    def _grant_pass(self) -> None:
        """A fastload.DataLoader begins a pass over it."""
        self._granted += 1

    def _check_driver(self) -> None:
        """The sampler of a fastload.DataLoader shards the epoch over the ranks itself: a
        loader a framework rebuilt around it (Accelerate's ``prepare``) shards its batches
        again, and each rank would see 1/world of its share. Refused, naming what to do."""
        if self._owner is None:
            return
        if self._granted:
            self._granted -= 1
            return
        rank, world = self._ranks()
        if world > 1:
            raise ConfigError(
                f"PermutationSampler of {self._owner} (rank {rank} of {world}) is iterated by "
                "another loader, one a framework rebuilt from it: it would shard the batches of "
                "this rank's share again, and each epoch would miss most samples. With "
                "Accelerate, do not pass the fastload.DataLoader to accelerator.prepare(): "
                "prepare the model and optimizer only, iterate the loader as it is (it splits "
                "every epoch over the process group itself) and call "
                "accelerator.register_for_checkpointing(loader) (or the DeviceLoader around "
                "it) so that save_state/load_state resume it exactly (docs/frameworks.md)"
            )

    def iter_batches(self, batch_size: int, drop_last: bool = False) -> Iterator[list[int]]:
        """Batches of this rank's indices, computed vectorised (the fast path)."""
        if batch_size < 1:
            raise ConfigError(f"iter_batches: batch_size must be >= 1, got {batch_size}")
        left = self.num_left
        total = left - (left % batch_size if drop_last else 0)
        step = max(batch_size, _CHUNK // batch_size * batch_size)
        self._yielded = 0
        for chunk_start in range(0, total, step):
            chunk = self.indices(chunk_start, min(chunk_start + step, total))
            for begin in range(0, len(chunk), batch_size):
                batch = chunk[begin : begin + batch_size].tolist()
                self._yielded += len(batch)
                yield batch

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self, local_consumed: int | None = None) -> dict[str, Any]:
        """Where this epoch stands, by global position: resumable on any world size.

        ``local_consumed`` is how many of this rank's samples the training loop really used
        (a DataLoader prefetches ahead of it); by default, how many the iterator yielded.
        """
        consumed = self._yielded if local_consumed is None else local_consumed
        if not 0 <= consumed <= self.num_left:
            raise ConfigError(
                f"PermutationSampler.state_dict: local_consumed must be in [0, "
                f"{self.num_left}], got {consumed}"
            )
        state = {
            "version": _STATE_VERSION,
            "n": self.n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "block_size": self.block_size,
            "window": self.window,
            "blocks": self._blocks_digest(),
            "epoch": self.epoch,
            "position": min(self._plan.start + consumed * self._ranks()[1], self.n),
        }
        if self._plan.ranges is not None:
            left = self._left(consumed)
            state["remaining"] = left.tolist()
            state["position"] = self.n - int((left[:, 1] - left[:, 0]).sum())
        return state

    def _left(self, consumed: int) -> Indices:
        """Block mode: the ranges of positions no rank has consumed once each consumed
        ``consumed`` (ranks go in lockstep): what follows each rank's consumed head in its
        share, and what ``drop_last`` left after the last share."""
        plan = self._plan
        assert plan.ranges is not None
        total = int((plan.ranges[:, 1] - plan.ranges[:, 0]).sum())
        places = []  # [a, b) runs of places in the ranges laid end to end
        world = self._ranks()[1]
        for rank in range(world):
            first = rank * plan.per_rank
            real = max(0, min(plan.per_rank, total - first))
            places.append((first + min(consumed, real), first + real))
        places.append((min(world * plan.per_rank, total), total))
        rows = [plan.positions_between(a, b) for a, b in places if a < b]
        return np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)

    def _blocks_digest(self) -> str | None:
        if self.blocks is None:
            return None
        return hashlib.sha256(self.blocks.tobytes()).hexdigest()[:16]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at its global position, in O(1)."""
        if not isinstance(state, dict):
            raise ConfigError(
                f"PermutationSampler.load_state_dict: expected the dict state_dict() gave, "
                f"got {type(state).__name__}"
            )
        for field in _STATE_FIELDS:
            if field not in state:
                raise ConfigError(f"PermutationSampler.load_state_dict: state lacks {field!r}")
        if not isinstance(state["epoch"], int) or isinstance(state["epoch"], bool):
            raise ConfigError(
                f"PermutationSampler.load_state_dict: epoch must be an int, got {state['epoch']!r}"
            )
        shaping = ("n", "seed", "shuffle", "block_size", "window")  # the window: in block mode
        for field in shaping if self._contiguous else shaping[:-1]:
            if state[field] != getattr(self, field):
                raise ConfigError(
                    f"PermutationSampler.load_state_dict: state has {field}={state[field]!r} "
                    f"but this sampler has {field}={getattr(self, field)!r}"
                )
        if state.get("blocks") != self._blocks_digest():
            raise ConfigError(
                "PermutationSampler.load_state_dict: the state was saved over other blocks "
                "(the dataset's shards or row groups changed)"
            )
        position = state.get("position")
        if not isinstance(position, int) or not 0 <= position <= self.n:
            raise ConfigError(
                f"PermutationSampler.load_state_dict: position must be in [0, {self.n}], "
                f"got {position!r}"
            )
        left: int | Indices = position
        if self._contiguous:  # a state saved before block mode shared contiguously: a prefix
            left = _checked_ranges(state.get("remaining", [[position, self.n]]), self.n)
        self.epoch, self._finished = int(state["epoch"]), None
        self._start(left)
        if self.num_left == 0 and self.n:  # the epoch had ended: the next one starts by itself
            self.epoch, self._finished = self.epoch + 1, self.epoch
            self._start(self._whole_epoch())
        self._yielded = 0
        self._epoch_chosen = True

    def _new_pass(self, advance: bool) -> None:
        """A loader starts a pass: go on to the next epoch (``advance``) unless one was chosen
        since the last pass. This is how ``DataLoader(shuffle=True)`` reshuffles, as torch's."""
        if advance and not self._epoch_chosen:
            self.set_epoch(self.epoch + 1)
        self._epoch_chosen = False

    def __repr__(self) -> str:
        return (
            f"PermutationSampler(n={self.n}, shuffle={self.shuffle}, seed={self.seed}, "
            f"rank={self.rank}, world_size={self.world_size}, epoch={self.epoch})"
        )


def _checked_ranges(ranges: Any, n: int) -> Indices:
    try:
        rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"PermutationSampler.load_state_dict: remaining must be [start, stop) pairs, got "
            f"{str(ranges)[:80]}"
        ) from exc
    if np.any(rows[:, 0] > rows[:, 1]) or np.any(rows < 0) or np.any(rows > n):
        raise ConfigError(
            f"PermutationSampler.load_state_dict: remaining must be ranges within [0, {n}], got "
            f"{rows[:3].tolist()}"
        )
    return rows


def _checked_blocks(
    blocks: Sequence[int] | npt.ArrayLike, n: int, block_size: int | None
) -> Indices:
    if block_size is not None:
        raise ConfigError("PermutationSampler: give block_size or blocks, not both")
    starts = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if n and (
        starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n
    ):
        raise ConfigError(
            f"PermutationSampler: blocks must be the first index of each block, ascending from 0 "
            f"and below n={n}, got {starts[:5].tolist()}{'...' if starts.size > 5 else ''}"
        )
    starts.setflags(write=False)
    return starts


def block_locality(
    sampler: PermutationSampler, batch_size: int, batches: int = 200
) -> dict[str, float]:
    """How local and how shuffled the sampler's first ``batches`` batches are: the mean number
    of distinct blocks a batch touches, and the mean share of its largest block (1.0: a batch is
    one block; 1/batch_size: every sample from a different block)."""
    starts = sampler.blocks
    if starts is None:
        size = sampler.block_size or 1
        starts = np.arange(0, sampler.n, size, dtype=np.int64)
    indices = sampler.indices(0, batch_size * batches)
    counts, shares = [], []
    for begin in range(0, len(indices), batch_size):
        block = np.searchsorted(starts, indices[begin : begin + batch_size], side="right")
        _, per = np.unique(block, return_counts=True)
        counts.append(len(per))
        shares.append(per.max() / per.sum())
    return {"blocks_per_batch": float(np.mean(counts)), "largest_share": float(np.mean(shares))}


def _iter_counted(
    counter: PermutationSampler, indices: Callable[[int, int], Indices]
) -> Iterator[int]:
    """Yield ``indices`` chunk by chunk, keeping ``counter``'s count for ``state_dict()``."""
    counter._yielded = 0
    for chunk_start, chunk_stop in _chunks(counter.num_left):
        chunk = indices(chunk_start, chunk_stop).tolist()
        for counter._yielded, index in enumerate(chunk, chunk_start + 1):
            yield index


class WeightedSampler(DistributedSampler[int]):
    """Sampling with replacement by weight (e.g. class balancing), deterministic per epoch.

    Each global position draws independently from a counter-based generator keyed by
    ``(seed, epoch, position)``, so ranks shard by position like :class:`PermutationSampler`
    (a ``DistributedSampler`` too, that frameworks leave to shard itself) and resuming costs
    O(1). Memory is O(len(weights)) for the cumulative weights.
    """

    def __init__(
        self,
        weights: Sequence[float] | npt.ArrayLike,
        num_samples: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        w = _one_per_sample(np.asarray(weights, dtype=np.float64), "weights")
        if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ConfigError("WeightedSampler: weights must be finite, >= 0, with a positive sum")
        if num_samples < 1:
            raise ConfigError(f"WeightedSampler: num_samples must be >= 1, got {num_samples}")
        self._cdf = np.cumsum(w) / w.sum()
        self._cdf[-1] = 1.0
        self._positions = PermutationSampler(
            num_samples, shuffle=False, seed=seed, rank=rank, world_size=world_size
        )
        self.seed, self.shuffle, self.drop_last = seed, True, False

    @property
    def rank(self) -> int:
        return self._positions.rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self._positions.rank = rank

    @property
    def num_replicas(self) -> int:
        return self._positions.world_size

    @num_replicas.setter
    def num_replicas(self, world_size: int) -> None:
        self._positions.world_size = world_size

    @property
    def epoch(self) -> int:
        return self._positions.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._positions.set_epoch(epoch)

    @classmethod
    def balanced(cls, labels: Sequence[int] | npt.ArrayLike, **kwargs: Any) -> WeightedSampler:
        """Every class equally likely: weight = 1 / (count of the sample's class)."""
        y = _one_per_sample(np.asarray(labels), "labels", " (one-hot labels: labels.argmax(1))")
        _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
        kwargs.setdefault("num_samples", y.size)
        return cls(1.0 / counts[inverse], **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self._positions.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._positions)

    def indices(self, start: int = 0, stop: int | None = None) -> Indices:
        positions = self._positions.indices(start, stop).astype(np.uint64)
        key = _splitmix64((self.seed & _MASK64) ^ _splitmix64(self._positions.epoch + 0x5EED))
        uniform = (_mix(positions, key) >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))
        drawn: Indices = np.searchsorted(self._cdf, uniform, side="right").astype(np.int64)
        return drawn

    def __iter__(self) -> Iterator[int]:
        return _iter_counted(self._positions, self.indices)

    def state_dict(self, local_consumed: int | None = None) -> dict[str, Any]:
        return self._positions.state_dict(local_consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._positions.load_state_dict(state)


def _one_per_sample(values: np.ndarray, what: str, hint: str = "") -> np.ndarray:
    """``values`` as one per sample: a column or a row is taken flat, a table refused (read
    flat, an (n, k) table drew indices up to n * k)."""
    if sum(length > 1 for length in values.shape) > 1:
        raise ConfigError(
            f"WeightedSampler: {what} must be one per sample (1-D), got shape {values.shape}{hint}"
        )
    return values.reshape(-1)
