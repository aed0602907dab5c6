"""A newcomer's first hour: the defaults a user expects (model summary, bounded checkpoint
retention, progress in log files, a note for ddp on one process), warnings for a train loader
that ignores the sampler or batch size under DDP, and an explained error for a resumed run
that outgrows its OneCycleLR schedule."""

import io
import os
import re
from typing import List

import pytest
from logs import captured_log
from torch.utils.data import DataLoader

from distributed import run_ranks
from toy import ToyModule

from framework import Trainer, TrainerArguments
from framework.callbacks import ModelSummary, ProgressBar
from framework.checkpoint.arguments import DefaultCheckpointerArguments

STEPS_PER_EPOCH = 8  # ToyModule: 256 samples, batch 32


def make_args(tmp_path, name: str = "run", checkpoints: DefaultCheckpointerArguments = None, **overrides) -> TrainerArguments:
    values = {
        "epochs": 2,
        "train_batch_size": 32,
        "seed": 0,
        "disable_tqdm": True,
        "log_level": "INFO",
        "output_dir": str(tmp_path / name),
    }
    values.update(overrides)
    return TrainerArguments(checkpointer_args=checkpoints or DefaultCheckpointerArguments(period=0, save_at_end=False), **values)


def checkpoint_names(directory) -> List[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("checkpoint-"))


# -- defaults: model summary, checkpoint retention, ddp on one process ----------------------------


def test_model_summary_is_logged_by_default_once_and_can_be_turned_off(tmp_path):
    trainer = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, epochs=1))
    assert [type(c) for c in trainer.callbacks] == [ModelSummary]  # disable_tqdm: no bar
    with captured_log("framework.callbacks.model_summary") as messages:
        trainer.train()
    assert len(messages) == 1 and "model summary (ToyModule)" in messages[0] and "trainable: 676" in messages[0]

    given = ModelSummary()
    assert Trainer(ToyModule(), make_args(tmp_path, "given"), callbacks=[given]).callbacks == [given]  # not twice
    quiet = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, "off", epochs=1, model_summary=False))
    assert quiet.callbacks == []
    warning_only = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, "warning", epochs=1, log_level="WARNING"))
    with captured_log("framework") as messages:
        warning_only.train()
    assert messages == []  # nothing printed under log_level WARNING


def test_default_retention_keeps_the_newest_three_and_says_so(tmp_path):
    args = make_args(tmp_path, epochs=5, checkpoints=DefaultCheckpointerArguments())
    with captured_log() as messages:
        Trainer(ToyModule(val_loaders=0), args).train()
    directory = tmp_path / "run" / "checkpoints"
    assert checkpoint_names(directory) == [f"checkpoint-{STEPS_PER_EPOCH * epoch:09d}.pt" for epoch in (3, 4, 5)]
    assert (
        f"checkpoints: every epoch and at the end into {directory}, keeping the newest 3 (checkpointer.keep_last_n)" in messages
    )

    keep_all = make_args(tmp_path, "all", epochs=5, checkpoints=DefaultCheckpointerArguments(keep_last_n=None))
    with captured_log() as messages:
        Trainer(ToyModule(val_loaders=0), keep_all).train()
    assert len(checkpoint_names(tmp_path / "all" / "checkpoints")) == 5
    assert any(message.endswith("keeping all") for message in messages)

    best = DefaultCheckpointerArguments(keep_last_n=2, keep_best_n=1, save_every_n_steps=4)
    with captured_log() as messages:
        Trainer(ToyModule(), make_args(tmp_path, "best", epochs=1, checkpoints=best)).train()
    assert any("every epoch, every 4 steps and at the end" in m and "the newest 2 (+1 best by val_loss)" in m for m in messages)


def test_ddp_backend_started_as_one_process_says_it_trains_as_one(tmp_path):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        assert variable not in os.environ  # a plain python process: no launcher
    note = "ddp backend with one process (not launched by torchrun/srun): training as a single process"
    with captured_log() as messages:
        Trainer(ToyModule(val_loaders=0), make_args(tmp_path, epochs=1, backend="ddp")).train()
    assert messages.count(note) == 1
    with captured_log() as messages:
        Trainer(ToyModule(val_loaders=0), make_args(tmp_path, "sp", epochs=1)).train()
    assert not any("single process" in message for message in messages)


# -- a train loader that ignores the sampler or the batch size under DDP ----------------------------


class ShufflingModule(ToyModule):
    """Builds its own shuffling loader with a fixed batch size: ignores both things handed to it."""

    def get_train_dataloader(self, sampler, batch_size):
        sampler(self.train_ds)  # made, then not used
        return DataLoader(self.train_ds, batch_size=64, shuffle=True)


def _two_ranks_train(rank: int, out: str):
    results = []
    for module in (ToyModule(val_loaders=0), ShufflingModule(val_loaders=0)):
        name = type(module).__name__
        args = TrainerArguments(
            epochs=1, train_batch_size=32, backend="ddp", seed=0, disable_tqdm=True, model_summary=False,
            output_dir=os.path.join(out, name), max_train_steps_per_epoch=1,
            checkpointer_args=DefaultCheckpointerArguments(period=0, save_at_end=False),
        )  # fmt: skip
        trainer = Trainer(module, args)
        with captured_log() as messages:
            trainer.train()
        results.append([message for message in messages if "train DataLoader" in message])
    return results


