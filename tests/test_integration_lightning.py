"""GpusnapCheckpointIO under a real Lightning Trainer (CPU): exact resume after SIGKILL,
ModelCheckpoint's top-k bookkeeping, and checkpoints equal to the state at each save call."""

from __future__ import annotations

import os

import pytest
import torch

L = pytest.importorskip("lightning")

import lightning_support as run  # noqa: E402
from integration_support import assert_equal_tensors, run_killed  # noqa: E402

import gpusnap  # noqa: E402
from gpusnap.integrations.lightning import ROOT_NAME, GpusnapCheckpointIO, resolve  # noqa: E402


def _pointers(folder: str) -> set[str]:
    return {n for n in os.listdir(folder) if n.endswith(".ckpt")}


def test_resume_after_sigkill_is_bit_exact(tmp_path):
    reported = run_killed("lightning_support.py", str(tmp_path / "killed"), "2")
    assert reported["last"].endswith("last.ckpt")

    trainer, resumed = run.fit(str(tmp_path / "killed"), ckpt_path=reported["last"])
    assert trainer.global_step == run.EPOCHS * run.STEPS_PER_EPOCH
    straight_trainer, straight = run.fit(str(tmp_path / "straight"))
    assert_equal_tensors(resumed.state_dict(), straight.state_dict())
    for got, want in zip(trainer.optimizers[0].state_dict()["state"].values(),
                         straight_trainer.optimizers[0].state_dict()["state"].values()):
        assert_equal_tensors(got, want)


def test_top_k_keeps_exactly_the_reported_checkpoints(tmp_path):
    folder = str(tmp_path / "ck")
    trainer, _ = run.fit(folder)
    cb = trainer.checkpoint_callback
    kept = {os.path.basename(p) for p in cb.best_k_models} | {"last.ckpt"}
    assert _pointers(folder) == kept and len(kept) == 3
    with gpusnap.Checkpointer(os.path.join(folder, ROOT_NAME)) as root:  # what the dropped pointers named is gone
        assert {i.id for i in root.list()} == {resolve(os.path.join(folder, n)).checkpoint for n in kept}
    best = GpusnapCheckpointIO().load_checkpoint(cb.best_model_path)
    assert best["epoch"] in (0, 1, 2, 3) and set(best["state_dict"]) == set(trainer.lightning_module.state_dict())

    # "last" and "best" resolve through the pointers: resuming at the end trains nothing more
    again, model = run.fit(folder, ckpt_path="last")
    assert again.global_step == run.EPOCHS * run.STEPS_PER_EPOCH
    assert_equal_tensors(model.state_dict(), trainer.lightning_module.state_dict())


class _SaveEveryStep(L.Callback):
    """trainer.save_checkpoint after every step, noting the state it hands over at the call;
    the next steps then change those very tensors in place while the save is written."""

    def __init__(self, folder: str) -> None:
        self.folder, self.expected = folder, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        path = os.path.join(self.folder, f"step-{trainer.global_step}.ckpt")
        optim = trainer.optimizers[0].state_dict()["state"]
        self.expected[path] = ({k: v.clone() for k, v in module.state_dict().items()},
                               {f"{i}.{k}": v.clone() for i, s in optim.items() for k, v in s.items()})
        trainer.save_checkpoint(path)


def test_each_checkpoint_equals_the_state_at_its_save_call(tmp_path):
    folder = str(tmp_path / "ck")
    saver = _SaveEveryStep(folder)
    torch.manual_seed(0)
    model = run.Net(width=256)  # (a few hundred KiB: copies still in flight when the next step writes)
    trainer = L.Trainer(max_epochs=2, plugins=[GpusnapCheckpointIO()], callbacks=[saver], accelerator="cpu",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(model, run.data())
    assert len(saver.expected) == 2 * run.STEPS_PER_EPOCH
    io = GpusnapCheckpointIO()
    for path, (weights, optim) in saver.expected.items():
        got = io.load_checkpoint(path)
        assert_equal_tensors(got["state_dict"], weights)
        state = got["optimizer_states"][0]["state"]
        assert_equal_tensors({f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}, optim)


def test_load_from_checkpoint_on_a_pointer_says_how_and_ours_loads_it(tmp_path):
    trainer, _ = run.fit(str(tmp_path), epochs=1)
    last = trainer.checkpoint_callback.last_model_path
    for weights_only in (None, False):  # torch.load refuses the file, naming gpusnap and the way
        with pytest.raises(Exception, match=r"gpusnap.*load_from_checkpoint\(YourModule, path\)"):
            run.Net.load_from_checkpoint(last, weights_only=weights_only)

    from gpusnap.integrations.lightning import load_from_checkpoint

    model = load_from_checkpoint(run.Net, last)
    assert isinstance(model, run.Net)
    assert_equal_tensors(model.state_dict(), trainer.lightning_module.state_dict())
