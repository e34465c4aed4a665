"""The worker-side backend interface: what the forked worker runs, whichever library computes."""
from abc import ABC, abstractmethod

from ..messages import ModelInfo, NewRequest, StepOutput


class Backend(ABC):
    info: ModelInfo

    @abstractmethod
    def step(self, new_requests: tuple[NewRequest, ...],
             finished_ids: tuple[str, ...]) -> StepOutput:
        """Free `finished_ids`, add `new_requests`, and return the new token ids of every active request and
        the requests that failed alone (the backend has already dropped them)."""

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing that outlives the process
        """Release the model before the worker exits."""


def resolve_device(device: str) -> str:
    """`auto` means CUDA when torch sees a GPU; only ever called in the worker, after the fork."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
