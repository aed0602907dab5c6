"""Manual optimization: a GAN and per-chunk TBPTT match plain PyTorch loops; resume is exact."""

import os
import sys
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from distributed import run_ranks
from toy import flat_parameters

from backends import MixedPrecision, ResumableSampler, SingleProcess, TrainerBackend
from framework import ModuleInterface, Trainer, TrainerArguments
from framework.checkpoint import DefaultCheckpointerArguments
from framework.data.rng import seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gan import DigitsGAN, GANArguments

SEED, BATCH, SAMPLES, EPOCHS = 3, 32, 256, 2
CONFIG = GANArguments(latent_size=8, hidden_size=32, learning_rate=1e-3, discriminator_max_norm=0.5)


def images(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(samples, 64, generator=generator) * 2 - 1)


def gan_args(tmp_path, **overrides: Any) -> TrainerArguments:
    values: Dict[str, Any] = dict(
        epochs=EPOCHS,
        train_batch_size=BATCH,
        seed=SEED,
        disable_tqdm=True,
        log_level="WARNING",
        output_dir=str(tmp_path),
        log_every_n_steps=4,
    )
    values.update(overrides)
    if str(values.get("backend", "sp")).startswith("ddp"):  # only DDP takes (and the GAN needs) the option
        values.setdefault("find_unused_parameters", True)
    return TrainerArguments(**values)


def plain_gan_loop(world_size: int = 1) -> torch.Tensor:
    """The GAN trained by hand: the same updates, in the same order, on one process.

    For ``world_size`` 2 it plays both ranks: each rank's batch comes from its shard of the
    framework's sampler, both ranks draw the same noise (same seed), and DDP's gradient mean
    over ranks is the mean of the two ranks' losses.
    """
    seed_everything(SEED)
    module = DigitsGAN(CONFIG, images())
    seed_everything(SEED)
    generator, discriminator = module.generator, module.discriminator
    opt_g = torch.optim.Adam(generator.parameters(), lr=CONFIG.learning_rate, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=CONFIG.learning_rate, betas=(0.5, 0.999))
    decay = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=0.99)
    per_rank = BATCH // world_size
    samplers = [ResumableSampler(module.data, shuffle=True, seed=SEED, rank=r, world_size=world_size) for r in range(world_size)]

    class RankBatches(torch.utils.data.Sampler):  # one loader for both ranks' shards
        def __iter__(self):
            shards = [list(sampler) for sampler in samplers]
            for start in range(0, len(shards[0]), per_rank):
                yield [index for shard in shards for index in shard[start : start + per_rank]]

        def __len__(self):
            return len(samplers[0]) // per_rank

    # The framework seeds each train loader's own generator: iterating it draws nothing from the global RNG.
    loader = DataLoader(module.data, batch_sampler=RankBatches(), generator=torch.Generator())
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for (real,) in loader:
            reals = real.split(per_rank)
            noise = torch.randn(per_rank, CONFIG.latent_size)
            fake = generator(noise)
            ones, zeros = torch.ones(per_rank, 1), torch.zeros(per_rank, 1)
            g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
            d_losses = [
                (
                    F.binary_cross_entropy_with_logits(discriminator(r), ones)
                    + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
                )
                / 2
                for r in reals
            ]
            d_loss = d_losses[0] if world_size == 1 else sum(d_losses) / world_size
            d_loss.backward()
            torch.nn.utils.clip_grad_norm_(list(discriminator.parameters()), CONFIG.discriminator_max_norm)
            opt_d.step()
            opt_d.zero_grad()
        decay.step()
    return flat_parameters(module)


def train_gan(tmp_path, backend: Any = None, **overrides: Any) -> Trainer:
    seed_everything(SEED)
    trainer = Trainer(DigitsGAN(CONFIG, images()), gan_args(tmp_path, **overrides), trainer_backend=backend)
    trainer.train()
    return trainer


def test_gan_on_sp_is_bitwise_a_plain_loop(tmp_path):
    trainer = train_gan(tmp_path)
    assert trainer.global_steps_finished == EPOCHS * SAMPLES // BATCH  # one step per batch
    assert torch.equal(flat_parameters(trainer.module), plain_gan_loop())
    history = trainer.history
    assert len(history.values("generator_loss")) == EPOCHS and len(history.values("train_loss")) == EPOCHS * 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(CONFIG.learning_rate * 0.99**EPOCHS)


def ddp_gan(rank: int, tmp: str) -> List[float]:
    seed_everything(SEED)
    trainer = Trainer(DigitsGAN(CONFIG, images()), gan_args(tmp, backend="ddp"))
    trainer.train()
    return flat_parameters(trainer.module).tolist()


@pytest.mark.slow
@pytest.mark.distributed
def test_gan_on_two_ddp_ranks_matches_a_plain_loop(tmp_path):
    rank0, rank1 = run_ranks(ddp_gan, tmp=str(tmp_path))
    assert rank0 == rank1
    difference = (torch.tensor(rank0) - plain_gan_loop(world_size=2)).abs().max().item()
    assert difference <= 1e-5, difference


