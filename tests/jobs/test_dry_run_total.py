"""src/jobs/dry_run_total.py: the dry run's total line over its jobs, run one at a time or several at once."""

from __future__ import annotations

from src.jobs.dry_run_total import JobEstimate, makespan, total


def test_the_total_of_jobs_run_at_once_gives_when_the_last_ends_and_their_peaks_together():
    def estimate(job: int, minutes: float, peak: float, action: str = "run") -> JobEstimate:
        return JobEstimate(job, f"seed={job}", action, 4, peak, minutes, f"~{minutes} min")

    listed = [estimate(0, 3.0, 500), estimate(1, 1.0, 700), estimate(2, 1.0, 600), estimate(3, 0, 900, "skip: x")]
    alone = "total: 3 to run, 1 to skip | ~5 min | largest peak 700 MiB"
    assert total(listed) == alone and total(listed, at_once=1) == alone
    assert total(listed, at_once=2) == f"{alone} | 2 at once: ~3 min, peaks up to 1300 MiB together"
    assert makespan([1.0, 1.0, 1.0], 2) == 2.0 and makespan([], 2) == 0.0  # joblib's order: the third waits
