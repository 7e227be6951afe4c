"""The distributed trainer's step accounting against a real DeepSpeed engine (one process, gloo on
loopback): a logged step, a checkpoint and an LR-schedule step happen exactly where DeepSpeed steps the
optimizer, i.e. after every gradient-accumulation-th micro-batch, never one micro-batch early."""

import socket

import pytest
import torch
import torch.distributed as dist
from tiny_models import untrained_drafter

from dspark import target as targets
from dspark.config import load_config
from dspark.train.loop import make_optimizer
from dspark.train.worker import _engine, _micro_step, _no_cpu_shm_build, ds_config

GAMMA = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank(monkeypatch):
    """torch.distributed as a Ray Train worker of a one-worker group sees it."""
    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    _no_cpu_shm_build()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch(tgt):
    ids = torch.tensor([tgt.tokenizer.encode("def add(a, b):\n    return a + b\n" * 2)] * 2)
    g = torch.Generator().manual_seed(0)
    B, T, d = *ids.shape, tgt.config.hidden_size
    return {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "valid": torch.ones_like(ids, dtype=torch.bool),
        "features": torch.randn(B, T, 3, d, generator=g),
        "last_hidden": torch.randn(B, T, d, generator=g),
    }


def test_a_step_ends_after_every_gradient_accumulation_th_micro_batch(one_rank):
    cfg = load_config(
        overrides=[
            "train.global_batch=4",
            "train.micro_batch=2",
            "train.num_workers=1",
            "train.lr=1e-3",
            "train.bf16=true",
        ]
    )
    tgt = targets.load("builtin")
    drafter = untrained_drafter(tgt, "dspark", GAMMA).train()
    engine, scheduler = _engine(cfg, drafter, world=1, total=3)
    # train.bf16 is autocast on every device: the weights stay float32 like the cache's features
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    gas = engine.gradient_accumulation_steps()
    assert gas == 2
    batch, ends, weights = _batch(tgt), [], []
    for micro in range(3 * gas):
        before = [p.detach().clone() for p in drafter.parameters() if p.requires_grad]
        _, boundary = _micro_step(engine, batch, cfg.train, torch.Generator().manual_seed(micro), world=1)
        after = [p.detach() for p in drafter.parameters() if p.requires_grad]
        ends.append(boundary)
        weights.append(any(not torch.equal(a, b) for a, b in zip(after, before)))
    # the micro-batches that end a step are exactly those after which the weights moved
    assert ends == [False, True] * 3 == weights
    assert engine.global_steps == 3
    assert len(scheduler.get_last_lr()) == 1 and scheduler.last_epoch == 3


def test_both_trainers_take_the_configured_adam_settings():
    """train.lr / adam_betas / weight_decay reach the local loop's AdamW and DeepSpeed's own optimizer."""
    tc = load_config(overrides=["train.adam_betas=[0.9,0.999]", "train.lr=2e-4", "train.weight_decay=0.1"]).train
    drafter = untrained_drafter(targets.load("builtin"), "dspark", GAMMA)
    group = make_optimizer(drafter, tc).param_groups[0]
    assert (group["betas"], group["lr"], group["weight_decay"]) == ((0.9, 0.999), 2e-4, 0.1)
    ds = ds_config(tc.model_copy(update={"optimizer": "deepspeed_adamw"}), world=1)
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "weight_decay": 0.1}
