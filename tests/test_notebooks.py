"""Every Colab notebook runs top to bottom (its code cells, in order, in a fresh process)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "code"
    )
    assert "!" not in [line[:1] for line in code.splitlines()], "shell magics do not run here"
    script = tmp_path / "notebook.py"
    script.write_text(code)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
