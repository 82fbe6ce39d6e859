"""The Stateful protocol (torch.distributed.checkpoint.stateful)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful", "stateful_values"]


@runtime_checkable
class Stateful(Protocol):
    """An object with ``state_dict()`` / ``load_state_dict(sd)``.

    ``save`` stores ``obj.state_dict()`` in its place; ``load`` loads into it
    and then calls ``obj.load_state_dict(loaded)``.

    Example::

        class Progress:
            def __init__(self): self.step = 0
            def state_dict(self): return {"step": self.step}
            def load_state_dict(self, sd): self.step = sd["step"]

        tfdist.checkpoint.save({"progress": Progress()}, checkpoint_id=path)
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def stateful_values(state_dict: dict) -> dict:
    """``state_dict`` with each Stateful value replaced by its ``state_dict()``."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
