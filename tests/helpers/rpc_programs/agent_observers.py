"""An agent and its observers: policy-gradient training, the agent behind ``RRef(self)``.

Written as torch.distributed.rpc programs are (the PyTorch RPC tutorial's
reinforcement-learning pattern), on CPU with a synthetic environment;
``RPC_SYSTEM`` picks the imports (``torch``: TensorPipe; ``aiodist``). Rank 0
is the agent; each observer runs episodes in its own environment and asks the
agent for actions through the agent's ``RRef(self)``. Every observer draws
from its own generator, so the run is deterministic however the observers'
calls interleave. Rank 0 prints one JSON line: each episode's reward and
loss, and the final policy.

Usage: ``RPC_SYSTEM=aiodist MASTER_PORT=29500 python agent_observers.py``
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp
from torch import nn, optim
from torch.nn import functional as F

if os.environ.get("RPC_SYSTEM", "torch") == "torch":
    import torch.distributed.rpc as rpc
    from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
else:
    import aiodist.rpc as rpc
    from aiodist.rpc import RRef, remote, rpc_async, rpc_sync

WORLD = 3
EPISODES = 3
STEPS = 6
GAMMA = 0.9
AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref, *list(args)]
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 16)
        self.affine2 = nn.Linear(16, 2)

    def forward(self, x):
        return F.softmax(self.affine2(torch.relu(self.affine1(x))), dim=1)


class ToyEnv:
    """A deterministic stand-in for CartPole: a 4-number state, two actions."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.state = torch.zeros(4)

    def reset(self):
        self.state = torch.rand(4, generator=self.gen) - 0.5
        return self.state

    def step(self, action):
        push = torch.tensor([0.1, -0.05, 0.02, 0.03]) * (1 if action == 1 else -1)
        self.state = self.state + push + 0.01 * torch.randn(4, generator=self.gen)
        reward = float(1.0 - self.state.abs().sum())
        return self.state, reward, bool(self.state.abs().max() > 1.0)


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = ToyEnv(seed=self.id)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self, world_size):
        torch.manual_seed(0)
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.generators = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []
            self.generators[ob_info.id] = torch.Generator().manual_seed(1000 + ob_info.id)

    def select_action(self, ob_id, state):
        probs = self.policy(state.unsqueeze(0))
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id])[0]
        self.saved_log_probs[ob_id].append(torch.log(probs[0, action]))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps=0):
        futs = [
            rpc_async(
                ob_rref.owner(),
                _call_method,
                args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps),
            )
            for ob_rref in self.ob_rrefs
        ]
        torch.futures.wait_all(futs)

    def finish_episode(self):
        rewards, probs = [], []
        for ob_id in sorted(self.rewards):
            rewards.extend(self.rewards[ob_id])
            probs.extend(self.saved_log_probs[ob_id])
        total = sum(rewards)
        returns, running = [], 0.0
        for r in rewards[::-1]:
            running = r + GAMMA * running
            returns.insert(0, running)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        loss = torch.cat([-lp * ret for lp, ret in zip(probs, returns, strict=True)]).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        return total, loss.item()


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        agent = Agent(world_size)
        history = []
        for _ in range(EPISODES):
            agent.run_episode(n_steps=STEPS)
            history.append(agent.finish_episode())
        policy = [p.detach().tolist() for p in agent.policy.parameters()]
        print(json.dumps({"history": history, "policy": policy}), flush=True)
    else:
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(WORLD,), nprocs=WORLD, join=True)
    sys.exit(0)
