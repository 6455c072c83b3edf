"""TR-DPO's reference sync (``objective.sync_ref_model``): every ``ref_model_sync_steps`` optimizer
steps the reference copy becomes ``alpha x policy + (1 - alpha) x reference``, as TRL 1.16's
SyncRefModelCallback updates it; the synced reference travels with the checkpoint, so a run
stopped and resumed continues the uninterrupted run step for step."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from rolemrc.modules.reference import CKPT_MODEL, CopyReference, make_reference
from rolemrc.run.train import run
from tests.train.helpers import series


def _set(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.full_like(p, value + i))


def test_mixup_every_sync_steps_is_the_hand_derived_blend() -> None:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    ref = CopyReference(policy, sync=(0.6, 2))
    start = [p.clone() for p in ref.model.parameters()]
    assert ref.state_dict() == {}  # not synced yet: nothing to save
    _set(policy, 1.0)
    ref.after_optimizer_step(policy, 1)  # not a sync step
    assert all(torch.equal(r, s) for r, s in zip(ref.model.parameters(), start))
    ref.after_optimizer_step(policy, 2)  # 0.6 * policy + 0.4 * start
    after2 = [0.6 * (1.0 + i) + 0.4 * s for i, s in enumerate(start)]
    for r, e in zip(ref.model.parameters(), after2):
        torch.testing.assert_close(r, e)
    _set(policy, -2.0)
    ref.after_optimizer_step(policy, 3)
    ref.after_optimizer_step(policy, 4)  # 0.6 * policy_4 + 0.4 * (0.6 * policy_2 + 0.4 * start)
    for i, (r, s) in enumerate(zip(ref.model.parameters(), start)):
        torch.testing.assert_close(r, 0.6 * (-2.0 + i) + 0.4 * (0.6 * (1.0 + i) + 0.4 * s))
    assert not any(p.requires_grad for p in ref.model.parameters())

    # the synced weights are saved and restored into a fresh copy of the starting policy
    saved = ref.state_dict()
    assert set(saved[CKPT_MODEL]) == {n for n, _ in ref.model.named_parameters()}
    fresh = CopyReference(policy, sync=(0.6, 2))
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), ref.model.parameters()))
    with pytest.raises(ValueError, match="sync_ref_model needs objective.reference=copy"):
        make_reference(policy, "adapter", sync=(0.6, 2))


def test_mixup_equals_trls_sync_rule() -> None:
    callbacks = pytest.importorskip("trl.trainer.callbacks")
    torch.manual_seed(1)
    policy = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ours = CopyReference(policy, sync=(0.3, 1))
    ours.model.to(torch.bfloat16)  # a frozen reference stored in bf16, the policy's fp32 masters mixed in
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    theirs = copy.deepcopy(ours.model)
    callbacks.SyncRefModelCallback._sync_target_model(policy, theirs, 0.3)
    ours.after_optimizer_step(policy, 1)
    for a, b in zip(ours.model.parameters(), theirs.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


ARGS = ["objective=dpo", "objective.sync_ref_model=true", "objective.ref_model_sync_steps=2",
        "objective.ref_model_mixup_alpha=0.6", "data.max_length=128", "data.max_prompt_length=96",
        "data.val_fraction=0", "data.batch_size=4", "optim.lr=5e-3", "optim.warmup_ratio=0", "trainer.max_steps=6",
        "trainer.max_epochs=5", "callbacks=default", "runtime.checkpoint_every_n_steps=1", "export.enabled=false"]
STOP = ["+callbacks.stop._target_=tests.train.test_loss_normalisation.StopAt", "+callbacks.stop.step=3"]


def _in(cfg, path: Path):
    cfg.run_dir = str(path)
    return cfg


def test_synced_reference_resumes_exactly(train_cfg, tmp_path: Path) -> None:
    run(_in(train_cfg(*ARGS), tmp_path / "whole"))
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(_in(train_cfg(*ARGS, *STOP), tmp_path / "first"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert CKPT_MODEL in torch.load(ckpt, map_location="cpu", weights_only=True)  # synced at step 2
    shutil.copy(ckpt, tmp_path / "stopped.ckpt")
    run(_in(train_cfg(*ARGS, f"ckpt_path={tmp_path / 'stopped.ckpt'}"), tmp_path / "second"))
    whole = series(tmp_path / "whole", "train/loss")
    assert series(tmp_path / "second", "train/loss") == pytest.approx(whole[3:], abs=1e-5)
    # the sync changes the reference: a resume that starts from the initial reference does not continue
    state = torch.load(tmp_path / "stopped.ckpt", map_location="cpu", weights_only=True)
    del state[CKPT_MODEL]
    torch.save(state, tmp_path / "unsynced.ckpt")
    run(_in(train_cfg(*ARGS, f"ckpt_path={tmp_path / 'unsynced.ckpt'}"), tmp_path / "third"))
    assert series(tmp_path / "third", "train/loss") != pytest.approx(whole[3:], abs=1e-5)


def _fsdp2_sync_on_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def shard(model: nn.Module) -> nn.Module:
            for layer in model:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        torch.manual_seed(0)
        policy = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        start = {n: p.detach().clone() for n, p in policy.named_parameters()}
        ref, fresh = CopyReference(policy, sync=(0.6, 1)), CopyReference(policy, sync=(0.6, 1))
        _set(policy, 1.0)
        trained = {n: p.detach().clone() for n, p in policy.named_parameters()}
        for m in (policy, ref.model, fresh.model):
            shard(m)
        from torch.distributed.tensor import DTensor

        first = next(ref.model.parameters())
        assert isinstance(first, DTensor) and first.to_local().shape[0] == first.shape[0] // 2
        ref.after_optimizer_step(policy, 1)  # each rank mixes its own shards
        saved = ref.state_dict()  # collective: full tensors
        fresh.load_state_dict(saved)  # each rank takes its shard back
        if rank == 0:
            torch.save({"start": start, "trained": trained, "saved": saved[CKPT_MODEL],
                        "reloaded": fresh.state_dict()[CKPT_MODEL]}, f"{out}/fsdp2.pt")
        else:
            fresh.state_dict()
    finally:
        dist.destroy_process_group()


def test_fsdp2_mixes_local_shards_and_checkpoints_full_tensors(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp2_sync_on_rank, args=(port, str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "fsdp2.pt")
    for name, start in got["start"].items():
        torch.testing.assert_close(got["saved"][name], 0.6 * got["trained"][name] + 0.4 * start)
        assert torch.equal(got["reloaded"][name], got["saved"][name])


@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_grpo_synced_reference_resumes_exactly(train_cfg, tmp_path: Path, objective: str) -> None:
    """GRPO's and RLOO's synced reference (RLOO: its KL taken out of the reward at the rollout)."""
    from tests.train.test_grpo import GRPO

    rl = [a.replace("objective=grpo", f"objective={objective}") for a in GRPO]
    args = [*rl, "objective.beta=0.1", "objective.sync_ref_model=true", "objective.ref_model_sync_steps=1",
            "objective.ref_model_mixup_alpha=0.5", "optim.lr=5e-3", "trainer.max_steps=4", "callbacks=default",
            "runtime.checkpoint_every_n_steps=1"]
    stop = ["+callbacks.stop._target_=tests.train.test_loss_normalisation.StopAt", "+callbacks.stop.step=2"]
    run(_in(train_cfg(*args), tmp_path / "whole"))
    with pytest.raises(RuntimeError, match="stopped at step 2"):
        run(_in(train_cfg(*args, *stop), tmp_path / "first"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert CKPT_MODEL in torch.load(ckpt, map_location="cpu", weights_only=True)
    run(_in(train_cfg(*args, f"ckpt_path={ckpt}"), tmp_path / "second"))
    for key in ("train/loss", "train/kl"):
        whole = series(tmp_path / "whole", key)
        assert series(tmp_path / "second", key) == pytest.approx(whole[2:], abs=1e-5), key
    assert max(series(tmp_path / "whole", "train/kl")) > 0
