"""python -m src.report sweep=<folder | parent run id> [margin=0.01 speed_margin=0.05 memory_margin=0.05]: see
:mod:`src.report.writer`."""

from omegaconf import DictConfig, OmegaConf

from src.cli import command
from src.report.writer import report


@command("report", zoo=False)
def main(cfg: DictConfig) -> None:
    report(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
