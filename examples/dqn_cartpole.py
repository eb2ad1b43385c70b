"""PyTorch's DQN tutorial (CartPole), with anydevice: the replay memory on the host, each
sampled batch moved to the device with one ``ad.to``.

    pip install 'anydevice[examples]'                # gymnasium
    python examples/dqn_cartpole.py                  # 300 episodes
    python examples/dqn_cartpole.py --tiny           # 15 episodes: does it run?

Written as a new user would write it first, the tutorial's loop keeps every transition as
tensors on the GPU: each environment step makes several tiny host-to-device copies (state,
action, reward, next state), the memory grows in GPU memory, and a replay batch is
assembled from thousands of tiny device tensors. The pattern that works: transitions stay
on the host, where the environment produces them; a batch is stacked on the host and moved
in one call (``ad.to`` moves the whole named tuple, asynchronously from pinned memory on
CUDA); only the state that picks the next action crosses per step. The networks run on
whatever device is here.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from typing import NamedTuple

import torch
from torch import nn

import anydevice as ad


class Batch(NamedTuple):
    state: torch.Tensor  # (B, 4) float32
    action: torch.Tensor  # (B,) int64
    reward: torch.Tensor  # (B,) float32
    next_state: torch.Tensor  # (B, 4) float32, zeros where done
    done: torch.Tensor  # (B,) bool


class ReplayMemory:
    """Transitions on the host, as plain tensors; ``sample`` stacks a batch there."""

    def __init__(self, capacity: int) -> None:
        self.memory: deque[tuple[torch.Tensor, int, float, torch.Tensor, bool]] = deque(
            maxlen=capacity
        )

    def push(self, s: torch.Tensor, a: int, r: float, s2: torch.Tensor, done: bool) -> None:
        self.memory.append((s, a, r, s2, done))

    def sample(self, n: int) -> Batch:
        rows = random.sample(self.memory, n)
        s, a, r, s2, d = zip(*rows, strict=True)
        return Batch(
            torch.stack(s), torch.tensor(a), torch.tensor(r, dtype=torch.float32),
            torch.stack(s2), torch.tensor(d),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.memory)


def q_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 2))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="15 episodes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    episodes = 15 if args.tiny else args.episodes
    try:
        import gymnasium as gym
    except ImportError as e:
        raise SystemExit("this example needs gymnasium: pip install 'anydevice[examples]'") from e

    dev = ad.device()
    why = "the best accelerator here" if dev.type != "cpu" else "no accelerator here"
    print(f"device: {dev} ({why}); replay memory on the host (cpu)")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    env = gym.make("CartPole-v1")
    env.action_space.seed(args.seed)
    policy, target = q_net().to(dev), q_net().to(dev)
    target.load_state_dict(policy.state_dict())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, amsgrad=True)
    memory = ReplayMemory(10_000)
    batch_size, gamma, tau = 128, 0.99, 0.005
    steps = updates = wrong_device = 0
    returns: list[int] = []

    def act(state: torch.Tensor) -> int:
        eps = 0.05 + 0.85 * math.exp(-steps / 1000)
        if random.random() < eps:
            return int(env.action_space.sample())
        with torch.no_grad():  # the one per-step copy, and the one per-step sync
            return int(policy(ad.to(state, dev).unsqueeze(0)).argmax(1).item())

    def optimize() -> None:
        nonlocal updates, wrong_device
        b = ad.to(memory.sample(batch_size), dev)  # one call moves the whole batch
        wrong_device += any(t.device != ad.device_of(policy) for t in b)
        q = policy(b.state).gather(1, b.action.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            best_next = target(b.next_state).max(1).values.masked_fill(b.done, 0.0)
        loss = nn.functional.smooth_l1_loss(q, b.reward + gamma * best_next)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_value_(policy.parameters(), 100)
        optimizer.step()
        with torch.no_grad():  # soft update of the target network
            for tp, pp in zip(target.parameters(), policy.parameters(), strict=True):
                tp.lerp_(pp, tau)
        updates += 1

    for episode in range(episodes):
        obs, _ = env.reset(seed=args.seed + episode)
        state = torch.as_tensor(obs, dtype=torch.float32)
        for t in range(1, 501):
            action = act(state)
            obs, reward, terminated, truncated, _ = env.step(action)
            steps += 1
            nxt = torch.as_tensor(obs, dtype=torch.float32)
            memory.push(state, action, float(reward), nxt * (not terminated), terminated)
            state = nxt
            if len(memory) >= batch_size:
                optimize()
            if terminated or truncated:
                returns.append(t)
                break
        if (episode + 1) % max(1, episodes // 5) == 0:
            recent = returns[-10:]
            print(f"episode {episode + 1}: mean return of the last {len(recent)} "
                  f"{sum(recent) / len(recent):.1f}")  # fmt: skip
    env.close()
    s = memory.memory[0][0]
    print(f"replay memory: {len(memory)} transitions on {s.device}; "
          f"{updates} updates, each batch moved with one ad.to")  # fmt: skip
    print(f"batches that reached a device other than the networks': {wrong_device}")
    print(f"networks on {ad.device_of(policy)}; steps {steps}; episodes {len(returns)}")


if __name__ == "__main__":
    main()
