"""The package's shape: imports run one way, and every change to Keras/TF internals is on record."""

from __future__ import annotations

import ast
import pathlib
import threading

import numpy as np
import pytest
import tensorflow as tf

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfdist"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.append((base, node.lineno, id(node) in top))
            out += [(f"{base}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


MODULES = _modules()


def test_tensor_never_imports_keras():
    bad = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items() if name.startswith("tfdist.tensor")
        for target, line, _ in _imports(path, name)
        if target == "keras" or target.startswith(("keras.", "tfdist.keras", "tfdist.models"))
    ]
    assert not bad, bad


def test_a_second_framework_needs_no_change_to_tensor_or_fsdp():
    """The proof of the seam is tests/test_second_backend.py: parallelize_module and fully_shard on
    plain tf.Modules through their own ModuleBackend; this checks that backend imports no Keras."""
    source = (pathlib.Path(__file__).parent / "tfmodule_backend.py").read_text()
    imported = {t for t, _, _ in _imports(pathlib.Path(__file__).parent / "tfmodule_backend.py", "tfmodule_backend")}
    assert not any(t == "keras" or t.startswith(("keras.", "tfdist.keras")) for t in imported), imported
    assert "register_module_backend(" in source


def test_private_keras_names_are_imported_in_one_module():
    """Every ``keras.src`` import is in ``tfdist/keras/_keras_internals.py`` (wrapped methods are
    the patch table's rows, named by path, not imported)."""
    bad = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items() if name != "tfdist.keras._keras_internals"
        for target, line, _ in _imports(path, name)
        if target == "keras.src" or target.startswith("keras.src.")
    ]
    assert not bad, bad


def test_no_import_cycles_between_tfdist_modules():
    graph = {
        name: {t for t, _, _ in _imports(path, name) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }
    # a package's __init__ re-exporting its children is not a dependency of the children on it
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_function_local_imports_of_tfdist_say_why():
    """Local imports between tfdist modules only keep imports light, and a ``# lazy`` comment says so."""
    bad = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.split("\n")
        functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for target, line, top in _imports(path, name):
            if top or not target.startswith("tfdist"):
                continue
            start = max((f.lineno for f in functions if f.lineno <= line <= f.end_lineno), default=line)
            if not any("# lazy" in lines[i - 1] for i in range(start, line + 1)):
                bad.append(f"{name}:{line} {lines[line - 1].strip()}")
    assert not bad, sorted(set(bad))


def test_import_tfdist_tensor_parallel_does_not_import_keras(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, tfdist.tensor.parallel, tfdist.tensor.experimental, tfdist.tensor.debug\n"
        "print(sorted(m for m in sys.modules if m.startswith('tfdist.keras')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- the patch table ------------------------------------------------------------------
def test_every_patch_fits_this_keras():
    import tfdist.keras  # noqa: F401  (installs the process-wide rows)
    from tfdist import _patches

    problems = [p for p in (_patches.verify(row) for row in _patches.PATCHES) if p]
    assert not problems, problems


def test_process_patches_are_installed_and_with_patches_are_not():
    import inspect
    import importlib

    import tfdist.keras  # noqa: F401
    from tfdist import _patches

    missing = object()
    for row in _patches.PATCHES:
        holder = importlib.import_module(row.module)
        if row.owner:
            holder = getattr(holder, row.owner)
        if isinstance(holder, dict):  # a registry: the row's attribute is its key
            current = holder.get(row.attribute, missing)
            current = _patches._MISSING if current is missing else current
        elif row.owner:
            current = inspect.getattr_static(holder, row.attribute)
        else:
            current = getattr(holder, row.attribute)
        if row.scope == "process":
            assert current is not _patches.original(row.name), row.name
        else:
            assert current is _patches.original(row.name), f"{row.name} is changed outside its with block"


def test_patching_an_unlisted_attribute_is_refused():
    from tfdist import _patches

    with pytest.raises(KeyError, match="not in tfdist._patches.PATCHES"):
        _patches.install("keras.src.layers.layer:Layer.call", lambda *a: None)


def test_untested_keras_version_fails_clearly(monkeypatch):
    import keras

    from tfdist import _patches

    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.delenv("TFDIST_ALLOW_UNTESTED_VERSIONS", raising=False)
    with pytest.raises(ImportError, match=r"keras 3\.99\.0 is installed.*TFDIST_ALLOW_UNTESTED_VERSIONS"):
        _patches.check_versions()
    monkeypatch.setenv("TFDIST_ALLOW_UNTESTED_VERSIONS", "1")
    _patches.check_versions()


def test_a_renamed_internal_is_reported(monkeypatch):
    from tfdist import _patches

    row = _patches.Patch("keras.src.layers.layer", "Layer", "no_such_method", ("self",), "process", "test")
    assert "no longer exists" in _patches.verify(row)
    row = _patches.Patch("keras.src.layers.layer", "Layer", "add_weight", ("self", "shape"), "process", "test")
    assert "parameters are" in _patches.verify(row)


def _cross_entropy_ops() -> set[str]:
    """Op types of a freshly traced sparse cross-entropy."""
    fn = tf.function(lambda lab, lg: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=lab, logits=lg))
    graph = fn.get_concrete_function(tf.TensorSpec([2], tf.int32), tf.TensorSpec([2, 3])).graph
    return {op.type for op in graph.get_operations()}


def test_loss_parallel_changes_only_the_entering_thread():
    """Inside the block the sharded formula (one-hot product) is traced; another thread
    meanwhile traces TF's fused kernel; after the block TF's function is back."""
    from tfdist.tensor.parallel import loss_parallel

    original = tf.nn.sparse_softmax_cross_entropy_with_logits
    inside_entered, other_done = threading.Event(), threading.Event()
    seen: dict[str, set[str]] = {}

    def other():
        inside_entered.wait(30)
        try:
            seen["other"] = _cross_entropy_ops()
        finally:
            other_done.set()

    worker = threading.Thread(target=other)
    worker.start()
    with loss_parallel():
        inside_entered.set()
        other_done.wait(30)
        seen["inside"] = _cross_entropy_ops()
        logits = tf.constant([[1.0, 2.0, 3.0]])
        value = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant([1]), logits=logits)
    worker.join()
    assert "OneHot" in seen["inside"] and "SparseSoftmaxCrossEntropyWithLogits" not in seen["inside"]
    assert "SparseSoftmaxCrossEntropyWithLogits" in seen["other"]
    want = np.log(np.exp([1.0, 2.0, 3.0]).sum()) - 2.0  # -log softmax(logits)[1], by hand
    np.testing.assert_allclose(value.numpy(), [want], rtol=1e-6)
    assert tf.nn.sparse_softmax_cross_entropy_with_logits is original
    assert "SparseSoftmaxCrossEntropyWithLogits" in _cross_entropy_ops()


