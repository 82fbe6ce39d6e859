"""keras-hub's backbones, enumerated from its exports and built tiny from their signatures, with
layout maps written as a user writes them (keras-hub's Llama pattern) or drawn at random.

Used by tests/keras/test_keras_py; ``python tests/keras/py`` prints the family
x case table docs/keras.md quotes.
"""

from __future__ import annotations

import tfdist

if __name__ == "__main__":
    tfdist.virtual_cpus(8)  # before TF lists its devices

import inspect
import json
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Any

import keras
import numpy as np
from tensorflow.experimental import dtensor

import keras_hub
import tfdist.keras  # noqa: F401  (the TF backend of keras.distribution)
from tfdist.keras import _variables

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import _hub_maps  # noqa: E402  (the Llama-pattern map, shared with benchmarks/keras_hub_vs_jax.py)

VOCAB, SEQ, BATCH = 64, 8, 16

# tiny values for the config arguments backbones share, by parameter name
TINY = {
    "vocabulary_size": VOCAB, "num_layers": 2, "num_heads": 4, "num_query_heads": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_dim": 32, "intermediate_dim": 64, "head_dim": 8,
    "max_sequence_length": 32, "dropout": 0.0, "num_segments": 2, "embedding_dim": 32, "num_experts": 4,
    "moe_intermediate_dim": 16, "shared_expert_intermediate_dim": 32, "attention_bias": False, "head_size": 8,
    "hidden_size": 32, "num_groups": 1, "attention_dropout": 0.0, "filter_dim": 64,
    "shared_expert_intermediate_size": 32,
    # vision backbones
    "image_shape": (16, 16, 3), "patch_size": 4, "mlp_dim": 64, "input_conv_filters": [64],
    "input_conv_kernel_sizes": [3], "stackwise_num_filters": [64, 64], "stackwise_num_blocks": [1, 1],
    "stackwise_num_strides": [1, 2], "block_type": "basic_block", "stackwise_num_repeats": [1, 1],
}
# families TINY builds but that cannot be built from it, with the reason
NOT_BUILT = {
    "SwinTransformerBackbone": "num_heads is a list per stage here, an int in every other family",
}

def backbones(inputs: str = "tokens,images") -> list[str]:
    """Names of keras-hub's exported ``*Backbone`` classes whose inputs are token ids (``tokens``,
    a ``vocabulary_size`` parameter) or images (``images``, an ``image_shape`` parameter)."""
    names = {"tokens": [], "images": []}
    for name in sorted(dir(keras_hub.models)):
        cls = getattr(keras_hub.models, name)
        if not (name.endswith("Backbone") and inspect.isclass(cls) and name != "Backbone"):
            continue
        params = inspect.signature(cls.__init__).parameters
        if "vocabulary_size" in params:
            names["tokens"].append(name)
        elif "image_shape" in params:
            names["images"].append(name)
    return [name for kind in inputs.split(",") for name in names[kind]]


def tiny_config(name: str) -> dict[str, Any] | str:
    """The backbone's constructor arguments from TINY, or why it cannot be built from them."""
    cls = getattr(keras_hub.models, name)
    if name in NOT_BUILT:
        return NOT_BUILT[name]
    config = {}
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        if param.name in TINY:
            config[param.name] = TINY[param.name]
        elif param.default is param.empty:
            return f"needs {param.name}"
    return config


def build(name: str) -> keras.Model:
    config = tiny_config(name)
    if isinstance(config, str):
        raise ValueError(config)
    keras.utils.set_random_seed(0)
    return getattr(keras_hub.models, name)(**config)


def inputs_for(backbone: keras.Model) -> dict[str, np.ndarray] | np.ndarray:
    rng = np.random.default_rng(0)
    data = {}
    for spec in backbone.inputs:
        key = spec.name.split(":")[0]
        if "float" in str(spec.dtype):
            sizes = [BATCH, SEQ * 4]
            shape = [sizes[i] if d is None else d for i, d in enumerate(spec.shape)]
            data[key] = rng.standard_normal(shape).astype(str(spec.dtype))
        elif key.endswith("_mask"):
            data[key] = np.ones((BATCH, SEQ), "int32")
        elif "segment" in key:
            data[key] = np.zeros((BATCH, SEQ), "int32")
        else:
            data[key] = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
    if len(data) == 1 and not isinstance(backbone._inputs_struct, dict):
        return next(iter(data.values()))  # one input: its array (an image backbone's functional input)
    return data