@pytest.mark.distributed
def test_ddp_warns_when_the_train_loader_ignores_the_sampler_or_the_batch_size(tmp_path):
    rank0, rank1 = run_ranks(_two_ranks_train, out=str(tmp_path))
    correct, ignoring = rank0
    assert correct == []
    assert len(ignoring) == 2
    assert ignoring[0].startswith("the train DataLoader does not use the sampler handed to get_train_dataloader")
    assert "RandomSampler" in ignoring[0] and "each of the 2 ranks trains on the whole dataset" in ignoring[0]
    assert "(256 samples per rank instead of about 128)" in ignoring[0] and "sampler=sampler(dataset)" in ignoring[0]
    assert ignoring[1].startswith("the train DataLoader has batch_size=64, but get_train_dataloader was asked for batch_size=16")
    assert "(train_batch_size=32 over 2 ranks)" in ignoring[1] and "each optimizer step sees 128 samples, not 32" in ignoring[1]
    assert rank1 == [[], []]  # rank 1 prints errors only


# -- extending a finished OneCycleLR run -------------------------------------------------------------


def test_resuming_a_finished_onecycle_run_with_more_epochs_explains_the_way_on(tmp_path):
    resume = DefaultCheckpointerArguments(resume="auto")
    Trainer(ToyModule(val_loaders=0), make_args(tmp_path, epochs=2, checkpoints=resume)).train()
    directory = tmp_path / "run" / "checkpoints"
    extended = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, epochs=3, checkpoints=resume))
    with pytest.raises(ValueError) as caught:
        extended.train()
    message = str(caught.value)
    assert message.startswith(f"OneCycleLR ran out of steps after {2 * STEPS_PER_EPOCH} optimizer steps")
    assert "built for total_steps=16 by the run this one resumed" in message
    assert "this run plans 3 epochs x 8 steps = 24" in message and "OneCycleLR cannot be extended" in message
    assert f"--checkpointer.load_dir {directory} --checkpointer.reset_optimizers_schedulers true" in message
    assert "Tried to step 17 times" in message

    # The way on: a new run that loads the weights and builds its schedule for the new epochs.
    fresh = DefaultCheckpointerArguments(load_dir=str(directory), reset_optimizers_schedulers=True)
    longer = Trainer(ToyModule(val_loaders=0), make_args(tmp_path, "longer", epochs=3, checkpoints=fresh))
    longer.train()
    assert longer.global_steps_finished == 3 * STEPS_PER_EPOCH and longer.schedulers[0].total_steps == 24


class ShortSchedule(ToyModule):
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizers, _ = super().get_optimizers_schedulers(estimated_global_steps_per_epoch, epochs)
        import torch

        return optimizers, [torch.optim.lr_scheduler.OneCycleLR(optimizers[0], max_lr=0.05, total_steps=5)]


def test_a_schedule_built_too_short_names_the_steps_the_run_takes(tmp_path):
    with pytest.raises(ValueError, match=r"built it for total_steps=5, but this run plans 2 epochs x 8 steps = 16; "):
        Trainer(ShortSchedule(val_loaders=0), make_args(tmp_path)).train()


# -- progress: plain lines in log files, bars for evaluation --------------------------------------


def test_progress_writes_plain_lines_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a log file
    assert ProgressBar().uses_lines()
    monkeypatch.setattr("sys.stderr", type("Terminal", (io.StringIO,), {"isatty": lambda self: True})())
    assert not ProgressBar().uses_lines() and ProgressBar(style="lines").uses_lines()
    with pytest.raises(ValueError, match=r"style='fancy' is invalid; allowed: \('auto', 'bar', 'lines'\)"):
        ProgressBar(style="fancy")

    # Epochs shorter than the refresh: one line per epoch, where it ended.
    args = make_args(tmp_path, disable_tqdm=False, log_every_n_steps=4, model_summary=False)
    with captured_log("framework.callbacks.progress") as messages:
        history = Trainer(ToyModule(val_loaders=0), args, callbacks=[ProgressBar(refresh_seconds=60, style="lines")]).train()
    last_losses = [value for step, value in history.steps("train_loss") if step % STEPS_PER_EPOCH == 0]
    assert len(messages) == 2
    for epoch, (message, loss) in enumerate(zip(messages, last_losses), start=1):
        assert re.fullmatch(rf"epoch {epoch}/2: 8/8 steps, [0-9.]+ step/s, loss {loss:.4f}, run ETA 00:00", message), message

    # No throttle: a line at every 10% mark (8 steps: every step).
    args = make_args(tmp_path, "every", epochs=1, disable_tqdm=False, log_every_n_steps=4, model_summary=False)
    with captured_log("framework.callbacks.progress") as messages:
        Trainer(ToyModule(val_loaders=0), args, callbacks=[ProgressBar(refresh_seconds=0, style="lines")]).train()
    assert [message.split(" steps")[0] for message in messages] == [f"epoch 1/1: {step}/8" for step in range(1, 9)]
    assert "loss" not in messages[2] and "loss" in messages[4]  # the loss read back at step 4 shows from then on


class WithTest(ToyModule):
    def get_test_dataloaders(self, sampler, batch_size):
        return {"holdout": self.get_val_dataloaders(sampler, batch_size)}

    def test_step(self, global_step, batch, device):
        return self.val_step(global_step, batch, device)


def test_validation_and_test_loaders_get_a_bar_in_a_terminal(tmp_path, capsys):
    args = make_args(tmp_path, epochs=1, disable_tqdm=False, model_summary=False, val_batch_size=16)
    trainer = Trainer(WithTest(), args, callbacks=[ProgressBar(refresh_seconds=0, style="bar")])
    trainer.train()
    trainer.test()
    err = capsys.readouterr().err
    assert "validating: 100%" in err and " 4/4 [" in err and "batch/s" in err
    assert "testing holdout: 100%" in err
    assert trainer.evaluator.current_batches == 4
