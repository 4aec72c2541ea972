"""MIB's circuit-track file format: the graph of a model's nodes and edges, and the check
every file we write or read passes (``check_mib``, ``read_mib``) — what MIB's own loader
would accept, without MIB installed."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.common.files import read_json
from lm_eval_headloc.common.words import counted

__all__ = ["ExportError", "MibFormatError", "check_mib", "is_mib_edge", "mib_node_names",
           "read_mib"]


_CFG_INTS = ("n_layers", "n_heads", "d_model")
_NUMBER = re.compile(r"0|[1-9][0-9]*")  # MIB's node names have no leading zeros
_HEAD_NODE = re.compile(rf"a({_NUMBER.pattern})\.h({_NUMBER.pattern})")
_MLP_NODE = re.compile(rf"m({_NUMBER.pattern})")
_EDGE = re.compile(r"(?P<parent>[^<>]+?)->(?P<child>[^<>]+?)(?:<(?P<qkv>[qkv])>)?")


class ExportError(UserError):
    """A run or an output path that cannot be exported (reported in one line)."""


class MibFormatError(ExportError):
    """A file or object that MIB's loader would not read as this format."""


def mib_node_names(n_layers: int, n_heads: int) -> list[str]:
    """Every node of MIB's graph of a model, in ``Graph.from_model``'s order: ``input``,
    then per layer its heads ``a{l}.h{h}`` and its MLP ``m{l}``, then ``logits``."""
    names = ["input"]
    for layer in range(n_layers):
        names += [f"a{layer}.h{head}" for head in range(n_heads)]
        names.append(f"m{layer}")
    return [*names, "logits"]


def _stage(node: str, n_layers: int, n_heads: int, parallel: bool) -> tuple[str, int] | None:
    """A node's kind and its place in the forward pass (a parent writes into every later
    place), or None if the graph has no such node. In sequence, layer l's heads read the
    residual stream before its MLP, which also reads them; in parallel both read the same
    stream."""
    if node == "input":
        return "input", -1
    if node == "logits":
        return "logits", 2 * n_layers
    if (match := _HEAD_NODE.fullmatch(node)) is not None:
        layer, head = int(match.group(1)), int(match.group(2))
        if layer < n_layers and head < n_heads:
            return "head", layer if parallel else 2 * layer
    elif (match := _MLP_NODE.fullmatch(node)) is not None:
        layer = int(match.group(1))
        if layer < n_layers:
            return "mlp", layer if parallel else 2 * layer + 1
    return None


def is_mib_edge(name: str, n_layers: int, n_heads: int, parallel_attn_mlp: bool = False
                ) -> bool:
    """Whether ``name`` is an edge of MIB's graph of the model (``Graph.from_model``): every
    node writes into every later head (once per input, ``<q>``, ``<k>``, ``<v>``), MLP and
    the logits."""
    match = _EDGE.fullmatch(name)
    if match is None:
        return False
    parent = _stage(match.group("parent"), n_layers, n_heads, parallel_attn_mlp)
    child = _stage(match.group("child"), n_layers, n_heads, parallel_attn_mlp)
    if parent is None or child is None or parent[0] == "logits" or child[0] == "input":
        return False
    if (child[0] == "head") != (match.group("qkv") is not None):
        return False  # an edge into a head names the head's input; no other edge does
    return parent[1] < child[1]


def _is_number(value: object) -> bool:
    # NaN is a number here: Graph.to_json writes an unscored node's NaN score as it is.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_cfg(cfg: object) -> dict[str, Any]:
    if not isinstance(cfg, Mapping):
        raise MibFormatError("'cfg' must be an object with n_layers, n_heads, d_model and "
                             f"parallel_attn_mlp, not {type(cfg).__name__}")
    for key in _CFG_INTS:
        value = cfg.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise MibFormatError(f"cfg {key} must be a whole number >= 1 (MIB's loader "
                                 f"builds the model's graph from it), not {value!r}")
    if not isinstance(cfg.get("parallel_attn_mlp"), bool):
        raise MibFormatError("cfg parallel_attn_mlp must be true or false, not "
                             f"{cfg.get('parallel_attn_mlp')!r}")
    return dict(cfg)


