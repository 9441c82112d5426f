"""src/jobs/rank.py: what a rank of a DDP job reports to the job's process when it fails."""

from __future__ import annotations

from tests.helpers import run_cli, runs, small_run


def test_a_diverged_rank_fails_the_ddp_run_as_diverged_in_one_line(tmp_path, store, shared_data):
    """A rank's Diverged reached the job's process as torch's ProcessRaisedException: a traceback, exit 1."""
    ddp = ("parallel=ddp", "parallel.nproc=2", "parallel.timeout_s=60", "model.norm=group", "optim.lr=1e308")
    result = run_cli(*small_run(tmp_path, store, shared_data, *ddp))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: training diverged: train/loss is nan at epoch 1")
    (run,) = runs(store)
    assert run.info.status == "FAILED" and run.data.tags["status"] == "diverged"
    assert not list(tmp_path.rglob("diverged_rank*.txt"))
