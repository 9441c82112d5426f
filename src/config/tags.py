"""The tags a user names (``tags=[...]``: MLflow tags ``<name>=true``) against medsweep's own tag keys."""

from __future__ import annotations

import re

from src.config.ranges import TAG_KEY_MAX, not_longer

TAGS_ALLOWED = (  # what check_tags lets through, as the key reference says it
    f"names of letters, digits, _ and -, each at most {TAG_KEY_MAX} characters, none a tag medsweep sets itself"
)
TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
RESERVED_TAGS = frozenset(  # the undotted tag keys medsweep writes itself (its dotted ones cannot clash)
    [
        "config_hash",
        "code_fingerprint",
        "overrides",
        "output_dir",
        "rerun_of",
        "retry_of",
        "git_commit",
        "torch_version",
        "cuda_version",
        "host",
        "boot_id",
        "pid",
        "device",
        "num_threads",
        "status",
        "retried",
        "preempted",
        "resume_with",
        "resumes",
        "resumed_at",
        "best_weights",
        "sweep_dir",
        "role",
        "cuda_graphs",
        "gpu_share",
        "fuse",
    ]
)


def check_tags(tags: list[str]) -> None:
    """``tags`` become MLflow tags ``<name>=true``: letters, digits, ``_`` and ``-``, none of medsweep's own keys."""
    for name in tags:
        if not TAG_NAME.fullmatch(str(name)):
            raise ValueError(f"tags: {name!r} is not a tag name: use letters, digits, _ and - (tags=[baseline,amp])")
        not_longer("tags: a name", str(name), TAG_KEY_MAX, "MLflow's limit for a tag key")
        if name in RESERVED_TAGS:
            raise ValueError(f"tags: {name} is a tag medsweep sets itself: choose another name")
