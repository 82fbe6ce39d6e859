"""Every python example in the README and the user docs runs as written, each in a fresh process.

An example that starts with a ``# x.py -- run: tfdist run ...`` comment runs through the launcher,
as it says; in the README, every ``print(...)  # <expected output>`` comment holds.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from free_ports import free_base_port

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
OUTPUT_CHECKED = (ROOT / "README.md",)  # its comments are the printed output
EXAMPLES = [
    (path, i, code)
    for path in (*OUTPUT_CHECKED, DOCS / "keras.md", DOCS / "fsdp.md", DOCS / "checkpoint.md", DOCS / "pipelining.md")
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S), 1)
]


def _command(code: str, script: pathlib.Path, port: int = 0) -> list[str]:
    """How the example says to run it; a launched one on ``port`` (tests run side by side: the
    default port could be another job's)."""
    launch = re.match(r"# \S+ -- run: tfdist run (.*?) \S+\.py", code)
    if launch:
        ports = ["--master-port", str(port)] if port else []
        return [sys.executable, "-m", "tfdist.run", *launch.group(1).split(), *ports, str(script)]
    return [sys.executable, str(script)]


@pytest.mark.parametrize("path,index,code", EXAMPLES, ids=[f"{p.stem}-{i}" for p, i, _ in EXAMPLES])
def test_example_runs_as_written(path, index, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(_command(code, script, free_base_port(8)), capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, f"{path.name} example {index}:\n{out.stderr[-3000:]}"
    if path in OUTPUT_CHECKED:
        for line in code.splitlines():
            if line.startswith("print(") and "# " in line:
                expected = line.split("# ", 1)[1].split(" = ")[0].strip()
                assert expected in out.stdout, (path.name, index, line, out.stdout)


def test_the_launcher_comment_is_read():
    code = "# train.py -- run: tfdist run --nproc-per-node 2 --devices-per-proc 4 train.py (every client)\n"
    assert _command(code, pathlib.Path("t.py"))[1:] == ["-m", "tfdist.run", "--nproc-per-node", "2",
                                                        "--devices-per-proc", "4", "t.py"]
    assert _command(code, pathlib.Path("t.py"), 12000)[-3:] == ["--master-port", "12000", "t.py"]
    assert _command("import tfdist\n", pathlib.Path("t.py"), 12000) == [sys.executable, "t.py"]
