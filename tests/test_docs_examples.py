"""Every python example in the user docs runs as written, each in a fresh process."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).parent.parent / "docs"
EXAMPLES = [
    (path, i, code)
    for path in (DOCS / "keras.md", DOCS / "fsdp.md", DOCS / "checkpoint.md", DOCS / "pipelining.md")
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S), 1)
]


@pytest.mark.parametrize("path,index,code", EXAMPLES, ids=[f"{p.stem}-{i}" for p, i, _ in EXAMPLES])
def test_example_runs_as_written(path, index, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, f"{path.name} example {index}:\n{out.stderr[-3000:]}"