def ddp_amp_gan(rank: int, tmp: str) -> Dict[str, Any]:
    seed_everything(SEED)
    trainer = Trainer(DigitsGAN(CONFIG, images()), gan_args(tmp, backend="ddp-amp", epochs=1))
    trainer.train()
    return {"params": flat_parameters(trainer.module).tolist(), "losses": trainer.history.values("discriminator_loss")}


@pytest.mark.slow
@pytest.mark.distributed
def test_gan_on_ddp_amp_trains_in_step_on_both_ranks(tmp_path):
    rank0, rank1 = run_ranks(ddp_amp_gan, tmp=str(tmp_path))
    assert rank0["params"] == rank1["params"] and torch.isfinite(torch.tensor(rank0["params"])).all()
    assert 0.0 < rank0["losses"][-1] < 2.0


def test_optimizer_steps_go_through_the_grad_scaler(tmp_path):
    backend = TrainerBackend(SingleProcess(), MixedPrecision("bfloat16", use_grad_scaler=True))
    trainer = train_gan(tmp_path, backend=backend, epochs=1)
    scaler = trainer.backend.precision.scaler
    steps = SAMPLES // BATCH
    # Two scaled backward passes and two scaler steps/updates per batch; no inf, so the
    # growth tracker counted every update, and the weights are finite.
    assert scaler.state_dict()["_growth_tracker"] == 2 * steps
    assert torch.isfinite(flat_parameters(trainer.module)).all()


def test_resume_in_manual_mode_is_exact(tmp_path):
    reference = train_gan(tmp_path / "reference")
    checkpoints = DefaultCheckpointerArguments(
        save_dir=str(tmp_path / "run" / "checkpoints"), resume="auto", save_every_n_steps=3
    )
    stopped = train_gan(tmp_path / "run", max_steps=11, checkpointer_args=checkpoints)  # mid-epoch 2
    assert stopped.global_steps_finished == 11
    resumed = train_gan(tmp_path / "run", checkpointer_args=checkpoints)
    assert resumed.global_steps_finished == reference.global_steps_finished
    assert torch.equal(flat_parameters(resumed.module), flat_parameters(reference.module))
    for got, want in zip(resumed.optimizers, reference.optimizers):
        assert got.state_dict()["state"][0]["step"] == want.state_dict()["state"][0]["step"]
    assert resumed.schedulers[0].last_epoch == reference.schedulers[0].last_epoch == EPOCHS


# -- per-chunk TBPTT (Lightning 0.x) --------------------------------------------------------


