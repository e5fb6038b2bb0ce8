"""Run ported ATorch code on 2 CPU gloo ranks as ATorch's launcher would, several codes per launch.

:func:`torchloom.testing.run_ranks` starts its ranks with the ``spawn`` method, and a spawned process keeps
``spawn`` as its default, so each DataLoader worker (ATorch's tests and examples use ``num_workers`` 1-2)
would re-import torch and transformers: 5-15 s per worker on a loaded 2-core machine. ATorch's launcher
(torchrun-like) starts ranks whose default start method is ``fork``; the ranks here restore that before the
ported code runs.

Starting 2 ranks costs a few seconds of imports each, so the codes of one test module run in one launch
(:class:`RankCodes`), one after the other, as ATorch's run_dist_code would run them in separate launches; each
test then reads its own code's outcome. ``atorch.reset_distributed()`` leaves run_ranks' process group alone,
so each code starts from the same group.
"""
import multiprocessing
import traceback

from torchloom.testing import run_ranks

WORLD_SIZE = 2


def _run_codes(codes):
    multiprocessing.set_start_method("fork", force=True)
    out = {}
    for name, (fn, args, kwargs) in codes.items():
        try:
            out[name] = ("ok", fn(*args, **kwargs))
        except Exception:  # noqa: BLE001 - reported to the test of this code, the next code still runs
            out[name] = ("error", traceback.format_exc())
    return out


class RankCodes:
    """Codes ``{name: (fn, args, kwargs)}`` run on 2 gloo ranks in one launch, at the first :meth:`result`."""

    def __init__(self, codes, timeout=600):
        self.codes = codes
        self.timeout = timeout
        self._results = None
        self._launch_error = None

    def result(self, name):
        """Each rank's return value of code ``name``.

        Raises:
            AssertionError: the code raised on some rank (with that rank's traceback).
            RuntimeError: the launch itself failed (a rank died or hung); every test of the group reports it,
                and the launch is not retried.
        """
        if self._launch_error is not None:
            raise RuntimeError(f"{name}: the shared 2-rank launch failed") from self._launch_error
        if self._results is None:
            try:
                self._results = run_ranks(_run_codes, WORLD_SIZE, self.codes, timeout=self.timeout,
                                          env={"NPROC_PER_NODE": str(WORLD_SIZE)})
            except RuntimeError as e:
                self._launch_error = e
                raise
        per_rank = [r[name] for r in self._results]
        errors = [f"rank {i}: {value}" for i, (status, value) in enumerate(per_rank) if status == "error"]
        if errors:
            raise AssertionError(f"{name} failed:\n" + "\n".join(errors))
        return [value for _, value in per_rank]
