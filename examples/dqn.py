"""A DQN in which every rank plays its own environment into its own replay buffer.

    python examples/dqn.py [--trainer.epochs 20]
    torchrun --nproc_per_node=2 examples/dqn.py --backend ddp --checkpointer.resume auto

No gym: the environment is a 1-D chain (:class:`ChainEnv`) whose actions slip with seeded
noise. ``setup()``, which the trainer calls on every rank with ``self.global_rank`` known,
seeds each rank's environment, replay-buffer sampler and exploration from its rank. Every
train step plays one environment step with the current network (epsilon-greedy) into the
buffer, as Lightning's DQN example does; the train stream (:class:`ReplayStream`, declared
``shards_itself``: each rank's stream is its own) samples the rank's buffer. ``get_state()``
holds the environment, the buffer (numpy arrays, a numpy ``Generator``) and the exploration's
``random.Random``: the framework saves them per rank and gives each rank its own back at any
resume, so a killed run continues bit for bit (``tests/test_rl_resume.py``).
"""

import copy
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework import ModuleInterface, Trainer, parse_config, seed_everything


class ChainEnv:
    """A chain of ``length`` cells; action 1 moves right, 0 left, and slips (is flipped) with
    probability ``slip``. Reward 1 on reaching the right end (the episode ends), else -0.01;
    an episode also ends after ``max_steps``. Episodes start at a random cell."""

    def __init__(self, seed: int, length: int = 8, slip: float = 0.2, max_steps: int = 16) -> None:
        self.length, self.slip, self.max_steps = length, slip, max_steps
        self.rng = np.random.default_rng(seed)
        self.position, self.steps = 0, 0
        self.reset()

    def reset(self) -> np.ndarray:
        self.position, self.steps = int(self.rng.integers(0, self.length - 1)), 0
        return self.observe()

    def observe(self) -> np.ndarray:
        observation = np.zeros(self.length, dtype=np.float32)
        observation[self.position] = 1.0
        return observation

    def step(self, action: int) -> Tuple[np.ndarray, float, bool]:
        if self.rng.random() < self.slip:
            action = 1 - action
        self.position = min(max(self.position + (1 if action == 1 else -1), 0), self.length - 1)
        self.steps += 1
        arrived = self.position == self.length - 1
        return self.observe(), 1.0 if arrived else -0.01, arrived or self.steps >= self.max_steps

    def state_dict(self) -> Dict[str, Any]:
        return {"rng": copy.deepcopy(self.rng), "position": self.position, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rng, self.position, self.steps = copy.deepcopy(state["rng"]), state["position"], state["steps"]


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays, sampled with its own numpy ``Generator``."""

    def __init__(self, capacity: int, observation_size: int, seed: int) -> None:
        self.arrays = {
            "observation": np.zeros((capacity, observation_size), dtype=np.float32),
            "action": np.zeros(capacity, dtype=np.int64),
            "reward": np.zeros(capacity, dtype=np.float32),
            "done": np.zeros(capacity, dtype=np.bool_),
            "next_observation": np.zeros((capacity, observation_size), dtype=np.float32),
        }
        self.capacity, self.size, self.next = capacity, 0, 0
        self.rng = np.random.default_rng(seed)

    def append(self, **transition: Any) -> None:
        for name, value in transition.items():
            self.arrays[name][self.next] = value
        self.next = (self.next + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self) -> Tuple[Any, ...]:
        index = int(self.rng.integers(0, self.size))
        return tuple(self.arrays[name][index] for name in self.arrays)

    def state_dict(self) -> Dict[str, Any]:
        return {"arrays": copy.deepcopy(self.arrays), "size": self.size, "next": self.next, "rng": copy.deepcopy(self.rng)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.arrays, self.rng = copy.deepcopy(state["arrays"]), copy.deepcopy(state["rng"])
        self.size, self.next = state["size"], state["next"]


class ReplayStream(IterableDataset):
    """``samples_per_epoch`` transitions a rank samples from its own buffer each epoch; its
    ``state_dict`` (how many it gave this epoch) lets a run continue mid-epoch."""

    shards_itself = True  # each rank's stream is its own

    def __init__(self, buffer: ReplayBuffer, samples_per_epoch: int) -> None:
        self.buffer, self.samples_per_epoch, self.given = buffer, samples_per_epoch, 0

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        if self.given >= self.samples_per_epoch:  # the last epoch ended (the loader need not exhaust us)
            self.given = 0
        while self.given < self.samples_per_epoch:
            self.given += 1
            yield self.buffer.sample()

    def state_dict(self) -> Dict[str, Any]:
        return {"given": self.given}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.given = state["given"]


@dataclass
class DQNArguments:
    """The model section of the DQN example's config."""

    chain_length: int = 8
    """Cells in the environment's chain (the observation is a one-hot of the position)."""
    samples_per_epoch: int = 64
    """Transitions each rank samples from its replay buffer per epoch."""
    gamma: float = 0.9
    """Discount factor."""
    sync_every: int = 5
    """Copy the network into the target network every this many steps."""
    learning_rate: float = 0.01
    """Adam learning rate."""


class DQN(ModuleInterface):
    """A Q-network with a target network; every train step also plays one environment step.

    Example:
        >>> module = DQN(DQNArguments(chain_length=4))
        >>> module.setup()  # the trainer calls it on every rank, rank known
        >>> module.buffer.size, sorted(module.get_state())
        (32, ['buffer', 'env', 'explore', 'model', 'observation'])
    """

    def __init__(self, config: Optional[DQNArguments] = None) -> None:
        super().__init__()
        self.config = config = config or DQNArguments()
        length = config.chain_length
        self.net = torch.nn.Sequential(torch.nn.Linear(length, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        self.target = copy.deepcopy(self.net).requires_grad_(False)

    def setup(self) -> None:
        rank, length = self.global_rank, self.config.chain_length
        self.env = ChainEnv(seed=1000 + rank, length=length)
        self.buffer = ReplayBuffer(capacity=128, observation_size=length, seed=2000 + rank)
        self.explore = random.Random(3000 + rank)
        self.observation = self.env.reset()
        for _ in range(32):  # warm-up with random actions
            self.play(epsilon=1.0)
        self.stream = ReplayStream(self.buffer, self.config.samples_per_epoch)

    def play(self, epsilon: float) -> None:
        if self.explore.random() < epsilon:
            action = self.explore.randrange(2)
        else:
            with torch.no_grad():
                action = int(self.net(torch.from_numpy(self.observation)).argmax())
        next_observation, reward, done = self.env.step(action)
        self.buffer.append(
            observation=self.observation, action=action, reward=reward, done=done, next_observation=next_observation
        )
        self.observation = self.env.reset() if done else next_observation

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int) -> Any:
        return [torch.optim.Adam(self.net.parameters(), lr=self.config.learning_rate)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.stream, batch_size=batch_size)

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        if global_step % self.config.sync_every == 0:
            self.target.load_state_dict(self.net.state_dict())
        self.play(epsilon=max(0.1, 1.0 - global_step / 20))
        observation, action, reward, done, next_observation = (t.to(device) for t in batch)
        q = self.net(observation).gather(1, action[:, None]).squeeze(1)
        with torch.no_grad():
            target = reward + self.config.gamma * self.target(next_observation).max(1).values * (~done).float()
        return F.mse_loss(q, target)

    def get_state(self) -> Dict[str, Any]:
        return {
            **super().get_state(),
            "env": self.env.state_dict(),
            "observation": self.observation.copy(),
            "buffer": self.buffer.state_dict(),
            "explore": copy.deepcopy(self.explore),
        }

    def update_state(self, state: Dict[str, Any]) -> None:
        super().update_state(state)
        self.env.load_state_dict(state["env"])
        self.observation = state["observation"].copy()
        self.buffer.load_state_dict(state["buffer"])  # in place: the stream samples this buffer
        self.explore = copy.deepcopy(state["explore"])


def main(argv: Any = None) -> float:
    """Train; return the last epoch's training loss."""
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = ["--trainer.epochs", "10", "--trainer.train_batch_size", "16", "--trainer.output_dir", "outputs/dqn"]
    config = parse_config({"model": DQNArguments}, argv=defaults + argv, program="examples/dqn.py")
    seed_everything(config.trainer.seed)  # the same initial weights on every run
    trainer = Trainer(module=DQN(config.model), args=config.trainer)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    loss = history.latest("train_loss_epoch")
    if trainer.is_main_process:
        print(f"final train_loss_epoch={loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
