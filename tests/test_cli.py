"""The console command, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _tfdist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfdist.cli", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_demo_shows_sharding_and_collectives():
    out = _tfdist("demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))" in text
    assert "cpu:5   (1, 1)  3:6    2:4" in text  # device 5 holds rows 3:6, cols 2:4
    assert "dp: S(0) -> R (all_gather)" in text and "tp: S(1) -> S(0) (all_to_all)" in text
    assert "tp: P(sum) -> S(0) (reduce_scatter)" in text
    assert "value: 6 = 0+1+2+3" in text
    assert "result (Shard(dim=0), Replicate()), value 8 (= 8)" in text
    # the Keras part: GPT trained with model.fit on the 2x4 mesh, weights sharded on tp
    losses = [float(v) for v in text.split("model.fit loss per epoch: ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    assert "gpt/block/mlp/dense/kernel           (32, 128)    ['unsharded', 'tp']" in text
    assert "collectives in one train step" in text


def test_info_lists_devices_and_versions():
    out = _tfdist("info", "--virtual-cpus", "4")
    assert out.returncode == 0, out.stderr
    assert "device type    cpu" in out.stdout
    assert "local devices  4" in out.stdout
    assert "tensorflow     2.21" in out.stdout and "keras          3." in out.stdout


def test_version_and_help_read_as_plain_text():
    version = _tfdist("--version")
    assert version.returncode == 0 and version.stdout.startswith("tfdist 0."), version
    help_text = _tfdist("--help").stdout
    assert "``" not in help_text and "demo" in help_text
    run_help = _tfdist("run", "--help").stdout
    assert "(default: 29500)" in run_help and "example: tfdist run --nproc-per-node 2" in run_help


def test_launcher_port_check_ignores_time_wait(tmp_path):
    """A finished run leaves its ports in TIME_WAIT; starting again right away must work."""
    import socket

    from tfdist.run import _check, build_parser

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.listen(1)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the side that closes first keeps the port in TIME_WAIT
    server.close()
    client.close()
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    parser = build_parser()
    args = parser.parse_args(["--master-port", str(port), str(script)])
    assert _check(args, parser) == ["127.0.0.1"]
    busy = socket.socket()  # a live listener still blocks the port
    busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    busy.bind(("", port))
    busy.listen(1)
    try:
        import pytest

        with pytest.raises(SystemExit):
            _check(parser.parse_args(["--master-port", str(port), str(script)]), parser)
    finally:
        busy.close()


def test_readme_example_runs_and_prints_what_it_says(tmp_path):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in code.splitlines():  # every "# <expected output>" comment on a print line holds
        if line.startswith("print(") and "# " in line:
            assert line.split("# ", 1)[1].split(" = ")[0].strip() in out.stdout, (line, out.stdout)


def test_the_command_is_quiet_by_default_and_verbose_on_request():
    """No TensorFlow log lines (I/W/E0000, absl) in the command's output unless --verbose;
    importing tfdist as a library leaves TF's logging as the user set it."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True, env=env,  # noqa: E731
                                    timeout=300)
    quiet = run("-m", "tfdist.cli", "demo", "--skip-keras")
    assert quiet.returncode == 0, quiet.stderr
    noise = [ln for ln in (quiet.stdout + quiet.stderr).splitlines() if "0000 " in ln or "absl" in ln]
    assert not noise, noise
    verbose = run("-m", "tfdist.cli", "--verbose", "info")
    assert verbose.returncode == 0 and "0000 " in verbose.stderr
    library = run("-c", "import tfdist")
    assert "0000 " in library.stderr  # not the command: TF's own logging is untouched


def test_quiet_detection():
    from tfdist._quiet import is_quiet_command

    assert is_quiet_command(["python", "-m", "tfdist.cli", "demo"])
    assert is_quiet_command(["python", "-m", "tfdist.run", "--nproc-per-node", "2", "train.py"])
    assert not is_quiet_command(["python", "-m", "tfdist.cli", "--verbose", "demo"])
    assert not is_quiet_command(["python", "-c", "import tfdist"])
