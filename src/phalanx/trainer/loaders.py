"""The Trainer's data loaders, built from its arguments as transformers' Trainer builds them, before the engine splits
them over the ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["build_loader", "eval_set", "loader_from"]


def build_loader(
    args: Any, engine: Any, collate: Callable[[list[Any]], Any], dataset: Dataset, batch_size: int, shuffle: bool
) -> DataLoader:
    """A DataLoader over ``dataset`` with the ``dataloader_*`` arguments; ``train()`` splits it over the ranks."""
    workers: dict[str, Any] = {}
    if args.dataloader_num_workers > 0:  # torch refuses these without workers
        workers["persistent_workers"] = args.dataloader_persistent_workers
        workers["prefetch_factor"] = args.dataloader_prefetch_factor
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and not isinstance(dataset, IterableDataset),  # a stream keeps its own order
        collate_fn=collate,
        drop_last=args.dataloader_drop_last,  # in evaluation too, as HF
        num_workers=args.dataloader_num_workers,
        **workers,
        pin_memory=args.dataloader_pin_memory and engine.device.type == "cuda",
    )
    # Not yet split over the ranks; the global batch it will give, as HF's prepared loader says.
    loader.total_batch_size = batch_size * engine.num_processes  # type: ignore[attr-defined]
    return loader


def eval_set(sets: Any, asked: Any) -> Any:
    """The dataset ``get_eval_dataloader(asked)`` reads: ``asked`` itself, one of the Trainer's named ``sets`` (a
    name), or the Trainer's eval set (None)."""
    if isinstance(asked, str):
        if not isinstance(sets, dict) or asked not in sets:
            names: list[str] = sorted(sets) if isinstance(sets, dict) else []
            raise KeyError(f"no eval set named {asked!r}: the Trainer's named eval sets are {names}")
        asked = sets[asked]
    dataset = asked if asked is not None else sets
    if dataset is None:
        raise ValueError("Trainer.evaluate needs an eval_dataset (given to Trainer or to evaluate)")
    if isinstance(dataset, dict):
        raise TypeError(
            f"the eval sets are named ({sorted(dataset)}): get_eval_dataloader(name) gives one set's loader"
        )
    return dataset


def loader_from(obj: Any, method: str) -> DataLoader:
    """What an overridden ``get_train_dataloader``/``get_eval_dataloader`` returned, if it is a torch DataLoader."""
    if not isinstance(obj, DataLoader):
        raise TypeError(
            f"{method}() returned a {type(obj).__name__}, not a torch DataLoader: phalanx splits each global batch of "
            "a DataLoader over the ranks and records its position for resuming, which it cannot do for another "
            "iterable. Return a DataLoader (over an IterableDataset that chains your sources, for instance)"
        )
    return obj
