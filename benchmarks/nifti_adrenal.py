"""AdrenalMNIST3D's 64^3 volumes written out as a NIfTI folder with a labels CSV, to train on them with ``data=nifti``
and compare with ``data=adrenalmnist3d`` (issue 24):

    python benchmarks/nifti_adrenal.py --out /tmp/adrenal_nifti
    NIFTI="data=nifti data.root=/tmp/adrenal_nifti data.size=28 data.spacing=[2.2857,2.2857,2.2857] \\
        data.classes=[normal,hyperplasia]"
    python -m src.volumes $NIFTI                              # build the cache and describe it
    python -m src.train $NIFTI experiment=accuracy_cpu
    python -m src.train data=adrenalmnist3d data.size=28 experiment=accuracy_cpu

``--per-split N`` writes the first N volumes of each split only (one of a class a split's first N lack takes the place
of its last volume of the commonest class: every split holds both classes), e.g. a small set to resample to 128^3:

    python benchmarks/nifti_adrenal.py --out /tmp/adrenal_small --per-split 64
    python -m src.train data=nifti data.root=/tmp/adrenal_small data.size=128 data.spacing=[0.5,0.5,0.5] \
        data.classes=[normal,hyperplasia]

Each volume is ``<split>/<split>_<index>.nii.gz``: uint8, 1 mm isotropic (MedMNIST records no spacing), its voxels
stored along ``--orientation`` (RAS, or e.g. LPS: the same volume in world space, which preprocessing turns back).
``labels.csv``: ``image``, ``label`` (medmnist's class name), ``split`` (the official split). MedMNIST's 28^3 file
holds the same field of view at 64/28 the voxel size, hence ``data.spacing=[2.2857,...]`` with ``data.size=28``
(``data.size=28`` alone would crop the central 28 mm of each 64 mm cube); ``data.classes`` keeps medmnist's class
order (sorted names would make ``hyperplasia`` class 0).
"""

from __future__ import annotations

import argparse
import csv
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's src, also when run as a script

import nibabel as nib  # noqa: E402
import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from medmnist import INFO  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from src.cli import register  # noqa: E402
from src.config import SPLITS  # noqa: E402
from src.data.files import ensure_file  # noqa: E402
from src.data.npz import read_npz  # noqa: E402

FLAG = "adrenalmnist3d"


def stored(volume: np.ndarray, orientation: str) -> nib.Nifti1Image:
    """``volume`` (its axes taken as R, A, S, 1 mm) as a NIfTI image whose voxels run along ``orientation``."""
    image = nib.Nifti1Image(volume, np.eye(4))
    target = nib.orientations.axcodes2ornt(tuple(orientation))
    return image.as_reoriented(nib.orientations.ornt_transform(nib.orientations.io_orientation(image.affine), target))


def first_of_each_split(labels: np.ndarray, count: int | None) -> list[int]:
    """The indices of the first ``count`` labels (all where None), where each class present in ``labels`` occurs: a
    class the first ``count`` lack takes the place of the last index of the commonest class among them."""
    if count is None or count >= len(labels):
        return list(range(len(labels)))
    chosen = list(range(count))
    for cls in np.unique(labels):
        if cls in labels[chosen]:
            continue
        common = max(set(labels[chosen].tolist()), key=labels[chosen].tolist().count)
        last = max(i for i in chosen if labels[i] == common)
        chosen[chosen.index(last)] = int(np.flatnonzero(labels == cls)[0])
    return sorted(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the NIfTI folder to write (data.root)")
    parser.add_argument("--orientation", default="RAS", help="axis codes the voxels are stored along, e.g. LPS")
    parser.add_argument("--threads", type=int, default=4, help="files written at once")
    parser.add_argument("--per-split", type=int, help="the first N volumes of each split only (both classes in each)")
    args = parser.parse_args()
    if args.per_split is not None and args.per_split < 2:
        parser.error("--per-split needs 2 or more: a split must hold both classes")
    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        data = OmegaConf.to_object(compose("config", overrides=[f"data={FLAG}", "data.size=64"])).data
    splits = read_npz(ensure_file(data))
    names = INFO[FLAG]["label"]
    rows = [
        (f"{split}/{split}_{i}.nii.gz", names[str(int(labels[i]))], split, volumes[i])
        for split in SPLITS
        for volumes, labels in [(splits[split][0], np.asarray(splits[split][1]).reshape(-1))]
        for i in first_of_each_split(labels, args.per_split)
    ]
    for split in SPLITS:
        (args.out / split).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.threads) as pool:  # gzip releases the GIL
        list(pool.map(lambda row: nib.save(stored(row[3], args.orientation), args.out / row[0]), rows))
    with (args.out / "labels.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "label", "split"])
        writer.writerows(row[:3] for row in rows)
    counts = {split: sum(row[2] == split for row in rows) for split in SPLITS}
    print(f"wrote {len(rows)} volumes ({counts}) and labels.csv to {args.out}, stored along {args.orientation}")


if __name__ == "__main__":
    main()
