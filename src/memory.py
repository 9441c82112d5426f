"""python -m src.memory model=densenet121 batch_size=16 amp=true: a run's predicted peak memory, part by part
(:mod:`src.perf.memory`); nothing is trained."""

from omegaconf import DictConfig

from src.cli import command
from src.execution import validate
from src.perf.autobatch import check_one_sample
from src.perf.memory import predict


@command("memory")
def main(cfg: DictConfig) -> None:
    typed, execution = validate(cfg)
    check_one_sample(typed)
    print(predict(typed, execution).table(), flush=True)


if __name__ == "__main__":
    main()
