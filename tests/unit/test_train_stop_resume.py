"""The end of a `loom train` run stopped early (issue [11] item 10) and a resume that cannot load its checkpoints
(item 3): the reference job's own methods on a one-rank group in this process (a small model in place of the
job's, real checkpoints)."""
from pathlib import Path

import pytest
import torch

import torchloom
from torchloom.train.config import TrainConfig
from torchloom.train.goodput import GoodputLog
from torchloom.train.job import Job, ResumeError, run_job


def _job(tmp_path: Path, width: int = 4, *overrides: str) -> Job:
    """A Job whose ``res`` is ``auto_accelerate`` of a ``Linear(4, width)`` (the state a checkpoint holds)."""
    cfg = TrainConfig.load("smoke", list(overrides), str(tmp_path / "run"))
    data = [torch.randn(4) for _ in range(8)]
    res = torchloom.auto_accelerate(torch.nn.Linear(4, width), torch.optim.SGD, data, lambda b, o: o.sum(),
                                    optim_args={"lr": 0.1}, dataloader_args={"batch_size": 2})
    job = Job(cfg)
    job.rank, job.world, job.res, job.attempt = 0, 1, res, 0
    job.out = Path(cfg.output_dir)
    job.ckpt_root = job.out / "checkpoints"
    job.goodput = GoodputLog(job.out / "goodput.jsonl")
    job.tokens_seen, job.train_time, job.initial_eval_loss, job.last_eval_loss = 0, 0.0, None, None
    job.tokens_per_step = 8
    job.lines = []
    job.log = job.lines.append
    return job


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_requested_stop_saves_the_step_it_reached(tmp_path):
    job = _job(tmp_path)  # smoke: checkpoint.interval 10, steps 20
    job.stop_early({"start_step": 0, "end_step": 12, "last_saved": 10})
    assert _steps(job.ckpt_root) == ["step_00000012"]
    (line,) = [m for m in job.lines if m.startswith("stopped")]
    assert line.startswith("stopped after step 12 of 20 (--max-steps-this-run): checkpoint step 12 saved (")
    assert line.endswith("re-run the same command (same output dir) to resume from step 12")
    assert job.maybe_resume() == 12  # what the re-run loads


def test_a_stop_on_a_saved_step_does_not_save_again(tmp_path):
    job = _job(tmp_path)
    job.save(10)
    job.lines.clear()
    job.stop_early({"start_step": 0, "end_step": 10, "last_saved": 10})
    assert _steps(job.ckpt_root) == ["step_00000010"]
    assert not [m for m in job.lines if m.startswith("checkpoint step")]
    assert "checkpoint step 10 saved" in job.lines[-1]


def test_a_stop_without_saving_says_what_is_lost(tmp_path):
    job = _job(tmp_path, 4, "checkpoint.save_on_stop=false")
    job.stop_early({"start_step": 0, "end_step": 12, "last_saved": 0})
    assert _steps(job.ckpt_root) == []
    assert job.lines[-1] == ("stopped after step 12 of 20 (--max-steps-this-run) without saving it "
                             "(checkpoint.save_on_stop: false): steps 1-12 are lost; a re-run of the same command "
                             "resumes from step 0: no checkpoint was saved and trains them again")
    job.save(10)
    job.stop_early({"start_step": 0, "end_step": 13, "last_saved": 10})
    assert "steps 11-13 are lost" in job.lines[-1] and "the newest checkpoint, step 10 (" in job.lines[-1]


def test_a_checkpoint_of_another_model_is_a_clean_error(tmp_path, capsys, monkeypatch):
    """A resume that cannot load the output dir's checkpoints names them and what to do; `run_job` prints it
    without a traceback and returns 1."""
    _job(tmp_path, 4).save(3)
    other = _job(tmp_path, 8)  # another model in the same output dir
    with pytest.raises(ResumeError) as e:
        other.maybe_resume()
    msg = str(e.value)
    assert msg.startswith(f"cannot resume from the checkpoints in {other.ckpt_root}: loading checkpoint ")
    assert "step_00000003" in msg and "Size mismatch" in msg and "another --output-dir" in msg and f"delete {other.ckpt_root}" in msg

    import torchloom.train.job as job_module

    monkeypatch.setattr(job_module, "run", lambda cfg, k=None: other.maybe_resume())
    assert run_job(["smoke", "--output-dir", str(other.out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("[loom] error: cannot resume from the checkpoints in ") and "Traceback" not in err


def test_a_data_position_the_new_batch_misses_is_a_clean_error(tmp_path):
    """A checkpoint taken 2 samples into the epoch, resumed with micro batch 4: the sampler's DataError becomes a
    ResumeError (one message, exit 1, no traceback) naming the job's key for the fix."""
    job = _job(tmp_path)
    next(iter(job.res.dataloader))  # 2 samples consumed
    job.save(1)
    other = _job(tmp_path)
    data = [torch.randn(4) for _ in range(8)]
    other.res = torchloom.auto_accelerate(torch.nn.Linear(4, 4), torch.optim.SGD, data, lambda b, o: o.sum(),
                                          optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4})
    with pytest.raises(ResumeError) as e:
        other.maybe_resume()
    msg = str(e.value)
    assert msg.startswith(f"cannot resume the data position of the checkpoints in {other.ckpt_root}: ")
    assert "consumed 2 samples" in msg and "--set train.micro_batch=N" in msg and "Nothing was trained" in msg
