"""Tiny epochs: pytorch/examples' VAE, as written there and ported to the framework.

The model and loss are pytorch/examples' ``vae/main.py`` (784-400-20 encoder, reparameterised
sample, 20-400-784 decoder, summed BCE + KL, Adam 1e-3, batch 128, a test pass after every
epoch), on scikit-learn's bundled digits instead of MNIST (64 pixels scaled to [0, 1]; 1500
train and 297 test images: 12 steps and 3 test batches per epoch, so per-epoch work weighs
as much as the steps). The port is what a user would write: ``train_step`` and ``val_step``
return the same losses, and the trainer runs at its defaults (progress, logging every 50 steps,
a checkpoint at the end of every epoch, metrics.csv).

Each run is a fresh process; runs alternate original, port, original, ... The figures are
medians: the whole process (imports, data, training, exit) and the per-step slope over the
epoch counts given (what grows with the run), each as port / original.

    python benchmarks/vae.py [--repeats 5] [--epochs 5 10 20] [--runners original port port-no-epoch-checkpoints]

``port-no-epoch-checkpoints`` (not run by default) is the port with ``checkpointer_args.period=0``:
the share of the default per-epoch checkpoint in the difference; ``port-async-checkpoints`` writes
them in the background (``async_save=True``); ``port-no-plot`` leaves out ``metrics.png`` (drawn in the
background at the defaults, joined before the process exits).

Target (issue "Performance: the whole run"): the whole process at most 1.10x the original's.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from fresh_process import _wait_for_background_plot, fit_line, run_process  # noqa: E402

BATCH, LOG_INTERVAL, TRAIN_IMAGES = 128, 10, 1500


def digits_images():
    """Digits as [0, 1] images (train, test), split with a fixed seed."""
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    y = torch.tensor(labels)
    train, test = order[:TRAIN_IMAGES], order[TRAIN_IMAGES:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_vae():
    """pytorch/examples' VAE on 64-pixel images."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc21, self.fc22 = nn.Linear(64, 400), nn.Linear(400, 20), nn.Linear(400, 20)
            self.fc3, self.fc4 = nn.Linear(20, 400), nn.Linear(400, 64)

        def forward(self, x):
            h1 = F.relu(self.fc1(x.view(-1, 64)))
            mu, logvar = self.fc21(h1), self.fc22(h1)
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
            return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar

    return VAE()


def vae_loss(recon_x, x, mu, logvar):
    """Reconstruction + KL divergence, summed over the batch (pytorch/examples' loss_function)."""
    import torch
    import torch.nn.functional as F

    bce = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def original(epochs: int, output_dir: str) -> float:
    """pytorch/examples' train()/test() loop, as written there (minus image saving)."""
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(1)
    train_set, test_set = digits_images()
    train_loader = DataLoader(train_set, batch_size=BATCH, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=BATCH, shuffle=False)
    model = make_vae()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        train_loss = 0.0
        for batch_idx, (data, _) in enumerate(train_loader):
            optimizer.zero_grad()
            recon_batch, mu, logvar = model(data)
            loss = vae_loss(recon_batch, data, mu, logvar)
            loss.backward()
            train_loss += loss.item()
            optimizer.step()
            if batch_idx % LOG_INTERVAL == 0:
                seen = f"{batch_idx * len(data)}/{len(train_loader.dataset)}"
                print(f"Train Epoch: {epoch} [{seen}]\tLoss: {loss.item() / len(data):.6f}")
        print(f"====> Epoch: {epoch} Average loss: {train_loss / len(train_loader.dataset):.4f}")
        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for data, _ in test_loader:
                recon_batch, mu, logvar = model(data)
                test_loss += vae_loss(recon_batch, data, mu, logvar).item()
        print(f"====> Test set loss: {test_loss / len(test_loader.dataset):.4f}")
    return time.perf_counter() - start


