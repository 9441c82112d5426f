"""A training step replayed as one CUDA graph (``cuda_graphs``): its micro-batches copied into static tensors, the step
run eagerly for a few warm-up steps, then captured once and replayed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
Body = Callable[[Sequence[Batch]], torch.Tensor]
Replay = Callable[[], None]

WARMUP_STEPS = 3  # eager steps before the capture (PyTorch's whole-network recipe): lazy state, cuDNN autotuning


def warm_on_side_stream(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One eager step on a side stream, as capture requires of the steps before it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = run()
    torch.cuda.current_stream().wait_stream(side)
    return out


def capture_cuda_graph(run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """``run`` captured, not run: the graph's replay and the output tensor each replay refills."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph.replay, out


class GraphedStep:
    """``body`` (forward and backward of each micro-batch, the optimizer step, running sums: device work only, no host
    sync, no Python state that must change per step) called on static copies of the step's batches: eagerly for
    :data:`WARMUP_STEPS`, then captured once by ``capture`` and replayed. Returns the last micro-batch's loss.

    :meth:`reset` drops the graph, e.g. after the optimizer's state tensors were replaced by a checkpoint's."""

    def __init__(
        self,
        body: Body,
        warm: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = warm_on_side_stream,
        capture: Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]] = capture_cuda_graph,
    ) -> None:
        self.body, self.warm, self.capture = body, warm, capture
        self.static: list[Batch] = []
        self.replay: Replay | None = None
        self.loss: torch.Tensor | None = None
        self.warm_steps = 0

    def __call__(self, batches: Sequence[Batch]) -> torch.Tensor:
        self._stage(batches)
        if self.replay is None:
            if self.warm_steps < WARMUP_STEPS:
                self.warm_steps += 1
                return self.warm(self._run)
            self.replay, self.loss = self.capture(self._run)
        self.replay()
        return self.loss

    def _run(self) -> torch.Tensor:
        return self.body(self.static)

    def _stage(self, batches: Sequence[Batch]) -> None:
        if not self.static:
            self.static = [(images.clone(), labels.clone()) for images, labels in batches]
            return
        for (images, labels), (new_images, new_labels) in zip(self.static, batches, strict=True):
            images.copy_(new_images)
            labels.copy_(new_labels)

    def reset(self) -> None:
        self.replay, self.loss, self.warm_steps = None, None, 0