def _distinct(weights: list) -> list:
    """One weight per path (a shared embedding appears under each layer that uses it)."""
    seen: dict[str, Any] = {}
    for v in weights:
        seen.setdefault(v.path, v)
    return list(seen.values())


def llama_pattern_map(backbone: keras.Model, mesh: Any) -> keras.distribution.LayoutMap:
    """keras-hub's Llama map pattern for a tiny zoo backbone (benchmarks/_hub_maps.py)."""
    return _hub_maps.llama_pattern_map(keras, backbone, mesh, TINY["hidden_dim"], VOCAB)


def random_map(backbone: keras.Model, mesh: Any, rng: np.random.Generator) -> keras.distribution.LayoutMap:
    """Every dim of every >= 2-D weight gets a mesh axis or None at random, each axis at most once
    per weight."""
    layout_map = keras.distribution.LayoutMap(mesh)
    for v in _distinct(backbone.weights):
        if len(v.shape) < 2:
            continue
        axes: list[str | None] = [None] * len(v.shape)
        for axis in mesh.axis_names:
            dim = int(rng.integers(0, len(v.shape) + 1))
            if dim < len(v.shape) and axes[dim] is None:
                axes[dim] = axis
        layout_map["^" + re.escape(v.path) + "$"] = tuple(axes)
    return layout_map


def trainable(backbone: keras.Model) -> keras.Model:
    """The backbone with one output (a seq2seq's decoder sequence, an encoder's sequence)."""
    out = backbone.output
    if isinstance(out, dict):
        key = next((k for k in ("decoder_sequence_output", "sequence_output") if k in out), sorted(out)[0])
        out = out[key]
    return keras.Model(backbone.inputs, out)


def _target(model: keras.Model, data) -> np.ndarray:
    out = keras.ops.convert_to_numpy(model(data))
    return np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)


def _train(model: keras.Model, data, target) -> list[float]:
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(data, target, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    return history.history["loss"]


def _held_axes(variable) -> tuple:
    specs = _variables.layout_of(variable._value).sharding_specs
    return tuple(None if s == dtensor.UNSHARDED else s for s in specs)


def distribute(name: str, mesh_shape: tuple[int, int], kind: str) -> keras.distribution.LayoutMap:
    """Sets the distribution of a case: ``kind``'s map (``llama`` or ``random``, seeded by the
    family's name) on a ``(batch, model)`` mesh of ``mesh_shape``; returns the map."""
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"])
    backbone = build(name)
    layout_map = (llama_pattern_map(backbone, mesh) if kind == "llama"
                  else random_map(backbone, mesh, np.random.default_rng(sum(map(ord, name)))))
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    return layout_map


def check(name: str, mesh_shape: tuple[int, int], kind: str) -> None:
    """Raises AssertionError where the family under the map differs from one device."""
    one = trainable(build(name))
    data = inputs_for(one)
    start = one.get_weights()
    target = _target(one, data)
    eager, predicted = keras.ops.convert_to_numpy(one(data)), one.predict(data, verbose=0)
    losses = _train(one, data, target)

    layout_map = distribute(name, mesh_shape, kind)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = trainable(build(name))
            model.set_weights(start)
            for v in model.weights:
                expected = layout_map[v.path]
                if expected is not None:
                    assert _held_axes(v) == tuple(expected.axes), (v.path, _held_axes(v), expected.axes)
            np.testing.assert_allclose(keras.ops.convert_to_numpy(model(data)), eager, atol=1e-4)
            np.testing.assert_allclose(model.predict(data, verbose=0), predicted, atol=1e-4)
            np.testing.assert_allclose(_train(model, data, target), losses, rtol=1e-4, atol=1e-5)
            for a, b in zip(one.get_weights(), model.get_weights()):
                np.testing.assert_allclose(b, a, atol=1e-4)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "zoo.weights.h5")
                model.save_weights(path)
                keras.distribution.set_distribution(None)
                loaded = trainable(build(name))
                loaded.load_weights(path)  # on one device
            for a, b in zip(one.get_weights(), loaded.get_weights()):
                np.testing.assert_allclose(b, a, atol=1e-4)
    finally:
        keras.distribution.set_distribution(None)


