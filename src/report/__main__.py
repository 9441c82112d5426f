"""python -m src.report sweep=<folder | parent run id> [margin=0.01 speed_margin=0.05 memory_margin=0.05]: see
:mod:`src.report.writer`, imported (MLflow, plotting) once the config passed its checks."""

from omegaconf import DictConfig, OmegaConf

from src.cli import command


@command("report", zoo=False, sweeps=False)
def main(cfg: DictConfig) -> None:
    from src.report.writer import report  # MLflow and plotting: once the config passed its checks

    report(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