# -- the registry of module state -------------------------------------------------------
def test_no_tfdist_attributes_on_other_peoples_objects():
    """State tfdist keeps about Keras/TF objects lives in tfdist._registry: no ``_tfdist_*``
    attribute is written, read or declared anywhere in the package."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            attr = None
            if isinstance(node, ast.Attribute):
                attr = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                attr = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                attr = node.target.id
            if attr and attr.startswith("_tfdist_"):
                bad.append(f"{name}:{node.lineno} {attr}")
    assert not bad, bad


def test_registry_keeps_state_off_the_object_and_drops_it_with_the_object():
    import gc

    import keras

    from tfdist import _registry

    layer = keras.layers.Dense(2)
    before = set(vars(layer))
    _registry.module(layer).batch_dim = "dp"
    assert _registry.module_if_any(layer).batch_dim == "dp"
    assert set(vars(layer)) == before  # nothing written onto the Keras object
    variable = tf.Variable([1.0])  # unhashable: keyed by identity
    _registry.variable(variable).layout_fn = len
    assert _registry.variable_if_any(variable).layout_fn is len
    assert _registry.module_if_any(keras.layers.Dense(2)) is None  # reading creates nothing
    count = len(_registry._MODULES)
    del layer
    gc.collect()
    assert len(_registry._MODULES) == count - 1


def test_a_plain_model_runs_kerass_own_code_with_tfdist_imported():
    """The same plain Keras program (fit with dropout and attention, an eager call, an eager tape, a
    plain tf.function) in two fresh processes, without and with ``import tfdist.keras``: the same
    traced graph (op counts), losses, outputs and gradients -- tfdist's process-wide rows hand
    calls they do not distribute to Keras' and TF's own code."""
    import json
    import os
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "plain" / "plain_model_run.py"
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    runs = [subprocess.Popen([sys.executable, str(script), *flag], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for flag in ([], ["--with-tfdist"])]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    without, with_tfdist = results
    assert with_tfdist == without
    assert "StatelessRandomUniformV2" in without["call_graph_ops"]  # Keras' own dropout draw was traced


# -- the framework seam --------------------------------------------------------------------
_KERAS_ATTRIBUTES = {"kernel", "bias", "activation", "compute_dtype", "lora_enabled", "quantization_mode",
                     "_learning_rate", "equation", "bias_axes", "input_dim", "trainable"}


def test_tensor_fsdp_checkpoint_and_pipelining_read_no_keras_attribute():
    """What tensor/, fsdp/, checkpoint/ and pipelining/ need of a layer or optimizer comes through the
    ModuleBackend (LayerKind, weights(), optimizer_scalars()), not from Keras attributes."""
    bad = []
    for name, path in MODULES.items():
        if not name.startswith(("tfdist.tensor", "tfdist.fsdp", "tfdist.checkpoint", "tfdist.pipelining")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _KERAS_ATTRIBUTES \
                    and isinstance(node.value, ast.Name) and node.value.id in ("layer", "optim", "optimizer", "module", "variable", "v"):
                bad.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in _KERAS_ATTRIBUTES:
                bad.append(f"{name}:{node.lineno} getattr(..., {node.args[1].value!r})")
    assert not bad, bad


def test_one_dense_equation():
    """The dense product's einsum is written once (LayerKind.equation_for), not at each call site."""
    spelled = [name for name, path in MODULES.items() if '"abcdefghijlmopqrsuvwxy"' in path.read_text()]
    assert spelled == ["tfdist.tensor._modules"], spelled
    from tfdist.tensor._modules import LayerKind

    assert LayerKind("dense").equation_for(3) == "abk,kn->abn"
    assert LayerKind("einsum", equation="bd,dhk->bhk").einsum_parts() == ("bd", "dhk", "bhk")


def test_what_design_md_says_about_the_code_is_true():
    """docs/design.md's countable claims: the patch table's rows, the modules that swap a class,
    and that ``keras.src`` is imported in one module (the test above checks the last)."""
    import re

    from tfdist import _patches

    design = " ".join((PACKAGE.parent / "docs" / "design.md").read_text().split())
    rows = re.search(r"The patch table\*\* \(`tfdist/_patches.py`, (\d+) rows\)", design)
    assert rows and int(rows.group(1)) == len(_patches.PATCHES)
    claim = re.search(r"`__class__` is assigned in (.*?) only\.", design)
    named = set(re.findall(r"`([\w/]+\.py)`", claim.group(1)))
    swapping = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                if re.search(r"\.__class__ = ", path.read_text())}
    assert named == swapping
    assert "`keras.src` import outside `tfdist/keras/_keras_internals.py`" in design
