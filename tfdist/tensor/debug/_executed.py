"""What TF DTensor ran for a traced program: the SPMD-expanded functions it keeps in the eager
context (``<traced name>__func_<hash>``) and the functions they call, node by node.

Used to check properties of the executed program that the traced graph cannot show, such as
where TF's all-reduce combiner slices each tensor back out of its packed buffer.
"""

from __future__ import annotations

from typing import Iterator

import tensorflow as tf
from tensorflow.python.eager import context

__all__ = ["function_nodes", "executed_nodes", "combined_all_reduce_pieces", "partition_graphs"]


def function_nodes(names: list[str]) -> Iterator[tuple[dict, object]]:
    """(nodes of its function by name, node) for every node of the functions ``names`` kept in
    the eager context and of every function they call (calls, control flow), each once."""
    ctx = context.context()
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen or not ctx.has_function(name):
            continue
        seen.add(name)
        nodes = ctx.get_function_def(name).node_def
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            yield by_name, node
            for attr in node.attr.values():
                todo += [attr.func.name] if attr.func.name else [f.name for f in attr.list.func]


def executed_nodes(program) -> Iterator[tuple[dict, object]]:
    """``function_nodes`` of what TF ran for ``program`` (a ``ConcreteFunction`` called at
    least once on DTensors): its SPMD-expanded functions, callees included."""
    prefix = program.name.decode() + "__func_"
    return function_nodes([name for name in context.context().list_function_names() if name.startswith(prefix)])


def combined_all_reduce_pieces(program) -> list[tuple[str, int, int]]:
    """(name, offset, elements) of each tensor TF DTensor slices back out of a combined
    all-reduce (``dtensor_allreduce_combine_optimization.cc``) in what it ran for ``program``.
    TF shares a piece whose offset is a multiple of 64 bytes and copies any other."""
    pieces = []
    for by_name, node in executed_nodes(program):
        if node.op == "Slice" and node.name.endswith("PostCombinedReduceSlice"):
            begin, size = (int(tf.make_ndarray(by_name[ref.split(":")[0]].attr["value"].tensor)[0])
                           for ref in node.input[1:3])
            pieces.append((node.name, begin, size))
    return pieces


def partition_graphs(run) -> list:
    """The per-device graphs TF instantiated while ``run()`` ran, after its graph optimisations
    (``GraphDef``s from the eager context's run metadata); a function instantiated before ``run``
    and only called again is not among them. The metadata may also hold graphs of other programs
    TF instantiated earlier in the process: pick a program's own by a name scope only it has."""
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        run()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return [g for function in metadata.function_graphs for g in function.partition_graphs]
