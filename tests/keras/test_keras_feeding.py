"""Host batches -> sharded DTensors (tfdist/keras/_data.py): one split per tensor, by data-parallel coordinate.

Reference: numpy's split of the batch; on a 2x4 (dp, tp) mesh the 4 tp devices of a dp row share a piece.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfdist
from tfdist.keras import _data


def test_a_2x4_mesh_slices_each_batch_tensor_twice_not_eight_times(monkeypatch):
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    packed_blocks = []
    pack = _data._pack_blocks

    def spy(blocks, *layout):
        packed_blocks.append(list(blocks))
        return pack(blocks, *layout)

    monkeypatch.setattr(_data, "_pack_blocks", spy)
    out = _data.shard_batch({"x": tf.constant(x)}, mesh, 0)["x"]
    (blocks,) = packed_blocks
    assert len(blocks) == 8 and len({id(b) for b in blocks}) == 2  # one piece per dp coordinate
    want = np.split(x, 2)
    for device_block, coord in zip(dtensor.unpack(out), mesh.local_coordinates()):
        np.testing.assert_array_equal(device_block.numpy(), want[coord[0]])


def test_a_batch_that_does_not_split_is_replicated():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = np.arange(5 * 2, dtype=np.float32).reshape(5, 2)
    out = _data.shard_batch(tf.constant(x), mesh, 0)
    assert dtensor.fetch_layout(out).is_fully_replicated()
    np.testing.assert_array_equal(_data.gather_to_numpy(out), x)


def _batches(*sizes, width=3):
    """A tf.data dataset of batches of the given sizes, rows numbered 0, 1, 2, ... (x) and x * 10 (y)."""
    rows = np.arange(sum(sizes) * width, dtype=np.float32).reshape(-1, width)
    ends = np.cumsum(sizes)
    xs = [rows[e - s:e] for s, e in zip(sizes, ends)]
    ds = tf.data.Dataset.from_generator(lambda: ((x, x * 10) for x in xs),
                                        output_signature=(tf.TensorSpec((None, width), tf.float32),) * 2)
    return ds, xs


def test_the_feed_splits_in_tf_data_and_places_by_coordinate(monkeypatch):
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    ds, xs = _batches(16, 8, 5)
    source = iter(ds)
    packed = []
    pack = _data._pack_blocks
    monkeypatch.setattr(_data, "_pack_blocks", lambda blocks, *layout: packed.append(list(blocks)) or pack(blocks, *layout))
    feed = _data.BatchFeed(source, mesh, 0, fresh=True)
    assert feed.taken_over
    got = list(feed)
    assert [even for _, even in got] == [True, True, False]  # 5 rows do not split over dp=2
    for (x, y), even_rows in zip((b for b, _ in got[:2]), xs[:2]):
        for t, want in ((x, even_rows), (y, even_rows * 10)):
            want_pieces = np.split(want, 2)
            for block, coord in zip(dtensor.unpack(t), mesh.local_coordinates()):
                np.testing.assert_array_equal(block.numpy(), want_pieces[coord[0]])
    assert all(len(blocks) == 8 and len({id(b) for b in blocks}) == 2 for blocks in packed[:4])
    x, y = got[2][0]  # the partial batch: whole, replicated, no padding row
    assert dtensor.fetch_layout(x).is_fully_replicated()
    np.testing.assert_array_equal(_data.gather_to_numpy(x), xs[2])
    np.testing.assert_array_equal(_data.gather_to_numpy(y), xs[2] * 10)
    assert len(list(source)) == 3  # Keras' own iterator (and its autotuner) never advanced


def test_packing_a_batch_equals_dtensor_pack(monkeypatch):
    """The feed's pack (the kernel ``dtensor.pack`` calls, with the layout printed once) gives
    what ``dtensor.pack`` gives -- layout and every device's block; the first pack of a layout
    on a DTensor device goes through ``dtensor.pack``, which registers the mesh there."""
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    pieces = tf.split(tf.constant(x), 2)
    layout, text = _data._batch_layout(mesh, 0, 2)
    blocks = [pieces[c[0]] for c in mesh.local_coordinates()]
    want = dtensor.pack(blocks, layout)
    through_pack = []
    pack = dtensor.pack
    monkeypatch.setattr(_data, "_REGISTERED", {})  # as on a DTensor device that never saw the layout
    monkeypatch.setattr(_data.dtensor, "pack", lambda *a: through_pack.append(1) or pack(*a))
    for _ in range(3):
        got = _data._pack_blocks(blocks, layout, text)
        assert dtensor.fetch_layout(got) == layout
        for g, w in zip(dtensor.unpack(got), dtensor.unpack(want)):
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert float(tf.reduce_sum(got)) == float(x.sum())  # an op on the mesh takes it
    assert through_pack == [1]


def test_the_feed_places_dicts_scalars_and_nests_in_their_structure():
    """A dict batch with a nested tuple and a per-batch scalar comes out of the flat staged
    pipeline in its own structure: batched leaves sharded, the scalar replicated; reference:
    numpy's split of the rows."""
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    rows = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    ds = tf.data.Dataset.from_tensor_slices(rows).batch(4).map(
        lambda r: {"z": (r, r[:, :1] * 2.0), "a": tf.cast(tf.shape(r)[0], tf.float32)})
    feed = _data.BatchFeed(iter(ds), mesh, 0, fresh=True)
    assert feed.taken_over
    got = list(feed)
    assert len(got) == 3 and all(even for _, even in got)
    for i, (batch, _) in enumerate(got):
        assert sorted(batch) == ["a", "z"]
        assert dtensor.fetch_layout(batch["a"]).is_fully_replicated() and float(batch["a"]) == 4.0
        want = rows[4 * i:4 * i + 4]
        for t, w in ((batch["z"][0], want), (batch["z"][1], want[:, :1] * 2.0)):
            pieces = np.split(w, 2)
            for block, coord in zip(dtensor.unpack(t), mesh.local_coordinates()):
                np.testing.assert_array_equal(block.numpy(), pieces[coord[0]])


