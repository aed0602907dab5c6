"""A small DQN whose every rank plays its own environment into its own replay buffer; the RL
resume test runs it under torchrun and SIGKILLs the whole job at chosen points.

No gym: the environment is a 1-D chain (:class:`ChainEnv`) whose actions slip with seeded
noise. Each rank seeds its environment, its replay buffer's sampler and its exploration from
its rank in ``setup()``. Every train step plays one environment step with the current
network (epsilon-greedy) into the buffer; the train stream (:class:`ReplayStream`, declared
``shards_itself``) samples each rank's own buffer. The module's ``get_state()`` holds the
environment, the buffer (numpy arrays, numpy ``Generator``) and the exploration's
``random.Random``: the framework saves and restores them per rank.

It always resumes with ``resume="auto"``, so running the same command again continues a
killed run. At the end every rank writes ``<out>/result-rank<R>.pt``: the flat parameters
and its own ``get_state()``.

Kill points (each fires once: a marker file under ``<out>/kills`` records it), on rank 0:
``mb:E:I`` right after micro-batch ``I`` (0-based) of epoch ``E``; ``begin:E`` at the start
of epoch ``E``, just after the previous epoch-end checkpoint was written. There rank 0
SIGKILLs torchrun's process group and every worker's (each worker is its own session), so
the whole job dies at once and torchrun cannot restart it.

Example:
    torchrun --nproc-per-node=2 tests/dqn_script.py /tmp/run --kill mb:1:5   # dies; rerun to finish
"""

import argparse
import copy
import os
import random
import signal
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from toy import flat_parameters  # noqa: E402

from framework import ModuleInterface, Trainer, TrainerArguments  # noqa: E402
from framework.callbacks import Callback  # noqa: E402
from framework.checkpoint import DefaultCheckpointerArguments  # noqa: E402


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


class DQN(ModuleInterface):
    """A Q-network with a target network; every train step also plays one environment step."""

    def __init__(self, length: int = 8, samples_per_epoch: int = 64, gamma: float = 0.9, sync_every: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(length, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        self.length, self.samples_per_epoch, self.gamma, self.sync_every = length, samples_per_epoch, gamma, sync_every

    def setup(self) -> None:
        rank = self.global_rank
        self.env = ChainEnv(seed=1000 + rank, length=self.length)
        self.buffer = ReplayBuffer(capacity=128, observation_size=self.length, seed=2000 + rank)
        self.explore = random.Random(3000 + rank)
        self.observation = self.env.reset()
        for _ in range(32):  # warm-up with random actions
            self.play(epsilon=1.0)
        self.stream = ReplayStream(self.buffer, self.samples_per_epoch)

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
        return [torch.optim.Adam(self.net.parameters(), lr=0.01)], []

    def get_train_dataloader(self, sampler: Any, batch_size: int) -> DataLoader:
        return DataLoader(self.stream, batch_size=batch_size)

    def train_step(self, global_step: int, batch: Any, device: torch.device) -> torch.Tensor:
        if global_step % self.sync_every == 0:
            self.target.load_state_dict(self.net.state_dict())
        self.play(epsilon=max(0.1, 1.0 - global_step / 20))
        observation, action, reward, done, next_observation = (t.to(device) for t in batch)
        q = self.net(observation).gather(1, action[:, None]).squeeze(1)
        with torch.no_grad():
            target = reward + self.gamma * self.target(next_observation).max(1).values * (~done).float()
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


def kill_whole_job(out: str) -> None:
    """SIGKILL torchrun (its process group when it leads one, never its caller's) and every worker
    (each its own session), this one last."""
    sys.stdout.flush()
    launcher = os.getppid()
    if os.getpgid(launcher) == launcher:
        os.killpg(launcher, signal.SIGKILL)
    else:
        os.kill(launcher, signal.SIGKILL)
    pids = []
    for name in sorted(os.listdir(os.path.join(out, "pids"))):
        with open(os.path.join(out, "pids", name)) as handle:
            pids.append(int(handle.read()))
    for pid in sorted(pids, key=lambda pid: pid == os.getpid()):
        os.killpg(os.getpgid(pid), signal.SIGKILL)


class Killer(Callback):
    """Kills the whole job at the ``mb:E:I`` and ``begin:E`` kill points (rank 0, each once)."""

    def __init__(self, out: str, specs: List[str]) -> None:
        self.out, self.specs = out, specs
        self.trainer: Any = None
        self.epoch, self.index = 0, 0

    def setup(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_begin_train_epoch(self, global_step: int, epoch: int) -> None:
        self.epoch, self.index = epoch, self.trainer.batches_finished_in_epoch
        if self.index == 0:
            self._maybe_die(f"begin:{epoch}")

    def on_end_train_step(self, global_step: int, *outputs: Any) -> None:
        self._maybe_die(f"mb:{self.epoch}:{self.index}")
        self.index += 1

    def _maybe_die(self, spec: str) -> None:
        if spec not in self.specs:
            return
        os.makedirs(os.path.join(self.out, "kills"), exist_ok=True)
        try:
            open(os.path.join(self.out, "kills", spec.replace(":", "_")), "x").close()
        except FileExistsError:
            return
        print(f"KILLING the whole job at {spec} (step {self.trainer.global_steps_finished})", flush=True)
        kill_whole_job(self.out)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill", action="append", default=[], help="mb:E:I or begin:E (rank 0)")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    os.makedirs(os.path.join(options.out, "pids"), exist_ok=True)
    with open(os.path.join(options.out, "pids", f"rank{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    checkpointer_args = DefaultCheckpointerArguments(
        save_dir=os.path.join(options.out, "checkpoints"), save_every_n_steps=3, keep_last_n=2, resume="auto"
    )
    args = TrainerArguments(
        epochs=options.epochs,
        train_batch_size=16,  # 8 per rank: 8 steps per epoch
        backend="ddp",
        disable_tqdm=True,
        output_dir=options.out,
        seed=7,
        loggers=["csv"],
        checkpointer_args=checkpointer_args,
    )
    module = DQN()
    trainer = Trainer(module, args, callbacks=[Killer(options.out, options.kill if rank == 0 else [])])
    try:
        trainer.train()
    finally:
        trainer.close()
    result = {"params": flat_parameters(module), "step": trainer.global_steps_finished, "state": module.get_state()}
    torch.save(result, os.path.join(options.out, f"result-rank{rank}.pt"))  # each rank its own: the test compares them
    print(f"FINISHED rank {rank} at step {trainer.global_steps_finished}", flush=True)


if __name__ == "__main__":
    main()
