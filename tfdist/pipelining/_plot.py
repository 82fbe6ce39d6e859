"""A schedule's timeline as a picture (matplotlib) or as text."""

from __future__ import annotations

import os
from typing import Any

from tfdist.pipelining import _timeline
from tfdist.pipelining._profile import PipelineProfile

_COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#72b7b2", "O": "#b279a2", "R": "#bab0ac"}


def _kind(action: str) -> str:
    if action.startswith("("):
        return "O"
    for k in ("REDUCE_GRAD", "F", "B", "I", "W"):
        if k in action.lstrip("0123456789")[:len(k)]:
            return "R" if k == "REDUCE_GRAD" else k
    return "R"


def timeline(schedule: Any, executed: bool = False) -> dict[int, list[tuple[str, float, float]]]:
    """Per rank ``(action, start, end)``: the last ``step``'s recorded run (``executed=True``, seconds)
    or the plan timed with unit costs (forward 1, backward 2)."""
    if executed:
        if not any(schedule.executed_order.values()):
            raise ValueError("timeline(executed=True): run schedule.step(...) first")
        return schedule.executed_order
    return _timeline.simulate(schedule._execution_order(), schedule._num_stages)


def plot_schedule(schedule: Any, path: str | os.PathLike, executed: bool = False,
                  profile: PipelineProfile | None = None) -> str:
    """Draws the schedule's timeline (one row per pipeline rank) into ``path`` (PNG, SVG, PDF...).

    ``executed=True`` draws the last ``step`` as recorded; ``profile`` (from
    :func:`read_profile`) draws it as the TF profiler saw it.

    Example::

        plot_schedule(schedule, "1f1b.png")                  # the plan, unit costs
        schedule.step(x, target=y)
        plot_schedule(schedule, "1f1b-run.png", executed=True)   # what ran, in seconds
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    executed = executed or profile is not None
    lines = profile.actions if profile is not None else timeline(schedule, executed)
    ranks = sorted(lines)
    end = max(e for acts in lines.values() for _, _, e in acts)
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.5 * sum(len(a) for a in lines.values()) / len(ranks))),
                                    0.6 * len(ranks) + 1.2))
    for row, rank in enumerate(ranks):
        for action, start, stop in lines[rank]:
            ax.broken_barh([(start, stop - start)], (row - 0.4, 0.8), facecolors=_COLOURS[_kind(action)],
                           edgecolor="white", linewidth=0.5)
            if stop - start > end / 60:
                ax.text((start + stop) / 2, row, action.replace("OVERLAP_F_B", ""), ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds" if executed else "time (forward = 1)")
    bubble = None if executed else _timeline.bubble_fraction(lines)
    title = f"{type(schedule).__name__}: {schedule._n_microbatches} microbatches"
    if profile is not None:
        title += f", TF profiler trace: {profile.concurrency():.2f} ranks busy at once"
    ax.set_title(title + (f", bubble {bubble:.3f}" if bubble is not None else "" if profile else ", executed"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.fspath(path)