def test_the_feed_leaves_iterators_it_cannot_extend_alone():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    ds, xs = _batches(8, 8)
    started = iter(ds)
    next(started)  # already advanced: its dataset would replay the first batch
    feed = _data.BatchFeed(started, mesh, 0, fresh=False)
    assert not feed.taken_over
    ((x, _), even), = list(feed)
    assert even
    np.testing.assert_array_equal(_data.gather_to_numpy(x), xs[1])
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]])).batch(2)
    assert not _data.BatchFeed(iter(ragged), mesh, 0, fresh=True).taken_over
    assert not _data.BatchFeed(iter(ds), mesh, None, fresh=True).taken_over  # no batch dim: replicated


def test_the_feed_runs_without_the_tf_data_autotuner():
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    ds, _ = _batches(8)
    feed = _data.BatchFeed(iter(ds), mesh, 0, fresh=True)
    assert feed._iterator._dataset.options().autotune.enabled is False


def test_fit_and_evaluate_feed_every_epoch_through_tf_data(monkeypatch):
    import keras

    from keras_helpers import make_mlp

    feeds = []
    init = _data.BatchFeed.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        feeds.append(self)

    monkeypatch.setattr(_data.BatchFeed, "__init__", spy)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        model = make_mlp()
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((40, 16), np.float32)
        model.fit(x, x[:, :8], batch_size=16, epochs=2, validation_data=(x, x[:, :8]), verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    assert len(feeds) == 4 and all(f.taken_over for f in feeds)  # 2 epochs x (train, validation)


def test_placing_the_next_batch_early_changes_neither_batches_nor_order():
    """place_next (called by fit right after dispatching a step) hands over the same batches, in
    the same order, and the end of the data, as plain iteration; reference: numpy's rows."""
    mesh = tfdist.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    ds, xs = _batches(16, 8, 5)
    feed = _data.BatchFeed(iter(ds), mesh, 0, fresh=True)
    got = []
    for _ in range(3):
        feed.place_next()
        feed.place_next()  # twice in a row takes no second batch
        got.append(next(feed))
    feed.place_next()  # past the end: the end is kept for the next call
    for _ in range(2):
        try:
            next(feed)
            raise AssertionError("the feed went past the end of its data")
        except StopIteration:
            pass
    assert [even for _, even in got] == [True, True, False]
    for ((x, y), _), want in zip(got, xs):
        np.testing.assert_array_equal(_data.gather_to_numpy(x), want)
        np.testing.assert_array_equal(_data.gather_to_numpy(y), want * 10)


def test_fit_places_the_next_batch_before_keras_reads_the_logs(monkeypatch):
    """During fit, batch k+1 is already placed when Keras' callbacks get the logs of batch k."""
    import keras

    from keras_helpers import make_mlp

    placed = []
    place = _data.BatchFeed._next_placed
    monkeypatch.setattr(_data.BatchFeed, "_next_placed", lambda self: placed.append(1) or place(self))
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(len(placed))

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        model = make_mlp()
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((64, 16), np.float32)
        model.fit(x, x[:, :8], batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[Seen()])
    finally:
        keras.distribution.set_distribution(None)
    assert seen == [2, 3, 4, 5]  # at the end of batch k (from 0), batches 0..k+1 are placed; the 5th: the end
