"""`loom train`'s progress output: a tqdm bar on a terminal, plain lines every N steps anywhere else (a log
file, CI), so a log never holds `\\r`-redrawn bars spliced with log lines."""
import io

import pytest

from torchloom.train.config import ConfigError, TrainConfig
from torchloom.train.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drive(progress: Progress, steps: int, log_at: int, out: io.StringIO) -> None:
    """What Job.train does: postfix after a metrics record, one update per step, a log line mid-run."""
    for step in range(1, steps + 1):
        progress.set_postfix(loss=f"{5 - step / 10:.3f}", tok_s="1,234", refresh=False)
        progress.update(1)
        if step == log_at:
            progress.write("[loom] step 5: held-out loss 4.5", file=out)
    progress.close()


def test_not_a_terminal_prints_plain_lines_every_n_steps():
    err, out = io.StringIO(), io.StringIO()
    drive(Progress(total=12, initial=0, enabled=True, every=4, stream=err), 12, 5, out)
    text = err.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    lines = text.splitlines()
    assert [line.split()[1:3] for line in lines] == [["step", "4/12"], ["step", "8/12"], ["step", "12/12"]], lines
    assert "loss 3.800" in lines[-1] and "tok_s 1,234" in lines[-1]
    assert out.getvalue() == "[loom] step 5: held-out loss 4.5\n"  # log lines untouched, on their own line


def test_resumed_and_stopped_runs_report_their_last_step():
    err = io.StringIO()
    p = Progress(total=100, initial=40, enabled=True, every=25, stream=err)
    for _ in range(13):  # steps 41..53, stopped by --max-steps-this-run
        p.update(1)
    p.close()
    lines = err.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["50/100", "53/100"], lines


def test_default_interval_is_about_twenty_lines_per_run():
    err = io.StringIO()
    drive(Progress(total=400, initial=0, enabled=True, every=None, stream=err), 400, 0, io.StringIO())
    assert len(err.getvalue().splitlines()) == 20


def test_a_terminal_gets_the_bar_and_disabled_prints_nothing():
    tty = Terminal()
    drive(Progress(total=5, initial=0, enabled=True, every=2, stream=tty), 5, 3, io.StringIO())
    assert "\r" in tty.getvalue() and "5/5" in tty.getvalue()  # tqdm redraws in place on a terminal
    quiet = io.StringIO()
    drive(Progress(total=5, initial=0, enabled=False, every=2, stream=quiet), 5, 3, io.StringIO())
    assert quiet.getvalue() == ""


def test_progress_every_config_key():
    assert TrainConfig.load(None, ["log.progress_every=50"]).log.progress_every == 50
    assert TrainConfig().log.progress_every is None
    with pytest.raises(ConfigError, match="log.progress_every"):
        TrainConfig.load(None, ["log.progress_every=0"])
