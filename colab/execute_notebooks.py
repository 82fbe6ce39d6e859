"""Runs every notebook in colab/ top to bottom and stores its outputs in the file.

    python colab/execute_notebooks.py            # all notebooks
    python colab/execute_notebooks.py 03_fsdp    # the ones whose name contains 03_fsdp

The notebooks are kept with their outputs so they read well on GitHub; the
test suite executes them the same way (tests/test_notebooks.py).
"""

from __future__ import annotations

import os
import pathlib
import sys

import re

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent
# TensorFlow's start-up lines (absl's pre-init notice, oneDNN, the CUDA probe, CPU features):
# printed at import whatever TF_CPP_MIN_LOG_LEVEL says; kept out of the stored outputs
_TF_NOISE = re.compile(
    r"^(WARNING: All log messages before absl|[IWE]\d{4} |To enable the following instructions|"
    r"rebuild TensorFlow with the appropriate compiler flags)"
)


def _final_text(text: str) -> str:
    """What a terminal finally shows: a progress bar redrawn with \\r and backspaces, once."""
    lines = []
    for line in text.replace("\b", "").split("\n"):
        lines.append(line.rsplit("\r", 1)[-1])
    return "\n".join(lines)


def _coalesced(outputs: list) -> list:
    """Consecutive stream outputs of one name merged, progress-bar redraws resolved."""
    merged: list = []
    for output in outputs:
        if merged and output.get("output_type") == "stream" and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == output.get("name"):
            merged[-1]["text"] += output["text"]
        else:
            merged.append(output)
    for output in merged:
        if output.get("output_type") == "stream":
            output["text"] = _final_text(output["text"])
    return merged


def _without_tf_noise(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in notebook.cells:
        kept = []
        for output in cell.get("outputs", []):
            if output.get("name") == "stderr":
                lines = [line for line in output["text"].splitlines(True) if not _TF_NOISE.match(line)]
                if not "".join(lines).strip():
                    continue
                output["text"] = "".join(lines)
            kept.append(output)
        if cell.cell_type == "code":
            cell.outputs = _coalesced(kept)
    return notebook


def execute(path: pathlib.Path, timeout: int = 900) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed in a fresh python3 kernel (raises on a failing cell)."""
    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def main(patterns: list[str]) -> None:
    for path in sorted(HERE.glob("*.ipynb")):
        if patterns and not any(p in path.name for p in patterns):
            continue
        print(f"executing {path.name}", flush=True)
        nbformat.write(_without_tf_noise(execute(path)), path)


if __name__ == "__main__":
    main(sys.argv[1:])