def port(epochs: int, output_dir: str, epoch_checkpoints: bool = True, async_save: bool = False) -> float:
    """The same model and losses as a framework module, the trainer at its defaults (``epoch_checkpoints``
    False: no checkpoint at epoch ends, only the one at the end of training; ``async_save``: checkpoints
    written in the background)."""
    import torch
    from torch.utils.data import DataLoader

    from framework import ModuleInterface, Trainer, TrainerArguments

    class VAEModule(ModuleInterface):
        def __init__(self) -> None:
            super().__init__()
            self.vae = make_vae()
            self.train_set, self.test_set = digits_images()

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.Adam(self.parameters(), lr=1e-3)], []

        def get_train_dataloader(self, sampler, batch_size):
            return DataLoader(self.train_set, batch_size=batch_size, sampler=sampler(self.train_set))

        def get_val_dataloaders(self, sampler, batch_size):
            return DataLoader(self.test_set, batch_size=batch_size, sampler=sampler(self.test_set, shuffle=False))

        def train_step(self, global_step, batch, device):
            data, _ = batch
            recon, mu, logvar = self.vae(data)
            return vae_loss(recon, data, mu, logvar)

        def val_step(self, global_step, batch, device):
            data, _ = batch
            recon, mu, logvar = self.vae(data)
            return vae_loss(recon, data, mu, logvar) / len(data)

    args = TrainerArguments(epochs=epochs, train_batch_size=BATCH, seed=1, output_dir=output_dir)
    if not epoch_checkpoints:
        args.checkpointer_args.period = 0
    args.checkpointer_args.async_save = async_save
    trainer = Trainer(VAEModule(), args)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def port_no_epoch_checkpoints(epochs: int, output_dir: str) -> float:
    return port(epochs, output_dir, epoch_checkpoints=False)


def port_async_checkpoints(epochs: int, output_dir: str) -> float:
    return port(epochs, output_dir, async_save=True)


def port_no_plot(epochs: int, output_dir: str) -> float:
    os.environ["FRAMEWORK_PLOT_METRICS"] = "0"  # the defaults less metrics.png: the plot's share
    return port(epochs, output_dir)


RUNNERS = {
    "original": original,
    "port": port,
    "port-no-epoch-checkpoints": port_no_epoch_checkpoints,
    "port-async-checkpoints": port_async_checkpoints,
    "port-no-plot": port_no_plot,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=["original", "port"], help="the first is the reference")
    parser.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if not options.child and len(set(options.epochs)) < 2:
        parser.error(f"--epochs needs at least two different run lengths to fit a slope, got {options.epochs}")
    if options.child:
        import torch

        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as output_dir:
            train_seconds = RUNNERS[options.child](options.epochs[0], output_dir)
            _wait_for_background_plot()  # before its directory goes (the process would wait at exit anyway)
            print(json.dumps({"train_seconds": train_seconds}))
        return
    process: Dict[Tuple[str, int], List[float]] = {}
    for _ in range(options.repeats):
        for epochs in options.epochs:
            for name in options.runners:
                seconds, _ = run_process([__file__, "--child", name, "--epochs", str(epochs)])
                process.setdefault((name, epochs), []).append(seconds)
    steps = [12 * epochs for epochs in options.epochs]
    longest = max(options.epochs)
    figures = {}
    for name in options.runners:
        slope, _ = fit_line(steps, [statistics.median(process[(name, epochs)]) for epochs in options.epochs])
        figures[name] = (slope, statistics.median(process[(name, longest)]))
    reference = options.runners[0]
    slope_o, whole_o = figures[reference]
    print(f"{options.repeats} rounds, fresh processes alternating, medians; epochs {options.epochs} (12 steps each)")
    print(f"per step (slope, test pass included): {reference} {1e3 * slope_o:.2f} ms", end="")
    print(
        "".join(
            f", {name} {1e3 * slope:.2f} ms ({slope / slope_o:.3f}x)" for name, (slope, _) in figures.items() if name != reference
        )
    )
    print(f"whole process, {longest} epochs: {reference} {whole_o:.2f} s", end="")
    print(
        "".join(f", {name} {whole:.2f} s ({whole / whole_o:.3f}x)" for name, (_, whole) in figures.items() if name != reference)
    )
    print("(target: port / original <= 1.10 for the whole process)")


if __name__ == "__main__":
    main()
