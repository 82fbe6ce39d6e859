"""log_prob / sample throughput: tfdist.distributions vs raw TFP on the same inputs.

Run: python benchmarks/distributions.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_probability as tfp  # noqa: E402

from _common import print_table, time_call, write_results  # noqa: E402
from tfdist import distributions as D  # noqa: E402

N = 1_000_000
tfd = tfp.distributions


def cases():
    x_real = tf.constant(np.random.default_rng(0).standard_normal(N), tf.float32)
    x_pos = tf.abs(x_real) + 0.1
    ids = tf.constant(np.random.default_rng(1).integers(0, 10, N))
    logits = tf.zeros(10)
    return [
        ("Normal", D.Normal(0.5, 2.0), tfd.Normal(0.5, 2.0), x_real),
        ("Gamma", D.Gamma(2.0, 3.0), tfd.Gamma(2.0, 3.0), x_pos),
        ("Categorical", D.Categorical(logits=logits), tfd.Categorical(logits=logits), ids),
    ]


def main() -> None:
    rows = []
    sync = lambda t: t.numpy()  # noqa: E731
    for name, ours, theirs, x in cases():
        ours_lp = tf.function(lambda v, d=ours: d.log_prob(v))
        theirs_lp = tf.function(lambda v, d=theirs: d.log_prob(tf.cast(v, d.dtype) if name == "Categorical" else v))
        ours_s = tf.function(lambda d=ours: d.sample((N,)))
        theirs_s = tf.function(lambda d=theirs: d.sample(N))
        t = {
            "log_prob": (time_call(lambda: ours_lp(x), sync), time_call(lambda: theirs_lp(x), sync)),
            "sample": (time_call(ours_s, sync), time_call(theirs_s, sync)),
        }
        for op, (a, b) in t.items():
            rows.append({"distribution": name, "op": op, "tfdist_ms": round(a, 2), "tfp_ms": round(b, 2),
                         "ratio": round(a / b, 3)})
    path = write_results("distributions", rows, {"n": N})
    print_table(rows, ["distribution", "op", "tfdist_ms", "tfp_ms", "ratio"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
