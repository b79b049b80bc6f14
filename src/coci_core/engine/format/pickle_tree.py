"""How big and how deep the object tree of a pickle is, found without unpickling it.

A pickle can name one object many times (its memo): unpickling shares the object, but whatever
walks the result as a tree (hashing a tuple used as a key, comparing, copying, saving it) pays
for every reference again, so a few kilobytes can describe a tree of billions of nodes; and
CPython hashes and compares nested tuples recursively in C, so a deep enough one crashes the
interpreter while it is unpickled. :func:`pickle_tree` reads the opcodes with
:mod:`pickletools` (nothing is built, nothing is called, no global is resolved), follows the
stack and the memo, and measures the tree with every shared reference counted again: the
importer refuses a pickle whose tree is larger than what its files justify before unpickling.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

__all__ = ["PickleTree", "pickle_tree", "pickle_tree_from"]

# Opcodes that push one new object whose size is the length of their argument (strings, bytes)
_SIZED = frozenset(
    {
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "UNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "PERSID",
    }
)
# Opcodes that push one new object of size 1 (numbers, constants, empty containers, globals:
# a global is a name looked up, never walked or copied)
_ATOMS = frozenset(
    {
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "FLOAT",
        "BINFLOAT",
        "EMPTY_LIST",
        "EMPTY_TUPLE",
        "EMPTY_DICT",
        "EMPTY_SET",
        "GLOBAL",
        "EXT1",
        "EXT2",
        "EXT4",
        "NEXT_BUFFER",
    }
)
# Opcodes that pop a fixed number of objects and push one made of them
_MAKES = {
    "TUPLE1": 1,
    "TUPLE2": 2,
    "TUPLE3": 3,
    "REDUCE": 2,
    "NEWOBJ": 2,
    "NEWOBJ_EX": 3,
    "BINPERSID": 1,
}
# Opcodes that pop the objects above the last mark and push one made of them
# (INST: a class named by its argument, called with those objects)
_MAKES_FROM_MARK = frozenset({"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"})
# Opcodes that pop the objects above the last mark into the container below the mark
_ADDS_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
# Opcodes that pop a fixed number of objects into the container below them
_ADDS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


@dataclass(frozen=True)
class PickleTree:
    """The tree a pickle describes: ``size`` objects (strings and bytes count their length),
    ``depth`` levels; each at most ``cap + 1`` (a reference cycle is an endless tree)."""

    size: int
    depth: int


class _Graph:
    """The objects a pickle makes (by number) and what each refers to."""

    def __init__(self) -> None:
        self.weight: list[int] = []
        self.refs: list[list[int]] = []

    def new(self, weight: int, refs: list[int] | None = None) -> int:
        self.weight.append(weight)
        self.refs.append(refs if refs is not None else [])
        return len(self.weight) - 1


def pickle_tree(data: bytes, cap: int) -> PickleTree:
    """The size and depth of the object tree that unpickling ``data`` gives, counting each
    shared reference again; a count beyond ``cap`` stops there (``cap + 1``).

    Raises:
        ValueError: ``data`` is not a well-formed pickle (it would not unpickle either).
    """
    graph = _Graph()
    root = _follow(data, graph)
    return _measure(graph, root, cap)


def pickle_tree_from(stream: IO[bytes], cap: Callable[[int], int]) -> tuple[PickleTree, int]:
    """:func:`pickle_tree` of the pickle that starts at ``stream``'s position, and its length
    in bytes; the stream is left just after its STOP (where the next pickle of a stream of
    pickles starts), and ``cap(length)`` is the cap.

    Raises:
        ValueError: the stream holds no well-formed pickle there.
    """
    start = stream.tell()
    graph = _Graph()
    root = _follow(stream, graph)
    length = stream.tell() - start
    return _measure(graph, root, cap(length)), length


def _ops(data: bytes | IO[bytes]) -> Iterator[tuple[Any, Any]]:
    """``pickletools.genops``'s opcodes and arguments. A string opcode of garbled bytes with an
    invalid escape makes Python warn (DeprecationWarning); where warnings are errors that
    warning is raised here as the damage it is (ValueError), not as a warning."""
    ops = pickletools.genops(data)
    while True:
        try:
            op, parsed, _ = next(ops)
        except StopIteration:
            return
        except Warning as e:
            raise ValueError(f"a string in the pickle is garbled ({e})") from e
        yield op, parsed


def _follow(data: bytes | IO[bytes], graph: _Graph) -> int:
    """Run the pickle's stack machine on object numbers; the number of the object it returns."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}

    def pop(n: int) -> list[int]:
        floor = marks[-1] if marks else 0
        if len(stack) - n < floor:
            raise ValueError("the pickle pops more than its stack holds")
        items = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        return items

    def pop_mark() -> list[int]:
        if not marks:
            raise ValueError("the pickle pops to a mark it never set")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def top() -> int:
        if len(stack) <= (marks[-1] if marks else 0):
            raise ValueError("the pickle uses an object its stack does not hold")
        return stack[-1]

    for op, parsed in _ops(data):
        name, arg = op.name, cast(Any, parsed)  # its type is the opcode's
        if name in _ATOMS:
            stack.append(graph.new(1))
        elif name in _SIZED:
            stack.append(graph.new(1 + len(arg)))
        elif name == "STACK_GLOBAL":  # a global named by two strings: as GLOBAL
            pop(2)
            stack.append(graph.new(1))
        elif name in _MAKES:
            stack.append(graph.new(1, pop(_MAKES[name])))
        elif name in _MAKES_FROM_MARK:
            stack.append(graph.new(1, pop_mark()))
        elif name in _ADDS_FROM_MARK:
            items = pop_mark()
            graph.refs[top()].extend(items)
        elif name in _ADDS:
            items = pop(_ADDS[name])
            graph.refs[top()].extend(items)
        elif name in _GETS:
            if arg not in memo:
                raise ValueError(f"the pickle reads memo entry {arg}, which it never wrote")
            stack.append(memo[arg])
        elif name in _PUTS:
            memo[arg] = top()
        elif name == "MEMOIZE":
            memo[len(memo)] = top()
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "POP":
            if marks and len(stack) == marks[-1]:
                marks.pop()  # what CPython's unpickler does: POP right after MARK drops it
            else:
                pop(1)
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(top())
        elif name == "STOP":
            return top()
        elif name not in ("PROTO", "FRAME", "READONLY_BUFFER"):  # pragma: no cover - all known
            raise ValueError(f"the pickle has the unknown opcode {name}")
    raise ValueError("the pickle has no STOP")  # pragma: no cover - genops raises first


def _measure(graph: _Graph, root: int, cap: int) -> PickleTree:
    """Size and depth of the tree below ``root`` (post-order, each object measured once)."""
    size: list[int] = [-1] * len(graph.weight)  # -1: not yet, -2: being measured
    depth: list[int] = [0] * len(graph.weight)
    endless = PickleTree(cap + 1, cap + 1)
    todo: list[tuple[int, int]] = [(root, 0)]
    size[root] = -2
    while todo:
        node, i = todo[-1]
        refs = graph.refs[node]
        if i < len(refs):
            todo[-1] = (node, i + 1)
            ref = refs[i]
            if size[ref] == -2:
                return endless  # a reference cycle
            if size[ref] == -1:
                size[ref] = -2
                todo.append((ref, 0))
            continue
        todo.pop()
        total, deepest = graph.weight[node], 0
        for ref in refs:
            total = min(cap + 1, total + size[ref])
            deepest = max(deepest, depth[ref])
        size[node], depth[node] = total, min(cap + 1, deepest + 1)
        if total > cap:
            return PickleTree(total, depth[node])
    return PickleTree(size[root], depth[root])
