"""One rank of small data parallel runs, for tests/integration/test_data_parallel.py:
`python -m tests.integration.dp_rank OUT EXCHANGE[,EXCHANGE...] STEPS [OPTIMIZER [HIDDEN]]` with RANK,
WORLD_SIZE and MARIANA_DIST_INIT set (or none: one process). For each exchange in turn, in one
process group (a process start and torch's import are most of a short run's cost), the real
step (data_parallel.train_step) on a fresh small SpeechDNN (HIDDEN: its widths, e.g. 64,32) and
seeded random frames; writes
OUT/EXCHANGE/rank{R}.json (a digest of the parameters after every step, the bytes counted and
written) and OUT/EXCHANGE/rank{R}.safetensors (EXCHANGE with ':' as '_')."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mariana.trainer.config import DenseConfig
from mariana.trainer.dense import make_optimizer
from mariana.trainer.models.speech_dnn import SpeechDNN, SpeechDNNConfig
from mariana.trainer.strategies import data_parallel as dp


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[3])
    optimizer = sys.argv[4] if len(sys.argv) > 4 else "adam"
    hidden = tuple(int(w) for w in (sys.argv[5] if len(sys.argv) > 5 else "64,32").split(","))
    torch.set_num_threads(1)
    ctx = dp.DistContext.from_env()
    dp.init_distributed(ctx, "gloo", os.environ.get("MARIANA_DIST_INIT"), timeout_s=60)
    for name in sys.argv[2].split(","):
        one_exchange(os.path.join(out, name.replace(":", "_")), dp.parse_exchange(name), steps, optimizer, hidden,
                     ctx)
    dp.shutdown_distributed()


def one_exchange(out: str, exchange, steps: int, optimizer: str, hidden: tuple[int, ...], ctx) -> None:
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2000, 40, generator=gen)
    y = (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10
    torch.manual_seed(0)
    model = SpeechDNN(SpeechDNNConfig(input_dim=40, hidden=hidden))
    model.set_input_stats(x)
    opt = make_optimizer(DenseConfig(optimizer=optimizer, lr=0.01 if optimizer == "adagrad" else 1e-3),
                         model.parameters())
    digests, counted, io, done = run(model, opt, x, y, exchange, steps, ctx)
    state = {f"opt.{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items() if torch.is_tensor(v)}
    gc.collect()  # the DDP wrapper of run() (its reducer, PowerSGD's state: cycles) goes before the next
    if ctx.distributed:  # every rank done with this run before any starts the next or leaves the group,
        torch.distributed.barrier()  # as trainer/speech.py does
    save_file({**{n: p.detach().contiguous() for n, p in model.named_parameters()},
               **{k: v.contiguous().reshape(v.shape) for k, v in state.items()}}, f"{out}/rank{ctx.rank}.safetensors")
    with open(f"{out}/rank{ctx.rank}.json", "w") as f:
        json.dump({"digests": digests, "counted": counted, "io": io, "steps": done}, f)


def run(model, opt, x, y, exchange, steps, ctx):
    net = dp.wrap_model(model, exchange, steps, torch.device("cpu"))
    counter = dp.CollectiveBytes()
    dp.count_collectives(counter)
    digests = []
    io0 = dp.io_written()
    done = 0
    for epoch in range(1000):
        for batch in dp.global_batches(len(x), 100, 0, epoch):
            if done == steps:
                break
            mine = dp.rank_slice(batch, ctx)
            dp.train_step(net, opt, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x[mine], y[mine],
                          len(batch), ctx.world_size)
            digests.append(digest(model))
            done += 1
        if done == steps:
            break
    io1 = dp.io_written()
    dp.stop_counting(counter)
    return digests, counter.snapshot()["sent"], io1 - io0, done


if __name__ == "__main__":
    main()
