"""Checking a state tree read from a manifest, and building the state back from it.

:func:`check_tree` walks a tree without recursion before anything is built from it;
:func:`unflatten_state` then builds the values, the types stored by name only from the fixed
lists of :mod:`coci_core.engine.format.tree_nodes` (OmegaConf's configs with
``OmegaConf.create`` when omegaconf is installed, else their plain content).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import importlib
import logging
import math
import pathlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from coci_core.engine.format.int_lists import base64_problem, check_ints, decode_ints
from coci_core.engine.format.tree_nodes import (
    CLASSES,
    CONFIG_FLAGS,
    CONFIG_TYPES,
    LEAF_TAGS,
    MAX_INT64,
    MAX_TREE_DEPTH,
    NODE_FIELDS,
    NONFINITE,
    NP_SCALAR_DTYPES,
    PATH_TYPES,
    SUPPORTED_DTYPES,
    WRAPPER_TAGS,
    decode_dtype,
    is_scalar,
)
from coci_core.errors import CorruptCheckpointError

__all__ = ["build_wrapped", "check_tree", "unflatten_state"]

logger = logging.getLogger(__name__)

# a wrapper's content: the container node it must be (by the wrapper's "type")
_WRAPPED = {"DictConfig": "dict", "ListConfig": "list", "namespace": "dict"}


def _import_omegaconf() -> Any:
    """omegaconf, when it is installed (imported by this fixed name only), else None."""
    try:
        return importlib.import_module("omegaconf")
    except ImportError:
        return None


_warned_no_omegaconf = False


def _without_omegaconf(what: str) -> None:
    global _warned_no_omegaconf
    if not _warned_no_omegaconf:
        _warned_no_omegaconf = True
        logger.warning(
            "coci: the checkpoint holds %s, and omegaconf is not installed: it comes back as "
            "plain dicts and lists (pip install omegaconf to get the DictConfig back)",
            what,
        )


def _make_config(kind: str, content: Any, flags: Mapping[str, bool]) -> Any:
    """A ``DictConfig``/``ListConfig`` built back from its stored content and flags (the plain
    content when omegaconf is not installed)."""
    if type(content) is not (dict if kind == "DictConfig" else list):
        raise CorruptCheckpointError(f"a stored {kind} holds a {type(content).__name__}")
    omegaconf = _import_omegaconf()
    if omegaconf is None:
        _without_omegaconf(f"an OmegaConf {kind}")
        return content
    try:
        conf = omegaconf.OmegaConf
        config = conf.create(content)
        if "struct" in flags:  # before readonly, which would refuse it
            conf.set_struct(config, flags["struct"])
        if "readonly" in flags:
            conf.set_readonly(config, flags["readonly"])
    except Exception as e:  # omegaconf's own errors (a bad key or interpolation)
        raise CorruptCheckpointError(f"a stored {kind} does not build: {e}") from e
    return config


def _make_namespace(content: Any) -> argparse.Namespace:
    if type(content) is not dict or not all(type(k) is str for k in content):
        raise CorruptCheckpointError("a stored argparse.Namespace holds no str-keyed dict")
    return argparse.Namespace(**content)


def _make_path(name: str, text: str) -> pathlib.PurePath:
    cls: type[pathlib.PurePath] = getattr(pathlib, name)  # one of PATH_TYPES (checked)
    try:
        return cls(text)
    except NotImplementedError:  # a concrete path of another OS: its pure form
        pure = pathlib.PureWindowsPath if name == "WindowsPath" else pathlib.PurePosixPath
        return pure(text)


def _make_class(name: str) -> Any:
    if name == "argparse.Namespace":
        return argparse.Namespace
    omegaconf = _import_omegaconf()
    short = name.removeprefix("omegaconf.")
    if omegaconf is None:  # Lightning reads a str type as "its own AttributeDict"
        _without_omegaconf(f"the class {name}")
        return short
    return getattr(omegaconf, short)


def unflatten_state(tree: Any, leaves: list[Any], *, checked: bool = False) -> Any:
    """Rebuild a state from its JSON tree; ``leaves[i]`` is the restored value of leaf ``i``.
    ``checked``: the tree already passed :func:`check_tree` for ``len(leaves)`` arrays (a
    tree of a parsed manifest), so it is not walked twice.

    Raises:
        CorruptCheckpointError: the tree is malformed (checked first, without recursion).
    """
    if not checked:
        check_tree(tree, n_leaves=len(leaves))
    return _decode(tree, leaves)


def check_tree(
    tree: Any,
    *,
    n_leaves: int,
    kinds: Any = None,
    keys: Any = None,
    what: str = "tree",
    ints: bool = True,
) -> None:
    """Check a state tree from a manifest without recursion, before anything is built from it.

    Every node must be of a known type with exactly its fields, of the right JSON types;
    containers may nest at most :data:`MAX_TREE_DEPTH` deep; every array node must name one of
    the ``n_leaves`` arrays. With ``kinds`` (the arrays' kinds) an array node must have its
    array's kind (a repeated node, a tied tensor, is ``"tensor"``). With ``keys`` (the arrays'
    keys, as a manifest records them) the arrays must appear in the order the state was
    flattened, each first at the path its key names, and every array must appear. ``ints``:
    whether ``ints`` nodes (long lists of ints, manifest format 5) may appear (not in a manifest
    of an earlier format).

    Raises:
        CorruptCheckpointError: naming the path of the first bad node.
    """
    next_id = 0
    path = ""

    def bad(why: str) -> CorruptCheckpointError:  # the node at ``path``
        return CorruptCheckpointError(f"{_at(what, path)}: {why}")

    # (node, its path, the depth of the container holding it)
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if is_scalar(node):
            if type(node) is float and not math.isfinite(node):
                raise bad("a non-finite number")
            continue
        if type(node) is not dict or type(node.get("t")) is not str:
            raise bad(f"not a tree node ({type(node).__name__})")
        tag = node["t"]
        fields = NODE_FIELDS.get(tag)
        if fields is None:
            raise bad(f"unknown state tree node type {tag[:40]!r}")
        required, optional = fields
        present = set(node) - {"t"}
        if not required <= present or not present <= required | optional:
            raise bad(
                f"a {tag!r} node has fields {sorted(present)[:8]}, "
                f"expected {sorted(required)} (and optionally {sorted(optional)})"
            )
        value = node.get("v")
        if tag in LEAF_TAGS:
            i = node["id"]
            if type(i) is not int or not 0 <= i < n_leaves:
                raise bad(f"array id {str(i)[:40]} is not one of the {n_leaves} arrays")
            if kinds is not None and kinds[i] != tag:
                raise bad(f"array {i} is a {kinds[i]}, not a {tag}")
            if keys is not None:
                if i == next_id:
                    if keys[i] != path:
                        raise bad(f"array {i} is stored as {str(keys[i])[:200]!r}")
                    next_id += 1
                elif i > next_id or tag != "tensor":
                    raise bad(f"array {i} out of order (array {next_id} comes next)")
        elif tag == "ints":
            if not ints:
                raise bad("an 'ints' node, which this manifest's format does not have")
            why = check_ints(node)
            if why is not None:
                raise bad(why)
        elif tag == "float":
            if type(value) is not str or value not in NONFINITE:
                raise bad(f"a float node holds {str(value)[:40]!r}")
        elif tag == "np":
            inner = node["v"]
            dtype = node["dtype"]
            if (
                type(dtype) is not str
                or dtype not in NP_SCALAR_DTYPES
                or not (
                    type(inner) in (bool, int, float)
                    or (type(inner) is dict and inner.get("t") == "float")
                )
            ):
                raise bad("a numpy scalar node is malformed")
            stack.append((inner, path, depth))
        elif tag == "dtype":
            if type(value) is not str or value not in SUPPORTED_DTYPES:
                raise bad(f"unknown dtype {str(value)[:40]!r}")
        elif tag == "size":
            if type(value) is not list or not all(
                type(x) is int and 0 <= x <= MAX_INT64 for x in value
            ):
                raise bad("a torch.Size node is malformed")
        elif tag == "bytes":
            if type(value) is not str:
                raise bad("a bytes node holds no string")
            why = base64_problem(value)
            if why is not None:
                raise bad(f"a bytes node's v {why}")
        elif tag == "path":
            if node["type"] not in PATH_TYPES or type(value) is not str:
                raise bad("a path node is malformed")
        elif tag == "class":
            if value not in CLASSES:
                raise bad(f"class {str(value)[:80]!r} is not stored")
        elif tag in WRAPPER_TAGS:
            _check_wrapper(node, _at(what, path))
            if depth + 1 > MAX_TREE_DEPTH:
                raise bad(f"nested more than {MAX_TREE_DEPTH} deep")
            stack.append((value, path, depth + 1))
        else:  # containers
            if depth + 1 > MAX_TREE_DEPTH:
                raise bad(f"nested more than {MAX_TREE_DEPTH} deep")
            children: list[tuple[Any, str, int]] = []
            if tag in ("list", "tuple"):
                if type(value) is not list:
                    raise bad(f"a {tag} node holds no list")
                children = [(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
            elif ("v" in node) == ("items" in node):
                raise bad("a dict node needs 'v' or 'items'")
            elif "v" in node:
                if type(value) is not dict:
                    raise bad("a dict node's 'v' is no object")
                children = [(v, f"{path}/{k}", depth + 1) for k, v in value.items()]
            else:
                items = node["items"]
                if type(items) is not list or not all(
                    type(kv) is list and len(kv) == 2 for kv in items
                ):
                    raise bad("a dict node's 'items' are malformed")
                for k, v in items:
                    _check_key(k, what, path, depth + 1)
                    children.append((v, f"{path}/{_decode_key(k)}", depth + 1))
            if "metadata" in node:
                children.append((node["metadata"], f"{path}/_metadata", depth + 1))
            stack.extend(reversed(children))
    if keys is not None and next_id != n_leaves:
        raise CorruptCheckpointError(
            f"{what}: holds {next_id} of its {n_leaves} arrays (array {next_id} is not in it)"
        )


def _at(what: str, path: str) -> str:
    """The name of a tree node in an error message (built only when a check fails)."""
    return f"{what} at {path[:200] or '/'!r}"


def build_wrapped(node: Mapping[str, Any], content: Any) -> Any:
    """The value of a checked ``config`` or ``namespace`` node (see :data:`WRAPPER_TAGS`),
    from its content, already built.

    Raises:
        CorruptCheckpointError: the content does not build one.
    """
    if node["t"] == "config":
        return _make_config(node["type"], content, node.get("flags", {}))
    return _make_namespace(content)


def _check_wrapper(node: dict[str, Any], where: str) -> None:
    """A config or namespace node: a known type, known flags, and a container of its kind."""
    kind = node["type"] if node["t"] == "config" else "namespace"
    if node["t"] == "config" and kind not in CONFIG_TYPES:
        raise CorruptCheckpointError(f"{where}: config type {str(kind)[:40]!r} is not stored")
    flags = node.get("flags", {})
    if type(flags) is not dict or not all(
        f in CONFIG_FLAGS and type(v) is bool for f, v in flags.items()
    ):
        raise CorruptCheckpointError(f"{where}: a config node's flags are malformed")
    content = node["v"]
    if type(content) is not dict or content.get("t") != _WRAPPED[kind]:
        raise CorruptCheckpointError(f"{where}: a {kind} node holds no {_WRAPPED[kind]} node")


def _check_key(k: Any, what: str, path: str, depth: int) -> None:
    """A dict key of the "items" form: a scalar, or a tuple of keys (nesting counts as depth)."""
    if is_scalar(k) and not (type(k) is float and not math.isfinite(k)):
        return
    where = _at(what, path)
    stack = [(k, depth)]
    while stack:
        item, d = stack.pop()
        if is_scalar(item):
            if type(item) is float and not math.isfinite(item):
                raise CorruptCheckpointError(f"{where}: a non-finite dict key")
            continue
        if type(item) is not dict or item.get("t") != "tuple" or set(item) != {"t", "v"}:
            raise CorruptCheckpointError(f"{where}: a dict key must be a scalar or a tuple")
        if type(item["v"]) is not list:
            raise CorruptCheckpointError(f"{where}: a tuple key holds no list")
        if d + 1 > MAX_TREE_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested more than {MAX_TREE_DEPTH} deep")
        stack.extend((x, d + 1) for x in item["v"])


def _decode(node: Any, leaves: list[Any]) -> Any:
    # The tree was checked by check_tree: only values still need checking here.
    if is_scalar(node):
        return node
    tag = node["t"]
    try:
        if tag in LEAF_TAGS:
            return leaves[node["id"]]
        if tag == "ints":
            return decode_ints(node)
        if tag == "float":
            return NONFINITE[node["v"]]
        if tag == "np":
            return np.dtype(node["dtype"]).type(_decode(node["v"], leaves))
        if tag == "dtype":
            return decode_dtype(node["v"])
        if tag == "size":
            return torch.Size(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"], validate=True)
        if tag == "list":
            return [_decode(v, leaves) for v in node["v"]]
        if tag == "tuple":
            return tuple(_decode(v, leaves) for v in node["v"])
        if tag in ("dict", "odict"):
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            if "v" in node:
                for k, v in node["v"].items():
                    out[k] = _decode(v, leaves)
            else:
                for k, v in node["items"]:
                    out[_decode_key(k)] = _decode(v, leaves)
            if "metadata" in node:
                out._metadata = _decode(node["metadata"], leaves)  # type: ignore[attr-defined]
            return out
        if tag in WRAPPER_TAGS:
            return build_wrapped(node, _decode(node["v"], leaves))
        if tag == "path":
            return _make_path(node["type"], node["v"])
        if tag == "class":
            return _make_class(node["v"])
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, binascii.Error) as e:
        raise CorruptCheckpointError(f"malformed state tree node {tag!r}: {e}") from e
    raise CorruptCheckpointError(f"unknown state tree node type {str(tag)[:40]!r}")


def _decode_key(k: Any) -> Any:
    if isinstance(k, dict) and k.get("t") == "tuple":
        return tuple(_decode_key(x) for x in k["v"])
    return k