def causal_lm_of(name: str) -> type | None:
    """keras-hub's causal LM task of a backbone family (``LlamaBackbone`` -> ``LlamaCausalLM``)."""
    return getattr(keras_hub.models, name[: -len("Backbone")] + "CausalLM", None)


GENERATE_LENGTH = 12  # SEQ prompt positions of which the last 4 are generated


def _generated(lm: keras.Model, prompt: dict) -> np.ndarray:
    lm.compile(sampler="greedy")
    return np.asarray(lm.generate(prompt, max_length=GENERATE_LENGTH, stop_token_ids=None)["token_ids"])


def check_generate(name: str, mesh_shape: tuple[int, int], kind: str) -> None:
    """Greedy ``generate`` (the key/value cache, the sampling loop) under the map equals one device's
    tokens, from the same weights."""
    task = causal_lm_of(name)
    rng = np.random.default_rng(2)
    ids = rng.integers(1, VOCAB, (4, GENERATE_LENGTH)).astype("int32")
    mask = np.zeros_like(ids, dtype=bool)
    mask[:, : GENERATE_LENGTH - 4] = True  # the prompt; generate fills the rest
    prompt = {"token_ids": ids * mask, "padding_mask": mask}
    one = task(backbone=build(name), preprocessor=None)
    start = one.get_weights()
    want = _generated(one, prompt)

    layout_map = distribute(name, mesh_shape, kind)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lm = task(backbone=build(name), preprocessor=None)
            lm.set_weights(start)
            got = _generated(lm, prompt)
        np.testing.assert_array_equal(got, want)
    finally:
        keras.distribution.set_distribution(None)


def markdown_table(results: dict[str, str]) -> str:
    """Family x (mesh, map kind) table of ``main``'s results: ok, skipped or the failure."""
    columns = [f"{m}-{k}" for m in ("2x4", "4x2", "1x8") for k in ("llama", "random")]
    families: dict[str, dict[str, str]] = {}
    for case, result in results.items():
        name, mesh, kind = case.rsplit("-", 2)
        families.setdefault(name, {})[f"{mesh}-{kind}"] = result
    lines = ["| family | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name, row in sorted(families.items()):
        if all(v.startswith("skipped") for v in row.values()):
            lines.append(f"| {name} | " + " | ".join(["not built: " + next(iter(row.values()))[9:]] + [""] * 5) + " |")
            continue
        cells = ["ok" if row.get(c) == "ok" else ("fails" if c in row else "") for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(out: str, meshes: str = "2x4,4x2,1x8", kinds: str = "llama,random") -> None:
    """Every family x mesh x map kind; writes {case: "ok" or the first line of the failure}."""
    results = {}
    for name in backbones():
        config = tiny_config(name)
        for shape in [tuple(int(n) for n in m.split("x")) for m in meshes.split(",")]:
            for kind in kinds.split(","):
                case = f"{name}-{shape[0]}x{shape[1]}-{kind}"
                if isinstance(config, str):
                    results[case] = f"skipped: {config}"
                    continue
                began = time.perf_counter()
                try:
                    check(name, shape, kind)
                    results[case] = "ok"
                except Exception as e:  # noqa: BLE001  (a table of what fails, by family)
                    results[case] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                print(case, results[case], f"{time.perf_counter() - began:.0f} s", flush=True)
                with open(out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] in ("--case", "--generate"):  # one case, for a test that runs each in its own process
        (check if sys.argv[1] == "--case" else check_generate)(
            sys.argv[2], tuple(int(n) for n in sys.argv[3].split("x")), sys.argv[4])
        print("ZOO CASE OK")
    else:
        main(*sys.argv[1:])  # out.json [meshes, e.g. 2x4,4x2] [kinds, e.g. llama,random]
