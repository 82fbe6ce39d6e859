"""The console command, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tfdist._cpu_kernels import is_x86_linux

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _tfdist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfdist.cli", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_demo_shows_what_it_claims(tmp_path):
    """The demo with small options: every claim it prints holds, against a reference derived here."""
    out_dir = tmp_path / "demo"
    out = _tfdist("demo", "--steps", "25", "--out", str(out_dir))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # 1. DTensor: placements by hand (device 5 of the 2x4 mesh is (1, 1): rows 3:6, columns 2:4)
    assert "DeviceMesh('cpu', [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))" in text
    assert "cpu:5   (1, 1)  3:6    2:4" in text
    assert "dp: S(0) -> R (all_gather)" in text and "tp: S(1) -> S(0) (all_to_all)" in text
    assert "tp: P(sum) -> S(0) (reduce_scatter)" in text
    assert "value: 6 = 0+1+2+3" in text
    assert "result (Shard(dim=0), Replicate()), value 8 (= 8)" in text
    # 2. model.fit learns: the loss falls every epoch, from about ln(64) = 4.16
    losses = [float(v) for v in text.split("model.fit loss per epoch: ")[1].splitlines()[0].split(", ")]
    assert len(losses) == 5 and abs(losses[0] - 4.16) < 0.3 and losses == sorted(losses, reverse=True)
    # TP shards the column-parallel kernel's output on tp, FSDP the first free dim on dp: 256 x 64 x 4 B / 8
    rows = " ".join(text.split())  # the table's column widths depend on the longest path
    assert "gpt/block/mlp/dense/kernel (64, 256) dp: S(0), tp: S(1) 8,192" in rows
    assert "gpt/block/mlp/dense_1/kernel (256, 64) dp: S(1), tp: S(0) 8,192" in rows  # row-parallel: tp on in
    assert "(one device would hold 437,248 bytes)" in text
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # FSDP's gathers and gradient reduction
        assert name in text.split("collectives in one training step")[1]
    # 3. the checkpoint reloaded on FSDP over 8 devices and on one device evaluates the same
    evals = [float(line.split()[-1]) for line in text.splitlines() if line.strip().startswith("evaluation loss,")]
    assert len(evals) == 3 and max(evals) - min(evals) < 1e-4, evals
    assert (out_dir / "checkpoint" / ".metadata").exists()
    # 4. the pipeline's gradients equal the whole model's; the plan's bubble is (p-1)/(m+p-1) = 3/11
    worst = float(text.split("gradients differ from the whole model's by at most ")[1].split()[0])
    assert worst < 1e-5
    assert "plan 0.273" in text and "0REDUCE_GRAD" in text
    # 5. the pictures, named at the end
    for name in ("loss_curve.png", "pipeline_1f1b.png"):
        assert (out_dir / name).stat().st_size > 10_000 and str(out_dir / name) in text


def test_demo_refuses_a_mesh_that_is_not_8_devices():
    out = _tfdist("demo", "--mesh", "3x2")
    assert out.returncode == 2 and "--mesh must multiply to 8 devices" in out.stderr and "'3x2'" in out.stderr


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


def test_the_command_is_quiet_by_default_and_verbose_on_request(tmp_path):
    """No TensorFlow log lines (I/W/E0000, absl) in the command's output unless --verbose;
    importing tfdist as a library leaves TF's logging as the user set it."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True, env=env,  # noqa: E731
                                    timeout=300)
    quiet = run("-m", "tfdist.cli", "demo", "--skip-keras", "--out", str(tmp_path / "demo"))
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


@pytest.mark.skipif(not is_x86_linux(), reason="the launcher turns oneDNN on for CPU jobs on x86-64 Linux only")
def test_launcher_turns_onednn_on_for_cpu_jobs_unless_the_user_chose(monkeypatch):
    """torchrun sets OMP_NUM_THREADS for its processes; tfdist run sets TF_ENABLE_ONEDNN_OPTS=1
    for a CPU job (TF turns oneDNN on only on CPUs with AVX512_VNNI/AMX), and keeps a value the
    user set, and leaves GPU jobs to TF's default."""
    from tfdist.run import build_parser, client_environments

    def envs(*argv: str) -> list[dict]:
        return client_environments(build_parser().parse_args([*argv, "job.py"]), ["127.0.0.1"])

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    assert [e["TF_ENABLE_ONEDNN_OPTS"] for e in envs("--nproc-per-node", "2")] == ["1", "1"]
    assert all("TF_ENABLE_ONEDNN_OPTS" not in e for e in envs("--nproc-per-node", "2", "--device-type", "gpu"))
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert [e["TF_ENABLE_ONEDNN_OPTS"] for e in envs("--nproc-per-node", "2")] == ["0", "0"]