def _check_node(name: str, entry: object, d_model: int) -> bool:
    """Check one node's entry as ``Graph.from_json`` reads it; returns whether it has a
    score."""
    if not isinstance(entry, Mapping):
        raise MibFormatError(f"node {name!r} must be an object with 'in_graph', not "
                             f"{type(entry).__name__}")
    if not isinstance(entry.get("in_graph"), bool):
        raise MibFormatError(f"node {name!r} needs 'in_graph' true or false (MIB's loader "
                             f"reads it for every node but logits), not "
                             f"{entry.get('in_graph')!r}")
    if "score" in entry and not _is_number(entry["score"]):
        raise MibFormatError(f"node {name!r} has score {entry['score']!r}; a score is a "
                             "number (leave the key out for an unscored node)")
    for key in ("neurons", "neurons_scores"):
        values = entry.get(key)
        if key in entry and not (isinstance(values, list) and len(values) == d_model
                                 and all(_is_number(v) or isinstance(v, bool)
                                         for v in values)):
            raise MibFormatError(f"node {name!r}: {key} must be a list of {d_model} numbers "
                                 "(one per d_model dimension)")
    return "score" in entry


def check_mib(obj: object, *, complete: bool = True, node_scores: bool = True) -> None:
    """Raise ``MibFormatError`` (one line) unless MIB's loader reads ``obj`` as a graph.

    The loader's checks (``Graph.from_json``, with ``Graph.from_model`` building the graph
    from ``cfg``): the keys ``cfg``, ``nodes`` and ``edges``; ``cfg``'s four values; every
    node and edge named one of the graph's (``is_mib_edge``), each node but ``logits``
    with a boolean ``in_graph`` and, where given, a numeric ``score`` (and ``neurons`` /
    ``neurons_scores`` of ``d_model`` numbers), each edge with a numeric ``score`` and a
    boolean ``in_graph``. Besides, ``complete`` asks for every node but ``logits`` (the
    loader would leave a missing one unscored, which is how ``Graph.to_json`` never writes
    a file) and ``node_scores`` for at least one scored node (node-level evaluation
    asserts that the graph has node scores).
    """
    if not isinstance(obj, Mapping):
        raise MibFormatError(f"a MIB graph is a JSON object, not {type(obj).__name__}")
    missing = [key for key in ("cfg", "nodes", "edges") if key not in obj]
    if missing:
        raise MibFormatError(f"missing key(s) {', '.join(missing)}: a MIB graph has cfg, "
                             "nodes and edges")
    cfg = _check_cfg(obj["cfg"])
    layers, heads, d_model = (cfg[key] for key in _CFG_INTS)
    parallel = cfg["parallel_attn_mlp"]
    nodes, edges = obj["nodes"], obj["edges"]
    if not isinstance(nodes, Mapping) or not isinstance(edges, Mapping):
        raise MibFormatError("'nodes' and 'edges' must be JSON objects keyed by name")
    scored = False
    for name, entry in nodes.items():
        if not isinstance(name, str) or _stage(name, layers, heads, parallel) is None:
            raise MibFormatError(
                f"unknown node {name!r} for cfg n_layers={layers}, n_heads={heads}: nodes "
                f"are input, a{{0..{layers - 1}}}.h{{0..{heads - 1}}}, m{{0..{layers - 1}}} "
                "and logits")
        if name != "logits":  # the loader skips logits' entry
            scored = _check_node(name, entry, d_model) or scored
    if complete:
        absent = [name for name in mib_node_names(layers, heads)[:-1] if name not in nodes]
        if absent:
            raise MibFormatError(f"{counted(len(absent), 'node')} missing, first {absent[0]!r}: "
                                 "Graph.to_json writes every node of the graph")
    if node_scores and not scored:
        raise MibFormatError("no node has a score; MIB's node-level evaluation needs node "
                             "scores")
    for name, entry in edges.items():
        if not (isinstance(name, str) and is_mib_edge(name, layers, heads, parallel)):
            raise MibFormatError(f"{name!r} is not an edge of the graph of cfg "
                                 f"n_layers={layers}, n_heads={heads}, "
                                 f"parallel_attn_mlp={str(parallel).lower()}")
        if not (isinstance(entry, Mapping) and _is_number(entry.get("score"))
                and isinstance(entry.get("in_graph"), bool)):
            raise MibFormatError(f"edge {name!r} needs a numeric 'score' and 'in_graph' true "
                                 "or false")


def read_mib(path: str | Path, *, complete: bool = True, node_scores: bool = True
             ) -> dict[str, Any]:
    """A MIB importance file (``.json``), checked by ``check_mib``; errors name the
    file."""
    if not isinstance(path, (str, os.PathLike)):  # pathlib's TypeError names no argument
        raise MibFormatError(f"a MIB file is a path (e.g. 'importances.json'), not {path!r}")
    path = Path(path)
    if path.suffix != ".json":
        raise MibFormatError(f"{path}: MIB reads a graph from a .json (or .pt) file by its "
                             "extension; this reads .json")
    if not path.exists():
        raise MibFormatError(f"{path}: no such file")
    data = read_json(path, MibFormatError)
    try:
        check_mib(data, complete=complete, node_scores=node_scores)
    except MibFormatError as err:
        raise MibFormatError(f"{path}: {err}") from None
    return data
