"""format_utils: checkpoints to and from TF bundles, safetensors and Keras .weights.h5.

Reference: the numpy arrays the values were made from, and the safetensors
package / tf.train.load_checkpoint reading the converted files on their own.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
import tfdist.checkpoint as dcp
from keras_helpers import no_global_distribution  # noqa: F401
from tfdist.checkpoint import format_utils as fu
from tfdist.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tfdist.tensor import Shard, distribute_tensor

RNG = np.random.default_rng(5)
W = RNG.standard_normal((6, 10)).astype(np.float32)
B = RNG.standard_normal(10).astype(np.float32)


def sharded_checkpoint(path):
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    dcp.save({"model": {"w": distribute_tensor(W, mesh, [Shard(0), Shard(1)]), "b": tf.constant(B),
                        "h": tf.cast(W, tf.bfloat16)}, "step": 4}, checkpoint_id=path)


def test_tf_checkpoint_round_trip(tmp_path):
    sharded_checkpoint(tmp_path / "dcp")
    fu.dcp_to_tf_checkpoint(tmp_path / "dcp", tmp_path / "tf" / "ckpt")
    reader = tf.train.load_checkpoint(str(tmp_path / "tf" / "ckpt"))
    np.testing.assert_array_equal(reader.get_tensor("model.w"), W)
    np.testing.assert_array_equal(reader.get_tensor("model.b"), B)
    fu.tf_checkpoint_to_dcp(tmp_path / "tf" / "ckpt", tmp_path / "back")
    sd = {"model": {"w": np.zeros_like(W), "b": np.zeros_like(B)}}
    dcp.load(sd, checkpoint_id=tmp_path / "back", planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    np.testing.assert_array_equal(sd["model"]["w"], W)


def test_safetensors_round_trip_with_objects_and_bfloat16(tmp_path):
    from safetensors import safe_open

    sharded_checkpoint(tmp_path / "dcp")
    fu.dcp_to_safetensors(tmp_path / "dcp", tmp_path / "m.safetensors", name_map=lambda k: k.removeprefix("model."))
    with safe_open(str(tmp_path / "m.safetensors"), framework="tf") as f:
        assert sorted(f.keys()) == ["b", "h", "w"]
        np.testing.assert_array_equal(f.get_tensor("w").numpy(), W)
        assert f.get_tensor("h").dtype == tf.bfloat16
    fu.safetensors_to_dcp(tmp_path / "m.safetensors", tmp_path / "back")
    mesh = tfdist.init_device_mesh("cpu", (8,))
    sd = {"w": distribute_tensor(np.zeros_like(W), mesh, [Shard(1)]), "h": tf.zeros((6, 10), tf.bfloat16),
          "step": 0}
    dcp.load(sd, checkpoint_id=tmp_path / "back")
    np.testing.assert_array_equal(sd["w"].numpy(), W)
    np.testing.assert_array_equal(sd["h"].numpy(), tf.cast(W, tf.bfloat16).numpy())
    assert sd["step"] == 4


def test_torch_style_safetensors_into_a_keras_model(tmp_path):
    from safetensors.numpy import save_file

    # what torch's nn.Linear(6, 10) named "fc" writes: weight [out, in], bias [out]
    save_file({"fc.weight": W.T.copy(), "fc.bias": B}, str(tmp_path / "torch.safetensors"))
    fu.safetensors_to_dcp(tmp_path / "torch.safetensors", tmp_path / "dcp",
                          name_map={"fc.weight": "dense.kernel", "fc.bias": "dense.bias"},
                          transform=lambda k, v: v.T if k.endswith(".weight") else v)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(10, name="dense")])
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=tmp_path / "dcp")
    from tfdist.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, sd)
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(model(x).numpy(), x @ W + B, rtol=1e-5)  # torch: x @ weight.T + bias


def test_keras_weights_round_trip(tmp_path):
    def make():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(10, name="dense")])

    source = make()
    source.get_layer("dense").kernel.assign(W)
    source.save_weights(str(tmp_path / "a.weights.h5"))
    fu.keras_weights_to_dcp(tmp_path / "a.weights.h5", make(), tmp_path / "dcp", prefix="model.")
    assert set(fu.read_full_state_dict(tmp_path / "dcp")) == {"model.dense.kernel", "model.dense.bias"}
    target = make()
    fu.dcp_to_keras_weights(tmp_path / "dcp", make(), tmp_path / "b.weights.h5", prefix="model.")
    target.load_weights(str(tmp_path / "b.weights.h5"))
    np.testing.assert_array_equal(target.get_layer("dense").kernel.numpy(), W)
    full = get_model_state_dict(target, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    np.testing.assert_array_equal(full["dense.kernel"], W)


def test_bad_names_are_refused(tmp_path):
    sharded_checkpoint(tmp_path / "dcp")
    with pytest.raises(ValueError, match="two keys"):
        fu.dcp_to_safetensors(tmp_path / "dcp", tmp_path / "x.safetensors", name_map=lambda k: "same")
