"""Train a tiny GPT on a mix of two token datasets, on CPU, with ``torchrun``:

    torchrun --nproc-per-node 2 examples/llm_pretrain/train.py WORKDIR --steps 12 --kill-at 7
    torchrun --nproc-per-node 2 examples/llm_pretrain/train.py WORKDIR --steps 12 --resume --weights 0.2,0.8

Each rank reads its share of every global batch from a ``datapipe.TokenMix`` (each global
batch holds each source's share exactly) through a ``StreamingDataLoader`` worker, and
every ``--save-every`` steps saves model, optimizer and loader state with
``datapipe.CheckpointWriter``. ``--kill-at S`` SIGKILLs rank 0 once step S's checkpoint is
durable (torchrun then ends the job); ``--resume`` loads the newest checkpoint and goes
on from its step, with ``--weights`` (prose,code) from that step on (``set_weights``).
Rank 0 writes one JSON line per step to WORKDIR/log.jsonl: the step, the loss, and how many
sequences of each source the global batch held.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import datapipe


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(n))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(n)
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--weights", default="0.75,0.25", help="prose,code")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    sources = [os.path.join(a.work, "prose"), os.path.join(a.work, "code")]
    weights = [float(w) for w in a.weights.split(",")]
    mix = datapipe.TokenMix(dict(zip(sources, weights)), a.seq_len, global_batch=a.global_batch, steps=a.steps,
                            seed=0)
    loader = datapipe.StreamingDataLoader(mix, batch_size=mix.per_rank_batch(), num_workers=1)
    vocab = max(s.manifest.vocab_size or 0 for s in mix.sources)
    model = nn.parallel.DistributedDataParallel(TinyGPT(vocab, a.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    writer = datapipe.CheckpointWriter(os.path.join(a.work, "ckpt"), keep_last=2)
    if a.resume:
        state = datapipe.load_checkpoint(os.path.join(a.work, "ckpt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # a few integers per source (and the weights in force)
        mix.set_weights(weights, from_step=mix.step)  # the new mixture from the resume step on
        if rank == 0:
            print(f"resumed at step {mix.step} with weights {weights}: {mix.counts()} sequences per global batch",
                  flush=True)
    log = open(os.path.join(a.work, "log.jsonl"), "a") if rank == 0 else None
    step = mix.step
    for batch in loader:
        ids = batch["input_ids"]
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        # the global batch's sequences per source, and the sum of its token ids (a check of its content)
        seen = torch.cat([torch.bincount(batch["source"], minlength=len(sources)), ids.sum().reshape(1)])
        dist.all_reduce(seen)
        if log is not None:
            log.write(json.dumps({"step": step, "loss": round(loss.item(), 4), "counts": seen[:-1].tolist(),
                                  "token_sum": int(seen[-1]), "resumed": a.resume}) + "\n")
            log.flush()
        if step % a.save_every == 0:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "loader": loader.state_dict()}
            writer.save(step, state).wait()
            if a.kill_at is not None and step >= a.kill_at and rank == 0:
                print(f"killing rank 0 after the checkpoint of step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