class ChunkedRNN(ModuleInterface):
    """An RNN stepped after every chunk of 4 time steps, carrying the detached hidden state."""

    automatic_optimization = False
    CHUNK = 4

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(3, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 1)
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(32, 12, 3, generator=generator), torch.randn(32, 12, 1, generator=generator))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step, batch, device):
        x, y = batch
        optimizer, hidden, total = self.optimizers(), None, 0.0
        for x_chunk, y_chunk in zip(x.split(self.CHUNK, dim=1), y.split(self.CHUNK, dim=1)):
            output, hidden = self.rnn(x_chunk, hidden)
            loss = F.mse_loss(self.head(output), y_chunk)
            self.manual_backward(loss)
            self.clip_gradients(optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            hidden, total = hidden.detach(), total + loss.detach()
        return total / 3


def test_per_chunk_tbptt_matches_a_plain_loop(tmp_path):
    seed_everything(0)
    trainer = Trainer(
        ChunkedRNN(), TrainerArguments(epochs=2, train_batch_size=8, seed=0, disable_tqdm=True, output_dir=str(tmp_path))
    )
    trainer.train()

    seed_everything(0)
    module = ChunkedRNN()
    seed_everything(0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    sampler = ResumableSampler(module.data, shuffle=True, seed=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(module.data, batch_size=8, sampler=sampler):
            hidden = None
            for x_chunk, y_chunk in zip(x.split(4, dim=1), y.split(4, dim=1)):
                output, hidden = module.rnn(x_chunk, hidden)
                F.mse_loss(module.head(output), y_chunk).backward()
                torch.nn.utils.clip_grad_norm_(list(module.parameters()), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                hidden = hidden.detach()
    assert trainer.global_steps_finished == 8
    assert torch.equal(flat_parameters(trainer.module), flat_parameters(module))


# -- what manual mode refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"gpu_batch_size_limit": 8}, "gradient accumulation"),
        ({"clip_grads": True}, "clip_grads"),
        ({"track_grad_norm": True}, "track_grad_norm"),
        ({"tbptt_steps": 4}, "tbptt_steps"),
    ],
)
def test_settings_that_cannot_apply_in_manual_mode_are_refused(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=f"manual optimization.*{named}"):
        Trainer(DigitsGAN(CONFIG, images()), gan_args(tmp_path, **overrides))


def test_manual_calls_outside_manual_mode_say_what_to_set(tmp_path):
    from toy import ToyModule

    module = ToyModule()
    Trainer(module, TrainerArguments(disable_tqdm=True, output_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="automatic_optimization = False"):
        module.manual_backward(torch.ones(1, requires_grad=True).sum())
    assert module.global_rank == 0 and module.world_size == 1 and module.current_epoch == 0


# -- backward's arguments, FSDP ---------------------------------------------------------------


class TwoLossesOneGraph(ModuleInterface):
    """Lightning's double-backward scenario: two losses backpropagated through one forward graph."""

    automatic_optimization = False

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        generator = torch.Generator().manual_seed(2)
        self.data = TensorDataset(torch.randn(32, 4, generator=generator))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def get_train_dataloader(self, sampler, batch_size):
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step, batch, device):
        optimizer = self.optimizers()
        output = self.net(batch[0])
        first, second = output.mean(), (output**2).mean()
        self.manual_backward(first, retain_graph=True)  # the graph is needed again below
        self.manual_backward(second)
        optimizer.step()
        optimizer.zero_grad()
        return first.detach() + second.detach()


def test_manual_backward_passes_backward_arguments_through(tmp_path):
    seed_everything(0)
    args = TrainerArguments(epochs=1, train_batch_size=8, seed=0, disable_tqdm=True, output_dir=str(tmp_path))
    trainer = Trainer(TwoLossesOneGraph(), args)
    trainer.train()

    seed_everything(0)
    module = TwoLossesOneGraph()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    sampler = ResumableSampler(module.data, shuffle=True, seed=0)
    sampler.set_epoch(0)
    for (x,) in DataLoader(module.data, batch_size=8, sampler=sampler):
        output = module.net(x)
        output.mean().backward(retain_graph=True)
        (output**2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(flat_parameters(trainer.module), flat_parameters(module))


def fsdp_gan(rank: int, tmp: str) -> Dict[str, Any]:
    seed_everything(SEED)
    module = DigitsGAN(CONFIG, images())
    start = flat_parameters(module)
    trainer = Trainer(module, gan_args(tmp, backend="fsdp", find_unused_parameters=False))
    trainer.train()
    full = trainer.backend.strategy.unsharded(dict(trainer.module.named_parameters()))
    params = torch.cat([tensor.detach().reshape(-1) for tensor in full.values()])
    adam_steps = [len(optimizer.state) for optimizer in trainer.optimizers]
    return {"params": params.tolist(), "moved": (params - start).abs().max().item(), "adam_states": adam_steps}


@pytest.mark.slow
@pytest.mark.distributed
def test_gan_on_two_fsdp_ranks_matches_a_plain_loop(tmp_path):
    """Manual backward runs inside the sharded root's forward: its gradients must still be
    reduce-scattered onto the shards the optimizers hold, and the updated shards gathered again."""
    rank0, rank1 = run_ranks(fsdp_gan, tmp=str(tmp_path))
    assert rank0["params"] == rank1["params"] and rank0["moved"] > 1e-3
    assert rank0["adam_states"] == [4, 4]  # both Adams hold state for their 4 parameters
    difference = (torch.tensor(rank0["params"]) - plain_gan_loop(world_size=2)).abs().max().item()
    assert difference <= 1e-5, difference


class TwoStepsOneBatch(TwoLossesOneGraph):
    """Two optimizer steps per batch, the second forward after the first step (as a GAN's
    discriminator sees the generator it just stepped): under autocast, the second forward must
    compute with the stepped weights, not the bf16 copies autocast cached before the step."""

    def train_step(self, global_step, batch, device):
        optimizer = self.optimizers()
        first = self.net(batch[0]).float().pow(2).mean()
        self.manual_backward(first)
        optimizer.step()
        optimizer.zero_grad()
        second = (self.net(batch[0]).float() - 1).pow(2).mean()
        self.manual_backward(second)
        optimizer.step()
        optimizer.zero_grad()
        return second.detach()


def test_a_forward_after_a_manual_step_under_autocast_sees_the_stepped_weights(tmp_path):
    """sp-amp against a hand-written loop with one autocast region per forward (torch's advice);
    autocast's weight cache, kept until its region ends, made the second forward compute with the
    weights before the step (and fsdp-amp, which gathers fresh weights, drift 10x from sp-amp)."""
    seed_everything(0)
    args = TrainerArguments(epochs=2, train_batch_size=8, seed=0, disable_tqdm=True, output_dir=str(tmp_path), backend="sp-amp")
    trainer = Trainer(TwoStepsOneBatch(), args)
    trainer.train()

    seed_everything(0)
    module = TwoStepsOneBatch()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    sampler = ResumableSampler(module.data, shuffle=True, seed=0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (x,) in DataLoader(module.data, batch_size=8, sampler=sampler):
            for target in (0.0, 1.0):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    output = module.net(x)
                (output.float() - target).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert torch.equal(flat_parameters(trainer.module), flat_parameters(module))
