"""One process of a training job under a framework, for tests/test_frameworks.py. Run from the
repository root as ``python -m tests._framework_jobs JOB SPEC``: Lightning's DDP starts its
other ranks with the same command line, ``torchrun -m`` starts every rank with it. ``SPEC`` is a
JSON file: the dataset's ``root`` and ``options`` (a loopback S3 server's), ``out`` (a folder),
``cache`` and per job ``phase``, ``ckpt``. Each rank writes what it saw to
``OUT/PHASE-rank-R.json``: for every epoch, the sample ids in the order the loop got them.

Jobs (2 ranks, gloo, CPU):

- ``lightning``: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` with its defaults
  (``use_distributed_sampler=False`` in phase ``off``), 3 epochs, a checkpoint every 4 steps
  and one at each epoch's end; resumed from one (``ckpt``) when given. The loader is made
  before ``fit`` (so before the process group), or in ``train_dataloader`` (phase ``hook``).
- ``accelerate``: under torchrun; the loader given to ``accelerator.prepare`` (the default
  setup), then the setup docs/frameworks.md gives: the model and optimizer prepared, the
  loader under a ``DeviceLoader`` registered for checkpointing; ``save_state`` mid-epoch and
  at an epoch's end, each resumed with ``load_state`` into a fresh loader.
- ``torchrun``: plain DDP; a loader iterated with no process group (the launcher's variables
  only), then one made before ``init_process_group``; its ``state_dict`` mid-epoch and at an
  epoch's end, each resumed by a fresh loader that is never told an epoch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import fastload
from fastload import Cache, ConfigError, RemoteDataset

EPOCHS = 3
BATCH = 10
SEED = 3


def dataset(spec: dict[str, Any]) -> RemoteDataset:
    return RemoteDataset(
        spec["root"],
        decode="npy",
        cache=Cache(spec["cache"], format="npy"),
        storage_options=spec["options"],
    )


def loader(spec: dict[str, Any], workers: int = 0) -> fastload.DataLoader:
    return fastload.DataLoader(
        dataset(spec), batch_size=BATCH, shuffle=True, seed=SEED, num_workers=workers
    )


def ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def write(spec: dict[str, Any], rank: int, result: dict[str, Any]) -> None:
    path = Path(spec["out"]) / f"{spec['phase']}-rank-{rank}.json"
    path.write_text(json.dumps(result))


def lightning(spec: dict[str, Any]) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.setdefault(self.current_epoch, []).extend(ids(batch))
            return (self.layer(batch.float()) ** 2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class MadeInTheHook(Model):
        def train_dataloader(self) -> fastload.DataLoader:
            return loader(spec)

    ckpt = Path(spec["out"]) / "checkpoints"
    every_4_steps = ModelCheckpoint(
        dirpath=ckpt,
        filename="step-{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=4,
        save_top_k=-1,
    )
    epoch_ends = ModelCheckpoint(
        dirpath=ckpt,
        filename="end-{epoch}",
        auto_insert_metric_name=False,
        every_n_epochs=1,
        save_on_train_epoch_end=True,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        callbacks=[every_4_steps, epoch_ends],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=spec["phase"] != "off",
        default_root_dir=spec["out"],
    )
    if spec["phase"] == "hook":
        model: Model = MadeInTheHook()
        trainer.fit(model, ckpt_path=spec.get("ckpt"))
    else:
        model = Model()
        trainer.fit(model, train_dataloaders=loader(spec), ckpt_path=spec.get("ckpt"))
    write(spec, trainer.global_rank, {"epochs": model.seen})


def accelerate(spec: dict[str, Any]) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    state = Path(spec["out"]) / "state"
    result: dict[str, Any] = {}
    # the default setup: the loader prepared with the model and optimizer
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    *_, prepared = accelerator.prepare(model, optimizer, loader(spec))
    try:
        result["prepared"] = [i for batch in prepared for i in ids(batch)]
    except ConfigError as exc:
        result["prepared error"] = str(exc)
    # the setup docs/frameworks.md gives; then resumed, each time in a fresh Accelerator
    result["epochs"] = accelerated(spec, range(EPOCHS), save=state)
    result["resumed mid"] = accelerated(spec, range(1, EPOCHS), load=state / "mid")
    result["resumed end"] = accelerated(spec, range(1, EPOCHS), load=state / "end")
    write(spec, accelerator.process_index, result)
    # the process group Accelerator made, ended before the interpreter (a rank that exited
    # with it alive aborted now and then: "terminate called without an active exception")
    accelerator.wait_for_everyone()
    accelerator.end_training()


def accelerated(
    spec: dict[str, Any], epochs: range, save: Path | None = None, load: Path | None = None
) -> dict[int, list[int]]:
    """Train over ``epochs`` with the model and optimizer prepared and the fastload loader as
    it is, under a DeviceLoader registered for checkpointing: saved to ``save``/mid after 3
    batches of epoch 1 and to ``save``/end after epoch 0, or first loaded from ``load``."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = fastload.DeviceLoader(loader(spec), accelerator.device)
    accelerator.register_for_checkpointing(data)
    if load is not None:
        accelerator.load_state(str(load))
    seen: dict[int, list[int]] = {}
    for epoch in epochs:
        for step, batch in enumerate(data):
            loss = (model(batch.float()) ** 2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.setdefault(epoch, []).extend(ids(batch))
            if save is not None and (epoch, step) == (1, 2):
                accelerator.save_state(str(save / "mid"))
        if save is not None and epoch == 0:
            accelerator.save_state(str(save / "end"))
    return seen


def torchrun(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {}
    # no process group at all: the launcher's RANK and WORLD_SIZE split the epoch
    result["no group"] = [i for batch in loader(spec) for i in ids(batch)]

    # made before the process group, iterated after it is up
    made_before = loader(spec, workers=1)
    dist.init_process_group("gloo")
    epochs: dict[int, list[int]] = {}
    states = {}
    for epoch in range(EPOCHS):
        made_before.set_epoch(epoch)
        for step, batch in enumerate(made_before):
            epochs.setdefault(epoch, []).extend(ids(batch))
            if (epoch, step) == (1, 2):
                states["mid"] = made_before.state_dict()
        if epoch == 0:
            states["end"] = made_before.state_dict()
    result["epochs"], result["states"], result["length"] = epochs, states, len(made_before)
    for name, state in states.items():  # a fresh loader, never told an epoch
        resumed = loader(spec)
        resumed.load_state_dict(state)
        passes = [[i for batch in resumed for i in ids(batch)] for _ in range(2)]
        result[f"resumed {name}"] = {"passes": passes, "length": len(resumed)}
    dist.barrier()
    dist.destroy_process_group()
    write(spec, rank, result)


JOBS = {"lightning": lightning, "accelerate": accelerate, "torchrun": torchrun}

if __name__ == "__main__":
    job, spec_file = sys.argv[1:3]
    JOBS[job](json.loads(Path(spec_file).read_text()))
