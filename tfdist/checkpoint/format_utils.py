"""Converting checkpoints to and from other formats (torch.distributed.checkpoint.format_utils).

* ``dcp_to_tf_checkpoint`` / ``tf_checkpoint_to_dcp``: one whole-tensor TF
  bundle (what ``tf.train.load_checkpoint`` reads), for tools that expect a
  plain TensorFlow checkpoint.
* ``dcp_to_safetensors`` / ``safetensors_to_dcp``: one safetensors file, the
  format torch and Hugging Face users hand weights over in (read and written
  with the ``safetensors`` package, ``pip install tfdist[formats]``).
  ``name_map`` renames keys (a dict or a function returning the new name, or
  None to drop the key) and ``transform`` rewrites values (torch's ``Linear``
  stores ``[out, in]``, Keras's ``Dense`` ``[in, out]``: transpose there).
* ``dcp_to_keras_weights`` / ``keras_weights_to_dcp``: Keras ``.weights.h5``
  files, through a model of the right architecture.
* torch's own: ``dcp_to_torch_save`` / ``torch_save_to_dcp``, and
  ``BroadcastingTorchSaveReader`` with ``DynamicMetaLoadPlanner`` to load a
  ``torch.save`` file straight into sharded values (need torch:
  ``pip install tfdist[torch]``).

These run in one process and hold whole tensors in host memory: they are for
hand-over between formats, not for training-time saves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf

from tfdist.checkpoint import _tf_io
from tfdist.checkpoint._whole import read_full_state_dict
from tfdist.checkpoint._torch_save import (
    BroadcastingTorchSaveReader, DynamicMetaLoadPlanner, dcp_to_torch_save, torch_save_to_dcp,
)
from tfdist.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from tfdist.checkpoint.state_dict_loader import load
from tfdist.checkpoint.state_dict_saver import save

__all__ = [
    "dcp_to_tf_checkpoint", "tf_checkpoint_to_dcp", "dcp_to_safetensors", "safetensors_to_dcp",
    "dcp_to_keras_weights", "keras_weights_to_dcp", "read_full_state_dict",
    "dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner",
]

NameMap = Mapping[str, str] | Callable[[str], "str | None"] | None
Transform = Callable[[str, np.ndarray], np.ndarray] | None


def _rename(name: str, name_map: NameMap) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def _mapped(state: Mapping[str, Any], name_map: NameMap, transform: Transform) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        new = _rename(key, name_map)
        if new is None:
            continue
        if new in out:
            raise ValueError(f"name_map sends two keys to {new!r}; each target name must be unique.")
        if transform is not None and isinstance(value, (tf.Tensor, np.ndarray)):
            value = transform(key, np.asarray(value))
        out[new] = value
    return out


def _save_whole(state: dict[str, Any], dcp_checkpoint_dir: str | os.PathLike) -> None:
    save(state, checkpoint_id=dcp_checkpoint_dir, no_dist=True)


def dcp_to_tf_checkpoint(dcp_checkpoint_dir: str | os.PathLike, tf_checkpoint_prefix: str | os.PathLike) -> None:
    """Writes every tensor of a checkpoint, whole, into one TF bundle (``<prefix>.index``/``.data-*``).

    Example::

        dcp_to_tf_checkpoint("/tmp/ckpt", "/tmp/plain/model")
        tf.train.load_checkpoint("/tmp/plain/model").get_tensor("model.dense.kernel")
    """
    state = {k: v for k, v in read_full_state_dict(dcp_checkpoint_dir).items() if isinstance(v, tf.Tensor)}
    if not state:
        raise ValueError(f"dcp_to_tf_checkpoint: {dcp_checkpoint_dir} holds no tensors.")
    os.makedirs(os.path.dirname(os.fspath(tf_checkpoint_prefix)) or ".", exist_ok=True)
    _tf_io.write_bundle(os.fspath(tf_checkpoint_prefix), list(state), [""] * len(state), list(state.values()))


def tf_checkpoint_to_dcp(tf_checkpoint_prefix: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike,
                         name_map: NameMap = None) -> None:
    """Reads every tensor of a TF checkpoint (``tf.train.Checkpoint`` or a bundle) into a checkpoint.

    Example::

        tf_checkpoint_to_dcp("/tmp/plain/model", "/tmp/ckpt")
    """
    reader = tf.train.load_checkpoint(os.fspath(tf_checkpoint_prefix))
    state = {name: tf.convert_to_tensor(reader.get_tensor(name))
             for name in sorted(reader.get_variable_to_shape_map()) if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}
    _save_whole(_mapped(state, name_map, None), dcp_checkpoint_dir)


def dcp_to_safetensors(dcp_checkpoint_dir: str | os.PathLike, safetensors_path: str | os.PathLike,
                       name_map: NameMap = None, transform: Transform = None) -> None:
    """Writes a checkpoint's tensors into one safetensors file; JSON-able objects go into its metadata.

    Example::

        dcp_to_safetensors("/tmp/ckpt", "/tmp/model.safetensors",
                           name_map=lambda k: k.removeprefix("model."))
    """
    from safetensors.tensorflow import save_file

    state = _mapped(read_full_state_dict(dcp_checkpoint_dir), name_map, transform)
    tensors = {k: tf.convert_to_tensor(v) for k, v in state.items() if isinstance(v, (tf.Tensor, np.ndarray))}
    extra = {}
    for k, v in state.items():
        if k not in tensors:
            try:
                extra[k] = json.dumps(v)
            except TypeError:
                raise ValueError(f"dcp_to_safetensors: {k!r} is a {type(v).__name__}, which safetensors cannot hold "
                                 "(only tensors, and JSON-able objects in its metadata); drop it with name_map.") \
                    from None
    save_file(tensors, os.fspath(safetensors_path), metadata={"tfdist.objects": json.dumps(extra)})


def safetensors_to_dcp(safetensors_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike,
                       name_map: NameMap = None, transform: Transform = None) -> None:
    """Reads a safetensors file (e.g. a torch model's weights) into a checkpoint.

    Example (a torch ``nn.Linear`` named ``fc`` onto a Keras ``Dense`` named ``dense``)::

        safetensors_to_dcp("model.safetensors", "/tmp/ckpt",
                           name_map={"fc.weight": "dense.kernel", "fc.bias": "dense.bias"},
                           transform=lambda k, v: v.T if k.endswith(".weight") else v)
    """
    from safetensors import safe_open
    from safetensors.tensorflow import load_file

    state: dict[str, Any] = dict(load_file(os.fspath(safetensors_path)))
    with safe_open(os.fspath(safetensors_path), framework="numpy") as f:
        meta = f.metadata() or {}
    for k, v in json.loads(meta.get("tfdist.objects", "{}")).items():
        state[k] = json.loads(v)
    state = _mapped(state, name_map, transform)
    _save_whole({k: tf.convert_to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in state.items()},
                dcp_checkpoint_dir)


def dcp_to_keras_weights(dcp_checkpoint_dir: str | os.PathLike, model: Any, weights_path: str | os.PathLike,
                         prefix: str = "") -> None:
    """Loads a checkpoint's model weights (keys ``prefix + canonical name``) into ``model`` and writes
    ``model.save_weights(weights_path)`` (a ``.weights.h5`` file).

    Example::

        dcp_to_keras_weights("/tmp/ckpt", make_model(), "/tmp/model.weights.h5", prefix="model.")
    """
    sd = get_model_state_dict(model)
    wrapped = {prefix + k: v for k, v in sd.items()}
    load(wrapped, checkpoint_id=dcp_checkpoint_dir, no_dist=True)
    set_model_state_dict(model, {k[len(prefix):]: v for k, v in wrapped.items()})
    model.save_weights(os.fspath(weights_path))


def keras_weights_to_dcp(weights_path: str | os.PathLike, model: Any, dcp_checkpoint_dir: str | os.PathLike,
                         prefix: str = "") -> None:
    """Reads a ``.weights.h5`` file into ``model`` and saves its weights as a checkpoint (keys
    ``prefix + canonical name``).

    Example::

        keras_weights_to_dcp("/tmp/model.weights.h5", make_model(), "/tmp/ckpt", prefix="model.")
    """
    model.load_weights(os.fspath(weights_path))
    _save_whole({prefix + k: v for k, v in get_model_state_dict(model).items()}, dcp_checkpoint_dir)
