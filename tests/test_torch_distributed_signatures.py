"""Every public class and function of torch.distributed that tfdist implements takes torch's
parameters, as ``inspect.signature`` shows them (what ``help()``, IDEs and notebooks show).
Reference: fixtures/torch_distributed_signatures.json, written by torch 2.13
(fixtures/generate_torch_distributed_signatures.py) for the names of the API documents tfdist
follows.

The rule: torch's positional parameters are tfdist's first ones, in torch's order; torch's
keyword-only ones are keywords tfdist takes; a parameter with a default in torch has one in tfdist;
a parameter tfdist adds has a default (so torch's calls bind unchanged)."""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest
from fixtures.qualnames import resolve

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TORCH = json.loads((FIXTURES / "torch_distributed_signatures.json").read_text())
DOCUMENTED = json.loads((FIXTURES / "torch_distributed_names.json").read_text())
# Constructors tfdist does not take from users, with why
DIFFERENT = {
    "torch.distributed.tensor.DTensor": "built by from_local/distribute_tensor; torch's own constructor is "
                                        "private to it too (local_tensor, spec)",
    "torch.distributed.pipelining.Pipe": "built by pipeline(); torch's takes a torch.fx GraphModule, which TF "
                                         "has no counterpart of (pipe.split_gm.submod_<i> is there)",
}
P = inspect.Parameter


def _tfdist(qualname: str):
    return resolve(qualname.replace("torch.distributed", "tfdist", 1))


CASES = sorted(q for q, p in TORCH["signatures"].items() if p is not None and q not in DIFFERENT)


@pytest.mark.parametrize("qualname", CASES)
def test_takes_torch_s_parameters(qualname):
    torch_params = [(n, getattr(P, kind), has_default) for n, kind, has_default in TORCH["signatures"][qualname]]
    if [k for _, k, _ in torch_params] == [P.VAR_POSITIONAL, P.VAR_KEYWORD]:
        return  # a protocol class: torch documents no constructor arguments
    ours = {p.name: p for p in inspect.signature(_tfdist(qualname)).parameters.values() if p.name != "self"}
    positional = [n for n, p in ours.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.POSITIONAL_ONLY)]
    want_positional = [n for n, k, _ in torch_params if k == P.POSITIONAL_OR_KEYWORD]
    assert positional[:len(want_positional)] == want_positional, (positional, want_positional)
    for name, kind, has_default in torch_params:
        if kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            assert any(p.kind == kind for p in ours.values()), f"tfdist takes no {name} ({kind.name})"
            continue
        assert name in ours, f"tfdist lacks torch's parameter {name!r}"
        if kind == P.KEYWORD_ONLY:
            assert ours[name].kind in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD), name
        if has_default:
            assert ours[name].default is not P.empty, f"{name!r} has a default in torch"
    torch_names = set(TORCH["torch_names"][qualname])  # torch's own, documented or not
    for name, p in ours.items():
        if name not in torch_names and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            assert p.default is not P.empty, f"tfdist's own parameter {name!r} needs a default"


def test_the_exceptions_are_still_exceptions():
    """If tfdist's constructor of one of DIFFERENT came to take torch's parameters, drop it there."""
    for qualname in DIFFERENT:
        names = [n for n in DOCUMENTED[qualname] if n != "*"]
        ours = list(inspect.signature(_tfdist(qualname)).parameters)
        assert ours[:len(names)] != names


def test_pipe_has_torch_s_attributes():
    import keras

    from tfdist.pipelining import SplitPoint, pipeline

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")])
    pipe = pipeline(model, (keras.ops.ones((2, 4)),), split_spec={"b": SplitPoint.BEGINNING})
    assert pipe.num_stages == 2 and pipe.has_loss_and_backward is False and pipe.loss_spec is None
    assert pipe.split_gm.submod_1 is pipe.get_stage_module(1)
