"""The ``tfdist`` command: ``demo``, ``info`` and ``run`` (the launcher)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    # lazy imports in this module: `tfdist --help` and `tfdist run` must not load TensorFlow
    import tensorflow as tf

    import tfdist
    from tfdist import _runtime

    if args.virtual_cpus:
        tfdist.virtual_cpus(args.virtual_cpus)
    device_type = _runtime.detect_device_type()
    try:
        import keras

        keras_version = keras.__version__
    except ImportError:  # pragma: no cover - keras is a dependency
        keras_version = "not installed"
    rows = [
        ("tfdist", tfdist.__version__),
        ("tensorflow", tf.__version__),
        ("keras", keras_version),
        ("device type", device_type.lower()),
        ("local devices", str(len(_runtime.local_devices(device_type)))),
        ("clients", str(_runtime.get_world_size())),
        ("this client", str(_runtime.get_rank())),
    ]
    for key, value in rows:
        print(f"{key:<14} {value}")
    for name in _runtime.local_devices(device_type):
        print(f"  {name}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tfdist._demo import run_demo  # lazy: TensorFlow loads only for the command that needs it

    run_demo(args.mesh, steps=args.steps, out_dir=args.out, skip_keras=args.skip_keras)
    return 0


def _mesh_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2, 4): the demo's (dp, tp) mesh of 8 devices."""
    try:
        dp, tp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes DPxTP, e.g. 2x4 or 4x2; got {text!r}") from None
    if dp < 1 or tp < 1 or dp * tp != 8:
        raise argparse.ArgumentTypeError(f"--mesh must multiply to 8 devices (2x4, 4x2, 1x8, 8x1); got {text!r}")
    return dp, tp


def _version() -> str:
    """The installed version, read without importing TensorFlow."""
    from importlib import metadata

    try:
        return metadata.version("tfdist")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without install
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tfdist`` console command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # the launcher parses its own arguments (script args pass through)
        from tfdist.run import main as run_main  # lazy: the launcher never loads TensorFlow

        return run_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="tfdist", description="The tfdist command: demo, info and run (the launcher)."
    )
    parser.add_argument("--version", action="version", version=f"tfdist {_version()}")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's own log lines (quiet by default)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="start a multi-client program, torchrun-style (see tfdist run --help)")
    demo = sub.add_parser("demo", help="DTensor, a GPT trained with model.fit (TP x FSDP), a checkpoint loaded "
                          "on other meshes, a pipeline schedule; on 8 virtual CPUs, about two minutes",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--mesh", type=_mesh_shape, default=(2, 4), metavar="DPxTP",
                      help="the (dp, tp) mesh of the 8 devices")
    demo.add_argument("--steps", type=int, default=100, help="training steps of the GPT (5 epochs)")
    demo.add_argument("--out", default="tfdist-demo", help="folder for the pictures and the checkpoint")
    demo.add_argument("--skip-keras", action="store_true", help="skip the GPT and the checkpoint")
    demo.set_defaults(func=_demo)
    info = sub.add_parser("info", help="devices, device type, clients, TF/Keras versions")
    info.add_argument("--virtual-cpus", type=int, default=0, help="split the CPU into N devices first")
    info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    if not args.verbose:  # (tfdist/_quiet.py already quieted TensorFlow's import)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
