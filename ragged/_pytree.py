"""The one place that fixes ragged's optree namespace.

Every flatten / map in ragged goes through :data:`pytree`, so custom nodes registered
under the ``"ragged"`` namespace (DBuffer, optimizer states) are always seen as nodes.
"""

import ast
import re
from collections.abc import Mapping

import optree

from ragged._errors import RaggedValueError

pytree = optree.pytree.reexport(namespace="ragged", module="ragged.pytree")


def keystr(accessor) -> str:
    """Formats an optree accessor as a key path such as ``['layers'][0]['w']``."""
    text = accessor.codify("")
    return text if text else "<root>"


def flatten_with_keystr(tree):
    """Flattens ``tree`` and returns ``(key path strings, leaves, treedef)``."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree, namespace="ragged")
    return [keystr(a) for a in accessors], leaves, treedef


_TOKEN = re.compile(r"\[((?:'(?:[^'\\]|\\.)*')|(?:\"(?:[^\"\\]|\\.)*\")|[^\]]*)\]|\.([A-Za-z_]\w*)")


def path_parts(path: str) -> list[str]:
    """Splits a key path such as ``['layers'][0].mu['w']`` into ``['layers', '0', 'mu', 'w']``.

    A string key that is itself a key path (FSDP units plan ``{key path: tensor}`` trees) is
    split too.

    Examples:
        >>> from ragged._pytree import path_parts
        >>> path_parts("['layers'][0].mu['w']")
        ['layers', '0', 'mu', 'w']
        >>> path_parts('''["['layers'][0]"]["['layers'][0]['w']"]''')
        ['layers', '0', 'layers', '0', 'w']
    """
    if path == "<root>":
        return []
    parts, pos = [], 0
    while pos < len(path):
        match = _TOKEN.match(path, pos)
        if match is None:
            raise RaggedValueError(f"cannot parse key path {path!r} at position {pos}.")
        bracket, attr = match.groups()
        if attr is not None:
            parts.append(attr)
        else:
            try:
                value = ast.literal_eval(bracket)
            except (ValueError, SyntaxError):
                value = bracket
            if isinstance(value, str) and value.startswith("["):
                try:  # a key that is itself a key path (plans over {path: tensor} trees)
                    parts.extend(path_parts(value))
                    pos = match.end()
                    continue
                except ValueError:
                    pass
            parts.append(str(value))
        pos = match.end()
    return parts


def key_mismatch(prefix, full, *, prefix_name: str, full_name: str) -> str | None:
    """Where a would-be prefix tree and the full tree have different dict keys, in words that
    say which tree has which keys (optree's own message calls the prefix's extra keys
    "missing"); None when the trees differ in some other way.

    Examples:
        >>> key_mismatch({"w": 1, "x": 2}, {"w": 1, "b": 2}, prefix_name="specs", full_name="params")
        "specs has key(s) ['x'] that params does not have, and params has key(s) ['b'] that specs does not cover"
        >>> key_mismatch({"l": [{"a": 1}]}, {"l": [{"b": 1}]}, prefix_name="specs", full_name="params")
        "specs['l'][0] has key(s) ['a'] that params['l'][0] does not have, and params['l'][0] has key(s) ['b'] that specs['l'][0] does not cover"
    """
    def leaf(x):
        return optree.tree_is_leaf(x, none_is_leaf=True, namespace="ragged")

    def walk(p, f, path):
        if leaf(p) or leaf(f):
            return None
        if isinstance(p, Mapping) and isinstance(f, Mapping):
            extra = sorted(set(p) - set(f), key=repr)
            lacking = sorted(set(f) - set(p), key=repr)
            said = [f"{prefix_name}{path} has key(s) {extra} that {full_name}{path} does not have"] if extra else []
            if lacking:
                said.append(f"{full_name}{path} has key(s) {lacking} that {prefix_name}{path} does not cover")
            if said:
                return ", and ".join(said)
            pairs = [(p[k], f[k], f"{path}[{k!r}]") for k in f]
        else:
            p_children, _, p_entries, _ = optree.tree_flatten_one_level(p, none_is_leaf=True, namespace="ragged")
            f_children, _, f_entries, _ = optree.tree_flatten_one_level(f, none_is_leaf=True, namespace="ragged")
            if type(p) is not type(f) or p_entries != f_entries:
                return None
            pairs = [(a, b, f"{path}[{e!r}]") for a, b, e in zip(p_children, f_children, f_entries)]
        for a, b, sub in pairs:
            said = walk(a, b, sub)
            if said:
                return said
        return None

    return walk(prefix, full, "")
