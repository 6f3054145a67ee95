"""What kind of data source the user passed, and the paragraph when it cannot be split.

    map      __len__ and __getitem__ (a torch map-style Dataset, a list, a Hugging Face `Dataset`): a
             sampler splits the indices (DistributedSampler's rule, or the user's sampler's order)
    stream   an iterable (torch `IterableDataset` without a rank split of its own): the index split of
             `ddpkit.data.streams`
    hf       a Hugging Face `IterableDataset` not yet split: its own `split_dataset_by_node` (by shard
             file when the shards divide over the ranks, else by example), then like `presplit`
    presplit the rank's own part already (`presplit=True`, or a Hugging Face `IterableDataset` after
             `split_dataset_by_node`): never split again

Hugging Face objects are recognised by their module and attributes, so `datasets` is imported only
when the user passed one of its objects.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from ddpkit.data.streams import shuffled
from ddpkit.errors import problem


def is_hf_iterable(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and hasattr(source, "n_shards")


def kind_of(source: Any, *, presplit: bool) -> str:
    """'map', 'stream', 'hf' or 'presplit'; a paragraph for what cannot be read or split."""
    if iter_is_self(source):
        raise problem(
            f"the data source is an iterator ({type(source).__name__}): it can be read once, by one "
            "process, so it cannot be split over ranks and DataLoader workers nor read again next epoch",
            "Wrap it in a torch.utils.data.IterableDataset whose __iter__ builds a new iterator each "
            "time (class Stream(IterableDataset): def __iter__(self): return my_generator()), and yield "
            "the same sequence in every process (seed any randomness by the epoch: set_epoch is called)",
        )
    iterable = isinstance(source, IterableDataset) or (
        hasattr(source, "__iter__") and not hasattr(source, "__getitem__")
    )
    if iterable:
        if is_hf_iterable(source):
            return "presplit" if getattr(source, "_distributed", None) is not None or presplit else "hf"
        return "presplit" if presplit else "stream"
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return "presplit" if presplit else "map"
    raise problem(
        f"the data source ({type(source).__name__}) is neither map-style (__len__ and __getitem__) nor "
        "iterable (__iter__)",
        "Pass a torch Dataset, a torch IterableDataset or a Hugging Face Dataset/IterableDataset",
    )


def iter_is_self(source: Any) -> bool:
    """A generator or another one-pass iterator (iter(x) is x)."""
    return hasattr(source, "__next__") and hasattr(source, "__iter__") and not hasattr(source, "__getitem__")


def check_stream_options(kind: str, options: dict[str, Any]) -> None:
    """Refuse DataLoader options an iterable source cannot honour, with the reason."""
    if options.get("persistent_workers"):
        raise problem(
            "persistent_workers=True with an iterable source: the workers would keep the first epoch's "
            "copy of the source, so set_epoch and the start position of later passes would not reach them",
            "Drop persistent_workers (workers start anew every pass), or use a map-style Dataset",
        )
    for name in ("sampler", "batch_sampler"):
        if options.get(name) is not None:
            raise problem(
                f"{name}= with an iterable source: an iterable has no indices to sample",
                "Drop it; shuffle=True shuffles an iterable through a seeded buffer (shuffle_buffer=N)",
            )


class Iterated(IterableDataset):
    """A rank's own stream (pre-split) as torch's DataLoader reads it, shuffled through a buffer seeded
    by (seed, epoch) when `buffer` > 0; the source splits itself over DataLoader workers, if it has any."""

    def __init__(self, source: Any, buffer: int, seed: int) -> None:
        self.source, self.buffer, self.seed = source, buffer, seed
        self.epoch = 0

    def __iter__(self) -> Any:
        if not self.buffer:
            return iter(self.source)
        return shuffled(self.source, self.buffer, self.seed * 1_000_003 + self.epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)
