"""Every class and function torch.distributions exports shows torch's parameters to
``inspect.signature`` (what ``help()``, IDEs and notebooks show), and its ``Distribution`` methods
take torch's argument names.  Reference: fixtures/torch_signatures.json, written by torch 2.13
(fixtures/generate_torch_signatures.py)."""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest

from tfdist import distributions as D

TORCH = json.loads((pathlib.Path(__file__).parent / "fixtures" / "torch_signatures.json").read_text())


def _names(obj) -> list[list]:
    sig = inspect.signature(obj)
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in sig.parameters.values()
            if p.name != "self"]


# torch 2.13 added it after the API this project implements (torch's docs of the spec list no
# GeneralizedPareto); any other export torch has and tfdist lacks fails below
NOT_IN_SPEC = {"GeneralizedPareto"}


def test_every_torch_export_of_the_spec_is_there():
    assert {n for n in TORCH["exports"] if not hasattr(D, n)} == NOT_IN_SPEC


@pytest.mark.parametrize("name", sorted(n for n, p in TORCH["exports"].items() if p is not None and n not in NOT_IN_SPEC))
def test_export_has_torch_s_parameters(name):
    assert _names(getattr(D, name)) == TORCH["exports"][name]


@pytest.mark.parametrize("method", sorted(TORCH["Distribution methods"]))
def test_distribution_method_has_torch_s_parameters(method):
    assert _names(getattr(D.Distribution, method)) == TORCH["Distribution methods"][method]


@pytest.mark.parametrize("make, bad", [
    (lambda: D.Normal(0.0), "missing a required argument: 'scale'"),
    (lambda: D.Normal(0.0, 1.0, None, 3), "too many positional arguments"),
    (lambda: D.Poisson(rate=1.0, loc=2.0), "unexpected keyword argument 'loc'"),
    (lambda: D.Gumbel(scale=1.0), "missing a required argument: 'loc'"),
])
def test_a_wrong_argument_is_a_type_error_naming_it(make, bad):
    with pytest.raises(TypeError, match=bad):
        make()


def test_keywords_and_positions_bind_as_torch_s():
    a = D.Normal(scale=2.0, loc=1.0, validate_args=False)
    b = D.Normal(1.0, 2.0)
    assert float(a.loc) == float(b.loc) == 1.0 and float(a.scale) == float(b.scale) == 2.0
    assert float(D.Poisson(3.0).rate) == float(D.Poisson(rate=3.0).rate) == 3.0
