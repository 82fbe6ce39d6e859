"""The ``tfdist`` command: ``demo`` and ``info``."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
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
    import numpy as np
    import tensorflow as tf

    import tfdist

    tfdist.virtual_cpus(8)
    from tfdist.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from tfdist.tensor.debug import explain_redistribute, visualize_sharding

    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    print(f"mesh: {mesh}\n")
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    a = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    visualize_sharding(a, header="== distribute_tensor(x[6, 8], mesh, [Shard(0), Shard(1)])")

    def move(src: DTensor, placements, title: str) -> DTensor:
        steps = explain_redistribute(src, mesh, placements)
        out = src.redistribute(mesh, placements)
        print(f"\n== {title}")
        for step in steps:
            print(f"   {step}")
        visualize_sharding(out)
        np.testing.assert_allclose(out.numpy(), src.numpy())
        return out

    b = move(a, [Replicate(), Shard(0)], "redistribute -> [Replicate(), Shard(0)]")
    move(b, [Replicate(), Replicate()], "redistribute -> [Replicate(), Replicate()]")
    move(a, [Shard(1), Shard(0)], "redistribute -> [Shard(1), Shard(0)] (uneven: 6 rows on 4 devices)")

    # Device (dp, tp) holds the value tp: replicas along dp agree, as they must.
    parts = [tf.fill((2, 8), float(i % 4)) for i in range(8)]
    p = DTensor.from_local(parts, mesh, [Replicate(), Partial("sum")])
    print("\n== DTensor.from_local(device (dp, tp) holds tp, [Replicate(), Partial('sum')])")
    visualize_sharding(p)
    r = move(p, [Replicate(), Shard(0)], "redistribute Partial -> Shard(0)")
    print(f"   value: {r.numpy()[0, 0]:.0f} = 0+1+2+3")

    w = distribute_tensor(np.ones((8, 4), np.float32), mesh, [Replicate(), Shard(0)])
    h = distribute_tensor(np.ones((6, 8), np.float32), mesh, [Shard(0), Shard(1)])

    @tf.function
    def step(h, w):
        return tf.nn.relu(tf.matmul(h, w))

    y = step(h, w)
    print(f"\n== tf.function matmul, contraction dim sharded on tp: result {y.placements}, "
          f"value {y.numpy()[0, 0]:.0f} (= 8)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tfdist`` console command."""
    parser = argparse.ArgumentParser(prog="tfdist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shard, redistribute and print a DTensor on 8 virtual CPUs")
    demo.set_defaults(func=_demo)
    info = sub.add_parser("info", help="devices, device type, clients, TF/Keras versions")
    info.add_argument("--virtual-cpus", type=int, default=0, help="split the CPU into N devices first")
    info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TF's C++ banner out of the output
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
