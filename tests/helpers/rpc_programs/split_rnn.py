"""An RNN split across two workers: embedding and decoder on one, the LSTM on the other.

Written as torch.distributed.rpc programs are (the PyTorch RPC tutorial's
distributed RNN), on CPU with synthetic data; ``RPC_SYSTEM`` picks the
imports (``torch``: TensorPipe; ``aiodist``). Rank 0 trains: each step's
forward pass goes to the parameter server and back twice, distributed
autograd carries the gradients back through both hops, and a
DistributedOptimizer steps the parameters where they live. Rank 0 prints one
JSON line: the losses, every parameter's gradient in the first context (the
local ones and the remote ones), and the same gradients computed by plain
autograd on one process.

Usage: ``RPC_SYSTEM=aiodist MASTER_PORT=29500 python split_rnn.py``
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.multiprocessing as mp
from torch import nn, optim

if os.environ.get("RPC_SYSTEM", "torch") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
else:
    import aiodist.rpc as rpc
    import aiodist.rpc.dist_autograd as dist_autograd
    from aiodist.rpc import RRef
    from aiodist.rpc.optim import DistributedOptimizer

NTOKEN, NINP, NHID, NLAYERS = 20, 8, 12, 2
STEPS, BATCH, SEQ = 3, 3, 5


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref, *list(args)]
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    return [RRef(param) for param in module.parameters()]


INIT_LOCK = threading.Lock()  # seeding and initialising: one module at a time


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp):
        super().__init__()
        with INIT_LOCK:
            torch.manual_seed(1)
            self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, inp):
        return self.encoder(inp)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid):
        super().__init__()
        with INIT_LOCK:
            torch.manual_seed(2)
            self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    def __init__(self, ps):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(NTOKEN, NINP))
        torch.manual_seed(3)
        self.rnn = nn.LSTM(NINP, NHID, NLAYERS)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(NTOKEN, NHID))

    def forward(self, inp, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, inp)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


def grads_of(module_rref, context_id):
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].tolist() for p in module_rref.local_value().parameters()]


def batches():
    gen = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, NTOKEN, (SEQ, BATCH), generator=gen),
            torch.randint(0, NTOKEN, (SEQ * BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


def init_hidden():
    return (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))


def local_reference():
    """The first step's gradients by plain autograd, the whole model in one process."""
    emb, dec = EmbeddingTable(NTOKEN, NINP), Decoder(NTOKEN, NHID)
    torch.manual_seed(3)
    rnn = nn.LSTM(NINP, NHID, NLAYERS)
    inp, target = batches()[0]
    output, _ = rnn(emb(inp), init_hidden())
    loss = nn.CrossEntropyLoss()(dec(output).view(-1, NTOKEN), target)
    loss.backward()
    return [[p.grad.tolist() for p in m.parameters()] for m in (emb, rnn, dec)]


def run_trainer():
    model = RNNModel("ps")
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    losses, grads = [], None
    for inp, target in batches():
        hidden = init_hidden()
        with dist_autograd.context() as ctx_id:
            output, hidden = model(inp, hidden)
            loss = criterion(output.view(-1, NTOKEN), target)
            dist_autograd.backward(ctx_id, [loss])
            if grads is None:
                here = dist_autograd.get_gradients(ctx_id)
                grads = [
                    rpc.rpc_sync("ps", grads_of, args=(model.emb_table_rref, ctx_id)),
                    [here[p].tolist() for p in model.rnn.parameters()],
                    rpc.rpc_sync("ps", grads_of, args=(model.decoder_rref, ctx_id)),
                ]
            opt.step(ctx_id)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "reference": local_reference()}


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        print(json.dumps(run_trainer()), flush=True)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(2,), nprocs=2, join=True)
    sys.exit(0)
