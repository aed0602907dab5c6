"""A GAN on scikit-learn's 8x8 digits, trained with manual optimization.

    python examples/gan.py [--trainer.epochs 20] [--model.learning_rate 2e-4]
    torchrun --nproc_per_node=2 examples/gan.py --backend ddp

Generator and discriminator alternate inside ``train_step``: ``self.optimizers()`` gives
both optimizers, ``self.manual_backward`` runs each backward through the backend (loss
scaling, DDP gradient sync; the discriminator's backward reaches only its own parameters,
so DDP needs ``find_unused_parameters``, which this script turns on for the ddp backends:
only DDP takes the option, any other backend refuses it).
"""

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework import ModuleInterface, Trainer, parse_config, seed_everything


@dataclass
class GANArguments:
    """The model section of the GAN example's config."""

    latent_size: int = 16
    """Size of the generator's noise input."""
    hidden_size: int = 128
    """Width of both networks' hidden layer."""
    learning_rate: float = 2e-4
    """Adam learning rate of both networks."""
    discriminator_max_norm: float = 1.0
    """Clip the discriminator's gradient norm to this."""


def load_digit_images() -> TensorDataset:
    """The 1797 digits as 64-pixel vectors scaled to [-1, 1]."""
    from sklearn.datasets import load_digits

    pixels = torch.tensor(load_digits().data, dtype=torch.float32)
    return TensorDataset(pixels / 8.0 - 1.0)


class DigitsGAN(ModuleInterface):
    """A small fully-connected GAN; ``train_step`` updates the generator, then the discriminator."""

    automatic_optimization = False

    def __init__(self, config: Optional[GANArguments] = None, data: Any = None) -> None:
        super().__init__()
        config = config or GANArguments()
        self.config = config
        hidden = config.hidden_size
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(config.latent_size, hidden), torch.nn.LeakyReLU(0.2), torch.nn.Linear(hidden, 64), torch.nn.Tanh()
        )
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.LeakyReLU(0.2), torch.nn.Linear(hidden, 1))
        self.data = data if data is not None else load_digit_images()

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int):
        betas = (0.5, 0.999)
        generator_optimizer = torch.optim.Adam(self.generator.parameters(), lr=self.config.learning_rate, betas=betas)
        discriminator_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=self.config.learning_rate, betas=betas)
        decay = torch.optim.lr_scheduler.ExponentialLR(generator_optimizer, gamma=0.99)  # stepped per epoch, below
        return [generator_optimizer, discriminator_optimizer], [decay]

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.data, batch_size=batch_size, sampler=sampler(self.data))

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()
        noise = torch.randn(real.shape[0], self.config.latent_size, device=device)
        fake = self.generator(noise)
        ones, zeros = torch.ones(real.shape[0], 1, device=device), torch.zeros(real.shape[0], 1, device=device)

        generator_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(generator_loss)
        generator_optimizer.step()
        generator_optimizer.zero_grad()
        discriminator_optimizer.zero_grad()  # the generator's backward went through the discriminator too

        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        discriminator_loss = (real_loss + fake_loss) / 2
        self.manual_backward(discriminator_loss)
        self.clip_gradients(discriminator_optimizer, max_norm=self.config.discriminator_max_norm)
        discriminator_optimizer.step()
        discriminator_optimizer.zero_grad()

        self.log("generator_loss", generator_loss.detach())
        self.log("discriminator_loss", discriminator_loss.detach())
        return generator_loss.detach() + discriminator_loss.detach()

    def on_end_train_epoch(self, global_step: int, *outputs: Any) -> None:
        self.lr_schedulers().step()


def main(argv: Any = None) -> float:
    """Train; return the discriminator's last epoch loss (about log 2 ~ 0.69 when balanced)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = [
        "--trainer.epochs",
        "10",
        "--trainer.train_batch_size",
        "64",
        "--trainer.output_dir",
        "outputs/gan",
        "--trainer.seed",
        "0",
    ]
    config = parse_config({"model": GANArguments}, argv=defaults + argv, program="examples/gan.py")
    if config.trainer.backend.startswith("ddp") and "--trainer.find_unused_parameters" not in argv:
        # The discriminator's backward reaches only its own parameters: DDP must look for unused ones.
        config.trainer = dataclasses.replace(config.trainer, find_unused_parameters=True)
    seed_everything(config.trainer.seed)
    trainer = Trainer(module=DigitsGAN(config.model), args=config.trainer)
    history = trainer.train()
    loss = history.latest("discriminator_loss")
    if trainer.is_main_process:
        print(f"final generator_loss={history.latest('generator_loss'):.4f} discriminator_loss={loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
