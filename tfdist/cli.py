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
    # lazy: TensorFlow loads only for the command that needs it
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
    if not args.skip_keras:
        _demo_gpt(mesh)
    return 0


def _demo_gpt(mesh) -> None:
    """A GPT-style Keras model trained with model.fit, tensor parallel on tp, data parallel on dp."""
    # lazy: Keras loads only when the Keras part of the demo runs
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.keras import _variables
    from tfdist.models import GPT, parallelize_gpt
    from tfdist.tensor.debug import CommDebugMode

    vocab, seq = 64, 16
    keras.utils.set_random_seed(0)
    model = GPT(vocab, seq, dim=32, heads=4, depth=2)
    parallelize_gpt(model, mesh)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (256, seq))
    y = (x + 1) % vocab  # learnable: predict the next token id
    print(f"\n== Keras 3 GPT (2 blocks, {vocab}-token vocab) on {mesh.axis_names} = {mesh.shape}: "
          "tensor parallel on tp, batches split over dp")
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    losses = ", ".join(f"{v:.3f}" for v in history.history["loss"])
    print(f"   model.fit loss per epoch: {losses}")
    print("   weight                               shape        layout (mesh dims per tensor dim)")
    for variable in (model.tok.embeddings, model.blocks[0].attn._query_dense.kernel,
                     model.blocks[0].mlp.up.kernel, model.blocks[0].mlp.down.kernel, model.head.kernel):
        specs = _variables.layout_of(variable._value).sharding_specs
        print(f"   {variable.path:<36} {str(tuple(variable.shape)):<12} {specs}")
    step = model.make_train_function()
    from tfdist.keras import _data

    batch = _data.shard_batch((tf.constant(x[:32]), tf.constant(y[:32])), mesh, 0)
    data = iter([batch])
    with CommDebugMode() as comm:
        step(data)
    print(f"   collectives in one train step (per device, as TF ran them): {comm.get_comm_counts()}")


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
    demo = sub.add_parser("demo", help="DTensor basics, then a Keras GPT trained with model.fit, on 8 virtual CPUs")
    demo.add_argument("--skip-keras", action="store_true", help="only the DTensor part")
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
